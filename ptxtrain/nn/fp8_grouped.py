"""FP8 grouped linear for the MoE experts: ``y[rows of g] = x[rows of g] · W[g]ᵀ`` with autograd.

Design note. The tokens arrive in expert-contiguous order (expert 0's rows, then expert 1's, ...)
with their counts. The three GEMMs of every expert run as one grouped GEMM each, with
DeepSeek-V3's fine-grained FP8 recipe (report §3.3; docs/design.md §1-2), as in the dense
:class:`ptxtrain.nn.Fp8Linear`:

- Fprop  ``y = x·W[g]ᵀ`` — x per 1x128 tile along K, each expert's W per 128x128 block:
  ``m_grouped_fp8_gemm_nt_contiguous``.
- Dgrad  ``dx = dy·W[g]`` — dy per 1x128 tile along N_out; B = W[g]ᵀ from the same 128x128
  quantization transposed (``per_block_cast_to_fp8_both``): ``m_grouped_fp8_gemm_nt_contiguous``.
- Wgrad  ``dW[g] = dy_gᵀ·x_g`` — contracts over each expert's tokens, so dy and x are quantized
  1x128 along the tokens (128x1 tiles, stored transposed): ``k_grouped_fp8_gemm_nt_contiguous``,
  fp32, cast to the weight's dtype. An expert with no tokens gets a zero gradient.

Layout. Both grouped GEMMs need each expert's rows padded: the m-grouped GEMM to
``get_m_alignment_for_contiguous_layout()`` (128) rows with ``m_indices = -1`` on padding rows,
the k-grouped GEMM to token slices that are multiples of 128 (no scale tile spans two experts).
One padded layout serves both (the values of :func:`ptxtrain.moe.ref.grouped_layout_ref`, built
by device ops from the host counts; only the 2·E counts and shifts are copied over): x and dy are
scattered into zero-filled ``[R, *]`` buffers, ``R = Σ_g ⌈n_g/align⌉·align``, and the outputs
gathered back. Zero rows leave the real rows'
quantization unchanged (1x128 tiles are per row; a zero never raises a 128x1 tile's amax), so the
result equals, on the reference path bit for bit, running the dense Fp8Linear once per expert.
When every count is already a multiple of ``align`` the layout is the identity and no copy is
made.

Host cost (the GPU's host issues every op of the small MoE layers): :class:`ptxtrain.moe.Experts`
calls the unchecked ``fp8_grouped_apply`` with one layout for its projections and each weight's
128x128 quantization cached until the weight changes. All of it is bit-identical to
:func:`fp8_grouped_linear` calls.

Stacked weights. ``fp8_grouped_apply`` also takes a tuple of weights ``[G, N_i, K]`` and
multiplies by their stack along N (the experts' gate/up ``[W1[g]; W3[g]]``): one Fprop GEMM
with N = ΣN_i; in backward one quantization of dy [R, ΣN_i] and one Dgrad GEMM with K = ΣN_i,
whose fp32 accumulator sums the parts' contributions (separate calls would write one bf16 dx per
part for autograd to add); Wgrad stays one k-grouped GEMM per part on its rows of dyᵀ's 128x1
quantization, so each part's gradient lands on its own (``main_grad`` or ``.grad``). The result
is, bit for bit, one call on ``torch.cat(parts, 1)``.

Saved for backward: FP8 data and scales only (xᵀ's 128x1 quantization from the forward and
W[g]ᵀ's 128x128 blocks), plus the int layout; a GEMM configured off by the config saves its
high-precision operand instead, as Fp8Linear does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ptxtrain import quant
from ptxtrain._checks import HP_DTYPES, ceil_div, check_tensor
from ptxtrain.gemm import ref as gemm_ref
from ptxtrain.nn.fp8_linear import (
    Fp8LinearConfig,
    autocast_off,
    complete_quantization,
    gemm_out_dtype,
    main_grad_target,
    quantize_activation,
    resolve_config,
    save_operands,
    saved_operands,
)

__all__ = ["fp8_grouped_linear"]

# The GEMM contracts (docs/design.md §2) fix the scale granularity and the k-grouped K unit at 128.
_GEMM_BLOCK = 128


def _grouped_gemms():
    """``(m_grouped_fp8_gemm_nt_contiguous, k_grouped_fp8_gemm_nt_contiguous)``: those of
    :mod:`ptxtrain.gemm.grouped` (Triton on CUDA, reference on CPU) where Triton is installed,
    else the references (any device). Imported at call time so ``import ptxtrain.nn`` needs no
    Triton.
    """
    try:
        from ptxtrain.gemm import grouped
    except ImportError:
        return (
            gemm_ref.m_grouped_fp8_gemm_nt_contiguous_ref,
            gemm_ref.k_grouped_fp8_gemm_nt_contiguous_ref,
        )
    return grouped.m_grouped_fp8_gemm_nt_contiguous, grouped.k_grouped_fp8_gemm_nt_contiguous


def _check_counts(tokens_per_expert: object, g: int, n: int, device: torch.device) -> list[int]:
    """``tokens_per_expert`` → G host ints ≥ 0 summing to N (one sync for a CUDA tensor)."""
    if isinstance(tokens_per_expert, torch.Tensor):
        t = tokens_per_expert
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"tokens_per_expert must have dtype int64 or int32, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"tokens_per_expert must be 1-D [G], got shape {tuple(t.shape)}")
        if t.device.type != "cpu" and t.device != device:
            raise ValueError(
                f"tokens_per_expert must be on the CPU or on x's device {device}, got {t.device}"
            )
        counts = [int(v) for v in t.tolist()]
    elif isinstance(tokens_per_expert, Sequence) and not isinstance(tokens_per_expert, str):
        counts = list(tokens_per_expert)
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in counts):
            raise TypeError(f"tokens_per_expert must hold ints, got {tokens_per_expert!r}")
    else:
        raise TypeError(
            "tokens_per_expert must be a 1-D int64 tensor or a sequence of ints, got "
            f"{type(tokens_per_expert).__name__}"
        )
    if len(counts) != g:
        raise ValueError(
            f"tokens_per_expert must have one count per expert (G = {g}, weight's dim 0), got "
            f"{len(counts)}"
        )
    if any(c < 0 for c in counts):
        raise ValueError(f"tokens_per_expert must be non-negative, got {counts}")
    if sum(counts) != n:
        raise ValueError(
            f"tokens_per_expert must sum to N = {n} (x's rows), got sum {sum(counts)} for {counts}"
        )
    return counts


def _check_align(align: object) -> int:
    # = ptxtrain.gemm.grouped.get_m_alignment_for_contiguous_layout(), and the k-grouped K unit.
    unit = gemm_ref.M_GROUPED_ALIGNMENT
    if isinstance(align, bool) or not isinstance(align, int):
        raise TypeError(f"align must be an int, got {type(align).__name__}")
    if align <= 0 or align % unit or align % gemm_ref.K_GROUPED_ALIGNMENT:
        raise ValueError(
            f"align must be a positive multiple of {unit} (the m-grouped GEMM's row alignment and "
            f"the k-grouped GEMM's token unit), got {align}"
        )
    return align


class HostLayout:
    """The padded expert-contiguous layout of N rows: ``R`` rows, expert g's ``n_g`` rows first
    in its slice of ``⌈n_g/align⌉·align`` rows, the rest padding.

    Built from the host list ``counts`` (E ints >= 0, summing to N; unchecked: callers validate
    them) with ``align`` a multiple of 128, on ``device``. Attributes: ``n`` (N), ``rows`` (R),
    ``ks`` (each expert's padded row count, the k-grouped Wgrad's group sizes), ``m_indices``
    (``[R]`` int32 expert of each row, -1 on padding), ``padded_rows`` (``[N]`` int64 padded row
    of each real row, None when ``identity``: every count already aligned).
    """

    def __init__(self, counts: list[int], align: int, device: torch.device) -> None:
        padded = [(c + align - 1) // align * align for c in counts]
        self.n = sum(counts)
        self.rows = sum(padded)  # R
        self.ks = padded  # token slice of each expert in the k-grouped wgrad (multiples of 128)
        self.identity = self.rows == self.n  # every count already aligned: no scatter needed
        # Built on the device from the E counts (the same values as
        # ptxtrain.moe.ref.grouped_layout_ref): permuted row i of expert e lands on padded row
        # i + shift[e], shift[e] = padded_start[e] - start[e]. Only the 2·E host ints are copied
        # (one small host→device copy); the [N] and [R] index vectors are made by device ops,
        # with repeat_interleave's output_size given so nothing waits on the device.
        e = len(counts)
        start = padded_start = 0
        shift = []
        for c, p in zip(counts, padded, strict=True):
            shift.append(padded_start - start)
            start, padded_start = start + c, padded_start + p
        host = torch.tensor([counts, shift], dtype=torch.int64)  # [2, E]
        small = host.to(device, non_blocking=True)
        experts = torch.repeat_interleave(
            torch.arange(e, device=device), small[0], output_size=self.n
        )  # [N] expert of each permuted row
        if self.identity:
            self.padded_rows = None
            self.m_indices = experts.to(torch.int32)  # [R = N] int32
        else:
            self.padded_rows = torch.arange(self.n, device=device) + small[1][experts]  # [N]
            m_indices = torch.full((self.rows,), -1, dtype=torch.int32, device=device)
            m_indices[self.padded_rows] = experts.to(torch.int32)
            self.m_indices = m_indices  # [R] int32, -1 = padding

    ks_tensor = None  # the k-grouped GEMM's group sizes are the host list ``ks``

    def host_counts(self, counts: list[int]) -> list[int]:
        """The per-expert row counts of the (unpadded) rows the high-precision loops walk."""
        return counts

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [N, C] → [R, C] with zero padding rows."""
        if self.identity:
            return t if t.is_contiguous() else t.contiguous()
        out = t.new_zeros(self.rows, t.shape[1])
        out.index_copy_(0, self.padded_rows, t)
        return out

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` [R, C] → its N real rows [N, C]."""
        return t if self.identity else t.index_select(0, self.padded_rows)


class DeviceLayout:
    """:class:`HostLayout`'s interface over a :class:`ptxtrain.moe.grouped_layout.GroupedLayout`:
    the rows arrive already padded (``identity``), the GEMMs read ``m_indices`` and the group
    sizes on the device, so no call made with it reads the routing back to the host (except
    the high-precision fallback loops, which read the sizes once).
    """

    identity = True
    padded_rows = None
    ks = None

    def __init__(self, layout) -> None:
        self.layout = layout
        self.n = self.rows = layout.rows
        self.m_indices = layout.m_indices
        self.ks_tensor = layout.sizes

    def host_counts(self, counts: list[int] | None) -> list[int]:
        """Rows of each expert's padded slice (one device-to-host read on CUDA)."""
        return self.layout.host_sizes()

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_contiguous() else t.contiguous()

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        return t


def _swap_leading(t: torch.Tensor) -> torch.Tensor:
    """``t.transpose(0, 1).contiguous()`` for a contiguous 3-D FP8 tensor, copying whole 8-byte
    words where the last dim allows: the rows stay contiguous, and torch's copy of a strided
    float8 tensor moves one byte per element at a fraction of the memory bandwidth."""
    a, b, c = t.shape
    if c % 8 or not t.is_contiguous() or t.storage_offset() % 8:
        return t.transpose(0, 1).contiguous()
    words = t.view(torch.uint8).view(torch.int64).view(a, b, c // 8)
    return words.transpose(0, 1).contiguous().view(torch.uint8).view(t.dtype).view(b, a, c)


def quantize_grouped_weight(
    weight: torch.Tensor, need_w: bool, need_wt: bool, pow2: bool
) -> tuple[torch.Tensor | None, ...]:
    """Each expert's 128x128 quantization of W[g] (Fprop's B, ``need_w``) and of W[g]ᵀ (Dgrad's
    B, ``need_wt``); ``weight`` is ``[G, N_out, K]`` float32 / bfloat16 / float16, scales are
    float32 (powers of two when ``pow2``). Raises as :func:`ptxtrain.quant.per_block_cast_to_fp8`.

    Returns ``(w_fp8 [G, N_out, K], sf [G, ⌈N_out/128⌉, ⌈K/128⌉], wt_fp8 [G, K, N_out],
    sf_t [G, ⌈K/128⌉, ⌈N_out/128⌉])``, None where not needed. With N_out a multiple of 128 the
    experts' blocks do not straddle, so one call quantizes the stacked [G·N_out, K] weight.
    """
    g, n_out, k = weight.shape
    nb, kb = ceil_div(n_out, _GEMM_BLOCK), ceil_div(k, _GEMM_BLOCK)
    if not (need_w or need_wt):
        return None, None, None, None
    if n_out % _GEMM_BLOCK == 0 and g > 0:
        flat = weight.reshape(g * n_out, k)
        if need_wt:
            w_fp8, sf, wt_fp8, sf_t = quant.per_block_cast_to_fp8_both(flat, pow2_scale=pow2)
            # wt_fp8 [K, G·N_out] → [G, K, N_out]; sf_t [⌈K/128⌉, G·Nb] → [G, ⌈K/128⌉, Nb],
            # copied K-major: the PTX m-grouped kernel (TMA) takes only a K-major B and runs the
            # dgrad ~2x faster than the Triton kernel that reads the strided view. The copy is
            # one pass over the FP8 weight per quantization, which the weight cache makes once
            # per optimizer step.
            wt_fp8 = _swap_leading(wt_fp8.view(k, g, n_out))
            sf_t = sf_t.view(kb, g, nb).transpose(0, 1).contiguous()
        else:
            w_fp8, sf = quant.per_block_cast_to_fp8(flat, pow2_scale=pow2)
            wt_fp8 = sf_t = None
        return w_fp8.view(g, n_out, k), sf.view(g, nb, kb), wt_fp8, sf_t
    # N_out tail: a 128-row block would straddle two experts, so quantize expert by expert.
    parts = [quant.per_block_cast_to_fp8_both(weight[e], pow2_scale=pow2) for e in range(g)]
    w_fp8, sf, wt_fp8, sf_t = (torch.stack([p[i] for p in parts]) for i in range(4))
    return w_fp8, sf, (wt_fp8 if need_wt else None), (sf_t if need_wt else None)


def quantize_grouped_input(
    x: torch.Tensor, layout: HostLayout, pow2: bool, row: bool, col: bool
) -> tuple[torch.Tensor | None, ...]:
    """x [N, K] scattered to the padded layout and quantized: ``(x_fp8 [R, K], sf [R, ⌈K/128⌉],
    xt_fp8 [K, R], sf_t [K, ⌈R/128⌉])`` — 1x128 tiles (``row``, Fprop's A) and 128x1 tiles stored
    transposed (``col``, Wgrad's B), one pass when both; None where not asked for.

    ``x`` is float32 / bfloat16 / float16 (after :func:`autocast_input`); e4m3 data, float32
    scales (powers of two when ``pow2``). Raises as the :mod:`ptxtrain.quant` functions.
    """
    if not (row or col):
        return None, None, None, None
    return quantize_activation(layout.scatter(x), pow2, row, col)


def _hp_grouped_mm(a: torch.Tensor, b: torch.Tensor, counts: list[int], b_t: bool) -> torch.Tensor:
    """High-precision per-expert ``a[rows of g] · (b[g]ᵀ if b_t else b[g])`` in a's dtype."""
    n_cols = b.shape[1] if b_t else b.shape[2]
    out = a.new_zeros(a.shape[0], n_cols)  # rows past the groups (a DeviceLayout's tail): 0
    start = 0
    for e, c in enumerate(counts):
        w = b[e].to(a.dtype)
        rows = a[start : start + c]
        # F.linear for Fprop: the very op nn.Linear runs, so the "bf16" recipe matches it.
        out[start : start + c] = F.linear(rows, w) if b_t else rows @ w
        start += c
    return out


def stack_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weight ``[G, ΣN_i, K]`` of parts ``[G, N_i, K]`` stacked along N (the part itself
    when there is one): what a call of :func:`fp8_grouped_apply` with a tuple multiplies by."""
    return weights[0] if len(weights) == 1 else torch.cat(tuple(weights), dim=1)


def _part_rows(weights: Sequence[torch.Tensor]) -> list[slice]:
    """Each part's rows of the stacked weight (and columns of y, rows of dyᵀ)."""
    out, start = [], 0
    for w in weights:
        out.append(slice(start, start + w.shape[1]))
        start += w.shape[1]
    return out


# Arguments of _Fp8GroupedLinearFunction.apply before the weight parts.
_N_LEADING_ARGS = 7


class _Fp8GroupedLinearFunction(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] · W[g]ᵀ`` with the GEMMs chosen by an Fp8LinearConfig, W
    the stack along N of one or more weight parts (:func:`stack_weights`).

    Inputs: x [N, K], the layout (:class:`HostLayout`, or a :class:`DeviceLayout` whose x is
    already padded: N = R), the host counts (None with a DeviceLayout), config, whether grad
    mode was on at the call, the cached weight quantization and x's shared quantization (or
    None), then the parts ``[G, N_i, K]``. Output: y [N, ΣN_i] in x's dtype. Each part gets
    its own gradient: the rows of the stacked dW that are its own, through a k-grouped GEMM of
    its own (so each can land in its own ``main_grad``).
    """

    @staticmethod
    def forward(ctx, input_hp, layout, counts, config, grad_enabled, weight_q, input_q, *weights):
        need_dx = grad_enabled and ctx.needs_input_grad[0]
        need_dws = [grad_enabled and n for n in ctx.needs_input_grad[_N_LEADING_ARGS:]]
        need_dw = any(need_dws)
        act_dtype = input_hp.dtype
        pow2 = config.pow2_scale
        keep_xt_fp8 = need_dw and config.wgrad
        need_wt = need_dx and config.dgrad
        cached_w = weight_q is not None and (weight_q[2] is not None or not need_wt)
        # The stacked high-precision weight (a copy for several parts): only where it is read.
        need_hp = not cached_w or not config.fprop or (need_dx and not need_wt)
        weight_hp = stack_weights(weights) if need_hp else None
        with autocast_off(input_hp.device.type):
            # -- x in the padded layout [R, K]: 1x128 for fprop, 128x1 (transposed [K, R]) for
            # wgrad; one pass when both. ``input_q`` (from quantize_grouped_input on these very
            # values, shared by projections of one input) supplies the parts it holds.
            input_fp8, input_sf, input_t_fp8, input_t_sf = complete_quantization(
                input_q, config.fprop, keep_xt_fp8,
                lambda row, col: quantize_grouped_input(input_hp, layout, pow2, row, col),
            )  # fmt: skip
            # -- each expert's W 128x128, and W[g]ᵀ's blocks when dgrad will need them (or the
            # caller's cached copy, ``weight_q``, made by quantize_grouped_weight from this weight).
            if cached_w:
                weight_fp8, weight_sf, weight_t_fp8, weight_t_sf = weight_q
            else:
                weight_fp8, weight_sf, weight_t_fp8, weight_t_sf = quantize_grouped_weight(
                    weight_hp, config.fprop, need_wt, pow2
                )
            # -- Fprop: y_pad [R, N_out] = x_pad · W[g]ᵀ per expert; padding rows come out zero.
            if config.fprop:
                y_pad = _grouped_gemms()[0](
                    (input_fp8, input_sf),
                    (weight_fp8, weight_sf),
                    layout.m_indices,
                    out_dtype=gemm_out_dtype(act_dtype),
                    check_indices=False,  # built by HostLayout, valid by construction
                )
                y = layout.gather(y_pad).to(act_dtype)
            else:
                y = _hp_grouped_mm(input_hp, weight_hp, layout.host_counts(counts), b_t=True)

        save_operands(
            ctx,
            weight_t=(weight_t_fp8, weight_t_sf) if need_wt else None,
            weight_hp=weight_hp if need_dx else None,
            input_t=(input_t_fp8, input_t_sf) if keep_xt_fp8 else None,
            input_hp=input_hp if need_dw else None,
        )
        ctx.layout = layout
        ctx.counts = counts
        ctx.config = config
        ctx.act_dtype = act_dtype
        ctx.need_dws = need_dws
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.part_rows = _part_rows(weights)
        g, _, k = weights[0].shape
        ctx.weight_shape = (g, ctx.part_rows[-1].stop, k)  # the stacked [G, ΣN_i, K]
        ctx.weights = weights if need_dw else None  # for main_grad_target in backward
        return y

    @staticmethod
    def backward(ctx, grad_output):
        config, layout, counts = ctx.config, ctx.layout, ctx.counts
        if not (config.dgrad and config.wgrad):  # a high-precision loop walks the experts
            counts = layout.host_counts(counts)
        need_dx, need_dw = ctx.needs_input_grad[0], any(ctx.need_dws)
        saved = saved_operands(ctx)
        pow2 = config.pow2_scale
        dy = grad_output  # [N, N_out], y's dtype
        dx = None
        dws = [None] * len(ctx.need_dws)
        with autocast_off(dy.device.type):
            fp8_dgrad, fp8_wgrad = need_dx and config.dgrad, need_dw and config.wgrad
            # -- dy in the padded layout: 1x128 along N_out (dgrad), 128x1 transposed (wgrad).
            dy_fp8, dy_sf, dy_t_fp8, dy_t_sf = quantize_grouped_input(
                dy, layout, pow2, fp8_dgrad, fp8_wgrad
            )  # [R, N_out] in the padded layout
            # -- Dgrad: dx_pad [R, K] = dy_pad · W[g], B = W[g]ᵀ [K, N_out] per expert: one GEMM
            # over the stacked N_out, its sum in fp32 inside the GEMM.
            if fp8_dgrad:
                dx_pad = _grouped_gemms()[0](
                    (dy_fp8, dy_sf),
                    (saved["weight_t_fp8"], saved["weight_t_sf"]),
                    layout.m_indices,
                    out_dtype=gemm_out_dtype(ctx.act_dtype),
                    check_indices=False,
                )
                dx = layout.gather(dx_pad).to(ctx.act_dtype)
            elif need_dx:
                dx = _hp_grouped_mm(dy, saved["weight_hp"], counts, b_t=False)
            # -- Wgrad: dW[g] [N_out, K] = dy_gᵀ · x_g over expert g's (padded) token slice.
            if fp8_wgrad:
                x_t = (saved["input_t_fp8"], saved["input_t_sf"])
                dws = _fp8_wgrad_parts(ctx, (dy_t_fp8, dy_t_sf), x_t)
            elif need_dw:
                dws = _hp_wgrad_parts(ctx, dy, saved["input_hp"], counts)
        return (dx, *[None] * (_N_LEADING_ARGS - 1), *dws)


def _fp8_wgrad_parts(ctx, dy_t: tuple, x_t: tuple) -> list[torch.Tensor | None]:
    """Each part's dW [G, N_i, K] by a k-grouped GEMM over its rows of dyᵀ's 128x1 quantization
    (``dy_t``: [ΣN_i, R] e4m3 and [ΣN_i, R/128] scales), fp32, cast to the part's dtype; or
    written into the part's ``main_grad`` (returned as None, see
    :func:`ptxtrain.nn.fp8_linear.main_grad_target`). None for a part that needs no gradient.
    """
    layout = ctx.layout
    dws: list[torch.Tensor | None] = []
    for w, rows, dtype, need in zip(
        ctx.weights, ctx.part_rows, ctx.weight_dtypes, ctx.need_dws, strict=True
    ):
        if not need:
            dws.append(None)
            continue
        target = main_grad_target(w)
        out, acc = target if target is not None else (None, False)
        dw = _grouped_gemms()[1](
            (dy_t[0][rows], dy_t[1][rows]),
            x_t,
            layout.ks,
            ks_tensor=layout.ks_tensor,
            out=out,
            accumulate=acc,
        )  # [G, N_i, K] fp32, the optimizer's buffer itself with a target
        if target is None:
            dws.append(dw.to(dtype))
        else:  # delivered into main_grad (see fp8_linear.main_grad_target)
            from ptxtrain.optim import mark_grad_ready

            mark_grad_ready(w)
            dws.append(None)
    return dws


def _hp_wgrad_parts(ctx, dy: torch.Tensor, input_hp: torch.Tensor, counts: list[int]) -> list:
    """Each part's dW in dy's dtype: the stacked dW [G, ΣN_i, K] per expert, split by rows
    and cast to each part's dtype (None for a part that needs no gradient)."""
    x_hp = input_hp.to(dy.dtype)
    dw = dy.new_zeros(ctx.weight_shape)
    start = 0
    for e, c in enumerate(counts):
        if c:
            dw[e] = dy[start : start + c].t() @ x_hp[start : start + c]
        start += c
    return [
        dw[:, rows].to(dtype) if need else None
        for rows, dtype, need in zip(ctx.part_rows, ctx.weight_dtypes, ctx.need_dws, strict=True)
    ]


def fp8_grouped_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    tokens_per_expert: torch.Tensor | Sequence[int],
    *,
    align: int = 128,
    config: Fp8LinearConfig | str | None = None,
) -> torch.Tensor:
    """Grouped linear of the MoE experts in FP8: ``y[rows of g] = x[rows of g] · weight[g]ᵀ``.

    All three GEMMs run as grouped FP8 GEMMs with DeepSeek-V3's fine-grained scaling (see the
    module note): Fprop and Dgrad through ``m_grouped_fp8_gemm_nt_contiguous``, Wgrad through
    ``k_grouped_fp8_gemm_nt_contiguous``; Triton kernels for CUDA tensors, the references on the
    CPU (same semantics). Differentiable in ``x`` and ``weight``.

    Args:
        x: [N, K] float32 / bfloat16 / float16 activations in expert-contiguous order (expert 0's
            rows, then expert 1's, ...); any N (0 included) and K.
        weight: [G, N_out, K] float32 / bfloat16 / float16, the stacked expert weights (typically
            one ``nn.Parameter``), on x's device; any N_out and K (tails allowed), G ≥ 1.
        tokens_per_expert: G counts ``n_g ≥ 0`` summing to N: a 1-D int64 / int32 tensor on the
            CPU or on x's device (read back to the host, one sync on CUDA), or a sequence of ints
            (no sync). A count of 0 is allowed.
        align: rows each expert's slice is padded to inside (internal layout only; a positive
            multiple of 128, ``get_m_alignment_for_contiguous_layout()``).
        config: an :class:`~ptxtrain.nn.Fp8LinearConfig`, a recipe name or None for
            ``"deepseek"``; selects which GEMMs run in FP8 (others run per expert in x's dtype)
            and power-of-two scales.

    Returns:
        y [N, N_out] in x's dtype, row-major. Gradients: x's [N, K] in x's dtype; weight's
        [G, N_out, K] in weight's dtype, zeros for an expert with no tokens. Under
        ``torch.autocast`` x is first cast to the autocast dtype (as Fp8Linear does).

    Raises:
        TypeError: x or weight not a tensor of a float32 / bfloat16 / float16 dtype;
            ``tokens_per_expert`` not an integer tensor or a sequence of ints; ``align`` not an
            int; ``config`` of a wrong type.
        ValueError: x not 2-D, weight not 3-D or G = 0, K of x and weight differ, x and weight on
            different devices; ``tokens_per_expert`` not 1-D, on another device, of length ≠ G,
            with a negative count or not summing to N; ``align`` not a positive multiple of 128;
            unknown recipe name.

    Source: DeepSeek-V3 report §3.3 (FP8 recipe, MoE experts); docs/design.md §1-2; DeepGEMM's
    grouped GEMM contracts.
    """
    check_tensor("x", x, dtypes=HP_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=HP_DTYPES, ndim=3)
    n, k = x.shape
    g, _, kw = weight.shape
    if g == 0:
        raise ValueError(f"weight must hold at least one expert (G ≥ 1), got {tuple(weight.shape)}")
    if kw != k:
        raise ValueError(
            f"x [N, K] and weight [G, N_out, K] must share K, got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got {x.device} and {weight.device}")
    align = _check_align(align)
    config = resolve_config(config)
    counts = _check_counts(tokens_per_expert, g, n, x.device)
    layout = HostLayout(counts, align, x.device)
    return fp8_grouped_apply(x, weight, layout, counts, config)


def autocast_input(x: torch.Tensor) -> torch.Tensor:
    """x cast to the autocast dtype when autocast is on for x's device type (as a matmul would
    be), else x itself: the dtype the grouped FP8 linear quantizes x from."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return x.to(torch.get_autocast_dtype(device_type))
    return x


def fp8_grouped_apply(
    x: torch.Tensor,
    weight: torch.Tensor | tuple[torch.Tensor, ...],
    layout: HostLayout,
    counts: list[int],
    config: Fp8LinearConfig,
    weight_q: tuple | None = None,
    input_q: tuple | None = None,
) -> torch.Tensor:
    """:func:`fp8_grouped_linear` after validation, for callers that checked their arguments
    and built ``layout`` from ``counts`` themselves (:class:`ptxtrain.moe.Experts` builds one
    layout per MoE layer for its projections). Nothing is checked here: wrong shapes or dtypes
    fail inside the kernels or give wrong results.

    Args:
        x: ``[N, K]`` (a :class:`HostLayout`) or ``[R, K]`` (a :class:`DeviceLayout`) float
            rows, expert-contiguous; cast by :func:`autocast_input`.
        weight: ``[G, N_out, K]`` float32 / bfloat16 / float16 on x's device, or a tuple of
            such parts ``[G, N_i, K]`` (one G and K) that the call stacks along N: then y is
            ``x · W[g]ᵀ`` for ``W = cat(parts, dim=1)`` (:func:`stack_weights`), bit for bit
            ``fp8_grouped_linear(x, torch.cat(parts, 1), ...)`` on the same GEMM backend, and
            each part gets the rows of dW that are its own. The FP8 operands are those of the
            stacked weight: a part's N_i that is not a multiple of 128 makes 128x128 blocks
            (and dy's 1x128 tiles) span two parts.
        layout: a :class:`HostLayout` built from ``counts``, or a :class:`DeviceLayout`.
        counts: the G host row counts (None with a DeviceLayout).
        config: the resolved :class:`~ptxtrain.nn.Fp8LinearConfig`.
        weight_q: :func:`quantize_grouped_weight`'s result for the (stacked) weight's current
            values (a cache), or None.
        input_q: ``quantize_grouped_input(autocast_input(x), layout, ...)`` for this x (shared
            by projections of one input), or None. Either is recomputed where it lacks a part
            the call needs.

    Returns:
        ``[N, ΣN_out]`` (``[R, ΣN_out]`` with a DeviceLayout) in x's (autocast) dtype, with
        autograd to x and every weight part.
    """
    x = autocast_input(x)
    grad = torch.is_grad_enabled()
    parts = weight if isinstance(weight, tuple) else (weight,)
    return _Fp8GroupedLinearFunction.apply(
        x, layout, counts, config, grad, weight_q, input_q, *parts
    )
