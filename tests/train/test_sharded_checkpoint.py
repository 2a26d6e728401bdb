"""Sharded checkpoints on two gloo ranks (CPU): resharding between ``--ep 2`` and one process,
asynchronous saves, and a rank SIGKILLed in the middle of a save.

Oracles: the parameters and optimizer state (FP32 masters, BF16 moments, steps) that one layout
reads must equal, bit for bit, what the other layout held when it saved: the two expert-parallel
ranks' experts side by side are the single process's stacked experts, and every replicated
entry is the same. An asynchronous save holds the state of its step even when the next step
runs while it writes. A save killed on any rank leaves the previous checkpoint, complete.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.train import TrainArgs, model_config, read_checkpoint_meta
from ptxtrain.train import checkpoint as ck
from ptxtrain.train.state_layout import StateLayout
from ptxtrain.train.strategy import ParallelStrategy
from tests._checkpoints import assert_same_checkpoint
from tests._spawn import run_gloo
from tests.train.test_checkpoint import N_EXPERTS, _fresh, _trained, kill_at

EXPERT = re.compile(r"(^|\.)experts\.w[123]$")  # stacked routed-expert weights [E_local, ...]
CONFIG = {"test": "sharded"}


def _build(out, ep: int):
    """A strategy, model and optimizer of the tiny preset (bf16: FP32 masters, BF16 moments)."""
    args = TrainArgs(preset="tiny", batch_size=4, seq_len=16, device="cpu", out=str(out), ep=ep)
    args.validate()
    config = model_config(args, None)
    strategy = ParallelStrategy(args, config, torch.bfloat16)
    model, optimizer = strategy.build(config)
    return strategy, model, optimizer


def _train_steps(strategy, seed: int, n: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x = torch.randint(0, 256, (4, 16), generator=g)
        strategy.step(x, torch.roll(x, -1, dims=1), 1e-2)


def _snapshot(model, optimizer) -> dict:
    """Copies of the model and optimizer state, the optimizer's keyed by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for g in optimizer.param_groups for p in g["params"]]
    sd = optimizer.state_dict()
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optim": {order[i]: {k: v.clone() for k, v in e.items()} for i, e in sd["state"].items()},
        "groups": sd["param_groups"],
    }


def _ep_worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    strategy, model, optimizer = _build(f"{root}/run{rank}", ep=world)
    _train_steps(strategy, seed=1, n=1)
    strategy.save(f"{root}/ep2", 1, config=CONFIG, extra={})
    torch.save(_snapshot(model, optimizer), f"{root}/ep2-rank{rank}.pt")
    # Asynchronous: the next step runs while the write may still go on.
    saver = ck.Checkpointer(strategy.checkpointer.layout, group=ck.checkpoint_group(),
                            async_save=True)  # fmt: skip
    saver.save(f"{root}/ep2-async", step=1, config=CONFIG)
    _train_steps(strategy, seed=2, n=1)
    saver.wait()
    # A single-process checkpoint (the test process wrote it) read by each rank.
    strategy.checkpointer.load(f"{root}/single")
    torch.save(_snapshot(model, optimizer), f"{root}/from-single-rank{rank}.pt")


def _assert_full_is_parts(full: dict, parts: list[dict]) -> None:
    """``full`` (one process) holds exactly ``parts``' (EP ranks in order) state: experts
    concatenated along dim 0, every other entry equal on every part."""

    def check(name: str, got: torch.Tensor, part_values: list[torch.Tensor], expert: bool):
        if expert:
            assert_bitwise_equal(got, torch.cat(part_values), name=name)
        else:
            for v in part_values:
                assert_bitwise_equal(got, v, name=name)

    for k, v in full["model"].items():
        check(k, v, [p["model"][k] for p in parts], bool(EXPERT.search(k)))
    assert full["optim"].keys() == parts[0]["optim"].keys()
    for name, entry in full["optim"].items():
        assert entry.keys() == parts[0]["optim"][name].keys(), name
        for k, v in entry.items():
            stacked = bool(EXPERT.search(name)) and k != "step"
            check(f"{name}.{k}", v, [p["optim"][name][k] for p in parts], stacked)
    assert all(full["groups"] == p["groups"] for p in parts)


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded")
    strategy, model, optimizer = _build(root / "single-run", ep=1)
    _train_steps(strategy, seed=3, n=1)
    strategy.save(root / "single", 1, config=CONFIG, extra={})
    single = _snapshot(model, optimizer)
    run_gloo(_ep_worker, 2, str(root), timeout=120)
    return root, single


