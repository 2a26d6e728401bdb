// ptxtrain/include/ptxtrain/quant/cast_transpose.cuh — FP8 (E4M3) quantizers that read a [M, K] tensor
// once per 128x128 tile and write its 1x128 (row), 128x1 (column, stored transposed) or 128x128
// (block) quantization, bit-exact with ptxtrain/quant/ref.py. Compiled through NVRTC by
// ptxtrain/quant/cuda.py (no CUDA toolkit headers: bf16 / fp16 are handled as raw bits).
//
// Layout of the work (default variant: one CTA = 256 threads = one 128x128 tile, tiles numbered
// K-fastest; the Knobs above the kernel change the threads per CTA, let a CTA walk several
// tiles with the next tile's loads in flight, and more):
//   load    every thread issues PASSES 16-byte loads: chunk c = tid % CPR of rows
//           tid / CPR + i * RPP (CPR = 16-byte chunks per tile row, RPP = rows per pass), so a
//           warp reads whole 256 / 512-byte row segments. Out-of-range rows / columns read 0,
//           which is the reference's zero padding inside the amax. With the PAIR knob a lane
//           loads chunks c and c + CPR / 2 of one row per pass (LPR = CPR / 2 lanes per row).
//   row     (ROW) quantized from registers: the LPR threads of a row reduce its amax with warp
//           shuffles; each stores its 8 (16-bit input) or 4 (fp32) FP8 bytes per chunk,
//           coalesced.
//   column  (COL) the raw tile goes to shared memory, [128][WPR] 32-bit words, word w of row r
//           at r * WPR + (w ^ (((r >> 4) & 7) << 2)) (an XOR swizzle on bits 2..4). Then a
//           thread takes one word column p (2 bf16/fp16 columns or 1 fp32 column) of 16
//           consecutive rows 16g..16g+15; lane = g + 8 * (p % 4), so in each 32-bit shared load
//           a warp touches rows 16g + j (g = 0..7) of 4 consecutive word columns, and the swizzle
//           spreads these over the 32 banks. The 8 lanes of a column reduce its amax with
//           shuffles and each stores 16 FP8 bytes of the transposed row k: 128 contiguous bytes
//           per column and warp. The warps take word columns 4 * warp + 4 * warps * pass.
//   block   (BLOCK mode) one amax for the whole tile (warp shuffles, then the warp maxima
//           through shared memory); the row and column outputs then use that one scale (with
//           the BYTE_T knob the column pass transposes the row pass's FP8 bytes instead).
//
// Scale and division, as ref.py: amax in fp32 from the integer bits of |x| (NaN above inf, so a
// NaN anywhere gives the canonical NaN like torch.amax), clamped below at 1e-12, sf = amax / 448
// (div.rn), optional power-of-two rounding, then x / sf correctly rounded: q0 = x * y with
// y = rcp.rn(sf) and two residual corrections q <- q - (q * sf - x) * y (FMA, exact residual):
// the first brings q within one ulp of x / sf, the second makes it the correctly rounded
// quotient (Markstein's theorem; below 2^-126 it may be off by a subnormal ulp, which E4M3,
// whose smallest step is 2^-9, rounds to the same ±0). 16-bit inputs stop after the first
// correction: their E4M3 bytes are the same, by exhaustion over every (x, amax) (see quotient).
// The signs are placed so that x = -0 gives -0. Tiles with a non-finite scale (one branch per
// tile row/column) take x * 0 (sf = inf) or x * NaN, IEEE's x / sf for those (see quantize).
// cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even.
//
// FULL (a template flag the host sets when M and K are multiples of 128 and every access is
// aligned): the bounds checks and the element-wise fallbacks are compiled out, the tile index
// is split with 32-bit math, a CTA without LOOP skips the tile < tiles test (one CTA per tile)
// and the column pass is unrolled. ncu showed the kernels bound by issuing instructions, not
// by memory, and the checks were a fifth of them. All kernels: the scale and output pointers
// are set up once per tile and advanced per pass (not rebuilt from 64-bit products), the
// scale stores are predicated, not branched around.
//
// PTXTRAIN_QUANT_HOST_EMULATION: compile this file as host C++ (g++ -std=c++20) against the
// shims of host_emulation.hpp, which run each CTA's threads as fibers (barriers for
// __syncthreads and shuffles) and check the alignment of every vector access; the test suite
// uses it to run these kernels (every variant) bit for bit against ref.py without a GPU.
#pragma once

#ifdef PTXTRAIN_QUANT_HOST_EMULATION
#include "host_emulation.hpp"
#else
#include <ptxtrain/ptx.cuh>
#endif

namespace ptxtrain_quant {

using ptxtrain::u16;
using ptxtrain::u32;
typedef long long i64;

#ifndef PTXTRAIN_QUANT_HOST_EMULATION
#define PTXTRAIN_DYNAMIC_SMEM(type, name) extern __shared__ __align__(16) type name[]

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

// Streaming 16-byte read-only load (the input is never written while the kernel runs).
__device__ __forceinline__ uint4 ld_stream_v4(const void* ptr) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr));
  return v;
}

