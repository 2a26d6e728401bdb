"""Triton FP8 quantizers, bit-exact twins of :mod:`ptxtrain.quant.ref` (docs/design.md §1, §3).

Design note.

- Two kernels. ``_quant_1x_kernel`` does the 1x128 and 128x1 tiles. A program owns a
  ``[BLOCK_M, BLOCK_K]`` tile of ``x`` (masked, zeros outside ``[M, K]``) and walks it
  ``SUB_K`` columns at a time; each chunk is loaded once into registers and upcast to fp32,
  and, as its ``ROW`` / ``COL`` flags ask, it is quantized row-wise (1 x ``block`` tiles; needs
  ``BLOCK_K == block``) and column-wise (``block`` x 1 tiles, whose amax ``axis=0`` is
  complete in every chunk since ``BLOCK_M == block``), the latter stored transposed through
  ``tl.trans``. With both flags (the fused kernel) a program owns a 128x128 tile walked in
  64-column chunks; its row amaxes need the whole 128 columns first, so it makes a first pass
  over the chunks for them and re-reads the tile from L1/L2 in the second. On the GPU that
  fused kernel is slower (0.40 of copy bandwidth) than the two single-flag kernels run
  one after the other (0.50), so ``per_token_cast_to_fp8_both`` runs those there (see
  ``_config_1x``); the fused one serves the interpreter and explicit configs.
  ``per_token_cast_to_fp8_t`` uses narrow 128x64 tiles (one chunk). The grid is
  ``(⌈M/BLOCK_M⌉, ⌈K/BLOCK_K⌉)``, M on axis 0 (CUDA allows 2^31-1 programs there, 65535 on
  axis 1). ``_quant_block_kernel`` does 128x128 weight blocks, one block per program.
- amax from integer bits: ``|x|`` is ``bits(x) & 0x7FFFFFFF``, and for non-negative floats the
  integer order is the float order with every NaN above +inf. So an int32 ``tl.max`` gives the
  tile's fp32 amax, NaN if the tile holds one and inf if it holds an inf (like ``torch.amax``),
  where a float ``tl.max`` would skip NaNs (maxnum on the GPU, ``nanmax`` in the interpreter);
  a NaN amax is made the canonical quiet NaN 0x7FC00000, which is what ``torch.amax`` returns.
  The amax clamp (``AMAX_EPS``) is an int32 maximum with its fp32 bits, so NaN stays NaN.
- Division, bit-exact with the reference's IEEE ``x / sf``: ``sf = amax / 448`` uses
  ``tl.div_rn`` (``div.rn.f32``; Triton's ``/`` on fp32 is the approximate ``div.full.f32``).
  The per-element ``x / sf`` is ``q0 = x·y`` with ``y = RN(1/sf)`` (one ``div_rn`` per tile
  row/column) plus one correction with the exact FMA residual, ``RN(q0 - (q0·sf - x)·y)``,
  which is the correctly rounded quotient (Markstein's theorem): 4 instructions per element
  instead of ~12. A tile whose scale is inf/NaN takes ``div_rn`` instead (uniform branch), so
  non-finite inputs give the reference's NaNs. ``pow2_scale`` rounds ``sf`` up to a power of two
  on its bits (add 2^23-1, keep the exponent), leaving inf/NaN as they are.
- fp32 → e4m3 is ``.to(tl.float8e4nv)``: round to nearest even, and on sm_90 Triton emits
  ``cvt.rn.satfinite.e4m3x2.f32`` (saturates to ±448, NaN stays NaN), the semantics of torch's
  cast that the reference uses; no explicit clamp is needed. (The compile-only test checks the
  instruction.) Under ``TRITON_INTERPRET=1`` the interpreter's own casts are not exact: tests
  apply :func:`ptxtrain.testing.triton_interp.apply_interpreter_patch`.
- Offsets are int64 (tensors past 2^31 elements); x needs ``stride(-1) == 1`` (other layouts are
  copied first) so loads vectorize to 128 bits along K.

Scales: ``sf_layout="row"`` gives row-major scales (the reference's layout); ``"mn_major"`` gives
the same values in an MN-major tensor: shape ``[rows, ⌈cols/128⌉]``, strides ``(1, rows_pad)``
with ``rows_pad = 4·⌈rows/4⌉`` (TMA wants 16-byte aligned columns), the layout of DeepGEMM's
``get_col_major_tma_aligned_tensor`` and of the LHS scales of ``torch._scaled_mm``
(docs/design.md §2). The padding entries are not allocated past the last column and are not written.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ptxtrain._checks import HP_DTYPES, ceil_div, check_tensor
from ptxtrain.quant.ref import (
    AMAX_EPS,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    SF_LAYOUTS,
    check_block,
    check_sf_layout,
    empty_sf,
)

__all__ = [
    "SF_LAYOUTS",
    "per_block_cast_to_fp8",
    "per_block_cast_to_fp8_both",
    "per_token_cast_to_fp8",
    "per_token_cast_to_fp8_both",
    "per_token_cast_to_fp8_t",
]


# Bits of fp32(AMAX_EPS): clamping |x| bits with an integer maximum keeps NaN (bits above inf).
_EPS_BITS = tl.constexpr(struct.unpack("<i", struct.pack("<f", AMAX_EPS))[0])
_FP8_MAX = tl.constexpr(FP8_MAX)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def abs_bits(x):
    """fp32 tile → int32 bits of |x| (order-preserving for non-negative floats, NaN on top)."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def scale_from_amax_bits(amax_bits, POW2: tl.constexpr):
    """int32 bits of a tile's amax → fp32 dequantization factor ``sf`` (as the reference)."""
    # Any NaN becomes the canonical quiet NaN, as torch.amax returns it (payloads are dropped).
    amax_bits = tl.where(amax_bits > 0x7F800000, 0x7FC00000, amax_bits)
    amax = tl.maximum(amax_bits, _EPS_BITS).to(tl.float32, bitcast=True)
    sf = tl.div_rn(amax, _FP8_MAX)
    if POW2:
        bits = sf.to(tl.int32, bitcast=True)
        # sf > 0: adding 2^23 - 1 carries into the exponent unless the mantissa is zero.
        up = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
        sf = tl.where((bits & 0x7F800000) != 0x7F800000, up, sf)
    return sf


