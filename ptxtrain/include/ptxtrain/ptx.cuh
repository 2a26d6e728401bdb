// ptxtrain/ptx.cuh — thin `asm volatile` wrappers, one per PTX instruction (docs/design.md §3).
//
// Every wrapper cites, by title, the PTX ISA section (ISA 9.0, CUDA 13.0) that defines its
// instruction. Header-only, no includes, so that NVRTC needs no CUDA toolkit headers.
//
// PTXTRAIN_AGGRESSIVE_PTX (default OFF): when defined, ld_nc_* use the read-only non-coherent
// path `ld.global.nc.L1::no_allocate.L2::256B`. Reading through `.nc` data that another SM or GPU
// writes while the kernel runs is undefined behaviour by the PTX memory model; DeepSeek found it
// correct on Hopper and kept it behind a switch (DISABLE_AGGRESSIVE_PTX_INSTRS). The default is
// a coherent `ld.relaxed.gpu.global` load.
#pragma once

namespace ptxtrain {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// 32-bit shared-state-space address of a generic pointer to shared memory, the form that the
// `.shared` operands below take (PTX ISA "Generic Addressing", `cvta`).
__device__ __forceinline__ u32 smem_addr(const void* ptr) {
  return static_cast<u32>(__cvta_generic_to_shared(ptr));
}

// ---- proxies and fences ----------------------------------------------------------------------

// Orders this thread's generic-proxy shared-memory writes before later async-proxy reads
// (TMA store, wgmma operand fetch). PTX ISA "membar / fence" (fence.proxy.async).
__device__ __forceinline__ void fence_proxy_async_shared_cta() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// ---- conversions -----------------------------------------------------------------------------

// Packs two floats into two E4M3 bytes, round to nearest even, saturating to ±448 (NaN stays
// NaN): `lo` lands in bits 0..7, `hi` in bits 8..15. PTX ISA "cvt" (.e4m3x2).
__device__ __forceinline__ u16 cvt_e4m3x2(float lo, float hi) {
  u16 out;
  asm volatile("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(out) : "f"(hi), "f"(lo));
  return out;
}

// Packs two floats into one bf16x2 word, round to nearest even: `lo` in bits 0..15, `hi` in bits
// 16..31 (the order of a little-endian pair of bf16 in memory). PTX ISA "cvt" (.bf16x2.f32).
__device__ __forceinline__ u32 cvt_bf16x2(float lo, float hi) {
  u32 out;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(out) : "f"(hi), "f"(lo));
  return out;
}

// Rounds one float to bf16 (round to nearest even); the 16 bits in the low half. PTX ISA "cvt".
__device__ __forceinline__ u16 cvt_bf16(float x) {
  u16 out;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(out) : "f"(x));
  return out;
}

// ---- warpgroup register reallocation -----------------------------------------------------------

// Raises / lowers the per-thread register budget of the executing warpgroup to N (24..256, a
// multiple of 8): producer warpgroups give registers to the math warpgroups.
// PTX ISA "setmaxnreg" (sm_90a).
template <u32 N>
__device__ __forceinline__ void setmaxnreg_inc() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: N must be in [24, 256], N % 8 == 0");
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

template <u32 N>
__device__ __forceinline__ void setmaxnreg_dec() {
  static_assert(N >= 24 && N <= 256 && N % 8 == 0, "setmaxnreg: N must be in [24, 256], N % 8 == 0");
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}

// ---- shared-memory matrix stores and named barriers --------------------------------------------

// Stores four 8x8 b16 matrices to shared memory: register q holds this thread's fragment of
// matrix q (row lane / 4, columns 2 (lane % 4) and + 1, the lower column in the low half, i.e.
// the layout of a wgmma accumulator's 8x8 block after packing), and lane 8q + i gives the
// shared address of row i of matrix q (16 contiguous bytes). PTX ISA "stmatrix" (sm_90).
__device__ __forceinline__ void stmatrix_x4(u32 smem_row, u32 r0, u32 r1, u32 r2, u32 r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_row),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}

