"""The training loop: exact resume (bf16 and fp8), run-folder contents, argument errors."""

import itertools
import json
import math
import os
import signal

import pytest

from ptxtrain.train import (
    CheckpointError,
    TrainArgs,
    TrainConfigError,
    lr_at,
    read_checkpoint_state,
    read_metrics,
    train,
)
from ptxtrain.train import loop as loop_mod
from tests._checkpoints import assert_same_checkpoint

# A smaller-than-tiny model so that a few steps take well under a second on a 2-core CPU.
SMALL = {
    "dim": 64,
    "n_layers": 2,
    "n_dense_layers": 1,
    "dense_inter_dim": 128,
    "n_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "moe_inter_dim": 32,
    "n_routed_experts": 4,
    "n_activated_experts": 2,
    "n_expert_groups": 2,
    "n_limited_groups": 1,
    "max_seq_len": 32,
}


def _args(out, **kw):
    base = dict(
        steps=6, batch_size=4, seq_len=16, lr=1e-2, min_lr=1e-3, warmup_steps=2,
        eval_every=3, eval_batches=2, ckpt_every=2, sample_tokens=0, progress=False,
        out=str(out), device="cpu",  # bitwise resume is promised on CPU
    )  # fmt: skip
    base.update(kw)
    return TrainArgs(**base)