@triton.jit
def _is_finite(sf):
    return (sf.to(tl.int32, bitcast=True) & 0x7F800000) != 0x7F800000


@triton.jit
def reciprocal(sf):
    """``RN(1/sf)`` (``div.rn``), the factor of the fast division in :func:`cast_e4m3`."""
    return tl.div_rn(1.0, sf)


@triton.jit
def cast_e4m3(x, sf, y, all_finite):
    """``RN_e4m3(RN_fp32(x / sf))``: the reference's IEEE division, then a saturating RNE cast.

    ``y`` is ``RN(1/sf)``. Where every ``sf`` of the tile is finite (the uniform ``all_finite``
    branch), the quotient is ``q0 = x·y`` corrected once with the exact residual ``q0·sf - x``
    (an FMA): by Markstein's theorem ``RN(q0 - (q0·sf - x)·y)`` is the correctly rounded
    quotient, except below 2^-126 (fp32 subnormals), where it may be 1 subnormal ulp off, which
    the e4m3 cast (smallest step 2^-9) maps to the same ±0. 4 FP instructions per element
    instead of ``div.rn``'s ~12. The signs are placed so that ``x = ±0`` gives ``±0`` (Triton's
    unary minus is ``0 - v``, which maps -0 to +0). Tiles with an inf/NaN scale take ``div_rn``,
    which gives the reference's NaNs.
    """
    if all_finite:
        q0 = x * y
        q = tl.fma(tl.fma(q0, sf, -x), -y, q0)
    else:
        q = tl.div_rn(x, sf)
    return q.to(tl.float8e4nv)


