"""The cp.async-pipelined 128x1 / both quantizers (``cast_async.cuh``) per (stages, CTAs per SM)
against the one-tile-at-a-time ``cast_fp8`` kernel, in one process, on a GPU machine.

    python3 -m benchmarks.sweep_quant_async [--json OUT]

For each shape and op: µs and the fraction of a BF16 copy's bandwidth (timed in the same
process, as ``ptxtrain bench quant``), for ``classic`` (PTXTRAIN_QUANT_ASYNC=0) and each
configuration of ``ptxtrain.quant.cuda.ASYNC_CONFIGS``; every output is checked bitwise against
the classic kernel's.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from ptxtrain.bench.quant import _bytes
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.quant import cuda as cq
from ptxtrain.testing import assert_bitwise_equal

SHAPES = ((4096, 7168), (8192, 7168), (16384, 4096), (4096, 32768), (4096, 2112))
OPS = {"per_token_t": "per_token_cast_to_fp8_t", "both": "per_token_cast_to_fp8_both"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    timer = GpuTimer(repeats=30)
    rows = []
    for m, k in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy_us = timer(lambda x=x, y=y: y.copy_(x))
        copy_gbs = 4 * m * k / (copy_us * 1e-6) / 1e9
        for op, fname in OPS.items():
            fn = getattr(cq, fname)
            nbytes = _bytes(op, m, k)
            os.environ[cq.ASYNC_ENV] = "0"
            want = fn(x)
            row = {"m": m, "k": k, "op": op, "copy_gbs": copy_gbs, "us": {}, "frac": {}}
            row["us"]["classic"] = timer(lambda fn=fn, x=x: fn(x))
            os.environ[cq.ASYNC_ENV] = "1"
            for config in cq.ASYNC_CONFIGS:
                cq.ASYNC_CONFIG = config
                got = fn(x)
                for g, w in zip(got, want):
                    assert_bitwise_equal(g, w, f"{op} {config}")
                row["us"][str(config)] = timer(lambda fn=fn, x=x: fn(x))
            for name, us in row["us"].items():
                row["frac"][name] = nbytes / (us * 1e-6) / 1e9 / copy_gbs
            rows.append(row)
            cells = " ".join(f"{n} {row['frac'][n]:.2f}" for n in row["us"])
            print(f"{m:>6} {k:>6} {op:>12}  copy {copy_gbs:5.0f} GB/s  /copy: {cells}", flush=True)
        del x, y
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sweep_quant_async", "env": environment(), "rows": rows}, f)


if __name__ == "__main__":
    main()