def _losses(run_dir):
    return [
        (r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(run_dir / "metrics.jsonl")
    ]


def test_lr_schedule():
    a = TrainArgs(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    lrs = [lr_at(i, a) for i in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x < y for x, y in itertools.pairwise(lrs[:10]))  # warmup rises
    assert all(x >= y for x, y in itertools.pairwise(lrs[9:]))  # cosine falls
    # Halfway through the decay the cosine is at the midpoint of [min_lr, lr].
    assert lr_at(55, a) == pytest.approx(0.55)
    assert lrs[-1] == pytest.approx(0.1, abs=1e-3)
    no_warmup = TrainArgs(steps=10, lr=2.0, min_lr=0.0, warmup_steps=0)
    assert lr_at(0, no_warmup) == 2.0


def _record_fp8_conversions(monkeypatch) -> list:
    """Make ``train()``'s FP8 conversion record every model it converts."""
    from ptxtrain.model import deepseek

    real, converted = deepseek.convert_model_to_fp8_training, []

    def spy(model, config=None):
        converted.append(real(model, config))
        return converted[-1]

    monkeypatch.setattr(deepseek, "convert_model_to_fp8_training", spy)
    return converted


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_resume_is_bitwise_exact(tmp_path, precision, monkeypatch):
    if precision == "fp8":
        # The routed experts' FP8 grouped GEMMs would run their Triton kernels in the CPU
        # interpreter under this suite's TRITON_INTERPRET=1 (~25 s for this test); use the CPU
        # references, as a run without the interpreter does (the kernels have their own tests).
        from ptxtrain.gemm import grouped

        monkeypatch.setattr(grouped, "is_interpreted", lambda: False)
    converted = _record_fp8_conversions(monkeypatch)
    straight = tmp_path / "straight"
    resumed = tmp_path / "resumed"
    s1 = train(_args(straight, precision=precision), model_overrides=SMALL)
    half = train(_args(resumed, precision=precision, stop_after=3), model_overrides=SMALL)
    assert half["step"] == 3
    s2 = train(_args(resumed, precision=precision, resume=True), model_overrides=SMALL)
    assert s2["step"] == 6 and s2["steps_run"] == 3
    # Same train loss and val loss at every step, compared as exact floats.
    assert _losses(straight) == _losses(resumed)
    assert s1["losses"] == s2["losses"]
    # And the final weights and optimizer state are the same bits.
    assert_same_checkpoint(straight, resumed)
    assert s1["losses"][-1] < s1["losses"][0]
    if precision == "fp8":  # the flag really ran FP8 layers (not a silent bf16 run)
        from ptxtrain.moe import Experts
        from ptxtrain.nn import Fp8Linear

        assert len(converted) == 3  # straight, first half, resumed half
        for model in converted:
            assert any(isinstance(m, Fp8Linear) for m in model.modules())
            assert all(m.fp8 for m in model.modules() if isinstance(m, Experts))


def test_deterministic_mode_sets_and_restores_the_global_switches(monkeypatch):
    import torch
    import torch.utils.deterministic as det

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory)
    assert before == (False, True)  # PyTorch's defaults, which the suite runs under
    with loop_mod.deterministic_mode(False):
        assert not torch.are_deterministic_algorithms_enabled()
    with loop_mod.deterministic_mode():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # warn-only keeps
        # the nondeterministic attention kernels: it must be the raising mode
        assert det.fill_uninitialized_memory is False
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert (torch.are_deterministic_algorithms_enabled(), det.fill_uninitialized_memory) == before
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    # A caller's own settings survive, also when the block raises.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.raises(KeyError), loop_mod.deterministic_mode():
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
            raise KeyError("inside")
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


def test_deterministic_run_trains_the_same_and_records_it(tmp_path, monkeypatch):
    import torch

    from ptxtrain.gemm import grouped

    monkeypatch.setattr(grouped, "is_interpreted", lambda: False)  # as test_resume_is_bitwise
    seen = []
    real = loop_mod._train

    def spy(*a, **kw):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real(*a, **kw)

    monkeypatch.setattr(loop_mod, "_train", spy)
    # Every op of an FP8 step (MTP and MoE included) has a deterministic implementation: in
    # deterministic mode PyTorch raises at any that has not. On CPU the losses are the same.
    kw = dict(precision="fp8", steps=3, eval_every=3, ckpt_every=0)
    plain = train(_args(tmp_path / "plain", **kw), model_overrides=SMALL)
    det = train(_args(tmp_path / "det", deterministic=True, **kw), model_overrides=SMALL)
    assert seen == [False, True]
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the run
    assert det["losses"] == plain["losses"]
    cfg = json.loads((tmp_path / "det" / "config.json").read_text())
    assert cfg["train"]["deterministic"] is True
    # --resume keeps it (a run field the checkpoint remembers, not part of the trajectory)
    from ptxtrain.train.checkpoint import read_checkpoint_meta

    meta = read_checkpoint_meta(tmp_path / "det")
    assert meta["extra"]["run"]["deterministic"] is True
    assert "deterministic" not in meta["config"]["train"]


@pytest.fixture
def sigint(request):
    """SIGINT set to ``request.param`` (default: Python's KeyboardInterrupt handler) for the
    test, whatever this process inherited (a non-interactive shell's background job starts with
    SIGINT ignored), and put back afterwards. Yields the disposition the test starts with."""
    start = getattr(request, "param", signal.default_int_handler)
    before = signal.signal(signal.SIGINT, start)
    try:
        yield start
    finally:
        signal.signal(signal.SIGINT, before)


def test_sigint_stops_after_the_step_and_resumes_exactly(tmp_path, monkeypatch, sigint):
    straight = tmp_path / "straight"
    train(_args(straight, steps=5, ckpt_every=0), model_overrides=SMALL)

    real = loop_mod.batch_generator

    def interrupt_at_step_3(seed, step, split="train"):
        if split == "train" and step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the handler only sets a flag
        return real(seed, step, split)

    monkeypatch.setattr(loop_mod, "batch_generator", interrupt_at_step_3)
    run = tmp_path / "run"
    s = train(_args(run, steps=5, ckpt_every=0), model_overrides=SMALL)
    assert s["interrupted"] and s["step"] == 3
    monkeypatch.setattr(loop_mod, "batch_generator", real)
    train(_args(run, steps=5, ckpt_every=0, resume=True), model_overrides=SMALL)
    assert _losses(run) == _losses(straight)
    assert signal.getsignal(signal.SIGINT) is sigint  # handler restored


@pytest.mark.parametrize("sigint", [signal.SIG_IGN, signal.default_int_handler], indirect=True)
def test_stop_flag_keeps_an_ignored_sigint_ignored(sigint):
    stop = loop_mod._StopFlag()
    with stop.on_sigint():
        os.kill(os.getpid(), signal.SIGINT)  # ignored, or sets the flag
        # A second one interrupts, unless SIGINT is ignored.
        if sigint is signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGINT)
        else:
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested is (sigint is not signal.SIG_IGN)
    assert signal.getsignal(signal.SIGINT) is sigint  # restored


