"""Hand-written sm_90a FP8 GEMMs (wgmma + TMA + mbarrier), JIT-compiled through NVRTC.

Design note (docs/design.md §3; DeepSeek-V3 report §3.3; DeepGEMM's kernel design). The
kernel lives in ``ptxtrain/include/ptxtrain/fp8_gemm.cuh``: a persistent grid of one CTA per SM,
one TMA producer warpgroup and one or two math warpgroups issuing ``wgmma.mma_async
m64nNk32.e4m3`` from 128-byte-swizzled shared memory, FP32 promotion of every 128-K block on the
CUDA cores with ``sf_a · sf_b``, a ring of shared-memory stages guarded by mbarriers. This module
chooses the block sizes (:func:`select_config`, a pure function), generates the translation unit
(the wgmma wrapper for the chosen ``BLOCK_N``, whose PTX takes ``BLOCK_N / 2`` accumulator
operands, is generated here because asm operand lists cannot be written as a loop), compiles and
caches it per (kind, N, K, config, output), builds the TMA descriptors and launches on PyTorch's
current stream.

The same kernel serves the MoE experts' m-grouped contiguous GEMM
(:func:`m_grouped_fp8_gemm_nt_contiguous`: each tile reads its group from ``m_indices``).

Shape specialization: N and K are template constants, M a kernel argument. Requirements (else
:func:`supports` is False and the dispatcher picks another backend; the public functions raise
``ValueError``): an sm_90 device, NVRTC + driver available, ``K % 16 == 0`` (TMA needs 16-byte
row strides). Any M (0 returns at once), N and K tails (TMA zero-fills, the epilogue masks).

Scales: the kernel reads A's scales (and B's for 1D1D) through TMA from an MN-major,
4-row-padded copy ``[⌈K/128⌉, M]`` (row stride ``4·⌈M/4⌉``, the layout of DeepGEMM and
``torch._scaled_mm``); an ``sf`` that is already MN-major (``sf.stride() == (1, 4·⌈M/4⌉)``) is
used as is, others are transposed once (one small copy).

SASS post-pass (opt-in, for A/B timing): :func:`set_ffma_yield` or ``PTXTRAIN_JIT_FFMA_YIELD``
rewrite the yield bits of the promotion's FFMAs before a kernel is loaded
(:mod:`ptxtrain.jit.sass`, after DeepGEMM's FFMA interleaving); default ``"off"``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass

import torch

from ptxtrain._checks import ceil_div
from ptxtrain.gemm import ref
from ptxtrain.gemm.heuristics import SM90_SMEM_BYTES, split_tail
from ptxtrain.quant.ref import to_mn_major

BLOCK_K = 128
_BLOCK_NS = tuple(range(16, 161, 16))  # wgmma N multiple of 8; <= 160 keeps acc + fin in registers
_BLOCK_NS_256 = (64, 96, 128)  # block_m = 256: two waves of fin + acc = 1.5 x block_n registers
# 1D2D with block_m <= 128 also takes 192 (one accumulator: 96 + 96 registers per thread; a
# tile still spans at most two 128-column scale blocks). Not chosen by select_config: 0.79-0.96x
# cuBLAS at M = 4096 and 0.72-1.09x at M = 64 / 128 on an H200, below the heuristic's tiles.
_BLOCK_NS_WIDE = (192,)
_MAX_STAGES = 8  # the heuristics' ring depth cap (see select_config)
_MAX_STAGES_DECODE = 16  # the cap for decode-sized tiles (see select_config)
_MAX_STAGES_ANY = 32  # what run_with_config accepts (sweeps of deeper rings)
_RASTER_MS = tuple(1 << i for i in range(7, 15))  # PtxConfig.raster_m: 128 .. 16384 rows
GROUPED_RASTER_M = 512  # grouped_config's raster_m when the group sizes are unknown (see there)
_TILE_OVERHEAD_N = 24  # per-tile cost in units of output columns (A's share of the smem traffic)
_DECODE_BLOCK_NS = (32, 64, 128)  # decode regime: see select_config
_UNROLL_K = 2  # unroll factor of the math K loop (see benchmarks/sweep_ptx.py)
_TMA_STORE = True  # select_config's epilogue (see PtxConfig.tma_store)
_SPLIT_TAIL = True  # select_config may set PtxConfig.split_k
_1D1D_KINDS = ("1d1d", "k_grouped")  # kernel kinds with per-column scales of B
# Lines put before the header in every kernel's source (set_source_defines).
_SOURCE_DEFINES = ""
# The SASS post-pass on the promotion FFMAs' yield bits (set_ffma_yield; None: the environment's).
_FFMA_YIELD: str | None = None
_GROUP_MODE = {"m_grouped": 1, "k_grouped": 2, "masked": 3}  # the kernel's kGroupMode (0: dense)


@dataclass(frozen=True)
class PtxConfig:
    """Block sizes of one compiled PTX GEMM: ``block_m`` (64: one math warpgroup; 128 or 256: two,
    each covering ``block_m / 128`` waves of 64 rows), ``block_n`` (a multiple of 16 in [16, 160],
    or 192 for 1D2D with one accumulator; at most 128 with ``block_m = 256``), ``num_stages``
    (shared-memory ring depth),
    ``cluster`` (1, or 2: two CTAs on adjacent M-blocks share each B tile by TMA multicast),
    ``multicast_a`` (with ``cluster = 2``: the two CTAs take adjacent N-blocks of one M-block
    and share each A tile instead, DeepGEMM's multicast on A for decode-sized M),
    ``unroll_k`` (unroll factor of the single-accumulator K loop), ``double_acc`` (two wgmma
    accumulators: block k + 1's MMAs run while block k is promoted; one wave, block_n <= 128),
    ``tma_store`` (the epilogue stages the tile in shared memory and writes it with TMA stores,
    or TMA reductions for ``accumulate``; needs ``block_n`` a multiple of 64 (bf16 D) or 32 (fp32
    D), 16-byte D rows and a 16-byte-aligned D, else the launch falls back to direct stores),
    ``epi_boxes`` (TMA store: 64-row x 128-byte boxes of D staged per math warpgroup at once;
    0 = a 64-row wave's boxes (the whole tile up to 128 rows); fewer write it in rounds and leave
    shared memory to the stages; twice a wave's boxes with ``block_m = 256``: both waves at once,
    no wait between them),
    ``raster_m`` (rows of A per rasterization group: the persistent CTAs walk
    ``raster_m / (block_m · cluster)`` M-blocks (``raster_m / block_m`` with ``multicast_a``),
    M fastest, before the next N-block, so the
    tiles in flight share a few panels of A and B in L2; a power of two in [128, 16384]),
    ``split_k`` (dense 1D2D / 1D1D: the tiles of a partial last wave are cut along K into
    slices that run on the otherwise idle SMs; each slice writes FP32 partial sums to a
    workspace and the last one of a tile sums them in slice order and stores the tile, so
    results are bitwise repeatable; see :func:`split_tail`; with ``double_acc`` only)."""

    block_m: int
    block_n: int
    num_stages: int
    cluster: int = 1
    unroll_k: int = 2
    double_acc: bool = False
    tma_store: bool = False
    epi_boxes: int = 0
    raster_m: int = 2048
    multicast_a: bool = False
    split_k: bool = False

    @property
    def num_threads(self) -> int:
        """One producer warpgroup + one (block_m = 64) or two math warpgroups."""
        return (min(self.block_m // 64, 2) + 1) * 128


def _out_bytes(out_dtype: torch.dtype) -> int:
    return 2 if out_dtype == torch.bfloat16 else 4


def _block_ns(kind: str, block_m: int) -> tuple[int, ...]:
    """The block_n values run_with_config takes for ``kind`` and ``block_m``."""
    if block_m == 256:
        return _BLOCK_NS_256
    return _BLOCK_NS + (_BLOCK_NS_WIDE if kind == "1d2d" else ())


def _tile_boxes(block_n: int, out_dtype: torch.dtype) -> int:
    return block_n * _out_bytes(out_dtype) // 128


def epilogue_bytes(block_m: int, block_n: int, out_dtype: torch.dtype, epi_boxes: int = 0) -> int:
    """Shared memory of the TMA-store epilogue's staging boxes: ``epi_boxes`` (0 = all) boxes of
    64 rows x 128 bytes of D per math warpgroup (mirrors ``EpiShape`` in fp8_gemm.cuh)."""
    boxes = _staged_boxes(block_m, block_n, out_dtype, epi_boxes)
    return (2 if block_m > 64 else 1) * boxes * 64 * 128


def _staged_boxes(block_m: int, block_n: int, out_dtype: torch.dtype, epi_boxes: int) -> int:
    """Boxes staged per math warpgroup (the kernel's kEpiBoxes): ``epi_boxes`` up to one wave's
    boxes (0 = all of them), or both waves' of a 256-row tile (``epi_boxes`` = twice a wave's)."""
    boxes = _tile_boxes(block_n, out_dtype)
    if block_m == 256 and epi_boxes == 2 * boxes:
        return epi_boxes
    return min(epi_boxes, boxes) if epi_boxes else boxes


def tma_store_fits(block_n: int, n: int, out_dtype: torch.dtype) -> bool:
    """Whether the TMA-store epilogue can write this D: whole 128-byte boxes per tile and rows of
    a 16-byte multiple (TMA's global stride rule)."""
    elem = _out_bytes(out_dtype)
    return block_n % (128 // elem) == 0 and (n * elem) % 16 == 0


def smem_bytes(block_m: int, block_n: int, num_stages: int, kind: str, epilogue: int = 0) -> int:
    """Dynamic shared memory of one CTA (mirrors ``Fp8GemmSmem`` in fp8_gemm.cuh); ``epilogue``:
    bytes of the TMA-store staging tiles (:func:`epilogue_bytes`, 0 for direct stores)."""
    slot_sfa = ceil_div(block_m * 4, 128) * 128
    # (1D1D: B's per-column scales by TMA; 1D2D: its two block scales, see Fp8GemmSmem)
    slot_sfb = ceil_div(block_n * 4, 128) * 128 if kind in _1D1D_KINDS else 16
    per_stage = block_m * BLOCK_K + block_n * BLOCK_K + slot_sfa + slot_sfb
    return epilogue + num_stages * per_stage + 2 * num_stages * 8 + 1024


def _default_out(kind: str) -> torch.dtype:
    return torch.float32 if kind in _1D1D_KINDS else torch.bfloat16


def config_smem_bytes(cfg: PtxConfig, kind: str, out_dtype: torch.dtype) -> int:
    """Bytes of dynamic shared memory one CTA of ``cfg`` takes (pure function): its stages
    (:func:`smem_bytes`; the 1D1D kinds ``"1d1d"`` / ``"k_grouped"`` also stage B's per-column
    scales) plus, with ``cfg.tma_store``, the epilogue's staging tiles of a ``out_dtype``
    (torch.bfloat16 or torch.float32) D (:func:`epilogue_bytes`). A config runs when this is at
    most :data:`~ptxtrain.gemm.heuristics.SM90_SMEM_BYTES`."""
    epi = epilogue_bytes(cfg.block_m, cfg.block_n, out_dtype, cfg.epi_boxes) if cfg.tma_store else 0
    return smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages, kind, epi)


def _efficiency(bm: int, bn: int, k: int) -> float:
    """Relative throughput per tile area, measured on an H200 at M = 4096 over the six DeepSeek-V3
    shapes, with and without the TMA-store epilogue: 128-row tiles with double accumulators
    (block_n <= 128) fastest on 5 of 6 shapes and 1D1D; 256x128 (one accumulator, two waves, B
    multicast) 1.11x faster at K = 16384 (1311 vs 1180 TFLOPS), 0.98-0.99x at K = 2048-7168;
    128-row tiles wider than 128 (one accumulator) ~0.75, narrower tiles proportionally slower
    (each wgmma re-reads A for fewer columns), one math warpgroup (block_m = 64) ~0.6."""
    pow2 = bn & (bn - 1) == 0
    if bm == 64:
        base = 0.6
    elif bm == 256:
        base = (1.1 if k >= 12288 else 0.97) if bn == 128 else 0.85
    else:
        base = 1.02 if bn <= 128 else 0.84
    return base * min(1.0, bn / 128) * (1.0 if pow2 else 0.9)


@functools.lru_cache(maxsize=4096)
def select_config(kind: str, m: int, n: int, k: int, num_sms: int) -> PtxConfig:
    """Block sizes for one GEMM shape on ``num_sms`` SMs (pure function).

    Two regimes:

    - Tiles fill the SMs (large M): minimize ``waves · block_m · block_n / efficiency`` with
      ``waves = ⌈tiles / num_sms⌉`` (the busiest SM's work) and the measured per-tile efficiency
      of :func:`_efficiency`; this picks 256x128 for most V3 shapes at M = 4096.
    - Decode-sized M: DeepGEMM's rule of the fewest waves, ``waves · block_m · (block_n + 24)``
      (each tile costs its area plus a share for A's traffic, which does not shrink with
      ``block_n``), over ``block_n`` in {32, 64, 128}. On an H200 with the TMA-store epilogue
      this picks the fastest or a within-3% config on all twelve V3 shapes at M = 64 and 128;
      non-power-of-two and 16-column tiles are left out (none is faster where timed), and
      64-row tiles win at M = 128 too.

    Ties go to the larger tile. ``cluster = 2`` (B multicast over two CTAs) when the tiles fill
    the SMs and an odd M-block count wastes little. Stages: as many as fit in shared memory,
    at most 8, or 16 for decode-sized tiles (their K loop streams B from HBM with little math
    per block: 16 stages run 1.04-1.07x faster than 8 at M = 64 on an H200).

    Raises:
        ValueError: unknown ``kind`` or a non-positive ``num_sms``.
    """
    if kind not in ("1d2d", "1d1d"):
        raise ValueError(f"kind must be '1d2d' or '1d1d', got {kind!r}")
    if num_sms < 1:
        raise ValueError(f"num_sms must be positive, got {num_sms}")
    block_ms = (64,) if m <= 64 else (64, 128) if m <= 256 else (64, 128, 256)
    if kind == "1d1d":
        # 256-row 1D1D tiles spill: B's per-column scales need block_n / 4 more registers.
        block_ms = tuple(bm for bm in block_ms if bm < 256)
    large = ceil_div(max(m, 1), 128) * ceil_div(n, 128) >= 2 * num_sms
    best = None
    for bm in block_ms:
        block_ns = (_BLOCK_NS if bm < 256 else _BLOCK_NS_256) if large else _DECODE_BLOCK_NS
        for bn in block_ns:
            if kind == "1d1d" and bm == 128 and bn > 128:
                continue  # spills: 1.5 x block_n accumulators + block_n / 4 scales of B
            tiles = ceil_div(max(m, 1), bm) * ceil_div(n, bn)
            waves = ceil_div(tiles, num_sms)
            if large:
                cost = waves * bm * bn / _efficiency(bm, bn, k)
            else:
                cost = waves * bm * (bn + _TILE_OVERHEAD_N)
            key = (cost, -bm, -bn)
            if best is None or key < best[0]:
                best = (key, bm, bn)
    _, bm, bn = best
    if kind == "1d2d" and not large and m == 128 and bm == 64 and bn >= 64:
        # One 128-row M-block of half as wide tiles instead of two 64-row ones: as many tiles,
        # each with two math warpgroups (two wgmma chains per SM) instead of one: 1.2-6.4% faster
        # at M = 128 on an H200 (within ±1.3% on an H100). At M = 100 the same tiles are 3-13%
        # slower, so partly filled 128-row blocks keep the 64-row pick.
        bm, bn = 128, bn // 2
    # TMA-store epilogue (the tile drains from shared memory while the next one computes) where
    # whole boxes fit the tile, sized for the kind's usual D (bf16 1D2D, fp32 1D1D).
    tma_store = _TMA_STORE and tma_store_fits(bn, n, _default_out(kind))
    # 256-row tiles stage one box per warpgroup at a time: the whole tile's boxes would cost
    # one of their four K stages.
    epi_boxes = 1 if bm == 256 else 0
    epi = epilogue_bytes(bm, bn, _default_out(kind), epi_boxes) if tma_store else 0
    stages = _MAX_STAGES if large else _MAX_STAGES_DECODE
    while stages > 2 and smem_bytes(bm, bn, stages, kind, epi) > SM90_SMEM_BYTES:
        stages -= 1
    # Multicast B over two CTAs when there are enough tiles to fill the SMs and the extra
    # (zero) M-block of an odd count wastes little: it halves B's L2 -> SM traffic (measured
    # 1.05x at 4096 x 7168 x 16384 with 256x128 tiles).
    m_blocks = ceil_div(max(m, 1), bm)
    tiles = m_blocks * ceil_div(n, bn)
    cluster = 2 if tiles >= num_sms and (m_blocks % 2 == 0 or m_blocks >= 8) else 1
    if bm < 256:
        # Measured: 128-row tiles (1D2D with double accumulators, and 1D1D) run 1.03-1.08x
        # faster without B multicast; 256x128 tiles gain from it.
        cluster = 1
    # Two wgmma accumulators (the next block's MMAs overlap this block's promotion) fit in the
    # registers up to 64 x 128 per math warpgroup (3 x 64 + 32 for 1D1D's scales of B).
    double_acc = bm <= 128 and bn <= 128
    cfg = PtxConfig(
        bm, bn, stages, cluster, _UNROLL_K, double_acc, tma_store, epi_boxes if tma_store else 0
    )
    return _with_split_tail(cfg, kind, m, n, k, num_sms)


def _with_split_tail(cfg: PtxConfig, kind: str, m: int, n: int, k: int, num_sms: int):
    """``cfg`` with ``split_k`` set by the split-tail rule (pure function).

    Split tail where whole waves leave SMs idle at the end that K-slices of the last tiles can
    fill (e.g. 4096 x 2112 x 7168: 4 waves + 16 tiles of 128x128), and (1D2D) where the tiles of
    decode-sized M are one wave that leaves at least half the SMs idle (64 x 2112 x 7168: 66
    tiles of 64x32, cut in 2: 1.20x faster on an H200; cutting wider tiles of shapes that fill
    the SMs is not faster except at 128 x 2112 x 7168; the tails of several decode-sized waves
    are not cut, as no timing shows them gaining).
    Double accumulators only: 256-row tiles spill registers with the slice loop compiled in.
    (Such tiles never take a cluster here: one unit per tile.)"""
    large = ceil_div(max(m, 1), 128) * ceil_div(n, 128) >= 2 * num_sms
    tiles = ceil_div(max(m, 1), cfg.block_m) * ceil_div(n, cfg.block_n)
    split = False
    if (large or (kind == "1d2d" and tiles < num_sms)) and _SPLIT_TAIL and cfg.double_acc:
        split = split_tail(tiles, num_sms, ceil_div(k, BLOCK_K), _split_quantum())[1] > 1
    return dataclasses.replace(cfg, split_k=split)


def _wgmma_struct(block_n: int) -> str:
    """C++ of ``struct Wgmma { static void mma(float (&d)[block_n / 2], u64, u64, bool) }`` for
    ``wgmma.mma_async.sync.aligned.m64n<block_n>k32.f32.e4m3.e4m3`` (PTX ISA "wgmma.mma_async")."""
    regs = block_n // 2
    dlist = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        "struct Wgmma {\n"
        "  __device__ __forceinline__ static void mma(float (&d)["
        f"{regs}], ptxtrain::u64 desc_a, ptxtrain::u64 desc_b, bool accumulate) {{\n"
        '    asm volatile("{\\n.reg .pred p;\\n'
        f"setp.ne.b32 p, %{regs + 2}, 0;\\n"
        f"wgmma.mma_async.sync.aligned.m64n{block_n}k32.f32.e4m3.e4m3 "
        f'{{{dlist}}}, %{regs}, %{regs + 1}, p, 1, 1;\\n}}\\n"\n'
        f"                 : {outs}\n"
        '                 : "l"(desc_a), "l"(desc_b), "r"(static_cast<unsigned>(accumulate)));\n'
        "  }\n"
        "};\n"
    )


_OUT_CODE = {torch.bfloat16: 0, torch.float32: 1}


def _epi_boxes(cfg: PtxConfig, out_dtype: torch.dtype) -> int:
    """The kernel's kEpiBoxes: 0 = direct stores, else staged boxes per warpgroup."""
    if not cfg.tma_store:
        return 0
    return _staged_boxes(cfg.block_m, cfg.block_n, out_dtype, cfg.epi_boxes)


def kernel_source(
    kind: str, cfg: PtxConfig, n: int, k: int, out_dtype: torch.dtype, accumulate: bool
) -> tuple[str, str]:
    """The translation unit and the kernel's name expression for one specialization (``kind``:
    ``"1d2d"``, ``"1d1d"``, ``"m_grouped"`` (the 1D2D kernel over an m-grouped contiguous A) or
    ``"k_grouped"`` (the 1D1D kernel over groups of K; ``k`` is then unused))."""
    # The name expression instantiates the template (NVRTC's nvrtcAddNameExpression).
    src = f"{_SOURCE_DEFINES}#include <ptxtrain/fp8_gemm.cuh>\n{_wgmma_struct(cfg.block_n)}"
    expr = (
        f"ptxtrain::fp8_gemm_nt_kernel<Wgmma, {cfg.block_m}, {cfg.block_n}, {cfg.num_stages}, "
        f"{n}, {k}, {'true' if kind in _1D1D_KINDS else 'false'}, {_OUT_CODE[out_dtype]}, "
        f"{'true' if accumulate else 'false'}, {cfg.cluster}, {cfg.unroll_k}, "
        f"{'true' if cfg.double_acc else 'false'}, {_epi_boxes(cfg, out_dtype)}, "
        f"{_GROUP_MODE.get(kind, 0)}, {cfg.raster_m}, {'true' if cfg.multicast_a else 'false'}, "
        f"{'true' if cfg.split_k else 'false'}>"
    )
    return src, expr


def set_source_defines(text: str) -> None:
    """Put ``text`` (e.g. ``"#define PTXTRAIN_GEMM_CHUNK 16\n"``, one of the kernel header's
    compile-time switches) before the header in every kernel compiled from now on, for A/B
    sweeps in one process (benchmarks/ab_ptx.py); ``""`` restores the defaults. The JIT disk
    cache keys on the source; the in-process caches of builds and launch plans are dropped.

    Raises:
        TypeError: ``text`` is not a str.
    """
    global _SOURCE_DEFINES
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    if text != _SOURCE_DEFINES:
        _SOURCE_DEFINES = text
        compile_gemm.cache_clear()
        _plan.cache_clear()


def set_ffma_yield(mode: str | None) -> None:
    """Load every kernel from now on with the FFMA yield post-pass ``mode`` (``"off"``,
    ``"interleave"``, ``"all"`` or ``"none"``: :func:`ptxtrain.jit.sass.patch_ffma_yield`
    rewrites the yield / reuse control bits of the promotion's FFMAs in the SASS), for A/B runs
    in one process (benchmarks/ab_ptx.py); ``None`` follows ``PTXTRAIN_JIT_FFMA_YIELD`` again
    (default ``"off"``; read when a launch plan is built, i.e. at a shape's first call). The
    cached launch plans are dropped; compiled cubins are kept (the pass runs on them at load).

    Raises:
        ValueError: an unknown ``mode``.
    """
    global _FFMA_YIELD
    from ptxtrain.jit.sass import FFMA_YIELD_MODES

    if mode is not None and mode not in FFMA_YIELD_MODES:
        raise ValueError(f"mode must be None or one of {FFMA_YIELD_MODES}, got {mode!r}")
    if mode != _FFMA_YIELD:
        _FFMA_YIELD = mode
        _plan.cache_clear()


def _ffma_yield_mode() -> str:
    """The FFMA yield post-pass of kernels loaded now: set_ffma_yield's, else the environment's."""
    from ptxtrain.jit.sass import default_ffma_yield_mode

    return _FFMA_YIELD if _FFMA_YIELD is not None else default_ffma_yield_mode()


@functools.lru_cache(maxsize=256)
def compile_gemm(
    kind: str, cfg: PtxConfig, n: int, k: int, out_dtype: torch.dtype, accumulate: bool
):
    """NVRTC-compile one specialization for sm_90a (disk-cached by :mod:`ptxtrain.jit`).

    Works without a GPU (CI compiles every variant the heuristics choose for the V3 shapes).

    Returns:
        (CompiledKernel, name expression).

    Raises:
        ptxtrain.jit.JitCompileError: NVRTC rejected the source (log in the message).
        RuntimeError: NVRTC is not installed.
    """
    from ptxtrain.jit import compile_cuda

    src, expr = kernel_source(kind, cfg, n, k, out_dtype, accumulate)
    name = (
        f"fp8_gemm_{kind}_{cfg.block_m}x{cfg.block_n}x{cfg.num_stages}c{cfg.cluster}"
        f"{'a' if cfg.multicast_a else ''}"
        f"u{cfg.unroll_k}{'d' if cfg.double_acc else ''}e{_epi_boxes(cfg, out_dtype)}"
        f"r{cfg.raster_m}{'s' if cfg.split_k else ''}_n{n}_k{k}"
    )
    compiled = compile_cuda(src, name=name, name_expressions=(expr,))
    return compiled, expr


# ---- availability ------------------------------------------------------------------------------


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def toolchain_available() -> bool:
    """Whether this process can compile and load the PTX kernels: NVRTC (``nvidia-cuda-nvrtc``)
    and the CUDA driver (``cuda-bindings``) importable (:func:`ptxtrain.jit.nvrtc_available`,
    :func:`ptxtrain.jit.driver_available`); cached. Says nothing of the GPU: :func:`supports`
    also checks for an sm_90 device."""
    from ptxtrain.jit import driver_available, nvrtc_available

    return nvrtc_available() and driver_available()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def supports(m: int, n: int, k: int, *, device: torch.device | None = None) -> bool:
    """Whether the PTX kernels run this shape here: a CUDA sm_90 device, NVRTC and the driver
    importable, ``K % 16 == 0`` and ``N >= 1``."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else device
    if dev.type != "cuda" or _capability(_index(dev)) != (9, 0):
        return False
    return n >= 1 and k >= 16 and k % 16 == 0 and toolchain_available()


def _check_runnable(a_fp8: torch.Tensor, n: int, k: int) -> None:
    if a_fp8.device.type != "cuda":
        raise ValueError(f"the ptx backend needs CUDA tensors, got a on {a_fp8.device}")
    cap = _capability(_index(a_fp8.device))
    if cap != (9, 0):
        raise ValueError(f"the ptx backend needs an sm_90 GPU, got capability {cap}")
    if k % 16 or k < 16:
        raise ValueError(
            f"the ptx backend needs K % 16 == 0 (TMA rows of 16-byte multiples), got K={k}; "
            "use the triton or ref backend"
        )
    if not toolchain_available():
        raise ValueError("the ptx backend needs NVRTC (nvidia-cuda-nvrtc) and cuda-bindings")


# ---- operands ------------------------------------------------------------------------------------


def _k_major(t: torch.Tensor) -> torch.Tensor:
    if t.stride(1) != 1 or t.stride(0) != t.shape[1] or t.data_ptr() % 16:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def _mn_major_padded(sf: torch.Tensor) -> torch.Tensor:
    """``sf [R, KB]`` → a ``[KB, R]`` view with row stride ``4·⌈R/4⌉`` (16-byte rows for TMA):
    the transpose of its ``"mn_major"`` layout (no copy when the quantizer wrote that)."""
    return to_mn_major(sf).t()


# The kernel's parameters (fp8_gemm.cuh): the TMA descriptors of A, B, sf_a, sf_b and D, then
# sf_b, out, m, m_indices, block_group, num_groups, the K-grouped / masked info pointer, and the
# split tail's num_dp_units, splits, workspace and counters.
_SIGNATURE = "TTTTTppippipiipp"


def _split_quantum() -> int:
    """K blocks per step of a slice's range: the double-accumulator chunk, PTXTRAIN_GEMM_CHUNK
    in fp8_gemm.cuh (8 unless :func:`set_source_defines` overrides it)."""
    chunk = re.search(r"#define\s+PTXTRAIN_GEMM_CHUNK\s+(\d+)", _SOURCE_DEFINES)
    return int(chunk.group(1)) if chunk else 8


# Per (device, stream): the split tail's tile counters, zero between launches (the last slice of
# a tile resets its counters), so one buffer serves every launch in stream order.
_SPLIT_COUNTERS: dict[tuple[int, int], torch.Tensor] = {}


def _split_counters(device_index: int, count: int) -> torch.Tensor:
    from ptxtrain.jit.launch import raw_stream

    # (the raw stream getter: torch.cuda.current_stream() costs 8.5 µs of host time per launch)
    if torch.cuda.is_current_stream_capturing():
        # A CUDA graph gets counters of its own (zeroed inside the graph, from its private pool):
        # graphs captured on one stream may replay at once on different streams.
        return torch.zeros(count, dtype=torch.int32, device=f"cuda:{device_index}")
    stream = raw_stream(device_index)
    key = (device_index, stream)
    buf = _SPLIT_COUNTERS.get(key)
    if buf is None or buf.numel() < count:
        buf = torch.zeros(max(count, 1024), dtype=torch.int32, device=f"cuda:{device_index}")
        _SPLIT_COUNTERS[key] = buf
    return buf


def _launch_config(kind, m, n, k, out_dtype, cfg, aligned, num_sms, num_groups=1) -> PtxConfig:
    """The config one launch geometry compiles and runs (pure): ``cfg`` (None: the kind's
    heuristic) resolved against the output's layout. ``k`` is the kernel's K template value
    (:data:`BLOCK_K` for the k-grouped kernel)."""
    if cfg is None and kind == "m_grouped":
        cfg = grouped_config(m, n, k, num_sms, num_groups)
    elif cfg is None and kind == "k_grouped":
        cfg = k_grouped_config(m, n, num_sms)
    elif cfg is None and kind == "masked":
        cfg = grouped_config(max(m * num_groups, 1), n, k, num_sms, split=False)
    elif cfg is None:
        cfg = select_config(kind, m, n, k, num_sms)
    # K-grouped / masked: a TMA box must not cross into the next group's rows of the [G·M, N]
    # view of D.
    aligned = aligned and (kind not in ("k_grouped", "masked") or m % cfg.block_m == 0)
    return _resolve(cfg, kind, n, aligned, out_dtype)


def compile_args(
    kind: str,
    m: int,
    n: int,
    k: int,
    out_dtype: torch.dtype,
    accumulate: bool,
    num_sms: int,
    num_groups: int = 1,
) -> tuple:
    """The arguments of :func:`compile_gemm` that a launch of this geometry compiles (a pure
    function of the shape: ``ptxtrain.nn.prewarm`` compiles them ahead of the first step).

    ``kind``: ``"1d2d"`` / ``"1d1d"`` (M, N, K of the GEMM), ``"m_grouped"`` (M the total padded
    rows, ``num_groups`` experts), ``"k_grouped"`` (M x N of each group's D; K is read at run
    time) or ``"masked"`` (M the rows per group); ``out_dtype`` and ``accumulate`` as the call
    passes them, a 16-byte-aligned output assumed (fresh allocations are). Raises ValueError for
    an unknown ``kind`` or a non-positive ``num_sms`` (via the config heuristics)."""
    if kind not in ("1d2d", "1d1d", "m_grouped", "k_grouped", "masked"):
        raise ValueError(f"kind must be a PTX GEMM kind, got {kind!r}")
    k_tpl = BLOCK_K if kind == "k_grouped" else k
    cfg = _launch_config(kind, m, n, k_tpl, out_dtype, None, True, num_sms, max(num_groups, 1))
    return kind, cfg, n, k_tpl, out_dtype, accumulate


@functools.lru_cache(maxsize=1024)
def _plan(kind, m, n, k, out_dtype, accumulate, cfg, aligned, device_index, num_groups=1):
    """(config, bound launch, grid) of one launch geometry, cached so a repeated shape costs one
    lookup of host time (``cfg=None``: the heuristic's)."""
    from ptxtrain.jit import (
        BoundLaunch,
        load_kernel,
        max_active_clusters,
        programmatic_launch_enabled,
    )
    from ptxtrain.jit.sass import with_ffma_yield

    cfg = _launch_config(kind, m, n, k, out_dtype, cfg, aligned, _num_sms(device_index), num_groups)
    compiled, expr = compile_gemm(kind, cfg, n, k, out_dtype, accumulate)
    # (a patched cubin carries a key of its own: load_kernel caches modules by key)
    compiled = with_ffma_yield(compiled, _ffma_yield_mode(), expr)
    with torch.cuda.device(device_index):
        kernel = load_kernel(compiled, expr)
    if cfg.multicast_a:  # units: one M-block x `cluster` N-blocks
        units = ceil_div(m, cfg.block_m) * ceil_div(ceil_div(n, cfg.block_n), cfg.cluster)
    else:  # units: `cluster` M-blocks x one N-block
        units = ceil_div(ceil_div(m, cfg.block_m), cfg.cluster) * ceil_div(n, cfg.block_n)
    if kind in ("k_grouped", "masked"):  # m is per group there; m_grouped's m is the total
        units *= num_groups
    smem = config_smem_bytes(cfg, kind, out_dtype)
    if cfg.cluster > 1:
        # Only as many clusters as fit at once: a second wave of a persistent grid doubles the
        # time (66 clusters of 2 on 132 SMs run 2x slower than 132 single CTAs).
        resident = max_active_clusters(kernel, cfg.cluster, cfg.num_threads, smem)
        grid = min(units, max(resident, 1)) * cfg.cluster
    else:
        grid = min(units, _num_sms(device_index))
    # Split tail: (num_dp_units, splits, workspace floats, counters); splits == 1: none.
    split = (units, 1, 0, 0)
    if cfg.split_k:
        num_kb = ceil_div(k, BLOCK_K)
        # (one CTA per SM: a single partial wave's slices fill the SMs its tiles leave idle)
        grid_units = grid // cfg.cluster if cfg.cluster > 1 else _num_sms(device_index)
        dp, splits = split_tail(units, grid_units, num_kb, _split_quantum())
        if splits > 1:
            if cfg.cluster == 1:
                grid = min(dp + (units - dp) * splits, grid_units)
            tiles = (units - dp) * cfg.cluster  # CTA tiles cut into slices
            math_warps = 4 * min(cfg.block_m // 64, 2)
            split = (dp, splits, tiles * splits * cfg.block_m * cfg.block_n, tiles * math_warps)
    bound = BoundLaunch(
        kernel,
        _SIGNATURE,
        cfg.num_threads,
        smem_bytes=smem,
        cluster=(cfg.cluster, 1, 1) if cfg.cluster > 1 else None,
        programmatic=programmatic_launch_enabled(),  # the kernel waits (grid_dependency_wait)
    )
    return cfg, bound, grid, split


def launch_gemm(kind, a, b, out, accumulate, out_dtype, cfg=None, grouped=None, k_offsets=None):
    """One launch of the PTX GEMM kernel on the current stream of A's device, compiled and bound
    on the first launch of its geometry (:func:`_plan`, cached). Checks nothing: the operands
    are those the public functions validated (shapes, dtypes, an sm_90 device, ``K % 16 == 0``),
    D is not empty and ``out`` is contiguous and 16-byte aligned (the epilogues store up to
    16-byte vectors; :func:`_write_into` makes such a D).

    Args:
        kind: ``"1d2d"`` / ``"1d1d"`` (dense), ``"m_grouped"``, ``"k_grouped"`` or ``"masked"``.
        a: ``(a_fp8, sf_a)``: e4m3 [M, K] ([G, M_max, K] for ``"masked"``; for ``"k_grouped"``
            K is ΣK of the groups) and its fp32 1x128 scales [M, ⌈K/128⌉] in any layout (copied
            MN-major when not already).
        b: ``(b_fp8, sf_b)``: e4m3 [N, K] ([G, N, K] for ``"m_grouped"`` / ``"masked"``) and
            its fp32 scales: 128x128 blocks, or 1x128 [N, ⌈K/128⌉] for the 1D1D kinds.
        out: D, bfloat16 or float32: [M, N]; [G, M, N] (``"k_grouped"``); [G, M_max, N]
            (``"masked"``).
        accumulate: D += A·Bᵀ (1D1D kinds with a float32 D) instead of D = A·Bᵀ.
        out_dtype: D's dtype (the compiled epilogue's).
        cfg: explicit :class:`PtxConfig` (None: the kind's heuristic); adapted to this D as
            :func:`_resolve` does.
        grouped: ``"m_grouped"`` only: ``(m_indices [M] int32, block_group [M / 64] int32)``
            (:func:`block_groups`).
        k_offsets: ``"k_grouped"``: [G + 1] int32 prefix sums of the groups' K / 128;
            ``"masked"``: ``masked_m`` [G] int32, contiguous.

    Raises:
        ptxtrain.jit.JitCompileError: NVRTC rejected the kernel.
    """
    from ptxtrain.jit import tma_2d_bytes

    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if kind == "masked":  # [G, M_max, K] -> [G·M_max, K], group g at row g·M_max
        a_fp8 = a_fp8.reshape(-1, a_fp8.shape[-1])
        sf_a = sf_a.reshape(-1, sf_a.shape[-1])
    m, k = a_fp8.shape
    num_groups = 0
    m_indices = block_group = out  # unused pointers unless M-grouped
    if grouped is not None or kind == "masked":
        num_groups, n = b_fp8.shape[0], b_fp8.shape[1]
        b_fp8 = b_fp8.reshape(num_groups * n, k)  # [G, N, K] -> [G·N, K], group g at row g·N
        if grouped is not None:
            m_indices, block_group = grouped
    else:
        n = b_fp8.shape[0]
    k_tpl = k
    if kind == "masked":
        num_groups, m = out.shape[0], out.shape[1]  # the kernel's M is M_max
        out = out.view(num_groups * m, n)
    elif k_offsets is not None:
        num_groups = out.shape[0]
        out = out.view(num_groups * m, n)  # D[g] = rows g·M .. of the 2D view
        k_tpl = BLOCK_K  # K is per group at run time; one compiled kernel for every ΣK
    else:
        k_offsets = out  # unused pointer
    aligned = out.data_ptr() % 16 == 0
    index = _index(a_fp8.device)
    cfg, bound, grid, (num_dp, splits, ws_floats, num_counters) = _plan(
        kind,
        m,
        n,
        k_tpl,
        out_dtype,
        accumulate,
        cfg,
        aligned,
        index,
        max(num_groups, 1) if kind in ("k_grouped", "masked", "m_grouped") else 1,
    )
    # FP8 operands go to TMA as bytes (make_tma_2d_desc maps e4m3 to UINT8): no uint8 view.
    a8 = _k_major(a_fp8)
    b8 = _k_major(b_fp8)
    sfa = _mn_major_padded(sf_a if sf_a.dtype == torch.float32 else sf_a.float())
    # Each CTA of a cluster loads its part of the multicast operand (A or B).
    split_a, split_b = (cfg.cluster, 1) if cfg.multicast_a else (1, cfg.cluster)
    tma_a = tma_2d_bytes(a8, cfg.block_m // split_a, BLOCK_K, swizzle="128B")
    tma_b = tma_2d_bytes(b8, cfg.block_n // split_b, BLOCK_K, swizzle="128B")
    tma_sfa = tma_2d_bytes(sfa, 1, cfg.block_m)
    if kind in _1D1D_KINDS:
        sfb_t = _mn_major_padded(sf_b if sf_b.dtype == torch.float32 else sf_b.float())
        tma_sfb = tma_2d_bytes(sfb_t, 1, cfg.block_n)
        sfb_ptr = sfb_t  # unused by the kernel; any valid pointer
    else:
        tma_sfb = tma_sfa  # unused by the 1D2D kernel
        sfb_ptr = sf_b
        if sfb_ptr.dtype != torch.float32 or not sfb_ptr.is_contiguous():
            sfb_ptr = sfb_ptr.float().contiguous()
    if cfg.tma_store:
        tma_d = tma_2d_bytes(out, 64, 128 // out.element_size(), swizzle="128B")
    else:
        tma_d = tma_a  # unused with direct stores
    ws = counters = out  # unused pointers without a split tail
    if splits > 1:
        # FP32 partial sums of the cut tiles (no initialization: every slice writes its part
        # before the counters let anyone read it); freed like the other temporaries below.
        ws = torch.empty(ws_floats, dtype=torch.float32, device=out.device)
        counters = _split_counters(index, num_counters)
    args = (
        tma_a,
        tma_b,
        tma_sfa,
        tma_sfb,
        tma_d,
        sfb_ptr.data_ptr(),
        out.data_ptr(),
        m,
        m_indices.data_ptr(),
        block_group.data_ptr(),
        num_groups,
        k_offsets.data_ptr(),
        num_dp,
        splits,
        ws.data_ptr(),
        counters.data_ptr(),
    )
    if torch.cuda.current_device() == index:
        bound(grid, *args)
    else:
        with torch.cuda.device(index):
            bound(grid, *args)
    # The descriptors hold raw addresses of possibly temporary operands (a K-major copy, the
    # MN-major scales): freed now, their memory is only reused by work queued after this kernel
    # on the same stream (PyTorch's caching allocator), as for any PyTorch op's temporaries.


def grouped_config(
    m: int, n: int, k: int, num_sms: int, num_groups: int = 0, split: bool = True
) -> PtxConfig:
    """Block sizes of the m-grouped contiguous GEMM: :func:`select_config`'s 1D2D choice for the
    total M, kept inside one 128-row group chunk (``block_m`` <= 128, no multicast: adjacent
    M-blocks may belong to different groups), with rasterization groups of about one expert's
    rows, ``M / num_groups`` rounded down to a power of two in [512, 2048] (512 when
    ``num_groups`` is unknown, 0): the tiles in flight then read few experts' B. 8 x 512 rows on
    an H200: 512 gives 1.03x / 1.01x the speed of the dense default 2048. ``split``: the
    dense rule's split tail (K-slices of the last partial wave's tiles, ``PtxConfig.split_k``);
    the masked GEMM has none."""
    raster = GROUPED_RASTER_M
    if num_groups > 0:
        per_group = max(1, m // num_groups)
        raster = min(2048, max(GROUPED_RASTER_M, 1 << (per_group.bit_length() - 1)))
    cfg = select_config("1d2d", m, n, k, num_sms)
    if cfg.block_m <= 128 and cfg.cluster == 1:
        return dataclasses.replace(cfg, raster_m=raster, split_k=cfg.split_k and split)
    bn = min(cfg.block_n, 128)
    epi = epilogue_bytes(128, bn, torch.bfloat16) if cfg.tma_store else 0
    stages = _MAX_STAGES
    while stages > 2 and smem_bytes(128, bn, stages, "1d2d", epi) > SM90_SMEM_BYTES:
        stages -= 1
    cfg = PtxConfig(128, bn, stages, 1, _UNROLL_K, True, cfg.tma_store, 0, raster)
    return _with_split_tail(cfg, "1d2d", m, n, k, num_sms) if split else cfg


def k_grouped_config(m: int, n: int, num_sms: int) -> PtxConfig:
    """Block sizes of the k-grouped GEMM (per-group K known only at run time, so one
    accumulator): 128-row tiles for M > 64 (one math warpgroup's 64 rows otherwise), ``block_n``
    128, the TMA-store epilogue when D's rows allow it, as many stages as fit."""
    bm = 64 if m <= 64 else 128
    tma = _TMA_STORE and tma_store_fits(128, n, torch.float32)
    epi = epilogue_bytes(bm, 128, torch.float32) if tma else 0
    stages = _MAX_STAGES
    while stages > 2 and smem_bytes(bm, 128, stages, "k_grouped", epi) > SM90_SMEM_BYTES:
        stages -= 1
    return PtxConfig(bm, 128, stages, 1, _UNROLL_K, False, tma, 0)


def _resolve(cfg: PtxConfig, kind: str, n: int, aligned: bool, out_dtype: torch.dtype):
    """``cfg`` adapted to this D: direct stores where the TMA store cannot write it (box rule,
    16-byte rows or base), and fewer stages where a wider (fp32) staging tile needs the room."""
    if cfg.tma_store and not (tma_store_fits(cfg.block_n, n, out_dtype) and aligned):
        cfg = dataclasses.replace(cfg, tma_store=False)
    while cfg.num_stages > 2 and config_smem_bytes(cfg, kind, out_dtype) > SM90_SMEM_BYTES:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def run_with_config(
    kind: str,
    a: ref.Operand,
    b: ref.Operand,
    cfg: PtxConfig,
    out_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """One GEMM with explicit block sizes (for sweeps and tests; no heuristic). ``kind`` is
    ``"1d2d"`` or ``"1d1d"``; D is ``out`` (``accumulate``: D += A·Bᵀ, 1D1D with fp32 ``out``
    only) or a fresh ``[M, N]`` tensor of ``out_dtype``. ``cfg.num_stages`` is lowered and
    ``cfg.tma_store`` dropped where this D needs it (see :class:`PtxConfig`).

    Raises:
        TypeError / ValueError: as :func:`fp8_gemm_nt` / :func:`fp8_gemm_nt_1d1d`, or a config
            outside :class:`PtxConfig`'s ranges or over the shared-memory limit.
    """
    if out is not None:
        out_dtype = out.dtype
    if kind == "1d2d":
        if accumulate:
            raise ValueError("accumulate: the 1D2D GEMM has no accumulate mode, got True")
        ref.validate_1d2d(a, b, out, out_dtype)
    elif kind == "1d1d":
        ref.validate_1d1d(a, b, out, accumulate, out_dtype)
    else:
        raise ValueError(f"kind must be '1d2d' or '1d1d', got {kind!r}")
    if (
        cfg.block_m not in (64, 128, 256)
        or cfg.block_n not in _block_ns(kind, cfg.block_m)
        or cfg.cluster not in (1, 2)
        or (cfg.multicast_a and cfg.cluster != 2)
        or cfg.unroll_k not in (1, 2, 4)
        or (cfg.double_acc and (cfg.block_m == 256 or cfg.block_n > 128))
        # (double accumulators wait for block k + 1's stage while holding block k's: one stage
        # would wait for itself)
        or (cfg.double_acc and cfg.num_stages < 2)
        # (split tail: built for the double-accumulator kernels; the others spill with it)
        or (cfg.split_k and not cfg.double_acc)
        or not 1 <= cfg.num_stages <= _MAX_STAGES_ANY
        or cfg.raster_m not in _RASTER_MS
        or isinstance(cfg.epi_boxes, bool)
        or not isinstance(cfg.epi_boxes, int)
        or cfg.epi_boxes < 0
        or smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages, kind) > SM90_SMEM_BYTES
    ):
        raise ValueError(f"cfg: block sizes or shared memory out of range, got {cfg}")
    return _gemm(kind, a, b, out, accumulate, out_dtype, cfg)


def _write_into(out, shape, dtype, device, accumulate, run):
    """Calls ``run(d)`` with the tensor the kernel writes and returns D: ``out`` itself when it
    is contiguous and 16-byte aligned (the epilogues store 4- to 16-byte vectors); else a fresh
    contiguous ``shape`` tensor (a copy of ``out`` when accumulating), copied back into ``out``
    when one was given."""
    if out is not None and out.is_contiguous() and out.dtype == dtype and out.data_ptr() % 16 == 0:
        run(out)
        return out
    if accumulate:
        d = out.clone(memory_format=torch.contiguous_format)
    else:
        d = torch.empty(shape, dtype=dtype, device=device)
    run(d)
    if out is None:
        return d
    out.copy_(d)
    return out


def _gemm(kind, a, b, out, accumulate, dtype, cfg=None):
    """D (+)= A · Bᵀ into ``out`` (or a fresh ``[M, N]`` tensor of ``dtype``); validated inputs."""
    (a_fp8, _), (b_fp8, _) = a, b
    m, k = a_fp8.shape
    n = b_fp8.shape[0]
    if m == 0 or n == 0:  # nothing to compute (no TMA descriptor of an empty B)
        return torch.empty(m, n, dtype=dtype, device=a_fp8.device) if out is None else out
    _check_runnable(a_fp8, n, k)
    return _write_into(
        out, (m, n), dtype, a_fp8.device, accumulate,
        lambda d: launch_gemm(kind, a, b, d, accumulate, dtype, cfg),
    )  # fmt: skip


def fp8_gemm_nt_unchecked(a, b, out, out_dtype):
    """:func:`fp8_gemm_nt` without its argument checks (the backend entry that
    :mod:`ptxtrain.gemm`'s dispatcher calls after validating once): ``a`` / ``b`` / ``out`` /
    ``out_dtype`` as :func:`ptxtrain.gemm.ref.validate_1d2d` accepts them. Raises as
    :func:`fp8_gemm_nt` for a device or K this backend cannot run."""
    return _gemm("1d2d", a, b, out, False, out.dtype if out is not None else out_dtype)


def fp8_gemm_nt_1d1d_unchecked(a, b, out, accumulate, out_dtype):
    """:func:`fp8_gemm_nt_1d1d` without its argument checks (the dispatcher's backend entry):
    arguments as :func:`ptxtrain.gemm.ref.validate_1d1d` accepts them. Raises as
    :func:`fp8_gemm_nt_1d1d` for a device or K this backend cannot run."""
    dtype = torch.float32 if accumulate else (out.dtype if out is not None else out_dtype)
    return _gemm("1d1d", a, b, out, accumulate, dtype)


def fp8_gemm_nt(
    a: ref.Operand,
    b: ref.Operand,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """PTX 1D2D GEMM with the contract of :func:`ptxtrain.gemm.ref.fp8_gemm_nt` (bf16 or fp32 D).

    Raises:
        TypeError / ValueError: as the reference, plus non-CUDA / non-sm_90 tensors or
            ``K % 16 != 0`` (see :func:`supports`).
        ptxtrain.jit.JitCompileError: NVRTC rejected the kernel (a bug; the log is attached).
    """
    ref.validate_1d2d(a, b, out, out_dtype)
    return fp8_gemm_nt_unchecked(a, b, out, out_dtype)


def m_grouped_fp8_gemm_nt_contiguous(
    a: ref.Operand,
    b: ref.Operand,
    m_indices: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    check_indices: bool = True,
) -> torch.Tensor:
    """PTX m-grouped contiguous GEMM (MoE Fprop / Dgrad) with the contract of
    :func:`ptxtrain.gemm.ref.m_grouped_fp8_gemm_nt_contiguous_ref`: ``D[r] = A[r] · B[g(r)]ᵀ``,
    A [M_total, K] e4m3 1x128-scaled with each group's rows padded to 128, ``m_indices``
    [M_total] int32 (-1 = padding row, stored as zeros), B [G, N, K] e4m3 128x128-scaled, D
    [M_total, N] bf16 / fp32.

    The 1D2D kernel with the tile's group read per work unit (DeepGEMM's contiguous layout):
    one launch, no host sync (``check_indices=False``; indices outside [-1, G) then give zero
    tiles), all-padding tiles skip the main loop. B must be K-major (a transposed view is
    copied first).

    Raises:
        TypeError / ValueError: as the reference, plus non-CUDA / non-sm_90 tensors or
            ``K % 16 != 0``.
        ptxtrain.jit.JitCompileError: NVRTC rejected the kernel.

    Source: DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous``; DeepSeek-V3 report §3.3;
    docs/design.md §2.
    """
    m, n, k, g = ref.validate_m_grouped_contiguous(a, b, m_indices, out, out_dtype, check_indices)
    return m_grouped_contiguous_unchecked(a, b, m_indices, out, out_dtype, (m, n, k, g))


def block_groups(m_indices: torch.Tensor) -> torch.Tensor:
    """The m-grouped kernel's tile-group input: per 64-row block of ``m_indices`` ([M] int32, M a
    multiple of 64), the largest index of its rows, i.e. the block's group (-1: all padding)."""
    return m_indices.reshape(-1, 64).amax(dim=1)


def _cached_block_groups(m_indices: torch.Tensor) -> torch.Tensor:
    """:func:`block_groups` of ``m_indices``, kept on the tensor object until it is modified
    in place (its version counter moves): a MoE layer's m-grouped GEMMs (the two projections'
    Fprop, then their Dgrad) share one ``m_indices``, so the reduction runs once per layout
    instead of once per GEMM (1-1.5% of an 8 x 512-row GEMM on an H200). Inference-mode tensors
    (no version counter) are not cached."""
    try:
        version = m_indices._version
    except RuntimeError:  # inference tensors do not track versions
        return block_groups(m_indices)
    hit = getattr(m_indices, "_ptxtrain_block_groups", None)
    if hit is not None and hit[0] == version:
        return hit[1]
    block_group = block_groups(m_indices)
    m_indices._ptxtrain_block_groups = (version, block_group)
    return block_group


def m_grouped_contiguous_unchecked(a, b, m_indices, out, out_dtype, dims, cfg=None):
    """:func:`m_grouped_fp8_gemm_nt_contiguous` without its argument checks, optionally with
    explicit block sizes.

    Args:
        a, b, m_indices, out, out_dtype: as :func:`m_grouped_fp8_gemm_nt_contiguous`, already
            accepted by :func:`ptxtrain.gemm.ref.validate_m_grouped_contiguous`.
        dims: ``(M, N, K, G)``, what that validation returns.
        cfg: a :class:`PtxConfig` (``benchmarks/bench_grouped.py --cfg``; not range-checked as
            :func:`run_with_config` does), or None for :func:`grouped_config`'s.

    Returns:
        D [M, N] of ``out_dtype`` (``out`` itself when given).

    Raises:
        ValueError: non-CUDA / non-sm_90 tensors, ``K % 16 != 0`` or no NVRTC.
        ptxtrain.jit.JitCompileError: NVRTC rejected the kernel.
    """
    m, n, k, g = dims
    a_fp8 = a[0]
    dtype = out.dtype if out is not None else out_dtype
    if out is None:
        out = torch.empty(m, n, dtype=dtype, device=a_fp8.device)
    if m == 0 or n == 0:
        return out
    if g == 0:
        return out.zero_()
    _check_runnable(a_fp8, n, k)
    m_indices = m_indices.contiguous()  # the kernel reads it by pointer, unit stride
    block_group = _cached_block_groups(m_indices)
    return _write_into(
        out, (m, n), dtype, a_fp8.device, False,
        lambda d: launch_gemm("m_grouped", a, b, d, False, dtype, cfg, (m_indices, block_group)),
    )  # fmt: skip


def k_grouped_fp8_gemm_nt_contiguous(
    a: ref.Operand,
    b: ref.Operand,
    ks: list[int] | None,
    *,
    ks_tensor: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """PTX k-grouped GEMM (the MoE experts' wgrad) with the contract of
    :func:`ptxtrain.gemm.ref.k_grouped_fp8_gemm_nt_contiguous_ref`: ``D[g] (+)= A[:, K_g] ·
    B[:, K_g]ᵀ``, A [M, ΣK] and B [N, ΣK] e4m3 1x128-scaled along K, group g owning the K
    columns ``[S_g, S_g + ks[g])`` (every ``ks[g]`` a multiple of 128), D [G, M, N] fp32.

    The 1D1D kernel with each work unit's K range read at run time (one compiled kernel for any
    ``ks``); a group with ``ks[g] = 0`` stores zeros (or adds nothing). One small host-to-device
    copy of the K offsets per call, or none with ``ks=None`` and ``ks_tensor`` (the sizes on the
    device, summing to at most K_total; the offsets are then a device prefix sum, no host sync).

    Raises:
        TypeError / ValueError: as the reference, plus non-CUDA / non-sm_90 tensors.
        ptxtrain.jit.JitCompileError: NVRTC rejected the kernel.

    Source: DeepGEMM ``k_grouped_fp8_gemm_nt_contiguous``; DeepSeek-V3 report §3.3;
    docs/design.md §2.
    """
    ref.check_one_of_ks(ks, ks_tensor)
    if ks_tensor is None:
        m, n, ks = ref.validate_k_grouped(a, b, ks, out, accumulate)
        g = len(ks)
    else:
        m, n, g = ref.validate_k_grouped_device(a, b, ks_tensor, out, accumulate)
    return _k_grouped_contiguous(a, b, ks, out, accumulate, (m, n, g), ks_tensor)


def _k_grouped_contiguous(a, b, ks, out, accumulate, dims, ks_tensor=None):
    """:func:`k_grouped_fp8_gemm_nt_contiguous` after validation (``dims`` = (M, N, G))."""
    a_fp8 = a[0]
    m, n, g = dims
    if out is None:
        out = torch.empty((g, m, n), dtype=torch.float32, device=a_fp8.device)
    if g == 0 or m == 0 or n == 0:
        return out
    k_total = a_fp8.shape[1]
    if k_total == 0:  # every group empty: D = 0, or unchanged when accumulating
        return out if accumulate else out.zero_()
    _check_runnable(a_fp8, n, k_total)
    if ks_tensor is None:
        offsets = [0]
        for kg in ks:
            offsets.append(offsets[-1] + kg // BLOCK_K)
        k_offsets = torch.tensor(offsets, dtype=torch.int32).to(a_fp8.device, non_blocking=True)
    else:  # [G + 1] prefix sums in 128-column blocks, on the device
        k_offsets = torch.zeros(g + 1, dtype=torch.int32, device=a_fp8.device)
        k_offsets[1:] = torch.cumsum(ks_tensor // BLOCK_K, 0)
    return _write_into(
        out, (g, m, n), torch.float32, a_fp8.device, accumulate,
        lambda d: launch_gemm(
            "k_grouped", a, b, d, accumulate, torch.float32, None, None, k_offsets
        ),
    )  # fmt: skip


def m_grouped_fp8_gemm_nt_masked(
    a: ref.Operand,
    b: ref.Operand,
    masked_m: torch.Tensor,
    expected_m: int | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """PTX masked m-grouped GEMM (MoE decode) with the contract of
    :func:`ptxtrain.gemm.ref.m_grouped_fp8_gemm_nt_masked_ref`: ``D[g, :masked_m[g]] =
    A[g, :masked_m[g]] · B[g]ᵀ``, A [G, M_max, K] e4m3 1x128-scaled, B [G, N, K] e4m3
    128x128-scaled, ``masked_m`` [G] int32 read on the device only (no host sync, CUDA-graph
    safe), D [G, M_max, N] bf16 / fp32. Tiles at or past ``masked_m[g]`` are skipped; rows past
    it inside a computed tile hold unspecified values (as in DeepGEMM). ``expected_m`` (rows per
    group, a hint) picks the block sizes.

    Status: GPU-tested on an H200 (``tests/gemm/test_ptx.py::test_gpu_m_grouped_masked``) and
    timed against the Triton kernel (``benchmarks/bench_grouped.py``): ``auto`` in
    :mod:`ptxtrain.gemm.grouped` takes it where it measured faster
    (:func:`ptxtrain.gemm.grouped.masked_ptx_wins`).

    Raises:
        TypeError / ValueError: as the reference (values of ``masked_m`` are not checked), plus
            non-CUDA / non-sm_90 tensors or ``K % 16 != 0``.
        ptxtrain.jit.JitCompileError: NVRTC rejected the kernel.

    Source: DeepGEMM ``m_grouped_fp8_gemm_nt_masked``; docs/design.md §2.
    """
    g, m_max, n, k = ref.validate_m_grouped_masked(
        a, b, masked_m, expected_m, out, out_dtype, check_masked_m=False
    )
    dtype = out.dtype if out is not None else out_dtype
    if out is None:
        out = torch.empty((g, m_max, n), dtype=dtype, device=a[0].device)
    if g == 0 or m_max == 0 or n == 0:
        return out
    _check_runnable(a[0], n, k)
    masked = masked_m.contiguous()
    return _write_into(
        out, (g, m_max, n), dtype, a[0].device, False,
        lambda d: launch_gemm("masked", a, b, d, False, dtype, None, None, masked),
    )  # fmt: skip


def fp8_gemm_nt_1d1d(
    a: ref.Operand,
    b: ref.Operand,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """PTX 1D1D (wgrad) GEMM with the contract of :func:`ptxtrain.gemm.ref.fp8_gemm_nt_1d1d`.

    Raises:
        TypeError / ValueError: as the reference, plus non-CUDA / non-sm_90 tensors or
            ``K % 16 != 0``.
        ptxtrain.jit.JitCompileError: NVRTC rejected the kernel.
    """
    ref.validate_1d1d(a, b, out, accumulate, out_dtype)
    return fp8_gemm_nt_1d1d_unchecked(a, b, out, accumulate, out_dtype)


__all__ = [
    "PtxConfig",
    "compile_args",
    "compile_gemm",
    "epilogue_bytes",
    "fp8_gemm_nt",
    "fp8_gemm_nt_1d1d",
    "grouped_config",
    "k_grouped_config",
    "k_grouped_fp8_gemm_nt_contiguous",
    "kernel_source",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "run_with_config",
    "select_config",
    "smem_bytes",
    "supports",
    "tma_store_fits",
]
