"""Triton block-scaled FP8 GEMMs: the GPU backend that is always available.

Design note. Same names, contracts and validation as :mod:`ptxtrain.gemm.ref` (docs/design.md §2):
``fp8_gemm_nt`` (1D2D: A per 1x128 tile, B per 128x128 block; bf16/fp32 out) and
``fp8_gemm_nt_1d1d`` (wgrad: both per 1x128 tile; fp32 out, optional ``D += ...``).

One kernel serves both. Each program owns a ``BLOCK_M x BLOCK_N`` output tile and walks K in
steps of ``BLOCK_K = 128``, exactly one scale block per step (DeepSeek-V3 report §3.3):

    blk  = tl.dot(a_tile [BM, 128] fp8, b_tile [BN, 128]ᵀ fp8)     # fp32, fresh every step
    acc += blk * (sf_a[:, None] * sf_b)                             # FP32 promotion per 128 K

so the tensor core never accumulates more than 128 products (4 WGMMAs of k = 32 on sm_90) before
the partial sum is scaled and added in FP32 registers — DeepGEMM's promotion. ``sf_b`` is
one scalar per step for 1D2D when ``BLOCK_N`` is 64 or 128 (the tile lies in one 128-row scale
block of B), a vector of two values gathered per column when ``BLOCK_N = 256`` (the tile spans
two scale rows), and a per-column vector for 1D1D. M and N tails: row indices are clamped for
the loads and masked at the store; K tail: masked loads with zeros (or TMA's zero fill). Every
operand (fp8 data, scales, output) is addressed through its strides, so sf_a may be row-major
or MN-major (the cuBLAS layout, docs/design.md §2); offsets switch to int64 when a tensor spans 2^31
elements.

Variants (:data:`ptxtrain.gemm.heuristics.VARIANTS`), chosen by a :class:`GemmConfig`:
``tiled`` (one program per tile, pointer loads), ``persistent`` (``programs_per_sm x num_sms``
programs looping over tiles with ``tl.range(..., flatten=True)`` so the next tile's loads overlap
the current epilogue), and ``tma`` / ``tma_persistent`` (A and B through host-built
``TensorDescriptor``s, i.e. TMA on sm_90; used only when both operands are K-major with 16-byte
aligned rows and bases, else the pointer twin runs). Triton 3.6's automatic warp specialization
(``tl.range(warp_specialize=True)``) runs a Hopper pass on sm_90 too, but its kernels hang or
fault there, a minimal bf16 GEMM's included (Triton's tutorials keep it off before Blackwell,
triton-lang/triton PR #7108), so no variant uses it;
:mod:`ptxtrain.gemm.gluon` specializes warps explicitly instead, and the default config sends
GEMMs of at least two waves of 128x128 tiles there (``heuristics.prefers_gluon``: sm_90,
TMA-loadable operands; ``PTXTRAIN_TRITON_GLUON=0`` turns it off; an explicit ``config`` or
``"autotune"`` keeps the Triton kernel).
The config is :func:`ptxtrain.gemm.heuristics.select_config`'s (rules from measurements, see
there) unless the caller passes one, or ``config="autotune"``, which times the candidates of
:func:`ptxtrain.gemm.heuristics.autotune_configs` once per ``(kind, M bucket, N, K, ...)``.
Every variant was checked on an H200 over the DeepSeek-V3 shapes (``calc_diff`` < 1e-3).

Speed of the default configs (H200, L2 flushed, vs cuBLAS blockwise through
``torch._scaled_mm``, DeepSeek-V3 shapes, ``ptxtrain bench gemm``; see docs/performance.md):
1D2D geometric mean 1.12x at M = 64, 1.06x at M = 128 (this kernel), 1.007-1.012x at M = 4096
(the Gluon kernel with its split tail; this one alone: 0.78x); 1D1D (wgrad, K = 4096)
0.94-1.02x per shape (Gluon; this one alone 0.77-0.80x).
This kernel's ceiling is structural: Triton 3.6 waits for each block's WGMMAs before the
promotion can read them, so only other programs on the SM overlap the promotion (heuristics.py).
Host overhead is ~50-110 µs per call against cuBLAS's ~20 µs: hide it with CUDA graphs.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` set before this
module is imported) on CPU tensors. Its ``tl.dot`` on FP8 operands upcasts them exactly
(e4m3 → fp16 bit manipulation, subnormals included) and multiplies in fp32, so the GEMM is
interpretable as is; only its fp32 → bf16 cast truncates instead of rounding (docs/design.md §7),
which the tests' tolerances cover. ``_compile_for_sm90`` compiles the kernel for sm_90a without a
GPU for instruction- and spill-level checks.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ptxtrain._checks import ceil_div
from ptxtrain.gemm.heuristics import (
    BLOCK_K,
    VARIANTS,
    GemmConfig,
    autotune_configs,
    device_sms,
    gluon_split_k,
    gluon_tile,
    m_bucket,
    prefers_gluon,
    select_config,
)

# The reference's validators: same checks, same messages (one source of truth for the contract).
from ptxtrain.gemm.ref import Operand, validate_1d1d, validate_1d2d

__all__ = ["default_kernel", "fp8_gemm_nt", "fp8_gemm_nt_1d1d", "is_interpreted"]

_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------


@triton.jit
def tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile id → (pid_m, pid_n), running down GROUP_M tile rows before moving right (L2 reuse)."""
    tiles_per_group = GROUP_M * num_pid_n
    group = tile_id // tiles_per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    in_group = tile_id % tiles_per_group
    return first_m + in_group % group_rows, in_group // group_rows


