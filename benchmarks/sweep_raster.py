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

from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas, ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff
from ptxtrain.testing.shapes import DSV3_DENSE_NK

G, ROWS = 8, 512


def _time(timer, fn, want, flops, label, rows, **info):
    diff = calc_diff(fn().float(), want)
    assert diff < 1e-3, f"{label}: calc_diff {diff:.2e}"  # the GEMM contract's bound
    us = timer(fn)
    tflops = flops / (us * 1e-6) / 1e12
    rows.append(dict(op=label, us=us, tflops=tflops, calc_diff=diff, **info))
    print(f"{label:<44} {us:9.1f} µs {tflops:7.0f} TFLOPS")
    return us


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
        m = G * ROWS
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(G, n, k, device="cuda")
        qa = per_token_cast_to_fp8(x)
        qws = [per_block_cast_to_fp8(w[g]) for g in range(G)]
        qb = (torch.stack([q for q, _ in qws]), torch.stack([s for _, s in qws]))
        m_indices = torch.arange(G, device="cuda", dtype=torch.int32).repeat_interleave(ROWS)
        block_group = m_indices.reshape(-1, 64).amax(dim=1)
        want = torch.cat([x[g * ROWS : (g + 1) * ROWS] @ w[g].t() for g in range(G)])
        flops = 2.0 * m * n * k
        dense_us = _time(timer, lambda: ptx.fp8_gemm_nt(qa, qws[0]), x @ w[0].t(), flops,
                         f"dense ptx {m}x{n}x{k}", rows, shape=[m, n, k])  # fmt: skip
        base = ptx.grouped_config(m, n, k, sms)
        for r in args.raster:
            cfg = dataclasses.replace(base, raster_m=r)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

            def run():
                ptx._launch("m_grouped", qa, qb, out, False, torch.bfloat16, cfg,
                            (m_indices, block_group))  # fmt: skip
                return out

            us = _time(timer, run, want, flops, f"m_grouped {m}x{n}x{k} raster {r}", rows,
                       shape=[m, n, k], raster_m=r, kind="m_grouped")  # fmt: skip
            summary[f"m_grouped_over_dense_{n}x{k}_raster{r}"] = dense_us / us
    if not args.no_dense:
        m = 4096
        for n, k in DSV3_DENSE_NK:
            a, b = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
            qa, qb = per_token_cast_to_fp8(a), per_block_cast_to_fp8(b)
            want, flops = a @ b.t(), 2.0 * m * n * k
            cub = _time(timer, lambda: cublas.fp8_gemm_nt(qa, qb), want, flops,
                        f"dense cublas {m}x{n}x{k}", rows, shape=[m, n, k])  # fmt: skip
            base = ptx.select_config("1d2d", m, n, k, sms)
            for r in args.raster:
                cfg = dataclasses.replace(base, raster_m=r)
                us = _time(timer,
                           lambda: ptx.run_with_config("1d2d", qa, qb, cfg, torch.bfloat16),
                           want, flops, f"dense ptx {m}x{n}x{k} raster {r}", rows,
                           shape=[m, n, k], raster_m=r, kind="1d2d")  # fmt: skip
                summary[f"dense_over_cublas_{n}x{k}_raster{r}"] = cub / us
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
