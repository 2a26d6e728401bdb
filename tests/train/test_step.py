"""ptxtrain.train.step: the single-device step, eager and as a replayed CUDA graph.

CPU: the eager path is what ``ptxtrain train`` runs everywhere else (tests/train/test_loop.py);
here its arguments and the logging that reads the device values in one go. GPU (marked): no host
synchronization inside a whole step of the ``small`` and ``medium`` models, and the captured step
giving the eager step's losses and weights bit for bit under ``--deterministic``.
"""

from __future__ import annotations

import pytest
import torch

from ptxtrain.model import build_model, get_preset
from ptxtrain.model.deepseek import convert_model_to_fp8_training
from ptxtrain.nn import Fp8LinearConfig
from ptxtrain.optim import AdamW
from ptxtrain.train import TrainArgs, train
from ptxtrain.train.loop import deterministic_mode
from ptxtrain.train.step import SingleDeviceStep, graphs_supported


def _model_and_opt(preset, precision, device, **overrides):
    import dataclasses

    cfg = dataclasses.replace(get_preset(preset), **overrides)
    model = build_model(cfg, dtype=torch.bfloat16, device=device, seed=0)
    if precision == "fp8":
        convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name("deepseek"))
    model.train()
    return cfg, model, AdamW(model.parameters(), lr=1e-3)


def _batch(cfg, rows, seq, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=g)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def test_step_arguments_and_cpu_fallback():
    cfg, model, opt = _model_and_opt("tiny", "bf16", "cpu")
    with pytest.raises(ValueError, match="grad_accum_steps must be >= 1"):
        SingleDeviceStep(model, opt, grad_accum_steps=0, grad_clip=1.0, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        SingleDeviceStep(
            model, opt, grad_accum_steps=1, grad_clip=1.0, device=torch.device("cpu"), warmup=0
        )
    assert "cpu" in graphs_supported(opt, torch.device("cpu"))
    step = SingleDeviceStep(
        model, opt, grad_accum_steps=2, grad_clip=1.0, device=torch.device("cpu")
    )
    assert step.mode == "eager" and step.graphs_off_reason is not None
    x, y = _batch(cfg, 4, 32, seed=1)
    out = step(x, y, 1e-3)
    assert set(out) >= {"lm_loss", "mtp_loss", "grad_norm", "moe_counts", "bias_abs_max"}
    assert out["moe_counts"].shape == (len(model.routers()), cfg.n_routed_experts)
    # every token-slot of the step's 2 micro-batches is counted once per MoE layer; the MTP
    # block's layer (the last router) sees T - 1 positions per sequence
    k = cfg.n_activated_experts
    assert out["moe_counts"].sum(1).tolist() == [4 * 32 * k] * (len(model.routers()) - 1) + [
        4 * 31 * k
    ]
    assert step.state_bytes is not None and step.state_bytes["total"] > 0


def test_log_every_reads_back_in_windows_with_every_record(tmp_path):
    # --log-every 3: records for every step, values equal to --log-every 1's (same run).
    runs = {}
    for every in (1, 3):
        args = TrainArgs(
            preset="tiny", steps=7, batch_size=2, seq_len=32, eval_every=4, sample_tokens=0,
            log_every=every, out=str(tmp_path / f"every{every}"), progress=False,
        )  # fmt: skip
        runs[every] = train(args)
    assert runs[1]["losses"] == runs[3]["losses"] and len(runs[3]["losses"]) == 7
    from ptxtrain.train import read_metrics

    a = read_metrics(tmp_path / "every1" / "metrics.jsonl")
    b = read_metrics(tmp_path / "every3" / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 8))
    for ra, rb in zip(a, b, strict=True):
        assert ra["grad_norm"] == rb["grad_norm"] and ra["moe"] == rb["moe"]
        assert ra.get("val_loss") == rb.get("val_loss")
    assert [r["step"] for r in b if "val_loss" in r] == [4, 7]
    with pytest.raises(ValueError, match="--log-every must be an integer > 0"):
        TrainArgs(log_every=0).validate()


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