def test_resume_drops_metrics_written_after_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    train(_args(run, stop_after=2, ckpt_every=0), model_overrides=SMALL)
    with open(run / "metrics.jsonl", "a") as f:  # a crashed run logged step 3 but never saved it
        f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n" + '{"step": 4, "lo')
    train(_args(run, resume=True, ckpt_every=0), model_overrides=SMALL)
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] > 0 for r in read_metrics(run / "metrics.jsonl"))


def test_resume_with_other_hyperparameters_is_refused(tmp_path):
    run = tmp_path / "run"
    train(_args(run, stop_after=2), model_overrides=SMALL)
    with pytest.raises(CheckpointError, match=r"train\.lr: checkpoint 0\.01, now 0\.02"):
        train(_args(run, resume=True, lr=2e-2), model_overrides=SMALL)
    with pytest.raises(CheckpointError, match=r"model\.dim"):
        train(_args(run, resume=True), model_overrides={**SMALL, "dim": 32, "n_heads": 2})


def test_fp8_recipe_reaches_the_layers_and_the_checkpoint(tmp_path, monkeypatch):
    from ptxtrain.gemm import grouped
    from ptxtrain.moe import Experts
    from ptxtrain.nn import Fp8Linear

    monkeypatch.setattr(grouped, "is_interpreted", lambda: False)  # as in the resume test
    converted = _record_fp8_conversions(monkeypatch)
    run = tmp_path / "run"
    kw = dict(precision="fp8", fp8_recipe="deepseek_pow2", eval_every=0)
    train(_args(run, stop_after=2, **kw), model_overrides=SMALL)
    (model,) = converted
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert linears and experts
    assert all(m.config.recipe_name == "deepseek_pow2" and m.config.pow2_scale for m in linears)
    assert all(m.fp8 and m.fp8_config.pow2_scale for m in experts)
    # The recipe is part of the trajectory: resuming with another one is refused...
    with pytest.raises(CheckpointError, match=r"train\.fp8_recipe: checkpoint 'deepseek_pow2'"):
        train(_args(run, resume=True, precision="fp8", eval_every=0), model_overrides=SMALL)
    # ...and with the same one the run goes on.
    assert train(_args(run, resume=True, **kw), model_overrides=SMALL)["step"] == 6
    # --fp8-recipe offers every Fp8Linear recipe that runs FP8 GEMMs.
    from ptxtrain.nn import RECIPES
    from ptxtrain.train.loop import FP8_RECIPES

    assert set(FP8_RECIPES) == set(RECIPES) - {"bf16"}
    # The default recipe stays out of the trajectory, so older checkpoints keep resuming.
    assert "fp8_recipe" not in TrainArgs(precision="fp8").trajectory()
    assert TrainArgs(precision="fp8", fp8_recipe="deepseek_pow2").trajectory()["fp8_recipe"] == (
        "deepseek_pow2"
    )


