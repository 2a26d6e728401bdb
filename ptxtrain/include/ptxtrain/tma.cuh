// ptxtrain/tma.cuh — Tensor Memory Accelerator bulk tensor copies (sm_90; docs/design.md §3).
// PTX ISA "Data Movement and Conversion Instructions: cp.async.bulk.tensor".
//
// The tensor map (CUtensorMap, 128 bytes, 64-byte aligned) is built on the host with
// cuTensorMapEncodeTiled (ptxtrain.jit.launch.make_tma_2d_desc) and passed by value as a
// `const __grid_constant__ TmaDescriptor` kernel parameter, so its address is a param-space
// address the TMA unit can read.
#pragma once

#include "mbarrier.cuh"

namespace ptxtrain {

// Opaque host-encoded tensor map (same size and alignment as CUtensorMap).
struct alignas(64) TmaDescriptor {
  u64 opaque[16];
};

// "prefetch.tensormap": warms the descriptor cache line before the first copy.
__device__ __forceinline__ void tma_prefetch_desc(const TmaDescriptor* desc) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(desc) : "memory");
}

// 2D tiled load global -> shared completing on an mbarrier (complete_tx::bytes): the box at
// (c0 = inner coordinate, c1 = outer coordinate) lands at `smem_dst`; the barrier's phase must
// expect the box's bytes (mbarrier_arrive_expect_tx).
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const TmaDescriptor* desc, u64* bar,
                                            int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(smem_dst)),
      "l"(desc), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}

// 2D tiled load multicast to the CTAs of the cluster in `cta_mask` (bit i = CTA rank i): the
// box lands at the same shared-memory offset `smem_dst` in each of them and completes `bytes`
// on the mbarrier at offset `bar` in each. PTX ISA "cp.async.bulk.tensor" (.multicast::cluster,
// sm_90a).
__device__ __forceinline__ void tma_load_2d_multicast(void* smem_dst, const TmaDescriptor* desc,
                                                      u64* bar, int c0, int c1, u16 cta_mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(smem_addr(smem_dst)),
      "l"(desc), "r"(c0), "r"(c1), "r"(smem_addr(bar)), "h"(cta_mask)
      : "memory");
}

// 2D tiled store shared -> global, tracked by bulk async-groups. Call
// fence_proxy_async_shared_cta() between the shared-memory writes and this store.
__device__ __forceinline__ void tma_store_2d(const TmaDescriptor* desc, const void* smem_src, int c0,
                                             int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(
          desc),
      "r"(c0), "r"(c1), "r"(smem_addr(smem_src))
      : "memory");
}

// 2D tiled reduction shared -> global, D[box] += smem (element type of the tensor map, e.g.
// fp32), tracked by bulk async-groups like tma_store_2d. PTX ISA "cp.reduce.async.bulk.tensor"
// (.add).
__device__ __forceinline__ void tma_reduce_add_2d(const TmaDescriptor* desc, const void* smem_src,
                                                  int c0, int c1) {
  asm volatile(
      "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group"
      " [%0, {%1, %2}], [%3];\n" ::"l"(desc),
      "r"(c0), "r"(c1), "r"(smem_addr(smem_src))
      : "memory");
}

// 1D bulk copy global -> shared completing on an mbarrier (complete_tx::bytes): `bytes` bytes, a
// multiple of 16, both addresses 16-byte aligned. PTX ISA "cp.async.bulk" (non-tensor).
__device__ __forceinline__ void bulk_load_1d(void* smem_dst, const void* src, u32 bytes, u64* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(smem_addr(smem_dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

// 4-byte asynchronous copy global -> shared through L1 (both addresses 4-byte aligned); its
// completion is tracked with cp_async_mbarrier_arrive. `src` is a generic pointer to global
// memory, converted to the .global address the instruction takes. PTX ISA "cp.async" (.ca,
// sm_80+), "Generic Addressing" (cvta).
__device__ __forceinline__ void cp_async_4(void* smem_dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_addr(smem_dst)),
               "l"(static_cast<unsigned long long>(__cvta_generic_to_global(src)))
               : "memory");
}

// Makes `bar` track this thread's cp.async copies issued so far: its pending count goes up by one
// now and down by one once they have landed, so the phase cannot complete before them (and a
// thread that waits on the phase sees their data). PTX ISA "cp.async.mbarrier.arrive" (no .noinc).
__device__ __forceinline__ void cp_async_mbarrier_arrive(u64* bar) {
  asm volatile("cp.async.mbarrier.arrive.shared.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// 1D bulk copy shared -> global (the address may be a peer GPU's, mapped for this one), tracked
// by bulk async-groups like tma_store_2d. PTX ISA "cp.async.bulk" (.bulk_group).
__device__ __forceinline__ void bulk_store_1d(void* dst, const void* smem_src, u32 bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

// "cp.async.bulk.commit_group": closes the group of bulk stores issued so far.
__device__ __forceinline__ void tma_store_commit_group() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// "cp.async.bulk.wait_group.read": waits until at most N groups still read shared memory.
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}

// "cp.async.bulk.wait_group": waits until at most N bulk groups are incomplete (their global
// writes done, not only their shared-memory reads).
template <int N>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace ptxtrain
