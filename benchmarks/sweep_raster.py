"""Sweep the PTX GEMM's rasterization (``PtxConfig.raster_m``) on a GPU, dense and m-grouped.

    python3 -m benchmarks.sweep_raster [--json OUT.json] [--raster 512 1024 2048 4096]

The persistent kernel walks ``raster_m / block_m`` M-blocks (M fastest) before the next N-block,
so the ~132 tiles in flight share a few panels of A and B in L2. The m-grouped contiguous GEMM
reads one B per expert, so its tiles in flight touch several experts' B at once when the raster
group spans several experts (2048 rows = four 512-row experts): fewer rows per group keep one
expert's B in flight. Measured here, per raster:

- m-grouped contiguous (issue 5's setting: 8 experts x 512 rows, N x K = 4096 x 7168 and
  7168 x 2048) against the dense PTX GEMM at the same total M with the heuristic's config;
- dense 1D2D at M = 4096 over the six DeepSeek-V3 (N, K), against cuBLAS blockwise.

Every config is checked (calc_diff < 1e-3 against the matmul of the unquantized inputs) before
it is timed, with the method of ``ptxtrain bench gemm`` (CUDA events, L2 flushed, median).
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from benchmarks.bench_grouped import ROWS, G, m_grouped_operands, timed
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas, ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing.shapes import DSV3_DENSE_NK


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--raster", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--no-dense", action="store_true", help="only the m-grouped GEMM")
    args = p.parse_args()
    timer = GpuTimer(repeats=args.repeats)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows: list = []
    summary: dict = {}
    for n, k in ((4096, 7168), (7168, 2048)):
        ops = m_grouped_operands(n, k)
        m, x, w, qa, qws, qb = (ops[key] for key in ("m", "x", "w", "qa", "qws", "qb"))
        m_indices = ops["m_indices"]
        block_group = ptx.block_groups(m_indices)
        flops, shape = 2.0 * m * n * k, [m, n, k]
        dense = timed(timer, "dense ptx", lambda: ptx.fp8_gemm_nt(qa, qws[0]), flops,
                     x @ w[0].t(), rows, shape)  # fmt: skip
        base = ptx.grouped_config(m, n, k, sms)
        for r in args.raster:
            cfg = dataclasses.replace(base, raster_m=r)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

            def run():
                ptx._launch("m_grouped", qa, qb, out, False, torch.bfloat16, cfg,
                            (m_indices, block_group))  # fmt: skip
                return out

            got = timed(timer, f"m_grouped raster {r}", run, flops, ops["want"], rows, shape,
                       raster_m=r, kind="m_grouped")  # fmt: skip
            summary[f"m_grouped_over_dense_{n}x{k}_raster{r}"] = got / dense
    if not args.no_dense:
        m = 4096
        for n, k in DSV3_DENSE_NK:
            a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
            qa, qb = per_token_cast_to_fp8(a), per_block_cast_to_fp8(b)
            want, flops, shape = a @ b.t(), 2.0 * m * n * k, [m, n, k]
            cub = timed(timer, "dense cublas", lambda: cublas.fp8_gemm_nt(qa, qb), flops, want,
                       rows, shape)  # fmt: skip
            base = ptx.select_config("1d2d", m, n, k, sms)
            for r in args.raster:
                cfg = dataclasses.replace(base, raster_m=r)
                got = timed(timer, f"dense ptx raster {r}",
                           lambda: ptx.run_with_config("1d2d", qa, qb, cfg, torch.bfloat16),
                           flops, want, rows, shape, raster_m=r, kind="1d2d")  # fmt: skip
                summary[f"dense_over_cublas_{n}x{k}_raster{r}"] = got / cub
        for r in args.raster:
            vals = [summary[f"dense_over_cublas_{n}x{k}_raster{r}"] for n, k in DSV3_DENSE_NK]
            gm = 1.0
            for v in vals:
                gm *= v
            summary[f"dense_over_cublas_geomean_raster{r}"] = gm ** (1 / len(vals))
    for key, v in summary.items():
        print(f"{key:<48} {v:.3f}")
    if args.json:
        rec = dict(bench="sweep_raster", env=environment(), rows=rows, summary=summary,
                   settings=dict(groups=G, rows_per_group=ROWS, rasters=args.raster))  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
