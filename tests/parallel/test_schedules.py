"""1F1B and DualPipe on CPU gloo groups against the unpartitioned model run in one process.

Oracle (docs/design.md §5, after DualPipe's example): float64 toy stages; losses and outputs must be
bitwise equal (each micro-batch goes through the very same ops on the same shapes, and P2P moves
raw bytes), gradients within 1e-13 (they are sums over micro-batches, accumulated in the schedule's
order rather than autograd's, so the last bits may differ). Several checks run in each spawned
group to keep the file fast; a hang fails through the spawn helper's timeout.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ptxtrain.parallel import DualPipe, DualPipeV, OneFOneB
from tests._spawn import run_gloo

DIM = 16
ROWS = 2  # rows per micro-batch
GRAD_TOL = 1e-13  # float64 sums of a few micro-batch grads in another order: ~1e-16 relative


class Block(nn.Module):
    """Toy stage: two Linear+GELU layers; returns a tuple to exercise multi-tensor P2P."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM, dtype=torch.float64)
        self.fc2 = nn.Linear(DIM, DIM, dtype=torch.float64)

    def forward(self, x, skip=None):
        h = F.gelu(self.fc1(x))
        h = F.gelu(self.fc2(h)) + (x if skip is None else skip)
        return h, 0.5 * x


def make_stage(s: int) -> Block:
    torch.manual_seed(1000 + s)
    return Block()


def criterion(h, half, y):
    return F.mse_loss(h + half, y)


def make_batch(seed: int, n_chunks: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_chunks * ROWS, DIM, dtype=torch.float64, generator=g)
    y = torch.randn(n_chunks * ROWS, DIM, dtype=torch.float64, generator=g)
    return x, y


def reference(pp: int, x, y, n_chunks: int):
    """Unpartitioned model, one process: (sum of micro-batch losses, outputs, grads per stage)."""
    stages = [make_stage(s) for s in range(pp)]
    losses, outs = [], []
    for xc, yc in zip(x.chunk(n_chunks), y.chunk(n_chunks), strict=True):
        act = (xc,)
        for st in stages:
            act = st(*act)
        losses.append(criterion(*act, yc))
        outs.append([a.detach() for a in act])
    loss = torch.stack(losses).sum()
    loss.backward()
    out = tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
    return loss.detach(), out, [[p.grad for p in st.parameters()] for st in stages]


def assert_grads(module: nn.Module, want: list[torch.Tensor], what: str) -> None:
    for (name, p), g in zip(module.named_parameters(), want, strict=True):
        diff = (p.grad - g).abs().max().item()
        assert diff <= GRAD_TOL, f"{what}: grad of {name} differs by {diff:.2e}"


def assert_outputs(got, want, what: str) -> None:
    assert len(got) == len(want), what
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), f"{what}: outputs differ by {(a - b).abs().max().item():.2e}"


def assert_step_result(loss, out, want, return_outputs: bool, what: str) -> None:
    """``step``'s ``(loss, outputs)`` on a rank: ``want`` = (reference loss, reference outputs)
    where the rank computes the loss (bitwise equal), None elsewhere (both must be None)."""
    if want is None:
        assert loss is None and out is None, what
        return
    assert torch.equal(loss, want[0]), f"{what}: loss {loss.item()} != {want[0].item()}"
    if return_outputs:
        assert_outputs(out, want[1], what)
    else:
        assert out is None, what


def check_1f1b(rank: int, world: int, n_chunks: int, return_outputs: bool) -> None:
    first, last = rank == 0, rank == world - 1
    stage = make_stage(rank)
    x, y = make_batch(n_chunks, n_chunks)
    loss, out = OneFOneB(stage).step(
        *((x,) if first else ()),
        num_chunks=n_chunks,
        criterion=criterion if last else None,
        labels=(y,) if last else (),
        return_outputs=return_outputs,
    )
    ref_loss, ref_out, ref_grads = reference(world, x, y, n_chunks)
    what = f"1F1B PP={world} rank={rank} num_chunks={n_chunks}"
    assert_step_result(loss, out, (ref_loss, ref_out) if last else None, return_outputs, what)
    assert_grads(stage, ref_grads[rank], what)


def check_dualpipe(rank: int, world: int, n_chunks: int, return_outputs: bool) -> None:
    last = world - 1
    m0, m1 = make_stage(rank), make_stage(last - rank)
    pipe = DualPipe((m0, m1))
    n = n_chunks // 2
    x0, y0 = make_batch(10 * n_chunks, n)  # direction 0: enters at rank 0, loss on rank PP-1
    x1, y1 = make_batch(10 * n_chunks + 1, n)  # direction 1: enters at rank PP-1, loss on rank 0
    inputs = {0: (x0,), last: (x1,)}.get(rank, ())
    labels = {0: (y1,), last: (y0,)}.get(rank, ())
    loss, out = pipe.step(
        *inputs,
        num_chunks=n_chunks,
        criterion=criterion if labels else None,
        labels=labels,
        return_outputs=return_outputs,
    )
    ref0, ref1 = reference(world, x0, y0, n), reference(world, x1, y1, n)
    what = f"DualPipe PP={world} rank={rank} num_chunks={n_chunks}"
    assert_step_result(loss, out, {0: ref1, last: ref0}.get(rank), return_outputs, what)
    # Each copy of a stage sees one direction only ...
    assert_grads(m0, ref0[2][rank], what + " modules[0] (direction 0)")
    assert_grads(m1, ref1[2][last - rank], what + " modules[1] (direction 1)")
    # ... and after the mirror reduction both copies hold the whole model's gradient.
    pipe.reduce_mirrored_grads()
    for m, s in ((m0, rank), (m1, last - rank)):
        want = [a + b for a, b in zip(ref0[2][s], ref1[2][s], strict=True)]
        assert_grads(m, want, what + f" stage {s} after reduce_mirrored_grads")


