"""Pipeline traffic as NCCL sees it: every send matched by a receive of the same size, in order.

gloo honours the ``tag`` of ``isend`` / ``recv``; NCCL ignores it and pairs the messages of one
(src, dst) pair purely in issue order. A schedule that passes on gloo can therefore hand one
message's bytes to a receive posted for another one on NCCL (wrong values, or out-of-bounds
reads and writes when the sizes differ). These tests record, on CPU gloo, every backend
``isend`` / ``recv`` of the pipeline P2P layer and of the runner's collectives per rank, share the
logs, and check what NCCL needs:

- per ordered pair (src, dst): the sizes, dtypes and bytes src sends, in order, equal those dst
  receives, in order, tags ignored (what NCCL would deliver is what gloo delivered);
- every rank issues the same collectives, in the same order, with the same shapes and dtypes;
- no pair's connections are set up from crossed first ops (both ranks sending to each other
  first), which crashed DualPipe on NCCL before the schedules connected their peers eagerly
  (``P2P.connect``); a DualPipe step without it is checked to be caught.

Before messages carried their own tag (``ptxtrain.parallel.p2p``), DualPipeV on 4 ranks failed
the first check (a ``tag 0`` activation sent ahead of a ``tag 3`` gradient on the same pair,
received in the other order), as did the direct two-tag exchange below.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ptxtrain.parallel import DualPipe, DualPipeV, OneFOneB
from ptxtrain.parallel.p2p import P2P
from tests._spawn import run_gloo
from tests.parallel.test_schedules import criterion, make_batch, make_stage

_P2P_OPS = ("isend", "irecv", "send", "recv")
_COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor")


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _record(log: list) -> None:
    """Wrap the torch.distributed entry points the pipeline code calls; append one entry per call:
    ``(op, global peer or None, shape, dtype, bytes digest or None, group name or None)``.
    Sends are digested when posted, blocking receives once filled: equal digests in order mean
    NCCL, which pairs the messages of a pair in order, would deliver the very bytes gloo
    delivered by tag. Runs in a spawned rank, so nothing leaks."""
    for name in _P2P_OPS + _COLLECTIVES:
        orig = getattr(dist, name)

        def wrapped(tensor, *args, _name=name, _orig=orig, **kwargs):
            peer = args[0] if _name in _P2P_OPS and args else None
            if _name in _P2P_OPS and peer is None:
                peer = kwargs.get("dst", kwargs.get("src"))
            t = tensor[0] if isinstance(tensor, list) else tensor
            out = _orig(tensor, *args, **kwargs)
            digest = _digest(t) if _name in ("isend", "send", "recv") else None
            pg = kwargs.get("group")
            group = None if pg is None else getattr(pg, "group_name", str(id(pg)))
            log.append((_name, peer, tuple(t.shape), str(t.dtype), digest, group))
            return out

        setattr(dist, name, wrapped)


def _check_traffic(log: list, rank: int, world: int, what: str) -> None:
    """Gather every rank's log and check the two properties of the module docstring."""
    logs: list = [None] * world
    dist.all_gather_object(logs, log)
    for src in range(world):
        for dst in range(world):
            sent = [e[2:5] for e in logs[src] if e[0] in ("isend", "send") and e[1] == dst]
            got = [e[2:5] for e in logs[dst] if e[0] in ("irecv", "recv") and e[1] == src]
            assert len(sent) == len(got), (
                f"{what}: rank {src} -> {dst}: {len(sent)} sends, {len(got)} receives"
            )
            for i, (s_, g_) in enumerate(zip(sent, got, strict=True)):
                assert s_ == g_, (
                    f"{what}: rank {src} -> {dst}, message part {i}: sent {s_[:2]} {s_[2][:8]}, "
                    f"received {g_[:2]} {g_[2][:8]} (NCCL pairs them in this order, ignoring tags)"
                )
    colls = [[e for e in lg if e[0] in _COLLECTIVES] for lg in logs]
    for r in range(1, world):
        assert colls[r] == colls[0], f"{what}: collectives of rank {r} {colls[r]} != {colls[0]}"


def _crossed_first_ops(log: list, world: int) -> list[str]:
    """The pairs whose connections NCCL would set up from crossed first ops (gathered logs).

    NCCL (runtime connect) sets a rank's connection toward a peer up at its first send to and
    at its first receive from that peer, and pairs these set-up events of the two ranks in
    order; the k-th events of the two sides must be of opposite kinds (a send meeting a
    receive). Both ranks sending first to each other is what crashed DualPipe on 2 x H200
    (``ptxtrain.parallel.p2p``). Returns one message per bad pair (empty: all fine).
    """
    logs: list = [None] * world
    dist.all_gather_object(logs, log)
    events: list[dict[int, list[str]]] = []
    for lg in logs:
        ev: dict[int, list[str]] = {}
        for op, peer, *_ in lg:
            if op in _P2P_OPS:
                kind = "send" if op in ("isend", "send") else "recv"
                if kind not in ev.setdefault(peer, []):
                    ev[peer].append(kind)
        events.append(ev)
    bad = []
    for a in range(world):
        for b in range(a + 1, world):
            ea, eb = events[a].get(b, []), events[b].get(a, [])
            if any(x == y for x, y in zip(ea, eb, strict=False)) or len(ea) != len(eb):
                bad.append(f"ranks {a}, {b}: set-up ops {ea} vs {eb}")
    return bad


