"""Expert-parallel dispatch / combine on gloo, against single-process recomputations.

Following DeepEP's test method (its tests/test_intranode.py): every rank builds *all* ranks'
inputs from one seed, so it can recompute, in plain Python, what it must receive. Rows are
rank-encoded (column 0 = the source rank, column 1 = the source token index), so the order of
received rows is checked both against the recomputation and by decoding the rows themselves. Each
world size spawns its processes once and runs every check inside, once on ``all_to_all_single`` and
once through the nvlink backend's Python side (index lists, byte rows, padding, capacity, autograd)
with the kernel replaced by :class:`GlooTransport`, a gloo emulation of its contract. The kernel
itself is tested on GPUs in ``test_nvlink.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ptxtrain.ep import Buffer, Config, DispatchHandle, EventOverlap, get_dispatch_layout
from ptxtrain.moe.ref import permute_ref, unpermute_ref
from ptxtrain.quant.ref import per_token_cast_to_fp8
from tests._spawn import run_gloo


def _interpreted() -> bool:
    import ptxtrain.ep.layout as lay

    if lay.triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(lay._layout_count_kernel, InterpretedFunction)


_INTERPRETED = _interpreted()

# --------------------------------------------------------------------------- input builders


def _routing(g, n_tokens, k, num_experts, allowed, p_none):
    """[T, k] distinct experts drawn from ``allowed`` (skewed: uneven loads), some slots -1."""
    probs = torch.zeros(num_experts, dtype=torch.float64)
    probs[allowed] = (torch.arange(len(allowed), dtype=torch.float64) + 1) ** 2  # skewed loads
    if n_tokens == 0:
        return torch.empty(0, k, dtype=torch.int64)
    idx = torch.multinomial(probs.expand(n_tokens, -1), k, replacement=False, generator=g)
    none = torch.rand(n_tokens, k, generator=g) < p_none
    return torch.where(none, -1, idx)


def _scenario(world, seed, tokens, hidden, k, num_experts, *, deaf_rank=None, mute_rank=None):
    """All ranks' (x fp32 rank-encoded, topk_idx, topk_weights fp32).

    ``deaf_rank``: no token routes to its experts (it receives nothing); ``mute_rank``: all its
    slots are -1 (it has tokens but sends nothing).
    """
    g = torch.Generator().manual_seed(seed)
    per_rank = num_experts // world
    allowed = [e for e in range(num_experts) if deaf_rank is None or e // per_rank != deaf_rank]
    xs, idxs, ws = [], [], []
    for r in range(world):
        n = tokens[r]
        x = torch.randn(n, hidden, generator=g)
        x[:, 0] = r
        x[:, 1] = torch.arange(n)
        idx = _routing(g, n, k, num_experts, allowed, p_none=0.15)
        if r == mute_rank:
            idx.fill_(-1)
        elif n > 0 and k <= per_rank:
            # token 0: all k experts on one rank (other than deaf_rank) -> must be sent once.
            dst = next(q % world for q in range(r + 1, r + 1 + world) if q % world != deaf_rank)
            idx[0] = dst * per_rank + torch.randperm(per_rank, generator=g)[:k]
        xs.append(x)
        idxs.append(idx)
        ws.append(torch.rand(n, k, generator=g) + 0.1)
    return xs, idxs, ws


def _expected(me, world, num_experts, xs, idxs, ws):
    """What rank ``me`` must receive, by a plain Python loop (independent of the module)."""
    per_rank = num_experts // world
    rows, loc_idx, loc_w, src = [], [], [], []
    for s in range(world):
        for t in range(idxs[s].shape[0]):
            ids = idxs[s][t].tolist()
            loc = [e - me * per_rank if e >= 0 and e // per_rank == me else -1 for e in ids]
            if all(v < 0 for v in loc):
                continue
            rows.append(xs[s][t])
            loc_idx.append(loc)
            loc_w.append([float(ws[s][t, j]) if loc[j] >= 0 else 0.0 for j in range(len(loc))])
            src.append((s, t))
    hidden, k = xs[0].shape[1], idxs[0].shape[1]
    recv_x = torch.stack(rows) if rows else xs[0].new_empty(0, hidden)
    recv_idx = torch.tensor(loc_idx, dtype=torch.int64).reshape(-1, k)
    recv_w = torch.tensor(loc_w, dtype=ws[0].dtype).reshape(-1, k)
    counts = [sum(row.count(e) for row in loc_idx) for e in range(per_rank)]
    return recv_x, recv_idx, recv_w, counts, src


def _check_exact(name, got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{name}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    )
    # Dispatch only moves data: exact equality (bytes for FP8, which lacks ==).
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want), f"{name} differs: {(got != want).nonzero()[:5].tolist()}"


# --------------------------------------------------------------------------- checks per rank


def _check_validation(buf, rank):
    x = torch.randn(4, 8)
    idx = torch.tensor([[0, 1], [2, -1], [1, 0], [-1, -1]])
    w = torch.rand(4, 2)
    n_exp = 2 * buf.num_ranks
    bad = [
        (TypeError, "x", dict(x=x.long())),
        (ValueError, "x", dict(x=x[0])),
        (TypeError, "topk_idx", dict(topk_idx=idx.int())),
        (ValueError, "topk_idx", dict(topk_idx=idx[:3])),
        (ValueError, "topk_idx", dict(topk_idx=idx.clamp(max=0) - 2)),
        (ValueError, "topk_idx", dict(topk_idx=idx + n_exp)),
        (TypeError, "topk_weights", dict(topk_weights=w.bfloat16())),
        (ValueError, "topk_weights", dict(topk_weights=w[:, :1])),
        (ValueError, "num_experts", dict(num_experts=n_exp + 1)),
        (TypeError, "num_experts", dict(num_experts=2.0)),
        (TypeError, "x_fp8", dict(x=(x, torch.ones(4, 1)))),
        (ValueError, "sf", dict(x=(x.to(torch.float8_e4m3fn), torch.ones(4, 2)))),
    ]
    for exc, word, override in bad:
        args = dict(x=x, topk_idx=idx, topk_weights=w, num_experts=n_exp) | override
        with pytest.raises(exc, match=word):
            buf.dispatch(**args)
    if not torch.cuda.is_available():  # (on a GPU host the gloo ranks could build one)
        with pytest.raises(ValueError, match="backend"):
            Buffer(backend="nvlink")  # no CUDA here
    with pytest.raises(TypeError, match="handle"):
        buf.combine(x, handle=None)[0]
    # Ranks disagreeing on the row layout: raised on every rank before the payload moves (the
    # rows were cut short or misread; same row bytes: bf16 [., 16] = fp32 [., 8] read as bf16).
    g = torch.Generator().manual_seed(40 + rank)
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(4)])
    odd = rank == buf.num_ranks - 1
    mismatches = [
        ("hidden=12", torch.randn(4, 12 if odd else 8), w),
        ("x dtype bfloat16", torch.randn(4, 16).bfloat16() if odd else torch.randn(4, 8), w),
        ("topk_weights dtype float64", x, w.double() if odd else w),
    ]
    for word, xx, ww in mismatches:
        with pytest.raises(ValueError, match=word):
            buf.dispatch(xx, topk_idx=idx, topk_weights=ww, num_experts=n_exp)
    with pytest.raises(ValueError, match="k=3"):  # a wider topk_idx on one rank
        buf.dispatch(
            x,
            topk_idx=idx[:, [0, 1, 1]] if odd else idx,
            topk_weights=w[:, [0, 1, 1]] if odd else w,
            num_experts=n_exp,
        )
    # Another num_experts on one rank: its count message has another number of columns, padded
    # to the same width for the exchange, so every rank raises (unpadded, gloo aborts the process).
    with pytest.raises(ValueError, match="num_experts"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=2 * n_exp if odd else n_exp)
    with pytest.raises(ValueError, match="at most 1024 per rank"):  # before any communication
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=1025 * buf.num_ranks)
    # combine's rows must have the dispatch's hidden size (then every rank's agree): raised
    # locally, before any communication, on the rank that differs.
    recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=n_exp)
    assert handle.hidden == 8
    if odd:
        with pytest.raises(ValueError, match="hidden size 8"):
            buf.combine(torch.cat([recv_x, recv_x[:, :4]], 1), handle)[0]
    buf.combine(recv_x, handle)[0]  # every rank, so the group stays in step


def _check_layout_and_dispatch(buf, rank, world, seed, tokens, k, num_experts, **kw):
    xs, idxs, ws = _scenario(world, seed, tokens, 16, k, num_experts, **kw)
    # The pure layout against a Python loop.
    per_rank = num_experts // world
    n_rank, n_exp, in_rank = get_dispatch_layout(idxs[rank], num_experts, world)
    want_in = torch.tensor(
        [
            [any(e >= 0 and e // per_rank == r for e in row) for r in range(world)]
            for row in idxs[rank].tolist()
        ],
        dtype=torch.bool,
    ).reshape(-1, world)
    _check_exact("is_token_in_rank", in_rank, want_in)
    _check_exact("num_tokens_per_rank", n_rank, want_in.sum(0))
    want_exp = torch.tensor([(idxs[rank] == e).sum() for e in range(num_experts)])
    _check_exact("num_tokens_per_expert", n_exp, want_exp)

    recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
        xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank], num_experts=num_experts
    )
    want_x, want_idx, want_w, want_counts, src = _expected(rank, world, num_experts, xs, idxs, ws)
    _check_exact("recv_x", recv_x, want_x)
    _check_exact("recv_topk_idx", recv_idx, want_idx)
    _check_exact("recv_topk_weights", recv_w, want_w)
    assert counts == want_counts, f"num_recv_tokens_per_expert {counts} != {want_counts}"
    # Order: by source rank, then source token, decoded from the rows themselves and the handle.
    decoded = [(int(a), int(b)) for a, b in recv_x[:, :2].tolist()]
    assert decoded == src == sorted(src), f"receive order {decoded[:8]} != {src[:8]}"
    from_handle = list(zip(handle.recv_src_rank.tolist(), handle.recv_src_idx.tolist()))
    assert from_handle == src
    assert isinstance(handle, DispatchHandle) and handle.num_recv_tokens == len(src)
    return xs, idxs, ws


def _check_fp8(buf, rank, world, num_experts):
    xs, idxs, ws = _scenario(world, 11, [6, 3, 8, 5][:world], 200, 2, num_experts)
    q = [per_token_cast_to_fp8(x * 10) for x in xs]  # H=200: a tail block, sf [T, 2]
    (rx, rsf), recv_idx, _, _, _, _ = buf.dispatch(
        q[rank], topk_idx=idxs[rank], topk_weights=ws[rank], num_experts=num_experts
    )
    want_q, want_idx, *_ = _expected(rank, world, num_experts, [a for a, _ in q], idxs, ws)
    want_sf, *_ = _expected(rank, world, num_experts, [b for _, b in q], idxs, ws)
    _check_exact("recv_x_fp8", rx, want_q)
    _check_exact("recv_sf", rsf, want_sf)
    _check_exact("recv_topk_idx (fp8)", recv_idx, want_idx)


def _check_combine_bf16(buf, rank, world, num_experts):
    xs, idxs, ws = _scenario(world, 12, [7, 4, 9, 6][:world], 24, 3, num_experts)
    x = xs[rank].bfloat16().requires_grad_()
    recv_x, _, _, _, handle, _ = buf.dispatch(
        x, topk_idx=idxs[rank], topk_weights=ws[rank], num_experts=num_experts
    )
    assert recv_x.dtype == torch.bfloat16
    out = buf.combine(recv_x, handle)[0]
    n_ranks = handle.is_token_in_rank.sum(1, keepdim=True).float()  # distinct ranks per token
    # ≤4 bf16 copies sum exactly in fp32, then one rounding, as in the reference: exact.
    _check_exact("combine(dispatch(x))", out, (x.detach().float() * n_ranks).bfloat16())
    # Backward through combine (a dispatch) and dispatch (a combine): d(sum out)/dx = n_ranks,
    # small integers, exact in bf16.
    out.sum().backward()
    _check_exact("bf16 dx", x.grad, n_ranks.expand_as(x).bfloat16())


def _moe_reference(x, idx, w, experts):
    """Single-process top-k MoE with ``f_e(x) = tanh(x W_e)``; -1 slots contribute nothing."""
    clean_idx = idx.clamp(min=0)
    clean_w = torch.where(idx >= 0, w, torch.zeros_like(w))
    xp, slots, per_expert = permute_ref(x, clean_idx, experts.shape[0])
    chunks = xp.split(per_expert.tolist())
    yp = torch.cat([torch.tanh(c @ experts[e]) for e, c in enumerate(chunks)])
    return unpermute_ref(yp, slots, clean_w)


def _check_moe_end_to_end(buf, rank, world, num_experts):
    g = torch.Generator().manual_seed(13)
    hidden = 12
    xs, idxs, ws = _scenario(world, 13, [8, 5, 0, 7][:world], hidden, 3, num_experts)
    experts = torch.randn(num_experts, hidden, hidden, generator=g, dtype=torch.float64) * 0.3
    grads_out = [torch.randn(x.shape[0], hidden, generator=g, dtype=torch.float64) for x in xs]
    xs = [x.double().requires_grad_() for x in xs]
    ws = [w.double().requires_grad_() for w in ws]

    # Distributed: dispatch -> local experts on the receiving side -> weighted sum -> combine.
    recv_x, recv_idx, recv_w, _, handle, _ = buf.dispatch(
        xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank], num_experts=num_experts
    )
    per_rank = num_experts // world
    y_recv = torch.zeros_like(recv_x)
    for j in range(recv_idx.shape[1]):
        for e in range(per_rank):
            hit = (recv_idx[:, j] == e).unsqueeze(1)
            y_e = recv_w[:, j : j + 1] * torch.tanh(recv_x @ experts[rank * per_rank + e])
            y_recv = y_recv + torch.where(hit, y_e, torch.zeros_like(y_e))
    y = buf.combine(y_recv, handle)[0]
    (y * grads_out[rank]).sum().backward()

    # Single process, all ranks' tokens at once.
    ref_x = [x.detach().clone().requires_grad_() for x in xs]
    ref_w = [w.detach().clone().requires_grad_() for w in ws]
    ys = [_moe_reference(a, i, b, experts) for a, i, b in zip(ref_x, idxs, ref_w)]
    sum((yy * go).sum() for yy, go in zip(ys, grads_out)).backward()

    # fp64 throughout; only the summation order differs (rounding ~1e-16 x a few dozen terms):
    # 1e-12 leaves a wide margin while any misrouted row gives O(0.1) errors.
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, ys[rank].detach(), **tol, msg=lambda m: f"MoE output: {m}")
    torch.testing.assert_close(xs[rank].grad, ref_x[rank].grad, **tol, msg=lambda m: f"dx: {m}")
    torch.testing.assert_close(ws[rank].grad, ref_w[rank].grad, **tol, msg=lambda m: f"dw: {m}")


class GlooTransport:
    """The nvlink kernel's contract (``NvlinkTransport.exchange``) emulated with gloo.

    Send row ``i`` goes to the rank ``d`` whose ``send_off`` group holds ``i``, at place ``i -
    send_off[d]``; output row ``k`` is place ``k - recv_off[s]`` of what rank ``s`` sent here
    (``s``: the ``recv_off`` group of ``k``); capacity ``num_nvl_bytes // (R · row bytes)`` rows
    per peer, as the real transport.
    """

    def __init__(self, rank, num_ranks, num_nvl_bytes):
        self.rank, self.num_ranks, self.num_nvl_bytes = rank, num_ranks, num_nvl_bytes
        self.device = torch.device("cpu")
        self.row_bytes_seen = set()
        self.calls = 0

    def capacity_rows(self, row_bytes):
        return self.num_nvl_bytes // (self.num_ranks * row_bytes)

    def exchange(self, rows, send_row, send_off, recv_off, num_recv):
        self.calls += 1
        # The contract: int64 offsets of R + 1 ascending entries that cover the send list and
        # the output; the kernel derives each row's peer and place from them.
        for off, total in ((send_off, send_row.numel()), (recv_off, num_recv)):
            assert off.dtype == torch.int64 and off.shape == (self.num_ranks + 1,)
            assert off[0] == 0 and off[-1] == total and bool((off.diff() >= 0).all())
        assert send_row.dtype == torch.int64
        assert rows.dtype == torch.uint8 and rows.shape[1] % 16 == 0 and rows.is_contiguous()
        send_dst = torch.repeat_interleave(send_off.diff())
        send_slot = torch.arange(send_row.numel()) - send_off[send_dst]
        recv_src = torch.repeat_interleave(recv_off.diff())
        recv_slot = torch.arange(num_recv) - recv_off[recv_src]
        self.row_bytes_seen.add(rows.shape[1])
        sent = (rows[send_row], send_dst, send_slot)
        everyone = [None] * self.num_ranks
        dist.all_gather_object(everyone, sent)
        regions = []  # regions[s][j]: the j-th row rank s sent here
        for r_rows, r_dst, r_slot in everyone:
            mine = (r_dst == self.rank).nonzero()[:, 0]
            slots, order = r_slot[mine].sort()
            assert torch.equal(slots, torch.arange(mine.numel())), "slots not 0..count-1"
            regions.append(r_rows[mine[order]])
        out = rows.new_zeros(recv_src.shape[0], rows.shape[1])
        for src in range(self.num_ranks):
            at = (recv_src == src).nonzero()[:, 0]
            out[at] = regions[src][recv_slot[at]]  # IndexError if a slot is out of range
        return out


def _check_async(buf, rank, world, num_experts):
    xs, idxs, ws = _scenario(world, 21, [5, 8, 3, 6][:world], 16, 2, num_experts)
    sync = buf.dispatch(
        xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank], num_experts=num_experts
    )
    *got, event = buf.dispatch(
        xs[rank],
        topk_idx=idxs[rank],
        topk_weights=ws[rank],
        num_experts=num_experts,
        async_finish=True,
    )
    assert isinstance(event, EventOverlap) and event.is_complete()
    event.current_stream_wait()
    event.synchronize()
    for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), got, sync):
        _check_exact(f"async {name}", a, b)
    assert got[3] == sync[3]
    y = torch.randn(sync[0].shape, generator=torch.Generator().manual_seed(rank))
    out, _, event = buf.combine(y, got[4], async_finish=True)
    assert isinstance(event, EventOverlap) and event.is_complete()
    _check_exact("async combine", out, buf.combine(y, sync[4])[0])


def _check_deepep_api(buf, rank, world, num_experts):
    """DeepEP's call shapes: fixed arities, the layout tensors, expert_alignment, a cached
    dispatch, combine's topk_weights / bias, and the arguments ptxtrain refuses."""
    xs, idxs, ws = _scenario(world, 23, [7, 4, 9, 5][:world], 16, 3, num_experts)
    x, idx, w = xs[rank], idxs[rank], ws[rank]
    layout = buf.get_dispatch_layout(idx, num_experts)
    assert len(layout) == 5 and layout[1] is None and isinstance(layout[4], EventOverlap)
    for got, want in zip(layout[0:1] + layout[2:4], get_dispatch_layout(idx, num_experts, world)):
        _check_exact("get_dispatch_layout", got, want)
    per_rank, _, per_expert, in_rank, _ = layout
    res = buf.dispatch(x, None, per_rank, None, in_rank, per_expert, idx, w)  # positional
    assert len(res) == 6 and isinstance(res[5], EventOverlap) and res[5].is_complete()
    plain = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts)
    for name, a, b in zip(("recv_x", "recv_topk_idx", "recv_topk_weights"), res, plain):
        _check_exact(f"layout-given {name}", a, b)
    aligned = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=num_experts,
                           expert_alignment=4)[3]  # fmt: skip
    assert aligned == [-(-c // 4) * 4 for c in res[3]], (aligned, res[3])
    # A cached dispatch: another tensor of the same tokens along the same layout.
    kw = dict(topk_idx=idx, topk_weights=w, num_experts=num_experts)
    handle = res[4]
    x2 = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank), dtype=x.dtype)
    cached = buf.dispatch(x2, handle)
    assert len(cached) == 6 and cached[1:4] == (None, None, []) and cached[4] is handle
    _check_exact("cached dispatch", cached[0], buf.dispatch(x2, **kw)[0])
    combined, combined_w, event = buf.combine(res[0], handle, topk_weights=res[2])
    assert isinstance(event, EventOverlap) and event.is_complete()
    # Each gate weight lives in exactly one rank's received row (0 elsewhere): its sum is exact.
    _check_exact("combined_topk_weights", combined_w, torch.where(idx >= 0, w, 0.0))
    assert buf.combine(res[0], handle)[1] is None
    bias = torch.randn(combined.shape, generator=torch.Generator().manual_seed(7), dtype=x.dtype)
    with_bias = buf.combine(res[0], handle, bias=(bias, bias))[0]
    _check_exact("combine bias", with_bias, combined + bias + bias)
    # Refused before any communication (the same on every rank).
    bad = [
        (TypeError, "handle", lambda: buf.dispatch(x, idx, w)),
        (
            NotImplementedError,
            "num_worst_tokens",
            lambda: buf.dispatch(x, **kw, num_worst_tokens=8),
        ),
        (
            NotImplementedError,
            "rdma",
            lambda: buf.dispatch(x, **kw, num_tokens_per_rdma_rank=per_rank),
        ),
        (ValueError, "config", lambda: buf.dispatch(x, **kw, config=Config(8))),
        (
            ValueError,
            "allocate_on_comm_stream",
            lambda: buf.dispatch(x, **kw, allocate_on_comm_stream=True),
        ),
        (ValueError, "expert_alignment", lambda: buf.dispatch(x, **kw, expert_alignment=0)),
        (ValueError, "num_experts", lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w)),
        (
            ValueError,
            "disagrees",
            lambda: buf.dispatch(x, **kw | dict(num_tokens_per_expert=per_expert[:-1])),
        ),
        (
            ValueError,
            "is_token_in_rank",
            lambda: buf.dispatch(x, **kw | dict(is_token_in_rank=in_rank[:, :1])),
        ),
        (ValueError, "cached dispatch", lambda: buf.dispatch(x, handle, topk_idx=idx)),
        (TypeError, "previous_event", lambda: buf.combine(res[0], handle, previous_event=1)),
        (ValueError, "bias", lambda: buf.combine(res[0], handle, bias=bias[:1])),
        (ValueError, "topk_weights", lambda: buf.combine(res[0], handle, topk_weights=w[:0])),
    ]
    for exc, word, call in bad:
        with pytest.raises(exc, match=word):
            call()
    assert buf.dispatch(x, **kw, config=buf.config)[3] == res[3]  # its own config is accepted


