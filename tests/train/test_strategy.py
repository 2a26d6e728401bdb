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


def test_every_rank_prewarms_its_own_micro_batch(monkeypatch):
    # FP8 on a GPU: every rank (not only a single process) prewarms the module it runs, for the
    # rows of its micro-batch, as local rank LOCAL_RANK of LOCAL_WORLD_SIZE processes sharing the
    # node's JIT cache. No GPU is touched: prewarm itself is a stand-in.
    from types import SimpleNamespace

    from ptxtrain.nn import prewarm

    calls = []
    monkeypatch.setattr(prewarm, "prewarm", lambda *a, **kw: calls.append((a, kw)) or "warm")
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    module = torch.nn.Linear(2, 2)
    for (pp, ep, batch, chunks), tokens in (
        ((1, 1, 16, None), 16 * 128),  # one process: the micro-batch
        ((1, 4, 16, None), 4 * 128),  # --ep 4: a quarter of the sequences
        ((2, 1, 16, 8), 2 * 128),  # --pp 2: one of 8 pipeline micro-batches
        ((2, 2, 32, 4), 4 * 128),  # --pp 2 --ep 2: 32 / 2 / 4 sequences
    ):
        strategy = ParallelStrategy.__new__(ParallelStrategy)
        strategy.args = TrainArgs(precision="fp8", pp=pp, ep=ep, batch_size=batch, seq_len=128,
                                  num_chunks=chunks)  # fmt: skip
        strategy.pipeline, strategy.ep = pp > 1, ep
        strategy.device = torch.device("cuda", 0)
        assert strategy.micro_batch_tokens() == tokens
        strategy._prewarm(module)
        assert calls.pop() == ((module, tokens, strategy.device), {"rank": 2, "ranks": 4})
        assert strategy.warm == "warm"
    # BF16, or FP8 on the CPU: nothing to compile.
    for precision, device in (("bf16", "cuda"), ("fp8", "cpu")):
        strategy.args = SimpleNamespace(precision=precision)
        strategy.device = torch.device(device)
        strategy._prewarm(module)
    assert calls == []
