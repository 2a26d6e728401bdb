"""Pure-PyTorch references of the MoE routing math and the token permutation (DeepSeek-V3 §2.1.2).

These functions are *the* definition: :class:`ptxtrain.moe.Router` and :class:`ptxtrain.moe.MoE`
call them, and future GPU kernels (fused gate + top-k, permutation, the expert-parallel
dispatch/combine) are tested against them. Everything is differentiable where it should be
(gate weights with respect to the router input and weight; permuted rows; the un-permute).

Permutation convention. With ``T`` tokens and top-``k`` routing, the ``T·k`` (token, slot) pairs
are numbered ``slot = t·k + j`` (row-major over ``topk_idx [T, k]``). ``permute_ref`` sorts them
by expert with a *stable* sort, so rows of one expert are contiguous and in ascending token
order; ``sorted_slots [T·k]`` maps permuted row -> slot, and ``sorted_slots // k`` is the source
token. ``tokens_per_expert [E]`` gives the slice lengths (what a grouped GEMM needs).

``permute_quant_ref`` adds what an FP8 grouped GEMM wants: the permuted rows quantized 1x128
(:func:`ptxtrain.quant.ref.per_token_cast_to_fp8`) and, optionally, each expert's slice padded to
an M alignment, with ``m_indices`` (expert of each row, -1 for padding rows) as DeepGEMM's
m-grouped contiguous GEMM reads it (:func:`grouped_layout_ref`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ptxtrain.ep.layout import count_per_expert  # the EP layout's counter, shared
from ptxtrain.quant.ref import per_token_cast_to_fp8

__all__ = [
    "PermuteQuantResult",
    "check_routing",
    "count_per_expert",
    "grouped_layout_ref",
    "permute_quant_ref",
    "permute_ref",
    "route_from_logits_ref",
    "route_ref",
    "seq_balance_loss_ref",
    "unpermute_ref",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (float64 reference runs stay float64 end to end)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def route_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    n_groups: int,
    n_limited_groups: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid routing with selection-only bias and group-limited top-k (report eqs. 12-16).

    ``s = sigmoid(x · weightᵀ)`` in fp32 (fp64 when ``x`` is fp64). Selection uses ``s + bias``:
    each group of ``E / n_groups`` consecutive experts is scored by the sum of its two largest
    ``s + bias`` (its single largest when a group has one expert), the ``n_limited_groups`` best
    groups are kept, and the top-``k`` experts among them are chosen. Gate weights are the chosen
    ``s`` (bias not included) normalized to sum 1, times ``route_scale``. Equal selection scores
    go to the lower expert (group) index; the exact order of operations is that of
    :func:`route_from_logits_ref`, which this calls with ``logits = x · weightᵀ``.

    Args:
        x: ``[T, D]`` token activations, any float dtype (upcast to fp32).
        weight: ``[E, D]`` router weight (the expert centroids ``e_i``), any float dtype.
        bias: ``[E]`` fp32 selection bias ``b_i`` (auxiliary-loss-free balancing).
        top_k, n_groups, n_limited_groups, route_scale: as in ``DeepSeekV3Config``
            (``n_activated_experts``, ``n_expert_groups``, ``n_limited_groups``, ``route_scale``).

    Returns:
        ``topk_idx [T, k]`` int64 expert ids, ordered by descending ``s + bias``;
        ``topk_weights [T, k]`` fp32 (fp64 for fp64 ``x``), each row summing to ``route_scale``;
        ``scores [T, E]`` same dtype, the affinities ``s`` (for the balance loss).

    Raises:
        ValueError: shapes disagree, or ``top_k`` / the groups do not fit ``E``.
    """
    if x.dim() != 2 or weight.dim() != 2 or bias.dim() != 1:
        raise ValueError(
            f"route_ref needs x [T, D], weight [E, D], bias [E]; got {tuple(x.shape)}, "
            f"{tuple(weight.shape)}, {tuple(bias.shape)}"
        )
    n_experts = weight.shape[0]
    if x.shape[1] != weight.shape[1] or bias.shape[0] != n_experts:
        raise ValueError(
            f"route_ref: x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
            f"{tuple(bias.shape)} disagree on D or E"
        )
    check_routing(n_experts, top_k, n_groups, n_limited_groups)
    acc = _acc_dtype(x.dtype)
    logits = torch.nn.functional.linear(x.to(acc), weight.to(acc))  # [T, E]
    return route_from_logits_ref(
        logits, bias, top_k=top_k, n_groups=n_groups, n_limited_groups=n_limited_groups,
        route_scale=route_scale,
    )  # fmt: skip