def _check_capacity(rank, world, num_experts):
    """Too small a (gloo-emulated) nvlink buffer raises on every rank, before moving data."""
    buf = Buffer()
    xs, idxs, ws = _scenario(world, 22, [12] * world, 16, 2, num_experts)
    # fp32 rows of 16 values = 64 bytes; 2 rows per peer fit, 12 tokens do not.
    buf._transport = GlooTransport(rank, world, num_nvl_bytes=2 * world * 64)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        buf.dispatch(xs[rank], topk_idx=idxs[rank], topk_weights=ws[rank], num_experts=num_experts)


def _check_message_counts(rank, world, num_experts):
    """One dispatch = one count exchange + ONE payload message (x, weights, topk_idx and source
    index packed per row); one combine = one message; each backward = one message."""
    calls = []
    real = dist.all_to_all_single

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    xs, idxs, ws = _scenario(world, 23, [7, 5, 9, 4][:world], 16, 3, num_experts)
    for nvl in (False, True):
        buf = Buffer()
        if nvl:
            buf._transport = GlooTransport(rank, world, num_nvl_bytes=1 << 20)
        x = xs[rank].clone().requires_grad_()
        w = ws[rank].clone().requires_grad_()
        dist.all_to_all_single = counting
        try:
            steps = []
            res = buf.dispatch(x, topk_idx=idxs[rank], topk_weights=w, num_experts=num_experts)
            steps.append(len(calls))
            out = buf.combine(res[0] * 2, res[4])[0]
            steps.append(len(calls))
            (out.sum() + res[2].sum()).backward()
            steps.append(len(calls))
        finally:
            dist.all_to_all_single = real
        moved = buf._transport.calls if nvl else 0
        calls.clear()
        # all_to_all: counts + payload, combine, backward of combine (a dispatch of the
        # gradient) + backward of dispatch (x and w gradients in one combine message).
        # nvlink: only the counts on all_to_all_single, the rest through the transport.
        assert steps == ([1, 1, 1] if nvl else [2, 3, 5]), (nvl, steps)
        assert moved == (4 if nvl else 0), moved
        # d(sum combine(2·recv_x))/dx = 2 · (ranks the token went to), summed exactly.
        n_ranks = res[4].is_token_in_rank.sum(1, keepdim=True).to(x.dtype)
        _check_exact(f"dx (nvl={nvl})", x.grad, (2 * n_ranks).expand_as(x))


