// ptxtrain/fp8_gemm.cuh — persistent, warp-specialized block-scaled FP8 GEMM for sm_90a
// (docs/design.md §2-3; DeepSeek-V3 report §3.3; the design of DeepGEMM's 1D2D / 1D1D kernels).
//
//   D[M, N] (+)= A[M, K] · B[N, K]ᵀ, A and B e4m3 K-major, scales per 128-K block:
//   1D2D: sf_a per 1x128 tile of A, sf_b per 128x128 block of B;  1D1D: both per 1x128 tile.
//
// Roles. One CTA per SM loops over work units (unit u, u + clusters, ...; see unit_coords for
// the rasterization that keeps the running units on a few panels of A and B in L2). The last
// warpgroup is the producer: one thread issues the TMA loads of A (BLOCK_M x 128, 128-byte
// swizzle), B (BLOCK_N x 128, 128-byte swizzle) and the scales of A (and of B for 1D1D) of each
// 128-K block into a ring of kNumStages shared-memory stages, each guarded by a `full` and an
// `empty` mbarrier; for decode-sized 1D2D tiles of short K and dense 128-row tiles of
// K >= 1024 (sfb_in_stage) it also copies the block's two 128x128-block scales of B into the
// stage with cp.async, tracked by the same `full` barrier. The math warpgroups (one for
// BLOCK_M = 64, two for 128 and 256, each then covering BLOCK_M / 128 waves of 64 rows) wait on
// `full`, issue 4 wgmma m64nBLOCK_Nk32 per wave (operands straight from shared memory), wait
// for them, release the stage (`empty`, one arrival per warp) and promote the block's partial
// sums into FP32 accumulators on the CUDA cores: fin += acc · sf_a[row] · sf_b[col block].
// While one math warpgroup promotes, the other's wgmmas keep the tensor core busy. setmaxnreg
// moves registers from the producer (40) to the math warpgroups (232) when there are two of them.
//
// Double accumulators (kDoubleAcc, one wave per warpgroup, BLOCK_N <= 128): block k + 1's
// wgmmas are issued into a second register set before block k is promoted, and wait_group 1
// retires block k alone, so the tensor core also runs while this warpgroup promotes. The K loop
// is then unrolled in chunks of 8 blocks drained at their ends: ptxas serializes wgmmas that stay
// in flight across a loop's back edge (C7514).
//
// Clusters (kCluster = 2): the two CTAs take adjacent M-blocks of one N-block; each loads half
// of B and multicasts it to both, halving B's L2 -> shared-memory traffic. A stage is free only
// when the math warps of both CTAs released it (remote mbarrier arrivals). With kMcastA (decode-
// sized M, one M-block) the roles flip: the two CTAs take adjacent N-blocks of one M-block and
// share A, each loading half of its rows (DeepGEMM's multicast on A); A is then read from L2 by
// half the CTAs.
//
// Split tail (kSplitK, dense or M-grouped): a persistent grid of G CTAs runs `units` tiles in
// whole waves of G plus a partial last wave that leaves SMs idle (4096 x 2112 x 7168 with 128x128
// tiles: 4 waves + 16 tiles on 132 SMs). The host (ptx.split_tail) passes num_dp_units, the
// tiles of the whole waves, and `splits`: each remaining tile becomes `splits` units over K
// ranges of whole double-accumulator chunks, run after the whole tiles (a second unit loop, so
// the first keeps a register allocation close to a kernel's without slices; the 1D1D kernel
// reads 6 instead of 8 column-scale groups early in both loops, 8 spill). A slice writes its FP32 partial tile to a workspace and
// counts itself in on a per-warp counter; the warp that arrives last sums the slices in slice
// order (bitwise repeatable), stores the tile with direct stores and zeroes the counter.
//
// Epilogue (kEpiBoxes > 0): the tile goes registers -> stmatrix -> 128-byte-swizzled shared
// boxes -> TMA stores (or TMA reduce-adds for accumulate), issued by one thread per warpgroup;
// the warpgroup starts its next tile while they drain (see EpiShape / store_tile_tma).
//
// M-grouped (kGroupMode 1, DeepGEMM's contiguous layout for the MoE experts): B is a [G, N, K]
// stack, every tile takes its group from the rows' m_indices (tile_group), all-padding tiles
// skip the main loop, padding rows store zeros. K-grouped (kGroupMode 2, the experts' wgrad):
// D[g] = A[:, K_g] · B[:, K_g]ᵀ per group over its own range of K blocks (group_unit).
//
// Tails. TMA zero-fills out-of-bounds rows and columns of A and B, so a K tail adds zeros, and
// the epilogue masks rows >= M and columns >= N. The shape constants N and K are template
// parameters (shape-specialized JIT); M is a kernel argument.
//
// Fragment layout (PTX ISA "Register Fragments and Shared Memory Matrix Layouts", wgmma .f32
// accumulator): in a m64nN tile, warp w of the warpgroup owns rows 16w..16w+15; thread lane
// holds, for each 8-column group j, d[4j + 0/1] at (row lane/4, cols 8j + 2(lane%4) + 0/1) and
// d[4j + 2/3] at row lane/4 + 8.
#pragma once

#include "tma.cuh"
#include "wgmma.cuh"

// Double accumulators: K blocks per fully unrolled, drained chunk of the K loop (see
// PTXTRAIN_FP8_GEMM_CHUNK in fp8_gemm_math).
#ifndef PTXTRAIN_GEMM_CHUNK
#define PTXTRAIN_GEMM_CHUNK 8
#endif
// 1D1D with double accumulators: 8-column groups of a block's column scales read before the
// wgmma wait (see kEarlyGroups in fp8_gemm_math).
#ifndef PTXTRAIN_GEMM_EARLY_SB_GROUPS
#define PTXTRAIN_GEMM_EARLY_SB_GROUPS 8
#endif
// The same with the split tail's slice loop compiled in (kSplitK): 8 spills there.
#ifndef PTXTRAIN_GEMM_EARLY_SB_GROUPS_SPLIT
#define PTXTRAIN_GEMM_EARLY_SB_GROUPS_SPLIT 6
#endif
// The same for a bf16 D (Fp8Linear's wgrad) without the split tail: 8 spill 8 bytes there.
#ifndef PTXTRAIN_GEMM_EARLY_SB_GROUPS_BF16
#define PTXTRAIN_GEMM_EARLY_SB_GROUPS_BF16 7
#endif
// Diagnostic only (wrong results unless 4): wgmma k32 slices issued per 128-K block, to time a
// block's chain of dependent wgmmas against the data it waits for.
#ifndef PTXTRAIN_GEMM_DIAG_KK
#define PTXTRAIN_GEMM_DIAG_KK 4
#endif
// Diagnostic only (benchmarks.ab_ptx "#PTXTRAIN_GEMM_DIAG_NO_PROMOTE=1"; wrong results): the
// one-accumulator K loop of single-wave tiles without the FP32 promotion, i.e. a plain FP8
// GEMM main loop whose wgmmas chain on one accumulator with the next block in flight. Its
// speed bounds what the promotion's overlap can reach with the same tiles, TMA ring and
// epilogue.
#ifndef PTXTRAIN_GEMM_DIAG_NO_PROMOTE
#define PTXTRAIN_GEMM_DIAG_NO_PROMOTE 0
#endif

// Diagnostic only (benchmarks.bench_grouped --ab "#PTXTRAIN_GEMM_DIAG_NO_ROW_MIDX=1"; padding
// rows then store their products instead of zeros): the M-grouped math warps skip the global
// loads of their rows' m_indices, to time what those loads cost the tile.
#ifndef PTXTRAIN_GEMM_DIAG_NO_ROW_MIDX
#define PTXTRAIN_GEMM_DIAG_NO_ROW_MIDX 0
#endif

// Diagnostic only (wrong results unless 0): what the 1D1D promotion's parts cost. Bit 1: no
// per-element scale products (fin += acc · sf_b[col], 64 fewer FMUL per block and thread);
// bit 2: every lane reads its column scales from the same address (group j's first pair: one
// address per warp-wide 8-byte load instead of four).
#ifndef PTXTRAIN_GEMM_DIAG_1D1D
#define PTXTRAIN_GEMM_DIAG_1D1D 0
#endif
#if (PTXTRAIN_GEMM_DIAG_1D1D) & ~3
#error "PTXTRAIN_GEMM_DIAG_1D1D: bits 1 and 2 only"
#endif

