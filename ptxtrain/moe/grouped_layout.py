"""The experts' token layout of one MoE layer, built on the device with a size the host knows.

Design note (DeepSeek-V3 report §2.1.2, §3.3; DeepGEMM's m-grouped contiguous layout).

The routed experts want their tokens expert-contiguous, each expert's rows padded to a multiple
of ``align`` (128 for the FP8 grouped GEMMs: the m-grouped GEMM's row alignment and the k-grouped
wgrad's 1x128 scale tiles along the tokens; 1 for BF16, whose grouped GEMM takes any offsets).
How many rows that is depends on the routing, which only the GPU knows; reading it back would
stall the host in every MoE layer, forward and backward, and keep the step out of a CUDA graph.
So the layout is sized from what the host knows: ``R = T·k + min(E, T·k)·(align - 1)`` rounded up
to ``align`` is at least ``Σ_e ⌈n_e/align⌉·align`` for any routing of ``T·k`` token-slots over
``E`` experts. Expert ``e`` owns rows ``[ends[e] - sizes[e], ends[e])``; its ``n_e`` tokens fill
the first ones in token order; everything else, the tail past ``ends[E-1]`` included, is padding
(``row_slots = -1``, ``m_indices = -1``, zero rows). The grouped GEMMs read the group of each row
(``m_indices``) or the group sizes (``sizes``) on the device; a tile of padding rows costs the
FP8 GEMM a store of zeros, nothing more.

Two moves, each one kernel on CUDA with a torch twin for the CPU:

- :func:`scatter_to_layout` ``x [T, D] -> x_pad [R, D]``: row ``r`` copies token
  ``row_slots[r] // k`` or is zero. A gather by row (each row written once, coalesced); its
  backward sums each token's ``k`` rows (:func:`combine_from_layout` with unit weights).
- :func:`combine_from_layout` ``y_pad [R, D], w [T, k] -> y [T, D]``:
  ``y[t] = Σ_j w[t, j] · y_pad[slot_rows[t, j]]``, each product rounded to fp32 and the sum taken
  in fp32 in ascending row order (the order in which ``index_add`` on the CPU adds the rows of
  :func:`ptxtrain.moe.ref.unpermute_ref`, so the values are those of the unpadded path), one cast.
  Its backward is a weighted gather into the layout (zero padding rows) and, for the gate
  weights, each slot's fp32 dot product ``⟨∂L/∂y[t], y_pad[row]⟩``, both in one pass over
  ``y_pad`` on CUDA.

Nothing here reads a device value on the host: building the layout is a stable sort, a count,
prefix sums and index writes whose sizes are ``T·k``, ``E`` and ``R``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ptxtrain._checks import ceil_div, check_positive_int, check_tensor
from ptxtrain.moe.ref import count_per_expert

__all__ = [
    "GroupedLayout",
    "build_grouped_layout",
    "combine_from_layout",
    "layout_rows",
    "scatter_to_layout",
]


@dataclass(frozen=True, eq=False)
class GroupedLayout:
    """Where each (token, slot) of one routing lands among the experts' padded rows.

    Host fields: ``num_tokens`` (T), ``top_k`` (k), ``num_experts`` (E), ``align`` and ``rows``
    (R, :func:`layout_rows`). Device tensors (on the routing's device):

    - ``slot_rows`` ``[T, k]`` int64: the row of slot ``(t, j)``;
    - ``row_slots`` ``[R]`` int64: the slot ``t·k + j`` of each row, -1 for padding;
    - ``m_indices`` ``[R]`` int32: the expert of each row, -1 for padding (the m-grouped GEMM's);
    - ``counts`` ``[E]`` int64: tokens per expert ``n_e``;
    - ``sizes`` ``[E]`` int32: rows per expert ``⌈n_e/align⌉·align`` (the k-grouped GEMM's K of
      each group);
    - ``ends`` ``[E]`` int32: the end row of each expert (prefix sums of ``sizes``; the ``offs`` of
      ``torch._grouped_mm``).
    """

    num_tokens: int
    top_k: int
    num_experts: int
    align: int
    rows: int
    slot_rows: torch.Tensor
    row_slots: torch.Tensor
    m_indices: torch.Tensor
    counts: torch.Tensor
    sizes: torch.Tensor
    ends: torch.Tensor

    def host_sizes(self) -> list[int]:
        """``sizes`` as host ints (one device-to-host read on CUDA: for paths that loop over the
        experts on the host, such as the CPU reference)."""
        return [int(v) for v in self.sizes.tolist()]


def layout_rows(num_slots: int, num_experts: int, align: int) -> int:
    """Rows of the padded layout of ``num_slots`` token-slots over ``num_experts`` experts: the
    largest ``Σ_e ⌈n_e/align⌉·align`` any routing can need, ``S + min(E, S)·(align - 1)`` rounded
    up to a multiple of ``align`` (0 for ``S = 0``).

    Raises:
        ValueError / TypeError: ``num_slots`` not an int ≥ 0, ``num_experts`` or ``align`` not a
            positive int.
    """
    if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 0:
        raise ValueError(f"num_slots must be an int >= 0, got {num_slots!r}")
    check_positive_int("num_experts", num_experts)
    check_positive_int("align", align)
    if num_slots == 0:
        return 0
    return ceil_div(num_slots + min(num_experts, num_slots) * (align - 1), align) * align


def build_grouped_layout(topk_idx: torch.Tensor, num_experts: int, align: int) -> GroupedLayout:
    """The padded expert-contiguous layout of a routing, with no host sync.

    Row order inside an expert is ascending slot ``t·k + j`` (the stable order of
    :func:`ptxtrain.moe.ref.permute_ref`), so the real rows are the unpadded permutation's rows,
    each expert's slice moved to its padded start.

    Args:
        topk_idx: ``[T, k]`` int64 expert ids in ``[0, num_experts)`` (not checked: an id outside
            it would need a host read to detect; the router's top-k is valid by construction).
        num_experts: ``E``.
        align: rows each expert's slice is padded to a multiple of (128 for the FP8 grouped
            GEMMs, 1 for none).

    Returns:
        :class:`GroupedLayout` on ``topk_idx``'s device.

    Raises:
        TypeError / ValueError: ``topk_idx`` not a 2-D int64 tensor; ``num_experts`` or ``align``
            not a positive int.

    Source: DeepGEMM ``m_grouped_fp8_gemm_nt_contiguous`` (layout); torchtitan's token-group
    alignment; docs/design.md §2, §4.
    """
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    n_tokens, k = topk_idx.shape
    n_slots = n_tokens * k
    rows = layout_rows(n_slots, num_experts, align)
    dev = topk_idx.device
    flat = topk_idx.reshape(-1)  # [S] expert of each slot
    counts = count_per_expert(flat, num_experts)  # [E]
    sizes = (counts + align - 1) // align * align  # [E]
    ends = torch.cumsum(sizes, 0)  # [E]
    order = flat.argsort(stable=True)  # [S] slots in expert order
    expert = flat.index_select(0, order)  # [S] expert of each permuted position
    # permuted position i of expert e -> row i - (its first position) + (its first padded row)
    shift = (ends - sizes) - (torch.cumsum(counts, 0) - counts)  # [E]
    perm_rows = torch.arange(n_slots, device=dev) + shift.index_select(0, expert)  # [S]
    slot_rows = torch.empty(n_slots, dtype=torch.int64, device=dev)
    slot_rows.scatter_(0, order, perm_rows)
    row_slots = torch.full((rows,), -1, dtype=torch.int64, device=dev)
    row_slots.scatter_(0, perm_rows, order)
    m_indices = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    m_indices.scatter_(0, perm_rows, expert.to(torch.int32))
    return GroupedLayout(
        num_tokens=n_tokens,
        top_k=k,
        num_experts=num_experts,
        align=align,
        rows=rows,
        slot_rows=slot_rows.view(n_tokens, k),
        row_slots=row_slots,
        m_indices=m_indices,
        counts=counts,
        sizes=sizes.to(torch.int32),
        ends=ends.to(torch.int32),
    )


# --------------------------------------------------------------------------------------------
# Torch twins (any device; the CPU path)
# --------------------------------------------------------------------------------------------


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def torch_layout_gather(
    src: torch.Tensor, layout: GroupedLayout, weights=None, dot_with=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``out[r] = w[s] · src[s // k]`` for ``s = row_slots[r] ≥ 0`` (product in fp32, one cast;
    ``w = 1`` when ``weights`` is None), zero rows elsewhere; with ``dot_with`` also
    ``dots[s] = Σ_d src[s // k, d] · dot_with[r, d]`` in fp32 for every slot ``s`` (slot order).
    The twin of :func:`ptxtrain.moe.triton.layout_gather`.
    """
    row_slots, top_k = layout.row_slots, layout.top_k
    n_tokens = src.shape[0]
    valid = row_slots >= 0
    token = torch.where(valid, row_slots // top_k, n_tokens)  # padding -> the zero row T
    acc = _acc(src.dtype)
    rows = torch.cat([src.to(acc), src.new_zeros(1, src.shape[1], dtype=acc)]).index_select(
        0, token
    )  # [R, D]
    out = rows
    if weights is not None:
        w = torch.cat([weights.reshape(-1).to(acc), weights.new_zeros(1, dtype=acc)])
        out = rows * w.index_select(0, torch.where(valid, row_slots, w.numel() - 1)).unsqueeze(1)
    dots = None
    if dot_with is not None:
        per_row = (rows * dot_with.to(acc)).sum(1)  # [R]
        n_slots = n_tokens * top_k
        dots = per_row.new_zeros(n_slots + 1)
        dots.scatter_(0, torch.where(valid, row_slots, n_slots), per_row)
        dots = dots[:n_slots]
    return out.to(src.dtype), dots


def torch_layout_combine(y: torch.Tensor, layout: GroupedLayout, weights=None) -> torch.Tensor:
    """``out[t] = Σ_j w[t, j] · y[slot_rows[t, j]]``: fp32 products (``w = 1`` when None), summed
    from 0 in ascending row order, one cast to ``y``'s dtype. The twin of
    :func:`ptxtrain.moe.triton.layout_combine`."""
    acc = _acc(y.dtype)
    slot_rows = layout.slot_rows
    n_tokens, k = slot_rows.shape
    rows, order = slot_rows.sort(dim=1)  # ascending rows per token
    out = torch.zeros(n_tokens, y.shape[1], dtype=acc, device=y.device)
    for j in range(k):
        term = y.index_select(0, rows[:, j]).to(acc)  # [T, D]
        if weights is not None:
            term = term * weights.to(acc).gather(1, order[:, j : j + 1])
        out = out + term
    return out.to(y.dtype)


# --------------------------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------------------------


def _gather(src, layout, triton, weights=None, dot_with=None):
    if triton:
        from ptxtrain.moe.triton import layout_gather

        return layout_gather(src, layout.row_slots, layout.top_k, weights, dot_with)
    return torch_layout_gather(src, layout, weights, dot_with)


def _combine(y, layout, triton, weights=None):
    if triton:
        from ptxtrain.moe.triton import layout_combine

        return layout_combine(y, layout.slot_rows, weights)
    return torch_layout_combine(y, layout, weights)


class _ScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout, triton):
        ctx.layout, ctx.triton = layout, triton
        return _gather(x, layout, triton)[0]

    @staticmethod
    def backward(ctx, grad_pad):
        return _combine(grad_pad.contiguous(), ctx.layout, ctx.triton), None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_pad, weights, layout, triton):
        ctx.layout, ctx.triton = layout, triton
        ctx.save_for_backward(y_pad, weights)
        return _combine(y_pad, layout, triton, weights)

    @staticmethod
    def backward(ctx, grad_out):
        y_pad, weights = ctx.saved_tensors
        need_y, need_w = ctx.needs_input_grad[:2]
        grad_y, dots = _gather(
            grad_out.contiguous(), ctx.layout, ctx.triton, weights, y_pad if need_w else None
        )
        grad_w = dots.view(weights.shape).to(weights.dtype) if need_w else None
        return (grad_y if need_y else None), grad_w, None, None


def _check_layout(layout: object) -> GroupedLayout:
    if not isinstance(layout, GroupedLayout):
        raise TypeError(f"layout must be a GroupedLayout, got {type(layout).__name__}")
    return layout


def scatter_to_layout(
    x: torch.Tensor, layout: GroupedLayout, *, triton: bool = False
) -> torch.Tensor:
    """Copy each token to its ``k`` rows of the layout: ``[T, D] -> [R, D]``, zero padding rows.

    Args:
        x: ``[T, D]`` float tokens (T = ``layout.num_tokens``).
        layout: from :func:`build_grouped_layout`.
        triton: run the Triton kernel (CUDA, or the CPU under ``TRITON_INTERPRET=1``) instead of
            the torch twin; same values.

    Returns:
        ``[R, D]`` in ``x``'s dtype. Gradient w.r.t. ``x``: the sum of each token's ``k`` rows,
        fp32 in ascending row order, cast to ``x``'s dtype.

    Raises:
        TypeError / ValueError: ``layout`` not a :class:`GroupedLayout`, ``x`` not a 2-D float
            tensor with ``layout.num_tokens`` rows on the layout's device.
    """
    layout = _check_layout(layout)
    check_tensor("x", x, ndim=2)
    if not x.is_floating_point() or x.shape[0] != layout.num_tokens:
        raise ValueError(
            f"x must be a float [T = {layout.num_tokens}, D] tensor, got {x.dtype} {tuple(x.shape)}"
        )
    if x.device != layout.row_slots.device:
        raise ValueError(
            f"x must be on the layout's device {layout.row_slots.device}, got {x.device}"
        )
    return _ScatterFn.apply(x.contiguous(), layout, triton)


def combine_from_layout(
    y_pad: torch.Tensor, weights: torch.Tensor, layout: GroupedLayout, *, triton: bool = False
) -> torch.Tensor:
    """Gate-weighted sum of each token's expert rows: ``[R, D], [T, k] -> [T, D]``.

    ``y[t] = Σ_j weights[t, j] · y_pad[slot_rows[t, j]]`` (see the module note for the rounding).

    Args:
        y_pad: ``[R, D]`` float expert outputs in the layout (padding rows are not read).
        weights: ``[T, k]`` float gate weights (differentiable).
        layout: from :func:`build_grouped_layout`.
        triton: as in :func:`scatter_to_layout`.

    Returns:
        ``[T, D]`` in ``y_pad``'s dtype. Gradients: ``y_pad``'s (``w · ∂L/∂y[t]`` on each token's
        rows, zeros on padding rows) and ``weights``' (fp32 row dot products, cast to its dtype).

    Raises:
        TypeError / ValueError: wrong types, shapes or devices.
    """
    layout = _check_layout(layout)
    check_tensor("y_pad", y_pad, ndim=2)
    check_tensor("weights", weights, ndim=2)
    if y_pad.shape[0] != layout.rows or not y_pad.is_floating_point():
        raise ValueError(
            f"y_pad must be a float [R = {layout.rows}, D] tensor, got {y_pad.dtype} "
            f"{tuple(y_pad.shape)}"
        )
    if tuple(weights.shape) != (layout.num_tokens, layout.top_k):
        raise ValueError(
            f"weights must be [T, k] = [{layout.num_tokens}, {layout.top_k}], got "
            f"{tuple(weights.shape)}"
        )
    dev = layout.slot_rows.device
    if y_pad.device != dev or weights.device != dev:
        raise ValueError(
            f"y_pad and weights must be on the layout's device {dev}, got {y_pad.device} and "
            f"{weights.device}"
        )
    return _CombineFn.apply(y_pad.contiguous(), weights, layout, triton)
