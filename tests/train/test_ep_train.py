"""``train(ep=2)`` on two gloo ranks against the single-process run (CPU), checkpoints included.

Oracle: the same seed gives the same initial weights on every rank (the full model is built,
then sliced) and the same global batches, and the expert-parallel step computes the gradient of
the same global batch-mean loss, so the ``ep = 2`` run must follow the single-process
trajectory. It cannot be bitwise: each rank runs its GEMMs on half the sequences, the gradient is
a sum of two half-batch gradients, the MoE output is summed per rank and then combined, and the
clipping norm is summed in another order. Tolerances per dtype are below. One spawned group runs
every case so the file stays fast; a hang fails through the spawn helper's timeout.
"""

from __future__ import annotations

import json

import pytest
import torch

from ptxtrain.train import TrainArgs, TrainConfigError, read_checkpoint_state, read_metrics, train
from tests._checkpoints import assert_checkpoints_close, assert_same_checkpoint
from tests._spawn import raised_on_this_rank, run_gloo

# The tiny preset (8 routed experts, 4 per rank; MTP on, so the MTP block's MoE layer is split
# too) at a short sequence length: a few steps take a couple of seconds.
STEPS = 4
DTYPES = {"float64": torch.float64, "bfloat16": torch.bfloat16}
# Relative tolerances (relative to max(1, |value|)) on the logged losses and gradient norm:
# - float64: the step-1 losses agree exactly (forward differences are ~1e-16). The single-process
#   reference clips with AdamW.clip_grad_norm_, whose total norm is an fp32 value (≈6e-8
#   relative), while the ep run sums the squared norms in float64; the clip coefficient then
#   differs by ~1e-7 relative, which Adam's second step turns into weight and loss differences.
#   Observed: grad norm 9e-8, losses 2e-8 after 4 steps. 5e-7 still catches any real error (a
#   gradient off by a factor 2 or a missed rank's tokens moves the norm and the losses by > 1e-3).
# - bfloat16: bf16 activations are rounded twice where a token's experts sit on both ranks (each
#   rank's partial sum, then the combine) and the half-batch GEMMs round differently, so the
#   step-1 losses differ by ~4e-5 relative; a small lr (the default 1e-2 makes this tiny bf16
#   model chaotic after two steps) keeps that from growing fast. Observed after 3 steps: losses
#   8e-4, grad norm 1e-2; tolerances 5e-3 and 5e-2 (an unscaled expert gradient moves the step-1
#   norm by > 10 %).
TOL = {"float64": (5e-7, 5e-7), "bfloat16": (5e-3, 5e-2)}  # (losses, grad_norm)
RUN_OF = {"float64": dict(steps=STEPS), "bfloat16": dict(steps=3, lr=2e-3)}


def _args(out, **kw) -> TrainArgs:
    base = dict(
        steps=STEPS, batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=1,
        eval_every=2, eval_batches=1, ckpt_every=2, sample_tokens=0, progress=False,
        out=str(out), device="cpu", overwrite=True,
    )  # fmt: skip
    base.update(kw)
    return TrainArgs(**base)


