"""Triton kernels of the fused training ops of :mod:`ptxtrain.nn.functional` (no autograd here).

Design note (issue 33 item 8: the SwiGLU, norms and dtype casts fused into neighbouring kernels).

Every kernel loads its inputs in their dtype, computes in fp32 and stores in the output's dtype:
the casts that the unfused graph runs as separate copies (RMSNorm's and RoPE's fp32 round trips)
happen in registers. fp contraction is off (``enable_fp_fusion=False``) so each product is rounded
before it is added, the order of :mod:`ptxtrain.nn.functional`'s torch references; what still
differs from them is named at each kernel (``exp`` and reduction orders).

- SwiGLU: ``out = silu(a)·b`` elementwise over flat, contiguous ``a``, ``b``; the backward reads
  ``g, a, b`` once and writes ``da, db`` (the product is not kept). The stacked form reads ``a``
  and ``b`` as the two column halves of one ``[rows, 2I]`` tensor (the experts' fused gate/up
  GEMM output) in ``[BLOCK_R, BLOCK_C]`` tiles and writes ``[da | db]`` into one ``[rows, 2I]``
  gradient; both forms share the math (``_silu_mul``, ``_silu_mul_grad``), so they agree bit for
  bit. The ``_q`` variants of the stacked form keep the input for backward as its 1x128 FP8
  quantization (DeepSeek-V3 report §3.3: the SwiGLU input is cached in FP8): the forward writes
  ``[h1 | h3]``'s e4m3 tiles and fp32 scales beside the output (the quantizer's math from
  :mod:`ptxtrain.quant.triton`, so the bits of ``per_token_cast_to_fp8``), a program owning
  ``[BLOCK_R, 128]`` of each half; the backward reads those and dequantizes in registers
  (``q·sf`` in fp32, as ``per_token_cast_back``). ``silu`` is ``a / (1 + e^-a)``,
  the formula of torch's kernels; ``exp`` is Triton's (``ex2.approx`` on the GPU, numpy in the
  interpreter), 1-2 fp32 ulps from torch's, so a bf16 output can sit one bf16 ulp off where the
  fp32 value lies at a rounding boundary.
- RMSNorm: a program owns one row ``[D]`` (``D <= 16384`` in registers): ``ms = Σx²/D``,
  ``rstd = 1/sqrt_rn(ms + eps)`` (correctly rounded, as the CPU's ``rsqrt``), ``y = (x·rstd)·w``.
  Only the sum order of ``Σx²`` differs from torch. Backward: a program owns a contiguous run of
  rows, writes ``dx = (g·w - x̂·mean(g·w·x̂))·rstd`` per row and one fp32 partial ``Σ g·x̂`` per
  column into ``[programs, D]``, which ``torch.sum`` reduces: deterministic, no atomics.
- MLA q/k: a program owns one token (all heads, looped in blocks of ``BLOCK_H``): it copies the
  nope columns of ``q`` and of ``kv`` (the per-head ``k_nope``), rotates ``q``'s rope columns and
  the token's one ``k_pe`` (once, then stored to every head), ``(x + iy)(c + is) = (xc - ys) +
  i(xs + yc)``, the product order of torch's complex64 multiply. Backward: ``dq`` (nope copied,
  rope rotated by ``c - is``), ``dkv = [dk_nope | dv]`` in one write, and ``dk_pe``: the heads'
  rope gradients summed in fp32 (a fixed tree order), then rotated back once, one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ptxtrain._checks import ceil_div
from ptxtrain.quant.ref import BLOCK as QUANT_BLOCK
from ptxtrain.quant.triton import quant_rows

__all__ = [
    "MAX_NORM_DIM",
    "mla_qk_bwd",
    "mla_qk_fwd",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "swiglu_bwd",
    "swiglu_fwd",
    "swiglu_stacked_bwd",
    "swiglu_stacked_bwd_q",
    "swiglu_stacked_fwd",
    "swiglu_stacked_fwd_q",
]

MAX_NORM_DIM = 16384  # an RMSNorm row lives in one program's registers
_EW_BLOCK = 2048  # elements per SwiGLU program
# RMSNorm backward programs: four per SM of an H200 (132 SMs) keeps every SM busy and the fp32
# partial-sum buffer [programs, D] small (15 MB at D = 7168).
_NORM_BWD_PROGRAMS = 528
_HEADS_PER_BLOCK = 16


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


# ------------------------------------------------------------------------------------ SwiGLU
@triton.jit
def _silu_mul(a, b):
    """``silu(a)·b`` of fp32 tensors: torch's ``silu`` formula, each product rounded."""
    silu = a / (1.0 + tl.exp(-a))
    return silu * b