namespace ptxtrain {

// Rows of A per rasterization group (see unit_coords): the kernels' kRasterM by default.
constexpr int kDefaultRasterM = 2048;

// 1D2D: where B's two 128x128-block scales of a K block come from. Either the producer copies
// them into the stage with cp.async (tracked by its `full` barrier), or the math warps load them
// from global memory per block. The stage, for
// - decode-sized tiles (BLOCK_M = 64) of short K: their tiles change every few blocks, so the
//   global loads would stall each tile start (3-7% faster at K = 512-2048, M = 64 / 128 on an
//   H200; at K >= 7168 the copy is 6-10% slower);
// - dense 128-row tiles of K >= 1024: a global load in flight makes the release fence of the
//   stage (MEMBAR.ALL.CTA in the SASS) wait for it every block; through the stage 0.3-4% faster
//   at the V3 fprop / dgrad shapes of K = 1536-24576, 3% slower at K = 512. 256-row tiles: no
//   faster through the stage.
//   M-grouped 128-row tiles (the experts' GEMMs) as well: 1-6% faster at 8 x 4096 and 4 x 8192
//   rows, level at 8 x 512.
template <bool k1D1D, int kBlockM, int kK, int kGroupMode = 0>
__host__ __device__ constexpr bool sfb_in_stage() {
  constexpr int kBlocks = (kK + 127) / 128;
  return !k1D1D && ((kBlockM == 64 && kBlocks <= 16) ||
                    (kBlockM == 128 && kGroupMode <= 1 && kBlocks >= 8));
}

template <int kBlockM, int kBlockN, int kNumStages, bool k1D1D, int kEpiBytes = 0>
struct Fp8GemmSmem {
  static constexpr int kBlockK = 128;
  // The TMA-store epilogue's staging tiles (0 with direct stores) come first: 8 KB boxes,
  // 1024-B aligned for the 128-byte swizzle.
  static constexpr u32 kOffA = kEpiBytes;
  static constexpr u32 kBytesA = kBlockM * kBlockK;             // one stage of A, 1024-B multiple
  static constexpr u32 kBytesB = kBlockN * kBlockK;             // one stage of B
  static constexpr u32 kBytesSfa = kBlockM * 4;                 // fp32 scales of A's rows
  static constexpr u32 kBytesSfb = k1D1D ? kBlockN * 4 : 0;     // fp32 scales of B's rows
  static constexpr u32 kSlotSfa = (kBytesSfa + 127) / 128 * 128;  // TMA destinations: 128-B aligned
  // (1D2D: room for the two 128x128-block scales of B of a stage's block, lo and hi, when the
  // producer copies them in, see sfb_in_stage; not part of the TMA transaction bytes)
  static constexpr u32 kSlotSfb = k1D1D ? (kBytesSfb + 127) / 128 * 128 : 16;
  static constexpr u32 kOffB = kOffA + kNumStages * kBytesA;
  static constexpr u32 kOffSfa = kOffB + kNumStages * kBytesB;
  static constexpr u32 kOffSfb = kOffSfa + kNumStages * kSlotSfa;
  static constexpr u32 kOffBar = kOffSfb + kNumStages * kSlotSfb;
  // + 1024 so the base can be rounded up to the 1024-B alignment of 128-byte-swizzled tiles.
  static constexpr u32 kTotal = kOffBar + 2 * kNumStages * 8 + 1024;
  static constexpr u32 kTxBytes = kBytesA + kBytesB + kBytesSfa + kBytesSfb;
};

// Diagnostic only (racy by design): 1 drops the fence of release_read_stage, to check that the
// repeated-runs test still catches the race it prevents.
#ifndef PTXTRAIN_GEMM_DIAG_NO_RELEASE_FENCE
#define PTXTRAIN_GEMM_DIAG_NO_RELEASE_FENCE 0
#endif

// One arrival per warp on the stage's `empty` barrier of every CTA of the cluster (lane c
// arrives for CTA c, so the remote arrivals go out in parallel).
template <int kCluster>
__device__ __forceinline__ void release_stage(u64* bar, int lane) {
  if constexpr (kCluster == 1) {
    if (lane == 0) mbarrier_arrive(bar);
  } else {
    if (lane < kCluster) mbarrier_arrive_cluster(bar, static_cast<u32>(lane));
  }
}

// release_stage for a math warp that read the stage's scales with ordinary shared-memory loads:
// fence.proxy.async first orders those generic-proxy reads before the producer's next TMA
// (async proxy) writes into the stage, which the release / acquire through `empty` alone does
// not (PTX ISA "Memory Consistency Model: proxies"). Without it ptxas may place the arrival
// before the loads have returned; at 4096 x 2112 x 7168 a row scale then reads the next block's
// value in rare runs (8 rows x 128 columns of one tile off; 3 of 40 runs of the direct-store
// kernel differ without the fence, none with it).
template <int kCluster>
__device__ __forceinline__ void release_read_stage(u64* bar, int lane) {
  if (!PTXTRAIN_GEMM_DIAG_NO_RELEASE_FENCE) fence_proxy_async_shared_cta();
  __syncwarp();
  release_stage<kCluster>(bar, lane);
}

// One 128-K block of one wave: 4 wgmma m64nBLOCK_Nk32 from the stage's A rows and B tile, given
// as shared addresses >> 4 (`a_lo`, `b_lo`: the descriptors' low words, smem_desc_hi), into `acc`
// (overwritten: scale-d = 0 on the first), committed as one group. K-major, 128-byte swizzle:
// 8-row atoms 1024 B apart; the kk-th 32-byte K slice starts kk * 32 bytes into each row (the
// swizzle applies to the absolute address), i.e. 2 kk in the low word. Stepping 32-bit words
// instead of building 64-bit descriptors from generic pointers takes the per-block address math
// from ~60 instructions to ~16, which is what a decode tile's K loop is made of.
template <class Mma, int kBlockN>
__device__ __forceinline__ void issue_kblock(float (&acc)[kBlockN / 2], u32 a_lo, u32 b_lo) {
  constexpr u32 kHi = smem_desc_hi(1024, SmemSwizzle::kB128);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < PTXTRAIN_GEMM_DIAG_KK; ++kk) {
    Mma::mma(acc, smem_desc(a_lo + 2 * kk, kHi), smem_desc(b_lo + 2 * kk, kHi), kk > 0);
  }
  wgmma_commit_group();
}

// FP32 promotion of one block's partial sums: fin += acc · sf_a[row] · sf_b. 1D2D: sf_b is
// `lo` for the 8-column groups left of `split`, `hi` right of it; 1D1D: per column from `sb`.
template <int kBlockN, bool k1D1D>
__device__ __forceinline__ void promote(float (&fin)[kBlockN / 2], const float (&acc)[kBlockN / 2],
                                        float sa0, float sa1, float sfb_lo, float sfb_hi,
                                        int split, const float (&sb)[k1D1D ? kBlockN / 4 : 1]) {
  if constexpr (k1D1D && (PTXTRAIN_GEMM_DIAG_1D1D & 1)) {
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      fin[4 * j + 0] += acc[4 * j + 0] * sb[2 * j];
      fin[4 * j + 1] += acc[4 * j + 1] * sb[2 * j + 1];
      fin[4 * j + 2] += acc[4 * j + 2] * sb[2 * j];
      fin[4 * j + 3] += acc[4 * j + 3] * sb[2 * j + 1];
    }
  } else if constexpr (k1D1D) {
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      fin[4 * j + 0] += acc[4 * j + 0] * (sa0 * sb[2 * j]);
      fin[4 * j + 1] += acc[4 * j + 1] * (sa0 * sb[2 * j + 1]);
      fin[4 * j + 2] += acc[4 * j + 2] * (sa1 * sb[2 * j]);
      fin[4 * j + 3] += acc[4 * j + 3] * (sa1 * sb[2 * j + 1]);
    }
  } else {
    const float lo0 = sa0 * sfb_lo, lo1 = sa1 * sfb_lo;
    const float hi0 = sa0 * sfb_hi, hi1 = sa1 * sfb_hi;
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) {
      const bool hi = 8 * j >= split;
      const float s0 = hi ? hi0 : lo0, s1 = hi ? hi1 : lo1;
      fin[4 * j + 0] += acc[4 * j + 0] * s0;
      fin[4 * j + 1] += acc[4 * j + 1] * s0;
      fin[4 * j + 2] += acc[4 * j + 2] * s1;
      fin[4 * j + 3] += acc[4 * j + 3] * s1;
    }
  }
}

// Math warpgroups of a BLOCK_M tile: one for 64 rows, two for 128 and 256 (each then covers
// BLOCK_M / 128 "waves" of 64 rows).
template <int kBlockM>
struct MathShape {
  static constexpr int kWarpgroups = kBlockM == 64 ? 1 : 2;
  static constexpr int kWaves = kBlockM / (64 * kWarpgroups);
};

