"""Triton kernels of the fused AdamW step (:mod:`ptxtrain.optim.fused` holds the buffers).

Three kernels, all reading only device tensors, so a step launches without host reads or
host-to-device copies (CUDA-graph capturable):

* ``_adamw_prologue_kernel``: one lane per parameter of a device table. Adds 1 to the step count of
  every parameter whose gradient flag is set, and writes that parameter's eight FP32 update
  scalars (a row of :data:`~ptxtrain.optim.fused.SCALARS`) from its group's FP64
  hyper-parameters and the new step count. Each is computed in FP64 and rounded once to FP32,
  as the per-tensor path rounds Python floats: ``1 - lr·wd``, ``1 - β1``, ``β2``, ``1 - β2``,
  ``eps``, ``-lr / (1 - β1^t)``, and ``1 / fp32(√(1 - β2^t))`` as an FP32 reciprocal (CUDA's
  per-tensor ``v.sqrt() / x`` multiplies by that reciprocal). ``β^t`` is exponentiation by
  squaring in FP64 over the bits of the FP32 step count (exact up to 2^24 steps); rounded to
  FP32 it matched Python's ``β ** t`` for all of 48,000 tried (β, t) pairs.
* ``_adamw_update_kernel``: one program per entry of a bucket's block table (a run of at most
  ``BLOCK`` elements inside one parameter; see ``Bucket.block_table``). It reads the
  parameter's flag and scalars, the gradient (times the device-scalar clip coefficient), the
  FP32 weight and both moments, and writes the weight, the moments and the low-precision
  working copy, in the per-tensor path's operation order::

      g = g · scale                     w = w · (1 - lr·wd)
      m = lerp(m, g, 1 - β1)            (torch's formula: m + w·(g - m) for w < 0.5)
      v = v · β2 + (1 - β2)·g·g
      w = w + (-lr / bc1) · (m / (√v · (1/√bc2) + eps))

  with IEEE ``sqrt_rn`` / ``div_rn`` (Triton's plain ``/`` and ``sqrt`` on FP32 are the
  approximate PTX instructions). A full block (``BLOCK`` elements, start aligned) loads and
  stores unmasked, in vectors; the last, partial block of a parameter takes the masked path.
  The loads wait only for the block's start and length: the parameter's flag and scalars
  (loads that depend on its index) are needed only by the arithmetic and the stores. A block
  of a parameter without a gradient this step is therefore read (wasted bandwidth in that
  rare case) but not written. The first update of a parameter with a master (step 1) takes
  the FP32 weight from the working copy, as the per-tensor path creates its master.
* ``_adamw_norm_kernel``: per block table entry, the sum of squares (2-norm) or the largest
  magnitude (inf-norm, on the bits so that a NaN wins, as ``torch.linalg.vector_norm``) of the
  gradient, 0 for a parameter without one; the caller reduces the partials.

Rounding: the CUDA per-tensor path runs the same FP32 operations as separate kernels; here
the compiler may contract a multiply and an add into one FMA, which moves some results by an
FP32 ulp per step (the GPU tests allow a few ulps, as for the foreach path).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ptxtrain.optim.fused import Bucket, DeviceTable

__all__ = ["grad_norm", "prologue", "update"]

# Lanes per program of the prologue (one lane per parameter; tables hold thousands at most).
_PROLOGUE_BLOCK = 128
# What the kernels are told a block's start is a multiple of, in elements (the flat buffers give
# fused.ALIGN = 256; blocks are powers of two >= 16). 4 makes Triton give every tensor one
# layout, 4 elements per thread: 16-byte FP32 and 8-byte BF16 vectors. With 8 or more, BF16
# accesses take 8 elements per thread, but Triton caps FP32 stores at 16 bytes per thread, so
# the FP32 weight goes through a layout conversion in shared memory before its store (the
# sm_90 build then uses 1 KB of shared memory per program and two convert_layout); a warp's
# 8-byte accesses are coalesced all the same.
_START_MULTIPLE = 4


@triton.jit
def _pow_by_squaring(base, n):
    """``base ** n`` for an FP64 tensor ``base`` and an int32 tensor ``0 <= n < 2^25``."""
    acc = tl.zeros_like(base) + 1.0
    for i in tl.static_range(25):
        acc = tl.where(((n >> i) & 1) != 0, acc * base, acc)
        base = base * base
    return acc


@triton.jit
def _adamw_prologue_kernel(
    flag_ptr, step_ptr, group_ptr, hyper_ptr, scal_ptr, n, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    flag = tl.load(flag_ptr + i, mask=mask, other=0)
    t = tl.load(step_ptr + i, mask=mask, other=0.0) + tl.where(flag != 0, 1.0, 0.0)
    tl.store(step_ptr + i, t, mask=mask)
    row = tl.load(group_ptr + i, mask=mask, other=0).to(tl.int64) * 5  # [lr, β1, β2, eps, wd]
    lr = tl.load(hyper_ptr + row, mask=mask, other=0.0)
    beta1 = tl.load(hyper_ptr + row + 1, mask=mask, other=0.0)
    beta2 = tl.load(hyper_ptr + row + 2, mask=mask, other=0.0)
    eps = tl.load(hyper_ptr + row + 3, mask=mask, other=0.0)
    wd = tl.load(hyper_ptr + row + 4, mask=mask, other=0.0)
    steps = tl.maximum(t, 1.0).to(tl.int32)  # t = 0 only without a gradient: scalars unused
    bc1 = 1.0 - _pow_by_squaring(beta1, steps)
    bc2_sqrt = tl.sqrt(1.0 - _pow_by_squaring(beta2, steps)).to(tl.float32)
    # FP32 1/x computed in FP64 and rounded once: the correctly rounded FP32 quotient.
    inv_bc2_sqrt = (1.0 / bc2_sqrt.to(tl.float64)).to(tl.float32)
    out = scal_ptr + i.to(tl.int64) * 8
    tl.store(out + 0, (1.0 - lr * wd).to(tl.float32), mask=mask)
    tl.store(out + 1, (1.0 - beta1).to(tl.float32), mask=mask)
    tl.store(out + 2, beta2.to(tl.float32), mask=mask)
    tl.store(out + 3, (1.0 - beta2).to(tl.float32), mask=mask)
    tl.store(out + 4, inv_bc2_sqrt, mask=mask)
    tl.store(out + 5, eps.to(tl.float32), mask=mask)
    tl.store(out + 6, (-(lr / bc1)).to(tl.float32), mask=mask)
    tl.store(out + 7, t, mask=mask)


@triton.jit
def _ld(ptr, offs, mask, MASKED: tl.constexpr):
    # Streamed once: evict_first keeps the L2 for the other operands.
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        return tl.load(ptr + offs, eviction_policy="evict_first")


@triton.jit
def _st(ptr, offs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr + offs, value.to(ptr.dtype.element_ty))


@triton.jit
def _master_at(master, p_ptr, offs, mask, t, MASKED: tl.constexpr):
    """The FP32 weight of update ``t``: the master, except at the first update, where the
    master starts as the working weight (the per-tensor path creates it then)."""
    if t == 1.0:
        master = _ld(p_ptr, offs, mask, MASKED).to(tl.float32)
    return master


@triton.jit
def _adamw_block(
    w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, ready, scal, scale,
    MODE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # The loads depend on the block's start and length only, not on the parameter's flag or
    # scalars (two more dependent loads): they leave first. Without a gradient this step, the
    # block is read but not written.
    g = _ld(g_ptr, offs, mask, MASKED).to(tl.float32) * scale
    if MODE == 2:  # low-precision parameter without a master: updated in FP32, rounded back
        w = _ld(p_ptr, offs, mask, MASKED).to(tl.float32)
    else:  # the FP32 parameter itself (MODE 0), or the FP32 master (MODE 1)
        w = _ld(w_ptr, offs, mask, MASKED)
    m = _ld(m_ptr, offs, mask, MASKED).to(tl.float32)
    v = _ld(v_ptr, offs, mask, MASKED).to(tl.float32)
    decay = tl.load(scal + 0)
    one_minus_beta1 = tl.load(scal + 1)
    beta2 = tl.load(scal + 2)
    one_minus_beta2 = tl.load(scal + 3)
    inv_bc2_sqrt = tl.load(scal + 4)
    eps = tl.load(scal + 5)
    step_size = tl.load(scal + 6)
    if MODE == 1:
        w = _master_at(w, p_ptr, offs, mask, tl.load(scal + 7), MASKED)
    w = w * decay
    d = g - m
    # torch's lerp, whose two forms are exact at weight 0 and 1 respectively
    m = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * d, g - d * (1.0 - one_minus_beta1))
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.sqrt_rn(v) * inv_bc2_sqrt + eps
    w = w + step_size * tl.div_rn(m, denom)
    if ready:
        if MODE != 2:
            _st(w_ptr, offs, w, mask, MASKED)
        if MODE != 0:
            _st(p_ptr, offs, w, mask, MASKED)  # round to nearest even
        _st(m_ptr, offs, m, mask, MASKED)
        _st(v_ptr, offs, v, mask, MASKED)


@triton.jit
def _this_block(start_ptr, len_ptr, param_ptr, flag_ptr, BLOCK, START_MULTIPLE):
    """This program's block table entry: (parameter index, has a gradient, element offsets,
    element count)."""
    pid = tl.program_id(0)
    param = tl.load(param_ptr + pid)
    ready = tl.load(flag_ptr + param) != 0
    start = tl.multiple_of(tl.load(start_ptr + pid), START_MULTIPLE)
    return param, ready, start + tl.arange(0, BLOCK), tl.load(len_ptr + pid)


@triton.jit
def _adamw_update_kernel(
    w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, start_ptr, len_ptr, param_ptr, flag_ptr, scal_ptr,
    scale_ptr, MODE: tl.constexpr, BLOCK: tl.constexpr, START_MULTIPLE: tl.constexpr,
):  # fmt: skip
    param, ready, offs, n = _this_block(
        start_ptr, len_ptr, param_ptr, flag_ptr, BLOCK, START_MULTIPLE
    )
    scal = scal_ptr + param.to(tl.int64) * 8
    scale = tl.load(scale_ptr)
    if n == BLOCK:  # unmasked: 16-byte / 8-byte vectors
        _adamw_block(w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, offs, None, ready, scal, scale, MODE, False)
    else:  # a parameter's last, partial block
        mask = tl.arange(0, BLOCK) < n
        _adamw_block(w_ptr, p_ptr, g_ptr, m_ptr, v_ptr, offs, mask, ready, scal, scale, MODE, True)


@triton.jit
def _norm_part(g, INF: tl.constexpr):
    if INF:  # |g| on the bits: as integers, NaN > inf > finite, so a NaN wins the max
        bits = g.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.max(bits, axis=0).to(tl.float32, bitcast=True)
    else:
        return tl.sum(g * g, axis=0)


@triton.jit
def _adamw_norm_kernel(
    g_ptr, start_ptr, len_ptr, param_ptr, flag_ptr, out_ptr,
    INF: tl.constexpr, BLOCK: tl.constexpr, START_MULTIPLE: tl.constexpr,
):  # fmt: skip
    _, ready, offs, n = _this_block(start_ptr, len_ptr, param_ptr, flag_ptr, BLOCK, START_MULTIPLE)
    if n == BLOCK:
        part = _norm_part(_ld(g_ptr, offs, None, False).to(tl.float32), INF)
    else:
        part = _norm_part(_ld(g_ptr, offs, tl.arange(0, BLOCK) < n, True).to(tl.float32), INF)
    # Without a gradient this step the buffer holds stale values (even NaN): they count 0.
    tl.store(out_ptr + tl.program_id(0), tl.where(ready, part, 0.0))


def _check_launch(block: object, num_warps: object) -> None:
    for name, value, low in (("block", block, 16), ("num_warps", num_warps, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < low or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {low}, got {value}")


def prologue(table: DeviceTable) -> None:
    """Advance the step count of every flagged parameter of ``table`` and write its scalars."""
    n = len(table.params)
    if n == 0:
        return
    grid = (triton.cdiv(n, _PROLOGUE_BLOCK),)
    _adamw_prologue_kernel[grid](
        table.flags, table.steps, table.group_of, table.hyper, table.scalars, n,
        BLOCK=_PROLOGUE_BLOCK, num_warps=4,
    )  # fmt: skip


def update(bucket: Bucket, table: DeviceTable, block: int, num_warps: int) -> None:
    """One fused AdamW update of every flagged parameter of ``bucket`` (after :func:`prologue`).

    ``block``: elements per program; ``num_warps``: warps per program.

    Raises:
        TypeError / ValueError: ``block`` is not a power of two >= 16, or ``num_warps`` not one.
    """
    _check_launch(block, num_warps)
    starts, lens, params = bucket.block_table(block)
    if starts.numel() == 0:
        return
    weight = bucket.master if bucket.master is not None else bucket.param
    _adamw_update_kernel[(starts.numel(),)](
        weight, bucket.param, bucket.grad, bucket.exp_avg, bucket.exp_avg_sq, starts, lens,
        params, table.flags, table.scalars, table.scale,
        MODE=bucket.mode, BLOCK=block, START_MULTIPLE=_START_MULTIPLE, num_warps=num_warps,
    )  # fmt: skip


def grad_norm(
    bucket: Bucket, table: DeviceTable, norm_type: float, block: int, num_warps: int
) -> torch.Tensor:
    """The 2-norm or inf-norm (``norm_type`` 2 or inf) of the gradients of ``bucket``'s flagged
    parameters, as a 0-d FP32 tensor on the bucket's device (0 when none has a gradient).

    The per-block partials (FP32) are summed in FP64 before the square root.

    Raises:
        TypeError / ValueError: as :func:`update`.
    """
    _check_launch(block, num_warps)
    starts, lens, params = bucket.block_table(block)
    if starts.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=bucket.device)
    inf = math.isinf(norm_type)
    partials = torch.empty(starts.numel(), dtype=torch.float32, device=bucket.device)
    _adamw_norm_kernel[(starts.numel(),)](
        bucket.grad, starts, lens, params, table.flags, partials,
        INF=inf, BLOCK=block, START_MULTIPLE=_START_MULTIPLE, num_warps=num_warps,
    )  # fmt: skip
    if inf:
        return partials.amax()
    return torch.sum(partials, dtype=torch.float64).sqrt().float()