def test_run_folder_contents(tmp_path):
    run = tmp_path / "run"
    s = train(_args(run, sample_tokens=24), model_overrides=SMALL)
    for name in ("config.json", "metrics.jsonl", "loss.png", "samples.txt", "summary.json"):
        assert (run / name).is_file(), name
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["model"]["dim"] == SMALL["dim"]
    assert cfg["train"]["lr"] == 1e-2 and cfg["versions"]["torch"]
    assert cfg["device"]["type"] == "cpu"
    assert 0 < cfg["corpus"]["unigram_entropy_nats"] < math.log(256)
    recs = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in recs] == list(range(1, 7))
    for r in recs:
        assert {"loss", "lr", "tokens_per_s", "grad_norm", "moe"} <= set(r)
        assert r["moe"]["tokens"] > 0
    assert [r["step"] for r in recs if "val_loss" in r] == [3, 6]
    assert len(s["samples"]) == 3 and all(s["samples"])
    assert "sample 1" in (run / "samples.txt").read_text(encoding="utf-8")
    # DeepSeek-V3's optimizer: FP32 master (4) + BF16 moments (2 + 2) = 8 B/param plus the
    # per-tensor step counters; with BF16 weights and FP32 grads, 14 plus the same.
    assert 8.0 <= s["optimizer_bytes_per_param"] < 8.2
    assert 14.0 <= s["training_bytes_per_param"] < 14.2
    # Throughput with and without the first step (the one that pays for compiles): the steady
    # figure is the 5 later steps' tokens over their time, taken from the per-step records.
    later = sum(r["time_s"] for r in recs[1:])
    assert s["first_step_s"] == pytest.approx(recs[0]["time_s"])
    assert s["steady_tokens_per_s"] == pytest.approx(5 * s["tokens_per_step"] / later)
    # Blocking checkpoints (--ckpt-every 2): each waited in full.
    saves = s["checkpoint_saves"]
    assert [c["step"] for c in saves] == [2, 4, 6] and s["async_ckpt"] is False
    assert all(c["blocking_s"] >= c["total_s"] > 0 for c in saves)
    assert s["checkpoint_save_s"] == pytest.approx(sum(c["blocking_s"] for c in saves))
    assert s["async_step_slowdown"] is None and not any("ckpt_writing" in r for r in recs)


def test_checkpoint_times_in_the_summary():
    class Saves:  # what ParallelStrategy.checkpoint_times returns: 2 saves of this call
        def checkpoint_times(self):
            return [
                {"step": 2, "blocking_s": 0.25, "total_s": 2.0},
                {"step": 4, "blocking_s": 1.5, "total_s": 1.5},
            ]

    # (step, seconds, overlapped a background write); step 1 pays the compiles.
    steps = [(1, 9.0, False), (2, 1.0, False), (3, 1.5, True), (4, 1.0, False), (5, 2.5, True)]
    records = [
        {"step": n, "time_s": t, **({"ckpt_writing": True} if w else {})} for n, t, w in steps
    ]
    out = loop_mod._checkpoint_times(TrainArgs(async_ckpt=True), Saves(), records, start=0)
    assert out["async_ckpt"] is True and out["checkpoint_saves"][1]["step"] == 4
    assert out["checkpoint_save_s"] == 1.75  # the loop's waits summed
    assert out["async_step_slowdown"] == 2.0  # steps 3, 5 (2.0 s) over steps 2, 4 (1.0 s)
    # A resumed call (from step 2): its first step (3) left out; 5 against 4.
    out = loop_mod._checkpoint_times(TrainArgs(), Saves(), records, start=2)
    assert out["async_step_slowdown"] == 2.5
    # No step overlapped a write (blocking saves), or none saved: no ratio.
    plain = [{k: v for k, v in r.items() if k != "ckpt_writing"} for r in records]
    assert loop_mod._checkpoint_times(TrainArgs(), Saves(), plain, 0)["async_step_slowdown"] is None


