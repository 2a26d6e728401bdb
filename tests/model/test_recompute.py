"""--recompute (ptxtrain.nn.recompute): the same losses, gradients and router counts as keeping
every activation, with the recomputed forward told apart; on a GPU, less memory."""

from __future__ import annotations

import copy

import pytest
import torch

from ptxtrain.model import build_model, get_preset
from ptxtrain.model.deepseek import convert_model_to_fp8_training
from ptxtrain.nn import Fp8LinearConfig
from ptxtrain.nn.recompute import recompute, recomputing
from ptxtrain.optim import AdamW
from ptxtrain.train import TrainArgs, train

MODES = ("none", "selective", "full")


def _batch(seed, b=2, t=64):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g), torch.randint(0, 256, (b, t), generator=g)


def _run(model, mode, fused=False):
    """Loss, every gradient (AdamW's FP32 buffers with ``fused``) and the routers' counts of one
    forward + backward under ``mode``."""
    model = copy.deepcopy(model)
    model.set_recompute(mode)
    opt = AdamW(model.parameters(), fused=True) if fused else None
    out = model(*_batch(1))
    out.loss.backward()
    grads = {
        n: (opt.grad_for(p) if opt is not None else p.grad).clone()
        for n, p in model.named_parameters()
    }
    return out.loss.detach(), grads, [r.expert_counts.clone() for r in model.routers()]


# fp8 runs the fused AdamW and the Triton kernels in the CPU interpreter: about 30 s.
@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp8", marks=pytest.mark.slow)])
def test_recompute_modes_give_the_same_bits(precision):
    # CPU kernels are deterministic, so a recomputed forward reproduces the kept values exactly;
    # FP8 uses the reference GEMMs and, with the fused AdamW, writes wgrad into main_grad.
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    model = build_model(get_preset("tiny"), dtype=dtype, device="cpu", seed=0).train()
    if precision == "fp8":
        convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name("deepseek"))
    results = {mode: _run(model, mode, fused=precision == "fp8") for mode in MODES}
    loss, grads, counts = results["none"]
    assert all(c.sum() > 0 for c in counts)
    for mode in ("selective", "full"):
        got_loss, got_grads, got_counts = results[mode]
        assert torch.equal(got_loss, loss), mode
        assert got_grads.keys() == grads.keys()
        for name, g in grads.items():
            assert torch.equal(got_grads[name], g), f"{mode}: {name}"
        # counted once per forward, not again in the backward's re-run
        assert all(torch.equal(a, b) for a, b in zip(got_counts, counts, strict=True)), mode


def test_recomputing_is_true_only_in_the_rerun():
    seen = []

    def fn(x):
        seen.append(recomputing())
        return x.sin()  # keeps x for its backward: checkpoint re-runs fn to get it back

    x = torch.randn(4, requires_grad=True)
    recompute(fn, x).sum().backward()
    assert seen == [False, True] and not recomputing()
    with torch.no_grad():
        recompute(fn, x)
    assert seen == [False, True, False]  # no grad: a plain call, nothing to recompute
    recompute(fn, x, enabled=False).sum().backward()
    assert seen[-1] is False and len(seen) == 4


def test_train_recompute_same_losses_and_bad_input(tmp_path):
    losses = {}
    for mode in ("none", "selective"):
        args = TrainArgs(
            preset="tiny", steps=3, batch_size=2, seq_len=32, sample_tokens=0, recompute=mode,
            out=str(tmp_path / mode), progress=False, checkpoint=False,
        )  # fmt: skip
        losses[mode] = train(args)["losses"]
    assert losses["selective"] == losses["none"]
    with pytest.raises(ValueError, match="--recompute must be one of"):
        TrainArgs(recompute="some").validate()
    model = build_model(get_preset("tiny"), device="cpu", seed=0)
    with pytest.raises(ValueError, match="recompute must be one of"):
        model.set_recompute("all")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_recompute_saves_memory_same_losses(precision):
    from ptxtrain.train.loop import deterministic_mode

    peaks, losses = {}, {}
    with deterministic_mode(True):
        base = build_model(get_preset("small"), dtype=torch.bfloat16, device="cuda", seed=0)
        if precision == "fp8":
            convert_model_to_fp8_training(base, Fp8LinearConfig.from_recipe_name("deepseek"))
        x, y = (t.cuda() for t in _batch(2, b=8, t=1024))
        for mode in MODES:
            model = copy.deepcopy(base).train()
            model.set_recompute(mode)
            model(x, y).loss.backward()  # compiles, caches
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            out = model(x, y)
            out.loss.backward()
            torch.cuda.synchronize()
            peaks[mode] = torch.cuda.max_memory_allocated() - before
            losses[mode] = out.loss.item()
            del model, out
            torch.cuda.empty_cache()
    assert losses["selective"] == losses["none"] == losses["full"]
    assert peaks["full"] < peaks["selective"] < peaks["none"], peaks
