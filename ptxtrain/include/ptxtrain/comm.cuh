// ptxtrain/comm.cuh — wrappers for inter-GPU communication kernels, beside ptx.cuh
// (docs/design.md §3).
//
// Each wrapper cites, by title, the PTX ISA section (ISA 9.0, CUDA 13.0) that defines its
// instruction. Header-only, no includes (NVRTC needs no CUDA toolkit headers).
#pragma once

namespace ptxtrain {

// Fence at system scope with acquire-release semantics: orders this thread's earlier memory
// operations (and, after a bar.sync, those of its CTA that it observed) before its later ones
// as seen from any GPU or the host. PTX ISA "membar / fence" (fence.acq_rel.sys).
__device__ __forceinline__ void fence_acq_rel_sys() {
  asm volatile("fence.acq_rel.sys;\n" ::: "memory");
}

// Relaxed load at system scope, for polling a flag in a loop before one acquiring fence or load.
// PTX ISA "ld" (.relaxed.sys).
__device__ __forceinline__ int ld_relaxed_sys(const int* ptr) {
  int v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];\n" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// The SM's 64-bit cycle counter, for bounding spin loops. PTX ISA "Special Registers"
// (%clock64), read with "mov".
__device__ __forceinline__ long long clock64_ptx() {
  long long v;
  asm volatile("mov.u64 %0, %%clock64;\n" : "=l"(v));
  return v;
}

}  // namespace ptxtrain
