"""Repeatability of the PTX GEMM under a compile-time switch: runs one config many times on the
same operands and counts the runs (and elements) that differ bitwise from the first.

    python3 -m benchmarks.diag_race --shape 4096 2112 7168 --config 128x128s5c1d --runs 30 \
        --direct --defines "" "#define PTXTRAIN_GEMM_CHUNK 16" [--json OUT.json]

The double-accumulator kernels are deterministic by construction (fixed order of FP32 additions),
so any difference is a race. (Session 12 found one this way: without a fence before a stage's
release, 3 of 40 direct-store runs at 4096 x 2112 x 7168 differed; the A/B switch that removed
the fence is gone.)
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from benchmarks.profile_gemm import parse_config
from ptxtrain.bench.timing import environment
from ptxtrain.gemm import ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", type=int, nargs=3, default=[4096, 2112, 7168])
    p.add_argument("--config", default="128x128s5c1d")
    p.add_argument("--direct", action="store_true", help="direct stores instead of TMA stores")
    p.add_argument("--out-dtype", choices=["bf16", "fp32"], default="fp32")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--defines", nargs="+", default=[""])
    p.add_argument("--json")
    args = p.parse_args()
    m, n, k = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    cfg = parse_config(args.config)
    if args.direct:
        cfg = dataclasses.replace(cfg, tma_store=False)
    dtype = torch.float32 if args.out_dtype == "fp32" else torch.bfloat16
    rows = []
    for defines in args.defines:
        ptx.set_source_defines(defines.replace("\\n", "\n") + ("\n" if defines else ""))
        try:
            first = ptx.run_with_config("1d2d", qa, qb, cfg, dtype)
            bad_runs, bad_elems = 0, 0
            for _ in range(args.runs):
                again = ptx.run_with_config("1d2d", qa, qb, cfg, dtype)
                diff = int((again != first).sum())
                bad_runs += diff > 0
                bad_elems += diff
            torch.cuda.synchronize()
        finally:
            ptx.set_source_defines("")
        rows.append(dict(defines=defines, runs=args.runs, runs_differing=bad_runs,
                         elements_differing=bad_elems))  # fmt: skip
        print(f"{defines or '(default)'}: {bad_runs} of {args.runs} runs differ "
              f"({bad_elems} elements)", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "bench": "diag_race", "shape": [m, n, k],
                       "config": str(cfg), "rows": rows}, f)  # fmt: skip


if __name__ == "__main__":
    main()
