// ptxtrain/mbarrier.cuh — shared-memory transaction barriers (mbarrier), the completion
// mechanism of TMA loads (docs/design.md §3). PTX ISA "Parallel Synchronization and
// Communication Instructions: mbarrier".
//
// A barrier is a 64-bit word in shared memory. Phase protocol: init with the number of expected
// arrivals; the producer calls arrive_expect_tx(bytes) and issues async copies that complete
// `bytes` of transactions; consumers wait on the current phase's parity, which flips each phase.
#pragma once

#include "ptx.cuh"

namespace ptxtrain {

// "mbarrier.init": set the expected arrival count of a new barrier.
__device__ __forceinline__ void mbarrier_init(u64* bar, u32 arrive_count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrive_count)
               : "memory");
}

// "membar / fence" (fence.mbarrier_init): makes initialised barriers visible to the
// async proxy and to the other CTAs of the cluster before they are used.
__device__ __forceinline__ void fence_mbarrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// "mbarrier.expect_tx" + "mbarrier.arrive": arrive once and raise
// the phase's pending transaction count by `tx_bytes`.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(u64* bar, u32 tx_bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
               "r"(tx_bytes)
               : "memory");
}

// "mbarrier.arrive": a plain arrival (no transactions).
__device__ __forceinline__ void mbarrier_arrive(u64* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

// "mbarrier.arrive" on the barrier at the same shared-memory offset in CTA `cta_rank` of the
// cluster (the address mapped with "mapa"): a consumer releases a stage that a multicast load of
// another CTA will overwrite. Default semantics (.release.cta): the consumer's reads of the stage
// are already in registers, so no cluster-scope fence is needed, and `.release.cluster` makes
// every k-block wait for one (clusters of 2 then run at half speed).
__device__ __forceinline__ void mbarrier_arrive_cluster(u64* bar, u32 cta_rank) {
  u32 remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n"
               : "=r"(remote)
               : "r"(smem_addr(bar)), "r"(cta_rank));
  asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];\n" ::"r"(remote)
               : "memory");
}

// "mbarrier.test_wait / mbarrier.try_wait": one bounded wait for the phase with
// parity `parity` to complete; true once it has.
__device__ __forceinline__ bool mbarrier_try_wait_parity(u64* bar, u32 parity) {
  u32 done;
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n"
      "}\n"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}

// Spins on mbarrier_try_wait_parity until the phase with parity `parity` completes (the loop is
// in C++, not in the asm, so that inlining it twice does not duplicate PTX labels).
__device__ __forceinline__ void mbarrier_wait(u64* bar, u32 parity) {
  while (!mbarrier_try_wait_parity(bar, parity)) {
  }
}

}  // namespace ptxtrain
