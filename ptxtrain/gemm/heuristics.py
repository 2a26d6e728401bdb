"""Launch-config heuristics for the Triton block-scaled FP8 GEMMs (pure functions, no GPU needed;
:func:`device_sms` reads the one device property they take, the SM count).

Design note. Every kernel in :mod:`ptxtrain.gemm.triton` walks K in steps of ``BLOCK_K = 128``,
one scale block per step, so a config only chooses the output tile (``block_m`` x ``block_n``),
the warps, the software-pipeline depth, the L2 swizzle width ``group_m``, the kernel variant and,
for persistent variants, how many programs share an SM.

What decides speed (measured on an H200, Triton 3.6, CUDA graphs with the L2 flushed):
Triton waits for each 128-K block's WGMMAs right after issuing them, because the block's partial
sum is needed at once for the FP32 promotion ``acc += blk * (sf_a * sf_b)``; within one program
the tensor core idles while the CUDA cores promote. Only *other* programs on the same SM fill
that gap. A 64x128 tile on one warpgroup (4 warps) needs ~155 registers and ~74 KB of shared
memory at 3 stages, so 2-3 such programs share an SM, and it beat every 128x128 / 64x256 /
128x64 config at M = 4096 (0.70-0.89x of cuBLAS blockwise, 1D2D; forcing 128x128 to 128 registers
for two programs per SM spilled and ran at half speed). With few tiles (decode-sized M), 64x64
tiles spread the work over more SMs and reached 1.05-1.25x of cuBLAS. TMA loads beat pointer
loads by 10-45% once tiles are many; with few tiles both run alike and the pointer variant has
less host overhead. Measurements: 1D2D over the DeepSeek-V3 shapes at M = 64, 128, 4096 and 1D1D
over the wgrad shapes at K = 4096 (tokens); the rules below are those results, not a model.

Rules of :func:`select_config` (any ``num_sms``):

- ``block_m = 64``, 4 warps; ``block_n = 64`` with 5 stages while 64x64 tiles number at most two
  waves (``2 · num_sms``), else ``block_n = 128`` with 3 stages;
- at most two waves of tiles: ``tiled``; more: 1D2D ``tma`` (``tma_persistent`` with two programs
  per SM when K <= 512, where prologue and epilogue weigh most), 1D1D ``tma_persistent`` with
  two programs per SM.

:func:`prefers_gluon` and :func:`gluon_tile` decide where the Triton backend's default runs the
warp-specialized Gluon kernel instead (``ptxtrain.gemm.gluon``; from two waves of 128x128
tiles) and with which tile (fewest L2 bytes per FLOP among those that fill the waves).

Source: DeepSeek-V3 report §3.3 (promotion every 128 K); DeepGEMM's block-size choice (fill the
SMs); docs/design.md §6 (132 SMs; a plain Triton kernel at ~0.7x of cuBLAS at M = 4096).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ptxtrain._checks import ceil_div

BLOCK_K = 128  # one K step = one 1x128 / 128x128 scale block (DeepSeek-V3 §3.3)
KINDS = ("1d2d", "1d1d")
# "tiled": one program per output tile, pointer loads (correct for any strides).
# "persistent": programs_per_sm x num_sms programs looping over the tiles (tl.range flatten=True).
# "tma" / "tma_persistent": the same with A and B loaded through host-built tensor descriptors
#   (TMA on sm_90); the launcher falls back to the pointer twin unless both operands are K-major
#   with 16-byte aligned rows and bases.
# Triton 3.6's automatic warp specialization (``tl.range(warp_specialize=True)``) hangs or
#   faults on sm_90, even in a minimal bf16 GEMM, so no variant uses it; ``ptxtrain.gemm.gluon``
#   specializes warps explicitly instead.
VARIANTS = ("tiled", "persistent", "tma", "tma_persistent")
_PERSISTENT_VARIANTS = ("persistent", "tma_persistent")
H100_SMS = 132  # H100 SXM and H200 (docs/design.md §6)

_BLOCK_MS = (64, 128)
_BLOCK_NS = (64, 128, 256)
_NUM_WARPS = (4, 8)
# Bytes of dynamic shared memory one block may opt into on sm_90 (232448 B: CUDA's
# cudaDevAttrMaxSharedMemoryPerBlockOptin on H100 / H200), the bound the Triton, Gluon and PTX
# GEMMs size their shared-memory rings against.
SM90_SMEM_BYTES = 227 * 1024
_EPILOGUE_SMEM = 64 * 1024  # kept free for Triton's layout conversions and scale buffers


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration of a Triton block-scaled FP8 GEMM kernel.

    Attributes:
        block_m: output tile rows (64 or 128).
        block_n: output tile columns (64, 128 or 256). With 1D2D and ``block_n = 256`` a tile
            spans two 128-row scale blocks of B; the kernel handles both cases.
        num_warps: 4 or 8 (one or two warpgroups).
        num_stages: software-pipeline depth of the K loop (1 to 6).
        group_m: tile rows per L2 swizzle group (consecutive programs run down ``group_m`` tile
            rows before moving right, so they share B tiles in L2).
        variant: one of :data:`VARIANTS`.
        programs_per_sm: persistent variants launch ``programs_per_sm x num_sms`` programs
            (1 to 4); ignored by the others.

    Raises:
        ValueError: a field outside the values above.
    """

    block_m: int = 64
    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    variant: str = "tiled"
    programs_per_sm: int = 1

    def __post_init__(self) -> None:
        for name, allowed in (
            ("block_m", _BLOCK_MS),
            ("block_n", _BLOCK_NS),
            ("num_warps", _NUM_WARPS),
            ("num_stages", (1, 2, 3, 4, 5, 6)),
            ("variant", VARIANTS),
            ("programs_per_sm", (1, 2, 3, 4)),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or value not in allowed:
                raise ValueError(f"GemmConfig.{name} must be one of {allowed}, got {value!r}")
        if isinstance(self.group_m, bool) or not isinstance(self.group_m, int) or self.group_m < 1:
            raise ValueError(f"GemmConfig.group_m must be an int >= 1, got {self.group_m!r}")

    @property
    def block_k(self) -> int:
        """K per step: always 128, one scale block."""
        return BLOCK_K

    @property
    def persistent(self) -> bool:
        return self.variant in _PERSISTENT_VARIANTS

    @property
    def uses_tma(self) -> bool:
        return self.variant in ("tma", "tma_persistent")

    def acc_regs_per_thread(self) -> int:
        """Registers per thread for the running and the per-block FP32 accumulators."""
        return 2 * self.block_m * self.block_n // (32 * self.num_warps)

    def smem_bytes(self) -> int:
        """Shared memory of the operand ring: ``num_stages`` x (A tile + B tile), 1 byte each."""
        return self.num_stages * (self.block_m + self.block_n) * BLOCK_K


def _check_dims(m: object, n: object, k: object, kind: object, num_sms: object) -> None:
    for name, value in (("m", m), ("n", n), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms must be an int >= 1, got {num_sms!r}")


def _check_variant(variant: object) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")


def m_bucket(m: int) -> int:
    """The autotuning bucket of ``m``: the next power of two, clamped to [16, 8192].

    Configs tuned for one M are reused for every M of its bucket (keys ``(bucket, N, K)``).

    Raises:
        ValueError: ``m`` is not an int >= 0.
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"m must be an int >= 0, got {m!r}")
    bucket = 16
    while bucket < m and bucket < 8192:
        bucket *= 2
    return bucket


def num_tiles(m: int, n: int, config: GemmConfig) -> int:
    """Output tiles of an [m, n] result under ``config``."""
    return ceil_div(m, config.block_m) * ceil_div(n, config.block_n)


@functools.cache
def _cuda_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the ``num_sms`` the heuristics take.

    A CUDA device without an index means the current device. Any other device (the CPU under
    Triton's interpreter) gives :data:`H100_SMS`, so the interpreter chooses configs as for the
    GPU the kernels are meant for. Cached per device index (one driver query each).
    """
    if device.type != "cuda":
        return H100_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=4096)
def select_config(
    m: int,
    n: int,
    k: int,
    kind: str = "1d2d",
    num_sms: int = H100_SMS,
    *,
    variant: str | None = None,
) -> GemmConfig:
    """Choose the launch config of an ``[m, k] x [n, k]ᵀ`` block-scaled FP8 GEMM.

    Pure and deterministic (cached); the rules and the measurements behind them are in the
    module docstring.

    Args:
        m, n, k: GEMM sizes (ints >= 0).
        kind: ``"1d2d"`` (:func:`ptxtrain.gemm.triton.fp8_gemm_nt`) or ``"1d1d"``
            (:func:`ptxtrain.gemm.triton.fp8_gemm_nt_1d1d`).
        num_sms: streaming multiprocessors of the GPU (132 on H100 SXM / H200).
        variant: force a kernel variant from :data:`VARIANTS` (tiles stay the heuristic's;
            persistent variants get two programs per SM); None lets the rules choose.

    Returns:
        A :class:`GemmConfig`.

    Raises:
        TypeError / ValueError: non-int or negative sizes, unknown ``kind`` / ``variant``,
        ``num_sms < 1``.

    Source: measurements in this module's docstring; DeepGEMM's block-size choice.
    """
    _check_dims(m, n, k, kind, num_sms)
    if variant is not None:
        _check_variant(variant)
    m1, n1 = max(m, 1), max(n, 1)
    few_tiles = 2 * num_sms
    if ceil_div(m1, 64) * ceil_div(n1, 64) <= few_tiles:
        block_n, stages = 64, 5
    else:
        block_n, stages = 128, 3
    tiles = ceil_div(m1, 64) * ceil_div(n1, block_n)
    programs_per_sm = 1
    if variant is None:
        if tiles <= few_tiles:
            variant = "tiled"
        elif kind == "1d1d" or k <= 512:
            variant, programs_per_sm = "tma_persistent", 2
        else:
            variant = "tma"
    elif variant in _PERSISTENT_VARIANTS:
        programs_per_sm = 2
    group_m = 8 if ceil_div(m1, 64) > 1 else 1
    return GemmConfig(64, block_n, 4, stages, group_m, variant, programs_per_sm)


# The warp-specialized Gluon kernel (ptxtrain.gemm.gluon) takes GEMMs from this many waves of
# 128x128 tiles on. Measured on an H200 against the Triton kernel in the same process (scales
# by TMA), 1D2D: 1.09x at 2048 x 2112 x 7168 (272 tiles, 2.1 waves),
# 1.18x at 2048 x 4096 x 7168 (3.9 waves), 1.08x at 4096 x 2112 x 7168 (4.1 waves), equal to
# 1.23x at the other V3 shapes at M = 4096 (7.8-47 waves); 1D1D (wgrad, K = 4096): 1.00-1.24x
# at 6.8-17 waves. Below 2 waves (decode-sized M) the Triton kernel's 64-row tiles spread the
# work over more SMs.
GLUON_MIN_WAVES = 2


def prefers_gluon(m: int, n: int, k: int, kind: str = "1d2d", num_sms: int = H100_SMS) -> bool:
    """Whether the Triton backend's default runs the warp-specialized Gluon kernel
    (:func:`ptxtrain.gemm.gluon.fp8_gemm`, with :func:`gluon_tile`'s tile) instead of its
    Triton kernel.

    True for GEMMs (1D2D or 1D1D) with K > 0 and at least ``GLUON_MIN_WAVES`` waves of
    128x128 output tiles over ``num_sms`` SMs.

    Raises:
        TypeError / ValueError: as :func:`select_config`.
    """
    _check_dims(m, n, k, kind, num_sms)
    if k == 0:
        return False
    return ceil_div(m, 128) * ceil_div(n, 128) >= GLUON_MIN_WAVES * num_sms


def _wave_efficiency(tiles: int, num_sms: int, k_blocks: int) -> float:
    """Share of the SMs' tile slots that ``tiles`` use over all their waves, after
    :func:`gluon_split_k` cuts the last partial wave's tiles (of ``k_blocks`` K blocks each)
    into at least :data:`GLUON_SPLIT_FILL_MIN` K-slices (that wave then counts ``1 / splits``
    of a wave)."""
    if not tiles:
        return 0.0
    whole, splits = gluon_split_k(tiles, num_sms, k_blocks)
    if splits < GLUON_SPLIT_FILL_MIN:
        return tiles / (ceil_div(tiles, num_sms) * num_sms)
    waves = whole // num_sms + 1 / splits
    return tiles / (waves * num_sms)


def split_tail(
    units: int, grid_units: int, num_kb: int, quantum: int, max_splits: int | None = None
) -> tuple[int, int]:
    """``(num_dp_units, splits)`` of a persistent launch of ``units`` work units on
    ``grid_units`` CTAs (clusters) with ``num_kb`` K blocks per tile (pure function).

    The first ``num_dp_units`` units are whole tiles: full waves, each CTA the same number. The
    ``tail = units - num_dp_units`` tiles of the partial last wave are cut into ``splits``
    K-slices of whole ``quantum``-block steps, as many as the idle CTAs take in one round:
    ``splits = min(grid_units // tail, num_kb // quantum)`` (and at most ``max_splits``). The
    PTX kernel's split tail (``PtxConfig.split_k``, quantum = its double-accumulator chunk) and
    the Gluon kernel's (:func:`gluon_split_k`) both cut by it.
    A single partial wave (``units < grid_units``, decode-sized M) is cut the same way, with no
    whole tiles in front: 64 x 2112 x 7168 with 64x32 tiles is 66 tiles on 132 SMs, cut in 2.
    ``splits == 1`` (nothing cut) when there is no partial wave or fewer than two slices fit.
    E.g. 4096 x 2112 x 7168 with 128x128 tiles on 132 SMs: 544 tiles = 4 waves + 16, cut into
    7 slices of 8 K blocks (112 units).

    Raises:
        ValueError: a non-positive ``grid_units`` or ``quantum``, or negative ``units`` /
            ``num_kb``.
    """
    if grid_units < 1 or quantum < 1:
        raise ValueError(f"grid_units and quantum must be positive, got {grid_units}, {quantum}")
    if units < 0 or num_kb < 0:
        raise ValueError(f"units and num_kb must be >= 0, got {units}, {num_kb}")
    tail = units % grid_units
    if tail == 0:  # (also M = 0: no units)
        return units, 1
    splits = min(grid_units // tail, num_kb // quantum)
    if max_splits is not None:
        splits = min(splits, max_splits)
    if splits < 2:
        return units, 1
    return units - tail, splits


# A K-slice of the split tail covers at least this many 128-K blocks (each slice's partial sums
# cost a [BM, BN] fp32 write and read; on an H200, 4096 x 24576 x 1536's 36 tail tiles in 3
# slices of 4 blocks run 0.993x cuBLAS against 1.005 unsplit, 4096 x 2112 x 7168's 8 in 7
# slices of 8 blocks 0.980, in 14 of 4 0.972), and a tile is cut into at most this many.
GLUON_SPLIT_MIN_BLOCKS = 8
GLUON_SPLIT_MAX = 16  # (GluonConfig.split_max's default and largest value)
# Slices a split wave needs to count as 1 / splits of a wave in gluon_tile's choice. On an
# H200, 2048 x 7168 x 2048 as 448 tiles of 256x128, the last 52 split 2 ways, runs 0.86x
# cuBLAS against 0.95 for 896 tiles of 128x128 (equal fill on paper); 4096 x 2112 x 7168's
# 8 tiles split 14 ways 0.93 against 0.75 unsplit.
GLUON_SPLIT_FILL_MIN = 4


def gluon_split_k(
    num_tiles: int, num_sms: int, k_blocks: int, max_splits: int = GLUON_SPLIT_MAX
) -> tuple[int, int]:
    """``(whole, splits)``: the warp-specialized Gluon kernel's persistent programs (one per SM)
    run tiles ``[0, whole)`` whole and cut each tile past them into ``splits`` K-slices that
    run side by side on the SMs the last partial wave would leave idle (their FP32 partial sums
    go to a workspace; a second kernel adds them in slice order and stores the tile, so results
    are bitwise repeatable). ``splits`` = SMs per tail tile, at most ``max_splits`` (the
    config's ``split_max``, default :data:`GLUON_SPLIT_MAX`) and at least
    :data:`GLUON_SPLIT_MIN_BLOCKS` K blocks per slice; ``(num_tiles, 1)`` where that is below
    2 or there is no partial wave.

    Measured on an H200 (x cuBLAS): a lone 256x128 x 7168 tile takes
    47 µs on one SM, and 4096 x 2112 x 7168's 272 tiles of 256x128 (two waves and 8 tiles)
    146 µs against 103 µs for 4096 x 2048's 256: the 8-tile wave costs a whole wave.

    Raises:
        ValueError: a negative count or ``num_sms`` < 1.
    """
    for name, value in (("num_tiles", num_tiles), ("k_blocks", k_blocks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0, got {value!r}")
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 1:
        raise ValueError(f"num_sms must be an int >= 1, got {num_sms!r}")
    return split_tail(num_tiles, num_sms, k_blocks, GLUON_SPLIT_MIN_BLOCKS, max_splits)


# The warp-specialized Gluon kernel's tiles, fewest L2 bytes per FLOP first: (BM + BN) / (BM BN)
# = 0.0117 for 256x128, 0.0156 for 128x128, 0.0195 for 256x64.
GLUON_TILES = ((256, 128), (128, 128), (256, 64))


@functools.lru_cache(maxsize=4096, typed=True)  # (on the host path of every routed GEMM)
def gluon_tile(m: int, n: int, k: int, kind: str = "1d2d", num_sms: int = H100_SMS) -> tuple:
    """``(block_m, block_n)`` of the warp-specialized Gluon kernel: the first tile of
    :data:`GLUON_TILES` (fewest L2 bytes per FLOP first) whose tiles fill the SMs' waves within
    5 points of the best-filling one, a last partial wave cut into K-slices by
    :func:`gluon_split_k` counting as ``1 / splits`` of a wave. 1D1D: always 128x128 (its
    per-column scales spill with two 64-row waves per consumer).

    Measured on an H200 (x cuBLAS blockwise, with one scale slot per stage; the kernel's ring of
    one slot more moves all tiles alike except 256x64, to 0.85-0.88): 1D2D at M = 4096
    256x128 against 128x128 at 24576 x 1536 0.995 / 0.958, 7168 x 16384 0.973 / 0.889,
    4096 x 7168 0.954 / 0.892, 7168 x 2048 0.995 / 0.955 (equal wave fill); at 2112 x 7168,
    where 256x64's 528 tiles fill 4 waves exactly (128x128: 82% of 5, 256x128: 69% of 3),
    256x64 0.912, 128x128 0.882, 256x128 0.792; at M = 2048, 7168 x 2048 (128x128 and 256x64
    97%, 256x128 85%), 128x128 0.961, 256x64 0.790, 256x128 0.876. These fills are without
    the split tail, which makes 256x128 fill 97-100% at these shapes.

    Raises:
        TypeError / ValueError: as :func:`select_config`.
    """
    _check_dims(m, n, k, kind, num_sms)
    if kind != "1d2d":
        return (128, 128)
    kb = ceil_div(k, BLOCK_K)
    fill = {
        (bm, bn): _wave_efficiency(ceil_div(m, bm) * ceil_div(n, bn), num_sms, kb)
        for bm, bn in GLUON_TILES
    }
    best = max(fill.values())
    return next(tile for tile in GLUON_TILES if fill[tile] >= best - 0.05)


def _max_stages(bm: int, bn: int) -> int:
    per_stage = (bm + bn) * BLOCK_K
    return max(2, min(5, (SM90_SMEM_BYTES - _EPILOGUE_SMEM) // per_stage))


# (block_m, block_n, num_warps) an autotuner tries: the accumulators of each fit 128 registers per
# thread; 8 warps only where 4 would not fit (8 warps on 64-row tiles measured slower).
_TUNE_TILES = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8))


def autotune_configs(
    m: int, n: int, k: int, kind: str = "1d2d", *, variants: tuple[str, ...] | None = None
) -> tuple[GemmConfig, ...]:
    """The candidate list an autotuner times for one shape; the heuristic's choice comes first.

    Tiles 64x64, 64x128, 128x64 (4 warps), 128x128 and 64x256 (8 warps; 128-row tiles only when
    ``m > 64``), pipeline depth 3 and the deepest that fits the shared memory, for each of
    ``variants`` (default: all of :data:`VARIANTS`), with 1 and 2 programs per SM for the
    persistent ones.

    Raises:
        TypeError / ValueError: as :func:`select_config`; an unknown variant.
    """
    _check_dims(m, n, k, kind, H100_SMS)
    variants = VARIANTS if variants is None else tuple(variants)
    for v in variants:
        _check_variant(v)
    first = select_config(m, n, k, kind)
    out: list[GemmConfig] = [first] if first.variant in variants else []
    for variant in variants:
        persistent = variant in _PERSISTENT_VARIANTS
        for bm, bn, warps in _TUNE_TILES:
            if m <= 64 and bm != 64:
                continue
            for pps in (1, 2) if persistent else (1,):
                for stages in sorted({3, _max_stages(bm, bn)}):
                    cfg = GemmConfig(bm, bn, warps, stages, 8, variant, pps)
                    if cfg not in out:
                        out.append(cfg)
    return tuple(out)