@triton.jit
def block_scaled_tile(
    a_src,
    b_src,
    sfa_ptr,
    sfb_ptr,
    M,
    N,
    K,
    pid_m,
    pid_n,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_sfa_m,
    stride_sfa_k,
    stride_sfb_n,
    stride_sfb_k,
    SFB_PER_ROW: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """Σ_kb (A_kb · B_kbᵀ) · sf_a[:, kb] · sf_b[·, kb] for one [BLOCK_M, BLOCK_N] tile, fp32."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_k = tl.arange(0, BLOCK_K)  # [BK]
    # Rows past M / N read row 0 (always in bounds) and are dropped at the store.
    rows_a = tl.where(offs_m < M, offs_m, 0)
    rows_b = tl.where(offs_n < N, offs_n, 0)
    if INT64:
        rows_a = rows_a.to(tl.int64)
        rows_b = rows_b.to(tl.int64)
    if not USE_TMA:
        a_ptrs = a_src + rows_a[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
        b_ptrs = b_src + rows_b[:, None] * stride_bn + offs_k[None, :] * stride_bk  # [BN, BK]
    sfa_ptrs = sfa_ptr + rows_a * stride_sfa_m  # [BM]
    if SFB_PER_ROW:  # 1D1D: sf_b [N, Kb], one scale per column of the tile
        sfb_ptrs = sfb_ptr + rows_b * stride_sfb_n  # [BN]
    elif BLOCK_N <= BLOCK_K:  # 1D2D, the tile lies inside one 128-row block of B
        sfb_ptrs = sfb_ptr + ((pid_n * BLOCK_N) // BLOCK_K) * stride_sfb_n  # scalar
    else:  # 1D2D, BLOCK_N = 256: the tile spans two 128-row blocks of B
        sfb_ptrs = sfb_ptr + (rows_b // BLOCK_K) * stride_sfb_n  # [BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_steps = tl.cdiv(K, BLOCK_K)
    for kb in tl.range(0, k_steps, num_stages=NUM_STAGES):
        if USE_TMA:
            # Out-of-bounds rows and the K tail come back as zeros.
            a = a_src.load([pid_m * BLOCK_M, kb * BLOCK_K])  # [BM, BK] fp8
            b = b_src.load([pid_n * BLOCK_N, kb * BLOCK_K])  # [BN, BK] fp8
        elif EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kb * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        sfa = tl.load(sfa_ptrs + kb * stride_sfa_k)  # [BM] fp32
        sfb = tl.load(sfb_ptrs + kb * stride_sfb_k)  # [BN] or scalar fp32
        blk = tl.dot(a, tl.trans(b))  # [BM, BN] fp32: at most 128 products per element
        if SFB_PER_ROW or BLOCK_N > BLOCK_K:
            acc += (blk * sfa[:, None]) * sfb[None, :]
        else:
            acc += blk * (sfa * sfb)[:, None]
        if not USE_TMA:
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def store_tile(
    out_ptr,
    acc,
    M,
    N,
    pid_m,
    pid_n,
    stride_om,
    stride_on,
    ACCUMULATE: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Store the fp32 ``acc [BLOCK_M, BLOCK_N]`` tile (pid_m, pid_n) into ``out`` (bf16 / fp32,
    any strides), masked to M x N; ``out +=`` when ACCUMULATE; int64 offsets when INT64."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if INT64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    if ACCUMULATE:
        acc += tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fp8_gemm_kernel(
    a_src,  # fp8 [M, K] pointer, or a TensorDescriptor with block [BLOCK_M, BLOCK_K]
    b_src,  # fp8 [N, K] pointer, or a TensorDescriptor with block [BLOCK_N, BLOCK_K]
    sfa_ptr,  # fp32 [M, ⌈K/128⌉], any strides
    sfb_ptr,  # fp32 [⌈N/128⌉, ⌈K/128⌉] (1D2D) or [N, ⌈K/128⌉] (1D1D), any strides
    out_ptr,  # bf16 / fp32 [M, N], any strides
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_sfa_m,
    stride_sfa_k,
    stride_sfb_n,
    stride_sfb_k,
    stride_om,
    stride_on,
    SFB_PER_ROW: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    EVEN_K: tl.constexpr,
    USE_TMA: tl.constexpr,
    PERSISTENT: tl.constexpr,
    INT64: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    if PERSISTENT:
        num_tiles = num_pid_m * num_pid_n
        for tile_id in tl.range(tl.program_id(0), num_tiles, tl.num_programs(0), flatten=True):
            pid_m, pid_n = tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = block_scaled_tile(
                a_src, b_src, sfa_ptr, sfb_ptr, M, N, K, pid_m, pid_n,
                stride_am, stride_ak, stride_bn, stride_bk,
                stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k,
                SFB_PER_ROW, EVEN_K, USE_TMA, INT64, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
            )  # fmt: skip
            store_tile(
                out_ptr, acc, M, N, pid_m, pid_n, stride_om, stride_on,
                ACCUMULATE, INT64, BLOCK_M, BLOCK_N,
            )  # fmt: skip
    else:
        pid_m, pid_n = tile_coords(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        acc = block_scaled_tile(
            a_src, b_src, sfa_ptr, sfb_ptr, M, N, K, pid_m, pid_n,
            stride_am, stride_ak, stride_bn, stride_bk,
            stride_sfa_m, stride_sfa_k, stride_sfb_n, stride_sfb_k,
            SFB_PER_ROW, EVEN_K, USE_TMA, INT64, BLOCK_M, BLOCK_N, BLOCK_K, NUM_STAGES,
        )  # fmt: skip
        store_tile(
            out_ptr, acc, M, N, pid_m, pid_n, stride_om, stride_on,
            ACCUMULATE, INT64, BLOCK_M, BLOCK_N,
        )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def is_interpreted() -> bool:
    """True when this module's kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return not isinstance(_fp8_gemm_kernel, triton.runtime.jit.JITFunction)


def _check_devices(a_fp8, sf_a, b_fp8, sf_b) -> None:
    device = a_fp8.device
    if device.type != "cuda" and not (is_interpreted() and device.type == "cpu"):
        raise ValueError(
            f"the Triton FP8 GEMM needs CUDA tensors, got {device} (CPU tensors run only under "
            "TRITON_INTERPRET=1; ptxtrain.gemm.ref runs anywhere)"
        )


def _max_offset(t: torch.Tensor) -> int:
    """Largest element offset of ``t`` from its data pointer."""
    return sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()) if size)


