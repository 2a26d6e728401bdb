// ptxtrain/quant/kernels/cast_async.cuh — the 128x1 (transposed) and fused 1x128 + 128x1 FP8
// quantizers of 16-bit input with the loads of the next tile in flight while this one is
// quantized: a persistent CTA of 256 threads walks tiles blockIdx.x, + gridDim.x, ..., and
// copies each 128x128 tile global -> shared memory with cp.async (two stages: the next tile
// lands while the current one is read). cast_transpose.cuh's kernel instead loads a tile into
// registers, quantizes it and only then loads the next, so the loads of a CTA and its arithmetic
// alternate, and reached 0.59 (both) / 0.73 (128x1) of copy bandwidth at 4096 x 7168 on an H200.
//
// Same arithmetic as cast_transpose.cuh's "lean" variant, with its helpers (AMAX16 bit maxima,
// FAST_SF, MUL_POW2 for power-of-two scales, correctly rounded x / sf), so bit-exact with
// ptxtrain/quant/ref.py. Only the aligned case: x 16-byte aligned with 16-byte rows, K % 8 == 0,
// M % 16 == 0 (vec_flags == 7); ptxtrain/quant/cuda.py sends everything else to cast_fp8.
//
// Shared memory, per stage: the tile's 128 rows x 16 chunks of 16 bytes, chunk c of row r at
// r * 16 + (c ^ swz(r)), swz(r) = ((r >> 4) & 7) ^ (r & 3). The row pass (2 threads a row, 8
// chunks each, the second thread starting 4 chunks later) and the column pass (a thread: one
// 32-bit word column of 16 rows 16g..16g+15, lane = g + 8 * (word % 4)) then hit 8 distinct
// 16-byte bank groups per quarter-warp and 32 distinct banks per warp, respectively.
#pragma once

#include "cast_transpose.cuh"