__device__ __forceinline__ void st_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// Per-16-bit-lane unsigned max (PTX max.u16x2, sm_90).
__device__ __forceinline__ u32 max_u16x2(u32 a, u32 b) {
  u32 r;
  asm("max.u16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Per-16-bit-lane signed max (PTX max.s16x2, sm_90).
__device__ __forceinline__ u32 max_s16x2(u32 a, u32 b) {
  u32 r;
  asm("max.s16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ void st_v2(void* ptr, uint2 v) { *static_cast<uint2*>(ptr) = v; }
__device__ __forceinline__ void st_u32(void* ptr, u32 v) { *static_cast<u32*>(ptr) = v; }
__device__ __forceinline__ void st_f32(float* ptr, float v) { *ptr = v; }
__device__ __forceinline__ void st_u8(unsigned char* ptr, unsigned char v) { *ptr = v; }
__device__ __forceinline__ void sts_v4(void* ptr, uint4 v) { *static_cast<uint4*>(ptr) = v; }
__device__ __forceinline__ void sts_v2(void* ptr, uint2 v) { *static_cast<uint2*>(ptr) = v; }
__device__ __forceinline__ u32 ld_u32(const void* ptr) { return *static_cast<const u32*>(ptr); }
__device__ __forceinline__ u32 ld_u16(const void* ptr) { return *static_cast<const u16*>(ptr); }

using ptxtrain::grid_dependency_launch;
using ptxtrain::grid_dependency_wait;

// ASYNC knob: 16-byte global -> shared copies that bypass L1 (both addresses 16-byte aligned),
// in flight while the previous tile is quantized. cp_async_commit_wait<N> closes this thread's
// group of copies issued so far, then waits until at most N of its groups are pending (their
// data then visible to this thread; to the others after a barrier). PTX ISA "cp.async" (.cg),
// "cp.async.commit_group", "cp.async.wait_group".
__device__ __forceinline__ void cp_async_v4(void* smem_dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(ptxtrain::smem_addr(smem_dst)),
               "l"(static_cast<unsigned long long>(__cvta_generic_to_global(src)))
               : "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_commit_wait() {
  asm volatile("cp.async.commit_group;\n"
               "cp.async.wait_group %0;\n" ::"n"(N)
               : "memory");
}
__device__ __forceinline__ uint4 lds_v4(const void* ptr) { return *static_cast<const uint4*>(ptr); }

// A predicated store (no branch): the address is computed on every lane, so the compiler keeps
// the scale pointers as incremented registers instead of rebuilding them inside a branch.
__device__ __forceinline__ void st_f32_if(bool pred, float* ptr, float v) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %0, 0;\n @p st.global.f32 [%1], %2;\n}"
               ::"r"(static_cast<int>(pred)), "l"(ptr), "f"(v)
               : "memory");
}

// rcp.rn(b): the correctly rounded reciprocal that Markstein's theorem needs (see the note at
// the top). A variant without rcp.rn's range branch (MUFU.RCP + one Newton step) saved a few
// instructions per scale, not per element, and was not proven correctly rounded for every
// scale on the GPU, so the full rcp.rn stays.
__device__ __forceinline__ float rcp_rn(float b) { return __frcp_rn(b); }
#else
inline void st_f32_if(bool pred, float* ptr, float v) {
  if (pred) st_f32(ptr, v);
}
// (host: one kernel at a time, nothing to wait for)
inline void grid_dependency_launch() {}
inline void grid_dependency_wait() {}
// (host: the copy completes at once, through the checked 16-byte load and shared store)
inline void cp_async_v4(void* smem_dst, const void* src) { sts_v4(smem_dst, ld_stream_v4(src)); }
template <int N>
inline void cp_async_commit_wait() {}
inline uint4 lds_v4(const void* ptr) {
  uint4 v{0u, 0u, 0u, 0u};
  if (emu::aligned(ptr, 16, "misaligned 16-byte shared load")) std::memcpy(&v, ptr, 16);
  return v;
}
inline float rcp_rn(float b) { return __frcp_rn(b); }
#endif

constexpr int kTile = 128;     // tile edge (DeepSeek-V3's 128)
constexpr u32 kEpsBits = 0x2b8cbcccu;  // bits of fp32(1e-12), ref.py's AMAX_EPS
constexpr u32 kCanonicalNan = 0x7fc00000u;

enum InKind { kF32 = 0, kBF16 = 1, kF16 = 2 };

template <int IN>
struct In;
template <>
struct In<kF32> {
  static constexpr int kBytes = 4;
};
template <>
struct In<kBF16> {
  static constexpr int kBytes = 2;
};
template <>
struct In<kF16> {
  static constexpr int kBytes = 2;
};

// Element e (0..3 for fp32, 0..7 for 16-bit) of a 16-byte chunk, as fp32 (exact).
template <int IN>
__device__ __forceinline__ float unpack(const uint4& v, int e) {
  const u32 w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (IN == kF32) {
    return __uint_as_float(w[e]);
  } else {
    const u32 word = w[e >> 1];
    const u32 half = (e & 1) ? (word >> 16) : (word & 0xffffu);
    if constexpr (IN == kBF16) {
      return __uint_as_float(half << 16);
    } else {
      return f16_to_f32(static_cast<u16>(half));
    }
  }
}

// Element e of a 32-bit shared word (2 16-bit elements, or 1 fp32).
template <int IN>
__device__ __forceinline__ float unpack_word(u32 word, int e) {
  if constexpr (IN == kF32) {
    return __uint_as_float(word);
  } else {
    const u32 half = e ? (word >> 16) : (word & 0xffffu);
    if constexpr (IN == kBF16) {
      return __uint_as_float(half << 16);
    } else {
      return f16_to_f32(static_cast<u16>(half));
    }
  }
}

__device__ __forceinline__ u32 abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }

// AMAX16: the amax of 16-bit inputs taken on the raw bits. |h| bits (h & 0x7fff) order bf16 and
// fp16 values by magnitude, NaNs (above 0x7f80 / 0x7c00) above inf, as the fp32 |x| bits do, so
// the max of the 16-bit |h| bits, widened once, gives the same amax bits as the max over the
// widened values: two columns (the halves of a word) per max.u16x2 (for 8+ words without a
// mask per word: abs_max16x2). In the 1x128 row pass two rows share one shuffle reduction
// (their maxima in the two 16-bit lanes). The widening of a 16-bit |h|: bf16 bits << 16; fp16
// through cvt.f32.f16 (a NaN stays a NaN: canonicalized later).
template <int IN>
__device__ __forceinline__ u32 widen_abs16(u32 h) {
  if constexpr (IN == kBF16) {
    return h << 16;
  } else {
    return abs_bits(f16_to_f32(static_cast<u16>(h)));
  }
}

