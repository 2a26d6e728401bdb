"""Autograd around the Triton MoE kernels, and the FP8 expert-parallel dispatch, for the MoE layer.

Design note (DeepSeek-V3 report §2.1.2, §3.2.2, §3.3; docs/design.md §4).

:mod:`ptxtrain.moe.triton` holds forward-only kernels, exact twins of :mod:`ptxtrain.moe.ref`.
This module gives each one the backward the reference's autograd has, so that
:class:`ptxtrain.moe.MoE` can swap them in (``MoE.kernels``) without changing its gradients:

- Routing (:func:`route_fused`). The router GEMM ``logits = x·Wᵀ`` stays a torch matmul in fp32
  (the very op of :func:`~ptxtrain.moe.ref.route_ref`), so ``x`` and ``W`` get their gradients
  from torch. ``_RouteFn`` runs :func:`~ptxtrain.moe.triton.fused_route` (sigmoid, bias, group
  limit, top-k, normalized gates; bitwise the reference's values) and its backward is the
  reference graph's, written out: with ``s = sigmoid(logits)``, ``g = s[idx]``, ``Σ = g_0 + … +
  g_{k-1} + 1e-20``, ``w = g / Σ · route_scale``, ``∂L/∂g_i = (r·ḡw_i)/Σ - Σ_j (r·ḡw_j)·g_j/Σ²``
  (``r = route_scale``), scattered into ``[T, E]``, plus the gradient of the returned ``scores``
  (the balance loss uses them), times ``s·(1 - s)``. The selection (``s + b``, top-k) has no
  gradient, as in the reference (``scores.detach() + bias``). The router's expert counters and
  balance loss are updated as :meth:`ptxtrain.moe.Router.forward` does.
- Permutation (:func:`permute_fused`). Forward: the row gather of
  :func:`~ptxtrain.moe.ref.permute_ref` (one ``index_select``; the experts need the
  high-precision rows: the FP8 grouped GEMMs quantize them themselves, 1x128 for Fprop and 128x1
  along tokens for Wgrad, in their own padded layout, so
  :func:`~ptxtrain.moe.triton.permute_quant`'s FP8 rows cannot replace them). Backward: the
  gather-sum of every token's ``k`` slot rows, which is
  :func:`~ptxtrain.moe.triton.unpermute_weighted` with unit weights: fp32 accumulation in
  ascending row order, one cast, deterministic (the reference's ``index_add`` uses atomics on
  CUDA, and adds in the activation dtype).
- Weighted un-permutation (:func:`unpermute_fused`). Forward:
  :func:`~ptxtrain.moe.triton.unpermute_weighted`. Backward (torch, the reference graph's ops):
  ``∂L/∂y_perm[r] = w[slot_r] · ∂L/∂out[token_r]`` (fp32 product, cast to ``y_perm``'s dtype) and
  ``∂L/∂w[slot_r] = ⟨∂L/∂out[token_r], y_perm[r]⟩`` (fp32 row dot products).
- FP8 dispatch (:func:`dispatch_fp8`). ``Buffer.dispatch`` moves an ``(x_fp8, sf)`` pair as raw
  bytes, with no autograd link to ``x`` (only the gate weights are differentiable there). Here
  ``x`` is quantized 1x128 (:func:`ptxtrain.quant.per_token_cast_to_fp8`), the pair dispatched,
  and the received rows dequantized to ``x``'s dtype by ``_Fp8RecvFn``, whose backward is
  ``Buffer.combine`` of the received rows' gradient in that dtype (fp32 accumulation inside):
  the quantization counts as the identity for the gradient, as for ``Fp8Linear``'s input, and the
  gradient travels BF16 (the activation dtype) as in DeepSeek-V3's combine.

Kernels are imported at call time, so ``import ptxtrain.moe`` needs no Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ptxtrain._backend import KERNEL_CHOICES, use_triton_kernels
from ptxtrain._checks import HP_DTYPES, check_tensor

__all__ = [
    "KERNEL_CHOICES",
    "dispatch_fp8",
    "permute_fused",
    "route_fused",
    "unpermute_fused",
    "use_triton_kernels",
]


def _mt():
    from ptxtrain.moe import triton as mt

    return mt


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------


class _RouteFn(torch.autograd.Function):
    """``fused_route`` with the reference graph's backward to the logits (see the note)."""

    @staticmethod
    def forward(ctx, logits, bias, top_k, n_groups, n_limited_groups, route_scale):
        topk_idx, topk_weights, scores = _mt().fused_route(
            logits, bias, top_k=top_k, n_groups=n_groups, n_limited_groups=n_limited_groups,
            route_scale=route_scale,
        )  # fmt: skip
        ctx.route_scale = float(route_scale)
        ctx.logits_dtype = logits.dtype
        ctx.mark_non_differentiable(topk_idx)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(scores, topk_idx)
        return topk_idx, topk_weights, scores

    @staticmethod
    def backward(ctx, _grad_idx, grad_weights, grad_scores):
        scores, topk_idx = ctx.saved_tensors  # [T, E] fp32, [T, k]
        grad_s = torch.zeros_like(scores) if grad_scores is None else grad_scores.float()
        if grad_weights is not None:
            gates = scores.gather(1, topk_idx)  # [T, k]
            denom = gates[:, :1]  # left to right, as the forward
            for j in range(1, gates.shape[1]):
                denom = denom + gates[:, j : j + 1]
            denom = denom + 1e-20  # [T, 1]
            grad_q = grad_weights.float() * ctx.route_scale  # [T, k], d/d(g / Σ)
            grad_denom = -(grad_q * (gates / denom) / denom).sum(1, keepdim=True)  # [T, 1]
            grad_gates = grad_q / denom + grad_denom  # [T, k]
            grad_s = grad_s.scatter_add(1, topk_idx, grad_gates)  # [T, E]
        grad_logits = grad_s * (1 - scores) * scores  # sigmoid'
        return grad_logits.to(ctx.logits_dtype), None, None, None, None, None