def _use_triton_kernels() -> bool:
    """Spawned ranks: run ptxtrain.ep.layout's kernels on CPU tensors when they can be
    interpreted (TRITON_INTERPRET=1 is inherited; the exact-cast patch is applied here, since
    conftest does not run in the children)."""
    import ptxtrain.ep.layout as lay

    if not _interpreted():
        return False
    from ptxtrain.testing.triton_interp import apply_interpreter_patch

    try:
        apply_interpreter_patch()
    except RuntimeError:  # another Triton version: keep the torch path
        return False
    lay._TRITON_ON_CPU = True
    return True


def _worker(rank: int, world: int, triton_kernels: bool) -> None:
    if triton_kernels:
        assert _use_triton_kernels(), "the Triton kernels could not be interpreted"
    buf = Buffer()
    assert (buf.rank, buf.num_ranks) == (rank, world)
    _check_validation(buf, rank)
    _check_async(buf, rank, world, 3 * world)
    _check_deepep_api(buf, rank, world, 3 * world)
    _check_capacity(rank, world, 3 * world)
    _run_checks(buf, rank, world)
    # The nvlink backend's Python side (handle indices, byte rows, 16-byte padding, autograd)
    # on the emulated kernel: every check again, same expected results.
    nvl = Buffer()
    nvl._transport = GlooTransport(rank, world, num_nvl_bytes=1 << 20)
    _run_checks(nvl, rank, world)
    # Dispatch rows carry payload + weights + topk_idx + source index (k·4 or k·8 + k·8 + 8 B),
    # padded to 16: fp32 [.,16] top-3/top-4 -> 108/120 -> 112/128 B, fp64 [.,12] top-3 -> 152
    # -> 160, fp8 200 + 8 B scales top-2 -> 240 B, bf16 [.,24] top-3 -> 96; combine rows: bf16
    # [.,24] = 48 B, fp64 [.,12] = 96 B, fp64 grads of x and w packed: 96 + 24 = 120 -> 128 B.
    want = {48, 96, 112, 128, 160, 240}
    assert want <= nvl._transport.row_bytes_seen, nvl._transport.row_bytes_seen
    _check_message_counts(rank, world, 3 * world)
    dist.barrier()