template <int WIDTH>
__device__ __forceinline__ u32 warp_max_u16x2(u32 v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = max_u16x2(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Per 16-bit lane, the max of |h| over the words w[0..N) (raw 16-bit bits). N >= 8 without a mask
// per word: the signed max is the largest |h| of the values of sign 0 if there is one, the
// unsigned max 0x8000 | the largest |h| of the values of sign 1 if there is one; each, masked,
// is the |h| of some value and one of them is the largest. N < 8: mask, then max (fewer ops).
template <int N>
__device__ __forceinline__ u32 abs_max16x2(const u32* w) {
  if constexpr (N >= 8) {
    u32 mu = w[0], ms = w[0];
#pragma unroll
    for (int j = 1; j < N; ++j) {
      mu = max_u16x2(mu, w[j]);
      ms = max_s16x2(ms, w[j]);
    }
    return max_u16x2(mu & 0x7fff7fffu, ms & 0x7fff7fffu);
  } else {
    u32 m = w[0] & 0x7fff7fffu;
#pragma unroll
    for (int j = 1; j < N; ++j) m = max_u16x2(m, w[j] & 0x7fff7fffu);
    return m;
  }
}

// The words of chunks v[0..N) (16 bytes each) in one array, for abs_max16x2.
template <int N>
__device__ __forceinline__ u32 chunks_abs_max16x2(const uint4* v) {
  u32 w[4 * N];
#pragma unroll
  for (int i = 0; i < N; ++i) {
    w[4 * i] = v[i].x;
    w[4 * i + 1] = v[i].y;
    w[4 * i + 2] = v[i].z;
    w[4 * i + 3] = v[i].w;
  }
  return abs_max16x2<4 * N>(w);
}

// Both 16-bit lanes of m -> their max, in both lanes (widen_abs16 reads the low lane).
__device__ __forceinline__ u32 fold16x2(u32 m) { return max_u16x2(m, __byte_perm(m, m, 0x1032)); }

// amax bits (max of |x| bits over a tile) -> fp32 dequantization factor, as ref.py.
// FAST_SF: amax / 448 as q = amax * RN(1/448), then one exact-residual correction
// q + (amax - 448 q) * RN(1/448) (two FMAs) instead of div.rn (its reciprocal, Newton steps and
// range check). Bit-exact with div.rn for every finite amax >= fp32(1e-12), the clamped range,
// by exhaustion over all 1,408,451,380 such floats (host_emulation.cpp's emu_check_fast_sf, run
// by tests/quant/test_cuda.py); inf / NaN: a * RN(1/448), div.rn's result for those two.
constexpr u32 kInv448Bits = 0x3b124925u;  // RN(1 / 448)

template <bool FAST_SF>
__device__ __forceinline__ float div448(u32 amax_bits) {
  const float a = __uint_as_float(amax_bits);
  if constexpr (FAST_SF) {
    // Without a branch: for the two non-finite amax (inf, the canonical NaN) a * RN(1/448) is
    // already div.rn's result (inf; the platform's canonical NaN, as div.rn gives).
    const float c = __uint_as_float(kInv448Bits);
    const float q = __fmul_rn(a, c);
    const float r = __fmaf_rn(__fmaf_rn(-q, 448.0f, a), c, q);
    return amax_bits < 0x7f800000u ? r : q;
  }
  return __fdiv_rn(a, 448.0f);
}

template <bool POW2, bool FAST_SF = false>
__device__ __forceinline__ float scale_from_amax_bits(u32 amax_bits) {
  if (amax_bits > 0x7f800000u) amax_bits = kCanonicalNan;  // NaN: torch.amax's canonical NaN
  if (amax_bits < kEpsBits) amax_bits = kEpsBits;             // clamp(min=1e-12); NaN stays
  float sf = div448<FAST_SF>(amax_bits);
  if constexpr (POW2) {
    // sf is finite exactly when amax is (sf <= FLT_MAX / 448), and then a normal sf > 0:
    // adding 2^23 - 1 carries into the exponent unless the mantissa is 0.
    if (amax_bits < 0x7f800000u) {
      sf = __uint_as_float((__float_as_uint(sf) + 0x7fffffu) & 0x7f800000u);
    }
  }
  return sf;
}

struct Scale {
  float sf;  // dequantization factor
  float y;   // rcp.rn(sf)
  bool finite;
};

template <bool POW2, bool FAST_SF = false>
__device__ __forceinline__ Scale make_scale(u32 amax_bits) {
  Scale s;
  s.sf = scale_from_amax_bits<POW2, FAST_SF>(amax_bits);
  s.y = rcp_rn(s.sf);
  s.finite = amax_bits < 0x7f800000u;  // the same as sf finite (see scale_from_amax_bits)
  return s;
}

// The scale of one row / column: the tile's block scale (BLOCK mode), else from the amax bits
// that `amax_bits()` reduces (called only then: it may hold warp shuffles).
template <bool BLOCK, bool POW2, bool FAST_SF, class AmaxBits>
__device__ __forceinline__ Scale tile_scale(const Scale& block_scale, AmaxBits amax_bits) {
  if constexpr (BLOCK) {
    return block_scale;
  } else {
    return make_scale<POW2, FAST_SF>(amax_bits());
  }
}

// RN_fp32(x / sf) for a finite sf, bit-exact with IEEE division (see the file comment).
// ONE_STEP (16-bit input): one residual correction instead of two. The quotient may then be one
// fp32 ulp off RN(x / sf), but its E4M3 byte is the same for every pair of a 16-bit x and a
// 16-bit amax >= |x| (the only scales such an input gives, the 1e-12 clamp included), bf16 and
// fp16: 532,668,480 and 503,824,896 pairs, checked by exhaustion (host_emulation.cpp's
// emu_check_one_step, run by tests/quant/test_cuda.py). Without any correction (x * y alone)
// 19,761 bf16 pairs differ. fp32 input keeps both corrections.
template <bool ONE_STEP = false>
__device__ __forceinline__ float quotient(float x, const Scale& s) {
  float q = __fmul_rn(x, s.y);
  q = __fmaf_rn(__fmaf_rn(q, s.sf, -x), -s.y, q);
  if constexpr (!ONE_STEP) q = __fmaf_rn(__fmaf_rn(q, s.sf, -x), -s.y, q);
  return q;
}

// Four quotients -> four E4M3 bytes, element 0 in the lowest byte (lowest address).
__device__ __forceinline__ u32 pack4(float a, float b, float c, float d) {
  return static_cast<u32>(ptxtrain::cvt_e4m3x2(a, b)) |
         (static_cast<u32>(ptxtrain::cvt_e4m3x2(c, d)) << 16);
}

// N values (N % 4 == 0) quantized with one scale into N / 4 words of E4M3 bytes. The branch on
// the scale is taken once for all N (a non-finite scale, from an inf / NaN input, multiplies).
// MUL_POW2 (only with power-of-two scales): x / sf = x * y exactly-rounded in one multiply, since
// sf = 2^e (e in [-48, 127]: amax >= 1e-12) and y = rcp.rn(sf) = 2^-e is exact (2^-127 is an fp32
// subnormal), so RN(x * y) and RN(x / sf) round the same real number; -0 * y = -0.
template <int N, bool MUL_POW2 = false, bool ONE_STEP = false>
__device__ __forceinline__ void quantize(const float (&f)[N], const Scale& s, u32 (&out)[N / 4]) {
  if (s.finite) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      if constexpr (MUL_POW2) {
        out[j] = pack4(__fmul_rn(f[4 * j], s.y), __fmul_rn(f[4 * j + 1], s.y),
                       __fmul_rn(f[4 * j + 2], s.y), __fmul_rn(f[4 * j + 3], s.y));
      } else {
        out[j] = pack4(quotient<ONE_STEP>(f[4 * j], s), quotient<ONE_STEP>(f[4 * j + 1], s),
                       quotient<ONE_STEP>(f[4 * j + 2], s), quotient<ONE_STEP>(f[4 * j + 3], s));
      }
    }
  } else {
    // sf = +inf or NaN (an inf / NaN in the tile): x / sf is x * z with z = 0 for sf = inf (±0
    // for finite x, NaN for x = ±inf / NaN, as IEEE x / inf) and z = sf for a NaN sf (NaN), one
    // multiply instead of div.rn's inline sequence per element; every NaN converts to 0x7F.
    const float z = __float_as_uint(s.sf) == 0x7f800000u ? 0.0f : s.sf;
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      out[j] = pack4(__fmul_rn(f[4 * j], z), __fmul_rn(f[4 * j + 1], z),
                     __fmul_rn(f[4 * j + 2], z), __fmul_rn(f[4 * j + 3], z));
    }
  }
}

