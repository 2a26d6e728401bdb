"""What the wgrad (1D1D) PTX GEMM pays for, on a GPU: the same shapes through kernels that drop
one cost at a time, all timed in one process with ``ptxtrain bench``'s method.

    python3 -m benchmarks.diag_wgrad [--json OUT.json]

Per DeepSeek-V3 wgrad shape (K = 4096 tokens): cuBLAS 1D1D; the PTX 1D1D kernel (fp32 out), also
with 0 and 4 (default 8) 8-column groups of column scales read before its wgmma wait; the
PTX 1D2D kernel with fp32 out (the same tiles, one scale per 128x128 block of B: no per-column
scale products in the promotion); the PTX 1D2D kernel with bf16 out (half the output bytes).
The gaps say how much the per-column promotion and the fp32 output cost. The 1D2D runs use the
1D1D kernel's block sizes (``select_config("1d1d", ...)``) so only the promotion differs; they
compute a different (coarser-scaled) product, so only their time is reported.
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import json

import torch

from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas, ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing.shapes import DSV3_WGRAD_MN


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    timer = GpuTimer(repeats=args.repeats)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    print(
        "M N K | cuBLAS 1D1D | PTX 1D1D | PTX 1D2D fp32 | PTX 1D2D bf16 | 1D1D early 0 | early 4"
        "  (µs TFLOPS)"
    )
    for m, n in DSV3_WGRAD_MN:
        k = args.k
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda")
        qa, qb1, qb2 = per_token_cast_to_fp8(x), per_token_cast_to_fp8(w), per_block_cast_to_fp8(w)
        cfg = ptx.select_config("1d1d", m, n, k, sms)
        runs = {
            "cublas_1d1d": lambda: cublas.fp8_gemm_nt_1d1d(qa, qb1),
            "ptx_1d1d": lambda: ptx.run_with_config("1d1d", qa, qb1, cfg, torch.float32),
            "ptx_1d2d_fp32": lambda: ptx.run_with_config("1d2d", qa, qb2, cfg, torch.float32),
            "ptx_1d2d_bf16": lambda: ptx.run_with_config("1d2d", qa, qb2, cfg, torch.bfloat16),
        }
        us = {name: timer(fn) for name, fn in runs.items()}  # (each lambda runs at once)
        # The 1D1D kernel with fewer (0 = none: the earlier layout) of its column scales read
        # before the wgmma wait (PTXTRAIN_GEMM_EARLY_SB_GROUPS; the default is 8); each switch
        # holds for its whole timing, so its one rebuild falls in the warm-up.
        for groups in (0, 4):
            ptx.set_source_defines(f"#define PTXTRAIN_GEMM_EARLY_SB_GROUPS {groups}\n")
            try:
                us[f"ptx_1d1d_early{groups}"] = timer(
                    lambda: ptx.run_with_config("1d1d", qa, qb1, cfg, torch.float32)
                )
            finally:
                ptx.set_source_defines("")
        flops = 2.0 * m * n * k
        row = dict(
            m=m,
            n=n,
            k=k,
            cfg=cfg.__dict__,
            us=us,
            tflops={a: flops / t / 1e6 for a, t in us.items()},
        )
        rows.append(row)
        print(
            f"{m} {n} {k} | " + " | ".join(f"{t:8.1f} {flops / t / 1e6:6.0f}" for t in us.values())
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "bench": "diag_wgrad", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
