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