def _tma_ok(x: torch.Tensor) -> bool:
    """Can a host TensorDescriptor (TMA) load [rows, K] tiles of this fp8 operand?"""
    return x.stride(1) == 1 and x.stride(0) % 16 == 0 and x.data_ptr() % 16 == 0


@functools.cache
def _gluon_available(device_index: int) -> bool:
    """An sm_90 GPU (the Gluon kernel's WGMMA and TMA are Hopper's) and a Triton with Gluon."""
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return False
    try:
        from ptxtrain.gemm import gluon  # noqa: F401
    except ImportError:
        return False
    return True


def _gluon_shape_route(kind, m, n, k, device: torch.device, num_sms: int) -> bool:
    """The shape and device part of the route to the Gluon kernel: a CUDA sm_90 device, not
    under the interpreter, ``PTXTRAIN_TRITON_GLUON`` not ``0``, and
    :func:`ptxtrain.gemm.heuristics.prefers_gluon`."""
    if device.type != "cuda" or os.environ.get("PTXTRAIN_TRITON_GLUON", "1") == "0":
        return False
    if is_interpreted() or not prefers_gluon(m, n, k, kind, num_sms):
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _gluon_available(index)


def _gluon_runs(kind, a_fp8, b_fp8, out, m, n, k, num_sms) -> bool:
    """Does the default config route this GEMM to the warp-specialized Gluon kernel?
    (:func:`_gluon_shape_route`, TMA-loadable operands, and an ``out`` whose column offsets fit
    int32: the Gluon kernel's; this kernel switches to int64.)"""
    if not (_tma_ok(a_fp8) and _tma_ok(b_fp8)) or (n - 1) * abs(out.stride(1)) >= 2**31:
        return False
    return _gluon_shape_route(kind, m, n, k, a_fp8.device, num_sms)