namespace ptxtrain_quant {

constexpr int kAsyncThreads = 256;
constexpr int kAsyncCtas = 3;                      // per SM: 3 x 64 KB of shared memory
constexpr int kAsyncStageBytes = kTile * kTile * 2;  // one 16-bit tile: 32 KB

__device__ __forceinline__ int async_swz(int r) { return ((r >> 4) & 7) ^ (r & 3); }

// 16 bytes global -> shared, zero-filled when !valid (rows past M, columns past K).
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
__device__ __forceinline__ void cp_async_wait_1() {
  asm volatile("cp.async.wait_group 1;" ::: "memory");
}

// Issue the copies of tile `tile` (if it exists) into the stage at shared address `stage`.
__device__ __forceinline__ void async_issue(u32 stage, const char* xb, i64 tile, i64 tiles,
                                           i64 M, i64 K, i64 ldx, i64 k_tiles, int tid) {
  if (tile >= tiles) return;
  const i64 m0 = tile / k_tiles * kTile;
  const i64 k0 = (tile - tile / k_tiles * k_tiles) * kTile;
#pragma unroll
  for (int i = 0; i < kTile * kTile * 2 / 16 / kAsyncThreads; ++i) {
    const int q = tid + kAsyncThreads * i;  // chunk q: row q / 16, chunk q % 16
    const int r = q >> 4, c = q & 15;
    const i64 row = m0 + r, col = k0 + c * 8;
    const bool valid = row < M && col < K;
    const char* src = valid ? xb + (row * ldx + col) * 2 : xb;
    cp_async_16(stage + (r * 16 + (c ^ async_swz(r))) * 16, src, valid);
  }
}

// IN: kBF16 or kF16. ROW: also write q [M, K] (1x128); COL: qt [K, M] (128x1). The arguments
// are cast_fp8's (vec_flags must be 7). Dynamic shared memory: 2 * kAsyncStageBytes.
template <int IN, bool ROW, bool COL, bool POW2>
__global__ void __launch_bounds__(kAsyncThreads, kAsyncCtas)
    cast_fp8_async(const void* __restrict__ x_ptr, unsigned char* __restrict__ q,
                   float* __restrict__ sf, unsigned char* __restrict__ qt,
                   float* __restrict__ sft, i64 M, i64 K, i64 ldx, i64 sf_s0, i64 sf_s1,
                   i64 sft_s0, i64 sft_s1, i64 k_tiles, int vec_flags) {
  static_assert(IN == kBF16 || IN == kF16, "16-bit input only");
  constexpr bool kMul = POW2;  // power-of-two scales: one exact multiply (see quantize)
  constexpr int kWarps = kAsyncThreads / 32;
  PTXTRAIN_DYNAMIC_SMEM(uint4, smem);
  const u32 smem0 = ptxtrain::smem_addr(smem);
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const i64 tiles = (M + kTile - 1) / kTile * k_tiles;
  const char* xb = static_cast<const char*>(x_ptr);
  (void)vec_flags;

  async_issue(smem0, xb, blockIdx.x, tiles, M, K, ldx, k_tiles, tid);
  cp_async_commit();
  int it = 0;
#pragma unroll 1
  for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x, ++it) {
    // The next tile goes to the other stage, read by the previous iteration (synced below).
    async_issue(smem0 + ((it + 1) & 1) * kAsyncStageBytes, xb, tile + gridDim.x, tiles, M, K,
                ldx, k_tiles, tid);
    cp_async_commit();
    cp_async_wait_1();  // every group but the newest: this tile's copies have landed
    __syncthreads();
    const uint4* st = smem + (it & 1) * (kAsyncStageBytes / 16);
    const i64 mt = tile / k_tiles;
    const i64 kt = tile - mt * k_tiles;
    const i64 m0 = mt * kTile, k0 = kt * kTile;

    // ---- row pass: thread = (row r, half h), chunks h*8 + (j + 4h) % 8 ----
    if constexpr (ROW) {
      const int r = tid >> 1, h = tid & 1;
      const int sw = async_swz(r);
      u32 amax = 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = h * 8 + ((j + 4 * h) & 7);
        amax = max(amax, chunk_max16(st[r * 16 + (c ^ sw)]));
      }
      amax = max(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // the row's other half
      const Scale s = make_scale<POW2, true>(widen_abs16<IN>(amax));
      const i64 row = m0 + r;
      if (h == 0 && row < M) st_f32(sf + row * sf_s0 + kt * sf_s1, s.sf);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = h * 8 + ((j + 4 * h) & 7);
        const uint4 v = st[r * 16 + (c ^ sw)];
        float f[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) f[e] = unpack<IN>(v, e);
        u32 packed[2];
        quantize<8, kMul>(f, s, packed);
        const i64 col = k0 + c * 8;
        if (row < M && col < K) st_v2(q + row * K + col, make_uint2(packed[0], packed[1]));
      }
    }

    // ---- column pass: word column p (2 columns) of rows 16g .. 16g + 15 ----
    if constexpr (COL) {
      const u32* sw32 = reinterpret_cast<const u32*>(st);
      const int g = lane & 7;
      const i64 m = m0 + 16 * g;
#pragma unroll 1
      for (int pass = 0; pass < 64 / (4 * kWarps); ++pass) {
        const int p = (lane >> 3) + 4 * (warp + kWarps * pass);  // word column 0..63
        u32 wd[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int r = 16 * g + j;
          wd[j] = sw32[r * 64 + (((p >> 2) ^ async_swz(r)) << 2) + (p & 3)];
        }
        u32 amax2 = 0u;
#pragma unroll
        for (int j = 0; j < 16; ++j) amax2 = max_u16x2(amax2, wd[j] & 0x7fff7fffu);
        amax2 = warp_max_u16x2<8>(amax2);  // the 8 lanes g = 0..7 of this word column
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float fe[16];
#pragma unroll
          for (int j = 0; j < 16; ++j) fe[j] = unpack_word<IN>(wd[j], e);
          const i64 k = k0 + 2 * p + e;
          const Scale s =
              make_scale<POW2, true>(widen_abs16<IN>(e ? amax2 >> 16 : amax2 & 0xffffu));
          if (g == 0 && k < K) st_f32(sft + k * sft_s0 + mt * sft_s1, s.sf);
          u32 w[4];
          quantize<16, kMul>(fe, s, w);
          if (k < K && m < M) st_v4(qt + k * M + m, make_uint4(w[0], w[1], w[2], w[3]));
        }
      }
    }
    __syncthreads();  // this stage is refilled two tiles from now (issued next iteration)
  }
}

}  // namespace ptxtrain_quant