def _run_checks(buf, rank, world):
    e = 3 * world
    # Uneven, skewed loads; rank 1 has no tokens; the last rank receives nothing.
    tokens = [9, 0, 13, 5][:world]
    _check_layout_and_dispatch(buf, rank, world, 1, tokens, 3, e, deaf_rank=world - 1)
    # Rank 0 has tokens but sends nothing; several experts of a token on one rank (top-3 of 3
    # local experts for token 0 of every rank).
    _check_layout_and_dispatch(buf, rank, world, 2, [6] * world, 3, e, mute_rank=0)
    # Top-4 with 3 local experts per rank: a token always has ≥2 experts on some rank.
    _check_layout_and_dispatch(buf, rank, world, 3, [10, 7, 4, 12][:world], 4, e)
    _check_fp8(buf, rank, world, e)
    _check_combine_bf16(buf, rank, world, e)
    _check_moe_end_to_end(buf, rank, world, e)
    dist.barrier()


@pytest.mark.parametrize("triton_kernels", [False, True], ids=["torch", "triton"])
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_combine_gloo(world, triton_kernels):
    """Every check on the torch path and on the Triton path (layout, packing, combine sum of
    ptxtrain.ep.layout, interpreted on the CPU): the same expected results, bit for bit."""
    if triton_kernels and not _INTERPRETED:
        pytest.skip("needs Triton with TRITON_INTERPRET=1 (the kernels run on CPU tensors)")
    run_gloo(_worker, world, triton_kernels, timeout=120.0)


