// ptxtrain/include/ptxtrain/quant/host_emulation.hpp — host C++ shims that let cast_transpose.cuh run on
// a CPU for testing (tests/quant/test_cuda.py): CUDA qualifiers become no-ops, each CTA's
// threads are cooperative fibers (ucontext) switched at barriers, __syncthreads is a barrier
// over the CTA, __shfl_xor_sync an exchange through memory between two barriers of the warp, and every vector / scalar memory
// access checks its alignment and every global access its bounds (a bad access is reported and
// makes the launch fail, where the GPU would fault or corrupt memory). Float intrinsics map to correctly rounded host operations (compile with
// -ffp-contract=off); the e4m3 conversion is a C++ model of cvt.rn.satfinite.e4m3x2.f32.
// Not part of the CUDA build.
#pragma once

#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

namespace ptxtrain {
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
}  // namespace ptxtrain

struct uint4 {
  unsigned x, y, z, w;
};
struct uint2 {
  unsigned x, y;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

struct EmuDim {
  unsigned x;
};

namespace emu {

// Cooperative threads: each GPU thread of a CTA is a ucontext fiber on one OS thread, switched
// round-robin at barriers only, so a CTA runs deterministically and without OS scheduling.
struct Barrier {
  int expected = 0;
  int arrived = 0;
  unsigned long long generation = 0;
};

struct Cta {
  int threads = 0;
  Barrier block;
  std::vector<Barrier> warps;
  std::vector<unsigned> shfl[2];  // one slot per thread, double-buffered
  std::vector<unsigned char> shfl_parity;
  std::vector<std::uint32_t> smem;
  std::vector<ucontext_t> ctx;
  std::vector<char> done;
  ucontext_t scheduler;
  int current = 0;
};

inline thread_local EmuDim tl_thread{0};
inline thread_local EmuDim tl_block{0};
inline thread_local EmuDim tl_grid{0};
inline thread_local Cta* tl_cta = nullptr;

// A bad access is reported once on stderr and flagged (the caller returns an error); a bad load
// reads zeros and a bad store is dropped, so the process survives to report it.
inline bool error = false;

inline void fail(const char* what, const void* ptr) {
  if (!error) {
    std::fprintf(stderr, "host emulation: %s at %p (thread %u, block %u)\n", what, ptr,
                 tl_thread.x, tl_block.x);
  }
  error = true;
}

inline bool aligned(const void* ptr, std::uintptr_t bytes, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(ptr) % bytes == 0) return true;
  fail(what, ptr);
  return false;
}

struct Range {
  const char* lo;
  const char* hi;
};
inline Range readable{nullptr, nullptr};  // the input tensor's span
inline std::vector<Range> writable;        // the output tensors' spans

inline bool in_range(const Range& r, const void* ptr, std::size_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  return p >= r.lo && p + bytes <= r.hi;
}

inline bool can_read(const void* ptr, std::size_t bytes, std::uintptr_t align) {
  if (!aligned(ptr, align, "misaligned global load")) return false;
  if (in_range(readable, ptr, bytes)) return true;
  fail("global load outside the input tensor", ptr);
  return false;
}

inline bool can_write(const void* ptr, std::size_t bytes, std::uintptr_t align) {
  if (!aligned(ptr, align, "misaligned global store")) return false;
  for (const Range& r : writable) {
    if (in_range(r, ptr, bytes)) return true;
  }
  fail("global store outside every output tensor", ptr);
  return false;
}

inline void yield() {
  Cta& c = *tl_cta;
  swapcontext(&c.ctx[c.current], &c.scheduler);
}

inline void wait(Barrier& b) {
  const unsigned long long gen = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  while (b.generation == gen) yield();
}

// Runs kernel(args...) over `grid` CTAs of `threads` threads each, one CTA at a time.
template <typename Kernel, typename... Args>
void launch(Kernel kernel, long long grid, int threads, std::size_t smem_bytes, Args... args) {
  constexpr std::size_t kStack = 64 * 1024;
  static thread_local std::function<void()> body;
  std::vector<std::unique_ptr<char[]>> stacks;
  for (int t = 0; t < threads; ++t) stacks.emplace_back(new char[kStack]);
  for (long long b = 0; b < grid; ++b) {
    Cta cta;
    cta.threads = threads;
    cta.block.expected = threads;
    cta.warps.assign(threads / 32, Barrier{32, 0, 0});
    cta.shfl[0].assign(threads, 0u);
    cta.shfl[1].assign(threads, 0u);
    cta.shfl_parity.assign(threads, 0);
    cta.smem.assign(smem_bytes / 4 + 4, 0xdeadbeefu);  // garbage: the kernel must not read it
    cta.ctx.resize(threads);
    cta.done.assign(threads, 0);
    tl_cta = &cta;
    tl_block.x = static_cast<unsigned>(b);
    tl_grid.x = static_cast<unsigned>(grid);
    body = [&] { kernel(args...); };
    for (int t = 0; t < threads; ++t) {
      getcontext(&cta.ctx[t]);
      cta.ctx[t].uc_stack.ss_sp = stacks[t].get();
      cta.ctx[t].uc_stack.ss_size = kStack;
      cta.ctx[t].uc_link = &cta.scheduler;
      makecontext(&cta.ctx[t], +[] {
        body();
        tl_cta->done[tl_cta->current] = 1;
      }, 0);
    }
    int live = threads;
    while (live > 0) {
      for (int t = 0; t < threads; ++t) {
        if (cta.done[t]) continue;
        cta.current = t;
        tl_thread.x = static_cast<unsigned>(t);
        swapcontext(&cta.scheduler, &cta.ctx[t]);
        if (cta.done[t]) --live;
      }
    }
    tl_cta = nullptr;
  }
}

}  // namespace emu

