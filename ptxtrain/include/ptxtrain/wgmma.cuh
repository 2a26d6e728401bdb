// ptxtrain/wgmma.cuh — warpgroup-level asynchronous MMA (sm_90a only; docs/design.md §3).
// PTX ISA "Asynchronous Warpgroup Level Matrix Multiply-Accumulate Instructions" (wgmma). In
// SASS the FP8 form shows as QGMMA.
//
// Operands A and B come from shared memory through 64-bit matrix descriptors (make_smem_desc);
// the accumulator lives in registers: for m64nNk32 each of the 128 threads holds N / 2 floats.
// Sequence: wgmma_fence(); mma_async(...) x k; wgmma_commit_group(); wgmma_wait_group<0>().
#pragma once

#include "ptx.cuh"

namespace ptxtrain {

// "wgmma.fence": orders register accesses to the accumulators before the first wgmma.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

// "wgmma.commit_group": closes the group of wgmma operations issued so far.
__device__ __forceinline__ void wgmma_commit_group() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// "wgmma.wait_group": waits until at most N committed groups are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait_group() {
  static_assert(N >= 0 && N <= 7, "wgmma_wait_group: N must be in [0, 7]");
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// Compiler-only fence on accumulator registers (no instruction): the registers may have been
// written behind the compiler's back (by an asynchronous wgmma), so no read of them is moved
// above this point and no write below it. Place after wgmma_wait_group, before reading them.
template <int N>
__device__ __forceinline__ void wgmma_fence_operand(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Swizzle modes of a shared-memory matrix descriptor (bits 62..63).
enum class SmemSwizzle : u32 { kNone = 0, kB128 = 1, kB64 = 2, kB32 = 3 };

// "Matrix Descriptor Format" (wgmma section): a 64-bit word describing a K-major tile in
// shared memory. Bits 0..13: start address >> 4; 16..29: leading-dimension byte offset >> 4;
// 32..45: stride-dimension byte offset >> 4; 49..51: base offset (0 for 1024-B aligned
// swizzled tiles); 62..63: swizzle mode. Byte offsets must be multiples of 16.
//
// Kernels that step through shared memory keep it as two 32-bit words: the high word (stride
// byte offset, swizzle: smem_desc_hi) is fixed per tile shape, and the low word holds the start
// address >> 4, so moving the tile by `bytes` (a multiple of 16) adds bytes >> 4 to it.
// Shared-memory addresses on sm_90 stay below 256 KB, so the 14-bit field never carries into
// the leading-byte-offset bits.
__host__ __device__ constexpr u32 smem_desc_hi(u32 stride_byte_offset, SmemSwizzle swizzle) {
  return ((stride_byte_offset >> 4) & 0x3FFFu) | ((static_cast<u32>(swizzle) & 0x3u) << 30);
}
__device__ __forceinline__ u64 smem_desc(u32 lo, u32 hi) {
  return (static_cast<u64>(hi) << 32) | lo;
}
__device__ __forceinline__ u64 make_smem_desc(const void* smem_ptr, u32 leading_byte_offset,
                                              u32 stride_byte_offset, SmemSwizzle swizzle) {
  const u32 lo =
      ((smem_addr(smem_ptr) >> 4) & 0x3FFFu) | (((leading_byte_offset >> 4) & 0x3FFFu) << 16);
  return smem_desc(lo, smem_desc_hi(stride_byte_offset, swizzle));
}

// "wgmma.mma_async" m64n128k32, FP32 accumulate, E4M3 x E4M3, both operands from shared memory.
// d[64] += A(64x32) . B(128x32)^T when accumulate != 0, else d = A . B^T.
__device__ __forceinline__ void wgmma_m64n128k32_f32_e4m3(float (&d)[64], u64 desc_a, u64 desc_b,
                                                          bool accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "setp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, p, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
        "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
        "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
        "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
        "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),
        "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
        "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(static_cast<u32>(accumulate)));
}

}  // namespace ptxtrain