def _absent_peer_worker(rank, world):
    import time

    buf = Buffer(timeout_s=2.0)
    if rank == 1:  # alive, in the group, but never calls dispatch (stuck elsewhere)
        time.sleep(8.0)
        return
    x, idx, w = torch.randn(4, 8), torch.tensor([[0, 3]] * 4), torch.rand(4, 2)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Buffer.dispatch: .* within timeout_s=2 s"):
        buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=4)
    # Bounded by timeout_s, not by the process group's (gloo's default: 30 min).
    assert time.monotonic() - start < 7.0


def test_dispatch_names_a_peer_that_never_arrives():
    """A rank that never reaches the exchange: the others raise after timeout_s, naming the call."""
    run_gloo(_absent_peer_worker, 2, timeout=60.0)


def test_get_dispatch_layout_single_process():
    g = torch.Generator().manual_seed(0)
    idx = _routing(g, 50, 4, 16, list(range(16)), p_none=0.2)
    n_rank, n_exp, in_rank = get_dispatch_layout(idx, 16, 4)
    want_in = torch.zeros(50, 4, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for e in row:
            if e >= 0:
                want_in[t, e // 4] = True
    _check_exact("is_token_in_rank", in_rank, want_in)
    _check_exact("num_tokens_per_rank", n_rank, want_in.sum(0))
    _check_exact("num_tokens_per_expert", n_exp, torch.bincount(idx[idx >= 0], minlength=16))
    assert int(n_rank.sum()) <= int(n_exp.sum())  # sent once per rank, not once per expert
    with pytest.raises(ValueError, match="num_experts"):
        get_dispatch_layout(idx, 15, 4)
    with pytest.raises(ValueError, match="topk_idx"):
        get_dispatch_layout(idx - 2, 16, 4)


def test_buffer_argument_validation_single_process():
    # Checked before the process group: no init needed.
    bad = [
        (ValueError, "backend", dict(backend="nccl")),
        (ValueError, "num_nvl_bytes", dict(num_nvl_bytes=-1)),
        (TypeError, "num_nvl_bytes", dict(num_nvl_bytes="1G")),
        (ValueError, "timeout_s", dict(timeout_s=0.0)),
        (TypeError, "timeout_s", dict(timeout_s=True)),
        (NotImplementedError, "num_rdma_bytes", dict(num_rdma_bytes=1 << 20)),
        (TypeError, "num_rdma_bytes", dict(num_rdma_bytes=None)),
        (NotImplementedError, "low_latency_mode", dict(low_latency_mode=True)),
        (ValueError, "num_qps_per_rank", dict(num_qps_per_rank=0)),
        (TypeError, "config", dict(config=dict(num_sms=24))),
    ]
    for exc, word, kw in bad:
        with pytest.raises(exc, match=word):
            Buffer(**kw)
    with pytest.raises(TypeError, match="positional"):  # ptxtrain's extras are keyword-only
        Buffer(None, 1 << 20, 0, False, 24, "nvlink")
    if not dist.is_initialized():
        with pytest.raises(ValueError, match="init_process_group"):
            Buffer()
    # Rows padded to 16 bytes: 7392-byte FP8 rows stay, 8-byte weight rows take 16.
    assert Buffer.nvl_bytes_hint(4096, 7168 + 224, 8) == 4096 * 7392 * 8
    assert Buffer.nvl_bytes_hint(10, 8, 2) == 10 * 16 * 2
    with pytest.raises(ValueError, match="num_max_tokens"):
        Buffer.nvl_bytes_hint(0, 16, 2)
    assert EventOverlap().is_complete()  # CPU: nothing to wait for


def test_config_validates_and_names_each_knob():
    bad = [
        (ValueError, "num_sms", dict(num_sms=0)),
        (TypeError, "num_sms", dict(num_sms=2.0)),
        (ValueError, "nvl_threads", dict(nvl_threads=100)),
        (TypeError, "nvl_threads", dict(nvl_threads=None)),
        (ValueError, "nvl_unroll", dict(nvl_unroll=3)),
        (TypeError, "nvl_pipeline", dict(nvl_pipeline=1)),
        (ValueError, "nvl_send_sms", dict(num_sms=8, nvl_send_sms=8)),
        (ValueError, "nvl_round_rows", dict(nvl_round_rows=65)),
    ]
    for exc, word, kw in bad:
        with pytest.raises(exc, match=word):
            Config(**kw)
    with pytest.raises(TypeError):  # DeepEP's chunk sizes have no counterpart: not positional
        Config(24, 6, 256)
    assert Config(16, nvl_send_sms=4) == Config(16, nvl_send_sms=4) != Config(16)


def test_default_configs_follow_set_num_sms():
    before = Buffer.num_sms
    try:
        assert Buffer.get_dispatch_config(2) == Buffer.get_combine_config(8) == Config(before)
        Buffer.set_num_sms(20)
        assert Buffer.get_dispatch_config(4).num_sms == 20
        with pytest.raises(ValueError, match="new_num_sms"):
            Buffer.set_num_sms(0)
        with pytest.raises(ValueError, match="num_ranks"):
            Buffer.get_dispatch_config(0)
    finally:
        Buffer.set_num_sms(before)


def test_signatures_follow_deepep():
    """Positional order and names of DeepEP's Buffer (the arguments a port passes positionally)."""
    import inspect

    def names(fn):
        return list(inspect.signature(fn).parameters)

    assert names(Buffer)[:5] == [
        "group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank"
    ]  # fmt: skip
    assert names(Buffer.dispatch)[1:15] == [
        "x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
        "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment",
        "num_worst_tokens", "config", "previous_event", "async_finish",
        "allocate_on_comm_stream",
    ]  # fmt: skip
    assert names(Buffer.combine)[1:] == [
        "x", "handle", "topk_weights", "bias", "config", "previous_event", "async_finish",
        "allocate_on_comm_stream",
    ]  # fmt: skip
    assert names(Buffer.get_dispatch_layout)[1:] == [
        "topk_idx", "num_experts", "previous_event", "async_finish", "allocate_on_comm_stream"
    ]  # fmt: skip


def test_signature_description_does_not_misread_other_widths():
    """A peer with another num_experts sends count rows of another width (5 + E / ranks), so the
    two columns read as its signature are arbitrary: they are described as such, not decoded
    into numbers that look like a real hidden size or k."""
    from ptxtrain.ep.buffer import _describe_signature, _encode_signature

    real = _encode_signature((7168, 256, 8, 1, torch.float32))
    assert _describe_signature(real).startswith("hidden=7168, num_experts=256, k=8, ")
    for garbage in [(94875727015280, 35619916218368 * 4096 * 16), (0, real[1]), (7168, 0),
                    (-5, real[1]), (7168, (256 * 4096) * 16)]:  # fmt: skip
        assert _describe_signature(garbage) == (
            "a count message of another width (another num_experts)"
        ), garbage
