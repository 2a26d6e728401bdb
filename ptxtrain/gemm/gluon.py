"""Block-scaled FP8 GEMMs in Gluon (Triton's explicit-layout dialect), sm_90 only. The
warp-specialized kernel is what ``ptxtrain.gemm.triton`` runs for GEMMs of at least two waves of
128x128 tiles (``heuristics.prefers_gluon`` / ``gluon_tile``); the single-partition kernel is
kept as a measured alternative and is not selected anywhere.

Design note. The Triton kernels (``ptxtrain.gemm.triton``) stop at about 0.78x cuBLAS at
M = 4096 because Triton 3.6 waits for each block's WGMMAs before the FP32 promotion reads them
(``wgmma.wait_group 0`` after every ``tl.dot``, even with two dots per iteration or a lagged
promotion: checked in the PTX), and its automatic warp specialization, which would split
the two, hangs or faults on sm_90. Gluon exposes the WGMMA wait itself, so this kernel gives one
partition the overlap of DeepGEMM's math warpgroups:

- a ``NUM_STAGES``-deep ring of A [BM, 128] / B [BN, 128] tiles in shared memory, filled by TMA,
  one mbarrier per stage;
- two block accumulators ``X`` and ``Y`` alternating between even and odd K blocks: block
  ``kb``'s WGMMAs are issued asynchronously, then ``warpgroup_mma_wait(1)`` returns block
  ``kb - 1``'s result while ``kb``'s still runs, and that result is promoted
  (``acc += blk * sf_a[:, None] * sf_b``) on the CUDA cores under the running WGMMAs;
- the stage of block ``kb - 1`` is refilled (block ``kb - 1 + NUM_STAGES``) once its WGMMAs are
  known complete, by the same warps;
- K runs in unrolled chunks of ``CHUNK`` blocks whose last block is drained (wait_group 0) at
  the chunk's end: ptxas serializes every WGMMA of a kernel in which one stays in flight across
  a loop's back edge (C7514). The blocks past the last whole chunk run one at a time.

On an H200 this kernel is correct (``calc_diff`` against the reference below 1e-6) but runs
at 0.26-0.65x cuBLAS at M = 4096, below the plain Triton kernel: three [BM, BN] fp32 tensors
leave registers for 64-column tiles only (128 columns spill), and Gluon's lowering puts a
CTA-wide ``bar.sync`` around every mbarrier and TMA operation, so the two warpgroups run in
lockstep.

``_gemm_ws_kernel`` (``GluonConfig(warp_specialized=True)``) is DeepGEMM's structure through
``gl.warp_specialize``: a TMA producer partition (40 registers) that brings each K block's A
(one [64, 128] box per 64-row wave), B and scales (sf_a, and 1D1D's per-column sf_b) into a
stage, and two consumer warpgroups (232 registers) of one or two 64-row waves each, each
waiting for its own WGMMAs and promoting while the other's run; persistent (one program per
SM; the producer runs into the next tile during the epilogue) with a TMA-store epilogue, and
for ``D +=`` the tile's old value TMA-loaded under the K loop. Explicit warp specialization
works on sm_90 (only Triton's automatic pass faults). On an H200 (see docs/performance.md):
1D2D at M = 4096 0.85-1.10x cuBLAS, geomean 0.976 with the tiles ``gluon_tile`` picks (the
plain Triton kernel: 0.78); 1D1D 0.94-0.97x. Two choices carry that: the scales come by TMA,
not by consumer global loads (4096 x 7168 x 16384: 0.85x cuBLAS instead of 0.73), and 256-row
tiles read a third fewer L2 bytes per FLOP (0.97x; 128x128 tiles run at 81% of L2
throughput). The scale ring has one slot more than the stages (see ``_ws_consumer``): with a
slot per stage the consumers can release a stage before their loads of its scales return
(0.1% wrong outputs).
A partial last wave of tiles is cut into K-slices (``GluonConfig.split_k``, the tiles past
``whole``, a second loop behind the SPLIT constexpr): a lone 256x128 x 7168 tile takes 47 µs on
one SM, so 4096 x 2112 x 7168's last 8 tiles cost a whole third wave; as 8 x 7 slices on the
otherwise idle SMs, whose fp32 partial sums ``_split_finish_kernel`` adds in slice order, it
runs 0.98x cuBLAS (256x64 tiles: 0.85x), and the Triton backend's M = 4096 geomean is
1.007-1.012x.
Each WGMMA sums 128 products at most (one 1x128 / 128x128 scale block; DeepSeek-V3 §3.3).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ptxtrain.gemm.heuristics import (
    GLUON_SPLIT_MAX,
    SM90_SMEM_BYTES,
    device_sms,
    gluon_split_k,
)

BLOCK_K = gl.constexpr(128)  # one 1x128 / 128x128 scale block per K step


@gluon.jit
def _scale_ptrs(sfa_ptr, sfb_ptr, rows, cols, off_n, M, N, stride_sfa_m, stride_sfb_n,
                SFB_PER_COL: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """K-block 0's scale pointers of a tile: sf_a per row, sf_b per column (1D1D, or a 1D2D
    tile that may span two 128-row blocks of B) or one scalar (a 1D2D tile inside one block).
    Rows and columns past M / N read row 0 (in bounds; their results are never stored)."""
    sfa_ptrs = sfa_ptr + gl.where(rows < M, rows, 0) * stride_sfa_m
    if SFB_PER_COL:
        sfb_ptrs = sfb_ptr + gl.where(cols < N, cols, 0) * stride_sfb_n
    elif BLOCK_K % BLOCK_N != 0:
        sfb_ptrs = sfb_ptr + (gl.where(cols < N, cols, 0) // BLOCK_K) * stride_sfb_n
    else:
        sfb_ptrs = sfb_ptr + (off_n // BLOCK_K) * stride_sfb_n
    return sfa_ptrs, sfb_ptrs


@gluon.jit
def _scaled_add(acc, blk, sfa, sfb, PER_COL: gl.constexpr):
    """acc + blk · sf_a[:, None] · sf_b: the FP32 promotion of one 128-K block."""
    if PER_COL:
        return acc + (blk * sfa[:, None]) * sfb[None, :]
    else:
        return acc + blk * (sfa * sfb)[:, None]


@gluon.jit
def _promote(acc, blk, sfa_ptrs, sfb_ptrs, kb, stride_sfa_k, stride_sfb_k,
             PER_COL: gl.constexpr):  # fmt: skip
    """:func:`_scaled_add` with K block ``kb``'s scales."""
    sfa = gl.load(sfa_ptrs + kb * stride_sfa_k)
    sfb = gl.load(sfb_ptrs + kb * stride_sfb_k)
    return _scaled_add(acc, blk, sfa, sfb, PER_COL)


