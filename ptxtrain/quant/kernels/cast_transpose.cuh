// ptxtrain/quant/kernels/cast_transpose.cuh — FP8 (E4M3) quantizers that read a [M, K] tensor
// once per 128x128 tile and write its 1x128 (row), 128x1 (column, stored transposed) or 128x128
// (block) quantization, bit-exact with ptxtrain/quant/ref.py. Compiled through NVRTC by
// ptxtrain/quant/cuda.py (no CUDA toolkit headers: bf16 / fp16 are handled as raw bits).
//
// Layout of the work (one CTA = 256 threads = one 128x128 tile, tiles numbered K-fastest):
//   load    every thread issues PASSES 16-byte loads: chunk c = tid % CPR of rows
//           tid / CPR + i * RPP (CPR = 16-byte chunks per tile row, RPP = rows per pass), so a
//           warp reads whole 256 / 512-byte row segments. Out-of-range rows / columns read 0,
//           which is the reference's zero padding inside the amax.
//   row     (ROW) quantized from registers: the CPR threads of a row reduce its amax with warp
//           shuffles; each stores its 8 (16-bit input) or 4 (fp32) FP8 bytes, coalesced.
//   column  (COL) the raw tile goes to shared memory, [128][WPR] 32-bit words, word w of row r
//           at r * WPR + (w ^ (((r >> 4) & 7) << 2)) (an XOR swizzle on bits 2..4). Then a
//           thread takes one word column p (2 bf16/fp16 columns or 1 fp32 column) of 16
//           consecutive rows 16g..16g+15; lane = g + 8 * (p % 4), so in each 32-bit shared load
//           a warp touches rows 16g + j (g = 0..7) of 4 consecutive word columns, and the swizzle
//           spreads these over the 32 banks. The 8 lanes of a column reduce its amax with
//           shuffles and each stores 16 FP8 bytes of the transposed row k: 128 contiguous bytes
//           per column and warp.
//   block   (BLOCK mode) one amax for the whole tile (warp shuffles, then 8 warp maxima through
//           shared memory); the row and column outputs then use that one scale.
//
// Scale and division, as ref.py: amax in fp32 from the integer bits of |x| (NaN above inf, so a
// NaN anywhere gives the canonical NaN like torch.amax), clamped below at 1e-4, sf = amax / 448
// (div.rn), optional power-of-two rounding, then x / sf correctly rounded: q0 = x * y with
// y = rcp.rn(sf) and two residual corrections q <- q - (q * sf - x) * y (FMA, exact residual):
// the first brings q within one ulp of x / sf, the second makes it the correctly rounded
// quotient (Markstein's theorem; below 2^-126 it may be off by a subnormal ulp, which E4M3,
// whose smallest step is 2^-9, rounds to the same ±0). The signs are placed so that x = -0
// gives -0. Tiles with a non-finite scale use div.rn directly (one branch per tile row/column). cvt.rn.satfinite.e4m3x2.f32 rounds to nearest even.
//
// PTXTRAIN_QUANT_HOST_EMULATION: compile this file as host C++ (g++ -std=c++20) against the
// shims of host_emulation.hpp, which run each CTA's 256 threads as OS threads (barriers for
// __syncthreads and shuffles) and check the alignment of every vector access; the test suite
// uses it to run these kernels bit for bit against ref.py without a GPU.
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

__device__ __forceinline__ void st_v2(void* ptr, uint2 v) { *static_cast<uint2*>(ptr) = v; }
__device__ __forceinline__ void st_u32(void* ptr, u32 v) { *static_cast<u32*>(ptr) = v; }
__device__ __forceinline__ void st_f32(float* ptr, float v) { *ptr = v; }
__device__ __forceinline__ void st_u8(unsigned char* ptr, unsigned char v) { *ptr = v; }
__device__ __forceinline__ void sts_v4(void* ptr, uint4 v) { *static_cast<uint4*>(ptr) = v; }
__device__ __forceinline__ u32 ld_u32(const void* ptr) { return *static_cast<const u32*>(ptr); }
__device__ __forceinline__ u32 ld_u16(const void* ptr) { return *static_cast<const u16*>(ptr); }
#endif

constexpr int kTile = 128;     // tile edge (DeepSeek-V3's 128)
constexpr int kThreads = 256;  // threads per CTA
constexpr u32 kEpsBits = 0x38d1b717u;  // bits of fp32(1e-4)
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

// amax bits (max of |x| bits over a tile) -> fp32 dequantization factor, as ref.py.
template <bool POW2>
__device__ __forceinline__ float scale_from_amax_bits(u32 amax_bits) {
  if (amax_bits > 0x7f800000u) amax_bits = kCanonicalNan;  // NaN: torch.amax's canonical NaN
  if (amax_bits < kEpsBits) amax_bits = kEpsBits;             // clamp(min=1e-4); NaN stays
  float sf = __fdiv_rn(__uint_as_float(amax_bits), 448.0f);
  if constexpr (POW2) {
    const u32 bits = __float_as_uint(sf);
    if ((bits & 0x7f800000u) != 0x7f800000u) {
      // sf > 0 is normal: adding 2^23 - 1 carries into the exponent unless the mantissa is 0.
      sf = __uint_as_float((bits + 0x7fffffu) & 0x7f800000u);
    }
  }
  return sf;
}

