"""Triton routing and permutation kernels for the MoE layer, exact twins of :mod:`ptxtrain.moe.ref`.

Design note.

- ``fused_route``: the router GEMM ``x · Wᵀ`` stays a matmul outside. ``s = sigmoid(logits)`` is
  computed by torch, the very op of :func:`~ptxtrain.moe.ref.route_from_logits_ref`: an in-kernel
  sigmoid would use another ``exp`` (libdevice or ``ex2.approx`` on the GPU, numpy in the
  interpreter, Sleef in torch's CPU kernel), 1-2 ulp apart, and an ulp is enough to flip a top-k
  choice at a near-tie. Everything after it is one kernel, ``_route_kernel``: a program owns
  ``BLOCK_T`` tokens and holds their ``s + b`` as a ``[BLOCK_T, G, E/G]`` tile (each axis padded to
  a power of two, padding lanes masked), so group top-2 and group selection are reductions along
  an axis. Every pick is a max and then the lowest index holding it, among lanes still "live"
  (a mask, not a -inf sentinel, so a genuine -inf is still picked in index order): the
  reference's stable-sort tie rule. Gates follow the reference's operation order: the selected
  ``s`` (an exact max over one lane), a left-to-right fp32 sum, ``div.rn``, one multiply by
  ``route_scale``; fp contraction is off so nothing is fused into an FMA.
- ``permute_quant``: the index bookkeeping (a stable argsort of the ``T·k`` expert ids,
  ``bincount``, prefix sums for the padded layout, the slot -> row map) is O(T·k) integers and
  stays in torch; the bytes are in the ``D``-wide rows, which ``_scatter_quant_kernel`` moves. A
  token's ``k`` copies have the same 1x128 quantization, so a program owns ``BLOCK_M`` *source*
  tokens x 128 columns, quantizes the tile once with the helpers of :mod:`ptxtrain.quant.triton`
  (bit-exact with :func:`ptxtrain.quant.ref.per_token_cast_to_fp8`) and stores it to the token's
  ``k`` rows: x is read once (``T·D`` elements, not ``T·k·D`` as a gather would) and no bf16
  permuted copy is written. ``_padding_rows_kernel`` writes the padding rows (a quantized zero
  row) and touches nothing else.
- ``unpermute_weighted``: a program owns ``BLOCK_T`` tokens x ``BLOCK_D`` columns; the rows of a
  token's ``k`` slots are visited in ascending row order, which is the order in which
  ``index_add`` on the CPU adds them in :func:`~ptxtrain.moe.ref.unpermute_ref`, each product
  rounded to fp32 before the fp32 add (fp contraction off), then one cast. The result is bitwise
  equal to ``unpermute_ref`` run on the CPU; CUDA's ``index_add`` adds with atomics in a varying
  order, so a reference run on the GPU differs from it (and from itself) in the last bits for
  ``k ≥ 3``.
- Offsets are int64. Validation (types, shapes, devices, index ranges) happens before any launch;
  checking index ranges reads two numbers back to the host (one sync per call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ptxtrain._checks import (
    HP_DTYPES,
    ceil_div,
    check_positive_int,
    check_same_device,
    check_tensor,
)
from ptxtrain.moe.ref import PermuteQuantResult, check_routing, count_per_expert
from ptxtrain.quant.ref import BLOCK, FP8_DTYPE, check_sf_layout, empty_sf
from ptxtrain.quant.triton import (
    abs_bits,
    all_finite,
    cast_e4m3,
    reciprocal,
    scale_from_amax_bits,
)

__all__ = ["fused_route", "layout_combine", "layout_gather", "permute_quant", "unpermute_weighted"]

_NEG_INF = tl.constexpr(float("-inf"))


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _route_kernel(
    scores_ptr,
    bias_ptr,
    idx_ptr,
    w_ptr,
    T,
    route_scale,
    E: tl.constexpr,
    G: tl.constexpr,
    PG: tl.constexpr,
    GP: tl.constexpr,
    PGP: tl.constexpr,
    N_LIMITED: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    toks64 = toks.to(tl.int64)
    tok_ok = toks < T
    g = tl.arange(0, GP)  # [GP] group
    j = tl.arange(0, PGP)  # [PGP] expert within its group
    eid = g[:, None] * PG + j[None, :]  # [GP, PGP] expert id
    lane_ok = (g < G)[:, None] & (j < PG)[None, :]  # [GP, PGP]
    eid3 = eid[None, :, :]  # [1, GP, PGP]
    ok3 = lane_ok[None, :, :] & tok_ok[:, None, None]  # [BT, GP, PGP]
    s = tl.load(scores_ptr + toks64[:, None, None] * E + eid3, mask=ok3, other=0.0)
    b = tl.load(bias_ptr + eid, mask=lane_ok, other=0.0)  # [GP, PGP]
    c = s + b[None, :, :]  # [BT, GP, PGP] selection scores s + b
    live = lane_ok[None, :, :] & (toks >= 0)[:, None, None]  # [BT, GP, PGP], padding lanes off
    if N_LIMITED < G:
        # Group score: top1 + top2 of s + b within the group (top1 alone for one-expert groups).
        v = tl.where(live, c, _NEG_INF)
        m1 = tl.max(v, axis=2)  # [BT, GP]
        j1 = tl.min(tl.where(live & (v == m1[:, :, None]), j[None, None, :], PGP), axis=2)
        if PG > 1:
            rest = live & (j[None, None, :] != j1[:, :, None])
            gscore = m1 + tl.max(tl.where(rest, v, _NEG_INF), axis=2)  # [BT, GP]
        else:
            gscore = m1
        glive = (g < G)[None, :] & (toks >= 0)[:, None]  # [BT, GP]
        kept = glive & (g < 0)[None, :]  # all False
        for _ in tl.static_range(N_LIMITED):
            cand = tl.where(glive, gscore, _NEG_INF)
            best = tl.max(cand, axis=1)  # [BT]
            gi = tl.min(tl.where(glive & (cand == best[:, None]), g[None, :], GP), axis=1)
            hit = g[None, :] == gi[:, None]  # [BT, GP]
            kept = kept | hit
            glive = glive & ~hit
        c = tl.where(kept[:, :, None], c, _NEG_INF)  # experts of dropped groups: -inf
    kk = tl.arange(0, KP)  # [KP]
    out_idx = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
    gates = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    denom = tl.zeros([BLOCK_T], dtype=tl.float32)
    for i in tl.static_range(K):
        cand = tl.where(live, c, _NEG_INF)
        best = tl.max(tl.max(cand, axis=2), axis=1)  # [BT]
        pick = live & (cand == best[:, None, None])
        e = tl.min(tl.min(tl.where(pick, eid3, E), axis=2), axis=1)  # [BT] lowest index
        hit = eid3 == e[:, None, None]  # [BT, GP, PGP], one lane per token
        gate = tl.max(tl.max(tl.where(hit, s, _NEG_INF), axis=2), axis=1)  # [BT] chosen s
        live = live & ~hit
        denom = denom + gate  # 0 + g_0 = g_0 exactly (s ≥ +0), then left to right
        out_idx = tl.where(kk[None, :] == i, e[:, None], out_idx)
        gates = tl.where(kk[None, :] == i, gate[:, None], gates)
    weights = tl.div_rn(gates, denom[:, None] + 1e-20) * route_scale  # [BT, KP]
    out_mask = tok_ok[:, None] & (kk < K)[None, :]
    out_offs = toks64[:, None] * K + kk[None, :]
    tl.store(idx_ptr + out_offs, out_idx.to(tl.int64), mask=out_mask)
    tl.store(w_ptr + out_offs, weights, mask=out_mask)


@triton.jit
def _scatter_quant_kernel(
    x_ptr,
    slot_row_ptr,
    q_ptr,
    sf_ptr,
    T,
    D,
    stride_xm,
    stride_qm,
    stride_sf_m,
    stride_sf_k,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    toks = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM] source tokens
    tok_ok = toks < T
    cols = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)  # [BK]
    mask = tok_ok[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + toks[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # [BM, BK]
    sf = scale_from_amax_bits(tl.max(abs_bits(x), axis=1), False)  # [BM]
    q = cast_e4m3(x, sf[:, None], reciprocal(sf)[:, None], all_finite(sf))
    sf_col = pid_k.to(tl.int64) * stride_sf_k
    for j in range(K):  # the same quantized tile goes to each of the token's k rows
        dst = tl.load(slot_row_ptr + toks * K + j, mask=tok_ok, other=0)  # [BM] output rows
        tl.store(q_ptr + dst[:, None] * stride_qm + cols[None, :], q, mask=mask)
        tl.store(sf_ptr + dst * stride_sf_m + sf_col, sf, mask=tok_ok)


@triton.jit
def _padding_rows_kernel(
    m_idx_ptr,
    q_ptr,
    sf_ptr,
    R,
    D,
    stride_qm,
    stride_sf_m,
    stride_sf_k,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BM]
    pad = tl.load(m_idx_ptr + rows, mask=rows < R, other=0) == -1  # [BM] padding rows only
    cols = (pid_k * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.int64)  # [BK]
    zero = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    sf = scale_from_amax_bits(tl.max(abs_bits(zero), axis=1), False)  # a zero row's scale
    q = zero.to(tl.float8e4nv)
    tl.store(
        q_ptr + rows[:, None] * stride_qm + cols[None, :],
        q,
        mask=pad[:, None] & (cols < D)[None, :],
    )
    tl.store(sf_ptr + rows * stride_sf_m + pid_k.to(tl.int64) * stride_sf_k, sf, mask=pad)


@triton.jit
def _unpermute_kernel(
    y_ptr,
    slot_row_ptr,
    w_ptr,
    out_ptr,
    T,
    D,
    stride_ym,
    stride_om,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    toks = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT]
    tok_ok = toks < T
    kk = tl.arange(0, KP)  # [KP]
    slot_ok = tok_ok[:, None] & (kk < K)[None, :]  # [BT, KP]
    slot_offs = toks[:, None] * K + kk[None, :]
    rows = tl.load(slot_row_ptr + slot_offs, mask=slot_ok, other=0)  # [BT, KP] int64 rows of y
    w = tl.load(w_ptr + slot_offs, mask=slot_ok, other=0.0)  # [BT, KP] fp32
    cols = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)  # [BD]
    mask = tok_ok[:, None] & (cols < D)[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    live = slot_ok & (rows >= 0)  # a slot whose row is -1 has no row in y: it adds nothing
    big = tl.full([BLOCK_T, KP], 2**62, dtype=tl.int64)
    for _ in tl.static_range(K):
        # The token's next slot in ascending row order (rows of one token are distinct).
        row = tl.min(tl.where(live, rows, big), axis=1)  # [BT]
        hit = live & (rows == row[:, None])
        wi = tl.max(tl.where(hit, w, _NEG_INF), axis=1)  # [BT] its weight
        live = live & ~hit
        ok = tok_ok & (row < 2**62)  # tokens past T, or with no slot left: nothing to add
        row = tl.where(ok, row, 0)
        wi = tl.where(ok, wi, 0.0)  # no -inf * 0
        y = tl.load(
            y_ptr + row[:, None] * stride_ym + cols[None, :], mask=mask & ok[:, None], other=0.0
        )
        # product rounded, then added (no FMA); a token without this slot keeps its sum as is
        acc = tl.where(ok[:, None], acc + y.to(tl.float32) * wi[:, None], acc)
    tl.store(
        out_ptr + toks[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _layout_gather_kernel(
    src_ptr,
    row_slots_ptr,
    w_ptr,
    dot_ptr,
    out_ptr,
    dots_ptr,
    R,
    D,
    K: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_DOT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # A program owns BLOCK_R rows of the layout and walks D: row r copies (w[s] times) the token
    # s // K of its slot s, or writes zeros; with HAS_DOT it also sums src[t] * dot[r] over D.
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BR]
    row_ok = rows < R
    slot = tl.load(row_slots_ptr + rows, mask=row_ok, other=-1)  # [BR] int64
    valid = slot >= 0
    token = tl.where(valid, slot // K, 0)
    if HAS_W:
        w = tl.load(w_ptr + tl.where(valid, slot, 0), mask=valid, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D).to(tl.int64)
        col_ok = cols < D
        v = tl.load(
            src_ptr + token[:, None] * D + cols[None, :],
            mask=valid[:, None] & col_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BR, BD]
        if HAS_DOT:
            y = tl.load(
                dot_ptr + rows[:, None] * D + cols[None, :],
                mask=valid[:, None] & col_ok[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(v * y, axis=1)
        if HAS_W:
            v = v * w[:, None]
        tl.store(
            out_ptr + rows[:, None] * D + cols[None, :],
            v.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & col_ok[None, :],
        )
    if HAS_DOT:
        tl.store(dots_ptr + slot, acc, mask=valid)


# --------------------------------------------------------------------------------------------
# Wrappers
# --------------------------------------------------------------------------------------------


def _kernels_interpreted() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1`` (they run on the CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_route_kernel, InterpretedFunction)


def _check_device(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _kernels_interpreted():
        raise ValueError(
            f"{name} must be a CUDA tensor for the Triton kernels, got device {t.device}; to run "
            "them on the CPU set TRITON_INTERPRET=1 before importing ptxtrain.moe.triton, or use "
            "ptxtrain.moe.ref"
        )


def _check_index_range(name: str, idx: torch.Tensor, upper: int) -> None:
    """Values in ``[0, upper)`` (reads the min and max back: one host sync)."""
    if idx.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo < 0 or hi >= upper:
        raise ValueError(f"{name} values must be in [0, {upper}), got min {lo} and max {hi}")


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(n, 1))


def fused_route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    n_groups: int,
    n_limited_groups: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sigmoid routing with selection bias and group-limited top-k, from the router logits.

    Bitwise equal to :func:`ptxtrain.moe.ref.route_from_logits_ref` (and so to
    :func:`~ptxtrain.moe.ref.route_ref` given the same logits), ties included: equal ``s + b``
    go to the lower expert index, equal group scores to the lower group index. ``sigmoid`` runs in
    torch (the reference's op); bias, group scores, group limit, top-k and gate normalization run
    in one Triton kernel. No autograd: the gates are not differentiable here.

    Args:
        logits: ``[T, E]`` float32 / bfloat16 / float16 router logits ``x · Wᵀ`` (upcast to
            fp32); on CUDA, or on the CPU under ``TRITON_INTERPRET=1``. ``T`` may be 0.
        bias: ``[E]`` float selection bias (upcast to fp32), same device.
        top_k: experts per token ``k``, in ``[1, n_limited_groups · E / n_groups]``.
        n_groups: groups of ``E / n_groups`` consecutive experts; must divide ``E``.
        n_limited_groups: groups a token may use, in ``[1, n_groups]``.
        route_scale: factor on the normalized gates.

    Returns:
        ``topk_idx [T, k]`` int64 (descending ``s + b``), ``topk_weights [T, k]`` fp32 (rows sum
        to ``route_scale``), ``scores [T, E]`` fp32 affinities ``s``.

    Raises:
        TypeError: a tensor has the wrong type/dtype, or an int argument is not an int.
        ValueError: shapes disagree, tensors are on different devices or not on CUDA (with the
            interpreter off), or the routing hyper-parameters do not fit ``E``.

    Source: DeepSeek-V3 report §2.1.2 (eqs. 12-16, node-limited routing); docs/design.md §4.
    """
    check_tensor("logits", logits, dtypes=HP_DTYPES, ndim=2)
    check_tensor("bias", bias, dtypes=(*HP_DTYPES, torch.float64), ndim=1)
    n_tokens, n_experts = logits.shape
    if bias.shape[0] != n_experts:
        raise ValueError(
            f"bias must be [E] = [{n_experts}] like logits' columns, got {tuple(bias.shape)}"
        )
    for name, value in (
        ("top_k", top_k),
        ("n_groups", n_groups),
        ("n_limited_groups", n_limited_groups),
    ):
        check_positive_int(name, value)
    if isinstance(route_scale, bool) or not isinstance(route_scale, (int, float)):
        raise TypeError(f"route_scale must be a float, got {type(route_scale).__name__}")
    per_group = check_routing(n_experts, top_k, n_groups, n_limited_groups)
    check_same_device(logits=logits, bias=bias)
    _check_device("logits", logits)

    scores = logits.float().sigmoid()  # [T, E], the reference's op
    bias32 = bias.float().contiguous()
    topk_idx = torch.empty((n_tokens, top_k), dtype=torch.int64, device=logits.device)
    topk_weights = torch.empty((n_tokens, top_k), dtype=torch.float32, device=logits.device)
    if n_tokens > 0:
        lanes = _pow2(n_groups) * _pow2(per_group)
        # <= 2048 lanes per program: 127 registers, no spills at E = 256 (ptxas, sm_90a).
        block_t = max(1, min(16, 2048 // lanes, _pow2(n_tokens)))
        _route_kernel[(triton.cdiv(n_tokens, block_t),)](
            scores.contiguous(),
            bias32,
            topk_idx,
            topk_weights,
            n_tokens,
            float(route_scale),
            E=n_experts,
            G=n_groups,
            PG=per_group,
            GP=_pow2(n_groups),
            PGP=_pow2(per_group),
            N_LIMITED=n_limited_groups,
            K=top_k,
            KP=_pow2(top_k),
            BLOCK_T=block_t,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return topk_idx, topk_weights, scores


def permute_quant(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    num_experts: int,
    *,
    align: int | None = None,
    sf_layout: str = "row",
) -> PermuteQuantResult:
    """Permute tokens to expert-contiguous order and quantize them 1x128 to FP8, in one pass.

    Row order is :func:`ptxtrain.moe.ref.permute_ref`'s (stable by expert, ascending token);
    ``x_fp8`` and ``sf`` are bitwise equal to ``per_token_cast_to_fp8(permute_ref(...)[0])``, or,
    with ``align``, to :func:`ptxtrain.moe.ref.permute_quant_ref`: each expert's slice padded to a
    multiple of ``align`` rows (the layout of DeepGEMM's m-grouped contiguous GEMM, ``align = 128``
    there), padding rows holding the quantization of a zero row (``x_fp8 = 0``,
    ``sf = AMAX_EPS / 448``). With ``align`` the output size depends on the counts, which are read
    back to the host (one sync; the index-range check is another).

    Args:
        x: ``[T, D]`` float32 / bfloat16 / float16 tokens (any ``D``, 0 included; copied first if
            ``stride(-1) != 1``); on CUDA, or on the CPU under ``TRITON_INTERPRET=1``.
        topk_idx: ``[T, k]`` int64 expert ids in ``[0, num_experts)``, same device; duplicates
            within a row are allowed (each slot is its own row).
        num_experts: ``E`` ≥ 1.
        align: ``None`` (rows packed, ``R = T·k``) or a positive int M alignment.
        sf_layout: ``"row"`` (row-major ``sf``) or ``"mn_major"`` (strides ``(1, 4·⌈R/4⌉)``,
            the LHS-scale layout of DeepGEMM and ``torch._scaled_mm``).

    Returns:
        :class:`~ptxtrain.moe.ref.PermuteQuantResult`: ``x_fp8 [R, D]`` float8_e4m3fn,
        ``sf [R, ⌈D/128⌉]`` fp32, ``sorted_slots [T·k]`` int64, ``tokens_per_expert [E]`` int64,
        and with ``align`` ``padded_rows [T·k]`` int64 (permuted position -> row of ``x_fp8``) and
        ``m_indices [R]`` int32 (expert of each row, -1 for padding); ``None`` for both otherwise.

    Raises:
        TypeError: ``x`` is not a float32/bfloat16/float16 tensor, ``topk_idx`` is not int64, or
            ``num_experts`` / ``align`` is not an int.
        ValueError: shapes disagree, an id is out of range, ``align`` / ``num_experts`` < 1,
            ``sf_layout`` is unknown, or the tensors are on different devices or not on CUDA
            (with the interpreter off).

    Source: DeepSeek-V3 report §3.3 (FP8 activations before MoE up-projections);
    docs/design.md §2, §4.
    """
    check_tensor("x", x, dtypes=HP_DTYPES, ndim=2)
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    if topk_idx.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_idx must be [T, k] with T = {x.shape[0]} (x's rows), got {tuple(topk_idx.shape)}"
        )
    check_positive_int("num_experts", num_experts)
    if align is not None:
        check_positive_int("align", align)
    sf_layout = check_sf_layout(sf_layout)
    check_same_device(x=x, topk_idx=topk_idx)
    _check_device("x", x)
    _check_index_range("topk_idx", topk_idx, num_experts)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()

    n_tokens, k = topk_idx.shape
    dev = x.device
    flat = topk_idx.reshape(-1)  # [T·k]
    sorted_slots = flat.argsort(stable=True)  # [T·k]
    tokens_per_expert = count_per_expert(flat, num_experts)  # [E] (bincount would sync)
    n_slots, d = flat.numel(), x.shape[1]
    padded_rows = m_indices = None
    rows = torch.arange(n_slots, device=dev)  # [T·k] output row of each permuted position
    n_rows = n_slots
    if align is not None:
        padded = (tokens_per_expert + align - 1) // align * align  # [E]
        shift = torch.cumsum(padded - tokens_per_expert, 0) - (padded - tokens_per_expert)  # [E]
        expert_of = flat.index_select(0, sorted_slots)  # [T·k] expert of each position
        padded_rows = rows = rows + shift.index_select(0, expert_of)
        n_rows = int(padded.sum())  # host sync: the output size
        m_indices = torch.full((n_rows,), -1, dtype=torch.int32, device=dev)
        m_indices.index_copy_(0, padded_rows, expert_of.to(torch.int32))
    slot_row = torch.empty(n_slots, dtype=torch.int64, device=dev)
    slot_row.index_copy_(0, sorted_slots, rows)  # [T·k] slot t·k + j -> output row
    x_fp8 = torch.empty((n_rows, d), dtype=FP8_DTYPE, device=dev)
    sf = empty_sf(n_rows, ceil_div(d, BLOCK), sf_layout, dev)
    if n_slots > 0 and d > 0:
        block_m = min(64, max(16, _pow2(n_tokens)))
        _scatter_quant_kernel[(triton.cdiv(n_tokens, block_m), ceil_div(d, BLOCK))](
            x,
            slot_row,
            x_fp8,
            sf,
            n_tokens,
            d,
            x.stride(0),
            x_fp8.stride(0),
            sf.stride(0),
            sf.stride(1),
            K=k,
            BLOCK_M=block_m,
            BLOCK_K=BLOCK,
            num_warps=4,
        )
    if n_rows > n_slots and d > 0:
        block_m = 64
        _padding_rows_kernel[(triton.cdiv(n_rows, block_m), ceil_div(d, BLOCK))](
            m_indices,
            x_fp8,
            sf,
            n_rows,
            d,
            x_fp8.stride(0),
            sf.stride(0),
            sf.stride(1),
            BLOCK_M=block_m,
            BLOCK_K=BLOCK,
            num_warps=4,
        )
    return PermuteQuantResult(x_fp8, sf, sorted_slots, tokens_per_expert, padded_rows, m_indices)


def unpermute_weighted(
    y: torch.Tensor,
    sorted_slots: torch.Tensor,
    topk_weights: torch.Tensor,
    num_tokens: int,
    *,
    padded_rows: torch.Tensor | None = None,
    check_slots: bool = True,
    num_valid: int | None = None,
) -> torch.Tensor:
    """Inverse permutation with the gate-weighted sum over each token's ``k`` slots.

    ``out[t] = Σ_j topk_weights[t, j] · y[row of slot t·k + j]``, each product rounded to fp32
    and summed in fp32 in ascending row order, then cast to ``y.dtype``: bitwise equal to
    :func:`ptxtrain.moe.ref.unpermute_ref` evaluated on the CPU (CUDA's ``index_add`` sums with
    atomics in a varying order, so a reference run on the GPU can differ in the last bits).

    Args:
        y: ``[T·k, D]`` expert outputs in permuted order, or ``[R, D]`` in the padded layout of
            :func:`permute_quant` when ``padded_rows`` is given; float32 / bfloat16 / float16.
        sorted_slots: ``[T·k]`` int64, a permutation of ``[0, T·k)`` (from :func:`permute_quant`
            or :func:`~ptxtrain.moe.ref.permute_ref`).
        topk_weights: ``[T, k]`` float gate weights (upcast to fp32).
        num_tokens: ``T`` (must equal ``topk_weights.shape[0]``; makes the call self-describing
            when ``T = 0``).
        padded_rows: optional ``[T·k]`` int64, permuted position -> row of ``y``.
        check_slots: read the min and max of ``sorted_slots`` (and ``padded_rows``) back to
            reject out-of-range values: one host sync each, which waits for all queued work.
            Callers whose indices come from their own permutation (the MoE layer, and the
            permutation's backward) pass False.
        num_valid: ``y`` is ``[num_valid, D]``, the first ``num_valid`` permuted positions;
            the slots at later positions add nothing (an expert-parallel rank's slots of other
            ranks' experts, :func:`~ptxtrain.moe.ref.permute_ref`'s ``num_valid``). Not with
            ``padded_rows``.

    Returns:
        ``[T, D]`` in ``y.dtype``.

    Raises:
        TypeError: wrong tensor types/dtypes, or ``num_tokens`` is not an int.
        ValueError: shapes disagree, an index is out of range (``check_slots``), or the
            tensors are on different devices or not on CUDA (with the interpreter off).

    Source: DeepSeek-V3 report §2.1.2 (eq. 12, the gated sum of expert outputs); docs/design.md §4.
    """
    check_tensor("y", y, dtypes=HP_DTYPES, ndim=2)
    check_tensor("sorted_slots", sorted_slots, dtypes=(torch.int64,), ndim=1)
    check_tensor("topk_weights", topk_weights, dtypes=(*HP_DTYPES, torch.float64), ndim=2)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
    if topk_weights.shape[0] != num_tokens or topk_weights.shape[1] < 1:
        raise ValueError(
            f"topk_weights must be [num_tokens, k] = [{num_tokens}, k ≥ 1], got "
            f"{tuple(topk_weights.shape)}"
        )
    k = topk_weights.shape[1]
    n_slots = num_tokens * k
    if sorted_slots.shape[0] != n_slots:
        raise ValueError(
            f"sorted_slots must be [T·k] = [{n_slots}], got {tuple(sorted_slots.shape)}"
        )
    tensors = dict(y=y, sorted_slots=sorted_slots, topk_weights=topk_weights)
    if num_valid is not None:
        from ptxtrain.moe.ref import check_num_valid

        check_num_valid(num_valid, n_slots)
        if padded_rows is not None:
            raise ValueError("num_valid and padded_rows exclude each other")
        if y.shape[0] != num_valid:
            raise ValueError(f"y must be [num_valid, D] = [{num_valid}, D], got {tuple(y.shape)}")
    elif padded_rows is None:
        if y.shape[0] != n_slots:
            raise ValueError(f"y must be [T·k, D] = [{n_slots}, D], got {tuple(y.shape)}")
    else:
        check_tensor("padded_rows", padded_rows, dtypes=(torch.int64,), ndim=1)
        if padded_rows.shape[0] != n_slots:
            raise ValueError(
                f"padded_rows must be [T·k] = [{n_slots}], got {tuple(padded_rows.shape)}"
            )
        tensors["padded_rows"] = padded_rows
    check_same_device(**tensors)
    _check_device("y", y)
    if check_slots:
        _check_index_range("sorted_slots", sorted_slots, n_slots)
        if padded_rows is not None:
            _check_index_range("padded_rows", padded_rows, y.shape[0])
    if y.shape[1] > 1 and y.stride(1) != 1:
        y = y.contiguous()

    d = y.shape[1]
    out = torch.empty((num_tokens, d), dtype=y.dtype, device=y.device)
    if num_tokens == 0 or d == 0:
        return out
    positions = torch.arange(n_slots, device=y.device)
    rows = positions if padded_rows is None else padded_rows
    if num_valid is not None:  # later positions: row -1, skipped by the kernel
        rows = torch.where(positions < num_valid, positions, -1)
    slot_row = torch.zeros(n_slots, dtype=torch.int64, device=y.device)  # never a wild row
    slot_row.index_copy_(0, sorted_slots, rows)  # [T·k] slot -> row of y
    return _combine(y, slot_row.view(num_tokens, k), topk_weights, out)


def _combine(y, slot_rows, weights, out):
    """Launch ``_unpermute_kernel``: ``out[t] = Σ_j w[t, j] · y[slot_rows[t, j]]``."""
    n_tokens, k = slot_rows.shape
    d = y.shape[1]
    block_d = min(256, _pow2(d))
    _unpermute_kernel[(triton.cdiv(n_tokens, 16), triton.cdiv(d, block_d))](
        y,
        slot_rows,
        weights.float().contiguous(),
        out,
        n_tokens,
        d,
        y.stride(0),
        out.stride(0),
        K=k,
        KP=_pow2(k),
        BLOCK_T=16,
        BLOCK_D=block_d,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


def layout_gather(
    src: torch.Tensor,
    row_slots: torch.Tensor,
    top_k: int,
    weights: torch.Tensor | None = None,
    dot_with: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rows of a :class:`~ptxtrain.moe.grouped_layout.GroupedLayout` gathered from their tokens,
    one launch: ``out[r] = w[s] · src[s // k]`` for ``s = row_slots[r] ≥ 0`` (fp32 product, one
    cast; ``w = 1`` without ``weights``), zeros for padding rows; with ``dot_with`` also the
    per-slot fp32 dot products ``dots[s] = ⟨src[s // k], dot_with[r]⟩``. The values of ``out``
    equal :func:`ptxtrain.moe.grouped_layout.torch_layout_gather`'s bit for bit; ``dots`` sum
    over D in another order (fp32 rounding).

    Inputs are trusted (the layout's own tensors; no range check, no host sync): ``src [T, D]``
    contiguous float, ``row_slots [R]`` int64, ``weights [T, k]`` fp32, ``dot_with [R, D]``
    contiguous, same device.

    Returns:
        ``(out [R, D] in src's dtype, dots [T·k] fp32 or None)``.
    """
    _check_device("src", src)
    n_rows, d = row_slots.shape[0], src.shape[1]
    out = torch.empty((n_rows, d), dtype=src.dtype, device=src.device)
    dots = None
    if dot_with is not None:
        dots = torch.zeros(src.shape[0] * top_k, dtype=torch.float32, device=src.device)
    if n_rows == 0 or d == 0:
        return out, dots
    w = weights.float().contiguous() if weights is not None else src  # (unused pointer)
    block_d = min(512, _pow2(d))
    block_r = max(1, min(32, 4096 // block_d))
    _layout_gather_kernel[(triton.cdiv(n_rows, block_r),)](
        src,
        row_slots,
        w,
        dot_with if dot_with is not None else src,
        out,
        dots if dots is not None else out,
        n_rows,
        d,
        K=top_k,
        HAS_W=weights is not None,
        HAS_DOT=dot_with is not None,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out, dots


def layout_combine(
    y: torch.Tensor, slot_rows: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """``out[t] = Σ_j w[t, j] · y[slot_rows[t, j]]`` in one launch (the weighted un-permutation
    kernel on precomputed rows): fp32 products (``w = 1`` without ``weights``) summed in
    ascending row order, one cast; bitwise
    :func:`ptxtrain.moe.grouped_layout.torch_layout_combine`. Inputs are trusted (no range
    check, no host sync): ``y [R, D]`` contiguous float, ``slot_rows [T, k]`` int64.

    Returns:
        ``[T, D]`` in ``y``'s dtype.
    """
    _check_device("y", y)
    n_tokens, k = slot_rows.shape
    d = y.shape[1]
    out = torch.empty((n_tokens, d), dtype=y.dtype, device=y.device)
    if n_tokens == 0 or d == 0:
        return out
    if weights is None:
        weights = torch.ones((n_tokens, k), dtype=torch.float32, device=y.device)
    return _combine(y, slot_rows.contiguous(), weights, out)