class _PermuteFn(torch.autograd.Function):
    """Row gather to expert order; backward = Triton gather-sum of the ``k`` slot rows."""

    @staticmethod
    def forward(ctx, x, topk_idx, num_experts, num_valid):
        from ptxtrain.moe.ref import permute_ref

        x_perm, sorted_slots, tokens_per_expert = permute_ref(
            x, topk_idx, num_experts, check_ids=False, num_valid=num_valid
        )  # ids checked by permute_fused
        ctx.shape = tuple(topk_idx.shape)  # (T, k)
        ctx.num_valid = num_valid
        ctx.mark_non_differentiable(sorted_slots, tokens_per_expert)
        ctx.save_for_backward(sorted_slots)
        return x_perm, sorted_slots, tokens_per_expert

    @staticmethod
    def backward(ctx, grad_perm, _grad_slots, _grad_counts):
        (sorted_slots,) = ctx.saved_tensors
        n_tokens, k = ctx.shape
        ones = torch.ones((n_tokens, k), dtype=torch.float32, device=grad_perm.device)
        # The slots are the forward's own permutation: no range check (a host sync that
        # would wait for the whole backward queued so far).
        grad_x = _mt().unpermute_weighted(
            grad_perm, sorted_slots, ones, n_tokens, check_slots=False, num_valid=ctx.num_valid
        )  # [T, D]
        return grad_x, None, None, None


