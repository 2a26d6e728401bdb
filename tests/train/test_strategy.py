"""ptxtrain.train.strategy: the single-process strategy, and the loop that does not branch on the
parallelism (the multi-process strategies run in tests/train/test_ep_train.py and
tests/parallel/test_pp_*.py against single-process runs)."""

from __future__ import annotations

import inspect
import re

import torch

from ptxtrain.train import loop as loop_mod
from ptxtrain.train.loop import TrainArgs, model_config
from ptxtrain.train.strategy import ParallelStrategy
from tests.train.test_loop import SMALL


def _strategy(tmp_path, **kw) -> tuple[ParallelStrategy, object]:
    base = dict(batch_size=2, seq_len=16, out=str(tmp_path), device="cpu", progress=False)
    args = TrainArgs(**{**base, **kw})
    args.validate()
    config = model_config(args, SMALL)
    return ParallelStrategy(args, config, torch.float64), config


def test_single_process_strategy_builds_and_steps_the_whole_model(tmp_path):
    strategy, config = _strategy(tmp_path, grad_accum_steps=2, sample_tokens=4)
    assert strategy.is_lead and strategy.rank == 0 and strategy.world_size == 1
    assert strategy.device == torch.device("cpu") and not strategy.active
    assert strategy.describe() is None and strategy.note() == ""
    assert strategy.on_every_rank(lambda: 7) == 7 and strategy.agree_to_stop(True)
    model, optimizer = strategy.build(config)
    # The optimizer holds every trainable parameter, once.
    held = [p for g in optimizer.param_groups for p in g["params"]]
    want = [p for p in model.parameters() if p.requires_grad]
    assert len(held) == len(want) and {id(p) for p in held} == {id(p) for p in want}
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (4, 16), generator=g)
    y = torch.randint(0, 256, (4, 16), generator=g)
    before = [p.detach().clone() for p in want]
    values = strategy.step(x, y, 1e-3)
    assert {"lm_loss", "grad_norm", "moe_counts"} <= set(values)
    # A random batch's byte-level loss is near ln(256) = 5.55 at init (a loose range: the
    # initial logits are not exactly uniform); the step moved every parameter with a gradient.
    assert 4.0 < float(values["lm_loss"]) < 7.0 and float(values["grad_norm"]) > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, want, strict=True))
    assert strategy.state_bytes is not None and strategy.state_bytes["numel"] > 0
    samples, peaks = strategy.finish()
    assert len(samples) == 3 and all(isinstance(t, str) and t for t in samples)
    assert peaks == [None]  # one process on CPU: no CUDA peak


def test_train_loop_does_not_branch_on_pp_or_ep():
    # The strategy owns every difference between single / EP / PP / PP x EP runs.
    src = inspect.getsource(loop_mod._train)
    assert not re.search(r"\b(if|elif|while)\b[^\n]*\bargs\.(pp|ep)\b", src)
    assert not re.search(r"\b(runner|ep_group|pp_group)\b", src)
