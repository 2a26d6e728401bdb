"""DualPipeV on CPU gloo groups against the unpartitioned 2R-stage model run in one process.

Same oracle as test_schedules.py (docs/design.md §5): float64 toy stages, loss and outputs bitwise
equal (same ops on the same micro-batches; P2P and the local turn move raw values), gradients within
1e-13 (sums over micro-batches in the schedule's order). Rank r holds stages r and 2R-1-r, and each
stage has one copy, so its gradient must equal the reference's directly.
"""

from __future__ import annotations

import pytest

from ptxtrain.parallel import DualPipeV, Timeline
from tests._spawn import run_gloo
from tests.parallel.test_schedules import (
    assert_grads,
    assert_step_result,
    criterion,
    make_batch,
    make_stage,
    reference,
)


def check_dualpipev(rank: int, world: int, n_chunks: int, return_outputs: bool) -> None:
    stages = 2 * world
    m0, m1 = make_stage(rank), make_stage(stages - 1 - rank)
    x, y = make_batch(100 + n_chunks, n_chunks)
    first = rank == 0
    tl = Timeline()
    loss, out = DualPipeV((m0, m1)).step(
        *((x,) if first else ()),
        num_chunks=n_chunks,
        criterion=criterion if first else None,
        labels=(y,) if first else (),
        return_outputs=return_outputs,
        timeline=tl,
    )
    ref_loss, ref_out, ref_grads = reference(stages, x, y, n_chunks)
    what = f"DualPipeV R={world} rank={rank} num_chunks={n_chunks}"
    assert_step_result(loss, out, (ref_loss, ref_out) if first else None, return_outputs, what)
    assert_grads(m0, ref_grads[rank], what + f" stage {rank}")
    assert_grads(m1, ref_grads[stages - 1 - rank], what + f" stage {stages - 1 - rank}")
    # The timeline saw each micro-batch once per leg: one F and one backward (B or BW) each, and
    # one W per B; the turn at rank R-1 is local, so it has no send/recv of the turn.
    (rec,) = tl.steps
    for d in (0, 1):
        cells = [c for c in rec["cells"] if c["dir"] == d]
        fwd = sorted(c["chunk"] for c in cells if c["kind"] == "F")
        bwd = sorted(c["chunk"] for c in cells if c["kind"] in ("B", "BW"))
        w = sorted(c["chunk"] for c in cells if c["kind"] == "W")
        b_only = sorted(c["chunk"] for c in cells if c["kind"] == "B")
        assert fwd == bwd == list(range(n_chunks)), f"{what} dir {d}: {fwd} / {bwd}"
        assert w == b_only, f"{what} dir {d}: W chunks {w} != B-only chunks {b_only}"
    recvs = [c for c in rec["cells"] if c["kind"] == "recv"]
    # Messages received: down leg from rank r-1 (F) and r+1 (grads), up leg likewise, except at
    # the ends of each leg; each is N messages.
    links = (rank > 0) + (rank < world - 1)
    assert len(recvs) == 2 * links * n_chunks, f"{what}: {len(recvs)} recv cells"


def check_invalid(rank: int, world: int) -> None:
    """Bad arguments raise on every rank before any P2P (no rank left waiting)."""
    stages = 2 * world
    x, y = make_batch(0, 2 * stages)
    pipe = DualPipeV((make_stage(rank), make_stage(stages - 1 - rank)))
    kw = {"criterion": criterion, "labels": (y,)} if rank == 0 else {}
    mine = (x,) if rank == 0 else ()
    with pytest.raises(ValueError, match="exactly two modules"):
        DualPipeV((make_stage(rank),))
    with pytest.raises(TypeError, match=r"modules\[1\] must be an nn\.Module"):
        DualPipeV((make_stage(rank), "stage"))
    with pytest.raises(TypeError, match="num_chunks must be an int"):
        pipe.step(*mine, num_chunks=4.0, **kw)
    with pytest.raises(ValueError, match=rf"num_chunks must be >= 2\*R = {2 * world}"):
        pipe.step(*mine, num_chunks=2 * world - 1, **kw)
    with pytest.raises(ValueError, match="inputs are missing on rank 0"):
        pipe.step(num_chunks=2 * world, **kw)
    if world > 1:
        with pytest.raises(ValueError, match="were given on rank 1"):  # inputs on every rank
            pipe.step(x, num_chunks=2 * world, **kw)
    with pytest.raises(ValueError, match="criterion is missing on rank 0"):
        pipe.step(*mine, num_chunks=2 * world, labels=(y,) if rank == 0 else ())
    with pytest.raises(ValueError, match="divisible"):  # 4*world*ROWS rows into 2*world+1
        pipe.step(*mine, num_chunks=2 * world + 1, **kw)
    with pytest.raises(ValueError, match="timeline must be"):  # on the last rank only
        pipe.step(*mine, num_chunks=2 * world, timeline=[] if rank == world - 1 else None, **kw)
    for p in pipe.parameters():
        assert p.grad is None, "a rejected step must not have run any backward"


def worker(rank: int, world: int, cases) -> None:
    check_invalid(rank, world)
    for n_chunks, ret in cases:
        check_dualpipev(rank, world, n_chunks, ret)


@pytest.mark.parametrize(
    ("world", "cases"),
    [
        (1, ((2, True), (5, False))),  # one rank: the whole V is local
        (2, ((4, True), (5, False), (8, True))),
        (4, ((8, False), (11, True))),
    ],
)
def test_dualpipev_matches_single_process(world, cases):
    run_gloo(worker, world, cases, timeout=90)