def check_routing(n_experts: int, top_k: int, n_groups: int, n_limited_groups: int) -> int:
    """Validate the routing hyper-parameters against ``E``; return experts per group.

    Raises:
        ValueError: ``n_groups`` does not divide ``E``, ``n_limited_groups`` is not in
            ``[1, n_groups]``, or ``top_k`` is not in ``[1, n_limited_groups · E / n_groups]``.
    """
    if n_groups <= 0 or n_experts % n_groups != 0:
        raise ValueError(f"n_groups must divide E={n_experts}, got n_groups={n_groups}")
    per_group = n_experts // n_groups
    if not 0 < n_limited_groups <= n_groups:
        raise ValueError(f"n_limited_groups must be in [1, {n_groups}], got {n_limited_groups}")
    if not 0 < top_k <= n_limited_groups * per_group:
        raise ValueError(
            f"top_k must be in [1, n_limited_groups x experts per group = "
            f"{n_limited_groups * per_group}], got {top_k}"
        )
    return per_group


def _top_indices(values: torch.Tensor, n: int) -> torch.Tensor:
    """Indices of the ``n`` largest entries of each row, largest first, ties to the lower index.

    A stable descending sort, so the order is defined on every device (``torch.topk`` leaves the
    order of equal values to the implementation, and CPU and CUDA differ).
    """
    return values.sort(dim=-1, descending=True, stable=True).indices[:, :n]