// TMA-store epilogue geometry (kEpiBoxes > 0): each math warpgroup stages its 64 x BLOCK_N part
// of the output tile in shared memory as boxes of 64 rows x 128 bytes (64 bf16 or 32 fp32
// columns, 128-byte swizzle: the 16-byte chunk c of row r sits at chunk c ^ (r % 8), so the eight
// rows a warp writes at once fall in different banks), then one thread stores the boxes with TMA
// (or adds them, for accumulate) and the warpgroup goes on to its next tile while they drain.
// kEpiBoxes boxes per warpgroup are staged at once; fewer than the tile's kBoxes write it in
// rounds (each waits for the previous round's reads), leaving shared memory to the K stages.
// Two-wave tiles (BLOCK_M = 256) may stage both waves (kEpiBoxes = 2 kBoxes, kWholeTile): the
// second wave's boxes then go to their own slots without waiting for the first wave's stores.
template <int kBlockM, int kBlockN, int kOut, int kEpiBoxes>
struct EpiShape {
  static constexpr int kElem = kOut == 0 ? 2 : 4;
  static constexpr int kBoxCols = 128 / kElem;
  static constexpr int kBoxes = kBlockN / kBoxCols;  // per 64-row wave
  static constexpr int kGroupsPerBox = kBoxCols / 8;  // 8-column accumulator groups per box
  static constexpr u32 kBoxBytes = 64 * 128;
  static constexpr u32 kWgBytes = kEpiBoxes * kBoxBytes;
  static constexpr int kBytes = MathShape<kBlockM>::kWarpgroups * kWgBytes;
  static constexpr int kWaves = MathShape<kBlockM>::kWaves;
  static constexpr bool kWholeTile = kWaves > 1 && kEpiBoxes == kWaves * kBoxes;
  // Boxes per store round (store_tile_tma's kEpiBoxes).
  static constexpr int kRoundBoxes = kWholeTile ? kBoxes : kEpiBoxes;
  static_assert(kEpiBoxes == 0 || kBlockN % kBoxCols == 0,
                "TMA store: BLOCK_N must be a multiple of the box columns");
  static_assert(kEpiBoxes >= 0 && (kEpiBoxes <= kBoxes || kWholeTile),
                "TMA store: 0 <= kEpiBoxes <= boxes, or the whole two-wave tile");
};

// Stores one wave's FP32 results `fin` (rows row_base.. of this warpgroup, columns n0..) through
// this warpgroup's staging boxes `stage` (see EpiShape). Rows >= M and columns >= N are clipped
// by TMA. `leader` (thread 0 of the warpgroup) issues the stores and owns their bulk group.
// `wait`: the first round waits until earlier stores have read the staging boxes (false when
// `stage` holds boxes no store in flight reads: a whole tile's second wave).
template <int kBlockN, int kOut, bool kAccumulate, int kN, int kEpiBoxes>
__device__ __forceinline__ void store_tile_tma(const float (&fin)[kBlockN / 2],
                                               unsigned char* stage, const TmaDescriptor* tma_d,
                                               int row_base, int n0, int wg, bool leader,
                                               bool wait = true) {
  using Epi = EpiShape<64, kBlockN, kOut, kEpiBoxes>;
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int b0 = 0; b0 < Epi::kBoxes; b0 += kEpiBoxes) {
    // Boxes b0 .. b0 + kEpiBoxes - 1 in staging slots 0.., i.e. 8-column groups g0 .. g1 - 1.
    constexpr int kRoundGroups = kEpiBoxes * Epi::kGroupsPerBox;
    const int g0 = b0 * Epi::kGroupsPerBox;
    // The previous round's (or tile's) stores have finished reading the staging boxes.
    if (leader && (wait || b0 > 0)) tma_store_wait_read<0>();
    named_barrier_sync(1 + wg, 128);
    if constexpr (kOut == 0) {
      // stmatrix x4 per pair of 8-column groups (j, j + 1): matrix q = lane / 8 is rows
      // 8 (q % 2).. of group j + q / 2; lane gives the address of its row i = lane % 8.
      const int q = lane / 8, i = lane % 8;
      const int r = warp * 16 + 8 * (q % 2) + i;
#pragma unroll
      for (int jr = 0; jr < kRoundGroups && g0 + jr < kBlockN / 8; jr += 2) {
        const int j = g0 + jr;
        const int jj = jr + q / 2;  // group within the round
        const u32 addr = smem_addr(stage + (jj / 8) * Epi::kBoxBytes + r * 128 +
                                   (((jj % 8) ^ i) * 16));
        stmatrix_x4(addr, cvt_bf16x2(fin[4 * j + 0], fin[4 * j + 1]),
                    cvt_bf16x2(fin[4 * j + 2], fin[4 * j + 3]),
                    cvt_bf16x2(fin[4 * j + 4], fin[4 * j + 5]),
                    cvt_bf16x2(fin[4 * j + 6], fin[4 * j + 7]));
      }
    } else {
      // fp32: 8 bytes per (row, pair of columns); 32 columns per box, so group jr of the round
      // is in slot jr / 4, 16-byte chunk 2 (jr % 4) + (lane % 4) / 2, 8-byte half lane % 2.
      // A warp's 8-byte stores go out as two half-warps (rows lane / 4 of 0..3 or 4..7). With
      // every lane at group jr, a half-warp's chunks (2 (jr % 4) + {0, 1}) ^ (row % 8) are 4
      // chunks written twice (ncu: 4.9 wavefronts per store instead of 2). So lanes of odd rows
      // write group jr ^ 2 (same slot, 4 chunks away) while the others write jr: a half-warp's 8
      // chunks differ, each lane still writes each group once (a select of two fixed registers):
      // 3.2 wavefronts per store, the 1D1D fp32 GEMMs 1.1-2.1% faster. The lane is read
      // again here through volatile asm: derived once at the kernel's start, these values held
      // registers across the main loop and ptxas spilled.
      u32 lid;
      asm volatile("mov.u32 %0, %%laneid;\n" : "=r"(lid));
      const bool odd = (lid / 4) & 1;
      // chunk ^ (r % 8) = 2 (jr % 4) ^ swz: the row's r % 8 (lane / 4), XOR 4 for odd rows,
      // XOR the lane's chunk of the group ((lane % 4) / 2).
      const int swz = static_cast<int>((lid / 4) ^ (odd ? 4 : 0) ^ ((lid % 4) / 2));
#pragma unroll
      for (int jr = 0; jr < kRoundGroups && g0 + jr < kBlockN / 8; ++jr) {
        // (fp32 boxes hold whole sets of 4 groups, so jr ^ 2 exists when jr does)
        const int ja = g0 + jr, jb = g0 + (jr ^ 2);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = warp * 16 + lane / 4 + 8 * h;
          float2* p = reinterpret_cast<float2*>(stage + (jr / 4) * Epi::kBoxBytes + r * 128 +
                                                (((2 * (jr % 4)) ^ swz) * 16) + (lane % 2) * 8);
          *p = odd ? make_float2(fin[4 * jb + 2 * h], fin[4 * jb + 2 * h + 1])
                   : make_float2(fin[4 * ja + 2 * h], fin[4 * ja + 2 * h + 1]);
        }
      }
    }
    // Generic-proxy writes -> visible to the TMA unit, then every thread's part is in place.
    fence_proxy_async_shared_cta();
    named_barrier_sync(1 + wg, 128);
    if (leader) {
#pragma unroll
      for (int b = 0; b < kEpiBoxes; ++b) {
        const int col = n0 + (b0 + b) * Epi::kBoxCols;
        if (b0 + b >= Epi::kBoxes || col >= kN) break;
        if constexpr (kAccumulate) {
          tma_reduce_add_2d(tma_d, stage + b * Epi::kBoxBytes, col, row_base);
        } else {
          tma_store_2d(tma_d, stage + b * Epi::kBoxBytes, col, row_base);
        }
      }
      tma_store_commit_group();
    }
  }
}

// The group of B (and of sf_b) the tile at row m0 of unit group kg multiplies; -1: nothing to
// compute. M-grouped (kGroupMode 1): from `block_group` (per 64-row block, the largest m_indices
// value of its rows: every non-padding row of an aligned 128-row chunk names the same group,
// padding rows are -1); -1 for all padding or an index outside [0, num_groups) (the tile then
// stores zeros). Masked (3): kg, or -1 at or past masked_m[kg] (`group_info`; nothing stored).
// Dense and K-grouped: 0.
template <int kGroupMode, int kBlockM>
__device__ __forceinline__ int tile_group(const int* block_group, const int* group_info, int m0,
                                          int kg, int num_groups) {
  if constexpr (kGroupMode == 1) {
    int g = __ldg(block_group + m0 / 64);
    if constexpr (kBlockM == 128) g = max(g, __ldg(block_group + m0 / 64 + 1));
    return g < num_groups ? g : -1;
  } else if constexpr (kGroupMode == 3) {
    return m0 < __ldg(group_info + kg) ? kg : -1;
  } else {
    return 0;
  }
}