// Barrier `id` (1..15; 0 is __syncthreads) among `threads` threads (a multiple of 32), e.g. the
// 128 threads of one warpgroup. PTX ISA "bar / barrier" (bar.sync with a thread count).
__device__ __forceinline__ void named_barrier_sync(u32 id, u32 threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// ---- programmatic dependent launch (sm_90) ---------------------------------------------------

// Waits until every grid this one depends on (the previous kernel on the stream, when this one
// was launched with programmatic stream serialization: ptxtrain.jit.BoundLaunch(programmatic=
// True)) has completed and its memory operations are visible; returns at once otherwise. A
// kernel launched that way executes it before its first global memory access (read or write).
// PTX ISA "griddepcontrol" (.wait).
__device__ __forceinline__ void grid_dependency_wait() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
}

// Lets the grids that depend on this one launch (once every CTA of this grid has executed it or
// exited) so their prologues overlap this grid's tail; they still wait for its completion in
// grid_dependency_wait. PTX ISA "griddepcontrol" (.launch_dependents).
__device__ __forceinline__ void grid_dependency_launch() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

// ---- thread-block clusters (sm_90) ------------------------------------------------------------

// This CTA's rank in its cluster. PTX ISA "Special Registers: %cluster_ctarank".
__device__ __forceinline__ u32 cluster_ctarank() {
  u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Every thread of every CTA of the cluster arrives, then waits for all (release / acquire at
// cluster scope). PTX ISA "barrier.cluster".
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// ---- global loads and stores -----------------------------------------------------------------

// 16-byte load for communication buffers. Aggressive: the non-coherent read-only path without
// L1 allocation and with a 256-byte L2 prefetch. Default: a coherent relaxed load at gpu scope.
// PTX ISA "ld" and "ld.global.nc".
__device__ __forceinline__ int4 ld_nc_v4(const int4* ptr) {
  int4 v;
#ifdef PTXTRAIN_AGGRESSIVE_PTX
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
#else
  asm volatile("ld.relaxed.gpu.global.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
#endif
  return v;
}

// 4-byte variant of ld_nc_v4 (same switch, same sections).
__device__ __forceinline__ float ld_nc_f32(const float* ptr) {
  float v;
#ifdef PTXTRAIN_AGGRESSIVE_PTX
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.f32 %0, [%1];\n" : "=f"(v) : "l"(ptr));
#else
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];\n" : "=f"(v) : "l"(ptr) : "memory");
#endif
  return v;
}

// 16-byte store that does not allocate in L1 (streamed output). PTX ISA "st".
__device__ __forceinline__ void st_na_v4(int4* ptr, int4 v) {
  asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// ---- flags between GPUs / SMs (PTX ISA "Memory Consistency Model") ------------------------

// Release store at system scope: writes before it are visible to a thread (on any GPU or the
// host) that reads the flag with ld_acquire_sys. PTX ISA "st" (.release.sys).
__device__ __forceinline__ void st_release_sys(int* ptr, int value) {
  asm volatile("st.release.sys.global.s32 [%0], %1;\n" ::"l"(ptr), "r"(value) : "memory");
}

// Acquire load at system scope, the reader's half of st_release_sys. PTX ISA "ld".
__device__ __forceinline__ int ld_acquire_sys(const int* ptr) {
  int v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// 64-bit st_release_sys / ld_acquire_sys, for flags that carry an epoch and a count. PTX ISA
// "st" / "ld" (.release.sys / .acquire.sys, .s64).
__device__ __forceinline__ void st_release_sys_64(long long* ptr, long long value) {
  asm volatile("st.release.sys.global.s64 [%0], %1;\n" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ long long ld_acquire_sys_64(const long long* ptr) {
  long long v;
  asm volatile("ld.acquire.sys.global.s64 %0, [%1];\n" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

}  // namespace ptxtrain
