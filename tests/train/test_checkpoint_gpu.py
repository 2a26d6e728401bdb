"""Sharded checkpoints of CUDA tensors (skipped without a GPU).

- One GPU: the fused AdamW keeps its state in flat CUDA buffers (views); a blocking save (DCP's
  writer threads copy the tensors to the host) and an asynchronous one (pinned staging buffers,
  background write while the next step runs) both read back bit for bit into a fresh model.
- Two GPUs (``multigpu``): ``--ep 2 --async-ckpt`` under torchrun's environment (NCCL for the
  step, the checkpoints' own gloo group for the background write), resumed in one process.

Run: ``python -m pytest -q tests/train/test_checkpoint_gpu.py`` on a machine with 2+ GPUs.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from ptxtrain.optim import AdamW
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.train import Checkpointer, TrainArgs, load_checkpoint, read_checkpoint_meta, train
from ptxtrain.train.state_layout import StateLayout
from tests._spawn import run_torchrun_like
from tests.train.test_checkpoint import _Net


def _cuda_steps(net, opt, n: int, seed: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(seed)
    for _ in range(n):
        x = torch.randn(5, 12, device="cuda", dtype=torch.bfloat16, generator=g)
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _cuda_net(seed: int):
    torch.manual_seed(seed)
    net = _Net().to(device="cuda", dtype=torch.bfloat16)
    return net, AdamW(net.parameters(), lr=1e-2)  # fused on CUDA (flat buffers) with Triton


def _state(net, opt) -> list[torch.Tensor]:
    sd = opt.state_dict()["state"]
    return [t.detach().clone() for t in net.state_dict().values()] + [
        sd[i][k].detach().clone() for i in sorted(sd) for k in sorted(sd[i])
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("async_save", [False, True])
def test_cuda_state_round_trip(tmp_path, async_save):
    net, opt = _cuda_net(0)
    _cuda_steps(net, opt, 2, seed=1)
    want = _state(net, opt)
    saver = Checkpointer(StateLayout(net, opt), async_save=async_save)
    saver.save(tmp_path, step=2, config={})
    _cuda_steps(net, opt, 1, seed=2)  # the next step, while an async write may still run
    saver.wait()
    net2, opt2 = _cuda_net(3)
    _cuda_steps(net2, opt2, 1, seed=4)  # state of its own, to be replaced
    load_checkpoint(tmp_path, model=net2, optimizer=opt2)
    got = _state(net2, opt2)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(g.cpu(), w.cpu(), name=f"entry {i}")


def _ep_worker(rank: int, world: int, root: str) -> None:
    args = TrainArgs(
        steps=4, batch_size=4, seq_len=32, eval_every=0, ckpt_every=1, sample_tokens=0,
        progress=False, out=f"{root}/run", device="cuda", ep=world, async_ckpt=True,
        stop_after=2,
    )  # fmt: skip
    s = train(args)
    if rank == 0:
        with open(f"{root}/ep.json", "w", encoding="utf-8") as f:
            json.dump(s, f)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_ep2_async_checkpoint_on_gpus_resumes_in_one_process(tmp_path):
    run_torchrun_like(_ep_worker, 2, str(tmp_path), timeout=300.0)
    ep = json.loads((tmp_path / "ep.json").read_text())
    assert ep["async_ckpt"] and [s["step"] for s in ep["checkpoint_saves"]] == [1, 2]
    assert all(s["total_s"] is not None for s in ep["checkpoint_saves"])
    assert read_checkpoint_meta(tmp_path / "run")["ranks"] == 2
    args = TrainArgs(
        steps=4, batch_size=4, seq_len=32, eval_every=0, ckpt_every=1, sample_tokens=0,
        progress=False, out=str(tmp_path / "run"), device="cuda", resume=True,
    )  # fmt: skip
    s = train(args)
    assert s["step"] == 4 and s["steps_run"] == 2
    assert len(s["losses"]) == 4 and all(math.isfinite(v) for v in s["losses"])
    assert s["losses"][:2] == ep["losses"]  # steps 1-2 recorded by the --ep 2 run
