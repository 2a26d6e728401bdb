"""Sweep the Triton quantizers' tile configs on a GPU: GB/s and fraction of copy bandwidth.

    python3 -m benchmarks.sweep_quant [--json OUT.json]

Each config's output is checked bit-exact against the default config's before it is timed. The
result picks the defaults of ``ptxtrain.quant.triton._config_1x`` (rules quoted there).
"""

from __future__ import annotations

import argparse
import json

import torch

from ptxtrain.bench.quant import _bytes
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.quant import triton as tq
from ptxtrain.testing import assert_bitwise_equal

C = tq._Config
ROW = [C(16, 128, 128, 4), C(32, 128, 128, 4), C(64, 128, 128, 4), C(64, 128, 128, 8),
       C(128, 128, 128, 8), C(32, 128, 128, 2)]  # fmt: skip
COL = [C(128, 64, 64, 4), C(128, 64, 64, 8), C(128, 32, 32, 4), C(128, 128, 128, 8),
       C(128, 128, 64, 8), C(128, 64, 32, 4)]  # fmt: skip
BOTH = [C(128, 128, 64, 4), C(128, 128, 128, 8), C(128, 128, 64, 8), C(128, 128, 32, 8),
        C(128, 128, 128, 16)]  # fmt: skip


def _label(cfg) -> str:
    return f"bm{cfg.block_m}/bk{cfg.block_k}/sk{cfg.sub_k}/w{cfg.num_warps}"


def _sweep_shape(m: int, k: int, timer: GpuTimer, rows: list) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_gbs = 4 * m * k / (timer(lambda: y.copy_(x)) * 1e-6) / 1e9

    def record(op, label, fn, want, nbytes):
        got = fn()
        for g, w in zip(got, want):
            assert_bitwise_equal(g, w, f"{op} {label}")
        us = timer(fn)
        gbs = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(m=m, k=k, op=op, config=label, us=us, gbs=gbs, frac=gbs / copy_gbs))
        print(
            f"{m:>6} {k:>6} {op:>14} {label:<36} {us:8.1f} µs {gbs:6.0f} GB/s "
            f"{gbs / copy_gbs:5.2f} of copy ({copy_gbs:.0f})",
            flush=True,
        )

    def q1x(cfg, row, col):
        return lambda: tq._quant_1x(x, 128, False, "row", row=row, col=col, config=cfg)

    ops = (("per_token", ROW, True, False), ("per_token_t", COL, False, True),
           ("both", BOTH, True, True))  # fmt: skip
    for op, cfgs, row, col in ops:
        want = q1x(None, row, col)()
        for cfg in cfgs:
            record(op, _label(cfg), q1x(cfg, row, col), want, _bytes(op, m, k))
    want = tq.per_token_cast_to_fp8_both(x)
    for rc in ROW[1:3]:
        for cc in COL[:3:2]:
            row_fn, col_fn = q1x(rc, True, False), q1x(cc, False, True)
            label = f"{_label(rc)}+{_label(cc)}"
            record("both_split", label, lambda r=row_fn, c=col_fn: (*r(), *c()), want,
                   _bytes("both", m, k))  # fmt: skip
    for op, trans in (("per_block", False), ("per_block_both", True)):
        want = tq._quant_block(x, 128, False, transposed=trans)
        for warps in (8, 16):

            def fn(w=warps, t=trans):
                return tq._quant_block(x, 128, False, transposed=t, num_warps=w)

            record(op, f"num_warps={warps}", fn, want, _bytes(op, m, k))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    timer = GpuTimer(repeats=30)
    rows: list = []
    for m, k in ((4096, 7168), (8192, 7168), (4096, 2112)):
        _sweep_shape(m, k, timer, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sweep_quant", "env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