class _UnpermuteFn(torch.autograd.Function):
    """Triton weighted un-permutation; backward to the permuted rows and to the gate weights."""

    @staticmethod
    def forward(ctx, y_perm, sorted_slots, topk_weights, check_slots, num_valid):
        n_tokens = topk_weights.shape[0]
        out = _mt().unpermute_weighted(
            y_perm, sorted_slots, topk_weights, n_tokens, check_slots=check_slots,
            num_valid=num_valid,
        )  # fmt: skip
        ctx.save_for_backward(y_perm, sorted_slots, topk_weights)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        y_perm, sorted_slots, topk_weights = ctx.saved_tensors
        k = topk_weights.shape[1]
        kept = sorted_slots[: y_perm.shape[0]]  # the positions with a row in y_perm
        grad_rows = grad_out.float().index_select(0, kept // k)  # [rows, D] fp32
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            w_perm = topk_weights.float().flatten().index_select(0, kept)  # [rows]
            grad_y = (grad_rows * w_perm.unsqueeze(1)).to(y_perm.dtype)  # [rows, D]
        if ctx.needs_input_grad[2]:
            dots = (grad_rows * y_perm.float()).sum(1)  # [rows] fp32, permuted order
            # slot order; a slot without a row (past num_valid) added nothing: gradient 0
            n = sorted_slots.shape
            grad_w = dots.new_empty(n) if kept.shape == n else dots.new_zeros(n)
            grad_w.index_copy_(0, kept, dots)
            grad_w = grad_w.view(topk_weights.shape).to(topk_weights.dtype)  # [T, k]
        return grad_y, None, grad_w, None, None


class _Fp8RecvFn(torch.autograd.Function):
    """Dequantized received FP8 rows; backward = ``Buffer.combine`` of their gradient to ``x``."""

    @staticmethod
    def forward(ctx, x, recv_fp8, recv_sf, buffer, handle):
        from ptxtrain.quant import per_token_cast_back

        ctx.buffer, ctx.handle = buffer, handle
        return per_token_cast_back(recv_fp8, recv_sf, out_dtype=x.dtype)  # [N, D]

    @staticmethod
    def backward(ctx, grad_recv):
        grad_x = ctx.buffer.combine(grad_recv.contiguous(), ctx.handle)[0]  # [T, D], collective
        return grad_x, None, None, None, None


# --------------------------------------------------------------------------------------------
# Functions the layer calls
# --------------------------------------------------------------------------------------------


def route_fused(router, x: torch.Tensor, *, seq_len: int | None = None):
    """:meth:`ptxtrain.moe.Router.forward` (with ``return_aux_loss=True``) on the Triton kernel.

    Same results (bitwise: the same fp32 logits GEMM, then
    :func:`~ptxtrain.moe.triton.fused_route`), the same gradient path (gates differentiable
    w.r.t. ``x`` and ``router.weight`` through the logits; selection not), the same side effects
    (``router.expert_counts`` in training mode).

    Args:
        router: the :class:`~ptxtrain.moe.Router`.
        x: ``[N, D]`` float32 / bfloat16 / float16 activations on CUDA (or the CPU under
            ``TRITON_INTERPRET=1``).
        seq_len: tokens per sequence for the balance loss (``None`` = one sequence).

    Returns:
        ``(topk_idx [N, k] int64, topk_weights [N, k] fp32, aux_loss)`` as the router's.

    Raises:
        TypeError / ValueError: ``x`` is not a float ``[N, D]`` tensor the kernel takes, or is not
            on a device it runs on; ``seq_len`` does not divide ``N``.

    Source: DeepSeek-V3 report §2.1.2; docs/design.md §4.
    """
    check_tensor("x", x, dtypes=HP_DTYPES, ndim=2)
    if x.shape[1] != router.dim:
        raise ValueError(f"x must be [N, {router.dim}], got {tuple(x.shape)}")
    logits = F.linear(x.float(), router.weight.float())  # [N, E] fp32, route_ref's GEMM
    topk_idx, topk_weights, scores = _RouteFn.apply(
        logits, router.bias, router.top_k, router.n_groups, router.n_limited_groups,
        router.route_scale,
    )  # fmt: skip
    return topk_idx, topk_weights, router.account_routing(topk_idx, scores, seq_len)


def permute_fused(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    *,
    check_ids: bool = True,
    num_valid: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`ptxtrain.moe.ref.permute_ref` whose backward is the Triton gather-sum.

    Args and returns: as :func:`~ptxtrain.moe.ref.permute_ref` (``x`` float32 / bfloat16 /
    float16 on CUDA, or the CPU under ``TRITON_INTERPRET=1``; duplicates in a row allowed;
    ``check_ids`` and ``num_valid`` as there).
    Gradient w.r.t. ``x``: ``[T, D]`` in ``x``'s dtype, the sum of the ``k`` slot rows' gradients
    accumulated in fp32.

    Raises:
        TypeError / ValueError: as :func:`~ptxtrain.moe.ref.permute_ref`; in backward, as
            :func:`~ptxtrain.moe.triton.unpermute_weighted`.
    """
    if check_ids and isinstance(topk_idx, torch.Tensor) and topk_idx.dtype == torch.int64:
        from ptxtrain.moe.ref import check_expert_ids

        check_expert_ids(topk_idx, num_experts)  # (other bad inputs: permute_ref raises)
    return _PermuteFn.apply(x, topk_idx, num_experts, num_valid)


def unpermute_fused(
    y_perm: torch.Tensor,
    sorted_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    check_slots: bool = True,
    num_valid: int | None = None,
) -> torch.Tensor:
    """:func:`ptxtrain.moe.triton.unpermute_weighted` with autograd (bitwise ``unpermute_ref``
    on the CPU).

    Args:
        y_perm: ``[T·k, D]`` float32 / bfloat16 / float16 expert outputs in permuted order.
        sorted_slots: ``[T·k]`` int64 from the permutation.
        topk_weights: ``[T, k]`` float gate weights.
        check_slots: as :func:`~ptxtrain.moe.triton.unpermute_weighted` (False: the caller
            made ``sorted_slots`` itself; no host sync).
        num_valid: ``y_perm`` holds the first ``num_valid`` permuted rows only, as there.

    Returns:
        ``[T, D]`` in ``y_perm``'s dtype. Gradients: ``y_perm``'s (``w · grad_out`` rows) and
        ``topk_weights``' (fp32 row dot products, cast to its dtype).

    Raises:
        TypeError / ValueError: as :func:`~ptxtrain.moe.triton.unpermute_weighted`.
    """
    return _UnpermuteFn.apply(y_perm, sorted_slots, topk_weights, check_slots, num_valid)


def dispatch_fp8(
    buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
) -> tuple:
    """FP8 expert-parallel dispatch: quantize 1x128, ``buffer.dispatch`` the pair, dequantize.

    Args:
        buffer: the :class:`~ptxtrain.ep.Buffer`.
        x: ``[T, D]`` float32 / bfloat16 / float16 tokens (``T`` may be 0).
        topk_idx / topk_weights / num_experts: as :meth:`~ptxtrain.ep.Buffer.dispatch`.

    Returns:
        As :meth:`~ptxtrain.ep.Buffer.dispatch`, except ``recv_x``: ``[N, D]`` in ``x``'s dtype,
        the received rows dequantized (each the 1x128 FP8 quantization of its source token).
        Differentiable w.r.t. ``x`` (backward: ``buffer.combine`` of the gradient in ``x``'s
        dtype, a collective) and ``topk_weights`` (``Buffer``'s own backward).

    Raises:
        TypeError / ValueError: as :func:`ptxtrain.quant.per_token_cast_to_fp8` and
            :meth:`~ptxtrain.ep.Buffer.dispatch`.

    Source: DeepSeek-V3 report §3.3 (FP8 dispatch, BF16 combine); docs/design.md §4.
    """
    from ptxtrain.quant import per_token_cast_to_fp8

    x_fp8, sf = per_token_cast_to_fp8(x.detach())  # [T, D] e4m3, [T, ⌈D/128⌉] fp32
    (recv_fp8, recv_sf), recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        (x_fp8, sf), topk_idx=topk_idx, topk_weights=topk_weights, num_experts=num_experts
    )
    recv_x = _Fp8RecvFn.apply(x, recv_fp8, recv_sf, buffer, handle)  # [N, D]
    return recv_x, recv_idx, recv_w, counts, handle, event