def test_ep2_checkpoint_read_by_one_process_is_the_ranks_state(ep_runs):
    root, _ = ep_runs
    strategy, model, optimizer = _build(root / "reader", ep=1)
    meta = strategy.checkpointer.load(root / "ep2", expected_config=CONFIG)
    assert meta["ranks"] == 2 and meta["step"] == 1
    parts = [torch.load(root / f"ep2-rank{r}.pt") for r in range(2)]
    _assert_full_is_parts(_snapshot(model, optimizer), parts)
    # Replicated entries were written once (DCP deduplicates them over the ranks): the data
    # files hold exactly the indexed entries, and both ranks wrote some.
    folder = root / "ep2" / "checkpoint"
    storage = FileSystemReader(folder).read_metadata().storage_data
    files = {i.relative_path for i in storage.values()}
    assert {f[:4] for f in files} == {"__0_", "__1_"}
    assert sum(i.length for i in storage.values()) == sum(
        p.stat().st_size for p in folder.glob("*.distcp")
    )


def test_one_process_checkpoint_read_by_ep2_ranks_is_their_slice(ep_runs):
    root, single = ep_runs
    parts = [torch.load(root / f"from-single-rank{r}.pt") for r in range(2)]
    _assert_full_is_parts(single, parts)


def test_async_save_holds_its_step(ep_runs):
    root, _ = ep_runs
    assert_same_checkpoint(root / "ep2", root / "ep2-async")


# ---------------------------------------------------------------------------- SIGKILL
def _kill_worker(rank: int, world: int, root: str, victim: int, point: str) -> None:
    """Read this rank's experts of the full checkpoint in ``root/full``, save step 1 from both
    ranks, then save step 2 and SIGKILL rank ``victim`` at ``point`` (test_checkpoint.kill_at):
    "data" inside DCP's write of its entries, "renames" (the lead) between the two renames."""
    torch.set_num_threads(1)
    net, _ = _fresh()
    per = N_EXPERTS // world
    net.experts.keep_experts_(rank * per, per)
    opt = type(_fresh()[1])(net.parameters(), lr=1e-2)
    ck.load_checkpoint(f"{root}/full", model=net, optimizer=opt)
    saver = ck.Checkpointer(StateLayout(net, opt), group=ck.checkpoint_group())
    saver.save(root, step=1, config=CONFIG)
    torch.save(_snapshot(net, opt), f"{root}/step1-rank{rank}.pt")
    with torch.no_grad():  # another state for step 2, the same change on every rank
        for p in net.parameters():
            p.mul_(2)
    if rank == victim:
        kill_at(point)
    saver.save(root, step=2, config=CONFIG)


@pytest.mark.parametrize(("victim", "point"), [(1, "data"), (0, "renames")])
def test_rank_killed_during_save_leaves_the_previous_checkpoint(tmp_path, victim, point):
    net, opt = _trained(11)
    ck.save_checkpoint(tmp_path / "full", model=net, optimizer=opt, step=0, config=CONFIG)
    with pytest.raises(AssertionError, match=r"exited with nonzero status|failed"):
        run_gloo(_kill_worker, 2, str(tmp_path), victim, point, timeout=60)
    meta = read_checkpoint_meta(tmp_path)  # every file there, each matching its sha256
    assert meta["step"] == 1 and meta["ranks"] == 2
    assert meta["path"].endswith("checkpoint.prev" if point == "renames" else "checkpoint")
    # The step-1 state of both ranks, read back in one process: experts 0-1 from rank 0, 2-3
    # from rank 1.
    net, opt = _fresh()
    ck.load_checkpoint(tmp_path, model=net, optimizer=opt)
    _assert_full_is_parts(
        _snapshot(net, opt), [torch.load(tmp_path / f"step1-rank{r}.pt") for r in range(2)]
    )