// Work units of a cluster: kCluster adjacent M-blocks of one N-block (B multicast), or with
// kMcastA one M-block and kCluster adjacent N-blocks (A multicast); CTA `rank` of the cluster
// takes the rank-th block of its unit. kGroup: M-groups per rasterization group (unit_coords).
template <int kBlockM, int kBlockN, int kN, int kCluster, bool kMcastA, int kRasterM>
struct UnitShape {
  static constexpr int kClusterM = kMcastA ? 1 : kCluster;  // M-blocks per unit
  static constexpr int kClusterN = kMcastA ? kCluster : 1;  // N-blocks per unit
  static constexpr int kNumNUnits = ((kN + kBlockN - 1) / kBlockN + kClusterN - 1) / kClusterN;
  static constexpr int kGroup =
      kRasterM / (kBlockM * kClusterM) > 0 ? kRasterM / (kBlockM * kClusterM) : 1;
  __device__ __forceinline__ static int m0(int mg, u32 rank) {
    return (mg * kClusterM + (kMcastA ? 0 : static_cast<int>(rank))) * kBlockM;
  }
  __device__ __forceinline__ static int n0(int nb, u32 rank) {
    return (nb * kClusterN + (kMcastA ? static_cast<int>(rank) : 0)) * kBlockN;
  }
};

// Work unit -> (M-group, N-block), rasterized in groups of kGroup M-groups so that the units
// running at once share a few panels of A and of B in L2 (with M-groups fastest inside a group).
template <int kGroup, int kNumNBlocks>
__device__ __forceinline__ void unit_coords(int unit, int num_m_groups, int& m_group,
                                            int& n_block) {
  const int per_group = kGroup * kNumNBlocks;
  const int first = (unit / per_group) * kGroup;
  const int size = min(kGroup, num_m_groups - first);
  const int r = unit % per_group;
  m_group = first + r % size;
  n_block = r / size;
}

// A work unit's tile and K range. K-grouped (kGroupMode 2) and masked (3): unit =
// g · units_per_group + the unit within D[g]; K-grouped: group g's K blocks are group_info[g] ..
// group_info[g + 1] - 1 (prefix sums of the groups' K / 128); otherwise all kNumKBlocks blocks
// (and g = 0 for kGroupMode 0 / 1). Split tail (kSplitK, dense or M-grouped): units from
// num_dp_units on are `splits` K-slices of each remaining tile (tile num_dp_units + t / splits,
// slice t % splits); the slices cut K at multiples of kQuantum blocks (the double-accumulator
// chunk), the last one also takes the K blocks past the last whole quantum; `slice` is the
// slice, -1 for a whole tile.
template <int kGroupMode, int kGroup, int kNumNBlocks, int kNumKBlocks, bool kSplitK = false,
          int kQuantum = 1>
__device__ __forceinline__ void group_unit(int unit, int units_per_group, int num_m_groups,
                                           const int* group_info, int& mg, int& nb, int& kg,
                                           int& kb_begin, int& num_kb, int& slice,
                                           int num_dp_units = 0, int splits = 1) {
  slice = -1;
  if constexpr (kGroupMode == 2) {
    kg = unit / units_per_group;
    unit_coords<kGroup, kNumNBlocks>(unit % units_per_group, num_m_groups, mg, nb);
    kb_begin = __ldg(group_info + kg);
    num_kb = __ldg(group_info + kg + 1) - kb_begin;
  } else if constexpr (kGroupMode == 3) {
    kg = unit / units_per_group;
    unit_coords<kGroup, kNumNBlocks>(unit % units_per_group, num_m_groups, mg, nb);
    kb_begin = 0;
    num_kb = kNumKBlocks;
  } else {
    kg = 0;
    kb_begin = 0;
    num_kb = kNumKBlocks;
    if constexpr (kSplitK) {
      if (unit >= num_dp_units) {
        constexpr int kQuanta = kNumKBlocks / kQuantum;
        const int t = unit - num_dp_units;
        slice = t % splits;
        unit = num_dp_units + t / splits;
        kb_begin = slice * kQuanta / splits * kQuantum;
        const int kb_end =
            slice + 1 == splits ? kNumKBlocks : (slice + 1) * kQuanta / splits * kQuantum;
        num_kb = kb_end - kb_begin;  // (0 when splits > kQuanta: the slice adds zeros)
      }
    }
    unit_coords<kGroup, kNumNBlocks>(unit, num_m_groups, mg, nb);
  }
}

// group_unit of the unit loops' two phases: whole tiles (`slices` false: no split-tail code) or
// the split tail's K-slices.
template <int kGroupMode, int kGroup, int kNumNBlocks, int kNumKBlocks, bool kSplitK, int kQuantum>
__device__ __forceinline__ void phase_unit(bool slices, int unit, int units_per_group,
                                           int num_m_groups, const int* group_info, int& mg,
                                           int& nb, int& kg, int& kb_begin, int& num_kb,
                                           int& slice, int num_dp_units, int splits) {
  if (slices) {
    group_unit<kGroupMode, kGroup, kNumNBlocks, kNumKBlocks, kSplitK, kQuantum>(
        unit, units_per_group, num_m_groups, group_info, mg, nb, kg, kb_begin, num_kb, slice,
        num_dp_units, splits);
  } else {
    group_unit<kGroupMode, kGroup, kNumNBlocks, kNumKBlocks>(
        unit, units_per_group, num_m_groups, group_info, mg, nb, kg, kb_begin, num_kb, slice);
  }
}

// 1D2D: the rows of sf_b ([⌈N/128⌉, ⌈K/128⌉] fp32, per group when M-grouped / masked) that hold
// the scales of the tile at column n0: `rows[0]` for its columns left of the next 128-column
// boundary, `rows[1]` for those right of it (the same row where the tile lies in one scale block
// or the next block is past N). (kMcastA: an N-block past N, the odd CTA of the last pair, reads
// the last block's scales; it computes on zero-filled B and stores nothing.)
template <int kN, int kK, int kBlockN, int kGroupMode>
__device__ __forceinline__ void sfb_rows(const float* sf_b, int group, int n0,
                                         const float* (&rows)[2]) {
  constexpr int kNumKBlocks = (kK + 127) / 128;
  constexpr int kNumSfbBlocks = (kN + 127) / 128;
  const int block = min(n0 / 128, kNumSfbBlocks - 1);
  const bool has_hi = 128 - n0 % 128 < kBlockN && block + 1 < kNumSfbBlocks;
  const float* g =
      sf_b + (kGroupMode == 1 || kGroupMode == 3 ? group * kNumSfbBlocks * kNumKBlocks : 0);
  rows[0] = g + block * kNumKBlocks;
  rows[1] = has_hi ? rows[0] + kNumKBlocks : rows[0];
}

// Split tail (kSplitK): this warp's FP32 partial sums of a K-slice of tile `tail_tile` go to
// the workspace (slice `slice` of the tile's `splits`, laid out [wave][column pair][lane] so that
// each store is a coalesced 256-byte row), then the warp counts itself in on its counter. The
// warp that arrives last sums the tile's slices in slice order (the result does not depend on
// the arrival order, so runs are bitwise repeatable), leaves the sum
// in `fin`, resets the counter for the next launch and returns true; the others return false.
// Release / acquire as in the CUDA programming guide's threadfence reduction: stores, fence,
// then the atomic; the last warp fences before it reads (L2, __ldcg: another SM wrote them).
template <int kBlockN, int kWaves, int kNumMathWG>
__device__ __forceinline__ bool split_fixup(float (&fin)[kWaves][kBlockN / 2], float* workspace,
                                            int* counters, int tail_tile, int slice, int splits,
                                            int wg, int warp, int lane) {
  constexpr int kPairs = kBlockN / 4;                      // float2 per lane per wave
  constexpr int kWarpPairs = kWaves * kPairs * 32;         // one warp's rows of one tile
  constexpr int kTilePairs = kNumMathWG * 4 * kWarpPairs;  // one slice of one tile
  const int slot = wg * 4 + warp;
  float2* tile = reinterpret_cast<float2*>(workspace) +
                 static_cast<long long>(tail_tile) * splits * kTilePairs + slot * kWarpPairs + lane;
  float2* mine = tile + static_cast<long long>(slice) * kTilePairs;
#pragma unroll
  for (int w = 0; w < kWaves; ++w) {
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      mine[(w * kPairs + i) * 32] = make_float2(fin[w][2 * i], fin[w][2 * i + 1]);
    }
  }
  __threadfence();
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    int* counter = counters + tail_tile * kNumMathWG * 4 + slot;
    last = atomicAdd(counter, 1) == splits - 1;
    if (last) *counter = 0;  // every slice of this launch has counted itself in
  }
  last = __shfl_sync(0xffffffffu, last, 0);
  if (!last) return false;
  // (A shuffle is no memory operation: the warp barrier orders lane 0's atomic before the other
  // lanes' fence and reads in the memory model, as __syncthreads does in the guide's pattern.)
  __syncwarp();
  __threadfence();
  // Slice 0 replaces this warp's registers, the others add to them in order; this warp's own
  // slice is read back too (one L2 read), so no second register tile is needed.