def _effective_config(cfg: GemmConfig, a_fp8: torch.Tensor, b_fp8: torch.Tensor) -> GemmConfig:
    """``cfg``, with a TMA variant replaced by its pointer twin where TMA cannot load the data."""
    if cfg.uses_tma and not (_tma_ok(a_fp8) and _tma_ok(b_fp8)):
        twin = "persistent" if cfg.persistent else "tiled"
        return dataclasses.replace(cfg, variant=twin)
    return cfg


def _launch(
    kind: str,
    a_fp8: torch.Tensor,
    sf_a: torch.Tensor,
    b_fp8: torch.Tensor,
    sf_b: torch.Tensor,
    out: torch.Tensor,
    accumulate: bool,
    cfg: GemmConfig,
    num_sms: int,
) -> None:
    """Launch one GEMM with a validated config; M, N, K are all > 0."""
    m, k = a_fp8.shape
    n = b_fp8.shape[0]
    cfg = _effective_config(cfg, a_fp8, b_fp8)
    tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
    grid = (min(tiles, num_sms * cfg.programs_per_sm),) if cfg.persistent else (tiles,)
    if cfg.uses_tma:
        a_src = TensorDescriptor(a_fp8, [m, k], [a_fp8.stride(0), 1], [cfg.block_m, BLOCK_K])
        b_src = TensorDescriptor(b_fp8, [n, k], [b_fp8.stride(0), 1], [cfg.block_n, BLOCK_K])
    else:
        a_src, b_src = a_fp8, b_fp8
    int64 = max(_max_offset(t) for t in (a_fp8, b_fp8, sf_a, sf_b, out)) > _INT32_MAX
    _fp8_gemm_kernel[grid](
        a_src, b_src, sf_a, sf_b, out, m, n, k,
        a_fp8.stride(0), a_fp8.stride(1), b_fp8.stride(0), b_fp8.stride(1),
        sf_a.stride(0), sf_a.stride(1), sf_b.stride(0), sf_b.stride(1),
        out.stride(0), out.stride(1),
        SFB_PER_ROW=kind == "1d1d",
        ACCUMULATE=accumulate,
        EVEN_K=k % BLOCK_K == 0,
        USE_TMA=cfg.uses_tma,
        PERSISTENT=cfg.persistent,
        INT64=int64,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=BLOCK_K,
        GROUP_M=cfg.group_m,
        NUM_STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )  # fmt: skip


# Autotuning results: (kind, device, M bucket, N, K, out dtype, accumulate, TMA-able) → config.
_TUNED: dict[tuple, GemmConfig] = {}


def _time_once(fn: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=5, rep=20))
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _autotuned_config(kind, a_fp8, sf_a, b_fp8, sf_b, out, accumulate, num_sms) -> GemmConfig:
    m, k = a_fp8.shape
    n = b_fp8.shape[0]
    tma = _tma_ok(a_fp8) and _tma_ok(b_fp8)
    key = (kind, str(a_fp8.device), m_bucket(m), n, k, out.dtype, accumulate, tma, num_sms)
    if key in _TUNED:
        return _TUNED[key]
    variants = VARIANTS if tma else ("tiled", "persistent")  # TMA ones would run as these
    scratch = torch.empty_like(out)  # timing runs never touch the caller's output
    timings: list[tuple[float, int, GemmConfig]] = []
    errors: list[str] = []
    for i, cfg in enumerate(autotune_configs(m, n, k, kind, variants=variants)):
        run = functools.partial(
            _launch, kind, a_fp8, sf_a, b_fp8, sf_b, scratch, accumulate, cfg, num_sms
        )
        try:
            timings.append((_time_once(run, a_fp8.device), i, cfg))
        except (triton.runtime.errors.OutOfResources, triton.CompilationError) as err:
            errors.append(f"{cfg}: {type(err).__name__}: {err}")
    if not timings:
        raise RuntimeError(f"no Triton FP8 GEMM config compiled for {m=}, {n=}, {k=}: {errors}")
    best = min(timings)[2]
    _TUNED[key] = best
    return best