# --grad-accum-steps 2 --batch-size 2 against --batch-size 4: the same 4 sequences per step
# (micro-batch i = rows [2i, 2i+2) of the step's batch), every loss term a mean over them.
# The runs add the same products in another order (GEMMs over 2 rows instead of 4; the gradient
# as the sum of two halves, each scaled by 1/2, which is exact), so they differ by rounding only:
# - float64: observed over 4 steps losses 4e-16, grad norm 0 (an FP32 value: AdamW computes the
#   norm in FP32), weights 2e-14 absolute. Adam amplifies rounding in a gradient element near
#   zero (its update is ~lr * g / (|g| + eps) whatever g's size), which is why the weights drift
#   more than the losses. Tolerances 1e-12 (losses), 1e-6 (grad norm: one FP32 rounding of the
#   norm is 6e-8) and 1e-10 absolute on weights of ~0.1.
# - float32: the same mechanism at 6e-8 rounding: observed losses 2e-7, grad norm 1.3e-7,
#   weights 3.1e-5 per tensor (relative L2; single elements up to 5.6e-5 on ~0.1) after 4 steps.
#   Tolerances 1e-6, 1e-6 and 3e-4.
# A real error moves them far more: a missing 1/N doubles the grad norm, a bias update per
# micro-batch routes the second one differently (losses 1e-4 apart at step 2), wrong rows change
# the loss at step 1 by 1e-2.
ACCUM_TOL = {"float64": (1e-12, 1e-6, 1e-10), "float32": (1e-6, 1e-6, 3e-4)}


@pytest.mark.parametrize("dtype", list(ACCUM_TOL))
def test_grad_accum_equals_one_big_batch(tmp_path, dtype):
    import torch

    loss_tol, norm_tol, weight_tol = ACCUM_TOL[dtype]
    kw = dict(steps=4, eval_every=2, ckpt_every=0)
    param_dtype = getattr(torch, dtype)
    dt = dict(model_overrides=SMALL, param_dtype=param_dtype)
    big = train(_args(tmp_path / "big", batch_size=4, **kw), **dt)
    acc = train(_args(tmp_path / "acc", batch_size=2, grad_accum_steps=2, **kw), **dt)
    assert acc["tokens_per_step"] == big["tokens_per_step"] == 4 * 16
    ref, got = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("big", "acc"))
    for key in ("loss", "mtp_loss", "aux_loss", "val_loss", "grad_norm"):
        pairs = [(a[key], b[key]) for a, b in zip(ref, got, strict=True) if key in a]
        assert pairs and len(pairs) == sum(key in b for b in got), key
        tol = norm_tol if key == "grad_norm" else loss_tol
        worst = max(abs(a - b) / abs(a) for a, b in pairs)
        assert worst < tol, f"{dtype} {key}: {worst:.2e}"
    # The routers counted both micro-batches' tokens before the one bias update per step.
    assert [r["moe"] for r in got] == [r["moe"] for r in ref]
    w_ref, w_got = (read_checkpoint_state(tmp_path / d) for d in ("big", "acc"))
    assert w_ref.keys() == w_got.keys()
    for k, v in w_ref.items():
        if not (k.startswith("model.") and v.is_floating_point()):
            continue
        d = w_got[k].double() - v.double()
        err = (
            float(d.abs().max())
            if dtype == "float64"
            else float(d.norm() / v.double().norm().clamp_min(1e-30))
        )
        assert err < weight_tol, f"{dtype} {k}: {err:.2e}"
    assert big["losses"][-1] < big["losses"][0]


def test_grad_accum_resume_is_bitwise_exact(tmp_path):
    kw = dict(batch_size=2, grad_accum_steps=2, eval_every=3, ckpt_every=0)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(_args(straight, **kw), model_overrides=SMALL)  # bf16: FP32 gradient buffers
    assert train(_args(resumed, stop_after=3, **kw), model_overrides=SMALL)["step"] == 3
    s = train(_args(resumed, resume=True, **kw), model_overrides=SMALL)
    assert s["step"] == 6 and s["steps_run"] == 3
    assert _losses(straight) == _losses(resumed)  # exact floats
    assert_same_checkpoint(straight, resumed)
    # Part of the trajectory: another accumulation (another batch) is refused on resume.
    with pytest.raises(CheckpointError, match=r"train\.grad_accum_steps: checkpoint 2"):
        train(_args(resumed, resume=True, **{**kw, "grad_accum_steps": 4}), model_overrides=SMALL)
    # Left out of the trajectory while it is 1, so checkpoints written before it existed resume.
    assert "grad_accum_steps" not in TrainArgs().trajectory()
    assert TrainArgs(grad_accum_steps=3).trajectory()["grad_accum_steps"] == 3


