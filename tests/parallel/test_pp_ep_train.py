"""``train(pp=2, ep=2)`` on four gloo ranks against the single-process run (CPU), resume included.

Layout under test: rank = pipeline_rank * 2 + ep_rank; ranks {0, 2} and {1, 3} are two pipelines
(each on half of every batch), ranks {0, 1} and {2, 3} the expert-parallel pairs holding the same
stages with half of every MoE layer's routed experts each.

Oracle: the same seed gives the same initial weights on every rank and the same global batches,
and the step computes the gradient of the same global batch-mean loss, so the run must follow the
single-process trajectory. It cannot be bitwise: every GEMM runs on a micro-batch of one sequence,
the micro-batch and replica gradients are summed in another order, the MoE output is summed per
rank before the combine, and the clipping norm is summed in float64 here but in fp32 by the
single-process AdamW.clip_grad_norm_. Float64 parameters keep the first of these at ~1e-16; the
fp32 clipping norm (~6e-8 relative) is what the tolerance below covers. One spawned group runs
every case so the file stays fast; a hang fails through the spawn helper's timeout.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.distributed as dist

from ptxtrain.train import TrainArgs, read_metrics, train
from ptxtrain.train.pipeline import pipeline_groups
from tests._checkpoints import assert_checkpoints_close, assert_same_checkpoint
from tests._spawn import raised_on_this_rank, run_gloo

PP, EP = 2, 2
STEPS = 4
SCHEDULES = ("dualpipe", "1f1b", "dualpipev")
# Copies of the pp x ep step-2 checkpoint resumed in other layouts: by the four ranks, and
# ("cross", None) by the test process alone.
RESHARDED = {"cross": None, "to-ep4": dict(ep=4), "to-pp4": dict(pp=4, schedule="1f1b")}
# Relative tolerance (relative to max(1, |value|)) on the logged losses and gradient norm, float64
# parameters: the single-process reference clips with an fp32 total norm (≈6e-8 relative) while
# this run sums the squared norms in float64, so the clip coefficient differs by ~1e-8 relative
# and Adam's later steps carry that into the weights and losses. Observed after 4 steps: grad
# norm 3.4e-8, losses 5e-10, val loss 8e-10 (the first three steps' losses ~1e-15). 5e-7 still
# catches any real error: an expert gradient not divided by EP moves the step-2 loss by 3e-6 and
# the step-3 loss by 3e-4; a replica's tokens dropped or a replicated gradient not averaged more.
TOL = 5e-7


def _args(out, **kw) -> TrainArgs:
    base = dict(
        preset="tiny", mtp=False, steps=STEPS, batch_size=8, seq_len=16, lr=1e-2, min_lr=1e-3,
        warmup_steps=1, eval_every=2, eval_batches=1, ckpt_every=2, sample_tokens=0,
        progress=False, out=str(out), device="cpu", overwrite=True,
    )  # fmt: skip
    base.update(kw)
    return TrainArgs(**base)


def _worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    f64 = torch.float64
    result: dict = {}
    for sched in SCHEDULES:
        s = train(
            _args(
                f"{root}/{sched}", pp=PP, ep=EP, schedule=sched, timeline=sched == "dualpipe",
                sample_tokens=4 if sched == "1f1b" else 0,
            ),
            param_dtype=f64,
        )  # fmt: skip
        result[sched] = s["losses"]
    # Interrupted after 2 steps (checkpointed), then resumed: must equal the straight run. A copy
    # of the step-2 folder is resumed by the single-process test below.
    train(_args(f"{root}/resumed", pp=PP, ep=EP, stop_after=2), param_dtype=f64)
    if rank == 0:
        for name in RESHARDED:
            shutil.copytree(f"{root}/resumed", f"{root}/{name}")
    dist.barrier()
    s = train(_args(f"{root}/resumed", pp=PP, ep=EP, resume=True, overwrite=False), param_dtype=f64)
    result["resumed"] = s["losses"]
    # The step-2 checkpoint resumed by the same four ranks in other layouts.
    for name, layout in RESHARDED.items():
        if layout is not None:
            s = train(_args(f"{root}/{name}", resume=True, overwrite=False, **layout),
                      param_dtype=f64)  # fmt: skip
            result[name] = s["losses"]
    # Errors seen by every rank: a layout of 8 ranks on a world of 4; experts that do not split.
    result["errors"] = raised_on_this_rank(
        [
            ((dict(pp=PP, ep=4, batch_size=16), None), "--pp 2 --ep 4 needs 8 processes"),
            (
                (
                    dict(pp=PP, ep=EP),
                    {"n_routed_experts": 3, "n_expert_groups": 1, "n_limited_groups": 1},
                ),
                "n_routed_experts=3 must be divisible by --ep",
            ),
        ],
        lambda kw, overrides: train(_args(f"{root}/bad", **kw), model_overrides=overrides),
    )
    g = pipeline_groups(PP, EP, "dualpipe")  # the layout, as the group members see it
    result["groups"] = [
        dist.get_process_group_ranks(x) for x in (g.pipeline, g.expert, g.mirror)
    ] + [g.pipeline_rank, g.ep_rank]
    with open(f"{root}/rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppep")
    run_gloo(_worker, PP * EP, str(root), timeout=180)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(PP * EP)]
    single = tmp_path_factory.mktemp("single") / "run"
    ref = train(_args(single), param_dtype=torch.float64)
    return root, ranks, ref, single


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(1.0, abs(b))


@pytest.mark.parametrize("sched", SCHEDULES)
def test_pp2_ep2_matches_single_process(runs, sched):
    root, ranks, ref, single = runs
    recs = read_metrics(root / sched / "metrics.jsonl")
    ref_recs = read_metrics(single / "metrics.jsonl")
    losses = [r["loss"] for r in recs]
    assert len(losses) == STEPS
    # Every rank reports the same (all-reduced) losses; rank 0 wrote them.
    assert all(res[sched] == losses for res in ranks)
    for key in ("loss", "aux_loss", "val_loss", "grad_norm"):
        got = [r.get(key) for r in recs]
        want = [r.get(key) for r in ref_recs]
        assert [g is None for g in got] == [w is None for w in want], key
        pairs = [(a, b) for a, b in zip(got, want, strict=True) if a is not None]
        assert pairs, key
        diffs = [_rel(a, b) for a, b in pairs]
        assert max(diffs) < TOL, f"{sched} {key}: {diffs}"
    assert ref["losses"][-1] < ref["losses"][0]
    assert recs[0]["grad_norm"] > 1.0  # the global clipping was active (grad_clip = 1)
    # The router bias update used the global load: the same statistics as the single process.
    for key in ("tokens", "max_load_ratio", "cv"):
        assert _rel(recs[-1]["moe"][key], ref_recs[-1]["moe"][key]) < TOL, key


def test_pp2_ep2_resume_is_exact_and_has_the_single_process_entries(runs):
    root, ranks, _, single = runs
    straight, resumed = root / "dualpipe", root / "resumed"
    # Rank 0 returns the losses of the whole run, the others those of the resuming call.
    assert len(ranks[0]["resumed"]) == STEPS
    assert all(res["resumed"] == ranks[0]["resumed"][2:] for res in ranks[1:])
    got, want = (
        [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(d / "metrics.jsonl")]
        for d in (resumed, straight)
    )
    assert got == want  # exact floats: the resumed run continues the very same trajectory
    assert_same_checkpoint(straight, resumed)
    # The four ranks wrote the single-process entries (every expert of every layer, every stage,
    # the optimizer state), close to the single-process run's after the same steps. Per tensor,
    # relative L2 difference: AdamW keeps its moments in BF16, so a ~1e-8 difference (see TOL)
    # can round a moment element to the neighbouring bf16 value and change that element's
    # update by 2^-8 of lr; tests/train/test_ep_train.py observed up to 1.5e-5 per weight and
    # 1.5e-4 per moment. 1e-3 is far below the O(1) difference of a misplaced, stale or missing
    # expert shard or stage.
    assert_checkpoints_close(straight, single, rel=1e-3)


def test_pp2_ep2_run_folder_and_errors(runs):
    root, ranks, ref, _ = runs
    run = root / "dualpipe"
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "metrics.jsonl", "summary.json", "loss.png"} <= names
    # --timeline: one pipeline's ranks (pipeline ranks 0 and 1), not overwritten by the other.
    assert {n for n in names if n.startswith("timeline_rank")} == {
        "timeline_rank0.jsonl",
        "timeline_rank1.jsonl",
    }
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["ep"] == EP and cfg["pipeline"]["pp"] == PP
    assert cfg["params"] == ref["params"]  # the whole model's counts
    # Sampling is a collective of pipeline rank 0's EP group.
    assert (root / "1f1b" / "samples.txt").read_text().count("--- sample") == 3
    for r, res in enumerate(ranks):
        assert res["errors"] == [True, True], f"rank {r}: {res['errors']}"


def test_pp2_ep2_checkpoint_resumes_in_other_layouts(runs):
    root, ranks, ref, _ = runs
    s = train(_args(root / "cross", resume=True, overwrite=False), param_dtype=torch.float64)
    # Steps 3-4 of the single-process trajectory from the pp x ep step-2 checkpoint (same TOL),
    # in one process, under --ep 4 and under --pp 4: each rank read what its layout holds.
    losses = {"cross": s["losses"], **{n: ranks[0][n] for n in RESHARDED if n != "cross"}}
    for name, got in losses.items():
        diffs = [_rel(a, b) for a, b in zip(got[2:], ref["losses"][2:], strict=True)]
        assert len(diffs) == 2 and max(diffs) < TOL, f"{name}: {diffs}"


def test_pp2_ep2_group_layout(runs):
    _, ranks, _, _ = runs
    for r, res in enumerate(ranks):
        p_rank, e_rank = divmod(r, EP)  # rank = pipeline_rank * EP + ep_rank
        pipe = [s * EP + e_rank for s in range(PP)]
        experts = [p_rank * EP + e for e in range(EP)]
        assert res["groups"] == [pipe, experts, pipe, p_rank, e_rank], r  # PP = 2: mirror = pipe


def _layout_worker(rank: int, world: int, root: str) -> None:
    g = pipeline_groups(4, 2, "dualpipe")
    got = [dist.get_process_group_ranks(x) for x in (g.pipeline, g.expert, g.mirror)]
    # One all-reduce per group: a group created in another order on some rank would mismatch.
    t = torch.ones(1)
    for x in (g.pipeline, g.expert, g.mirror):
        dist.all_reduce(t, group=x)
    with open(f"{root}/layout{rank}.json", "w", encoding="utf-8") as f:
        json.dump([*got, float(t)], f)


def test_pipeline_groups_dualpipe_pp4_ep2(tmp_path):
    # The DualPipe mirror pairs with PP > 2 (not reachable by the 4-rank training runs above).
    run_gloo(_layout_worker, 8, str(tmp_path), timeout=60)
    for r in range(8):
        p_rank, e_rank = divmod(r, 2)
        mirror_rank = 3 - p_rank
        got = json.loads((tmp_path / f"layout{r}.json").read_text())
        assert got[0] == [s * 2 + e_rank for s in range(4)], r
        assert got[1] == [p_rank * 2, p_rank * 2 + 1], r
        assert got[2] == sorted([r, mirror_rank * 2 + e_rank]), r
        assert got[3] == 4 * 2 * 2  # 1 x 4 (pipeline) x 2 (expert) x 2 (mirror)
