"""Checkpoints and ``--resume`` of ``train(pp=2)`` on two gloo ranks (CPU).

Oracles:
- A run stopped after 2 of 4 steps (checkpointed) and resumed with the same pipeline must log
  exactly the metrics of the straight run, and end with a bit-identical checkpoint: the
  checkpoint restores every stage, its optimizer state, the step (hence the data position and
  the learning rate), the RNG state and the router biases.
- The checkpoint's names do not depend on the layout (each rank writes the stages it owns), so a
  pipeline checkpoint holds the single-process one's entries, resumes in one process, and a
  single-process checkpoint resumes under ``--pp``; those runs follow the other layout's
  trajectory up to float rounding (tolerance below). ``--async-ckpt`` writes the same checkpoint.
- Faults (another model, a corrupt file, a failure on one rank only) raise on every rank; a hang
  fails through the spawn helper's timeout.
One spawned group runs every case so the file stays fast.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ptxtrain.train import CheckpointError, TrainArgs, read_metrics, train
from tests._checkpoints import assert_checkpoints_close, assert_same_checkpoint
from tests._spawn import run_gloo
from tests.parallel.test_pp_train import CFG

STEPS = 4
STOP = 2  # the interrupted runs stop (checkpointed) after this many steps
# Bitwise resume: DualPipe in bf16 (the training dtype: FP32 masters in the optimizer state) and
# 1F1B in fp32 (no masters), so both kinds of optimizer state are covered.
BITWISE = {"dualpipe": torch.bfloat16, "1f1b": torch.float32}
# The 4-step pipeline runs of test_pp_train agree with one process within 2e-5 in fp32 (micro-
# batch GEMM blockings and summation order; observed ~5e-7). Here only the 2 resumed steps run in
# the other layout, so the difference can only be smaller; a lost or misplaced optimizer state
# (Adam restarting from zero moments) moves the step-3 loss by > 1e-2.
CROSS_TOL = 2e-5
# Logged metrics that measure the machine rather than the trajectory.
TIMING = ("time_s", "tokens_per_s", "model_tflops", "mfu")


def _args(out, **kw) -> TrainArgs:
    base = dict(
        steps=STEPS, batch_size=8, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=1,
        eval_every=2, eval_batches=1, ckpt_every=2, sample_tokens=0, progress=False,
        out=str(out), device="cpu", overwrite=True, mtp=False,
    )  # fmt: skip
    base.update(kw)
    return TrainArgs(**base)


def _resume(out, **kw) -> TrainArgs:
    return _args(out, resume=True, overwrite=False, **kw)


def _raises(fn, exc, match) -> bool:
    try:
        fn()
    except exc as e:
        return match in str(e)
    return False


def _worker(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: dict = {}
    for sched, dtype in BITWISE.items():
        pp = dict(pp=world, schedule=sched)
        train(_args(f"{root}/{sched}-straight", **pp), model_overrides=CFG, param_dtype=dtype)
        run = f"{root}/{sched}-resumed"
        train(_args(run, stop_after=STOP, **pp), model_overrides=CFG, param_dtype=dtype)
        if rank == 0 and sched == "1f1b":  # the step-2 checkpoint, resumed in one process later
            shutil.copytree(run, f"{root}/to-single")
        s = train(_resume(run, async_ckpt=sched == "1f1b", **pp), model_overrides=CFG,
                  param_dtype=dtype)  # fmt: skip
        result[sched] = s["losses"]
    # A single-process checkpoint (written by the test process) resumed under DualPipe.
    train(
        _resume(f"{root}/from-single", pp=world, schedule="dualpipe"),
        model_overrides=CFG,
        param_dtype=torch.float32,
    )

    # Faults, seen by every rank: another model; a corrupt file; a failure on one rank only.
    pp = dict(pp=world, schedule="1f1b")
    errors = [
        _raises(
            lambda: train(
                _resume(f"{root}/1f1b-resumed", **pp), model_overrides={**CFG, "dim": 48}
            ),
            CheckpointError,
            "different configuration",
        )
    ]
    bad = f"{root}/corrupt"
    if rank == 0:
        shutil.copytree(f"{root}/1f1b-resumed", bad)
        path = Path(bad) / "checkpoint" / "__1_0.distcp"  # hashed by one rank: seen by both
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte: the file's sha256 no longer matches
        path.write_bytes(bytes(data))
    dist.barrier()
    errors.append(
        _raises(
            lambda: train(_resume(bad, **pp), model_overrides=CFG, param_dtype=torch.float32),
            CheckpointError,
            "__1_0.distcp does not match its recorded sha256",
        )
    )
    from ptxtrain.model import get_preset
    from ptxtrain.train.strategy import ParallelStrategy

    config = type(get_preset("tiny")).from_dict({**get_preset("tiny").to_dict(), **CFG})
    setup = ParallelStrategy(_args(bad, **pp), config, torch.float32)

    def fail_on_rank_1():
        if rank == 1:
            raise CheckpointError("only rank 1 sees this")
        return "ok"

    errors.append(_raises(lambda: setup.on_every_rank(fail_on_rank_1), CheckpointError, "only"))
    result["errors"] = errors
    with open(f"{root}/rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppckpt")
    f32 = torch.float32
    # Single-process fp32 reference (straight), and its step-2 checkpoint for the pp resume.
    single = train(_args(root / "single"), model_overrides=CFG, param_dtype=f32)
    train(_args(root / "from-single", stop_after=STOP), model_overrides=CFG, param_dtype=f32)
    run_gloo(_worker, 2, str(root), timeout=150)
    # The 1F1B step-2 checkpoint resumed in this (single) process.
    to_single = train(_resume(root / "to-single"), model_overrides=CFG, param_dtype=f32)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return root, ranks, single, to_single


def _trajectory(run) -> list[dict]:
    return [
        {k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(run / "metrics.jsonl")
    ]


@pytest.mark.parametrize("sched", list(BITWISE))
def test_pp2_resume_is_bitwise(runs, sched):
    root, ranks, _, _ = runs
    straight, resumed = root / f"{sched}-straight", root / f"{sched}-resumed"
    got, want = _trajectory(resumed), _trajectory(straight)
    assert len(want) == STEPS and "val_loss" in want[STOP - 1] and "moe" in want[-1]
    # Exact floats: every logged metric (losses, lr, grad norm, aux loss, val loss, router
    # statistics) of the resumed run equals the straight run's.
    assert got == want
    # Rank 0 returns the losses of the whole run, the others those of the resuming call.
    assert ranks[0][sched] == [r["loss"] for r in want]
    assert ranks[1][sched] == ranks[0][sched][STOP:]
    assert_same_checkpoint(straight, resumed)
    meta = json.loads((resumed / "checkpoint" / "meta.json").read_text())["body"]
    assert meta["step"] == STEPS and meta["ranks"] == 2


def test_pp2_checkpoint_has_the_single_process_entries(runs):
    # Same step (4: two steps under 1F1B then two in one process, against two in one process
    # then two under DualPipe), same dtype: the two checkpoints hold the same tensors under the
    # same names, with close values (relative L2 per tensor: fp32 rounding only, Adam-amplified
    # over the steps; a misplaced stage or optimizer entry is O(1) off), and the same optimizer
    # parameter groups.
    root, _, _, _ = runs
    assert_checkpoints_close(root / "to-single", root / "from-single", rel=1e-3)


def test_pp2_checkpoint_resumes_in_one_process_and_back(runs):
    root, _, single, to_single = runs
    # pp -> one process: steps 1-2 from the 1F1B run (exact), steps 3-4 in one process.
    pp_losses = [r["loss"] for r in read_metrics(root / "1f1b-straight" / "metrics.jsonl")]
    assert to_single["losses"][:STOP] == pp_losses[:STOP]
    diffs = [abs(a - b) for a, b in zip(to_single["losses"], pp_losses, strict=True)]
    assert max(diffs) < CROSS_TOL, f"pp -> single: {diffs}"
    # one process -> pp: steps 1-2 from the single-process run (exact), 3-4 under DualPipe.
    from_single = [r["loss"] for r in read_metrics(root / "from-single" / "metrics.jsonl")]
    assert from_single[:STOP] == single["losses"][:STOP]
    diffs = [abs(a - b) for a, b in zip(from_single, single["losses"], strict=True)]
    assert max(diffs) < CROSS_TOL, f"single -> pp: {diffs}"
    assert from_single[-1] < from_single[0]  # it trained on


def test_pp2_checkpoint_faults_raise_on_every_rank(runs):
    _, ranks, _, _ = runs
    for r, res in enumerate(ranks):
        assert res["errors"] == [True, True, True], f"rank {r}: {res['errors']}"