def fp8_gemm(
    kind: str,
    a: Operand,
    b: Operand,
    out: torch.Tensor | None,
    out_dtype: torch.dtype,
    accumulate: bool,
    config: GemmConfig | str | None,
    num_sms: int | None = None,
) -> torch.Tensor:
    """:func:`fp8_gemm_nt` (``kind="1d2d"``) or :func:`fp8_gemm_nt_1d1d` (``"1d1d"``) in one
    call with the same checks, in the argument order of :func:`ptxtrain.gemm.gluon.fp8_gemm`
    (``benchmarks/ab_triton.py`` runs both alike); ``num_sms`` overrides the device's SM count
    in the heuristic (tests pick another GPU's tiles).

    Args:
        kind: ``"1d2d"`` (sf_b [⌈N/128⌉, ⌈K/128⌉]) or ``"1d1d"`` (sf_b [N, ⌈K/128⌉]).
        a, b, out, out_dtype, accumulate, config: as :func:`fp8_gemm_nt_1d1d`
            (``accumulate`` with ``"1d1d"`` only, as there).

    Returns:
        D [M, N] of ``out_dtype`` (``out`` itself when given).

    Raises:
        ValueError: ``kind`` is neither ``"1d2d"`` nor ``"1d1d"``, or ``accumulate`` with
            ``"1d2d"``; else as the public functions.
    """
    if kind == "1d2d":
        if accumulate:
            raise ValueError("accumulate: the 1D2D GEMM has no accumulate mode, got True")
        m, n, k = validate_1d2d(a, b, out, out_dtype)
    elif kind == "1d1d":
        m, n, k = validate_1d1d(a, b, out, accumulate, out_dtype)
    else:
        raise ValueError(f"kind must be '1d2d' or '1d1d', got {kind!r}")
    return _gemm_checked(kind, a, b, out, out_dtype, accumulate, config, m, n, k, num_sms)


