"""``ptxtrain bench dispatch``: its byte accounting, table and command line (the timing itself
needs GPUs and torchrun: ``torchrun --nproc-per-node 2 -m ptxtrain bench dispatch``)."""

from __future__ import annotations

import random

import pytest

from ptxtrain.bench.dispatch import format_table, logical_bytes
from ptxtrain.cli import build_parser, main


def test_logical_bytes_match_deepep_accounting():
    rng = random.Random(0)
    for _ in range(20):
        n, h = rng.randrange(0, 5000), 128 * rng.randrange(1, 64)
        # FP8 dispatch moves one byte per element plus one fp32 scale per 128 elements.
        fp8 = n * h + 4 * n * (h // 128)
        assert logical_bytes("dispatch", n, h) == pytest.approx(fp8, rel=1e-12)  # float factor
        assert logical_bytes("dispatch_payload", n, h) == pytest.approx(fp8, rel=1e-12)
        assert logical_bytes("combine", n, h) == 2 * n * h  # bf16
        assert logical_bytes("dispatch", n, h, fp8=False) == 2 * n * h
    with pytest.raises(ValueError, match="op"):
        logical_bytes("all_gather", 1, 128)


def test_format_table_lists_every_backend_and_op():
    rng = random.Random(1)
    rows = []
    for backend, sms in (("all_to_all", None), ("nvlink", 24)):
        for op in ("dispatch", "dispatch_payload", "combine"):
            gbs = [rng.uniform(10, 400) for _ in range(2)]
            us = [rng.uniform(50, 900) for _ in range(2)]
            rows.append(
                dict(backend=backend, op=op, num_sms=sms, us=us, gbs=gbs, recv_tokens=[5, 7],
                     us_max=max(us), gbs_mean=sum(gbs) / 2)
            )  # fmt: skip
    settings = dict(world_size=2, tokens_per_rank=4096, hidden=7168, experts=256, topk=8)
    text = format_table({"settings": settings, "rows": rows, "skipped": {"x": "why"}})
    lines = text.splitlines()
    assert "EP2" in lines[0] and "top-8" in lines[0]
    for r in rows:
        line = next(
            ln for ln in lines if ln.split()[:2] == [r["backend"], r["op"]]
        )  # one line per (backend, op)
        assert f"{r['us_max']:.1f}" in line and f"{r['gbs_mean']:.1f}" in line
        assert f"{min(r['gbs']):.1f}" in line and f"{max(r['gbs']):.1f}" in line
    assert lines[-1] == "x: skipped (why)"


def test_cli_dispatch_arguments(capsys):
    ns = build_parser().parse_args(
        ["bench", "dispatch", "--tokens", "128", "--hidden", "256", "--experts", "16",
         "--topk", "4", "--num-sms", "8", "--repeats", "3"]
    )  # fmt: skip
    assert (ns.what, ns.tokens, ns.hidden, ns.experts, ns.topk, ns.num_sms, ns.repeats) == (
        "dispatch", 128, 256, 16, 4, 8, 3
    )  # fmt: skip
    ns = build_parser().parse_args(["bench", "dispatch"])  # DeepEP's setting by default
    assert (ns.tokens, ns.hidden, ns.experts, ns.topk, ns.num_sms) == (4096, 7168, 256, 8, 24)
    assert main(["bench", "dispatch", "--num-sms", "0"]) == 2
    assert "--num-sms: must be >= 1" in capsys.readouterr().err


def _profile_worker(rank: int, world: int, out: str) -> None:
    import json

    import torch

    from ptxtrain.bench.dispatch import profile_buffer
    from ptxtrain.ep.buffer import Buffer
    from ptxtrain.quant.ref import per_token_cast_to_fp8

    g = torch.Generator().manual_seed(rank)
    topk_idx = torch.rand(64, 16, generator=g).topk(4, dim=1).indices
    inputs = dict(
        x_fp8=per_token_cast_to_fp8(torch.randn(64, 256, generator=g)),
        topk_idx=topk_idx,
        topk_w=torch.rand(64, 4, generator=g),
        experts=16,
        hidden=256,
    )
    tables = profile_buffer(Buffer(backend="all_to_all"), inputs, calls=2, rows=10)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(tables, f)


def test_profile_buffer_on_gloo(tmp_path):
    """--profile's tables (CPU gloo: host tables only; a collective on every rank)."""
    import json

    from tests._spawn import run_gloo

    run_gloo(_profile_worker, 2, str(tmp_path), hard_exit=True)  # (torch teardown abort)
    for r in range(2):
        tables = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert set(tables) == {
            "dispatch_by_host", "dispatch_by_device", "combine_by_host", "combine_by_device"
        }  # fmt: skip
        # The payload's autograd Function and the count exchange show up among the host ops.
        assert "_DispatchFn" in tables["dispatch_by_host"]
        assert "alltoall" in tables["dispatch_by_host"]
        assert "Self CPU" in tables["combine_by_host"]
        assert tables["dispatch_by_device"] == tables["combine_by_device"] == ""  # no CUDA


def test_cli_dispatch_profile_flag():
    assert build_parser().parse_args(["bench", "dispatch", "--profile"]).profile is True
    assert build_parser().parse_args(["bench", "dispatch"]).profile is False