def route_from_logits_ref(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    n_groups: int,
    n_limited_groups: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`route_ref` from the router logits ``u = x · weightᵀ`` (the GEMM done by the caller).

    ``s = sigmoid(logits)`` in fp32 (fp64 for fp64 logits); selection, group limit and gates as
    in :func:`route_ref`. The order of operations is part of the contract, so that kernels can
    match it bit for bit: the group score is ``top1 + top2`` of ``s + bias``; equal selection
    scores (groups or experts) go to the **lower index** first; the gate denominator is the
    left-to-right sum ``((g_0 + g_1) + g_2) + ...`` of the chosen ``s`` in selection order, and
    ``topk_weights = g / (denominator + 1e-20) * route_scale`` (IEEE division, then a multiply).
    NaN logits give unspecified choices.

    Args:
        logits: ``[T, E]`` router logits, any float dtype (upcast to fp32).
        bias: ``[E]`` selection bias (upcast like ``logits``).
        top_k, n_groups, n_limited_groups, route_scale: as in :func:`route_ref`.

    Returns:
        ``(topk_idx [T, k] int64, topk_weights [T, k], scores [T, E])`` as :func:`route_ref`.

    Raises:
        ValueError: ``logits`` is not 2-D, ``bias`` is not ``[E]``, or the routing
            hyper-parameters do not fit ``E`` (see :func:`check_routing`).
    """
    if logits.dim() != 2 or bias.dim() != 1 or bias.shape[0] != logits.shape[1]:
        raise ValueError(
            f"route_from_logits_ref needs logits [T, E] and bias [E]; got "
            f"{tuple(logits.shape)} and {tuple(bias.shape)}"
        )
    n_tokens, n_experts = logits.shape
    per_group = check_routing(n_experts, top_k, n_groups, n_limited_groups)
    acc = _acc_dtype(logits.dtype)
    scores = logits.to(acc).sigmoid()  # [T, E] affinities s
    choice = scores.detach() + bias.to(acc)  # [T, E] selection scores s + b (no gradient)
    if n_limited_groups < n_groups:
        grouped = choice.view(n_tokens, n_groups, per_group)  # [T, G, E/G]
        group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)  # [T, G]
        keep = _top_indices(group_scores, n_limited_groups)  # [T, M]
        group_mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(group_mask.unsqueeze(-1), float("-inf")).flatten(1)
    topk_idx = _top_indices(choice, top_k)  # [T, k]
    gates = scores.gather(1, topk_idx)  # [T, k] selected s, differentiable
    denom = gates[:, :1]  # [T, 1], summed left to right (a fixed order on every device)
    for j in range(1, top_k):
        denom = denom + gates[:, j : j + 1]
    topk_weights = gates / (denom + 1e-20) * route_scale
    return topk_idx, topk_weights, scores


def seq_balance_loss_ref(
    scores: torch.Tensor, topk_idx: torch.Tensor, seq_len: int, alpha: float
) -> torch.Tensor:
    """Sequence-wise balance loss ``α Σ_i f_i P_i`` (report eqs. 17-20), averaged over sequences.

    Per sequence of ``T = seq_len`` tokens: ``f_i = E / (k·T) · #{t : i ∈ TopK_t}`` (no gradient),
    ``P_i = (1/T) Σ_t s_{i,t} / Σ_j s_{j,t}``. Perfect balance gives ``α``.

    Args:
        scores: ``[N, E]`` fp32 affinities ``s`` from :func:`route_ref`, ``N = B·T``, token
            order row-major over ``[B, T]``.
        topk_idx: ``[N, k]`` int64 selected experts.
        seq_len: ``T``; must divide ``N``.
        alpha: the loss weight ``α``.

    Returns:
        scalar in ``scores``' dtype.

    Raises:
        ValueError: ``seq_len`` does not divide ``N`` or the shapes disagree.
    """
    n_tokens, n_experts = scores.shape
    if topk_idx.shape[0] != n_tokens:
        raise ValueError(
            f"scores {tuple(scores.shape)} and topk_idx {tuple(topk_idx.shape)} disagree on N"
        )
    if seq_len <= 0 or n_tokens % seq_len != 0:
        raise ValueError(f"seq_len must divide the token count {n_tokens}, got {seq_len}")
    k = topk_idx.shape[1]
    n_seqs = n_tokens // seq_len
    probs = scores / scores.sum(-1, keepdim=True)  # [N, E] s'
    p = probs.view(n_seqs, seq_len, n_experts).mean(1)  # [B, E] P_i
    counts = torch.zeros(n_seqs, n_experts, dtype=scores.dtype, device=scores.device)
    seq_of = topk_idx.reshape(n_seqs, seq_len * k)  # [B, T·k]
    counts.scatter_add_(1, seq_of, torch.ones_like(seq_of, dtype=scores.dtype))
    f = counts * (n_experts / (k * seq_len))  # [B, E] f_i
    return alpha * (f * p).sum(-1).mean()


def check_expert_ids(topk_idx: torch.Tensor, num_experts: int) -> None:
    """ValueError unless every id of ``topk_idx`` is in ``[0, num_experts)`` (one host read)."""
    if topk_idx.numel() > 0:
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(
                f"topk_idx must hold expert ids in [0, num_experts={num_experts}), got values "
                f"in [{lo}, {hi}]"
            )


def check_num_valid(num_valid: object, n_slots: int) -> int:
    """``num_valid`` (the permuted rows kept, see :func:`permute_ref`) if it is an int in
    ``[0, n_slots]``; else ValueError / TypeError naming it."""
    if isinstance(num_valid, bool) or not isinstance(num_valid, int):
        raise TypeError(f"num_valid must be an int, got {type(num_valid).__name__}")
    if not 0 <= num_valid <= n_slots:
        raise ValueError(f"num_valid must be in [0, T·k = {n_slots}], got {num_valid}")
    return num_valid


def permute_ref(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    *,
    check_ids: bool = True,
    num_valid: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per selected expert, grouped by expert (stable order).

    Args:
        x: ``[T, D]`` tokens, any dtype.
        topk_idx: ``[T, k]`` int64 expert ids in ``[0, num_experts)`` (an id outside it would
            sort before expert 0 or after the last one without being counted, shifting every
            expert's slice: rejected).
        num_experts: ``E``.
        check_ids: check the id range (one device-to-host read of the min and max); callers
            whose ids are valid by construction (the MoE layer: the router's top-k) pass False.
        num_valid: copy only the first ``num_valid`` permuted rows (None: all ``T·k``). An
            expert-parallel rank sends the slots of other ranks' experts to a last "spill"
            expert and keeps the rows before them.

    Returns:
        ``x_permuted [T·k, D]`` (``[num_valid, D]``; dtype of ``x``; rows of expert 0 first,
        then expert 1, ...),
        ``sorted_slots [T·k]`` int64 (permuted row -> slot ``t·k + j``; token = ``slot // k``),
        ``tokens_per_expert [E]`` int64 (slice lengths, summing to ``T·k``).

    Raises:
        ValueError: shapes disagree, (``check_ids``) an id is outside ``[0, num_experts)``, or
            ``num_valid`` is outside ``[0, T·k]``.
        TypeError: ``topk_idx`` is not int64; ``num_valid`` not an int.
    """
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"permute_ref needs x [T, D] and topk_idx [T, k], got {tuple(x.shape)} and "
            f"{tuple(topk_idx.shape)}"
        )
    if topk_idx.dtype != torch.int64:
        raise TypeError(f"topk_idx must be int64, got {topk_idx.dtype}")
    if check_ids:
        check_expert_ids(topk_idx, num_experts)
    k = topk_idx.shape[1]
    flat = topk_idx.flatten()  # [T·k]
    sorted_slots = flat.argsort(stable=True)  # [T·k]
    tokens_per_expert = count_per_expert(flat, num_experts)  # [E], no host sync
    kept = sorted_slots
    if num_valid is not None:
        kept = sorted_slots[: check_num_valid(num_valid, flat.numel())]
    x_permuted = x.index_select(0, kept // k)  # [T·k, D] or [num_valid, D]
    return x_permuted, sorted_slots, tokens_per_expert


def unpermute_ref(
    y_permuted: torch.Tensor,
    sorted_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    check_slots: bool = True,
    num_valid: int | None = None,
) -> torch.Tensor:
    """Weighted sum of each token's expert outputs back in token order (the "combine").

    ``y[t] = Σ_j topk_weights[t, j] · y_permuted[row of slot t·k+j]``, accumulated in **fp32**
    (``index_add`` of fp32 products; fp64 for fp64 inputs), then cast to ``y_permuted``'s dtype.

    Args:
        y_permuted: ``[T·k, D]`` expert outputs in permuted order.
        sorted_slots: ``[T·k]`` int64 from :func:`permute_ref`.
        topk_weights: ``[T, k]`` gate weights (fp32).
        check_slots: check that ``sorted_slots`` holds int64 values in ``[0, T·k)`` (one
            device-to-host read of its min and max); callers that built it themselves may skip.
        num_valid: ``y_permuted`` holds only the first ``num_valid`` permuted rows
            (:func:`permute_ref`'s); the slots of the later positions add nothing.

    Returns:
        ``y [T, D]`` in ``y_permuted.dtype``.

    Raises:
        ValueError: shapes disagree, or (``check_slots``) a slot is outside ``[0, T·k)``.
        TypeError: ``sorted_slots`` is not int64.
    """
    n_tokens, k = topk_weights.shape
    rows = n_tokens * k if num_valid is None else check_num_valid(num_valid, n_tokens * k)
    if y_permuted.dim() != 2 or y_permuted.shape[0] != rows:
        raise ValueError(
            f"y_permuted must be [T·k or num_valid, D] = [{rows}, D], got {tuple(y_permuted.shape)}"
        )
    if sorted_slots.shape != (n_tokens * k,):
        raise ValueError(f"sorted_slots must be [{n_tokens * k}], got {tuple(sorted_slots.shape)}")
    if sorted_slots.dtype != torch.int64:
        raise TypeError(f"sorted_slots must be int64, got {sorted_slots.dtype}")
    if check_slots and sorted_slots.numel():
        lo, hi = (int(v) for v in torch.aminmax(sorted_slots))
        if lo < 0 or hi >= n_tokens * k:
            raise ValueError(
                f"sorted_slots must hold slots in [0, T·k = {n_tokens * k}), got values in "
                f"[{lo}, {hi}]"
            )
    acc = _acc_dtype(y_permuted.dtype)
    kept = sorted_slots[:rows]
    w = topk_weights.to(acc).flatten().index_select(0, kept)  # [rows] in permuted order
    contrib = y_permuted.to(acc) * w.unsqueeze(1)  # [rows, D] fp32
    y = torch.zeros(n_tokens, y_permuted.shape[1], dtype=acc, device=y_permuted.device)
    y = y.index_add(0, kept // k, contrib)  # [T, D] fp32
    return y.to(y_permuted.dtype)


class PermuteQuantResult(NamedTuple):
    """Outputs of :func:`permute_quant_ref` and :func:`ptxtrain.moe.triton.permute_quant`.

    ``R`` is the row count of the permuted tensor: ``T·k`` without alignment, else
    ``Σ_e ⌈n_e / align⌉ · align``.
    """

    x_fp8: torch.Tensor  # [R, D] float8_e4m3fn, expert-contiguous rows
    sf: torch.Tensor  # [R, ⌈D/128⌉] fp32 dequantization factors (1x128 tiles)
    sorted_slots: torch.Tensor  # [T·k] int64, permuted position -> slot t·k + j
    tokens_per_expert: torch.Tensor  # [E] int64
    padded_rows: torch.Tensor | None  # [T·k] int64, permuted position -> row of x_fp8 (align)
    m_indices: torch.Tensor | None  # [R] int32, expert of each row, -1 for padding (align)


def grouped_layout_ref(
    tokens_per_expert: torch.Tensor, align: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad each expert's slice to a multiple of ``align`` rows (the M-grouped contiguous layout).

    Expert ``e`` gets rows ``[P_e, P_e + ⌈n_e/align⌉·align)`` with ``P_e`` the exclusive prefix sum
    of the padded counts (an expert with no tokens gets no rows); its ``n_e`` tokens fill the
    first rows in permuted order, the rest are padding.

    Args:
        tokens_per_expert: ``[E]`` int64 counts ``n_e`` (from :func:`permute_ref`).
        align: rows per alignment unit (DeepGEMM: 128).

    Returns:
        ``padded_rows [Σn_e]`` int64 (permuted position -> padded row) and
        ``m_indices [R]`` int32 (expert of each padded row, -1 for padding rows).

    Raises:
        ValueError: ``align`` is not a positive int, or ``tokens_per_expert`` is not 1-D.
    """
    if isinstance(align, bool) or not isinstance(align, int) or align <= 0:
        raise ValueError(f"align must be a positive int, got {align!r}")
    if tokens_per_expert.dim() != 1:
        raise ValueError(f"tokens_per_expert must be [E], got {tuple(tokens_per_expert.shape)}")
    dev = tokens_per_expert.device
    counts = tokens_per_expert.to(torch.int64)  # [E]
    padded = (counts + align - 1) // align * align  # [E]
    start = torch.cumsum(counts, 0) - counts  # [E] first permuted position of each expert
    padded_start = torch.cumsum(padded, 0) - padded  # [E] first padded row of each expert
    experts = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts)  # [Σn]
    positions = torch.arange(experts.numel(), device=dev)
    padded_rows = positions - start[experts] + padded_start[experts]  # [Σn]
    m_indices = torch.full((int(padded.sum()),), -1, dtype=torch.int32, device=dev)
    m_indices[padded_rows] = experts.to(torch.int32)
    return padded_rows, m_indices


def permute_quant_ref(
    x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, *, align: int | None = None
) -> PermuteQuantResult:
    """:func:`permute_ref` followed by 1x128 FP8 quantization, optionally padded per expert.

    Padding rows (``m_indices == -1``) hold the quantization of a zero row: ``x_fp8 = 0`` and
    ``sf = AMAX_EPS / 448`` (the clamped amax of :func:`ptxtrain.quant.ref.per_token_cast_to_fp8`).

    Args:
        x: ``[T, D]`` float32 / bfloat16 / float16 tokens.
        topk_idx: ``[T, k]`` int64 expert ids in ``[0, num_experts)``.
        num_experts: ``E``.
        align: ``None`` (rows packed, ``R = T·k``) or the M alignment of each expert's slice.

    Returns:
        :class:`PermuteQuantResult`; ``padded_rows`` and ``m_indices`` are ``None`` without
        ``align``.

    Raises:
        TypeError / ValueError: as :func:`permute_ref`, :func:`per_token_cast_to_fp8` and
            :func:`grouped_layout_ref`.
    """
    x_perm, sorted_slots, tokens_per_expert = permute_ref(x, topk_idx, num_experts)
    if align is None:
        x_fp8, sf = per_token_cast_to_fp8(x_perm)
        return PermuteQuantResult(x_fp8, sf, sorted_slots, tokens_per_expert, None, None)
    padded_rows, m_indices = grouped_layout_ref(tokens_per_expert, align)
    x_pad = x_perm.new_zeros(m_indices.numel(), x.shape[1])  # [R, D], zero padding rows
    x_pad[padded_rows] = x_perm
    x_fp8, sf = per_token_cast_to_fp8(x_pad)
    return PermuteQuantResult(x_fp8, sf, sorted_slots, tokens_per_expert, padded_rows, m_indices)
