"""Few-launch helpers of :mod:`ptxtrain.ep.buffer`: the send layout, row packing and the
combine sum, each one Triton kernel with a ``torch_*`` twin (bit-identical results).

Design note (docs/design.md §4; why: a dispatch is host-bound, ~10-20 µs of host time per torch op).

- :func:`send_layout` — everything a dispatch computes from ``topk_idx`` before the count
  exchange, in two kernels over blocks of ``BT`` tokens (one program per block; it was one
  single-program kernel, 252 µs at 4096 tokens x top-8 on an H200, the largest GPU item of a
  dispatch): ``_layout_count_kernel`` writes ``is_token_in_rank [T, R]`` and each block's tokens
  per rank, invalid ids and histogram of expert ids (``tl.histogram``);
  ``_layout_order_kernel`` sums those into the count message ``[R, 3 + E/R]`` (rows for the
  peer, the largest per-peer count, the number of ids outside ``[-1, E)``, the tokens for each
  of the peer's experts; program 0 writes it) and writes the send order (rank-major, ascending
  tokens; the place of a (token, rank) pair is the rank's first place plus the rank's tokens in
  the earlier blocks plus a running ``tl.cumsum`` in the block) and the ``[T, R]`` slot table
  (the send place of every (token, rank) pair, ``-1`` if not sent), which the combine sum reads.
  Between the two, one ``torch.cumsum`` of the block counts over blocks gives each program its
  earlier blocks' tokens per rank (its row minus its own counts) and the totals (the last row):
  the order kernel reads O(1) rows per program, linear in the number of blocks (it re-read every
  earlier block's counts, quadratic: ~37 M loads at 64 K tokens). The message is written
  into row 0 of a ``[2, R, W]`` buffer whose row 1 receives the exchange, so one device-to-host
  copy carries the send and the receive counts. Integer results only: the kernels and
  :func:`torch_send_layout` agree bit for bit (the twin builds no slot table).
- :func:`pack_rows` / :func:`unpack_rows` — the byte rows of several tensors side by side in one
  matrix (the one payload message), and back into contiguous tensors: ONE launch of
  ``_pack_kernel`` instead of an ``index_select`` + ``copy_`` (or a ``clone``) per part. The rows
  are moved in the widest word (8, 4, 2 or 1 bytes) dividing every width, offset and address.
- :func:`combine_sum` — the per-token sum of the rows sent back by a combine, from the slot
  table: a program owns ``BLOCK_T`` tokens x ``BLOCK_H`` columns and adds a token's rows in
  ascending rank (= ascending row) order in fp32 (fp64 for fp64), starting from 0, then casts
  once — the order of ``index_add`` on the CPU (:func:`torch_combine_sum`). CUDA's
  ``index_add`` adds with atomics in a varying order; for at most two rows per token (two ranks)
  the orders agree bitwise, beyond that the kernel is the deterministic one.
- :func:`recv_tail` — after the payload arrived, the received rows' local expert ids and
  weights, their source token index as a vector and their source rank (from the receive
  offsets, a compare per peer): one launch instead of a division, compares, two ``where``, a
  copy and a ``repeat_interleave`` (each of them host time while the GPU waits on the host).

The Triton path is the default on CUDA tensors; CPU tensors take the torch twins (tests run the
kernels on the CPU under ``TRITON_INTERPRET=1`` with ``use_triton=True`` or
``_TRITON_ON_CPU``). Callers validate; these helpers do not.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU installs without Triton use the torch twins
    triton = None

__all__ = [
    "combine_sum",
    "count_per_expert",
    "pack_rows",
    "recv_tail",
    "send_layout",
    "torch_combine_sum",
    "torch_pack_rows",
    "torch_recv_tail",
    "torch_send_layout",
    "torch_unpack_rows",
    "triton_usable",
    "unpack_rows",
]


def count_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many entries of ``expert_ids`` (any shape, int64) name each expert: ``[E]`` int64.

    ``torch.bincount(ids, minlength=E)`` for ids in ``[0, E)``, without its host sync (on CUDA
    bincount reads the maximum back to size its output: a stall in every MoE layer's forward).
    Ids outside ``[0, E)`` are not counted.
    """
    flat = expert_ids.reshape(-1)
    spill = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, spill, torch.ones_like(spill))[:num_experts]


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _token_ranks(idx_ptr, start, T, E, K: tl.constexpr, KP: tl.constexpr, EPR: tl.constexpr,
                     RP: tl.constexpr, BT: tl.constexpr):  # fmt: skip
        """``[BT, RP]`` int64 hit matrix of tokens ``start + [0, BT)`` and their ids."""
        toks = start + tl.arange(0, BT)
        tok_ok = toks < T
        j = tl.arange(0, KP)
        m = tok_ok[:, None] & (j < K)[None, :]
        ids = tl.load(idx_ptr + toks.to(tl.int64)[:, None] * K + j[None, :], mask=m, other=-1)
        valid = m & (ids >= 0) & (ids < E)
        dest = tl.where(valid, ids // EPR, -1)  # [BT, KP]
        r = tl.arange(0, RP)
        hit = tl.max((dest[:, :, None] == r[None, None, :]).to(tl.int64), axis=1)  # [BT, RP]
        return toks, tok_ok, ids, m, valid, hit

    @triton.jit
    def _layout_count_kernel(idx_ptr, in_rank_ptr, blk_ptr, hist_ptr, T, E,
                             R: tl.constexpr, RP: tl.constexpr, K: tl.constexpr,
                             KP: tl.constexpr, EPR: tl.constexpr, BINS: tl.constexpr,
                             BT: tl.constexpr):  # fmt: skip
        """Program ``b``, tokens ``[b·BT, (b+1)·BT)``: ``is_token_in_rank``, the block's tokens
        per rank and its invalid ids (``blk[b] = [per rank (RP), n_bad]``), its histogram of
        expert ids (``hist[b]``)."""
        b = tl.program_id(0)
        r = tl.arange(0, RP)
        r_ok = r < R
        toks, tok_ok, ids, m, valid, hit = _token_ranks(idx_ptr, b * BT, T, E, K, KP, EPR, RP,
                                                        BT)  # fmt: skip
        st = tok_ok[:, None] & r_ok[None, :]
        tl.store(in_rank_ptr + toks.to(tl.int64)[:, None] * R + r[None, :], hit.to(tl.int8),
                 mask=st)  # fmt: skip
        blk = b.to(tl.int64) * (RP + 1)
        tl.store(blk_ptr + blk + r, tl.sum(tl.where(st, hit, 0), axis=0))
        n_bad = tl.sum(tl.sum((m & ((ids < -1) | (ids >= E))).to(tl.int64), 1), 0)
        tl.store(blk_ptr + blk + RP, n_bad)
        spill = tl.reshape(tl.where(valid, ids, E).to(tl.int32), [BT * KP])
        tl.store(hist_ptr + b.to(tl.int64) * BINS + tl.arange(0, BINS), tl.histogram(spill, BINS))

    @triton.jit
    def _layout_order_kernel(idx_ptr, blk_ptr, pre_ptr, tot_ptr, hist_ptr, msg_ptr, order_ptr,
                             slot_ptr, T, E, NB, X0, X1, R: tl.constexpr, RP: tl.constexpr,
                             K: tl.constexpr, KP: tl.constexpr, EPR: tl.constexpr, W: tl.constexpr,
                             BINS: tl.constexpr, BT: tl.constexpr,
                             CH: tl.constexpr, NX: tl.constexpr):  # fmt: skip
        """Program ``b``: the send order and slot table of its tokens (each rank's first place
        plus the tokens for that rank in the blocks before ``b``, plus a running cumsum);
        program 0 also writes the count message ``[R, W]``, its last ``NX`` (0 to 2) columns
        the caller's values ``X0``, ``X1``. ``pre [NB, RP + 1]`` is the inclusive cumsum of
        ``blk`` over blocks and ``tot`` its last row (the totals): a program reads its own rows
        of ``blk`` and ``pre`` and ``tot``, not every earlier block's."""
        b = tl.program_id(0)
        r = tl.arange(0, RP)
        r_ok = r < R
        own = b.to(tl.int64) * (RP + 1)
        per_rank = tl.load(tot_ptr + r)  # [RP] tokens per rank in all blocks
        # tokens per rank in blocks < b: inclusive prefix minus this block's own counts
        before = tl.load(pre_ptr + own + r) - tl.load(blk_ptr + own + r)
        if b == 0:
            tl.store(msg_ptr + r * W, per_rank, mask=r_ok)
            tl.store(msg_ptr + r * W + 1, tl.zeros([RP], tl.int64) + tl.max(per_rank, axis=0),
                     mask=r_ok)  # fmt: skip
            n_bad = tl.load(tot_ptr + RP)
            tl.store(msg_ptr + r * W + 2, tl.zeros([RP], tl.int64) + n_bad, mask=r_ok)
            e = tl.arange(0, BINS)
            hist = tl.zeros([BINS], dtype=tl.int64)
            for c0 in range(0, NB, CH):
                c = c0 + tl.arange(0, CH)
                h = tl.load(hist_ptr + c.to(tl.int64)[:, None] * BINS + e[None, :],
                            mask=(c < NB)[:, None], other=0)  # fmt: skip
                hist += tl.sum(h.to(tl.int64), axis=0)
            tl.store(msg_ptr + (e // EPR) * W + 3 + e % EPR, hist, mask=e < E)
            if NX >= 1:
                tl.store(msg_ptr + r * W + 3 + EPR, tl.zeros([RP], tl.int64) + X0, mask=r_ok)
            if NX >= 2:
                tl.store(msg_ptr + r * W + 4 + EPR, tl.zeros([RP], tl.int64) + X1, mask=r_ok)
        run = tl.cumsum(per_rank, axis=0) - per_rank + before  # [RP] this block's first places
        toks, tok_ok, _, _, _, hit = _token_ranks(idx_ptr, b * BT, T, E, K, KP, EPR, RP,
                                                  BT)  # fmt: skip
        st = tok_ok[:, None] & r_ok[None, :]
        hit = tl.where(st, hit, 0)
        place = run[None, :] + tl.cumsum(hit, axis=0) - 1  # [BT, RP]
        toks64 = toks.to(tl.int64)
        tok2 = tl.zeros([BT, RP], tl.int64) + toks64[:, None]
        tl.store(order_ptr + place, tok2, mask=st & (hit > 0))
        tl.store(slot_ptr + toks64[:, None] * R + r[None, :], tl.where(hit > 0, place, -1),
                 mask=st)  # fmt: skip

    @triton.jit(do_not_specialize=["M"])  # (row counts vary per step, see _recv_tail_kernel)
    def _pack_kernel(packed_ptr, rows_ptr, M, PW, HAS_ROWS: tl.constexpr, UNPACK: tl.constexpr,
                     p0, p1, p2, p3, p4, p5,
                     W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
                     W4: tl.constexpr, W5: tl.constexpr,
                     O0: tl.constexpr, O1: tl.constexpr, O2: tl.constexpr, O3: tl.constexpr,
                     O4: tl.constexpr, O5: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
        pid = tl.program_id(0)
        rr = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = rr < M
        r64 = rr.to(tl.int64)
        src = tl.load(rows_ptr + r64, mask=ok, other=0) if HAS_ROWS else r64
        _pack_part(packed_ptr, p0, r64, src, ok, PW, W0, O0, UNPACK, BLOCK_M, BLOCK_W)
        _pack_part(packed_ptr, p1, r64, src, ok, PW, W1, O1, UNPACK, BLOCK_M, BLOCK_W)
        _pack_part(packed_ptr, p2, r64, src, ok, PW, W2, O2, UNPACK, BLOCK_M, BLOCK_W)
        _pack_part(packed_ptr, p3, r64, src, ok, PW, W3, O3, UNPACK, BLOCK_M, BLOCK_W)
        _pack_part(packed_ptr, p4, r64, src, ok, PW, W4, O4, UNPACK, BLOCK_M, BLOCK_W)
        _pack_part(packed_ptr, p5, r64, src, ok, PW, W5, O5, UNPACK, BLOCK_M, BLOCK_W)

    @triton.jit
    def _pack_part(packed_ptr, part_ptr, r64, src, ok, PW, W: tl.constexpr, OFF: tl.constexpr,
                   UNPACK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):  # fmt: skip
        """Words ``[0, W)`` of part row ``src`` <-> words ``[OFF, OFF + W)`` of packed row."""
        if W > 0:
            for c0 in range(0, W, BLOCK_W):
                c = c0 + tl.arange(0, BLOCK_W)
                m = ok[:, None] & (c < W)[None, :]
                p_off = r64[:, None] * PW + OFF + c[None, :]
                if UNPACK:
                    v = tl.load(packed_ptr + p_off, mask=m)
                    tl.store(part_ptr + r64[:, None] * W + c[None, :], v, mask=m)
                else:
                    v = tl.load(part_ptr + src[:, None] * W + c[None, :], mask=m)
                    tl.store(packed_ptr + p_off, v, mask=m)

    @triton.jit
    def _combine_kernel(back_ptr, slot_ptr, out_ptr, T, H, R: tl.constexpr, ACC: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):  # fmt: skip
        toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        t64 = toks.to(tl.int64)
        ok = (toks < T)[:, None] & (cols < H)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=ACC)
        for r in tl.static_range(R):
            s = tl.load(slot_ptr + t64 * R + r, mask=toks < T, other=-1)  # [BT]
            m = ok & (s >= 0)[:, None]
            v = tl.load(back_ptr + s[:, None] * H + cols[None, :], mask=m, other=0.0)
            acc = tl.where(m, acc + v.to(ACC), acc)
        tl.store(out_ptr + t64[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=ok)  # fmt: skip

    # N, lo, hi: not specialized (divisible by 16 or not, == 1), so a training run whose row
    # counts vary from step to step compiles one variant instead of several mid-run.
    @triton.jit(do_not_specialize=["N", "lo", "hi"])
    def _recv_tail_kernel(w_ptr, g_ptr, src_ptr, off_ptr, idx_out, w_out, src_out, rank_out, N,
                          lo, hi, K: tl.constexpr, KP: tl.constexpr, R: tl.constexpr,
                          BLOCK_N: tl.constexpr):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = rows < N
        r64 = rows.to(tl.int64)
        cols = tl.arange(0, KP)
        m = ok[:, None] & (cols < K)[None, :]
        o = r64[:, None] * K + cols[None, :]
        g = tl.load(g_ptr + o, mask=m, other=-1)
        w = tl.load(w_ptr + o, mask=m, other=0.0)
        local = (g >= lo) & (g < hi)  # the floor test of the twin, without a division
        tl.store(idx_out + o, tl.where(local, g - lo, -1), mask=m)
        tl.store(w_out + o, tl.where(local, w, 0.0).to(w.dtype), mask=m)
        tl.store(src_out + r64, tl.load(src_ptr + r64, mask=ok), mask=ok)
        src_rank = tl.zeros([BLOCK_N], dtype=tl.int64)
        for r in tl.static_range(1, R):  # rows before recv_off[r] came from ranks < r
            src_rank += (r64 >= tl.load(off_ptr + r)).to(tl.int64)
        tl.store(rank_out + r64, src_rank, mask=ok)


_TRITON_ON_CPU = False  # tests: run the kernels on CPU tensors too (TRITON_INTERPRET=1 only)
_LAYOUT_BLOCK_T = 0  # tests: tokens per layout program (0: the default, chosen per shape)


def triton_usable(t: torch.Tensor) -> bool:
    """True when the default path for ``t`` is Triton: a CUDA tensor (CPU tensors take the
    torch twins, unless a test set ``_TRITON_ON_CPU`` with the kernels interpreted)."""
    if triton is None:
        return False
    if t.device.type == "cuda":
        return True
    if not _TRITON_ON_CPU:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_layout_count_kernel, InterpretedFunction)


# --------------------------------------------------------------------------------------------
# Send layout
# --------------------------------------------------------------------------------------------


def torch_send_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int, *, extra: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
    """Torch twin of :func:`send_layout` (no slot table: the fourth result is ``None``)."""
    n_tokens, dev = topk_idx.shape[0], topk_idx.device
    experts_per_rank = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)  # [T, k]
    n_bad = ((topk_idx < -1) | (topk_idx >= num_experts)).sum()
    # Invalid slots point at a spill column (R for ranks, E for experts) dropped afterwards.
    dest = torch.where(valid, topk_idx // experts_per_rank, num_ranks)  # [T, k]
    in_rank = torch.zeros(n_tokens, num_ranks + 1, dtype=torch.bool, device=dev).scatter_(
        1, dest, True
    )[:, :num_ranks]  # [T, R]
    per_rank = in_rank.sum(0, dtype=torch.int64)  # [R]
    per_expert = count_per_expert(topk_idx, num_experts)  # [E] valid slots (no bincount sync)
    width = 3 + experts_per_rank + len(extra)
    counts = torch.empty(2, num_ranks, width, dtype=torch.int64, device=dev)
    counts[0, :, 0] = per_rank
    counts[0, :, 1] = per_rank.max()
    counts[0, :, 2] = n_bad
    counts[0, :, 3 : 3 + experts_per_rank] = per_expert.view(num_ranks, experts_per_rank)
    for j, value in enumerate(extra):  # scalar fills: no host-to-device copy
        counts[0, :, 3 + experts_per_rank + j].fill_(value)
    # Send order (rank-major, ascending tokens) without nonzero (a sync): the place of each
    # (rank, token) pair is the running count of pairs before it; others go to a spill slot.
    flat = in_rank.t().reshape(-1)  # [R·T]
    n_pairs = flat.numel()
    place = torch.where(flat, flat.cumsum(0) - 1, n_pairs)
    token_of = torch.arange(n_pairs, dtype=torch.int64, device=dev) % max(n_tokens, 1)
    order = torch.empty(n_pairs + 1, dtype=torch.int64, device=dev).scatter_(0, place, token_of)
    return in_rank.contiguous(), counts, order[:n_pairs], None


def send_layout(
    topk_idx: torch.Tensor,
    num_experts: int,
    num_ranks: int,
    *,
    use_triton: bool | None = None,
    extra: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The send side of a dispatch from ``topk_idx``, with device ops only (no host sync).

    Args:
        topk_idx: ``[T, k]`` int64 global expert ids; ids outside ``[0, E)`` are skipped (and
            those outside ``[-1, E)`` counted).
        num_experts / num_ranks: ``E`` and ``R`` (``E % R == 0``; validated by the caller).
        use_triton: ``None`` = the Triton kernel where :func:`triton_usable`, else torch.
        extra: up to two int64 values appended as columns to every row of the count message
            (:class:`ptxtrain.ep.Buffer` sends the call's signature there).

    Returns:
        ``is_token_in_rank [T, R]`` bool; ``counts [2, R, 3 + E/R + len(extra)]`` int64 whose
        row 0 is the count message (per peer ``r``: tokens for ``r``, the largest of those
        counts, ids outside ``[-1, E)``, the tokens for each of ``r``'s experts, then the
        ``extra`` values) and row 1 is uninitialized (the receive buffer of the exchange);
        ``order [T·R]`` int64 whose first ``S = Σ counts[0, :, 0]`` entries are the sent
        tokens (rank-major, ascending tokens), the rest unspecified; ``slot [T, R]`` int64,
        the send place of each (token, rank) pair or ``-1`` (``None`` on the torch path).

    Source: DeepEP ``get_dispatch_layout`` + the notify step; docs/design.md §4.
    """
    if use_triton is None:
        use_triton = triton_usable(topk_idx)
    if len(extra) > 2:
        raise ValueError(f"extra: at most two values, got {len(extra)}")
    if not use_triton:
        return torch_send_layout(topk_idx, num_experts, num_ranks, extra=extra)
    n_tokens, k = topk_idx.shape
    dev = topk_idx.device
    epr = num_experts // num_ranks
    width = 3 + epr + len(extra)
    in_rank = torch.empty(n_tokens, num_ranks, dtype=torch.bool, device=dev)
    counts = torch.empty(2, num_ranks, width, dtype=torch.int64, device=dev)
    order = torch.empty(max(n_tokens * num_ranks, 1), dtype=torch.int64, device=dev)
    slot = torch.empty(n_tokens, num_ranks, dtype=torch.int64, device=dev)
    kp, rp = _pow2(k), _pow2(num_ranks)
    block_t = _LAYOUT_BLOCK_T or max(1, min(64, 2048 // (kp * rp)))
    n_blocks = max(1, -(-n_tokens // block_t))
    bins = _pow2(num_experts + 1)
    blk = torch.empty(n_blocks, rp + 1, dtype=torch.int64, device=dev)
    hist = torch.empty(n_blocks, bins, dtype=torch.int32, device=dev)
    idx = topk_idx.contiguous()
    meta = dict(R=num_ranks, RP=rp, K=k, KP=kp, EPR=epr, BINS=bins, BT=block_t)
    _layout_count_kernel[(n_blocks,)](
        idx, in_rank.view(torch.int8), blk, hist, n_tokens, num_experts, **meta
    )
    pre = torch.cumsum(blk, 0)  # [NB, RP + 1] inclusive prefix over blocks (one cheap op)
    x0, x1 = (*extra, 0, 0)[:2]
    _layout_order_kernel[(n_blocks,)](
        idx, blk, pre, pre[n_blocks - 1], hist, counts, order, slot, n_tokens, num_experts,
        n_blocks, x0, x1, W=width, CH=min(16, _pow2(n_blocks)), NX=len(extra), **meta,
    )  # fmt: skip
    return in_rank, counts, order[: n_tokens * num_ranks], slot


# --------------------------------------------------------------------------------------------
# Row packing
# --------------------------------------------------------------------------------------------

_MAX_PARTS = 6


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[M, ...]`` -> ``[M, row bytes]`` uint8 view (contiguous)."""
    t = t.contiguous()
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _word(*sizes: int) -> tuple[int, torch.dtype]:
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all(s % size == 0 for s in sizes):
            return size, dtype
    return 1, torch.uint8


def torch_pack_rows(
    parts: list[torch.Tensor], width: int, rows: torch.Tensor | None
) -> torch.Tensor:
    """Torch twin of :func:`pack_rows`."""
    views = [_as_bytes(p) for p in parts]
    n = views[0].shape[0] if rows is None else rows.numel()
    out = torch.empty(n, width, dtype=torch.uint8, device=views[0].device)
    off = 0
    for v in views:
        w = v.shape[1]
        out[:, off : off + w].copy_(v if rows is None else v.index_select(0, rows))
        off += w
    return out


def torch_unpack_rows(packed: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Torch twin of :func:`unpack_rows`."""
    out, off, n = [], 0, packed.shape[0]
    for p in parts:
        w = math.prod(p.shape[1:]) * p.element_size()
        piece = packed[:, off : off + w]
        if w != packed.shape[1] or piece.storage_offset() % p.element_size():
            piece = piece.clone(memory_format=torch.contiguous_format)  # offset 0, aligned
        out.append(piece.view(p.dtype).reshape(n, *p.shape[1:]))
        off += w
    return out


def _launch_pack(packed, views, rows, unpack):
    width = packed.shape[1]
    sizes = [width, packed.data_ptr()] + [v.shape[1] for v in views] + [v.data_ptr() for v in views]
    size, wdt = _word(*sizes)
    n = packed.shape[0]
    words = [v.view(wdt) if v.numel() else v.new_empty(0, dtype=wdt) for v in views]
    widths, offs, off = [], [], 0
    for v in views:
        widths.append(v.shape[1] // size)
        offs.append(off // size)
        off += v.shape[1]
    pad = _MAX_PARTS - len(views)
    ptrs = words + [words[0]] * pad
    widths += [0] * pad
    offs += [0] * pad
    if n == 0:
        return
    block_w = min(256, _pow2(max(widths)))
    block_m = max(1, min(16, 2048 // block_w))
    _pack_kernel[(triton.cdiv(n, block_m),)](
        packed.view(wdt), rows if rows is not None else packed, n, width // size,
        rows is not None, unpack, *ptrs,
        *widths, *offs, BLOCK_M=block_m, BLOCK_W=block_w,
    )  # fmt: skip


def pack_rows(
    parts: list[torch.Tensor], width: int, rows: torch.Tensor | None, *, use_triton=None
) -> torch.Tensor:
    """The rows of ``parts`` (each ``[M, ...]``, any dtype) side by side as ``[n, width]`` uint8.

    ``rows`` (int64 ``[n]``) selects and orders the rows (``None``: all ``M``). ``width`` is at
    least the summed row bytes; bytes past the parts are left uninitialized. At most six parts
    on the Triton path (one launch).
    """
    if use_triton is None:
        use_triton = triton_usable(parts[0]) and len(parts) <= _MAX_PARTS
    if not use_triton:
        return torch_pack_rows(parts, width, rows)
    views = [_as_bytes(p) for p in parts]
    n = views[0].shape[0] if rows is None else rows.numel()
    out = torch.empty(n, width, dtype=torch.uint8, device=views[0].device)
    _launch_pack(out, views, rows, unpack=False)
    return out


def unpack_rows(
    packed: torch.Tensor, parts: list[torch.Tensor], *, use_triton=None
) -> list[torch.Tensor]:
    """Inverse of :func:`pack_rows` on ``[K, width]`` rows: one ``[K, ...]`` tensor per part
    (shape and dtype of the part's rows), contiguous."""
    if use_triton is None:
        use_triton = triton_usable(packed) and len(parts) <= _MAX_PARTS
    if not use_triton:
        return torch_unpack_rows(packed, parts)
    n = packed.shape[0]
    outs = [torch.empty((n, *p.shape[1:]), dtype=p.dtype, device=packed.device) for p in parts]
    _launch_pack(packed, [_as_bytes(o) for o in outs], None, unpack=True)
    return outs


# --------------------------------------------------------------------------------------------
# Combine sum
# --------------------------------------------------------------------------------------------


def torch_combine_sum(back: torch.Tensor, send_src_idx: torch.Tensor, n_tokens: int):
    """Torch twin of :func:`combine_sum` (``index_add`` by the send order)."""
    acc = torch.float64 if back.dtype == torch.float64 else torch.float32
    out = torch.zeros((n_tokens, *back.shape[1:]), dtype=acc, device=back.device)
    out.index_add_(0, send_src_idx, back.to(acc))  # [T, ...]
    return out.to(back.dtype)


def combine_sum(back: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """Rows in the send order ``[S, ...]`` -> per-token sums ``[T, ...]`` (Triton; one launch).

    ``slot [T, R]`` int64 from :func:`send_layout`. Accumulated in fp32 (fp64 for fp64) in
    ascending rank order, returned in ``back``'s dtype.
    """
    n_tokens, n_ranks = slot.shape
    out = torch.empty((n_tokens, *back.shape[1:]), dtype=back.dtype, device=back.device)
    hidden = math.prod(back.shape[1:])
    if n_tokens == 0 or hidden == 0:
        return out
    acc = tl.float64 if back.dtype == torch.float64 else tl.float32
    block_h = min(1024, _pow2(hidden))
    block_t = max(1, min(16, 2048 // block_h))
    grid = (triton.cdiv(n_tokens, block_t), triton.cdiv(hidden, block_h))
    _combine_kernel[grid](
        back.contiguous(), slot, out, n_tokens, hidden, R=n_ranks, ACC=acc,
        BLOCK_T=block_t, BLOCK_H=block_h,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Receive tail
# --------------------------------------------------------------------------------------------


def torch_recv_tail(recv_w, recv_global, recv_src, recv_off, rank: int, experts_per_rank: int):
    """Torch twin of :func:`recv_tail` (same arguments and results)."""
    # Local iff the floor quotient is this rank (-1 // E/R = -1 never is).
    local = torch.div(recv_global, experts_per_rank, rounding_mode="floor") == rank
    recv_topk_idx = torch.where(local, recv_global - rank * experts_per_rank, -1)
    recv_topk_weights = torch.where(local, recv_w, 0.0)
    n = recv_global.shape[0]
    src_rank = torch.repeat_interleave(recv_off.diff(), output_size=n)
    return recv_topk_idx, recv_topk_weights, recv_src[:, 0].contiguous(), src_rank


def recv_tail(
    recv_w: torch.Tensor,
    recv_global: torch.Tensor,
    recv_src: torch.Tensor,
    recv_off: torch.Tensor,
    rank: int,
    experts_per_rank: int,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a dispatch derives from its received rows' metadata, in one launch.

    Args:
        recv_w: ``[N, k]`` float32 / float64 gate weights as received.
        recv_global: ``[N, k]`` int64 global expert ids as received (``-1`` or ``[0, E)``).
        recv_src: ``[N, 1]`` int64 source token index of every row.
        recv_off: ``[R + 1]`` int64 receive offsets (prefix sums of the receive counts,
            ``recv_off[R] = N``).
        rank / experts_per_rank: this rank and ``E / R``.

    Returns:
        ``recv_topk_idx [N, k]`` int64 (local expert id, ``-1`` where the expert is elsewhere
        or was ``-1``), ``recv_topk_weights [N, k]`` (``recv_w``'s dtype, 0 where not local),
        ``recv_src_idx [N]`` int64 and ``recv_src_rank [N]`` int64 (row ``n`` came from the rank
        ``s`` with ``recv_off[s] <= n < recv_off[s + 1]``); bit-identical to
        :func:`torch_recv_tail` (integer selects and copies only).

    Source: DeepEP ``Buffer.dispatch``'s received ``topk_idx`` / ``topk_weights``;
    docs/design.md §4.
    """
    if use_triton is None:
        use_triton = triton_usable(recv_global)
    if not use_triton:
        return torch_recv_tail(recv_w, recv_global, recv_src, recv_off, rank, experts_per_rank)
    n, k = recv_global.shape
    dev = recv_global.device
    idx = torch.empty(n, k, dtype=torch.int64, device=dev)
    w = torch.empty(n, k, dtype=recv_w.dtype, device=dev)
    src = torch.empty(n, dtype=torch.int64, device=dev)
    src_rank = torch.empty(n, dtype=torch.int64, device=dev)
    if n == 0:
        return idx, w, src, src_rank
    kp = _pow2(k)
    block_n = max(1, min(128, 1024 // kp))
    lo = rank * experts_per_rank
    _recv_tail_kernel[(triton.cdiv(n, block_n),)](
        recv_w.contiguous(), recv_global.contiguous(), recv_src.contiguous(),
        recv_off.contiguous(), idx, w, src, src_rank, n, lo, lo + experts_per_rank,
        K=k, KP=kp, R=recv_off.shape[0] - 1, BLOCK_N=block_n,
    )  # fmt: skip
    return idx, w, src, src_rank
