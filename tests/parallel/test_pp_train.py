"""``train(pp=2)`` under each schedule against the single-process run (CPU, gloo).

Oracle: the same seed gives the same initial weights and the same batches, so the pipeline run
must follow the single-process trajectory. It cannot be bitwise: the pipeline runs each
micro-batch's GEMMs on a quarter of the rows (other blockings, other fp32 rounding), averages
micro-batch means instead of one batch mean, and sums the micro-batch gradients into the FP32
buffers one by one. Tolerances per dtype are below. One spawned group runs every case so the
file stays fast; a hang fails through the spawn helper's timeout.
"""

from __future__ import annotations

import json

import pytest
import torch

from ptxtrain.train import TrainArgs, model_config, read_checkpoint_meta, read_metrics, train
from ptxtrain.train.pipeline_layout import balanced_layout, part_costs
from tests._spawn import raised_on_this_rank, run_gloo, run_torchrun_like

# A 4-layer model small enough for a few steps in well under a second; 4 layers split into 2
# stages (1F1B, DualPipe) or 4 (DualPipeV on 2 ranks). MoE layers with the sequence-wise
# balance loss on (the default alpha), MTP off (not supported in the pipeline).
CFG = {
    "dim": 32,
    "n_layers": 4,
    "n_dense_layers": 1,
    "dense_inter_dim": 64,
    "n_heads": 2,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "moe_inter_dim": 16,
    "n_routed_experts": 4,
    "n_activated_experts": 2,
    "n_expert_groups": 2,
    "n_limited_groups": 1,
    "max_seq_len": 16,
    "mtp_depth": 0,
}
UNEVEN = {**CFG, "n_layers": 6}
# Explicit non-uniform layouts (--pp-layout), each with an empty end stage (the embedding alone,
# the head and loss alone): (run name, schedule, model, layout).
LAYOUTS = (
    ("layout-dualpipev", "dualpipev", UNEVEN, (0, 3, 2, 1)),
    ("layout-1f1b", "1f1b", CFG, (4, 0)),
)
STEPS = 4
SCHEDULES = ("1f1b", "dualpipe", "dualpipev")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Absolute tolerance on the train and val losses (about 5.5 nats at the start):
# - fp32: the only differences are fp32 rounding (micro-batch GEMM blockings, the order of
#   sums); observed a few ulps (~5e-7) after 4 steps, so 2e-5 leaves room and still catches any
#   real error (a wrong gradient or a missed micro-batch moves the loss by > 1e-3).
# - bf16: weights are bf16, so a last-bit difference in an FP32 master can round a weight to the
#   neighbouring bf16 value (2^-8 relative); observed ~2e-4 after 4 steps, tolerance 3e-3.
TOL = {"float32": 2e-5, "bfloat16": 3e-3}


def _args(out, **kw) -> TrainArgs:
    base = dict(
        steps=STEPS, batch_size=8, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=1,
        eval_every=STEPS, eval_batches=1, ckpt_every=0, sample_tokens=0, progress=False,
        out=str(out), device="cpu", overwrite=True,
    )  # fmt: skip
    base.update(kw)
    return TrainArgs(**base)