#pragma unroll 1
  for (int s = 0; s < splits; ++s) {
    const float2* src = tile + static_cast<long long>(s) * kTilePairs;
#pragma unroll
    for (int w = 0; w < kWaves; ++w) {
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        const float2 v = __ldcg(src + (w * kPairs + i) * 32);
        fin[w][2 * i] = s == 0 ? v.x : fin[w][2 * i] + v.x;
        fin[w][2 * i + 1] = s == 0 ? v.y : fin[w][2 * i + 1] + v.y;
      }
    }
  }
  return true;
}

// The math warpgroups' part of fp8_gemm_nt_kernel (see the header comment and the kernel).
template <class Mma, int kBlockM, int kBlockN, int kNumStages, int kN, int kK, bool k1D1D,
          int kOut, bool kAccumulate, int kCluster, int kUnrollK, bool kDoubleAcc, int kEpiBoxes,
          int kGroupMode, int kRasterM = kDefaultRasterM, bool kMcastA = false,
          bool kSplitK = false>
__device__ __forceinline__ void fp8_gemm_math(unsigned char* smem_d, unsigned char* smem_a,
                                              unsigned char* smem_b, unsigned char* smem_sfa,
                                              unsigned char* smem_sfb, u64* full, u64* empty,
                                              const float* sf_b, const TmaDescriptor* tma_d,
                                              void* out, int m, int num_m_groups, int num_units,
                                              int first_unit, int unit_stride, u32 rank,
                                              const int* m_indices, const int* block_group,
                                              int num_groups, const int* group_info,
                                              int num_dp_units, int splits, float* split_ws,
                                              int* split_counters) {
  using Epi = EpiShape<kBlockM, kBlockN, kOut, kEpiBoxes>;
  using Smem = Fp8GemmSmem<kBlockM, kBlockN, kNumStages, k1D1D, Epi::kBytes>;
  constexpr int kNumMathWG = MathShape<kBlockM>::kWarpgroups;
  constexpr int kWaves = MathShape<kBlockM>::kWaves;
  constexpr int kNumKBlocks = (kK + 127) / 128;
  using Units = UnitShape<kBlockM, kBlockN, kN, kCluster, kMcastA, kRasterM>;
  constexpr int kGroup = Units::kGroup;
  const int wg = threadIdx.x / 128;
  if constexpr (kNumMathWG == 2) setmaxnreg_inc<232>();
  const int warp = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  // This thread's rows in wave w: w * 64 * kNumMathWG + row0 and + 8; columns 8j + col0 + {0, 1}.
  const int row0 = wg * 64 + warp * 16 + lane / 4;
  const int col0 = 2 * (lane % 4);
  // Descriptor low words (issue_kblock) of stage 0: this warpgroup's first 64 rows of A, and B.
  const u32 a_lo0 = (smem_addr(smem_a) + wg * 64 * 128) >> 4;
  const u32 b_lo0 = smem_addr(smem_b) >> 4;
  u32 it = 0;
  const int units_per_group = num_m_groups * Units::kNumNUnits;
  float acc[kBlockN / 2];
  float fin[kWaves][kBlockN / 2];
  // Whole tiles, then (split tail) the K-slices of the last tiles: the phase loop unrolls into
  // two unit loops, so that the whole tiles' loop keeps the registers of a kernel without
  // slices. A slice (kSlice) stores only if it completes its tile's sum (split_fixup).
  int unit = first_unit;
#pragma unroll
  for (int phase = 0; phase < (kSplitK ? 2 : 1); ++phase) {
  const bool kSlice = phase == 1;
  for (; unit < (kSplitK && !kSlice ? num_dp_units : num_units); unit += unit_stride) {
    int mg, nb, kg, kb_begin, num_kb, slice;
    phase_unit<kGroupMode, kGroup, Units::kNumNUnits, kNumKBlocks, kSplitK, PTXTRAIN_GEMM_CHUNK>(
        kSlice, unit, units_per_group, num_m_groups, group_info, mg, nb, kg, kb_begin, num_kb,
        slice, num_dp_units, splits);
    const int m0 = Units::m0(mg, rank);
    const int n0 = Units::n0(nb, rank);
    const int group = tile_group<kGroupMode, kBlockM>(block_group, group_info, m0, kg, num_groups);
    if (kGroupMode == 3 && group < 0) continue;  // masked off: neither computed nor stored
    // M-grouped: this thread's rows' m_indices, loaded now so that their latency hides behind
    // the main loop instead of stalling the epilogue (a padding row, -1, stores zeros; 1-9%
    // faster than loading them in the epilogue).
    int row_midx[kGroupMode == 1 ? 2 * kWaves : 1];
    if constexpr (kGroupMode == 1) {
#pragma unroll
      for (int wh = 0; wh < 2 * kWaves; ++wh) {
        const int row = m0 + (wh / 2) * 64 * kNumMathWG + row0 + 8 * (wh % 2);
        row_midx[wh] = (group >= 0 && row < m && !PTXTRAIN_GEMM_DIAG_NO_ROW_MIDX)
                           ? __ldg(m_indices + row)
                           : 0;
      }
    }
#pragma unroll
    for (int w = 0; w < kWaves; ++w) {
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) fin[w][i] = 0.0f;
    }
    // 1D2D: the tile's columns lie in scale block n0 / 128 below `split`, in the next one above
    // (both blocks' scales are loaded for every K block, see sfb_rows).
    const int split = 128 - n0 % 128;
    // 1D2D: B's two block scales of block kb (in stage s): from the stage where the producer
    // copied them (sfb_in_stage), else from global memory (cached; hi = lo where the tile lies
    // in one scale block). 1D1D: per column from the stage (load_sb).
    constexpr bool kSfbInStage = sfb_in_stage<k1D1D, kBlockM, kK, kGroupMode>();
    const float* sfb_lo_hi[2];
    if constexpr (!k1D1D && !kSfbInStage) {
      sfb_rows<kN, kK, kBlockN, kGroupMode>(sf_b, group, n0, sfb_lo_hi);
    }
    auto load_sfb = [&](u32 s, int kb, float& lo, float& hi) {
      if constexpr (kSfbInStage) {
        const float2 v = *reinterpret_cast<const float2*>(smem_sfb + s * Smem::kSlotSfb);
        lo = v.x;
        hi = v.y;
      } else if constexpr (!k1D1D) {
        lo = __ldg(sfb_lo_hi[0] + kb);
        hi = __ldg(sfb_lo_hi[1] + kb);
      }
    };
    // (j0 .. j1 - 1: the 8-column groups to load; all by default)
    auto load_sb = [&](u32 s, float (&sb)[k1D1D ? kBlockN / 4 : 1], int j0 = 0,
                       int j1 = kBlockN / 8) {
      if constexpr (k1D1D) {
        // col0 is even and the slot 128-B aligned: one 8-byte load per 8-column group.
        const float2* sfb = reinterpret_cast<const float2*>(smem_sfb + s * Smem::kSlotSfb);
#pragma unroll
        for (int j = j0; j < j1; ++j) {
          const float2 v = sfb[4 * j + ((PTXTRAIN_GEMM_DIAG_1D1D & 2) ? 0 : col0 / 2)];
          sb[2 * j] = v.x;
          sb[2 * j + 1] = v.y;
        }
      }
    };
    if (group >= 0) {  // (always, unless an M-grouped tile is all padding)
    if constexpr (kDoubleAcc) {
      // Block kb's wgmmas are in flight in one accumulator while block kb + 1's are issued into
      // the other; wait_group 1 then retires kb alone, which is promoted while kb + 1 runs.
      static_assert(kWaves == 1, "double accumulators need a single wave per warpgroup");
      float acc2[kBlockN / 2];
      // 1D1D: read block kb's row scales and the first kEarlyGroups 8-column groups of its
      // column scales (in its stage since its `full` wait) before issuing block kb + 1 and
      // waiting for kb, so their shared-memory latency hides behind the wait instead of stalling
      // the promotion; more early groups hold more registers across the wait (all 16 of a
      // 128-column tile spill). 0: every scale after the wait.
      static_assert(PTXTRAIN_GEMM_EARLY_SB_GROUPS >= 0 &&
                        PTXTRAIN_GEMM_EARLY_SB_GROUPS_SPLIT >= 0 &&
                        PTXTRAIN_GEMM_EARLY_SB_GROUPS_BF16 >= 0,
                    "PTXTRAIN_GEMM_EARLY_SB_GROUPS(_SPLIT / _BF16) >= 0");
      constexpr int kEarlyWant = kSplitK    ? PTXTRAIN_GEMM_EARLY_SB_GROUPS_SPLIT
                                 : kOut == 0 ? PTXTRAIN_GEMM_EARLY_SB_GROUPS_BF16
                                             : PTXTRAIN_GEMM_EARLY_SB_GROUPS;
      constexpr int kEarlyGroups =
          k1D1D ? (kEarlyWant < kBlockN / 8 ? kEarlyWant : kBlockN / 8) : 0;
      // Row scales before the wait too (1D2D as well once K spans a whole chunk: the fence before
      // the stage's release then finds their loads done instead of waiting for them, up to 1.4%
      // faster at K = 2048-7168; at K = 512 reading them late is 3% faster).
      constexpr bool kEarlySa = kEarlyGroups > 0 || kNumKBlocks >= PTXTRAIN_GEMM_CHUNK;
      // Retire the oldest block (`cur`): read its early scales (kEarlySa / kEarlyGroups); with
      // `next`, issue block it + 1 into `nxt` and wait until one group is pending; then read the
      // rest of its scales, release the stage, promote.
#define PTXTRAIN_FP8_GEMM_RETIRE(kb, cur, nxt, next)                                            \
  {                                                                                           \
    const u32 s = it % kNumStages;                                                            \
    float sfb_lo = 1.0f, sfb_hi = 1.0f;                                                       \
    load_sfb(s, (kb), sfb_lo, sfb_hi);                                                        \
    const float* sfa = reinterpret_cast<const float*>(smem_sfa + s * Smem::kSlotSfa);         \
    float sa0 = 0.0f, sa1 = 0.0f;                                                             \
    float sb[k1D1D ? kBlockN / 4 : 1];                                                        \
    if constexpr (kEarlySa) {                                                                 \
      sa0 = sfa[row0];                                                                        \
      sa1 = sfa[row0 + 8];                                                                    \
    }                                                                                         \
    load_sb(s, sb, 0, kEarlyGroups);                                                          \
    if (next) {                                                                               \
      const u32 s1 = (it + 1) % kNumStages;                                                   \
      mbarrier_wait(&full[s1], ((it + 1) / kNumStages) & 1u);                                 \
      issue_kblock<Mma, kBlockN>(nxt, a_lo0 + s1 * (Smem::kBytesA >> 4),                    \
                                 b_lo0 + s1 * (Smem::kBytesB >> 4));                          \
      wgmma_wait_group<1>();                                                                  \
    } else {                                                                                  \
      wgmma_wait_group<0>();                                                                  \
    }                                                                                         \
    wgmma_fence_operand(cur);                                                                 \
    if constexpr (!kEarlySa) {                                                                \
      sa0 = sfa[row0];                                                                        \
      sa1 = sfa[row0 + 8];                                                                    \
    }                                                                                         \
    load_sb(s, sb, kEarlyGroups);                                                             \
    release_read_stage<kCluster>(&empty[s], lane);                                            \
    promote<kBlockN, k1D1D>(fin[0], cur, sa0, sa1, sfb_lo, sfb_hi, split, sb);                \
    ++it;                                                                                     \
  }
      // Chunks of kChunk blocks, each fully unrolled and drained at its end (wait_group 0): ptxas
      // serializes wgmmas that are still in flight across a loop's back edge, so none is. After
      // unrolling, `i` is a constant and the parity / last-block branches fold away.
#define PTXTRAIN_FP8_GEMM_CHUNK(kb0, count)                                                     \
  {                                                                                           \
    {                                                                                         \
      const u32 s = it % kNumStages;                                                          \
      mbarrier_wait(&full[s], (it / kNumStages) & 1u);                                        \
      issue_kblock<Mma, kBlockN>(acc, a_lo0 + s * (Smem::kBytesA >> 4),                     \
                                 b_lo0 + s * (Smem::kBytesB >> 4));                           \
    }                                                                                         \
    _Pragma("unroll") for (int i = 0; i < (count); ++i) {                                     \
      if (i % 2 == 0) {                                                                       \
        PTXTRAIN_FP8_GEMM_RETIRE((kb0) + i, acc, acc2, i + 1 < (count))                       \
      } else {                                                                                \
        PTXTRAIN_FP8_GEMM_RETIRE((kb0) + i, acc2, acc, i + 1 < (count))                       \
      }                                                                                       \
    }                                                                                         \
  }
      constexpr int kChunk = PTXTRAIN_GEMM_CHUNK;
      static_assert(kChunk >= 1, "PTXTRAIN_GEMM_CHUNK: at least one K block per chunk");
      // (Split tail: a slice's K range is whole chunks, plus the remainder for the last slice;
      // a whole tile is blocks 0 .. kNumKBlocks - 1 as constants.)
      const int kb_first = kSlice ? kb_begin : 0;
      const int kb_full = kSlice ? kb_begin + num_kb / kChunk * kChunk
                                  : kNumKBlocks / kChunk * kChunk;
#pragma unroll 1
      for (int kb0 = kb_first; kb0 < kb_full; kb0 += kChunk) PTXTRAIN_FP8_GEMM_CHUNK(kb0, kChunk)
      if constexpr (kNumKBlocks % kChunk != 0) {
        if (!kSlice || kb_begin + num_kb == kNumKBlocks) {
          PTXTRAIN_FP8_GEMM_CHUNK(kNumKBlocks - kNumKBlocks % kChunk, kNumKBlocks % kChunk)
        }
      }
#undef PTXTRAIN_FP8_GEMM_CHUNK
#undef PTXTRAIN_FP8_GEMM_RETIRE
    } else if constexpr (PTXTRAIN_GEMM_DIAG_NO_PROMOTE != 0 && kWaves == 1) {
      // (diagnostic, see PTXTRAIN_GEMM_DIAG_NO_PROMOTE: block kb's wgmmas accumulate onto block
      // kb - 1's in flight; the stage of kb - 1 is released once only kb's group is pending)
      constexpr u32 kHi = smem_desc_hi(1024, SmemSwizzle::kB128);
#pragma unroll 1
      for (int kb = 0; kb < num_kb; ++kb, ++it) {
        const u32 s = it % kNumStages;
        mbarrier_wait(&full[s], (it / kNumStages) & 1u);
        const u32 a_lo = a_lo0 + s * (Smem::kBytesA >> 4), b_lo = b_lo0 + s * (Smem::kBytesB >> 4);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          Mma::mma(acc, smem_desc(a_lo + 2 * kk, kHi), smem_desc(b_lo + 2 * kk, kHi),
                   kk > 0 || kb > 0);
        }
        wgmma_commit_group();
        wgmma_wait_group<1>();
        if (kb > 0) {
          __syncwarp();
          release_stage<kCluster>(&empty[(it - 1) % kNumStages], lane);
        }
      }
      wgmma_wait_group<0>();
      wgmma_fence_operand(acc);
      if (num_kb > 0) {
        __syncwarp();
        release_stage<kCluster>(&empty[(it - 1) % kNumStages], lane);
      }
#pragma unroll
      for (int i = 0; i < kBlockN / 2; ++i) fin[0][i] = acc[i];
    } else {
    // kUnrollK: how far the compiler may unroll the K loop (more overlaps one block's scale
    // loads and address math with the previous block's promotion; too much spills).
#pragma unroll(kUnrollK)
    for (int kb = 0; kb < num_kb; ++kb, ++it) {
      const u32 s = it % kNumStages;
      const u32 phase = (it / kNumStages) & 1u;
      float sfb_lo = 1.0f, sfb_hi = 1.0f;
      if constexpr (!kSfbInStage) load_sfb(s, kb, sfb_lo, sfb_hi);
      mbarrier_wait(&full[s], phase);
      if constexpr (kSfbInStage) load_sfb(s, kb, sfb_lo, sfb_hi);
      const float* sfa = reinterpret_cast<const float*>(smem_sfa + s * Smem::kSlotSfa);
      float sb[k1D1D ? kBlockN / 4 : 1];
      load_sb(s, sb);
#pragma unroll
      for (int w = 0; w < kWaves; ++w) {
        const int wrow = w * 64 * kNumMathWG + row0;
        // Scales first: once this warp releases the stage, the producer may overwrite it.
        const float sa0 = sfa[wrow];
        const float sa1 = sfa[wrow + 8];
        issue_kblock<Mma, kBlockN>(
            acc, a_lo0 + s * (Smem::kBytesA >> 4) + w * 64 * kNumMathWG * 128 / 16,
            b_lo0 + s * (Smem::kBytesB >> 4));
        wgmma_wait_group<0>();
        wgmma_fence_operand(acc);
        if (w == kWaves - 1) {
          release_read_stage<kCluster>(&empty[s], lane);
        }
        promote<kBlockN, k1D1D>(fin[w], acc, sa0, sa1, sfb_lo, sfb_hi, split, sb);
      }
    }
    }
    }
    if constexpr (kGroupMode == 1) {
      // Padding rows (m_indices -1) of a computed tile store zeros, as the contract says.
#pragma unroll
      for (int wh = 0; wh < 2 * kWaves; ++wh) {
        const int w = wh / 2, h = wh % 2;
        if (row_midx[wh] < 0) {
#pragma unroll
          for (int j = 0; j < kBlockN / 8; ++j) {
            fin[w][4 * j + 2 * h] = 0.0f;
            fin[w][4 * j + 2 * h + 1] = 0.0f;
          }
        }
      }
    }

    // ---- epilogue ------------------------------------------------------------------------
    // Split tail: only the warp that completes a tile's sum stores it, with direct stores (the
    // TMA store's staging is per warpgroup, and the warps of one finish at different times).
    bool direct = kEpiBoxes == 0;
    if constexpr (kSplitK) {
      if (kSlice) {
        const int tail_tile = ((unit - num_dp_units) / splits) * kCluster + static_cast<int>(rank);
        if (!split_fixup<kBlockN, kWaves, kNumMathWG>(fin, split_ws, split_counters, tail_tile,
                                                      slice, splits, wg, warp, lane)) {
          continue;
        }
        direct = true;
      }
    }
    if constexpr (kEpiBoxes > 0) {
      if (!direct) {
#pragma unroll
        for (int w = 0; w < kWaves; ++w) {
        // (K-grouped / masked: D[g] is rows g·M.. of the [G·M, N] view (M = M_max when masked);
        // TMA stores only where M % BLOCK_M == 0, so no box reaches the next group's rows.)
          // (whole two-wave tile: wave w in its own slots, only the first waits for old stores)
          store_tile_tma<kBlockN, kOut, kAccumulate, kN, Epi::kRoundBoxes>(
              fin[w],
              smem_d + wg * Epi::kWgBytes +
                  (Epi::kWholeTile ? w * Epi::kBoxes * Epi::kBoxBytes : 0),
              tma_d, kg * m + m0 + w * 64 * kNumMathWG + wg * 64, n0, wg, threadIdx.x % 128 == 0,
              !Epi::kWholeTile || w == 0);
        }
        continue;
      }
    }
    // Direct stores: registers -> global, rows >= M and columns >= N masked.
#pragma unroll
    for (int wh = 0; wh < 2 * kWaves; ++wh) {
      const int w = wh / 2, h = wh % 2;
      const int row = m0 + w * 64 * kNumMathWG + row0 + 8 * h;
      if (row >= m) continue;
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        const int col = n0 + 8 * j + col0;
        if (col >= kN) continue;
        const float v0 = fin[w][4 * j + 2 * h], v1 = fin[w][4 * j + 2 * h + 1];
        const long long off = (static_cast<long long>(kg) * m + row) * kN + col;
        if constexpr (kOut == 0) {
          u16* o = reinterpret_cast<u16*>(out) + off;
          if constexpr (kN % 2 == 0) {
            *reinterpret_cast<u32*>(o) = cvt_bf16x2(v0, v1);
          } else {
            o[0] = cvt_bf16(v0);
            if (col + 1 < kN) o[1] = cvt_bf16(v1);
          }
        } else {
          float* o = reinterpret_cast<float*>(out) + off;
          if constexpr (kN % 2 == 0) {
            float2 v = make_float2(v0, v1);
            if constexpr (kAccumulate) {
              const float2 old = *reinterpret_cast<const float2*>(o);
              v.x += old.x;
              v.y += old.y;
            }
            *reinterpret_cast<float2*>(o) = v;
          } else {
            o[0] = kAccumulate ? o[0] + v0 : v0;
            if (col + 1 < kN) o[1] = kAccumulate ? o[1] + v1 : v1;
          }
        }
      }
    }
  }
  }
  // The staging boxes stay valid (and the kernel alive) until the last stores completed.
  if constexpr (kEpiBoxes > 0) {
    if (threadIdx.x % 128 == 0) tma_store_wait<0>();
  }
}