def _worker(rank: int, world: int, root: str) -> None:
    torch.set_num_threads(1)
    result: dict = {}
    for name, dtype in DTYPES.items():
        s = train(
            _args(f"{root}/ep-{name}", ep=world, sample_tokens=4, **RUN_OF[name]),
            param_dtype=dtype,
        )
        result[name] = s["losses"]
    # Gradient accumulation: 2 micro-batches of 2 sequences (1 per rank), the batch of 4 above.
    train(
        _args(f"{root}/ep-accum", ep=world, batch_size=2, grad_accum_steps=2),
        param_dtype=torch.float64,
    )
    # Interrupted after 2 steps (checkpointed), then resumed: must equal the straight run.
    train(_args(f"{root}/resumed", ep=world, stop_after=2), param_dtype=torch.float64)
    s = train(
        _args(f"{root}/resumed", ep=world, resume=True, overwrite=False),
        param_dtype=torch.float64,
    )
    result["resumed"] = s["losses"]
    # Errors seen by every rank: an ep of 4 on a world of 2; experts that do not split in two.
    result["errors"] = raised_on_this_rank(
        [
            ((dict(ep=4), None), "needs 4 processes"),
            (
                (
                    dict(ep=world),
                    {"n_routed_experts": 3, "n_expert_groups": 1, "n_limited_groups": 1},
                ),
                "n_routed_experts=3 must be divisible by --ep",
            ),
        ],
        lambda kw, overrides: train(_args(f"{root}/bad", **kw), model_overrides=overrides),
    )
    # The shared Buffer's errors are checked before each optimizer step (nvlink reports a timed
    # out wait only then): a Buffer that reports one stops the run before the first step.
    from ptxtrain.ep.buffer import Buffer

    def failing_check(self) -> None:
        raise RuntimeError("a peer timed out (test)")

    original, Buffer.check_errors = Buffer.check_errors, failing_check
    try:
        train(_args(f"{root}/timeout", ep=world, steps=1), param_dtype=torch.float64)
        result["check_errors"] = "not raised"
    except RuntimeError as e:
        result["check_errors"] = str(e)
    finally:
        Buffer.check_errors = original
    with open(f"{root}/rank{rank}.json", "w", encoding="utf-8") as f:
        json.dump(result, f)


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    run_gloo(_worker, 2, str(root), timeout=150)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    return root, ranks


@pytest.fixture(scope="module")
def single_runs(tmp_path_factory):
    """The single-process reference runs (same arguments, ep = 1), one per dtype."""
    root = tmp_path_factory.mktemp("single")
    return {
        name: (train(_args(root / name, **RUN_OF[name]), param_dtype=dtype), root / name)
        for name, dtype in DTYPES.items()
    }


def test_ep_buffer_errors_are_checked_before_the_step(ep_runs):
    root, ranks = ep_runs
    # Raised as a CollectiveError naming the check, the rank and the step, with the cause.
    for rank, r in enumerate(ranks):
        assert r["check_errors"].startswith(
            f"rank {rank} of 2: the EP buffer's nvlink kernels (their waits on the peers) in "
            "step 1 failed after"
        ), r["check_errors"]
        assert "a peer timed out (test)" in r["check_errors"]
    metrics = root / "timeout" / "metrics.jsonl"
    assert not metrics.exists() or not read_metrics(metrics)  # no step was logged


def _assert_records_close(recs: list[dict], ref_recs: list[dict], dtype: str) -> None:
    """The logged losses and gradient norms of ``recs`` within ``TOL[dtype]`` of ``ref_recs``."""
    for key in ("loss", "mtp_loss", "aux_loss", "val_loss", "grad_norm"):
        got = [r.get(key) for r in recs]
        want = [r.get(key) for r in ref_recs]
        assert [g is None for g in got] == [w is None for w in want], key
        pairs = [(a, b) for a, b in zip(got, want, strict=True) if a is not None]
        if not pairs:  # not logged in this case (no evaluation)
            continue
        diffs = [abs(a - b) / max(1.0, abs(b)) for a, b in pairs]  # relative above 1
        tol = TOL[dtype][key == "grad_norm"]
        assert max(diffs) < tol, f"{dtype} {key}: {diffs}"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_ep2_losses_match_single_process(ep_runs, single_runs, dtype):
    root, ranks = ep_runs
    ref, ref_dir = single_runs[dtype]
    ref_recs = read_metrics(ref_dir / "metrics.jsonl")
    recs = read_metrics(root / f"ep-{dtype}" / "metrics.jsonl")
    losses = [r["loss"] for r in recs]
    assert len(losses) == RUN_OF[dtype]["steps"]
    # Every rank reports the same (all-reduced) losses; rank 0 wrote them.
    assert ranks[0][dtype] == ranks[1][dtype] == losses
    _assert_records_close(recs, ref_recs, dtype)
    assert ref["losses"][-1] < ref["losses"][0]
    # The router bias update used the global load: same statistics as the single process.
    assert recs[-1]["moe"]["tokens"] == ref_recs[-1]["moe"]["tokens"]
    assert recs[-1]["moe"]["n_moe_layers"] == 4  # 3 main MoE layers + the MTP block's