@triton.jit
def all_finite(sf):
    """Whether every fp32 scale of the tile ``sf`` is finite (uniform, for :func:`cast_e4m3`)."""
    return tl.min(_is_finite(sf).to(tl.int32), axis=0) == 1


@triton.jit
def quant_rows(x, POW2: tl.constexpr):
    """1 x C quantization of an fp32 tile ``[R, C]``, one scale per row (C = 128: the 1x128
    tiles): ``(e4m3 tile, fp32 scales [R])``."""
    sf = scale_from_amax_bits(tl.max(abs_bits(x), axis=1), POW2)
    return cast_e4m3(x, sf[:, None], reciprocal(sf)[:, None], all_finite(sf)), sf


@triton.jit
def _quant_1x_kernel(
    x_ptr,
    q_ptr,
    sf_ptr,
    qt_ptr,
    sft_ptr,
    M,
    K,
    stride_xm,
    stride_qm,
    stride_sf_m,
    stride_sf_k,
    stride_qt_k,
    stride_sft_k,
    stride_sft_m,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SUB_K: tl.constexpr,
    ROW: tl.constexpr,
    COL: tl.constexpr,
    POW2: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rows64 = rows.to(tl.int64)
    row_ok = rows < M
    col0 = pid_k * BLOCK_K
    TWO_PASS: tl.constexpr = ROW and SUB_K < BLOCK_K
    if TWO_PASS:
        # Pass 1: the row amax over the BLOCK_K columns, SUB_K at a time (few live registers;
        # pass 2 reads the tile again, from L1/L2).
        amax = tl.zeros([BLOCK_M], dtype=tl.int32)
        for j in range(BLOCK_K // SUB_K):
            cols = col0 + j * SUB_K + tl.arange(0, SUB_K)
            mask = row_ok[:, None] & (cols < K)[None, :]
            ptrs = x_ptr + rows64[:, None] * stride_xm + cols.to(tl.int64)[None, :]
            x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(abs_bits(x), axis=1))
        sf = scale_from_amax_bits(amax, POW2)  # [BM]
        y = reciprocal(sf)
        finite = all_finite(sf)
        sf_ptrs = sf_ptr + rows64 * stride_sf_m + pid_k.to(tl.int64) * stride_sf_k
        tl.store(sf_ptrs, sf, mask=row_ok)
    # Pass 2 (the only one unless TWO_PASS): quantize SUB_K columns at a time.
    for j in range(BLOCK_K // SUB_K):
        cols = col0 + j * SUB_K + tl.arange(0, SUB_K)  # [SK]
        cols64 = cols.to(tl.int64)
        col_ok = cols < K
        mask = row_ok[:, None] & col_ok[None, :]  # [BM, SK]
        ptrs = x_ptr + rows64[:, None] * stride_xm + cols64[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if ROW:
            if TWO_PASS:
                q = cast_e4m3(x, sf[:, None], y[:, None], finite)
            else:  # the chunk is the whole 1 x BLOCK_K tile
                q, sf_row = quant_rows(x, POW2)
                sf_ptrs = sf_ptr + rows64 * stride_sf_m + pid_k.to(tl.int64) * stride_sf_k
                tl.store(sf_ptrs, sf_row, mask=row_ok)
            tl.store(q_ptr + rows64[:, None] * stride_qm + cols64[None, :], q, mask=mask)
        if COL:  # BLOCK_M x 1 tiles, complete in the chunk; xt [K, M] written transposed
            sft = scale_from_amax_bits(tl.max(abs_bits(x), axis=0), POW2)  # [SK]
            qt = tl.trans(cast_e4m3(x, sft[None, :], reciprocal(sft)[None, :], all_finite(sft)))
            qt_ptrs = qt_ptr + cols64[:, None] * stride_qt_k + rows64[None, :]
            tl.store(qt_ptrs, qt, mask=tl.trans(mask))
            sft_ptrs = sft_ptr + cols64 * stride_sft_k + pid_m.to(tl.int64) * stride_sft_m
            tl.store(sft_ptrs, sft, mask=col_ok)


@triton.jit
def _quant_block_kernel(
    w_ptr,
    q_ptr,
    sf_ptr,
    qt_ptr,
    N,
    K,
    stride_wn,
    stride_qn,
    stride_sf_n,
    stride_qt_k,
    BLOCK: tl.constexpr,
    POW2: tl.constexpr,
    TRANS: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # [B]
    cols = (pid_k * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)  # [B]
    mask = (rows < N)[:, None] & (cols < K)[None, :]  # [B, B]
    w = tl.load(w_ptr + rows[:, None] * stride_wn + cols[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    amax_bits = tl.max(tl.max(abs_bits(w), axis=1), axis=0)  # scalar
    sf = scale_from_amax_bits(amax_bits, POW2)
    q = cast_e4m3(w, sf, reciprocal(sf), _is_finite(sf))
    tl.store(q_ptr + rows[:, None] * stride_qn + cols[None, :], q, mask=mask)
    if TRANS:  # the block of wᵀ is this block transposed: same bits
        tl.store(qt_ptr + cols[:, None] * stride_qt_k + rows[None, :], tl.trans(q), tl.trans(mask))
    tl.store(sf_ptr + pid_n.to(tl.int64) * stride_sf_n + pid_k, sf)


# --------------------------------------------------------------------------------------------
# Launch configuration (pure functions; the lead's benchmark tunes these)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantConfig:
    """Tile of one launch of the 1x128 / 128x1 quantizer kernel (:func:`quant_1x_unchecked`'s
    ``config``; the default comes from the measured rules of ``_config_1x``): ``block_m`` x
    ``block_k`` elements per program, quantized ``sub_k`` columns at a time, on ``num_warps``
    warps. 1x128 tiles need ``block_k == block``, 128x1 tiles ``block_m == block``; all powers
    of two, ``sub_k`` dividing ``block_k``. Not checked: ``benchmarks/sweep_quant.py`` compares
    each config's output bit for bit with the default's."""

    block_m: int  # tile rows (tokens) per program
    block_k: int  # tile columns (channels) per program
    sub_k: int  # columns quantized per step (divides block_k)
    num_warps: int


def _config_1x(
    m: int, block: int, *, row: bool, col: bool, interpreted: bool = False
) -> QuantConfig:
    """Tile for ``_quant_1x_kernel``.

    1x128 tiles need ``block_k == block``; 128x1 tiles need ``block_m == block``. Without the
    1x128 tiles a narrow ``block_k`` keeps each program small (many programs in flight); with
    both, the program walks its ``block`` columns ``sub_k`` at a time. The CPU interpreter's
    cost grows with programs x steps, so there it takes whole ``block`` x ``block`` tiles.
    """
    if interpreted and col:
        return QuantConfig(block_m=block, block_k=block, sub_k=block, num_warps=4)
    # Measured on an H200 at 4096 / 8192 x 7168 and 4096 x 2112 bf16, fraction of copy bandwidth
    # (benchmarks/sweep_quant.py):
    # 1x128 at block_m 32: 0.76-0.86 (16: same, 64: 0.71-0.84, 128 with 8 warps: 0.69-0.81);
    # 128x1 at block_k 64: 0.62-0.67 (32: 0.58-0.60, 128: 0.43-0.45, 8 warps slower); fused
    # both at sub_k 64: 0.40 (32: 0.27-0.35, 128: 0.34). Transposing the 16-bit input instead of
    # the fp8 output changed nothing; TMA loads/stores through tensor descriptors were slower
    # (0.25-0.57). So per_token_cast_to_fp8_both runs the 1x128 and the 128x1 kernels one after
    # the other on the GPU (0.50-0.53: reading x twice costs less than the fused kernel's
    # transposed stores); the fused kernel stays for the interpreter and explicit configs.
    if row and col:
        return QuantConfig(block_m=block, block_k=block, sub_k=min(64, block), num_warps=4)
    if col:
        return QuantConfig(block_m=block, block_k=min(64, block), sub_k=min(64, block), num_warps=4)
    block_m = min(32, max(16, triton.next_power_of_2(max(m, 1))))
    return QuantConfig(block_m=block_m, block_k=block, sub_k=block, num_warps=4)


# --------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------


def _kernels_interpreted() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1`` (they run on the CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_quant_1x_kernel, InterpretedFunction)


def _check_triton_block(block: object) -> int:
    check_block(block)
    if block & (block - 1) or not 16 <= block <= 128:
        raise ValueError(
            f"block must be a power of two between 16 and 128 for the Triton kernels, got {block}"
        )
    return block


def _check_input(name: str, x: object, block: object) -> tuple[torch.Tensor, int]:
    """Validate like the reference, plus the device; return x with ``stride(-1) == 1``."""
    check_tensor(name, x, dtypes=HP_DTYPES, ndim=2)
    _check_triton_block(block)
    if x.device.type != "cuda" and not _kernels_interpreted():
        raise ValueError(
            f"{name} must be a CUDA tensor for the Triton kernels, got device {x.device}; to run "
            "them on the CPU set TRITON_INTERPRET=1 before importing ptxtrain.quant.triton, or use "
            "ptxtrain.quant.ref"
        )
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x, block


def quant_1x_unchecked(x, block, pow2_scale, sf_layout, *, row: bool, col: bool, config=None):
    """The launcher behind :func:`per_token_cast_to_fp8` (``row``), :func:`per_token_cast_to_fp8_t`
    (``col``) and :func:`per_token_cast_to_fp8_both` (both), without their checks.

    Args:
        x: [M, K] float32 / bfloat16 / float16 with ``stride(1) == 1``, on CUDA (or the CPU
            under ``TRITON_INTERPRET=1``), as the public functions pass it.
        block: tile length, a power of two in [16, 128].
        pow2_scale: round each scale up to a power of two.
        sf_layout: ``"row"`` or ``"mn_major"`` (already checked).
        row, col: write the 1 x ``block`` quantization of ``x`` and / or the ``block`` x 1 one
            stored transposed (at least one).
        config: a :class:`QuantConfig` overriding the measured tile (``benchmarks/sweep_quant.py``;
            with ``row`` and ``col`` it also forces the fused kernel), or None.

    Returns:
        ``(x_fp8 [M, K], sf [M, ⌈K/block⌉])`` with ``row``, then ``(xt_fp8 [K, M],
        sf_t [K, ⌈M/block⌉])`` with ``col``: e4m3 and float32, bit-identical to the reference.
    """
    m, k = x.shape
    dev = x.device
    interpreted = _kernels_interpreted()
    if row and col and config is None and not interpreted and m > 0 and k > 0:
        # Two kernels beat the fused one on the GPU (see _config_1x).
        x_fp8, sf_x = quant_1x_unchecked(x, block, pow2_scale, sf_layout, row=True, col=False)
        xt_fp8, sf_t = quant_1x_unchecked(x, block, pow2_scale, sf_layout, row=False, col=True)
        return x_fp8, sf_x, xt_fp8, sf_t
    q = sf = qt = sft = None
    if row:
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=dev)
        sf = empty_sf(m, ceil_div(k, block), sf_layout, dev)
    if col:
        qt = torch.empty((k, m), dtype=FP8_DTYPE, device=dev)
        sft = empty_sf(k, ceil_div(m, block), sf_layout, dev)
    if m > 0 and k > 0:
        cfg = config or _config_1x(m, block, row=row, col=col, interpreted=interpreted)
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(k, cfg.block_k))
        _quant_1x_kernel[grid](
            x,
            q if row else x,  # unused pointers get x: never dereferenced
            sf if row else x,
            qt if col else x,
            sft if col else x,
            m,
            k,
            x.stride(0),
            q.stride(0) if row else 0,
            sf.stride(0) if row else 0,
            sf.stride(1) if row else 0,
            qt.stride(0) if col else 0,
            sft.stride(0) if col else 0,
            sft.stride(1) if col else 0,
            BLOCK_M=cfg.block_m,
            BLOCK_K=cfg.block_k,
            SUB_K=cfg.sub_k,
            ROW=row,
            COL=col,
            POW2=bool(pow2_scale),
            num_warps=cfg.num_warps,
        )
    return tuple(t for t in (q, sf, qt, sft) if t is not None)


def per_token_cast_to_fp8(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`ptxtrain.quant.ref.per_token_cast_to_fp8` (1 x ``block`` tiles).

    Args:
        x: [M, K] float32 / bfloat16 / float16 on CUDA (or on the CPU under
            ``TRITON_INTERPRET=1``). Any M and K, 0 included; ``stride(-1) != 1`` is copied first.
        block: tile width along K; a power of two in [16, 128] (128 in the DeepSeek recipe).
        pow2_scale: round each ``sf`` up to a power of two.
        sf_layout: ``"row"`` (row-major, as the reference) or ``"mn_major"`` (strides
            ``(1, 4·⌈M/4⌉)``, the LHS-scale layout of DeepGEMM and ``torch._scaled_mm``).

    Returns:
        ``(x_fp8, sf)``: x_fp8 [M, K] float8_e4m3fn, row-major; sf [M, ⌈K/block⌉] float32 in
        ``sf_layout``. Bit-identical to the reference.

    Raises:
        TypeError: ``x`` is not a float32/bfloat16/float16 tensor.
        ValueError: ``x`` is not 2-D, is not on CUDA while the interpreter is off, ``block`` is
            not a power of two in [16, 128], or ``sf_layout`` is unknown.

    Source: DeepSeek-V3 report §3.3; docs/design.md §1.
    """
    x, block = _check_input("x", x, block)
    sf_layout = check_sf_layout(sf_layout)
    return quant_1x_unchecked(x, block, pow2_scale, sf_layout, row=True, col=False)


def per_token_cast_to_fp8_t(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`ptxtrain.quant.ref.per_token_cast_to_fp8_t` (``block`` x 1 tiles).

    Args:
        x: [M, K], as :func:`per_token_cast_to_fp8`.
        block: tile height along M.
        pow2_scale: as :func:`per_token_cast_to_fp8`.
        sf_layout: layout of ``sf_t``: ``"row"`` or ``"mn_major"`` (strides ``(1, 4·⌈K/4⌉)``).

    Returns:
        ``(xt_fp8, sf_t)``: xt_fp8 [K, M] float8_e4m3fn, row-major (xᵀ, K-major for the wgrad
        NT GEMM); sf_t [K, ⌈M/block⌉] float32. Bit-identical to the reference.

    Raises:
        TypeError / ValueError: as :func:`per_token_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 (wgrad operands quantized along tokens); docs/design.md §1.
    """
    x, block = _check_input("x", x, block)
    sf_layout = check_sf_layout(sf_layout)
    return quant_1x_unchecked(x, block, pow2_scale, sf_layout, row=False, col=True)


def per_token_cast_to_fp8_both(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`per_token_cast_to_fp8` and :func:`per_token_cast_to_fp8_t` of one tensor.

    On the GPU the two kernels run one after the other (x is read twice): faster than
    the fused one-read kernel, whose transposed stores run at 0.40 of copy bandwidth (module
    note). Under the interpreter the fused kernel runs.

    Args:
        x, block, pow2_scale: as :func:`per_token_cast_to_fp8`.
        sf_layout: layout of both ``sf`` and ``sf_t`` (``"row"`` or ``"mn_major"``).

    Returns:
        ``(x_fp8 [M, K], sf [M, ⌈K/block⌉], xt_fp8 [K, M], sf_t [K, ⌈M/block⌉])``,
        bit-identical to :func:`ptxtrain.quant.ref.per_token_cast_to_fp8_both`.

    Raises:
        TypeError / ValueError: as :func:`per_token_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 (the transposed re-quantization it names as a memory-traffic
    cost); docs/design.md §1.
    """
    x, block = _check_input("x", x, block)
    sf_layout = check_sf_layout(sf_layout)
    return quant_1x_unchecked(x, block, pow2_scale, sf_layout, row=True, col=True)


def per_block_cast_to_fp8(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`ptxtrain.quant.ref.per_block_cast_to_fp8` (``block``² blocks).

    Args:
        w: [N, K] float32 / bfloat16 / float16 on CUDA (or the CPU under ``TRITON_INTERPRET=1``);
            any N and K, 0 included.
        block: block edge; a power of two in [16, 128].
        pow2_scale: round each ``sf`` up to a power of two.

    Returns:
        ``(w_fp8, sf)``: w_fp8 [N, K] float8_e4m3fn, row-major; sf [⌈N/block⌉, ⌈K/block⌉]
        float32, row-major. Bit-identical to the reference.

    Raises:
        TypeError / ValueError: as :func:`per_token_cast_to_fp8` (naming ``w``).

    Source: DeepSeek-V3 report §3.3; docs/design.md §1.
    """
    w, block = _check_input("w", w, block)
    return quant_block_unchecked(w, block, pow2_scale, transposed=False)


def quant_block_unchecked(w, block, pow2_scale, *, transposed: bool, num_warps: int = 8):
    """The launcher behind :func:`per_block_cast_to_fp8` (and ``_both`` with ``transposed``),
    without their checks: ``w`` [N, K] as :func:`quant_1x_unchecked`'s ``x``, ``block`` a power
    of two in [16, 128]; ``num_warps`` per ``block`` x ``block`` program (8 unless swept by
    ``benchmarks/sweep_quant.py``).

    Returns:
        ``(w_fp8 [N, K], sf [⌈N/block⌉, ⌈K/block⌉])``, plus ``(wt_fp8 [K, N],
        sf_t [⌈K/block⌉, ⌈N/block⌉])`` with ``transposed``; e4m3 and float32, row-major.
    """
    n, k = w.shape
    q = torch.empty((n, k), dtype=FP8_DTYPE, device=w.device)
    qt = torch.empty((k, n), dtype=FP8_DTYPE, device=w.device) if transposed else None
    sf = torch.empty((ceil_div(n, block), ceil_div(k, block)), dtype=torch.float32, device=w.device)
    if n > 0 and k > 0:
        grid = (ceil_div(n, block), ceil_div(k, block))
        _quant_block_kernel[grid](
            w,
            q,
            sf,
            qt if transposed else q,  # unused pointer when not transposed: never dereferenced
            n,
            k,
            w.stride(0),
            q.stride(0),
            sf.stride(0),
            qt.stride(0) if transposed else 0,
            BLOCK=block,
            POW2=bool(pow2_scale),
            TRANS=transposed,
            num_warps=num_warps,
        )
    if transposed:
        return q, sf, qt, sf.t().contiguous()
    return q, sf


def per_block_cast_to_fp8_both(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`ptxtrain.quant.ref.per_block_cast_to_fp8_both`: one read of ``w``
    writes the 128x128 quantization of ``w`` and, transposed in registers, that of ``wᵀ``.

    Args:
        w, block, pow2_scale: as :func:`per_block_cast_to_fp8`.

    Returns:
        ``(w_fp8 [N, K], sf [⌈N/block⌉, ⌈K/block⌉], wt_fp8 [K, N], sf_t [⌈K/block⌉, ⌈N/block⌉])``,
        row-major, bit-identical to the reference.

    Raises:
        TypeError / ValueError: as :func:`per_block_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 (Fprop reads W, Dgrad reads Wᵀ); docs/design.md §1.
    """
    w, block = _check_input("w", w, block)
    return quant_block_unchecked(w, block, pow2_scale, transposed=True)