def _shared_groups(log: list) -> list[str]:
    """The process groups this rank used for P2P in both directions or with several peers.

    NCCL runs one communicator's ops in issue order, so a large send and a later receive on the
    same communicator can block each other when the peer does the same (crossed sends: the hang
    of PP = 4 DualPipe on 4 x H200). The schedules send each direction of a pair on its own
    2-rank group; this lists violations (empty: every group carries one direction)."""
    use: dict[str, set] = {}
    for op, peer, *_rest, group in log:
        if op in _P2P_OPS:
            kind = "send" if op in ("isend", "send") else "recv"
            use.setdefault(str(group), set()).add((kind, peer))
    return [f"group {g}: {sorted(u)}" for g, u in use.items() if len(u) > 1]


def _two_tags(rank: int, world: int) -> None:
    torch.manual_seed(7)
    a = torch.randn(3, 4)  # same seed on both ranks, so rank 1 knows what to expect
    b = torch.randint(-50, 50, (5,))
    log: list = []
    _record(log)
    p2p = P2P(None, torch.device("cpu"))
    if rank == 0:  # tag 0 first, then tag 3 ...
        p2p.send([a], 1, tag=0)
        p2p.send([b, a.double()], 1, tag=3)
    else:  # ... asked for in the other order
        (got_b, got_a64) = p2p.recv(0, tag=3)
        (got_a,) = p2p.recv(0, tag=0)
        assert torch.equal(got_b, b) and torch.equal(got_a64, a.double())
        assert torch.equal(got_a, a)
    p2p.wait_all()
    _check_traffic(log, rank, world, "two tags out of order")


def test_p2p_receives_by_tag_in_wire_order():
    run_gloo(_two_tags, 2)


def _schedules(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    last = world - 1
    n_chunks = 2 * world
    x, y = make_batch(5, n_chunks)
    log: list = []
    _record(log)

    OneFOneB(make_stage(rank)).step(
        *((x,) if rank == 0 else ()),
        num_chunks=n_chunks,
        criterion=criterion if rank == last else None,
        labels=(y,) if rank == last else (),
    )
    _check_traffic(log, rank, world, "1F1B")
    assert not _crossed_first_ops(log, world), _crossed_first_ops(log, world)
    assert not _shared_groups(log), _shared_groups(log)
    log.clear()

    dp = DualPipe((make_stage(rank), make_stage(last - rank)))
    half = x.shape[0] // 2
    ends = {0: ((x[:half],), (y[half:],)), last: ((x[half:],), (y[:half],))}
    inputs, labels = ends.get(rank, ((), ()))
    dp.step(*inputs, num_chunks=n_chunks, criterion=criterion if labels else None, labels=labels)
    dp.reduce_mirrored_grads()
    _check_traffic(log, rank, world, "DualPipe")
    assert not _crossed_first_ops(log, world), _crossed_first_ops(log, world)
    assert not _shared_groups(log), _shared_groups(log)
    log.clear()

    # The same step without the eager connect crosses its first sends: what crashed on NCCL.
    unconnected = DualPipe((make_stage(rank), make_stage(last - rank)))
    unconnected._connected.update(range(world))  # as if connected: P2P.connect is skipped
    unconnected.step(
        *inputs, num_chunks=n_chunks, criterion=criterion if labels else None, labels=labels
    )
    assert _crossed_first_ops(log, world), "the check must see DualPipe's crossed first sends"
    log.clear()

    DualPipeV((make_stage(rank), make_stage(2 * world - 1 - rank))).step(
        *((x,) if rank == 0 else ()),
        num_chunks=n_chunks,
        criterion=criterion if rank == 0 else None,
        labels=(y,) if rank == 0 else (),
    )
    _check_traffic(log, rank, world, "DualPipeV")
    assert not _crossed_first_ops(log, world), _crossed_first_ops(log, world)
    assert not _shared_groups(log), _shared_groups(log)
    log.clear()

    # A bare P2P over the pipeline group (no per-direction groups) shares one group for both
    # directions: the check must see it.
    bare = P2P(None, torch.device("cpu"))
    peer = rank ^ 1
    bare.send([x[:1]], peer, tag=0)
    bare.recv(peer, tag=0)
    bare.wait_all()
    assert _shared_groups(log), "the check must see a group used in both directions"


def test_schedule_traffic_pairs_up_without_tags():
    # 4 ranks: the smallest pipeline where DualPipeV's pairs carry both legs out of tag order.
    run_gloo(_schedules, 4, timeout=120)