template <int WIDTH>
__device__ __forceinline__ u32 warp_max(u32 v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Knobs of one compiled variant (template constants; ptxtrain/quant/cuda.py's VARIANTS table):
//   NT        threads per CTA: 128, 256 (the original kernel) or 512.
//   LOOP      a CTA walks tiles blockIdx.x, + gridDim.x, ... (the host picks the grid); without
//             it (and without PIPE) a CTA does tile blockIdx.x only (grid = number of tiles).
//   PIPE      software pipeline across the tiles of a CTA: the 16-byte chunks of the CTA's next
//             tile are loaded into a thread's registers as soon as the current tile's chunk in
//             those registers is dead (after its row quantization, or after it was staged in
//             shared memory when there is no row output), so the next tile's loads are in
//             flight during this tile's quantization. Without PIPE the next tile is loaded at
//             the top of the loop. PIPE implies LOOP.
//   MUL_POW2  power-of-two scales divide by one exact multiply (see quantize).
//   BYTE_T    block mode with both outputs (W and Wᵀ share one scale, so the same bytes): the
//             row pass also writes its FP8 bytes to shared memory ([128][32] words of 4 column
//             bytes, word w of row r at r * 32 + (w ^ (((r >> 4) & 7) << 2))) and the column pass
//             transposes bytes (a thread: 4 columns x 16 rows, 8 byte permutes per 4x4 block)
//             instead of staging the raw tile and quantizing every element a second time.
//   AMAX16    16-bit input: amax reductions on the raw 16-bit bits, two per max.u16x2 (see
//             widen_abs16), instead of widening every element first.
//   FAST_SF   sf = amax / 448 by a multiply and one FMA correction (see div448; exhaustively
//             checked bit-exact) instead of div.rn.
//   PAIR      each lane loads two 16-byte chunks of one row per pass (chunks c and c + CPR / 2,
//             so each load instruction still reads whole 128-byte row segments): a row's amax
//             needs one shuffle level less and its scale, its division setup and its scale
//             store are shared by twice the elements.
//   ASYNC     (1x128 / 128x1 modes with a column output, FULL, LOOP without PIPE) the raw tiles
//             reach shared memory by 16-byte cp.async copies into two buffers: the CTA's next
//             tile is copied while this one is quantized (the row pass reads its chunks back
//             from shared memory), so loads stay in flight without registers holding them.
//             Other instantiations of an ASYNC variant run as LOOP (the two-buffer layout
//             kept, the second buffer unused).
//   MIN_CTAS  __launch_bounds__ minimum CTAs per SM for 16-bit input, 2/3 of it for fp32 (at
//             least 1; the registers are capped at 65536 / (NT * it));
//             0: 768 / NT for 16-bit input, 512 / NT for fp32 (at least 1), i.e. the original
//             80 / 128 registers per thread.
template <int NT, bool LOOP, bool PIPE, bool MUL_POW2, int MIN_CTAS, bool BYTE_T = false,
          bool AMAX16 = false, bool FAST_SF = false, bool PAIR = false, bool ASYNC = false>
struct Knobs {
  static constexpr bool kPair = PAIR;
  static constexpr bool kAsync = ASYNC;
  static constexpr bool kFastSf = FAST_SF;
  static constexpr bool kAmax16 = AMAX16;
  static constexpr bool kByteT = BYTE_T;
  static constexpr int kThreads = NT;
  static constexpr bool kLoop = LOOP || PIPE;
  static constexpr bool kPipe = PIPE;
  static constexpr bool kMulPow2 = MUL_POW2;
  static constexpr int kMinCtas = MIN_CTAS;
};
using DefaultKnobs = Knobs<256, false, false, false, 0>;  // the original kernel

template <int IN, typename KN>
struct MinCtas {
  static constexpr int kDefault = (In<IN>::kBytes == 2 ? 768 : 512) / KN::kThreads;
  static constexpr int kGiven = In<IN>::kBytes == 2 ? KN::kMinCtas : KN::kMinCtas * 2 / 3;
  static constexpr int value =
      KN::kMinCtas > 0 ? (kGiven > 0 ? kGiven : 1) : (kDefault > 0 ? kDefault : 1);
};

// Where one thread's chunks of a tile come from: pass i is row m0 + r_base + i * RPP, columns
// col + dc .. col + dc + VEC - 1 of x for the chunk at element offset dc (load_chunk); rows at or
// past M (also all rows of a tile index past the last tile) and columns at or past K read zeros
// (the reference's padding inside the amax).
struct ChunkSrc {
  const char* p;  // the pass-0 chunk at dc = 0
  i64 step;       // bytes from one pass to the next (RPP rows)
  i64 col;
  int rows;       // passes i with i * RPP < rows exist
  bool aligned;   // x is 16-byte aligned with 16-byte rows: whole chunks load as one vector
};

template <int IN, int RPP>
__device__ __forceinline__ ChunkSrc chunk_src(const char* xb, i64 M, i64 ldx, i64 m0, i64 col,
                                              int r_base, bool x_vec) {
  constexpr int kBytes = In<IN>::kBytes;
  ChunkSrc s;
  const i64 row = m0 + r_base;
  const i64 left = M - row;
  s.rows = left <= 0 ? 0 : (left > kTile ? kTile : static_cast<int>(left));
  s.p = xb + (row * ldx + col) * kBytes;
  s.step = static_cast<i64>(RPP) * ldx * kBytes;
  s.col = col;
  s.aligned = x_vec;
  return s;
}

// kFull: the chunk is known to be in range and aligned (FULL kernel): one 16-byte load.
template <int IN, int RPP, bool kFull = false>
__device__ __forceinline__ uint4 load_chunk(const ChunkSrc& s, i64 K, int i, int dc = 0) {
  constexpr int kBytes = In<IN>::kBytes;
  constexpr int VEC = 16 / kBytes;
  if constexpr (kFull) return ld_stream_v4(s.p + i * s.step + dc * kBytes);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  if (i * RPP < s.rows) {
    const char* p = s.p + i * s.step + dc * kBytes;
    const i64 col = s.col + dc;
    if (s.aligned && col + VEC <= K) {
      v = ld_stream_v4(p);
    } else {
      u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (col + e < K) {
          u32 bits;
          if constexpr (kBytes == 4) {
            bits = ld_u32(p + e * 4);
          } else {
            bits = ld_u16(p + e * 2);
          }
          w[e * kBytes / 4] |= bits << ((e * kBytes * 8) & 31);
        }
      }
      v = make_uint4(w[0], w[1], w[2], w[3]);
    }
  }
  return v;
}

// The kernel. IN: input kind; BLOCK: one scale per 128x128 tile (else 1x128 rows / 128x1
// columns); ROW: write q [M, K]; COL: write qt [K, M]; POW2: power-of-two scales; KN: Knobs.
//
// Arguments: x (row stride ldx elements, unit column stride); q (row stride K) and its scales sf
// (element (i, j) at sf[i * sf_s0 + j * sf_s1]); qt (row stride M) and sft (strides sft_s0,
// sft_s1; unused in BLOCK mode, whose transposed scales the host makes). vec_flags: bit 0 = x is
// 16-byte aligned with a 16-byte multiple row stride; bit 1 = q's rows allow 8 / 4-byte stores
// (K % 8 == 0 for 16-bit input, K % 4 == 0 for fp32); bit 2 = qt's rows allow 16-byte stores
// (M % 16 == 0). Pointers the mode does not use may be anything (never dereferenced).
// Dynamic shared memory: 128 * 128 * sizeof(input) bytes when COL, then NT / 32 words.
// FULL: the host promises M % 128 == 0, K % 128 == 0 and every vec_flags bit the mode uses, so
// every tile is whole and every access aligned: the bounds checks and the scalar fallbacks are
// compiled out (about a sixth of the instructions of the fused kernel, by ncu's SASS counts).
template <int IN, bool BLOCK, bool ROW, bool COL, bool POW2, typename KN = DefaultKnobs,
          bool FULL = false>
__global__ void __launch_bounds__(KN::kThreads, MinCtas<IN, KN>::value)
    cast_fp8(const void* __restrict__ x_ptr, unsigned char* __restrict__ q, float* __restrict__ sf,
             unsigned char* __restrict__ qt, float* __restrict__ sft, i64 M, i64 K, i64 ldx,
             i64 sf_s0, i64 sf_s1, i64 sft_s0, i64 sft_s1, i64 k_tiles, int vec_flags) {
  constexpr int kThreads = KN::kThreads;
  constexpr bool kPipe = KN::kPipe;
  constexpr bool kMul = POW2 && KN::kMulPow2;
  constexpr bool kOneStep = IN != kF32;  // one quotient correction suffices (see quotient)
  constexpr int kWarps = kThreads / 32;
  constexpr int kBytes = In<IN>::kBytes;
  constexpr int VEC = 16 / kBytes;         // elements per 16-byte chunk
  constexpr int CPR = kTile / VEC;         // chunks per tile row: 16 or 32
  constexpr int CH = KN::kPair ? 2 : 1;    // chunks per lane and pass (of one row)
  constexpr int LPR = CPR / CH;            // lanes per tile row
  constexpr int DC = LPR * VEC;            // element offset of a lane's next chunk in its row
  constexpr int RPP = kThreads / LPR;      // rows per load pass
  constexpr int PASSES = kTile / RPP;      // load passes per tile
  constexpr int WPR = kTile * kBytes / 4;  // 32-bit words per tile row: 64 or 128
  constexpr int EPW = 4 / kBytes;          // elements per word: 2 or 1
  static_assert(kThreads % LPR == 0 && kTile % RPP == 0, "threads must tile the 128 rows");
  static_assert(WPR % (4 * kWarps) == 0, "the column pass needs WPR / (4 * warps) passes");

  constexpr bool kByteT = BLOCK && ROW && COL && KN::kByteT;
  constexpr bool kAmax16 = KN::kAmax16 && In<IN>::kBytes == 2;
  constexpr bool kFastSf = KN::kFastSf;
  constexpr bool kFull = FULL;
  // ASYNC (see Knobs): two raw-tile buffers; kAsync where this instantiation uses them.
  constexpr bool kAsyncLayout = KN::kAsync && COL && !BLOCK;
  constexpr bool kAsync = kAsyncLayout && kFull && KN::kLoop && !kPipe;
  // Shared memory: the raw tile [128][WPR] words for the column pass (two with kAsyncLayout;
  // with kByteT, its FP8 bytes [128][32] words), then the warp maxima.
  PTXTRAIN_DYNAMIC_SMEM(u32, smem);
  constexpr int kTileWords = kTile * (kByteT ? kTile / 4 : WPR);
  u32* red = smem + (COL ? kTileWords * (kAsyncLayout ? 2 : 1) : 0);

  // Programmatic dependent launch (ptxtrain.jit.BoundLaunch(programmatic=True)): read x only
  // once the previous kernel's results are visible. (The next kernel is let in at the end.)
  grid_dependency_wait();

  const int tid = threadIdx.x;
  const i64 tiles = (M + kTile - 1) / kTile * k_tiles;
  const i64 stride = gridDim.x;
  const bool x_vec = vec_flags & 1;
  const bool q_vec = vec_flags & 2;
  const bool qt_vec = vec_flags & 4;
  const char* xb = static_cast<const char*>(x_ptr);
  // (unsigned: a signed division by a power of two would add a rounding fix-up)
  const int c = static_cast<u32>(tid) % LPR;  // 16-byte chunk column of this thread (its first)
  const int r_base = static_cast<u32>(tid) / LPR;

  // Tile t -> (its row of tiles, its column of tiles). FULL: 32-bit (the host launches fewer than
  // 2^31 tiles), not the 64-bit division with its 32-bit fast path.
  const auto tile_mt = [&](i64 t) -> i64 {
    if constexpr (kFull) return static_cast<u32>(t) / static_cast<u32>(k_tiles);
    return t / k_tiles;
  };
  const auto tile_kt = [&](i64 t, i64 mt) -> i64 {
    if constexpr (kFull) {
      return static_cast<u32>(t) - static_cast<u32>(mt) * static_cast<u32>(k_tiles);
    }
    return t - mt * k_tiles;
  };

  // Word offset in the swizzled raw tile of this thread's chunk i (pass i / CH, chunk column
  // c + (i % CH) * LPR). RPP a multiple of 16 (a power of two): ((r >> 4) & 7) of row
  // r = r_base + ip * RPP is that of r_base XOR that of ip * RPP (no carries), so the offset is
  // one XOR with a constant per pass from a per-thread base.
  const auto chunk_word = [&](int i) -> int {
    const int ip = i / CH;
    const int r = r_base + ip * RPP;
    if constexpr (RPP % 16 == 0) {
      const int swz0 = ((r_base >> 4) & 7) << 2;
      const int base = r_base * WPR + (((c + i % CH * LPR) * 4) ^ swz0);
      return (base ^ (((ip * RPP / 16) & 7) << 2)) + ip * RPP * WPR;
    } else {
      return r * WPR + (((c + i % CH * LPR) * 4) ^ (((r >> 4) & 7) << 2));
    }
  };
  // kAsync: start the copies of tile t's chunks of this thread into raw-tile buffer `buf`.
  const auto copy_tile = [&](i64 t, u32* buf) {
    const i64 t_mt = tile_mt(t);
    const i64 t_col = tile_kt(t, t_mt) * kTile + c * VEC;
    const ChunkSrc src = chunk_src<IN, RPP>(xb, M, ldx, t_mt * kTile, t_col, r_base, x_vec);
#pragma unroll
    for (int i = 0; i < PASSES * CH; ++i) {
      cp_async_v4(buf + chunk_word(i), src.p + (i / CH) * src.step + (i % CH) * DC * kBytes);
    }
  };

  uint4 v[PASSES * CH];  // v[i * CH + j]: pass i, chunk column c + j * LPR
  if constexpr (kPipe) {  // the first tile; later ones are prefetched during the previous one
    const i64 t0 = blockIdx.x;
    const i64 m0 = tile_mt(t0) * kTile;
    const i64 col = tile_kt(t0, tile_mt(t0)) * kTile + c * VEC;
    const ChunkSrc src = chunk_src<IN, RPP>(xb, M, ldx, m0, col, r_base, x_vec);
#pragma unroll
    for (int i = 0; i < PASSES * CH; ++i) v[i] = load_chunk<IN, RPP, kFull>(src, K, i / CH, i % CH * DC);
  }

  if constexpr (kAsync) {  // the first tile; later ones are copied during the previous one
    if (blockIdx.x < tiles) copy_tile(blockIdx.x, smem);
    cp_async_commit_wait<1>();  // (closes the first tile's group; waits for nothing yet)
  }

  // FULL without LOOP: the host launches one CTA per tile, so tile < tiles needs no test.
  // (`iter`: this CTA's tile count so far; kAsync's buffer parity)
#pragma unroll 1
  for (i64 tile = blockIdx.x, iter = 0; (kFull && !KN::kLoop) || tile < tiles;
       tile += stride, ++iter) {
    const i64 mt = tile_mt(tile);
    const i64 kt = tile_kt(tile, mt);
    const i64 m0 = mt * kTile;
    const i64 k0 = kt * kTile;
    const i64 col = k0 + c * VEC;
    ChunkSrc next;  // the next tile of this CTA (past the end: its loads read nothing)
    if constexpr (kPipe) {
      const i64 nt = tile + stride;
      const i64 n_mt = tile_mt(nt);
      const i64 n_col = tile_kt(nt, n_mt) * kTile + c * VEC;
      next = chunk_src<IN, RPP>(xb, M, ldx, n_mt * kTile, n_col, r_base, x_vec);
    } else if constexpr (!kAsync) {
      const ChunkSrc src = chunk_src<IN, RPP>(xb, M, ldx, m0, col, r_base, x_vec);
#pragma unroll
      for (int i = 0; i < PASSES * CH; ++i) v[i] = load_chunk<IN, RPP, kFull>(src, K, i / CH, i % CH * DC);
    }
    if constexpr (COL || BLOCK) {
      // The previous tile's column pass (shared tile) and block amax (red) are done everywhere.
      if (tile != blockIdx.x) __syncthreads();
    }
    // The raw tile the column pass reads (kAsync: this tile's buffer).
    u32* const tile_s = kAsync ? smem + (iter & 1) * kTileWords : smem;
    if constexpr (kAsync) {
      // The other buffer was last read by the previous tile's passes (done: the barrier above):
      // copy the next tile into it, then wait for this tile's copies (all but the newest group)
      // and for every thread's (the barrier), and take this thread's chunks for the row pass.
      const i64 nt = tile + stride;
      if (nt < tiles) copy_tile(nt, smem + ((iter & 1) ^ 1) * kTileWords);
      cp_async_commit_wait<1>();
      __syncthreads();
#pragma unroll
      for (int i = 0; i < PASSES * CH; ++i) v[i] = lds_v4(tile_s + chunk_word(i));
    }

    // ---- stage the raw tile in shared memory (swizzled) for the column pass ----
    if constexpr (COL && !kByteT && !kAsync) {
#pragma unroll
      for (int i = 0; i < PASSES * CH; ++i) sts_v4(smem + chunk_word(i), v[i]);
    }

    Scale block_scale;
    if constexpr (BLOCK) {
      u32 amax = 0u;
      if constexpr (kAmax16) {
        amax = widen_abs16<IN>(fold16x2(chunks_abs_max16x2<PASSES * CH>(v)) & 0xffffu);
      } else {
#pragma unroll
        for (int i = 0; i < PASSES * CH; ++i) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) amax = max(amax, abs_bits(unpack<IN>(v[i], e)));
        }
      }
      amax = warp_max<32>(amax);
      if ((tid & 31) == 0) red[tid >> 5] = amax;
      __syncthreads();
      amax = red[0];
#pragma unroll
      for (int wi = 1; wi < kWarps; ++wi) amax = max(amax, red[wi]);
      block_scale = make_scale<POW2, kFastSf>(amax);
      if (tid == 0) st_f32(sf + mt * sf_s0 + kt * sf_s1, block_scale.sf);
    } else if constexpr (COL && !kAsync) {
      __syncthreads();  // the column pass reads other threads' chunks
    }
    if constexpr (kPipe && !ROW) {  // the chunks are in shared memory: fetch the next tile
#pragma unroll
      for (int i = 0; i < PASSES * CH; ++i) v[i] = load_chunk<IN, RPP>(next, K, i / CH, i % CH * DC);
    }

    // ---- row pass (1x128 tiles, or the block scale) from registers ----
    if constexpr (ROW) {
      // Pass i's scale goes to sf_row + i * sf_step, its bytes to q_row + i * q_step + (element
      // offset): the 64-bit address math once per tile, not per pass.
      float* const sf_row = sf + (m0 + r_base) * sf_s0 + kt * sf_s1;
      const i64 sf_step = RPP * sf_s0;
      unsigned char* const q_row = q + (m0 + r_base) * K + col;
      const i64 q_step = RPP * K;
      // kRowPairs (16-bit input, 1x128, no PIPE): the 16-bit |h| maxima of rows 2k and 2k + 1
      // share one u32 (low / high lane) and so one shuffle reduction over the row's lanes.
      constexpr bool kRowPairs = kAmax16 && !BLOCK && !kPipe;
      u32 pair_max[(PASSES + 1) / 2];
      if constexpr (kRowPairs) {
#pragma unroll
        for (int k = 0; k < (PASSES + 1) / 2; ++k) {
          const u32 a = chunks_abs_max16x2<CH>(v + 2 * k * CH);
          u32 m;
          if (2 * k + 1 < PASSES) {
            const u32 b = chunks_abs_max16x2<CH>(v + (2 * k + 1) * CH);
            m = max_u16x2(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));
          } else {
            m = fold16x2(a);
          }
          pair_max[k] = warp_max_u16x2<LPR>(m);
        }
      }
#pragma unroll
      for (int i = 0; i < PASSES; ++i) {
        const i64 row = m0 + r_base + i * RPP;
        constexpr int N = CH * VEC;  // this lane's elements of the row
        float f[N];
#pragma unroll
        for (int j = 0; j < CH; ++j) {
#pragma unroll
          for (int e = 0; e < VEC; ++e) f[j * VEC + e] = unpack<IN>(v[i * CH + j], e);
        }
        u32 m16 = 0u;  // kAmax16: the chunks' 16-bit |h| maxima per lane, before the next loads
        if constexpr (kAmax16 && !kRowPairs) m16 = chunks_abs_max16x2<CH>(v + i * CH);
        if constexpr (kPipe) {
#pragma unroll
          for (int j = 0; j < CH; ++j) v[i * CH + j] = load_chunk<IN, RPP>(next, K, i, j * DC);
        }
        const Scale s = tile_scale<BLOCK, POW2, kFastSf>(block_scale, [&] {
          if constexpr (kRowPairs) {
            return widen_abs16<IN>(i % 2 ? pair_max[i / 2] >> 16 : pair_max[i / 2] & 0xffffu);
          } else if constexpr (kAmax16) {
            return widen_abs16<IN>(warp_max_u16x2<LPR>(fold16x2(m16)) & 0xffffu);
          }
          u32 amax = 0u;
#pragma unroll
          for (int e = 0; e < N; ++e) amax = max(amax, abs_bits(f[e]));
          return warp_max<LPR>(amax);  // the LPR lanes of this row (aligned lane groups)
        });
        if constexpr (!BLOCK) st_f32_if(c == 0 && (kFull || row < M), sf_row + i * sf_step, s.sf);
        u32 packed[N / 4];
        quantize<N, kMul, kOneStep>(f, s, packed);
#pragma unroll
        for (int j = 0; j < CH; ++j) {
          const u32* pk = packed + j * (VEC / 4);  // chunk column c + j * LPR
          const int cc = c + j * LPR;
          if constexpr (kByteT) {  // this chunk's bytes: words VEC / 4 * cc .. of tile row r
            const int r = r_base + i * RPP;
            const int w = ((VEC / 4) * cc) ^ (((r >> 4) & 7) << 2);
            if constexpr (VEC == 8) {
              sts_v2(smem + r * (kTile / 4) + w, make_uint2(pk[0], pk[1]));
            } else {
              smem[r * (kTile / 4) + w] = pk[0];
            }
          }
          const i64 cj = col + j * DC;
          if (kFull || row < M) {
            unsigned char* dst = q_row + i * q_step + j * DC;
            if (kFull || (q_vec && cj + VEC <= K)) {
              if constexpr (VEC == 8) {
                st_v2(dst, make_uint2(pk[0], pk[1]));
              } else {
                st_u32(dst, pk[0]);
              }
            } else {
#pragma unroll
              for (int e = 0; e < VEC; ++e) {
                if (cj + e < K) st_u8(dst + e, static_cast<unsigned char>(pk[e / 4] >> (8 * (e % 4))));
              }
            }
          }
        }
      }
    }

    // ---- column pass, kByteT: transpose the row pass's FP8 bytes ----
    if constexpr (kByteT) {
      __syncthreads();  // every row's bytes are in shared memory
      const int lane = tid & 31;
      const int g = lane & 7;  // tile rows 16g .. 16g + 15
      const i64 m = m0 + 16 * g;
#pragma unroll 1
      for (int p = (lane >> 3) + 4 * (tid >> 5); p < kTile / 4; p += 4 * kWarps) {
        u32 wd[16];  // wd[j]: columns 4p .. 4p + 3 of tile row 16g + j
#pragma unroll
        for (int j = 0; j < 16; ++j) wd[j] = smem[(16 * g + j) * (kTile / 4) + (p ^ (g << 2))];
        u32 out[4][4];  // out[e][t]: column 4p + e, rows 16g + 4t .. 16g + 4t + 3
#pragma unroll
        for (int t = 0; t < 4; ++t) {
          const u32 lo_ab = __byte_perm(wd[4 * t], wd[4 * t + 1], 0x5140);  // a0 b0 a1 b1
          const u32 hi_ab = __byte_perm(wd[4 * t], wd[4 * t + 1], 0x7362);  // a2 b2 a3 b3
          const u32 lo_cd = __byte_perm(wd[4 * t + 2], wd[4 * t + 3], 0x5140);
          const u32 hi_cd = __byte_perm(wd[4 * t + 2], wd[4 * t + 3], 0x7362);
          out[0][t] = __byte_perm(lo_ab, lo_cd, 0x5410);  // a0 b0 c0 d0
          out[1][t] = __byte_perm(lo_ab, lo_cd, 0x7632);  // a1 b1 c1 d1
          out[2][t] = __byte_perm(hi_ab, hi_cd, 0x5410);
          out[3][t] = __byte_perm(hi_ab, hi_cd, 0x7632);
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const i64 k = k0 + 4 * p + e;
          if (kFull || (k < K && m < M)) {
            unsigned char* dst = qt + k * M + m;
            if (kFull || (qt_vec && m + 16 <= M)) {
              st_v4(dst, make_uint4(out[e][0], out[e][1], out[e][2], out[e][3]));
            } else {
#pragma unroll
              for (int j = 0; j < 16; ++j) {
                if (m + j < M) st_u8(dst + j, static_cast<unsigned char>(out[e][j / 4] >> (8 * (j % 4))));
              }
            }
          }
        }
      }
    }

    // ---- column pass (128x1 tiles, or the block scale), stored transposed ----
    if constexpr (COL && !kByteT) {
      const int lane = tid & 31;
      const int warp = tid >> 5;
      const int g = lane & 7;  // row group: tile rows 16g .. 16g + 15
      const i64 m = m0 + 16 * g;
      // Channel k = k_first + pass * K_PASS + e: its bytes at qt_col + pass * K_PASS * M + e * M,
      // its scale at sft_col + (pass * K_PASS + e) * sft_s0 (64-bit address math once per tile).
      constexpr int K_PASS = 4 * kWarps * EPW;
      const i64 k_first = k0 + ((lane >> 3) + 4 * warp) * EPW;
      unsigned char* qt_col = qt + k_first * M + m;
      float* sft_col = sft + k_first * sft_s0 + mt * sft_s1;
      const i64 qt_pass = K_PASS * M;
      const i64 sft_pass = K_PASS * sft_s0;
      constexpr int kColUnroll = kFull ? WPR / (4 * kWarps) : 1;
#pragma unroll kColUnroll
      for (int pass = 0; pass < WPR / (4 * kWarps); ++pass) {
        const int p = (lane >> 3) + 4 * (warp + kWarps * pass);  // word column
        // Without PIPE the 16 words are read once for both 16-bit halves; with PIPE (the next
        // tile's chunks hold registers) they are re-read per half, halving the live floats.
        constexpr bool kSplit = kPipe && EPW > 1;
        u32 wd[16];
        if constexpr (!kSplit || (kAmax16 && !BLOCK)) {
#pragma unroll
          for (int j = 0; j < 16; ++j) wd[j] = tile_s[(16 * g + j) * WPR + (p ^ (g << 2))];
        }
        u32 amax2 = 0u;  // kAmax16: the |h| maxima of word column p's two columns, per half
        if constexpr (kAmax16 && !BLOCK) {
          // reduced over the 8 lanes g = 0..7 of this word column
          amax2 = warp_max_u16x2<8>(abs_max16x2<16>(wd));
        }
#pragma unroll
        for (int e = 0; e < EPW; ++e) {
          constexpr bool kHaveWords = !kSplit || (kAmax16 && !BLOCK);  // wd read above
          if (kSplit && (e > 0 || !kHaveWords)) {
#pragma unroll
            for (int j = 0; j < 16; ++j) wd[j] = tile_s[(16 * g + j) * WPR + (p ^ (g << 2))];
          }
          float fe[16];  // ((r >> 4) & 7) == g for tile rows r = 16g + j
#pragma unroll
          for (int j = 0; j < 16; ++j) fe[j] = unpack_word<IN>(wd[j], e);
          const i64 k = k0 + p * EPW + e;
          const Scale s = tile_scale<BLOCK, POW2, kFastSf>(block_scale, [&] {
            if constexpr (kAmax16) return widen_abs16<IN>(e ? amax2 >> 16 : amax2 & 0xffffu);
            u32 amax = 0u;
#pragma unroll
            for (int j = 0; j < 16; ++j) amax = max(amax, abs_bits(fe[j]));
            return warp_max<8>(amax);  // the 8 lanes g = 0..7 of this word column
          });
          if constexpr (!BLOCK) st_f32_if(g == 0 && (kFull || k < K), sft_col + e * sft_s0, s.sf);
          u32 w[4];
          quantize<16, kMul, kOneStep>(fe, s, w);
          if (kFull || (k < K && m < M)) {
            // (qt_col: FULL only; as a live register pair it made the default variant spill)
            unsigned char* dst = kFull ? qt_col + e * M : qt + k * M + m;
            if (kFull || (qt_vec && m + 16 <= M)) {
              st_v4(dst, make_uint4(w[0], w[1], w[2], w[3]));
            } else {
#pragma unroll
              for (int j = 0; j < 16; ++j) {
                if (m + j < M) st_u8(dst + j, static_cast<unsigned char>(w[j / 4] >> (8 * (j % 4))));
              }
            }
          }
        }
        qt_col += qt_pass;
        sft_col += sft_pass;
      }
    }
    if constexpr (!KN::kLoop) break;  // one tile per CTA
  }
  // The next kernel may launch once every CTA got here: in the last wave, not at the start,
  // where its CTAs could take SMs this grid's later waves need (a GEMM's take a whole SM and
  // wait there for this grid's end). Let in at the start, it makes Fp8Linear 1.7-2.3% slower
  // with PDL than without.
  grid_dependency_launch();
}

}  // namespace ptxtrain_quant