def _gemm_checked(kind, a, b, out, out_dtype, accumulate, config, m, n, k, num_sms=None):
    """:func:`fp8_gemm` after the contract's validation (the dispatcher validates once)."""
    (a_fp8, sf_a), (b_fp8, sf_b) = a, b
    if out is not None and any(st == 0 and sz > 1 for st, sz in zip(out.stride(), out.shape)):
        raise ValueError(
            f"out must not repeat memory (a broadcast view), got strides {out.stride()}"
        )
    if not (config is None or config == "autotune" or isinstance(config, GemmConfig)):
        raise TypeError(f"config must be a GemmConfig, 'autotune' or None, got {config!r}")
    _check_devices(a_fp8, sf_a, b_fp8, sf_b)

    if out is None:
        out = torch.empty((m, n), dtype=out_dtype, device=a_fp8.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not accumulate:
            out.zero_()
        return out
    if num_sms is None:
        num_sms = device_sms(a_fp8.device)
    if config is None and _gluon_runs(kind, a_fp8, b_fp8, out, m, n, k, num_sms):
        from ptxtrain.gemm import gluon

        cfg = gluon.ws_config(*gluon_tile(m, n, k, kind, num_sms), out.element_size())
        # (validated above and by _gluon_runs: fp8_gemm's checks without repeating them)
        return gluon.launch_checked(kind, a, b, out, accumulate, cfg, m, n, k)
    if config is None:
        cfg = select_config(m, n, k, kind, num_sms)
    elif config == "autotune":
        cfg = _autotuned_config(kind, a_fp8, sf_a, b_fp8, sf_b, out, accumulate, num_sms)
    else:
        cfg = config
    if a_fp8.device.type == "cuda":
        with torch.cuda.device(a_fp8.device):
            _launch(kind, a_fp8, sf_a, b_fp8, sf_b, out, accumulate, cfg, num_sms)
    else:
        _launch(kind, a_fp8, sf_a, b_fp8, sf_b, out, accumulate, cfg, num_sms)
    return out


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def fp8_gemm_nt(
    a: Operand,
    b: Operand,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    config: GemmConfig | str | None = None,
) -> torch.Tensor:
    """``D = A · Bᵀ`` with A scaled per 1x128 tile and B per 128x128 block ("1D2D"), in Triton.

    Args:
        a: ``(a_fp8, sf_a)``: a_fp8 [M, K] float8_e4m3fn (K-major is fastest; any strides work);
            sf_a [M, ⌈K/128⌉] float32, row-major or MN-major (strides (1, M)) or any strides.
        b: ``(b_fp8, sf_b)``: b_fp8 [N, K] float8_e4m3fn; sf_b [⌈N/128⌉, ⌈K/128⌉] float32.
        out: optional [M, N] bf16/fp32 output written in place, any strides (its dtype wins).
        out_dtype: torch.bfloat16 or torch.float32 when ``out`` is None.
        config: None (the heuristic, :func:`ptxtrain.gemm.heuristics.select_config`), a
            :class:`GemmConfig`, or ``"autotune"`` (time the candidates once per shape bucket).

    Returns:
        D [M, N] of ``out_dtype`` (``out`` itself when given). Any M, N, K, 0 included; partial
        sums are promoted to FP32 with ``sf_a * sf_b`` every 128 elements of K.

    Raises:
        TypeError: operands not ``(float8_e4m3fn, float32)`` pairs, bad ``out_dtype``/``config``.
        ValueError: ranks, mismatched K, scale shapes or ``out`` shape wrong; tensors on different
            devices, or not on a CUDA device (CPU only under ``TRITON_INTERPRET=1``).

    Source: DeepGEMM ``fp8_gemm_nt``; DeepSeek-V3 report §3.3; docs/design.md §1-2.
    """
    return fp8_gemm("1d2d", a, b, out, out_dtype, False, config)


def fp8_gemm_nt_1d1d(
    a: Operand,
    b: Operand,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
    config: GemmConfig | str | None = None,
) -> torch.Tensor:
    """``D (+)= A · Bᵀ`` with both operands scaled per 1x128 tile along K ("1D1D", wgrad).

    Args:
        a: ``(a_fp8, sf_a)``: a_fp8 [M, K] float8_e4m3fn; sf_a [M, ⌈K/128⌉] float32, any strides.
        b: ``(b_fp8, sf_b)``: b_fp8 [N, K] float8_e4m3fn; sf_b [N, ⌈K/128⌉] float32, any strides.
        out: optional [M, N] float32 or bfloat16 output, any strides (its dtype wins).
        accumulate: add into ``out`` (which must then be given, float32) instead of
            overwriting it.
        out_dtype: torch.float32 (default) or torch.bfloat16 when ``out`` is None.
        config: as in :func:`fp8_gemm_nt`.

    Returns:
        D [M, N] in ``out_dtype`` (``out`` itself when given).

    Raises:
        TypeError / ValueError: as :func:`fp8_gemm_nt`; ``accumulate=True`` without ``out`` or
        with a bfloat16 ``out``.

    Source: DeepGEMM ``fp8_gemm_nt`` 1D1D / ``wgrad_gemm_fp8_fp8_fp32_nt``; docs/design.md §2.
    """
    return fp8_gemm("1d1d", a, b, out, out_dtype, accumulate, config)


def default_kernel(kind: str, m: int, n: int, k: int, device: torch.device | None = None) -> str:
    """Which kernel and tile the default config runs for this shape on ``device`` (default:
    the current CUDA device, else the CPU, where the interpreter runs the plain Triton kernel
    with an H200's config), with TMA-loadable operands and a row-major output, e.g.
    ``"gluon 256x128 s3 b2"`` (stages, staging buffers; ``" split 8x14"``: 8 tiles cut into
    14 K-slices each, ``heuristics.gluon_split_k``) or ``"triton 64x128 s3 tma"`` (shown
    by ``ptxtrain bench gemm``).

    Raises:
        TypeError / ValueError: as :func:`ptxtrain.gemm.heuristics.select_config`.
    """
    if device is None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    num_sms = device_sms(device)
    if _gluon_shape_route(kind, m, n, k, device, num_sms):
        from ptxtrain.gemm import gluon

        bm, bn = gluon_tile(m, n, k, kind, num_sms)
        cfg = gluon.ws_config(bm, bn, 2 if kind == "1d2d" else 4)
        tiles = ceil_div(m, bm) * ceil_div(n, bn)
        whole, splits = (
            gluon_split_k(tiles, num_sms, ceil_div(k, BLOCK_K), cfg.split_max)
            if cfg.split_k
            else (tiles, 1)
        )
        split = f" split {tiles - whole}x{splits}" if splits > 1 else ""
        return f"gluon {bm}x{bn} s{cfg.num_stages} b{cfg.store_buffers}{split}"
    cfg = select_config(m, n, k, kind, num_sms)
    return f"triton {cfg.block_m}x{cfg.block_n} s{cfg.num_stages} {cfg.variant}"


def fp8_gemm_nt_unchecked(a, b, out, out_dtype):
    """:func:`fp8_gemm_nt` without its argument checks (the entry :mod:`ptxtrain.gemm`'s
    dispatcher calls, see :func:`ptxtrain.gemm.ref.fp8_gemm_nt_unchecked`); the heuristic's
    config; still raises ValueError for tensors not on CUDA (the CPU only under
    ``TRITON_INTERPRET=1``)."""
    m, k = a[0].shape
    return _gemm_checked("1d2d", a, b, out, out_dtype, False, None, m, b[0].shape[0], k)


def fp8_gemm_nt_1d1d_unchecked(a, b, out, accumulate, out_dtype):
    """:func:`fp8_gemm_nt_1d1d` without its argument checks (the dispatcher's entry, see
    :func:`ptxtrain.gemm.ref.fp8_gemm_nt_1d1d_unchecked`); device errors as
    :func:`fp8_gemm_nt_unchecked`."""
    m, k = a[0].shape
    return _gemm_checked("1d1d", a, b, out, out_dtype, accumulate, None, m, b[0].shape[0], k)


def _compile_for_sm90(
    kind: str = "1d2d",
    config: GemmConfig | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    even_k: bool = True,
    accumulate: bool = False,
):
    """Compile the kernel for sm_90a without a GPU; returns Triton's ``CompiledKernel``.

    ``.asm["ptx"]``, ``.asm["cubin"]``, ``.n_regs`` / ``.n_spills`` (or ``.metadata``) allow
    instruction- and register-level checks on a CPU-only machine. Not under the interpreter.
    """
    if is_interpreted():
        raise RuntimeError("_compile_for_sm90 needs the compiled (not interpreted) kernel")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = config or GemmConfig()
    elem = {torch.bfloat16: "bf16", torch.float32: "fp32"}[out_dtype]
    if cfg.uses_tma:
        a_ty = f"tensordesc<fp8e4nv[{cfg.block_m}, {BLOCK_K}]>"
        b_ty = f"tensordesc<fp8e4nv[{cfg.block_n}, {BLOCK_K}]>"
    else:
        a_ty = b_ty = "*fp8e4nv"
    signature = {
        "a_src": a_ty,
        "b_src": b_ty,
        "sfa_ptr": "*fp32",
        "sfb_ptr": "*fp32",
        "out_ptr": f"*{elem}",
        **{name: "i32" for name in ("M", "N", "K")},
        **{
            f"stride_{s}": "i32"
            for s in ("am", "ak", "bn", "bk", "sfa_m", "sfa_k", "sfb_n", "sfb_k", "om", "on")
        },
    }
    constexprs = {
        "SFB_PER_ROW": kind == "1d1d",
        "ACCUMULATE": accumulate,
        "EVEN_K": even_k,
        "USE_TMA": cfg.uses_tma,
        "PERSISTENT": cfg.persistent,
        "INT64": False,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": BLOCK_K,
        "GROUP_M": cfg.group_m,
        "NUM_STAGES": cfg.num_stages,
        # K-major operands: unit strides along K, as the launcher's specialization would see.
        "stride_ak": 1,
        "stride_bk": 1,
        "stride_on": 1,
    }
    for name in ("stride_ak", "stride_bk", "stride_on"):
        signature[name] = "constexpr"
    # 16-divisible pointers, sizes and row strides, as the launcher sees for DeepSeek-V3 shapes.
    arg_names = _fp8_gemm_kernel.arg_names
    aligned = ("a_src", "b_src", "sfa_ptr", "sfb_ptr", "out_ptr", "N", "K")
    aligned += ("stride_am", "stride_bn", "stride_om")
    attrs = {(arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    if cfg.uses_tma:  # descriptors carry no divisibility attribute
        del attrs[(arg_names.index("a_src"),)], attrs[(arg_names.index("b_src"),)]
    src = ASTSource(fn=_fp8_gemm_kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