def _worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    result: dict = {}
    for sched in SCHEDULES:
        for name, dtype in DTYPES.items():
            out = f"{root}/{sched}-{name}"
            s = train(
                _args(out, pp=world, schedule=sched, timeline=sched == "dualpipe"),
                model_overrides=CFG,
                param_dtype=dtype,
            )
            result[f"{sched}-{name}"] = s["losses"]
    for name, sched, cfg, layout in LAYOUTS:
        s = train(
            _args(f"{root}/{name}", pp=world, schedule=sched, pp_layout=layout),
            model_overrides=cfg,
            param_dtype=torch.float32,
        )
        result[name] = s["losses"]
    result["peaks"] = s.get("peak_memory_bytes_per_rank", "rank > 0")
    # Errors seen by every rank: a pipeline of 4 on a world of 2, and a run folder in use
    # (found by rank 0 only, then shared).
    result["errors"] = raised_on_this_rank(
        [
            ((dict(pp=4, schedule="1f1b"),), "needs 4 processes"),
            ((dict(pp=world, schedule="1f1b", overwrite=False),), "already holds a run"),
        ],
        lambda kw: train(_args(f"{root}/1f1b-float32", **kw), model_overrides=CFG),
    )
    with open(f"{root}/rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    run_gloo(_worker, 2, str(root), timeout=120)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return root, ranks


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_pp2_losses_match_single_process(pipeline_runs, tmp_path, dtype):
    root, ranks = pipeline_runs
    ref = train(_args(tmp_path / "ref"), model_overrides=CFG, param_dtype=DTYPES[dtype])
    ref_val = read_metrics(tmp_path / "ref" / "metrics.jsonl")[-1]["val_loss"]
    for sched in SCHEDULES:
        key = f"{sched}-{dtype}"
        records = read_metrics(root / key / "metrics.jsonl")
        losses = [r["loss"] for r in records]
        assert len(losses) == STEPS
        # Every rank reports the same (all-reduced) losses; rank 0 wrote them.
        assert ranks[0][key] == ranks[1][key] == losses
        diffs = [abs(a - b) for a, b in zip(losses, ref["losses"], strict=True)]
        assert max(diffs) < TOL[dtype], f"{key}: train loss diffs {diffs}"
        # The val loss is computed on rank 0 after gathering every stage: checks the gather.
        val = records[-1]["val_loss"]
        assert abs(val - ref_val) < TOL[dtype], f"{key}: val loss {val} vs {ref_val}"
        assert records[-1]["aux_loss"] > 0  # the MoE balance loss went through the pipeline


@pytest.mark.parametrize(("name", "sched", "cfg", "layout"), LAYOUTS)
def test_pp2_layout_matches_single_process(pipeline_runs, tmp_path, name, sched, cfg, layout):
    root, ranks = pipeline_runs
    ref = train(_args(tmp_path / "ref"), model_overrides=cfg, param_dtype=torch.float32)
    assert ranks[0][name] == ranks[1][name]
    assert ranks[0]["peaks"] == [None, None]  # gathered from both ranks; None on CPU
    diffs = [abs(a - b) for a, b in zip(ranks[0][name], ref["losses"], strict=True)]
    assert max(diffs) < TOL["float32"], f"{name}: train loss diffs {diffs}"
    # The run records the layout it was given (config.json, summary.json, the checkpoint).
    run = root / name
    want = {"pp": 2, "schedule": sched, "num_chunks": 4, "layout": list(layout)}
    assert json.loads((run / "config.json").read_text())["pipeline"] == want
    assert json.loads((run / "summary.json").read_text())["pipeline"] == want
    assert read_checkpoint_meta(run)["extra"]["pipeline"] == want  # what --resume keeps


def test_pp2_run_folder(pipeline_runs):
    root, _ = pipeline_runs
    run = root / "dualpipe-float32"
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "metrics.jsonl", "summary.json", "loss.png"} <= names
    assert {"timeline_rank0.jsonl", "timeline_rank1.jsonl"} <= names  # --timeline: every rank
    # --ckpt-every 0: one checkpoint at the end (its content: tests/parallel/test_pp_checkpoint.py)
    assert (run / "checkpoint" / "meta.json").is_file()
    cfg = json.loads((run / "config.json").read_text())
    # No --pp-layout: the cost-balanced layout of this model (tests/train/test_pp_layout.py).
    config = model_config(_args(run), model_overrides=CFG)
    # 8 sequences of 16 tokens in 4 micro-batches
    layout = balanced_layout(part_costs(config, 16, 2 * 16), "dualpipe", 2)
    assert cfg["pipeline"] == {"pp": 2, "schedule": "dualpipe", "num_chunks": 4,
                               "layout": list(layout)}  # fmt: skip
    assert cfg["train"]["pp_layout"] is None
    assert not any(
        n.startswith("timeline") for n in (p.name for p in (root / "1f1b-float32").iterdir())
    )


def test_pp2_errors_raise_on_every_rank(pipeline_runs):
    _, ranks = pipeline_runs
    for r, res in enumerate(ranks):
        assert res["errors"] == [True, True], f"rank {r}: {res['errors']}"


def test_pp_report_reads_the_run_folders(pipeline_runs, tmp_path):
    """benchmarks/pp_report.py: throughput, per-rank memory and the bubble from a pipeline run
    folder, against a one-process run made here."""
    from benchmarks.pp_report import main as pp_report

    root, _ = pipeline_runs
    train(_args(tmp_path / "one"), model_overrides=CFG)
    out = tmp_path / "report.json"
    rc = pp_report(
        ["--json", str(out), f"1gpu={tmp_path / 'one'}", f"pp2={root / 'dualpipe-float32'}"]
    )
    assert rc == 0
    rec = json.loads(out.read_text())
    one, pp2 = rec["runs"]["1gpu"], rec["runs"]["pp2"]
    assert (one["gpus"], pp2["gpus"]) == (1, 2)
    assert (
        pp2["pipeline"]
        == json.loads((root / "dualpipe-float32" / "config.json").read_text())["pipeline"]
    )
    assert pp2["peak_memory_mib_per_rank"] == [None, None]  # CPU: no CUDA memory, both ranks
    assert rec["compared"] == "steady_tokens_per_s" and pp2["steady_tokens_per_s"] > 0
    assert one["bubble"] is None  # no timeline without --pp
    bubble = pp2["bubble"]
    assert bubble["schedule"] == "dualpipe" and bubble["ranks"] == 2
    assert bubble["steps_used"] == min(5, STEPS) and 0 <= bubble["measured_median"] < 1
    # A folder without summary.json is reported as missing, and the exit code says so.
    assert pp_report(["--json", str(out), f"gone={tmp_path / 'nothing'}"]) == 1
    assert "gone" in json.loads(out.read_text())["missing"]


def _twice(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    for i, sched in enumerate(("dualpipe", "1f1b")):
        s = train(_args(f"{root}/run{i}", pp=world, schedule=sched, steps=1), model_overrides=CFG)
        assert len(s["losses"]) == 1
        assert dist.is_initialized()  # the group train() made stays for the next call


def test_train_twice_in_one_torchrun_process(tmp_path):
    """train() creates the process group from torchrun's environment; a second call in the same
    process reuses it (re-initializing after a destroy hung in the rendezvous)."""
    run_torchrun_like(_twice, 2, str(tmp_path), timeout=120)