def check_invalid(rank: int, world: int) -> None:
    """Bad arguments raise ValueError on every rank, before any P2P (no rank left waiting)."""
    last = world - 1
    x, y = make_batch(0, 2 * world)
    stage = make_stage(rank)
    pipe = OneFOneB(stage)
    end_kw = {"criterion": criterion, "labels": (y,)} if rank == last else {}
    with pytest.raises(ValueError, match="num_chunks must be >= 1"):
        pipe.step(x, num_chunks=0)
    with pytest.raises(ValueError, match="inputs"):  # inputs on every rank, not only rank 0
        pipe.step(x, num_chunks=2, **end_kw)
    with pytest.raises(  # no criterion on the last rank
        ValueError, match=f"criterion is missing on rank {last}, where the loss is computed"
    ):
        pipe.step(*((x,) if rank == 0 else ()), num_chunks=2)
    with pytest.raises(ValueError, match="divisible"):  # 2*world*ROWS rows into 3 chunks
        pipe.step(*((x,) if rank == 0 else ()), num_chunks=3, **end_kw)

    with pytest.raises(ValueError, match="exactly two modules"):
        DualPipe((stage,))
    dp = DualPipe((stage, make_stage(last - rank)))
    ends = {0: (x,), last: (x,)}
    dp_kw = {"criterion": criterion, "labels": (y,)} if rank in ends else {}
    with pytest.raises(ValueError, match="even and >= 2"):  # odd
        dp.step(*ends.get(rank, ()), num_chunks=2 * world + 1, **dp_kw)
    with pytest.raises(ValueError, match="even and >= 2"):  # too few
        dp.step(*ends.get(rank, ()), num_chunks=2 * world - 2, **dp_kw)
    with pytest.raises(ValueError, match="inputs"):  # inputs on rank 0 only
        dp.step(*((x,) if rank == 0 else ()), num_chunks=2 * world, **dp_kw)
    if world > 2:  # at PP=2 every rank is an end
        with pytest.raises(ValueError, match="inputs"):  # inputs on every rank
            dp.step(x, num_chunks=2 * world, **dp_kw)
    for p in list(stage.parameters()) + list(dp.parameters()):
        assert p.grad is None, "a rejected step must not have run any backward"


def worker_pp(rank: int, world: int) -> None:
    check_invalid(rank, world)
    for n_chunks, ret in ((max(world - 1, 1), True), (2 * world + 1, False)):
        check_1f1b(rank, world, n_chunks, ret)
    for n_chunks, ret in ((2 * world, False), (2 * world + 4, True)):
        check_dualpipe(rank, world, n_chunks, ret)


def worker_pp1(rank: int, world: int) -> None:
    check_1f1b(rank, world, 3, True)  # PP=1: forward then backward per micro-batch
    with pytest.raises(ValueError, match="even number of pipeline ranks"):
        DualPipe((make_stage(0), make_stage(0))).step(
            torch.ones(2, DIM), num_chunks=4, criterion=criterion
        )


@pytest.mark.parametrize("world", [2, 4])
def test_schedules_match_single_process(world):
    run_gloo(worker_pp, world, timeout=90)


def test_pp1_and_odd_pp():
    run_gloo(worker_pp1, 1, timeout=60)


def test_p2p_pairs():
    from ptxtrain.parallel.stages import p2p_pairs

    # Neighbours; DualPipe adds the mirror pairs (r, PP-1-r) of its gradient reduction.
    assert p2p_pairs("1f1b", [0, 1, 2, 3]) == [(0, 1), (1, 2), (2, 3)]
    assert p2p_pairs("dualpipev", [0, 1, 2, 3]) == [(0, 1), (1, 2), (2, 3)]
    assert p2p_pairs("dualpipe", [0, 1, 2, 3]) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert p2p_pairs("dualpipe", [0, 1]) == [(0, 1)]
    # A pipeline of a PP x EP layout (ep = 2, ep_rank 1): group ranks map to global ranks.
    assert p2p_pairs("dualpipe", [1, 3, 5, 7]) == [(1, 3), (1, 7), (3, 5), (5, 7)]
    assert p2p_pairs("1f1b", [4]) == []


@pytest.mark.parametrize("cls", [DualPipe, DualPipeV])
def test_constructor_follows_upstream_dualpipe(cls):
    """deepseek-ai/DualPipe's order: (modules, batch_dim, process_group, rank_mapping), then
    ptxtrain's keyword-only extras; step's keywords as upstream's."""
    import inspect

    params = inspect.signature(cls).parameters
    assert list(params)[:4] == ["modules", "batch_dim", "process_group", "rank_mapping"]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in ("overlap", "p2p_groups"))
    step = inspect.signature(cls.step).parameters
    assert [step[n].default for n in ("num_chunks", "criterion", "return_outputs")] == [
        0, None, False
    ]  # fmt: skip
    stages = (nn.Linear(4, 4), nn.Linear(4, 4))
    cls(stages, 0, None, [0, 1])  # the identity mapping is what ptxtrain does
    bad = [
        (ValueError, "batch_dim", dict(batch_dim=1)),
        (TypeError, "batch_dim", dict(batch_dim=None)),
        (NotImplementedError, "rank_mapping", dict(rank_mapping=[1, 0])),
        (ValueError, "permutation", dict(rank_mapping=[0, 2])),
        (TypeError, "rank_mapping", dict(rank_mapping="01")),
    ]
    for exc, word, kw in bad:
        with pytest.raises(exc, match=word):
            cls(stages, **kw)
    with pytest.raises(TypeError, match="positional"):  # overlap is keyword-only
        cls(stages, 0, None, None, False)
