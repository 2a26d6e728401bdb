"""Host (CPU) time of one Gluon-routed GEMM call of the Triton backend, and a cProfile of it.

    python3 -m benchmarks.diag_gluon_host [--json OUT.json]

For 1D2D (4096 x 4096 x 7168) and 1D1D (7168 x 4096 x 4096, the wgrad shape), the median host
µs of ``ptxtrain.gemm.triton.fp8_gemm_nt`` / ``fp8_gemm_nt_1d1d`` with the device idle before
each call, then the top functions of a cProfile of 200 calls by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

import torch

from ptxtrain.bench.gemm import random_problem
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import triton as tg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    args = p.parse_args()
    rows = []
    for kind, (m, n, k) in (("1d2d", (4096, 4096, 7168)), ("1d1d", (7168, 4096, 4096))):
        _, qa, qb = random_problem(m, n, k, kind)
        fn = tg.fp8_gemm_nt if kind == "1d2d" else tg.fp8_gemm_nt_1d1d
        out = torch.empty(
            m, n, device="cuda", dtype=torch.bfloat16 if kind == "1d2d" else torch.float32
        )

        def call(fn=fn, qa=qa, qb=qb, out=out):
            return fn(qa, qb, out=out)

        for _ in range(5):
            call()
        us = GpuTimer(warmup=0).host_us(call, calls=50)
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(200):
            call()
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(f"=== {kind} {m} x {n} x {k}: {us:.1f} host µs per call\n{s.getvalue()}", flush=True)
        rows.append(dict(kind=kind, m=m, n=n, k=k, host_us=us, profile=s.getvalue()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "bench": "diag_gluon_host", "rows": rows}, f)


if __name__ == "__main__":
    main()