def test_ep2_grad_accum_matches_single_process(ep_runs, single_runs):
    # Each rank accumulates its sequence of each micro-batch; the gradients are reduced once per
    # step. Same batch as the single-process batch_size 4 run, so the same trajectory (TOL).
    root, _ = ep_runs
    recs = read_metrics(root / "ep-accum" / "metrics.jsonl")
    ref_recs = read_metrics(single_runs["float64"][1] / "metrics.jsonl")
    assert len(recs) == STEPS
    _assert_records_close(recs, ref_recs, "float64")
    assert [r["moe"]["tokens"] for r in recs] == [r["moe"]["tokens"] for r in ref_recs]


def test_ep2_checkpoint_resume_is_exact_and_full_layout(ep_runs, single_runs):
    root, ranks = ep_runs
    straight, resumed = root / "ep-float64", root / "resumed"
    # Rank 0 returns the losses of the whole run, the others those of the resuming call.
    assert len(ranks[0]["resumed"]) == STEPS and ranks[0]["resumed"][2:] == ranks[1]["resumed"]
    got, want = (
        [(r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(d / "metrics.jsonl")]
        for d in (resumed, straight)
    )
    assert got == want  # exact floats: the resumed ep run continues the very same trajectory
    assert_same_checkpoint(straight, resumed)
    # The two ranks wrote the single-process entries (all 8 experts of every layer, one key
    # each), close to the single-process run's state after the same steps. Per tensor, relative
    # L2 difference: AdamW stores its moments in BF16, so a ~1e-8 difference (see TOL) can round
    # a moment element to the neighbouring bf16 value and change that element's update by 2^-8
    # of lr = 1e-2; observed up to 1.5e-5 per weight tensor (single elements up to 6e-6 on a
    # 0.02 scale) and 1.5e-4 per BF16 moment (the flipped roundings themselves). 1e-3 is far
    # below the O(1) difference of a misplaced or stale expert shard.
    single = single_runs["float64"][1]
    assert_checkpoints_close(straight, single, rel=1e-3)
    assert {f"model.layers.1.ffn.experts.w1.{e}" for e in range(8)} <= read_checkpoint_state(
        straight
    ).keys()


def test_ep2_run_folder_and_errors(ep_runs, single_runs):
    root, ranks = ep_runs
    run = root / "ep-float64"
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "metrics.jsonl", "summary.json", "loss.png", "samples.txt"} <= names
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["ep"] == 2
    # Parameter counts are the whole model's (other ranks' experts included).
    assert cfg["params"] == single_runs["float64"][0]["params"]
    assert json.loads((run / "summary.json").read_text())["ep"] == 2
    for r, res in enumerate(ranks):
        assert res["errors"] == [True, True], f"rank {r}: {res['errors']}"


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(ep=0), "--ep must be an integer >= 1"),
        (dict(ep=2, batch_size=3), "--batch-size 3 must be divisible by --ep 2"),
        # each micro-batch is split over the ranks: 3 x 2 = 6 sequences per step do not help
        (dict(ep=2, batch_size=3, grad_accum_steps=2), "--batch-size 3 must be divisible by"),
        (dict(ep=2, pp=2, mtp=False, batch_size=8), "--pp 2 --ep 2 needs 4 processes"),
        (dict(ep=2), "--ep 2 needs 2 processes"),  # this test process is a world of 1
    ],
)
def test_bad_ep_arguments(tmp_path, kw, match):
    with pytest.raises(TrainConfigError, match=match):
        train(_args(tmp_path / "run", **kw))