# (preset, rows, seq, overrides): the small preset at the CLI's default batch, and medium with
# one 2048-token sequence (its weights and optimizer state alone are ~59 GB).
SYNC_CASES = [("small", 16, 128, {}), ("medium", 1, 2048, {"mtp_depth": 0})]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("preset,rows,seq,overrides", SYNC_CASES)
def test_gpu_step_has_no_host_sync(preset, rows, seq, overrides, precision):
    dev = torch.device("cuda")
    cfg, model, opt = _model_and_opt(preset, precision, dev, **overrides)
    step = SingleDeviceStep(
        model, opt, grad_accum_steps=2, grad_clip=1.0, device=dev, cuda_graphs=False
    )
    for i in range(2):  # compiles, lazy state
        step(*_batch(cfg, 2 * rows, seq, seed=i), 1e-4)
    x, y = _batch(cfg, 2 * rows, seq, seed=9)
    x, y = x.pin_memory(), y.pin_memory()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step(x, y, 1e-4)  # forward + backward x2, clip, AdamW, router bias update
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(out["lm_loss"]).item()
    del model, opt, step
    torch.cuda.empty_cache()


def _train_losses(tmp_path, name, precision, graphs, **kw):
    args = TrainArgs(
        preset="small", precision=precision, steps=6, batch_size=4, seq_len=256,
        grad_accum_steps=2, eval_every=3, sample_tokens=0, log_every=1, deterministic=True,
        cuda_graphs=graphs, out=str(tmp_path / name), progress=False, **kw,
    )  # fmt: skip
    summary = train(args)
    from ptxtrain.train import read_metrics

    recs = read_metrics(tmp_path / name / "metrics.jsonl")
    return summary, [(r["loss"], r["grad_norm"], r.get("val_loss")) for r in recs]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_graph_equals_eager_bitwise(tmp_path, precision):
    eager, eager_recs = _train_losses(tmp_path, f"eager-{precision}", precision, False)
    graph, graph_recs = _train_losses(tmp_path, f"graph-{precision}", precision, True)
    assert graph_recs == eager_recs  # losses, gradient norms, validation (eval between replays)
    assert graph["samples"] == eager["samples"]


@pytest.mark.gpu
def test_gpu_capture_failure_falls_back_to_eager(tmp_path, monkeypatch):
    # A forward that synchronizes cannot be captured: the step says why once and runs eagerly,
    # with the eager run's results.
    from ptxtrain.model.deepseek import DeepSeekV3

    lines = []
    forward = DeepSeekV3.forward

    def syncing_forward(self, *a, **k):
        out = forward(self, *a, **k)
        float(out.loss)  # a host read: illegal while capturing
        return out

    with deterministic_mode(True):
        dev = torch.device("cuda")
        results = []
        for graphs in (False, True):
            cfg, model, opt = _model_and_opt("small", "bf16", dev, mtp_depth=0)
            monkeypatch.setattr(DeepSeekV3, "forward", syncing_forward)
            step = SingleDeviceStep(
                model, opt, grad_accum_steps=1, grad_clip=1.0, device=dev, cuda_graphs=graphs,
                log=lines.append,
            )  # fmt: skip
            losses = [float(step(*_batch(cfg, 4, 128, seed=i), 1e-3)["lm_loss"]) for i in range(5)]
            results.append((losses, step.mode))
            monkeypatch.setattr(DeepSeekV3, "forward", forward)
    assert results[1] == (results[0][0], "eager")
    assert len(lines) == 1 and "capture failed" in lines[0]
    torch.randn(4, device="cuda")  # random ops work again after the failed capture


def test_no_checkpoint_writes_none(tmp_path):
    args = TrainArgs(
        preset="tiny", steps=2, batch_size=2, seq_len=32, sample_tokens=0, ckpt_every=1,
        checkpoint=False, out=str(tmp_path / "run"), progress=False,
    )  # fmt: skip
    train(args)
    assert not (tmp_path / "run" / "checkpoint").exists()
    assert (tmp_path / "run" / "summary.json").exists()
    with pytest.raises(ValueError, match="--checkpoint must be a bool"):
        TrainArgs(checkpoint="no").validate()