def test_existing_run_folder_needs_resume_or_overwrite(tmp_path):
    run = tmp_path / "run"
    train(_args(run, steps=2, eval_every=0), model_overrides=SMALL)
    with pytest.raises(TrainConfigError, match="--resume"):
        train(_args(run, steps=2, eval_every=0), model_overrides=SMALL)
    s = train(_args(run, steps=2, eval_every=0, overwrite=True), model_overrides=SMALL)
    assert s["step"] == 2


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"steps": 0}, "--steps"),
        ({"batch_size": -1}, "--batch-size"),
        ({"lr": float("nan")}, "--lr"),
        ({"min_lr": 1.0}, "--min-lr"),
        ({"precision": "fp16"}, "--precision"),
        ({"device": "tpu"}, "--device"),
        ({"seed": 2**64}, "--seed must be < 2"),  # beyond torch.Generator.manual_seed
        ({"seq_len": 64}, "max_seq_len"),
        ({"preset": "huge"}, "unknown model preset"),
        ({"resume": True, "overwrite": True}, "exclude"),
        ({"precision": "fp8", "fp8_recipe": "bf16"}, "--fp8-recipe must be one of"),
        ({"fp8_recipe": "deepseek_pow2"}, "--fp8-recipe applies to --precision fp8 only"),
        ({"deterministic": 1}, "--deterministic must be a bool"),
        ({"grad_accum_steps": 0}, "--grad-accum-steps must be an integer > 0, got 0"),
        ({"grad_accum_steps": -2}, "--grad-accum-steps must be an integer > 0, got -2"),
        ({"grad_accum_steps": 2.0}, "--grad-accum-steps must be an integer > 0, got 2.0"),
        ({"grad_accum_steps": True}, "--grad-accum-steps must be an integer > 0, got True"),
        ({"grad_accum_steps": "2"}, "--grad-accum-steps must be an integer > 0, got '2'"),
        # The pipeline splits a step into --num-chunks micro-batches already.
        ({"grad_accum_steps": 2, "pp": 2, "mtp": False}, "--grad-accum-steps 2 cannot run with"),
        ({"config": 3}, "--config must be a JSON file's path or a dict"),
    ],
)
def test_bad_arguments(tmp_path, kw, match):
    with pytest.raises(TrainConfigError, match=match):
        train(_args(tmp_path / "run", **kw), model_overrides=SMALL)
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


def test_profile_step_writes_the_tables(tmp_path, monkeypatch):
    monkeypatch.setenv("PTXTRAIN_PROFILE_STEP", "2")
    train(_args(tmp_path / "run", steps=3, ckpt_every=0, eval_every=3))
    text = (tmp_path / "run" / "profile_step2_rank0.txt").read_text()
    assert "step 2, rank 0" in text and "--- by self_cpu_time_total" in text
    assert "aten::" in text  # the step's ops were recorded
    assert not (tmp_path / "run" / "profile_step1_rank0.txt").exists()
    monkeypatch.setenv("PTXTRAIN_PROFILE_STEP", "two")
    with pytest.raises(TrainConfigError, match="PTXTRAIN_PROFILE_STEP"):
        train(_args(tmp_path / "run2", steps=1))