// Mma: a struct with `static void mma(float (&d)[kBlockN / 2], u64 desc_a, u64 desc_b, bool
// accumulate)` issuing one wgmma.mma_async m64n<kBlockN>k32 e4m3 (generated per BLOCK_N).
// kOut: 0 = bf16, 1 = fp32. kAccumulate (fp32 only): D += A·Bᵀ. kUnrollK: unroll factor of the
// math warpgroups' K loop. kDoubleAcc (one wave only): two wgmma accumulators, so the next
// 128-K block's wgmmas run while this block is promoted (wgmma.wait_group 1 instead of 0).
// kEpiBoxes > 0: the epilogue stages the tile in shared memory (kEpiBoxes boxes per warpgroup at
// a time) and writes it with TMA stores (TMA reductions for accumulate) through `tma_d`, a
// descriptor of D with 64-row x 128-byte boxes and 128-byte swizzle (see EpiShape); 0: `out` is
// written directly from registers. kGroupMode 1 (DeepGEMM's m-grouped contiguous layout): B is the
// [G, N, K] stack seen as [G * N, K], sf_b [G, ⌈N/128⌉, ⌈K/128⌉]; each tile takes its group from
// `block_group` (see tile_group) and rows with m_indices -1 store zeros; otherwise the last three
// arguments are unused. kGroupMode: 0 dense, 1 M-grouped (above), 2 K-grouped (the experts'
// wgrad, 1D1D): D is [G, M, N] seen as [G·M, N], group g's K blocks are group_info[g] ..
// group_info[g + 1] - 1 of A [M, ΣK] and B [N, ΣK] (group_unit); `m` is the per-group M. 3
// masked (DeepGEMM's decode layout): A [G, M_max, K], B [G, N, K], D [G, M_max, N] seen as 2D,
// `m` = M_max, group_info = masked_m; tiles at or past masked_m[g] are skipped (rows past it in
// a computed tile are written, as the contract allows). kRasterM: rows of A per rasterization
// group (unit_coords; UnitShape::kGroup M-groups, at least one). kMcastA (kCluster = 2, dense
// only): the cluster shares A over adjacent N-blocks instead of B over adjacent M-blocks; tma_a's
// box is then BLOCK_M / 2 rows, tma_b's BLOCK_N. kSplitK (dense, M-grouped): units from
// num_dp_units on are `splits` K-slices of the last tiles (group_unit, split_fixup), with
// `split_ws` (FP32, splits x BLOCK_M x BLOCK_N per cut tile) and `split_counters` (int, 4 per
// math warpgroup per cut tile, zero before the launch and left zero after it).
template <class Mma, int kBlockM, int kBlockN, int kNumStages, int kN, int kK, bool k1D1D,
          int kOut, bool kAccumulate, int kCluster, int kUnrollK, bool kDoubleAcc, int kEpiBoxes,
          int kGroupMode, int kRasterM = kDefaultRasterM, bool kMcastA = false,
          bool kSplitK = false>