@gluon.jit
def _pin(x):
    """``x`` itself, through a side-effecting register move: LLVM may not sink the arithmetic
    that produced ``x`` past a later side-effecting operation (with two waves it sank the first
    wave's promotion past the second wave's WGMMAs, keeping two block accumulators live: 256
    registers)."""
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=gl.float32,
                                     is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def _store_tile(out_ptr, acc, rows, cols, M, N, stride_om, stride_on, ACCUMULATE: gl.constexpr):
    """Masked pointer stores of an fp32 tile in its own layout (``out += acc`` for ACCUMULATE)."""
    out_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if ACCUMULATE:
        acc = acc + gl.load(out_ptrs, mask=mask, other=0.0)
    gl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _tile_coords(t, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, group_m):
    """(off_m, off_n) of tile ``t``; ``group_m`` tile rows share their B tiles in L2."""
    width = group_m * gl.cdiv(N, BLOCK_N)
    first_m = (t // width) * group_m
    group_rows = gl.minimum(gl.cdiv(M, BLOCK_M) - first_m, group_m)
    return (first_m + (t % width) % group_rows) * BLOCK_M, ((t % width) // group_rows) * BLOCK_N


@gluon.jit
def _issue_load(a_desc, b_desc, a_ring, b_ring, ready, kb, off_m, off_n, pred,
                NUM_STAGES: gl.constexpr):  # fmt: skip
    """TMA loads of K block ``kb`` into its stage (predicated: no branch in the K loop)."""
    s = kb % NUM_STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, kb * BLOCK_K], bar, a_ring.index(s), pred=pred)
    tma.async_copy_global_to_shared(b_desc, [off_n, kb * BLOCK_K], bar, b_ring.index(s), pred=pred)