#define threadIdx (emu::tl_thread)
#define blockIdx (emu::tl_block)
#define gridDim (emu::tl_grid)
#define PTXTRAIN_DYNAMIC_SMEM(type, name) \
  type* name = reinterpret_cast<type*>(emu::tl_cta->smem.data())

inline void __syncthreads() { emu::wait(emu::tl_cta->block); }

inline unsigned __shfl_xor_sync(unsigned /*mask*/, unsigned v, int lane_mask) {
  emu::Cta& c = *emu::tl_cta;
  const unsigned t = threadIdx.x;
  // Alternate buffers: a lane can only write this buffer again after the warp's next barrier,
  // which every lane reaches after its read below.
  std::vector<unsigned>& slot = c.shfl[c.shfl_parity[t]];
  c.shfl_parity[t] ^= 1;
  slot[t] = v;
  emu::wait(c.warps[t / 32]);
  return slot[(t & ~31u) | ((t & 31u) ^ static_cast<unsigned>(lane_mask))];
}

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __fdiv_rn(float a, float b) { return a / b; }
// prmt.b32 (default mode): byte i of the result is byte (s >> 4i) & 7 of the pair {y:x}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long pair = (static_cast<unsigned long long>(y) << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= ((pair >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }

namespace ptxtrain {

// cvt.rn.satfinite.e4m3x2.f32 for one value: round to nearest even, finite values beyond 448
// (and ±inf) saturate to ±448, NaN gives 0x7F.
inline unsigned char e4m3_rn_satfinite(float f) {
  if (std::isnan(f)) return 0x7f;
  const unsigned char sign = std::signbit(f) ? 0x80 : 0x00;
  const float a = std::fabs(f);
  if (a > 448.0f) return sign | 0x7e;
  if (a < 0.015625f) {  // below 2^-6: subnormal steps of 2^-9 (8 rounds up to the first normal)
    return sign | static_cast<unsigned char>(std::nearbyint(a * 512.0f));
  }
  int e2;
  std::frexp(a, &e2);  // a = m * 2^e2, m in [0.5, 1)
  int e = e2 - 1;      // a in [2^e, 2^(e+1))
  float r = std::nearbyint(std::ldexp(a, 3 - e));  // [8, 16], exact scaling
  if (r == 16.0f) {
    r = 8.0f;
    ++e;
  }
  int code = ((e + 7) << 3) | (static_cast<int>(r) - 8);
  if (code > 0x7e) code = 0x7e;
  return sign | static_cast<unsigned char>(code);
}

inline u16 cvt_e4m3x2(float lo, float hi) {
  return static_cast<u16>(e4m3_rn_satfinite(lo) | (e4m3_rn_satfinite(hi) << 8));
}

}  // namespace ptxtrain

namespace ptxtrain_quant {

inline float f16_to_f32(ptxtrain::u16 h) {
  const unsigned sign = (h >> 15) & 1u, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    mag = man ? NAN : INFINITY;
  } else {
    mag = std::ldexp(static_cast<float>(man | 0x400u), static_cast<int>(exp) - 25);
  }
  return sign ? -mag : mag;
}

inline uint4 ld_stream_v4(const void* ptr) {
  uint4 v{0u, 0u, 0u, 0u};
  if (emu::can_read(ptr, 16, 16)) std::memcpy(&v, ptr, 16);
  return v;
}
inline unsigned ld_u32(const void* ptr) {
  unsigned v = 0u;
  if (emu::can_read(ptr, 4, 4)) std::memcpy(&v, ptr, 4);
  return v;
}
inline unsigned ld_u16(const void* ptr) {
  ptxtrain::u16 v = 0;
  if (emu::can_read(ptr, 2, 2)) std::memcpy(&v, ptr, 2);
  return v;
}
inline void st_v4(void* ptr, uint4 v) {
  if (emu::can_write(ptr, 16, 16)) std::memcpy(ptr, &v, 16);
}
inline void st_v2(void* ptr, uint2 v) {
  if (emu::can_write(ptr, 8, 8)) std::memcpy(ptr, &v, 8);
}
inline void st_u32(void* ptr, unsigned v) {
  if (emu::can_write(ptr, 4, 4)) std::memcpy(ptr, &v, 4);
}
inline void st_f32(float* ptr, float v) {
  if (emu::can_write(ptr, 4, 4)) std::memcpy(ptr, &v, 4);
}
inline void st_u8(unsigned char* ptr, unsigned char v) {
  if (emu::can_write(ptr, 1, 1)) *ptr = v;
}
inline void sts_v4(void* ptr, uint4 v) {
  if (emu::aligned(ptr, 16, "misaligned 16-byte shared store")) std::memcpy(ptr, &v, 16);
}
inline unsigned max_u16x2(unsigned a, unsigned b) {
  const unsigned lo = std::max(a & 0xffffu, b & 0xffffu), hi = std::max(a >> 16, b >> 16);
  return lo | (hi << 16);
}
inline unsigned max_s16x2(unsigned a, unsigned b) {
  const auto s16 = [](unsigned v) { return static_cast<int>(static_cast<short>(v & 0xffffu)); };
  const unsigned lo = static_cast<unsigned>(std::max(s16(a), s16(b))) & 0xffffu;
  const unsigned hi = static_cast<unsigned>(std::max(s16(a >> 16), s16(b >> 16))) & 0xffffu;
  return lo | (hi << 16);
}
inline void sts_v2(void* ptr, uint2 v) {
  if (emu::aligned(ptr, 8, "misaligned 8-byte shared store")) std::memcpy(ptr, &v, 8);
}

}  // namespace ptxtrain_quant