def _write_json(path, obj_or_text):
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text)
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_config_file_fields_apply_over_the_preset_then_the_flags(tmp_path):
    import torch

    g = torch.Generator().manual_seed(7)
    width = 32 * int(torch.randint(1, 4, (1,), generator=g))  # 32, 64 or 96
    path = _write_json(tmp_path / "model.json", {**SMALL, "dim": width, "n_layers": 3})
    run = tmp_path / "run"
    kw = dict(config=path, steps=2, eval_every=0, ckpt_every=0)
    s = train(_args(run, n_layers=2, mtp=False, **kw))
    model = json.loads((run / "config.json").read_text())["model"]
    # the file over tiny (dim, experts, ...), then --n-layers and --no-mtp over the file
    assert (model["dim"], model["n_routed_experts"], model["n_layers"]) == (width, 4, 2)
    assert model["mtp_depth"] == 0 and model["vocab_size"] == 256  # tiny's, not in the file
    assert s["params"]["mtp_total"] == 0
    # The whole model config is in the checkpoint, so the model is checked on resume.
    from ptxtrain.train.checkpoint import read_checkpoint_meta

    assert read_checkpoint_meta(run)["config"]["model"] == model
    other = _write_json(tmp_path / "other.json", {**SMALL, "dim": width + 32, "n_layers": 3})
    with pytest.raises(CheckpointError, match=rf"model\.dim: checkpoint {width}, now {width + 32}"):
        train(_args(run, resume=True, n_layers=2, mtp=False, **{**kw, "config": other}))
    # A dict of fields (what `ptxtrain train --resume` passes) is the same model.
    s2 = train(_args(run, resume=True, n_layers=2, mtp=False, **{**kw, "config": model}))
    assert s2["step"] == 2


@pytest.mark.parametrize(
    ("content", "needles"),
    [
        ({"dims": 64}, ["unknown field 'dims'", "did you mean 'dim'?"]),
        ({"dim": "big"}, ["DeepSeekV3Config.dim must be an int, got 'big'"]),
        ({"n_layers": True}, ["DeepSeekV3Config.n_layers must be an int, got True"]),
        ({"dim": 64.0}, ["DeepSeekV3Config.dim must be an int"]),
        ({"route_scale": None}, ["DeepSeekV3Config.route_scale must be a float"]),
        ({"n_activated_experts": 9}, ["n_activated_experts", "must be <= n_routed_experts=8"]),
        ({"n_dense_layers": 5}, ["n_dense_layers must be in [0, n_layers=4]"]),
        ({"qk_rope_head_dim": 7}, ["qk_rope_head_dim must be even"]),
        ('{"dim": 64, "dim": 128}', ["field 'dim' is given more than once"]),
        ("[1, 2]", ["must hold one JSON object", "got a JSON array"]),
        ('"dim"', ["got a JSON string"]),
        ('{"dim": 64,}', ["is not valid JSON", "line 1"]),
        ("", ["is not valid JSON"]),
        (None, ["cannot read the file", "No such file"]),
    ],
)
def test_bad_config_file_is_refused_before_anything_is_built(
    tmp_path, monkeypatch, content, needles
):
    from ptxtrain import model as model_pkg

    def no_build(*a, **kw):
        raise AssertionError("a model was built")

    monkeypatch.setattr(model_pkg, "build_model", no_build)
    path = tmp_path / "cfg.json"
    if content is not None:
        _write_json(path, content)
    run = tmp_path / "run"
    with pytest.raises(TrainConfigError) as e:
        train(_args(run, config=str(path)))
    msg = str(e.value)
    assert msg.startswith(f"--config {path}"), msg  # names the file
    for needle in needles:
        assert needle in msg, (needle, msg)
    assert not run.exists()  # no run folder either


def test_vocab_below_the_byte_corpus_is_refused_before_anything_is_built(tmp_path):
    # The model checks token ids on a GPU only asynchronously: the byte corpus's ids (0-255) must
    # fit the vocabulary, checked with the config.
    path = tmp_path / "small_vocab.json"
    path.write_text(json.dumps({"vocab_size": 200}))
    args = TrainArgs(config=str(path), out=str(tmp_path / "run"), progress=False)
    with pytest.raises(TrainConfigError, match="vocab_size 200 is below the 256 byte tokens"):
        train(args)
    assert not (tmp_path / "run").exists()