@triton.jit
def _silu_mul_grad(g, a, b):
    """``(da, db)`` of ``silu(a)·b`` for the output gradient ``g`` (fp32 tensors)."""
    e = tl.exp(-a)
    sig = 1.0 / (1.0 + e)
    db = g * (a / (1.0 + e))
    # torch's silu_backward(dy = g·b, a): dy·σ·(1 + a·(1 - σ)), left to right
    da = ((g * b) * sig) * (1.0 + a * (1.0 - sig))
    return da, db


@triton.jit
def _swiglu_fwd_kernel(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, _silu_mul(a, b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, a_ptr, b_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    da, db = _silu_mul_grad(g, a, b)
    tl.store(da_ptr + offs, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + offs, db.to(db_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _stacked_tile(rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's ``[BLOCK_R, BLOCK_C]`` tile of a ``[rows, cols]`` output: its rows, the
    offsets of ``a`` in the stacked ``[rows, 2·cols]`` input (``b`` at ``+ cols``), of the
    output, and the mask."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    return r, r[:, None] * (2 * cols) + c[None, :], r[:, None] * cols + c[None, :], mask


@triton.jit
def _swiglu_stacked_fwd_kernel(
    h_ptr, out_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    _, ab, o, mask = _stacked_tile(rows, cols, BLOCK_R, BLOCK_C)
    a = tl.load(h_ptr + ab, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(h_ptr + ab + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, _silu_mul(a, b).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_stacked_bwd_kernel(
    g_ptr, h_ptr, dh_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr
):
    _, ab, o, mask = _stacked_tile(rows, cols, BLOCK_R, BLOCK_C)
    g = tl.load(g_ptr + o, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(h_ptr + ab, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(h_ptr + ab + cols, mask=mask, other=0.0).to(tl.float32)
    da, db = _silu_mul_grad(g, a, b)
    tl.store(dh_ptr + ab, da.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + ab + cols, db.to(dh_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_stacked_fwd_q_kernel(
    h_ptr, out_ptr, q_ptr, sf_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr,
    POW2: tl.constexpr,
):  # fmt: skip
    r, ab, o, mask = _stacked_tile(rows, cols, BLOCK_R, BLOCK_Q)
    a = tl.load(h_ptr + ab, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(h_ptr + ab + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, _silu_mul(a, b).to(out_ptr.dtype.element_ty), mask=mask)
    # The scale columns of a's tile and b's: tile j of the first half, tile j + I/128 of the
    # second ([rows, 2I/128] row-major).
    n_sf = 2 * (cols // BLOCK_Q)
    j = tl.program_id(1)
    qa, sfa = quant_rows(a, POW2)
    tl.store(q_ptr + ab, qa, mask=mask)
    tl.store(sf_ptr + r * n_sf + j, sfa, mask=r < rows)
    qb, sfb = quant_rows(b, POW2)
    tl.store(q_ptr + ab + cols, qb, mask=mask)
    tl.store(sf_ptr + r * n_sf + j + n_sf // 2, sfb, mask=r < rows)


@triton.jit
def _swiglu_stacked_bwd_q_kernel(
    g_ptr, q_ptr, sf_ptr, dh_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr
):
    r, ab, o, mask = _stacked_tile(rows, cols, BLOCK_R, BLOCK_Q)
    n_sf = 2 * (cols // BLOCK_Q)
    j = tl.program_id(1)
    sfa = tl.load(sf_ptr + r * n_sf + j, mask=r < rows, other=1.0)
    sfb = tl.load(sf_ptr + r * n_sf + j + n_sf // 2, mask=r < rows, other=1.0)
    a = tl.load(q_ptr + ab, mask=mask, other=0.0).to(tl.float32) * sfa[:, None]
    b = tl.load(q_ptr + ab + cols, mask=mask, other=0.0).to(tl.float32) * sfb[:, None]
    g = tl.load(g_ptr + o, mask=mask, other=0.0).to(tl.float32)
    da, db = _silu_mul_grad(g, a, b)
    tl.store(dh_ptr + ab, da.to(dh_ptr.dtype.element_ty), mask=mask)
    tl.store(dh_ptr + ab + cols, db.to(dh_ptr.dtype.element_ty), mask=mask)


_Q_ROWS = 32  # rows per program of the _q kernels: two [32, 128] tiles


def swiglu_stacked_fwd_q(
    h: torch.Tensor, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`swiglu_stacked_fwd` of a contiguous ``[rows, 2I]`` tensor (``I`` a multiple of
    128), plus ``h``'s 1x128 quantization for backward: ``(out [rows, I] in h's dtype,
    h_fp8 [rows, 2I] e4m3, sf [rows, 2I/128] fp32 row-major)``, the bits of
    ``per_token_cast_to_fp8(h, pow2_scale=pow2_scale)``."""
    rows, cols = h.shape[0], h.shape[1] // 2
    out = h.new_empty(rows, cols)
    q = torch.empty(h.shape, dtype=torch.float8_e4m3fn, device=h.device)
    sf = torch.empty(rows, 2 * cols // QUANT_BLOCK, dtype=torch.float32, device=h.device)
    if out.numel():
        grid = (triton.cdiv(rows, _Q_ROWS), cols // QUANT_BLOCK)
        _swiglu_stacked_fwd_q_kernel[grid](
            h, out, q, sf, rows, cols, BLOCK_R=_Q_ROWS, BLOCK_Q=QUANT_BLOCK, POW2=pow2_scale,
            num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return out, q, sf


def swiglu_stacked_bwd_q(
    g: torch.Tensor, q: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``d[h1 | h3]`` ``[rows, 2I]`` in ``dtype`` for the contiguous output gradient ``g``
    ``[rows, I]``, from :func:`swiglu_stacked_fwd_q`'s quantization: bit for bit
    :func:`swiglu_stacked_bwd` of ``per_token_cast_back(q, sf)`` (fp32), cast to ``dtype``."""
    rows, cols = g.shape
    dh = torch.empty(q.shape, dtype=dtype, device=q.device)
    if g.numel():
        grid = (triton.cdiv(rows, _Q_ROWS), cols // QUANT_BLOCK)
        _swiglu_stacked_bwd_q_kernel[grid](
            g, q, sf, dh, rows, cols, BLOCK_R=_Q_ROWS, BLOCK_Q=QUANT_BLOCK, num_warps=4,
            enable_fp_fusion=False,
        )  # fmt: skip
    return dh


def swiglu_fwd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(a)·b`` of two contiguous tensors of one shape and dtype, in that dtype."""
    out = torch.empty_like(a)
    n = a.numel()
    if n:
        _swiglu_fwd_kernel[(triton.cdiv(n, _EW_BLOCK),)](
            a, b, out, n, BLOCK=_EW_BLOCK, num_warps=8, enable_fp_fusion=False
        )
    return out


def swiglu_bwd(
    g: torch.Tensor, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(da, db)`` of ``silu(a)·b`` for the output gradient ``g`` (all contiguous, one shape)."""
    da, db = torch.empty_like(a), torch.empty_like(b)
    n = a.numel()
    if n:
        _swiglu_bwd_kernel[(triton.cdiv(n, _EW_BLOCK),)](
            g, a, b, da, db, n, BLOCK=_EW_BLOCK, num_warps=8, enable_fp_fusion=False
        )
    return da, db


def _stacked_grid(rows: int, cols: int) -> tuple[tuple[int, int], dict]:
    """Grid and tile sizes of the stacked SwiGLU kernels: ``_EW_BLOCK`` elements per program,
    ``BLOCK_C`` columns (256, or the next power of two of a narrower ``cols``) by ``BLOCK_R``
    rows; I = 1408 takes 6 column tiles (8% of the lanes masked)."""
    block_c = min(256, triton.next_power_of_2(cols))
    block_r = _EW_BLOCK // block_c
    return (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c)), dict(
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=8, enable_fp_fusion=False
    )


def swiglu_stacked_fwd(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I])·h[:, I:]`` of a contiguous ``[rows, 2I]`` tensor: ``[rows, I]`` in its
    dtype, bit for bit :func:`swiglu_fwd` of the two halves."""
    rows, cols = h.shape[0], h.shape[1] // 2
    out = h.new_empty(rows, cols)
    if out.numel():
        grid, meta = _stacked_grid(rows, cols)
        _swiglu_stacked_fwd_kernel[grid](h, out, rows, cols, **meta)
    return out


def swiglu_stacked_bwd(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``d[h1 | h3]`` ``[rows, 2I]`` of :func:`swiglu_stacked_fwd` for the contiguous output
    gradient ``g`` ``[rows, I]``: both halves written by one pass (bit for bit
    :func:`swiglu_bwd`'s ``da`` and ``db``)."""
    rows, cols = g.shape
    dh = torch.empty_like(h)
    if g.numel():
        grid, meta = _stacked_grid(rows, cols)
        _swiglu_stacked_bwd_kernel[grid](g, h, dh, rows, cols, **meta)
    return dh


# ------------------------------------------------------------------------------------ RMSNorm
@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (x * rstd) * w
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    g_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_part_ptr,
    n_rows,
    D,
    rows_per_program,
    stride_g,
    stride_x,
    stride_dx,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    first = pid.to(tl.int64) * rows_per_program
    for i in range(0, tl.minimum(rows_per_program, n_rows - first)):
        row = first + i
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        gw = g * w
        c = tl.sum(gw * x_hat, axis=0) / D
        dx = (gw - x_hat * c) * rstd
        tl.store(dx_ptr + row * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += g * x_hat
    tl.store(dw_part_ptr + pid.to(tl.int64) * D + cols, dw, mask=mask)


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [rows, D]`` (last stride 1), ``weight [D]`` contiguous -> (``y [rows, D]`` in x's
    dtype, ``rstd [rows]`` fp32)."""
    rows, d = x.shape
    y = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        block = triton.next_power_of_2(d)
        _rms_norm_fwd_kernel[(rows,)](
            x, weight, y, rstd, d, x.stride(0), y.stride(0), eps,
            BLOCK_D=block, num_warps=_warps(block), enable_fp_fusion=False,
        )  # fmt: skip
    return y, rstd


def rms_norm_bwd(
    g: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx [rows, D]`` in x's dtype, ``dweight [D]`` in weight's dtype) of ``rms_norm_fwd``;
    ``g`` and ``x`` ``[rows, D]`` with last stride 1."""
    rows, d = x.shape
    dx = torch.empty((rows, d), dtype=x.dtype, device=x.device)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    per_program = ceil_div(rows, min(rows, _NORM_BWD_PROGRAMS))
    programs = ceil_div(rows, per_program)
    dw_part = torch.empty((programs, d), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(d)
    _rms_norm_bwd_kernel[(programs,)](
        g, x, weight, rstd, dx, dw_part, rows, d, per_program,
        g.stride(0), x.stride(0), dx.stride(0),
        BLOCK_D=block, num_warps=_warps(block), enable_fp_fusion=False,
    )  # fmt: skip
    return dx, dw_part.sum(0).to(weight.dtype)


# ------------------------------------------------------------------------------------ MLA q/k
@triton.jit
def _rotate(x, y, c, s, CONJ: tl.constexpr):
    """``(x + iy)·(c ± is)``: torch's complex64 product order (each product rounded first)."""
    if CONJ:
        return x * c + y * s, y * c - x * s
    return x * c - y * s, x * s + y * c


@triton.jit
def _token_freqs(f_ptr, t, sf_t, HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    """Pair indices ``rr``, their mask, ``cos`` and ``sin`` of token ``t`` (fp32 ``[BLOCK_R]``)."""
    rr = tl.arange(0, BLOCK_R)
    mr = rr < HALF
    c = tl.load(f_ptr + t * sf_t + 2 * rr, mask=mr, other=0.0)
    s = tl.load(f_ptr + t * sf_t + 2 * rr + 1, mask=mr, other=0.0)
    return rr, mr, c, s


@triton.jit
def _mla_qk_fwd_kernel(
    q_ptr, kv_ptr, kpe_ptr, f_ptr, qo_ptr, ko_ptr,
    T, H,
    sq_b, sq_t, sq_h, skv_b, skv_t, skv_h, spe_b, spe_t, sf_t,
    NOPE: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    b, t = row // T, row % T
    QK: tl.constexpr = NOPE + 2 * HALF
    rn = tl.arange(0, BLOCK_N)
    rr, mr, c, s = _token_freqs(f_ptr, t, sf_t, HALF, BLOCK_R)
    pe = kpe_ptr + b * spe_b + t * spe_t + 2 * rr
    kx = tl.load(pe, mask=mr, other=0.0).to(tl.float32)
    ky = tl.load(pe + 1, mask=mr, other=0.0).to(tl.float32)
    k_re, k_im = _rotate(kx, ky, c, s, False)
    k_re = k_re.to(ko_ptr.dtype.element_ty)
    k_im = k_im.to(ko_ptr.dtype.element_ty)
    for h0 in range(0, H, BLOCK_H):
        hh = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mh = hh < H
        m_n = mh[:, None] & (rn < NOPE)[None, :]
        m_r = mh[:, None] & mr[None, :]
        q_row = q_ptr + b * sq_b + t * sq_t + hh[:, None] * sq_h
        kv_row = kv_ptr + b * skv_b + t * skv_t + hh[:, None] * skv_h
        out = (row * H + hh[:, None]) * QK  # q_rot and k: contiguous [B, T, H, QK]
        tl.store(qo_ptr + out + rn[None, :], tl.load(q_row + rn[None, :], mask=m_n), mask=m_n)
        tl.store(ko_ptr + out + rn[None, :], tl.load(kv_row + rn[None, :], mask=m_n), mask=m_n)
        pair = NOPE + 2 * rr[None, :]
        qx = tl.load(q_row + pair, mask=m_r, other=0.0).to(tl.float32)
        qy = tl.load(q_row + pair + 1, mask=m_r, other=0.0).to(tl.float32)
        q_re, q_im = _rotate(qx, qy, c[None, :], s[None, :], False)
        tl.store(qo_ptr + out + pair, q_re.to(qo_ptr.dtype.element_ty), mask=m_r)
        tl.store(qo_ptr + out + pair + 1, q_im.to(qo_ptr.dtype.element_ty), mask=m_r)
        zero = tl.zeros([BLOCK_H, BLOCK_R], dtype=ko_ptr.dtype.element_ty)
        tl.store(ko_ptr + out + pair, zero + k_re[None, :], mask=m_r)
        tl.store(ko_ptr + out + pair + 1, zero + k_im[None, :], mask=m_r)


@triton.jit
def _mla_qk_bwd_kernel(
    dqo_ptr, dko_ptr, dv_ptr, f_ptr, dq_ptr, dkv_ptr, dpe_ptr,
    T, H, V,
    sg_b, sg_t, sg_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sf_t,
    NOPE: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    b, t = row // T, row % T
    QK: tl.constexpr = NOPE + 2 * HALF
    rn = tl.arange(0, BLOCK_N)
    rv = tl.arange(0, BLOCK_V)
    rr, mr, c, s = _token_freqs(f_ptr, t, sf_t, HALF, BLOCK_R)
    acc_x = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc_y = tl.zeros([BLOCK_R], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        hh = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mh = hh < H
        m_n = mh[:, None] & (rn < NOPE)[None, :]
        m_r = mh[:, None] & mr[None, :]
        m_v = mh[:, None] & (rv < V)[None, :]
        gq = dqo_ptr + b * sg_b + t * sg_t + hh[:, None] * sg_h
        gk = dko_ptr + b * sk_b + t * sk_t + hh[:, None] * sk_h
        gv = dv_ptr + b * sv_b + t * sv_t + hh[:, None] * sv_h
        dq = dq_ptr + (row * H + hh[:, None]) * QK  # dq: contiguous [B, T, H, QK]
        dkv = dkv_ptr + (row * H + hh[:, None]) * (NOPE + V)  # dkv: contiguous [B, T, H, NOPE+V]
        tl.store(dq + rn[None, :], tl.load(gq + rn[None, :], mask=m_n), mask=m_n)
        tl.store(dkv + rn[None, :], tl.load(gk + rn[None, :], mask=m_n), mask=m_n)
        tl.store(dkv + NOPE + rv[None, :], tl.load(gv + rv[None, :], mask=m_v), mask=m_v)
        pair = NOPE + 2 * rr[None, :]
        gx = tl.load(gq + pair, mask=m_r, other=0.0).to(tl.float32)
        gy = tl.load(gq + pair + 1, mask=m_r, other=0.0).to(tl.float32)
        d_re, d_im = _rotate(gx, gy, c[None, :], s[None, :], True)
        tl.store(dq + pair, d_re.to(dq_ptr.dtype.element_ty), mask=m_r)
        tl.store(dq + pair + 1, d_im.to(dq_ptr.dtype.element_ty), mask=m_r)
        acc_x += tl.sum(tl.load(gk + pair, mask=m_r, other=0.0).to(tl.float32), axis=0)
        acc_y += tl.sum(tl.load(gk + pair + 1, mask=m_r, other=0.0).to(tl.float32), axis=0)
    pe_re, pe_im = _rotate(acc_x, acc_y, c, s, True)
    pe = dpe_ptr + row * 2 * HALF + 2 * rr  # dk_pe: contiguous [B, T, 2·HALF]
    tl.store(pe, pe_re.to(dpe_ptr.dtype.element_ty), mask=mr)
    tl.store(pe + 1, pe_im.to(dpe_ptr.dtype.element_ty), mask=mr)


def _head_blocks(h: int, nope: int, half: int) -> dict:
    return dict(
        BLOCK_H=min(triton.next_power_of_2(h), _HEADS_PER_BLOCK),
        BLOCK_N=triton.next_power_of_2(max(nope, 1)),
        BLOCK_R=triton.next_power_of_2(half),
        NOPE=nope,
        HALF=half,
    )


def mla_qk_fwd(
    q: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor, freqs_real: torch.Tensor, nope: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [B, T, H, nope+rope]``, ``kv [B, T, H, nope+v]``, ``k_pe [B, T, rope]`` (last strides
    1), ``freqs_real [T, rope/2, 2]`` fp32 (cos, sin; last stride 1) -> contiguous ``q_rot`` and
    ``k`` ``[B, T, H, nope+rope]`` in q's dtype."""
    bsz, t, h, qk = q.shape
    q_rot = torch.empty((bsz, t, h, qk), dtype=q.dtype, device=q.device)
    k = torch.empty_like(q_rot)
    if q_rot.numel():
        _mla_qk_fwd_kernel[(bsz * t,)](
            q, kv, k_pe, freqs_real, q_rot, k, t, h,
            q.stride(0), q.stride(1), q.stride(2), kv.stride(0), kv.stride(1), kv.stride(2),
            k_pe.stride(0), k_pe.stride(1), freqs_real.stride(0),
            **_head_blocks(h, nope, (qk - nope) // 2), num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return q_rot, k


def mla_qk_bwd(
    dq_rot: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    freqs_real: torch.Tensor,
    nope: int,
    pe_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``mla_qk_fwd`` (and of the ``v`` view): ``dq_rot``, ``dk`` ``[B, T, H,
    nope+rope]``, ``dv [B, T, H, v]`` (any strides, last stride 1) -> contiguous ``dq`` like q,
    ``dkv [B, T, H, nope+v]``, ``dk_pe [B, T, rope]`` in ``pe_dtype``."""
    bsz, t, h, qk = dq_rot.shape
    v = dv.shape[-1]
    dq = torch.empty((bsz, t, h, qk), dtype=dq_rot.dtype, device=dq_rot.device)
    dkv = torch.empty((bsz, t, h, nope + v), dtype=dk.dtype, device=dk.device)
    dpe = torch.empty((bsz, t, qk - nope), dtype=pe_dtype, device=dk.device)
    if dq.numel():
        _mla_qk_bwd_kernel[(bsz * t,)](
            dq_rot, dk, dv, freqs_real, dq, dkv, dpe, t, h, v,
            dq_rot.stride(0), dq_rot.stride(1), dq_rot.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            freqs_real.stride(0), BLOCK_V=triton.next_power_of_2(max(v, 1)),
            **_head_blocks(h, nope, (qk - nope) // 2), num_warps=4, enable_fp_fusion=False,
        )  # fmt: skip
    return dq, dkv, dpe