@gluon.jit
def _gemm_kernel(a_desc, b_desc, sfa_ptr, sfb_ptr, out_ptr, M, N, K, stride_sfa_m, stride_sfa_k,
                 stride_sfb_n, stride_sfb_k, stride_om, stride_on, SFB_PER_COL: gl.constexpr,
                 ACCUMULATE: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                 CHUNK: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    off_m, off_n = _tile_coords(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 32]
    )
    rows_l: gl.constexpr = gl.SliceLayout(1, mma_layout)
    cols_l: gl.constexpr = gl.SliceLayout(0, mma_layout)
    rows = off_m + gl.arange(0, BLOCK_M, layout=rows_l)
    cols = off_n + gl.arange(0, BLOCK_N, layout=cols_l)
    sfa_ptrs, sfb_ptrs = _scale_ptrs(sfa_ptr, sfb_ptr, rows, cols, off_n, M, N, stride_sfa_m,
                                     stride_sfb_n, SFB_PER_COL, BLOCK_N)  # fmt: skip

    a_ring = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)

    PER_COL: gl.constexpr = SFB_PER_COL or (BLOCK_K % BLOCK_N != 0)
    k_steps = gl.cdiv(K, BLOCK_K)
    for s in gl.static_range(NUM_STAGES):
        _issue_load(a_desc, b_desc, a_ring, b_ring, ready, s, off_m, off_n, s < k_steps,
                    NUM_STAGES)  # fmt: skip

    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
    x = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
    y = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, mma_layout)
    # Chunks of CHUNK blocks, unrolled, with X / Y alternating: block i's WGMMAs are issued,
    # then wait_group 1 retires block i - 1 alone, which is promoted under block i's WGMMAs.
    # The chunk's last block is drained (wait_group 0) at its end: ptxas serializes every
    # WGMMA of a kernel in which one stays in flight across a loop's back edge (C7514).
    n_chunks = k_steps // CHUNK
    for c in range(n_chunks):
        for i in gl.static_range(CHUNK):
            kb = c * CHUNK + i
            st = kb % NUM_STAGES
            mbarrier.wait(ready.index(st), (kb // NUM_STAGES) & 1)
            b_tile = b_ring.index(st).permute((1, 0))
            if i % 2 == 0:
                x = warpgroup_mma(a_ring.index(st), b_tile, x, use_acc=False, is_async=True)
                if i > 0:
                    y = warpgroup_mma_wait(num_outstanding=1, deps=(y,))
                    acc = _promote(acc, y, sfa_ptrs, sfb_ptrs, kb - 1, stride_sfa_k,
                                   stride_sfb_k, PER_COL)  # fmt: skip
            else:
                y = warpgroup_mma(a_ring.index(st), b_tile, y, use_acc=False, is_async=True)
                x = warpgroup_mma_wait(num_outstanding=1, deps=(x,))
                acc = _promote(acc, x, sfa_ptrs, sfb_ptrs, kb - 1, stride_sfa_k, stride_sfb_k,
                               PER_COL)  # fmt: skip
            if i > 0:  # block kb - 1's WGMMAs are done: its stage takes block kb - 1 + STAGES
                nxt = kb - 1 + NUM_STAGES
                _issue_load(a_desc, b_desc, a_ring, b_ring, ready, nxt, off_m, off_n,
                            nxt < k_steps, NUM_STAGES)  # fmt: skip
        kb = c * CHUNK + CHUNK - 1
        if (CHUNK - 1) % 2 == 0:
            x = warpgroup_mma_wait(num_outstanding=0, deps=(x,))
            acc = _promote(acc, x, sfa_ptrs, sfb_ptrs, kb, stride_sfa_k, stride_sfb_k,
                           PER_COL)  # fmt: skip
        else:
            y = warpgroup_mma_wait(num_outstanding=0, deps=(y,))
            acc = _promote(acc, y, sfa_ptrs, sfb_ptrs, kb, stride_sfa_k, stride_sfb_k,
                           PER_COL)  # fmt: skip
        nxt = kb + NUM_STAGES
        _issue_load(a_desc, b_desc, a_ring, b_ring, ready, nxt, off_m, off_n, nxt < k_steps,
                    NUM_STAGES)  # fmt: skip
    # The K blocks past the last whole chunk, one at a time (no overlap).
    for kb in range(n_chunks * CHUNK, k_steps):
        st = kb % NUM_STAGES
        mbarrier.wait(ready.index(st), (kb // NUM_STAGES) & 1)
        x = warpgroup_mma(a_ring.index(st), b_ring.index(st).permute((1, 0)), x, use_acc=False,
                          is_async=True)  # fmt: skip
        x = warpgroup_mma_wait(num_outstanding=0, deps=(x,))
        acc = _promote(acc, x, sfa_ptrs, sfb_ptrs, kb, stride_sfa_k, stride_sfb_k, PER_COL)
        nxt = kb + NUM_STAGES
        _issue_load(a_desc, b_desc, a_ring, b_ring, ready, nxt, off_m, off_n, nxt < k_steps,
                    NUM_STAGES)  # fmt: skip
    for s in gl.static_range(NUM_STAGES):
        mbarrier.invalidate(ready.index(s))

    _store_tile(out_ptr, acc, rows, cols, M, N, stride_om, stride_on, ACCUMULATE)


# ---------------------------------------------------------------------------------------------
# Warp-specialized: DeepGEMM's structure, a TMA producer and two consumer warpgroups
# ---------------------------------------------------------------------------------------------
# Each consumer warpgroup owns WAVES x 64 rows of a tile of BLOCK_M = 128 WAVES rows (WAVES = 1
# or 2): per K block it waits for the stage and, wave by wave, issues the 64 rows' WGMMAs, waits
# for them and promotes them into that wave's running sum (after its last wave it releases the
# stage: count-2 "empty" barrier). The two warpgroups are not in lockstep, so one's promotion
# runs under the other's WGMMAs; the producer (4 warps, one thread issuing) keeps NUM_STAGES
# blocks in flight. Two waves per warpgroup (a 256-row tile) read each B tile for twice the rows
# (a third less L2 traffic per FLOP than 128-row tiles) with one [64, BLOCK_N] block
# accumulator and two running sums in registers.


@gluon.jit
def _slice_blocks(j, splits, k_steps):
    """(first, end) K block of K-slice ``j % splits`` of a split tile."""
    return ((j % splits) * k_steps) // splits, ((j % splits + 1) * k_steps) // splits


@gluon.jit
def _produce(a_desc, b_desc, a_ring, b_ring, ready, empty, flags, sfa_desc, sfb_desc, sfa_ring,
             sfb_ring, off_m, off_n, kb0, kb1, it):  # fmt: skip
    """TMA loads of K blocks ``[kb0, kb1)`` of the tile at ``(off_m, off_n)`` into the ring from
    position ``it`` on; returns the position after them."""
    # (In the default partition constexpr arguments arrive as values: sizes come from types.)
    HALF: gl.constexpr = a_desc.block_type.shape[0]
    STAGES: gl.constexpr = b_ring.type.shape[0]
    BOXES: gl.constexpr = a_ring.type.shape[0] // STAGES  # A boxes per stage: 2 WAVES
    SFB_PER_COL: gl.constexpr = flags.type.shape[0] == 2
    SCALES_TMA: gl.constexpr = flags.type.shape[3] == 2
    nbytes: gl.constexpr = BOXES * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    sf_nbytes: gl.constexpr = BOXES * sfa_desc.block_type.nbytes + (
        sfb_desc.block_type.nbytes if SFB_PER_COL else 0
    )
    for kb in range(kb0, kb1):
        st = it % STAGES
        # mbarriers start with the phase before 0 complete: the first pass does not wait.
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
        bar = ready.index(st)
        k0 = kb * BLOCK_K
        if SCALES_TMA:
            mbarrier.expect(bar, nbytes + sf_nbytes)
            # sf_a's MN-major view is [ceil(K/128), M]: row kb, 64 columns per A box. The
            # scale ring has one slot more than the stages (slot it % (STAGES + 1); see
            # the consumer).
            ss = it % (STAGES + 1)
            for i in gl.static_range(BOXES):
                tma.async_copy_global_to_shared(sfa_desc, [kb, off_m + i * HALF], bar,
                                                sfa_ring.index(ss * BOXES + i))  # fmt: skip
            if SFB_PER_COL:
                tma.async_copy_global_to_shared(sfb_desc, [kb, off_n], bar,
                                                sfb_ring.index(ss))  # fmt: skip
        else:
            mbarrier.expect(bar, nbytes)
        for i in gl.static_range(BOXES):
            tma.async_copy_global_to_shared(a_desc, [off_m + i * HALF, k0], bar,
                                            a_ring.index(st * BOXES + i))  # fmt: skip
        tma.async_copy_global_to_shared(b_desc, [off_n, k0], bar, b_ring.index(st))
        it += 1
    return it


@gluon.jit
def _ws_producer(args):
    """The TMA producer (the default partition): the K blocks of this program's tiles, one
    after another, running ahead into the next tile while the consumers store the last. Each
    stage takes BLOCK_M / 64 A boxes of [64, 128] and one B box; with SCALES_TMA also the K
    block's sf_a ([1, 64] per A box) and, for per-column sf_b (1D1D), its [1, BLOCK_N] box.
    With SPLIT, then this program's K-slices of the tiles past ``whole``."""
    (a_desc, b_desc, a_ring, b_ring, ready, empty, _sfa, _sfb, _out, M, N, K,
     _s0, _s1, _s2, _s3, _s4, _s5, group_m, flags, _c, _c0, _c1,
     sfa_desc, sfb_desc, sfa_ring, sfb_ring, _cb, _ws, whole, splits) = args  # fmt: skip
    HALF: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BOXES: gl.constexpr = a_ring.type.shape[0] // b_ring.type.shape[0]
    SPLIT: gl.constexpr = flags.type.shape[4] == 2
    k_steps = gl.cdiv(K, BLOCK_K)
    ring = (a_desc, b_desc, a_ring, b_ring, ready, empty, flags, sfa_desc, sfb_desc, sfa_ring,
            sfb_ring)  # fmt: skip
    num_tiles = gl.cdiv(M, BOXES * HALF) * gl.cdiv(N, BLOCK_N)
    # (Without SPLIT the bound is computed here, not taken from ``whole``: with ``whole`` as the
    # unsplit kernel's bound ptxas schedules consumer 1's WGMMAs after scale FMULs, 4-5% slower.)
    it = 0  # K blocks issued by this program so far (all tiles): the ring position
    for t in range(gl.program_id(0), whole if SPLIT else num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_coords(t, M, N, BOXES * HALF, BLOCK_N, group_m)
        it = _produce(*ring, off_m, off_n, 0, k_steps, it)
    if SPLIT:  # (whole is a multiple of the programs: this program's first slice is its id)
        for j in range(gl.program_id(0), (num_tiles - whole) * splits, gl.num_programs(0)):
            off_m, off_n = _tile_coords(whole + j // splits, M, N, BOXES * HALF, BLOCK_N, group_m)
            kb0, kb1 = _slice_blocks(j, splits, k_steps)
            it = _produce(*ring, off_m, off_n, kb0, kb1, it)


@gluon.jit
def _consume(a_ring, b_ring, ready, empty, flags, sfa_ring, sfb_ring, sfa_ptr, sfb_ptrs, rows, M,
             stride_sfa_m, stride_sfa_k, stride_sfb_k, kb0, kb1, it, blk, acc0, acc1,
             HALF_INDEX: gl.constexpr):  # fmt: skip
    """Consumer warpgroup HALF_INDEX's WGMMAs and promotion of K blocks ``[kb0, kb1)`` of one
    tile from ring position ``it`` on, into ``acc0`` (wave 0) and ``acc1`` (wave 1); returns
    ``(acc0, acc1, blk, it)``."""
    # (sizes from the rings' types; flags as in _gemm_ws_kernel)
    NUM_STAGES: gl.constexpr = b_ring.type.shape[0]
    BLOCK_N: gl.constexpr = b_ring.type.shape[1]
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    SCALES_TMA: gl.constexpr = flags.type.shape[3] == 2
    SFB_PER_COL: gl.constexpr = flags.type.shape[0] == 2
    PER_COL: gl.constexpr = SFB_PER_COL or (BLOCK_K % BLOCK_N != 0)
    HALF: gl.constexpr = a_ring.type.shape[1]
    BOXES: gl.constexpr = a_ring.type.shape[0] // NUM_STAGES  # A boxes per stage: 2 WAVES
    WAVES: gl.constexpr = BOXES // 2
    # A stage's scale boxes read as vectors in the accumulator's row / column layout.
    vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    for kb in range(kb0, kb1):
        st = it % NUM_STAGES
        mbarrier.wait(ready.index(st), (it // NUM_STAGES) & 1)
        b_tile = b_ring.index(st).permute((1, 0))
        # The scales sit in a ring of NUM_STAGES + 1 slots: slot it % (NUM_STAGES + 1) is
        # written again for block it + NUM_STAGES + 1, whose stage the producer gets only
        # once this warpgroup has released block it + 1, in a later iteration; before that
        # iteration's start (a branch) every scale load of this one, consumed by this
        # iteration's promotion, has returned. Read from a slot the release below frees, with
        # ptxas free to sink the loads past it, 0.1% of 1D1D's outputs come out wrong; a proxy
        # fence before the release fixes that too but costs 1-5%, a release after the promotion
        # 18% for 1D1D.
        ss = it % (NUM_STAGES + 1)
        for w in gl.static_range(WAVES):
            box = st * BOXES + HALF_INDEX * WAVES + w
            blk = warpgroup_mma(a_ring.index(box), b_tile, blk, use_acc=False, is_async=True)
            # The scales load while the WGMMAs run (from the stage, or from global memory).
            if SCALES_TMA:
                sfa = (
                    sfa_ring.index(ss * BOXES + HALF_INDEX * WAVES + w)
                    ._reinterpret(gl.float32, [HALF], vec_layout)
                    .load(gl.SliceLayout(1, mma_layout))
                )
                if SFB_PER_COL:
                    sfb = (
                        sfb_ring.index(ss)
                        ._reinterpret(gl.float32, [BLOCK_N], vec_layout)
                        .load(gl.SliceLayout(0, mma_layout))
                    )
                else:
                    sfb = gl.load(sfb_ptrs + kb * stride_sfb_k)
            else:
                # (wave 1's rows clamped too: rows past M read row 0, in bounds)
                wave_rows = rows + w * HALF
                sfa = gl.load(sfa_ptr + gl.where(wave_rows < M, wave_rows, 0) * stride_sfa_m
                              + kb * stride_sfa_k)  # fmt: skip
                sfb = gl.load(sfb_ptrs + kb * stride_sfb_k)
            blk = warpgroup_mma_wait(num_outstanding=0, deps=(blk,))
            if w == WAVES - 1:  # this warpgroup's WGMMAs are done with the stage's A / B
                mbarrier.arrive(empty.index(st), count=1)
            if w == 0:
                acc0 = _scaled_add(acc0, blk, sfa, sfb, PER_COL)
                if WAVES == 2:  # promoted before wave 1's WGMMAs reuse blk's registers
                    acc0 = _pin(acc0)
            else:
                acc1 = _scaled_add(acc1, blk, sfa, sfb, PER_COL)
        it += 1
    return acc0, acc1, blk, it


@gluon.jit
def _ws_consumer(args, HALF_INDEX: gl.constexpr):
    """Consumer warpgroup HALF_INDEX: rows [64 WAVES HALF_INDEX, 64 WAVES (HALF_INDEX + 1)) of
    each tile of this program, in the producer's order (the same ring position ``it``); with
    SPLIT, then its K-slices of the tiles past ``whole``, whose fp32 partial sums go to the
    workspace ``ws_ptr`` (slot j of ``[slices, BLOCK_M, BLOCK_N]`` for slice j)."""
    (a_desc, b_desc, a_ring, b_ring, ready, empty, sfa_ptr, sfb_ptr, out_ptr, M, N, K,
     stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k, stride_om, stride_on, group_m,
     flags, c_desc, c0_smem, c1_smem, _sfa_desc, _sfb_desc, sfa_ring, sfb_ring,
     c_bars, ws_ptr, whole, splits) = args  # fmt: skip
    HALF: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    NUM_STAGES: gl.constexpr = b_ring.type.shape[0]
    BOXES: gl.constexpr = a_ring.type.shape[0] // NUM_STAGES
    WAVES: gl.constexpr = BOXES // 2
    SFB_PER_COL: gl.constexpr = flags.type.shape[0] == 2
    ACCUMULATE: gl.constexpr = flags.type.shape[1] == 2
    TMA_STORE: gl.constexpr = flags.type.shape[2] == 2
    SPLIT: gl.constexpr = flags.type.shape[4] == 2
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
    )
    c_smem = c0_smem if HALF_INDEX == 0 else c1_smem
    BUFS: gl.constexpr = c_smem.type.shape[0]  # staging buffers (with TMA_STORE)
    c_bar = c_bars.index(HALF_INDEX)
    k_steps = gl.cdiv(K, BLOCK_K)
    ring = (a_ring, b_ring, ready, empty, flags, sfa_ring, sfb_ring, sfa_ptr)
    blk = gl.zeros((HALF, BLOCK_N), gl.float32, mma_layout)
    num_tiles = gl.cdiv(M, BOXES * HALF) * gl.cdiv(N, BLOCK_N)
    it = 0
    for t in range(gl.program_id(0), whole if SPLIT else num_tiles, gl.num_programs(0)):
        off_m, off_n = _tile_coords(t, M, N, BOXES * HALF, BLOCK_N, group_m)
        row0 = off_m + HALF_INDEX * WAVES * HALF  # this warpgroup's first row
        rows = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma_layout))
        cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        _sfa_ptrs, sfb_ptrs = _scale_ptrs(sfa_ptr, sfb_ptr, rows, cols, off_n, M, N, stride_sfa_m,
                                          stride_sfb_n, SFB_PER_COL, BLOCK_N)  # fmt: skip
        acc0 = gl.zeros((HALF, BLOCK_N), gl.float32, mma_layout)
        acc1 = gl.zeros((HALF, BLOCK_N), gl.float32, mma_layout)  # (WAVES = 2 only)
        tile_iter = (t - gl.program_id(0)) // gl.num_programs(0)  # this program's tiles before
        if TMA_STORE and ACCUMULATE:
            # D +=: wave 0's out comes in by TMA under the K loop, into the staging buffer once
            # the previous tile's store has read it.
            tma.store_wait(0)
            mbarrier.expect(c_bar, c_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(c_desc, [row0, off_n], c_bar, c_smem.index(0))
        acc0, acc1, blk, it = _consume(*ring, sfb_ptrs, rows, M, stride_sfa_m, stride_sfa_k,
                                       stride_sfb_k, 0, k_steps, it, blk, acc0, acc1,
                                       HALF_INDEX)  # fmt: skip
        for w in gl.static_range(WAVES):
            acc = acc0 if w == 0 else acc1
            if TMA_STORE:
                # Through shared memory and one TMA store per wave (clipped at M and N), from
                # this consumer's BUFS staging buffers in turn over all its stores (D +=:
                # BUFS = 1).
                buf = c_smem.index((tile_iter * WAVES + w) % BUFS)
                if ACCUMULATE:
                    if w > 0:  # wave w's out, once the previous wave's store has read the buffer
                        tma.store_wait(0)
                        mbarrier.expect(c_bar, c_desc.block_type.nbytes)
                        tma.async_copy_global_to_shared(c_desc, [row0 + w * HALF, off_n], c_bar,
                                                        buf)  # fmt: skip
                    # c_bar's phase: its completions so far (WAVES per earlier tile)
                    mbarrier.wait(c_bar, (tile_iter * WAVES + w) & 1)
                    acc = acc + buf.load(mma_layout)
                else:  # the store that last used this buffer must have read it (the newest
                    # BUFS - 1 stores may still be in flight)
                    tma.store_wait(BUFS - 1)
                buf.store(acc.to(c_desc.dtype))
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [row0 + w * HALF, off_n], buf)
            else:
                _store_tile(out_ptr, acc, rows + w * HALF, cols, M, N, stride_om, stride_on,
                            ACCUMULATE)  # fmt: skip
    if SPLIT:  # this program's K-slices (as the producer's): partial sums to the workspace
        lrows = HALF_INDEX * WAVES * HALF + gl.arange(0, HALF, gl.SliceLayout(1, mma_layout))
        lcols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        for j in range(gl.program_id(0), (num_tiles - whole) * splits, gl.num_programs(0)):
            off_m, off_n = _tile_coords(whole + j // splits, M, N, BOXES * HALF, BLOCK_N, group_m)
            rows = off_m + lrows
            cols = off_n + lcols
            _sfa_ptrs, sfb_ptrs = _scale_ptrs(sfa_ptr, sfb_ptr, rows, cols, off_n, M, N,
                                              stride_sfa_m, stride_sfb_n, SFB_PER_COL,
                                              BLOCK_N)  # fmt: skip
            kb0, kb1 = _slice_blocks(j, splits, k_steps)
            acc0 = gl.zeros((HALF, BLOCK_N), gl.float32, mma_layout)
            acc1 = gl.zeros((HALF, BLOCK_N), gl.float32, mma_layout)
            acc0, acc1, blk, it = _consume(*ring, sfb_ptrs, rows, M, stride_sfa_m, stride_sfa_k,
                                           stride_sfb_k, kb0, kb1, it, blk, acc0, acc1,
                                           HALF_INDEX)  # fmt: skip
            slot = ws_ptr + j.to(gl.int64) * (BOXES * HALF * BLOCK_N)
            for w in gl.static_range(WAVES):
                acc = acc0 if w == 0 else acc1
                gl.store(slot + (lrows + w * HALF)[:, None] * BLOCK_N + lcols[None, :], acc)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _ws_consumer1(args):
    _ws_consumer(args, 1)


@gluon.jit
def _ws_consumer0(args):
    _ws_consumer(args, 0)


@gluon.jit
def _gemm_ws_kernel(a_desc, b_desc, sfa_ptr, sfb_ptr, out_ptr, c_desc, sfa_desc, sfb_desc, M, N,
                    K, stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k, stride_om,
                    stride_on, ws_ptr, whole, splits, SFB_PER_COL: gl.constexpr,
                    ACCUMULATE: gl.constexpr, TMA_STORE: gl.constexpr, SCALES_TMA: gl.constexpr,
                    SPLIT: gl.constexpr, WAVES: gl.constexpr,
                    STORE_BUFFERS: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
    HALF: gl.constexpr = a_desc.block_type.shape[0]  # A boxes are [64, 128]: one per wave
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    BOXES: gl.constexpr = 2 * WAVES  # two consumers of WAVES x 64 rows

    a_ring = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES * BOXES, HALF, BLOCK_K],
                                       a_desc.layout)  # fmt: skip
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    # warp_specialize passes constexpr arguments to the partitions as values, so the five
    # flags travel in the shape of an unused shared-memory descriptor:
    # [1 + SFB_PER_COL, 1 + ACCUMULATE, 1 + TMA_STORE, 1 + SCALES_TMA, 1 + SPLIT].
    flags = gl.allocate_shared_memory(
        gl.int8,
        [1 + SFB_PER_COL, 1 + ACCUMULATE, 1 + TMA_STORE, 1 + SCALES_TMA, 1 + SPLIT],
        gl.SwizzledSharedLayout(1, 1, 1, [4, 3, 2, 1, 0]),
    )
    # The scale rings ([1, 64] sf_a boxes per A box, [1, BLOCK_N] per-column sf_b boxes; one
    # slot more than the stages, see the consumer), or ``flags`` standing in.
    if SCALES_TMA:
        sfa_ring = gl.allocate_shared_memory(gl.float32, [(NUM_STAGES + 1) * BOXES, 1, HALF],
                                             sfa_desc.layout)  # fmt: skip
        if SFB_PER_COL:
            sfb_ring = gl.allocate_shared_memory(gl.float32, [NUM_STAGES + 1, 1, BLOCK_N],
                                                 sfb_desc.layout)  # fmt: skip
        else:
            sfb_ring = flags
    else:
        sfa_ring = flags
        sfb_ring = flags
    # TMA-store staging, STORE_BUFFERS [64, BLOCK_N] buffers per consumer (``flags`` stands in
    # without). With D += each wave's out comes into its buffer by TMA first (one mbarrier per
    # consumer).
    c_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if TMA_STORE:
        c_rows: gl.constexpr = c_desc.block_type.shape[0]
        c_shape: gl.constexpr = [STORE_BUFFERS, c_rows, BLOCK_N]
        c0_smem = gl.allocate_shared_memory(c_desc.dtype, c_shape, c_desc.layout)
        c1_smem = gl.allocate_shared_memory(c_desc.dtype, c_shape, c_desc.layout)
        if ACCUMULATE:
            mbarrier.init(c_bars.index(0), count=1)
            mbarrier.init(c_bars.index(1), count=1)
    else:
        c0_smem = flags
        c1_smem = flags
    args = (a_desc, b_desc, a_ring, b_ring, ready, empty, sfa_ptr, sfb_ptr, out_ptr,
            M, N, K, stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k, stride_om,
            stride_on, GROUP_M, flags, c_desc, c0_smem, c1_smem, sfa_desc, sfb_desc, sfa_ring,
            sfb_ring, c_bars, ws_ptr, whole, splits)  # fmt: skip
    gl.warp_specialize(
        [(_ws_producer, (args,)), (_ws_consumer0, (args,)), (_ws_consumer1, (args,))],
        [4, 4],
        [CONSUMER_REGS, CONSUMER_REGS],
    )


@triton.jit
def _split_finish_kernel(ws_ptr, out_ptr, M, N, stride_om, stride_on, whole, group_m,
                         SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         ROWS: tl.constexpr, ACCUMULATE: tl.constexpr):  # fmt: skip
    """Rows ``[ROWS·pid1, ROWS·(pid1 + 1))`` of split tile ``whole + pid0``: its ``SPLITS``
    partial sums from the workspace added in slice order (``out +=`` with ACCUMULATE), stored
    at the tile's place (``_tile_coords``' rasterization). The loads are unrolled so that all
    slices' are in flight at once (a loop of dependent loads ran latency-bound)."""
    tt = tl.program_id(0)
    t = whole + tt
    width = group_m * tl.cdiv(N, BLOCK_N)
    first_m = (t // width) * group_m
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, group_m)
    off_m = (first_m + (t % width) % group_rows) * BLOCK_M
    off_n = ((t % width) // group_rows) * BLOCK_N
    lrows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    lcols = tl.arange(0, BLOCK_N)
    part = ws_ptr + (tt * SPLITS).to(tl.int64) * (BLOCK_M * BLOCK_N)
    part += lrows[:, None] * BLOCK_N + lcols[None, :]
    acc = tl.load(part)
    for i in tl.static_range(1, SPLITS):
        acc += tl.load(part + i * (BLOCK_M * BLOCK_N))
    rows, cols = off_m + lrows, off_n + lcols
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if ACCUMULATE:
        acc += tl.load(ptrs, mask=mask, other=0.0)
    tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


_BK = 128  # BLOCK_K on the host
# Registers per thread the warp-specialized kernel is compiled for: 12 warps (the 4-warp TMA
# producer, the default partition, and two 4-warp consumer warpgroups) x 32 x 168 fill the
# SM's 65536; the producer gives up to 40 (setmaxnreg.dec), the consumers take 232 (.inc).
_WS_MAXNREG = 168
_WS_CONSUMER_REGS = 232


@functools.cache  # (get_default_for costs about 11 µs of host time per call)
def _smem_layout(rows: int) -> gl.NVMMASharedLayout:
    """128-byte swizzled K-major tile of ``rows`` x 128 fp8 (the layout TMA and WGMMA share)."""
    return gl.NVMMASharedLayout.get_default_for([rows, _BK], gl.float8e4nv)


@functools.cache
def _out_layout(block_n: int, fp32: bool) -> gl.NVMMASharedLayout:
    """The TMA-store staging layout of a [64, block_n] bf16 / fp32 box of the output."""
    return gl.NVMMASharedLayout.get_default_for([64, block_n], gl.float32 if fp32 else gl.bfloat16)


# A [1, n] fp32 box of an MN-major scale tensor: unswizzled, so it reads back as a vector.
_SF_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def _mn_major(sf: torch.Tensor) -> torch.Tensor:
    """``sf [rows, KB]`` with strides ``(1, 4·⌈rows/4⌉)`` and a 16-byte aligned base (the
    layout ``per_token_cast_to_fp8(..., sf_layout="mn_major")`` writes and TMA can read as
    ``[KB, rows]``): ``sf`` itself when it already is, else a copy."""
    rows, kb = sf.shape
    pad = -(-rows // 4) * 4
    if sf.stride(0) == 1 and (sf.stride(1) == pad or kb == 1) and sf.data_ptr() % 16 == 0:
        return sf
    out = torch.empty((kb, pad), dtype=sf.dtype, device=sf.device).t()[:rows]
    return out.copy_(sf)


def _sf_desc(sf: torch.Tensor, box: int):
    """TMA descriptor of ``sf``'s MN-major ``[KB, rows]`` view (:func:`_mn_major`) in
    ``[1, box]`` boxes; rows past the end read as zero."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    rows, kb = sf.shape
    stride = -(-rows // 4) * 4  # (sf.stride(1) is arbitrary when KB = 1)
    return TensorDescriptor(sf.t(), [kb, rows], [stride, 1], [1, box], _SF_LAYOUT)


def _compile_for_sm90(kind: str = "1d2d", block_m: int = 128, block_n: int = 128,
                      num_warps: int = 8, num_stages: int = 4, chunk: int = 4, out: str = "bf16",
                      accumulate: bool = False, ws: bool = False,
                      consumer_regs: int = _WS_CONSUMER_REGS,
                      scales_tma: bool = True, tma_store: bool = True,
                      store_buffers: int = 1, split: bool = False):  # fmt: skip
    """Compile the kernel for sm_90a without a GPU; returns Triton's ``CompiledKernel``."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(rows):
        return f"tensordesc<fp8e4nv[{rows}, {_BK}],{_smem_layout(rows)!r}>"

    waves = block_m // 128
    if ws:  # A in [64, 128] boxes, one per 64-row wave; 4 warps in the default partition
        block_m, num_warps = 64, 4
    signature = {"a_desc": desc(block_m), "b_desc": desc(block_n), "sfa_ptr": "*fp32",
                 "sfb_ptr": "*fp32", "out_ptr": f"*{out}"}  # fmt: skip
    if ws:  # the TMA-store descriptor (A's stands in when the kernel stores through pointers)
        c_layout = _out_layout(block_n, out == "fp32")
        signature["c_desc"] = (
            f"tensordesc<{out}[64, {block_n}],{c_layout!r}>" if tma_store else desc(block_m)
        )
        for name, box in (("sfa_desc", 64), ("sfb_desc", block_n)):
            signature[name] = (
                f"tensordesc<fp32[1, {box}],{_SF_LAYOUT!r}>" if scales_tma else desc(block_m)
            )
    signature.update({name: "i32" for name in ("M", "N", "K")})
    signature.update(
        {f"stride_{s}": "i32" for s in ("sfa_m", "sfa_k", "sfb_n", "sfb_k", "om", "on")}
    )
    if ws:  # the split tail's workspace and plan
        signature.update({"ws_ptr": "*fp32", "whole": "i32", "splits": "i32"})
    constexprs = {
        "SFB_PER_COL": kind == "1d1d",
        "ACCUMULATE": accumulate,
        "GROUP_M": 8,
        "NUM_STAGES": num_stages,
        "num_warps": num_warps,
    }
    if ws:
        constexprs["CONSUMER_REGS"] = consumer_regs
        constexprs["TMA_STORE"] = tma_store
        constexprs["SCALES_TMA"] = scales_tma
        constexprs["SPLIT"] = split
        constexprs["WAVES"] = waves
        constexprs["STORE_BUFFERS"] = store_buffers
    else:
        constexprs["CHUNK"] = chunk
    src = GluonASTSource(_gemm_ws_kernel if ws else _gemm_kernel, signature, constexprs)
    options = {"num_warps": num_warps}
    if ws:
        options["maxnreg"] = _WS_MAXNREG
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    """Launch configuration of :func:`fp8_gemm`.

    Attributes:
        block_m: tile rows, 16 x ``num_warps`` (64 with 4 warps, 128 with 8); warp-specialized
            128 or 256 (one or two 64-row waves per consumer warpgroup).
        block_n: tile columns, 64 or 128 (powers of two; 128 leaves ptxas no registers for the
            three [BM, BN] fp32 tensors and spills).
        num_warps: 4 or 8.
        num_stages: shared-memory ring depth (A + B tiles per stage: (BM + BN) x 128 bytes).
        chunk: K blocks per unrolled chunk (one exposed promotion per chunk).
        group_m: tile rows per L2 rasterization group.
        warp_specialized: run ``_gemm_ws_kernel`` instead: a TMA producer and two consumer
            warpgroups of block_m / 2 rows each (num_warps 8 counted as the consumers';
            ``chunk`` unused).
        scales_tma: (warp-specialized only) the producer brings each K block's sf_a, and
            1D1D's per-column sf_b, into the stage by TMA beside A and B (scale tensors not
            MN-major with 4-aligned rows are copied to that layout first); False: the consumers
            load them from global memory after issuing the block's WGMMAs.
        store_buffers: (warp-specialized only) TMA-store staging buffers per consumer, 1 or 2,
            used in turn: with 2, a store does not wait for the previous one (a 256-row tile's
            first wave, or the previous tile) to have read its buffer (``D +=`` uses 1).
        split_k: (warp-specialized only) cut the tiles of a partial last wave into K-slices
            that run on the SMs it would leave idle
            (:func:`ptxtrain.gemm.heuristics.gluon_split_k`): each slice writes its fp32
            partial sums to a workspace, and ``_split_finish_kernel`` adds a tile's slices in
            slice order (bitwise repeatable) and stores it.
        split_max: with split_k, the most slices per tile (2 to
            :data:`ptxtrain.gemm.heuristics.GLUON_SPLIT_MAX`, its default).

    Raises:
        ValueError: block_m not 16 x num_warps (warp-specialized: not 128 or 256 with
            num_warps 8), block_n not 64 or 128, num_stages outside
            [2, 8], chunk not 2, 4 or 8, group_m not an int >= 1, or warp_specialized /
            scales_tma not a bool, or store_buffers not 1 or 2.
    """

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 4
    chunk: int = 4
    group_m: int = 8
    warp_specialized: bool = False
    scales_tma: bool = True
    store_buffers: int = 1
    split_k: bool = False
    split_max: int = GLUON_SPLIT_MAX

    def __post_init__(self) -> None:
        for field in ("warp_specialized", "scales_tma", "split_k"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"GluonConfig.{field} must be a bool, got {getattr(self, field)!r}"
                )
        if self.warp_specialized:
            # The WGMMAs need 64-row consumers (Triton: "WGMMA result M dimension must be
            # divisible by 64"), one or two waves each.
            if self.block_m not in (128, 256) or self.num_warps != 8:
                raise ValueError(
                    f"GluonConfig(warp_specialized=True) needs block_m 128 or 256 and "
                    f"num_warps=8 (two consumer warpgroups of one or two 64-row waves), got "
                    f"block_m={self.block_m}, num_warps={self.num_warps}"
                )
        elif self.num_warps not in (4, 8) or self.block_m != 16 * self.num_warps:
            raise ValueError(
                f"GluonConfig needs num_warps in (4, 8) and block_m = 16 x num_warps, got "
                f"block_m={self.block_m}, num_warps={self.num_warps}"
            )
        if isinstance(self.split_max, bool) or self.split_max not in range(2, GLUON_SPLIT_MAX + 1):
            raise ValueError(
                f"GluonConfig.split_max must be in [2, {GLUON_SPLIT_MAX}], got {self.split_max!r}"
            )
        if self.store_buffers not in (1, 2) or isinstance(self.store_buffers, bool):
            raise ValueError(
                f"GluonConfig.store_buffers must be 1 or 2, got {self.store_buffers!r}"
            )
        if self.block_n not in (64, 128):
            raise ValueError(f"GluonConfig.block_n must be 64 or 128, got {self.block_n}")
        if isinstance(self.group_m, bool) or not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"GluonConfig.group_m must be an int >= 1, got {self.group_m!r}")
        # The ring must fit with the smallest staging (bf16); fp8_gemm checks the output's.
        smem = self.smem_bytes(2)
        if smem > SM90_SMEM_BYTES:
            raise ValueError(
                f"GluonConfig: {self.num_stages} stages of {self.block_m}x128 + "
                f"{self.block_n}x128 fp8 tiles need {smem} bytes of shared memory, over "
                f"{SM90_SMEM_BYTES}"
            )
        if not 2 <= self.num_stages <= 8 or self.chunk not in (2, 4, 8):
            raise ValueError(
                f"GluonConfig needs num_stages in [2, 8] and chunk in (2, 4, 8), got "
                f"{self.num_stages}, {self.chunk}"
            )

    def smem_bytes(self, out_size: int = 2) -> int:
        """Shared memory the kernel needs with an output of ``out_size``-byte elements: the
        A + B ring and, warp-specialized, the [64, block_n] TMA-store staging buffers, the
        TMA'd scales (block_m sf_a and block_n sf_b fp32 values per slot, stages + 1) and 1 KiB
        for the mbarriers, the flag descriptor and alignment (measured: about 250 bytes)."""
        smem = self.num_stages * (self.block_m + self.block_n) * 128 + _SMEM_SLACK
        if self.warp_specialized:
            smem += 2 * self.store_buffers * 64 * self.block_n * out_size
            if self.scales_tma:  # (a scale ring of one slot more than the stages)
                smem += (self.num_stages + 1) * (self.block_m + self.block_n) * 4
        return smem


_SMEM_SLACK = 1024  # mbarriers, flags and alignment beyond the buffers smem_bytes counts
# The stages and TMA-store buffers ``ptxtrain.gemm.triton`` runs each warp-specialized tile with
# where its default routes a GEMM here (``heuristics.prefers_gluon`` / ``gluon_tile``), the
# fastest on an H200: 4 stages for 128x128 (5 within 1%), 3 for 256x128 with two staging
# buffers per consumer (+0.3-2.5% over one), 5 for 256x64 with one (two cost it a stage: -1%),
# each where the staging of the output fits.
_WS_STAGES = {(128, 128): 4, (256, 128): 3, (256, 64): 5}
_WS_BUFFERS = {(128, 128): 1, (256, 128): 2, (256, 64): 1}


@functools.cache  # (called for every GEMM the Triton backend routes here)
def ws_config(block_m: int, block_n: int, out_size: int = 2) -> GluonConfig:
    """The warp-specialized config of a ``block_m x block_n`` tile with its measured stage count
    and staging buffers, and the split tail on (``split_k``); where the staging of
    ``out_size``-byte outputs would not fit, one buffer, then fewer stages.

    Raises:
        KeyError: a tile without measurements (not in ``heuristics.GLUON_TILES``).
    """
    tile = (block_m, block_n)
    cfg = GluonConfig(block_m, block_n, 8, _WS_STAGES[tile], 4, warp_specialized=True,
                      store_buffers=_WS_BUFFERS[tile], split_k=True)  # fmt: skip
    if cfg.smem_bytes(out_size) > SM90_SMEM_BYTES:
        cfg = dataclasses.replace(cfg, store_buffers=1)
    while cfg.smem_bytes(out_size) > SM90_SMEM_BYTES:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


@functools.cache
def _no_workspace(device: torch.device) -> torch.Tensor:
    """The fp32 pointer the kernel gets when no tile is split (never read or written)."""
    return torch.empty(1, dtype=torch.float32, device=device)


def _check_out_offsets(m: int, n: int, stride_om: int, stride_on: int) -> None:
    """The kernels address ``out`` with int64 row offsets but int32 column offsets.

    Raises:
        ValueError: ``(N - 1) x stride_on`` does not fit int32 (e.g. a column-major ``out``
            with M x N >= 2^31).
    """
    if n > 0 and (n - 1) * stride_on >= 2**31:
        raise ValueError(
            f"out's column stride {stride_on} x (N - 1 = {n - 1}) needs 64-bit offsets; pass a "
            f"row-major out (stride (N, 1)) to the Gluon GEMM"
        )


def fp8_gemm(kind: str, a: tuple, b: tuple, out: torch.Tensor | None = None,
             out_dtype: torch.dtype = torch.bfloat16, accumulate: bool = False,
             config: GluonConfig | None = None) -> torch.Tensor:  # fmt: skip
    """``out (+)= (A · sf_a) (B · sf_b)ᵀ`` on sm_90 with the Gluon kernel (experimental).

    Args:
        kind: ``"1d2d"`` (sf_b [ceil(N/128), ceil(K/128)]) or ``"1d1d"`` (sf_b [N, ceil(K/128)]).
        a: ``(A [M, K] float8_e4m3fn, K-major, 16-byte aligned rows; sf_a [M, ceil(K/128)]
            float32, any strides)``.
        b: ``(B [N, K] float8_e4m3fn, as A; sf_b float32, any strides)``.
        out: ``[M, N]`` bfloat16 / float32 (any strides), or None for a new ``out_dtype`` one.
        accumulate: ``out += ...`` (out required).
        config: a :class:`GluonConfig` (default: 128x64, 8 warps, 4 stages).

    Returns:
        ``out``.

    Raises:
        TypeError / ValueError: the GEMM contract's checks (``ptxtrain.gemm.ref.validate_1d2d``
            / ``validate_1d1d``: dtypes, shapes, scale shapes, devices, ``out``), an unknown
            ``kind`` or a config that is not a :class:`GluonConfig`; then operands not on a
            CUDA device or not K-major with 16-byte aligned rows and base (TMA), or a
            warp-specialized config whose shared memory with this ``out`` is over 227 KiB.
    """
    from ptxtrain.gemm.ref import validate_1d1d, validate_1d2d

    if kind == "1d2d":
        m, n, k = validate_1d2d(a, b, out, out_dtype)
    elif kind == "1d1d":
        m, n, k = validate_1d1d(a, b, out, accumulate, out_dtype)
    else:
        raise ValueError(f"kind must be '1d2d' or '1d1d', got {kind!r}")
    if kind == "1d2d" and accumulate:
        raise ValueError("accumulate=True is a 1D1D (wgrad) option, got kind='1d2d'")
    if config is not None and not isinstance(config, GluonConfig):
        raise TypeError(f"config must be a GluonConfig or None, got {type(config).__name__}")
    a_fp8, b_fp8 = a[0], b[0]
    cfg = config or GluonConfig()
    if out is not None:
        _check_out_offsets(m, n, out.stride(0), out.stride(1))
    for name, t in (("a", a_fp8), ("b", b_fp8)):
        if t.device.type != "cuda" or t.stride(1) != 1 or (t.stride(0) % 16) or t.data_ptr() % 16:
            raise ValueError(
                f"{name} must be a K-major CUDA tensor with 16-byte aligned rows and base for "
                f"TMA, got device {t.device}, strides {tuple(t.stride())}"
            )
    if out is None:  # (accumulate without out was refused by the validators)
        out = torch.empty((m, n), dtype=out_dtype, device=a_fp8.device)
    if m == 0 or n == 0 or k == 0:
        if k == 0 and not accumulate:
            out.zero_()
        return out
    return launch_checked(kind, a, b, out, accumulate, cfg, m, n, k)


def launch_checked(kind: str, a: tuple, b: tuple, out: torch.Tensor, accumulate: bool,
                   cfg: GluonConfig, m: int, n: int, k: int) -> torch.Tensor:  # fmt: skip
    """:func:`fp8_gemm` without its checks: ``ptxtrain.gemm.triton``'s default route, which
    has made them, calls this directly (the checks cost about a tenth of a call's host time).

    The caller guarantees what :func:`fp8_gemm` checks: ``a = (a_fp8 [m, k] e4m3, sf_a [m,
    ceil(k/128)] fp32)``, ``b = (b_fp8 [n, k] e4m3, sf_b)`` with sf_b ``[ceil(n/128),
    ceil(k/128)]`` (1D2D) or ``[n, ceil(k/128)]`` (1D1D), both K-major CUDA tensors with
    16-byte aligned rows and base (TMA), m, n, k > 0, and ``out`` an ``[m, n]`` bf16 / fp32
    tensor whose column offsets fit in int32. Writes ``out`` (``+=`` when ``accumulate``) and
    returns it.

    Raises:
        ValueError: ``cfg`` needs more shared memory than sm_90 has for this ``out`` dtype.
    """
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    a_box = 64 if cfg.warp_specialized else cfg.block_m  # one box per 64-row wave
    a_desc = TensorDescriptor(a_fp8, list(a_fp8.shape), list(a_fp8.stride()),
                              [a_box, _BK], _smem_layout(a_box))  # fmt: skip
    b_desc = TensorDescriptor(b_fp8, list(b_fp8.shape), list(b_fp8.stride()),
                              [cfg.block_n, _BK], _smem_layout(cfg.block_n))  # fmt: skip
    num_tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    grid = (num_tiles,)
    whole, splits = num_tiles, 1
    if cfg.warp_specialized:  # persistent: one program per SM walks the tiles
        num_sms = device_sms(a_fp8.device)
        if cfg.split_k:
            whole, splits = gluon_split_k(num_tiles, num_sms, triton.cdiv(k, _BK), cfg.split_max)
        grid = (min(whole + (num_tiles - whole) * splits, num_sms),)
    with torch.cuda.device(a_fp8.device):
        if cfg.warp_specialized:
            # The output through TMA stores (and, for D +=, TMA loads) when it can take them
            # (row-contiguous, 16-byte aligned rows and base); else masked pointer accesses.
            esz = out.element_size()
            tma_store = (out.stride(1) == 1 and (out.stride(0) * esz) % 16 == 0
                         and out.data_ptr() % 16 == 0)  # fmt: skip
            c_desc = a_desc  # a stand-in the kernel never reads without TMA_STORE
            if accumulate and cfg.store_buffers != 1:  # D +=: one staging buffer per consumer
                cfg = dataclasses.replace(cfg, store_buffers=1)
            smem = cfg.smem_bytes(esz if tma_store else 0)
            if smem > SM90_SMEM_BYTES:
                raise ValueError(
                    f"config {cfg} needs {smem} bytes of shared memory with a {out.dtype} out, "
                    f"over {SM90_SMEM_BYTES}: use fewer stages"
                )
            if tma_store:
                c_layout = _out_layout(cfg.block_n, out.dtype == torch.float32)
                c_desc = TensorDescriptor(out, list(out.shape), list(out.stride()),
                                          [64, cfg.block_n], c_layout)  # fmt: skip
            sfa_desc = sfb_desc = a_desc  # stand-ins the kernel never reads without SCALES_TMA
            if cfg.scales_tma:
                sf_a = _mn_major(sf_a)
                sfa_desc = _sf_desc(sf_a, 64)
                if kind == "1d1d":
                    sf_b = _mn_major(sf_b)
                    sfb_desc = _sf_desc(sf_b, cfg.block_n)
            # K-slices' partial sums: [slices, BM, BN] fp32 (one float stands in without)
            ws = _no_workspace(out.device)
            if splits > 1:
                slices = (num_tiles - whole) * splits
                ws = torch.empty(slices * cfg.block_m * cfg.block_n, dtype=torch.float32,
                                 device=out.device)  # fmt: skip
            _gemm_ws_kernel[grid](
                a_desc, b_desc, sf_a, sf_b, out, c_desc, sfa_desc, sfb_desc, m, n, k,
                sf_a.stride(0), sf_a.stride(1), sf_b.stride(0), sf_b.stride(1),
                out.stride(0), out.stride(1), ws, whole, splits,
                SFB_PER_COL=kind == "1d1d", ACCUMULATE=accumulate, TMA_STORE=tma_store,
                SCALES_TMA=cfg.scales_tma, SPLIT=splits > 1, WAVES=cfg.block_m // 128,
                STORE_BUFFERS=cfg.store_buffers, GROUP_M=cfg.group_m,
                NUM_STAGES=cfg.num_stages, CONSUMER_REGS=_WS_CONSUMER_REGS, num_warps=4,
                maxnreg=_WS_MAXNREG,
            )  # fmt: skip
            if splits > 1:
                rows = 16  # rows of a tile per finishing program
                _split_finish_kernel[(num_tiles - whole, cfg.block_m // rows)](
                    ws, out, m, n, out.stride(0), out.stride(1), whole, cfg.group_m,
                    SPLITS=splits, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, ROWS=rows,
                    ACCUMULATE=accumulate, num_warps=4,
                )  # fmt: skip
            return out
        _gemm_kernel[grid](
            a_desc, b_desc, sf_a, sf_b, out, m, n, k,
            sf_a.stride(0), sf_a.stride(1), sf_b.stride(0), sf_b.stride(1),
            out.stride(0), out.stride(1),
            SFB_PER_COL=kind == "1d1d", ACCUMULATE=accumulate, GROUP_M=cfg.group_m,
            NUM_STAGES=cfg.num_stages, CHUNK=cfg.chunk, num_warps=cfg.num_warps,
        )  # fmt: skip
    return out