__global__ void __launch_bounds__((MathShape<kBlockM>::kWarpgroups + 1) * 128, 1)
    fp8_gemm_nt_kernel(const __grid_constant__ TmaDescriptor tma_a,
                       const __grid_constant__ TmaDescriptor tma_b,
                       const __grid_constant__ TmaDescriptor tma_sfa,
                       const __grid_constant__ TmaDescriptor tma_sfb,
                       const __grid_constant__ TmaDescriptor tma_d, const float* sf_b, void* out,
                       int m, const int* m_indices, const int* block_group, int num_groups,
                       const int* group_info, int num_dp_units, int splits, float* split_ws,
                       int* split_counters) {
  using Epi = EpiShape<kBlockM, kBlockN, kOut, kEpiBoxes>;
  using Smem = Fp8GemmSmem<kBlockM, kBlockN, kNumStages, k1D1D, Epi::kBytes>;
  constexpr int kNumMathWG = MathShape<kBlockM>::kWarpgroups;
  constexpr int kNumKBlocks = (kK + 127) / 128;
  using Units = UnitShape<kBlockM, kBlockN, kN, kCluster, kMcastA, kRasterM>;
  constexpr int kGroup = Units::kGroup;
  static_assert(kBlockM == 64 || kBlockM == 128 || kBlockM == 256, "BLOCK_M: 64, 128 or 256");
  // A tile at n0 = j * BLOCK_N starts at most 128 - gcd(BLOCK_N, 128) columns into its scale
  // block, so it spans at most two 128-column scale blocks of B iff BLOCK_N <= 128 + that gcd
  // (16..160 in steps of 16, and 192).
  static_assert(kBlockN % 16 == 0 && kBlockN >= 16 && kBlockN <= 192 &&
                    kBlockN <= 128 + ((kBlockN & -kBlockN) < 128 ? (kBlockN & -kBlockN) : 128),
                "BLOCK_N: a multiple of 16 in [16, 160], or 192 (a tile then spans at most two "
                "128-column scale blocks of B)");
  static_assert(kOut == 1 || !kAccumulate, "accumulate needs an fp32 output");
  static_assert(kCluster == 1 || kCluster == 2, "clusters of 1 or 2 CTAs");
  static_assert(kGroupMode != 1 || (kCluster == 1 && kBlockM <= 128 && !k1D1D),
                "M-grouped: 1D2D, BLOCK_M 64 or 128 (inside one 128-row chunk), no multicast");
  static_assert(kGroupMode != 2 || (kCluster == 1 && kBlockM <= 128 && k1D1D && !kDoubleAcc),
                "K-grouped: 1D1D, BLOCK_M 64 or 128, no multicast, one accumulator (runtime K)");
  static_assert(kGroupMode != 3 || (kCluster == 1 && kBlockM <= 128 && !k1D1D),
                "masked: 1D2D, BLOCK_M 64 or 128, no multicast");
  static_assert(!kMcastA || kCluster == 2, "multicast of A: clusters of 2 CTAs");
  static_assert(!kSplitK || ((kGroupMode == 0 || kGroupMode == 1) && kDoubleAcc),
                "split tail: dense or M-grouped GEMMs with double accumulators (K-slices of whole "
                "chunks)");
  constexpr u32 kHalfB = Smem::kBytesB / kCluster;  // the part of B one CTA of the cluster loads
  constexpr u32 kHalfA = Smem::kBytesA / kCluster;  // kMcastA: the part of A one CTA loads

  extern __shared__ unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  unsigned char* smem_d = smem;
  unsigned char* smem_a = smem + Smem::kOffA;
  unsigned char* smem_b = smem + Smem::kOffB;
  unsigned char* smem_sfa = smem + Smem::kOffSfa;
  unsigned char* smem_sfb = smem + Smem::kOffSfb;
  u64* full = reinterpret_cast<u64*>(smem + Smem::kOffBar);
  u64* empty = full + kNumStages;

  const int wg = threadIdx.x / 128;
  const int num_m_blocks = (m + kBlockM - 1) / kBlockM;
  // Work units (UnitShape): kCluster adjacent M-blocks of one N-block; the CTAs of a cluster
  // take one unit together (CTA rank r its M-block r) and share B through multicast; with
  // kMcastA, adjacent N-blocks sharing A. A block past M or N (odd count) is computed on
  // zero-filled operands and not stored.
  const u32 rank = kCluster > 1 ? cluster_ctarank() : 0u;
  const int num_m_groups = (num_m_blocks + Units::kClusterM - 1) / Units::kClusterM;
  int num_units = num_m_groups * Units::kNumNUnits * (kGroupMode >= 2 ? num_groups : 1);
  // Split tail: the units past num_dp_units become `splits` K-slices each (group_unit).
  if constexpr (kSplitK) num_units = num_dp_units + (num_units - num_dp_units) * splits;
  const int first_unit = blockIdx.x / kCluster;
  const int unit_stride = gridDim.x / kCluster;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kNumStages; ++s) {
      mbarrier_init(&full[s], 1);
      // One arrival per math warp of every CTA of the cluster: a stage is free only when no CTA
      // still reads the B that this CTA multicasts into it.
      mbarrier_init(&empty[s], kNumMathWG * 4 * kCluster);
    }
    fence_mbarrier_init();
  }
  if constexpr (kCluster > 1) {
    cluster_sync();  // the peers' barriers exist before any multicast lands on them
  } else {
    __syncthreads();
  }
  // Programmatic dependent launch (ptxtrain.jit.BoundLaunch(programmatic=True)): this one's first
  // global access (loads of A, B and the scales, stores of D) waits for the previous kernel's
  // results; the next kernel may launch once the producer of every CTA has issued its last
  // loads (below), so its prologue overlaps only this one's last tiles.
  grid_dependency_wait();

  if (wg == kNumMathWG) {
    // ---- producer warpgroup: one thread issues every TMA load ----------------------------
    if constexpr (kNumMathWG == 2) setmaxnreg_dec<40>();
    if (threadIdx.x % 128 == 0) {
      tma_prefetch_desc(&tma_a);
      tma_prefetch_desc(&tma_b);
      tma_prefetch_desc(&tma_sfa);
      if constexpr (k1D1D) tma_prefetch_desc(&tma_sfb);
      if constexpr (kEpiBoxes > 0) tma_prefetch_desc(&tma_d);
      u32 it = 0;
      // The math warpgroups' two unit loops (fp8_gemm_math), unit for unit.
      int unit = first_unit;
#pragma unroll
      for (int phase = 0; phase < (kSplitK ? 2 : 1); ++phase) {
      const bool kSlice = phase == 1;
      for (; unit < (kSplitK && !kSlice ? num_dp_units : num_units); unit += unit_stride) {
        int mg, nb, kg, kb_begin, num_kb, slice;
        phase_unit<kGroupMode, kGroup, Units::kNumNUnits, kNumKBlocks, kSplitK,
                   PTXTRAIN_GEMM_CHUNK>(
            kSlice, unit, num_m_groups * Units::kNumNUnits, num_m_groups, group_info, mg, nb, kg,
            kb_begin, num_kb, slice, num_dp_units, splits);
        const int m0 = Units::m0(mg, rank);
        const int n0 = Units::n0(nb, rank);
        // M-grouped / masked: B is [G * N, K], group g's rows start at g * N; all-padding and
        // masked-off tiles load nothing (the math warpgroups skip them too, so the stage ring
        // stays in step). Masked: A is [G * M_max, K], group g's rows start at g * M_max.
        const int group =
            tile_group<kGroupMode, kBlockM>(block_group, group_info, m0, kg, num_groups);
        if (group < 0) continue;
        const int a_row = (kGroupMode == 3 ? kg * m : 0) + m0;
        const float* sfb_lo_hi[2];
        if constexpr (sfb_in_stage<k1D1D, kBlockM, kK, kGroupMode>()) {
          sfb_rows<kN, kK, kBlockN, kGroupMode>(sf_b, group, n0, sfb_lo_hi);
        }
#pragma unroll 1
        for (int kbi = 0; kbi < num_kb; ++kbi, ++it) {
          const int kb = kb_begin + kbi;  // (K-grouped: this group's K blocks)
          const u32 s = it % kNumStages;
          const u32 phase = (it / kNumStages) & 1u;
          mbarrier_wait(&empty[s], phase ^ 1u);  // a fresh barrier passes parity 1 at once
          if constexpr (sfb_in_stage<k1D1D, kBlockM, kK, kGroupMode>()) {
            // 1D2D: block kb's two scales of B into the stage; the stage's phase completes only
            // once they have landed (read by the math warps after their `full` wait).
            unsigned char* slot = smem_sfb + s * Smem::kSlotSfb;
            cp_async_4(slot, sfb_lo_hi[0] + kb);
            cp_async_4(slot + 4, sfb_lo_hi[1] + kb);
            cp_async_mbarrier_arrive(&full[s]);
          }
          // The full tiles arrive: this CTA's part plus the peer's multicast part.
          mbarrier_arrive_expect_tx(&full[s], Smem::kTxBytes);
          if constexpr (kMcastA) {
            tma_load_2d_multicast(smem_a + s * Smem::kBytesA + rank * kHalfA, &tma_a, &full[s],
                                  kb * 128, a_row + static_cast<int>(rank) * (kBlockM / kCluster),
                                  static_cast<u16>((1u << kCluster) - 1u));
          } else {
            tma_load_2d(smem_a + s * Smem::kBytesA, &tma_a, &full[s], kb * 128, a_row);
          }
          if constexpr (kCluster > 1 && !kMcastA) {
            tma_load_2d_multicast(smem_b + s * Smem::kBytesB + rank * kHalfB, &tma_b, &full[s],
                                  kb * 128, n0 + static_cast<int>(rank) * (kBlockN / kCluster),
                                  static_cast<u16>((1u << kCluster) - 1u));
          } else {
            tma_load_2d(smem_b + s * Smem::kBytesB, &tma_b, &full[s], kb * 128, group * kN + n0);
          }
          tma_load_2d(smem_sfa + s * Smem::kSlotSfa, &tma_sfa, &full[s], a_row, kb);
          if constexpr (k1D1D) tma_load_2d(smem_sfb + s * Smem::kSlotSfb, &tma_sfb, &full[s], n0, kb);
        }
      }
      }
      grid_dependency_launch();
    }
  } else {
    fp8_gemm_math<Mma, kBlockM, kBlockN, kNumStages, kN, kK, k1D1D, kOut, kAccumulate, kCluster,
                  kUnrollK, kDoubleAcc, kEpiBoxes, kGroupMode, kRasterM, kMcastA, kSplitK>(
        smem_d, smem_a, smem_b, smem_sfa, smem_sfb, full, empty, sf_b, &tma_d, out, m,
        num_m_groups, num_units, first_unit, unit_stride, rank, m_indices, block_group,
        num_groups, group_info, num_dp_units, splits, split_ws, split_counters);
  }
  // No CTA leaves while a peer may still multicast into it or arrive on its barriers.
  if constexpr (kCluster > 1) {
    __syncwarp();
    cluster_sync();
  }
}

}  // namespace ptxtrain