struct Scale {
  float sf;  // dequantization factor
  float y;   // rcp.rn(sf)
  bool finite;
};

template <bool POW2>
__device__ __forceinline__ Scale make_scale(u32 amax_bits) {
  Scale s;
  s.sf = scale_from_amax_bits<POW2>(amax_bits);
  s.y = __frcp_rn(s.sf);
  s.finite = (__float_as_uint(s.sf) & 0x7f800000u) != 0x7f800000u;
  return s;
}

// RN_fp32(x / sf) for a finite sf, bit-exact with IEEE division (see the file comment).
__device__ __forceinline__ float quotient(float x, const Scale& s) {
  float q = __fmul_rn(x, s.y);
  q = __fmaf_rn(__fmaf_rn(q, s.sf, -x), -s.y, q);
  q = __fmaf_rn(__fmaf_rn(q, s.sf, -x), -s.y, q);
  return q;
}

// Four quotients -> four E4M3 bytes, element 0 in the lowest byte (lowest address).
__device__ __forceinline__ u32 pack4(float a, float b, float c, float d) {
  return static_cast<u32>(ptxtrain::cvt_e4m3x2(a, b)) |
         (static_cast<u32>(ptxtrain::cvt_e4m3x2(c, d)) << 16);
}

// N values (N % 4 == 0) quantized with one scale into N / 4 words of E4M3 bytes. The branch on
// the scale is taken once for all N (a non-finite scale, from an inf / NaN input, uses div.rn).
template <int N>
__device__ __forceinline__ void quantize(const float (&f)[N], const Scale& s, u32 (&out)[N / 4]) {
  if (s.finite) {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      out[j] = pack4(quotient(f[4 * j], s), quotient(f[4 * j + 1], s),
                     quotient(f[4 * j + 2], s), quotient(f[4 * j + 3], s));
    }
  } else {
#pragma unroll
    for (int j = 0; j < N / 4; ++j) {
      out[j] = pack4(__fdiv_rn(f[4 * j], s.sf), __fdiv_rn(f[4 * j + 1], s.sf),
                     __fdiv_rn(f[4 * j + 2], s.sf), __fdiv_rn(f[4 * j + 3], s.sf));
    }
  }
}

template <int WIDTH>
__device__ __forceinline__ u32 warp_max(u32 v) {
#pragma unroll
  for (int o = WIDTH / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The kernel. IN: input kind; BLOCK: one scale per 128x128 tile (else 1x128 rows / 128x1
// columns); ROW: write q [M, K]; COL: write qt [K, M]; POW2: power-of-two scales.
//
// Arguments: x (row stride ldx elements, unit column stride); q (row stride K) and its scales sf
// (element (i, j) at sf[i * sf_s0 + j * sf_s1]); qt (row stride M) and sft (strides sft_s0,
// sft_s1; unused in BLOCK mode, whose transposed scales the host makes). vec_flags: bit 0 = x is
// 16-byte aligned with a 16-byte multiple row stride; bit 1 = q's rows allow 8 / 4-byte stores
// (K % 8 == 0 for 16-bit input, K % 4 == 0 for fp32); bit 2 = qt's rows allow 16-byte stores
// (M % 16 == 0). Pointers the mode does not use may be anything (never dereferenced).
template <int IN, bool BLOCK, bool ROW, bool COL, bool POW2>
__global__ void __launch_bounds__(kThreads, In<IN>::kBytes == 2 ? 3 : 2)
    cast_fp8(const void* __restrict__ x_ptr, unsigned char* __restrict__ q, float* __restrict__ sf,
             unsigned char* __restrict__ qt, float* __restrict__ sft, i64 M, i64 K, i64 ldx,
             i64 sf_s0, i64 sf_s1, i64 sft_s0, i64 sft_s1, i64 k_tiles, int vec_flags) {
  constexpr int kBytes = In<IN>::kBytes;
  constexpr int VEC = 16 / kBytes;         // elements per 16-byte chunk
  constexpr int CPR = kTile / VEC;         // chunks per tile row: 16 or 32
  constexpr int RPP = kThreads / CPR;      // rows per load pass: 16 or 8
  constexpr int PASSES = kTile / RPP;      // 8 or 16
  constexpr int WPR = kTile * kBytes / 4;  // 32-bit words per tile row: 64 or 128
  constexpr int EPW = 4 / kBytes;          // elements per word: 2 or 1

  PTXTRAIN_DYNAMIC_SMEM(u32, smem);  // [128][WPR] when COL, then 8 warp maxima
  u32* red = smem + (COL ? kTile * WPR : 0);

  const int tid = threadIdx.x;
  const i64 tile = blockIdx.x;
  const i64 mt = tile / k_tiles;
  const i64 kt = tile - mt * k_tiles;
  const i64 m0 = mt * kTile;
  const i64 k0 = kt * kTile;
  const bool x_vec = vec_flags & 1;
  const bool q_vec = vec_flags & 2;
  const bool qt_vec = vec_flags & 4;

  // ---- load: 16-byte chunks, zeros outside [M, K] ----
  const int c = tid % CPR;
  const int r_base = tid / CPR;
  const i64 col = k0 + c * VEC;
  const char* xb = static_cast<const char*>(x_ptr);
  uint4 v[PASSES];
#pragma unroll
  for (int i = 0; i < PASSES; ++i) {
    const i64 row = m0 + r_base + i * RPP;
    v[i] = make_uint4(0u, 0u, 0u, 0u);
    if (row < M) {
      const char* p = xb + (row * ldx + col) * kBytes;
      if (x_vec && col + VEC <= K) {
        v[i] = ld_stream_v4(p);
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
        v[i] = make_uint4(w[0], w[1], w[2], w[3]);
      }
    }
  }

  // ---- stage the raw tile in shared memory (swizzled) for the column pass ----
  if constexpr (COL) {
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const int r = r_base + i * RPP;
      const int w = (c * 4) ^ (((r >> 4) & 7) << 2);
      sts_v4(smem + r * WPR + w, v[i]);
    }
  }

  Scale block_scale;
  if constexpr (BLOCK) {
    u32 amax = 0u;
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) amax = max(amax, abs_bits(unpack<IN>(v[i], e)));
    }
    amax = warp_max<32>(amax);
    if ((tid & 31) == 0) red[tid >> 5] = amax;
    __syncthreads();
    amax = red[0];
#pragma unroll
    for (int wi = 1; wi < kThreads / 32; ++wi) amax = max(amax, red[wi]);
    block_scale = make_scale<POW2>(amax);
    if (tid == 0) st_f32(sf + mt * sf_s0 + kt * sf_s1, block_scale.sf);
  } else if constexpr (COL) {
    __syncthreads();  // the column pass reads other threads' chunks
  }

  // ---- row pass (1x128 tiles, or the block scale) from registers ----
  if constexpr (ROW) {
#pragma unroll
    for (int i = 0; i < PASSES; ++i) {
      const i64 row = m0 + r_base + i * RPP;
      float f[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) f[e] = unpack<IN>(v[i], e);
      Scale s;
      if constexpr (BLOCK) {
        s = block_scale;
      } else {
        u32 amax = 0u;
#pragma unroll
        for (int e = 0; e < VEC; ++e) amax = max(amax, abs_bits(f[e]));
        amax = warp_max<CPR>(amax);  // the CPR lanes of this row (aligned lane groups)
        s = make_scale<POW2>(amax);
        if (c == 0 && row < M) st_f32(sf + row * sf_s0 + kt * sf_s1, s.sf);
      }
      u32 packed[VEC / 4];
      quantize<VEC>(f, s, packed);
      if (row < M) {
        unsigned char* dst = q + row * K + col;
        if (q_vec && col + VEC <= K) {
          if constexpr (VEC == 8) {
            st_v2(dst, make_uint2(packed[0], packed[1]));
          } else {
            st_u32(dst, packed[0]);
          }
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) {
            if (col + e < K) st_u8(dst + e, static_cast<unsigned char>(packed[e / 4] >> (8 * (e % 4))));
          }
        }
      }
    }
  }

  // ---- column pass (128x1 tiles, or the block scale), stored transposed ----
  if constexpr (COL) {
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g = lane & 7;  // row group: tile rows 16g .. 16g + 15
    const i64 m = m0 + 16 * g;
#pragma unroll 1
    for (int pass = 0; pass < WPR / 32; ++pass) {
      const int p = (lane >> 3) + 4 * (warp + 8 * pass);  // word column
      float f[EPW][16];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int r = 16 * g + j;
        const u32 word = smem[r * WPR + (p ^ (g << 2))];  // ((r >> 4) & 7) == g
#pragma unroll
        for (int e = 0; e < EPW; ++e) f[e][j] = unpack_word<IN>(word, e);
      }
#pragma unroll
      for (int e = 0; e < EPW; ++e) {
        const i64 k = k0 + p * EPW + e;
        Scale s;
        if constexpr (BLOCK) {
          s = block_scale;
        } else {
          u32 amax = 0u;
#pragma unroll
          for (int j = 0; j < 16; ++j) amax = max(amax, abs_bits(f[e][j]));
          amax = warp_max<8>(amax);  // the 8 lanes g = 0..7 of this word column
          s = make_scale<POW2>(amax);
          if (g == 0 && k < K) st_f32(sft + k * sft_s0 + mt * sft_s1, s.sf);
        }
        u32 w[4];
        quantize<16>(f[e], s, w);
        if (k < K && m < M) {
          unsigned char* dst = qt + k * M + m;
          if (qt_vec && m + 16 <= M) {
            st_v4(dst, make_uint4(w[0], w[1], w[2], w[3]));
          } else {
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              if (m + j < M) st_u8(dst + j, static_cast<unsigned char>(w[j / 4] >> (8 * (j % 4))));
            }
          }
        }
      }
    }
  }
}

}  // namespace ptxtrain_quant
