"""Sweep the PTX GEMM's block sizes against cuBLAS blockwise on a GPU (tunes the heuristic).

    python3 -m benchmarks.sweep_ptx [--json OUT.json] [--m 4096] [--kind 1d2d]

For each DeepSeek-V3 (N, K) and each candidate config (block_m, block_n, stages, cluster), the
kernel is checked (calc_diff < 1e-3 against the matmul of the unquantized inputs) and timed with
the method of ``ptxtrain bench gemm``; cuBLAS blockwise and the heuristic's pick are timed in the
same process. Prints µs, TFLOPS and the ratio to cuBLAS; the best config per shape is marked.
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import itertools
import json

import torch

from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas, ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff
from ptxtrain.testing.shapes import DSV3_DENSE_NK, DSV3_WGRAD_MN


def _candidates(
    kind: str, m: int, n: int, unrolls=(2,), doubles=(False,), tmas=(False,), epi_boxes=(0,)
) -> list[ptx.PtxConfig]:
    out = []
    out_dtype = torch.bfloat16 if kind == "1d2d" else torch.float32
    for bm in (128, 256) if m > 128 else (64, 128) if m > 64 else (64,):
        bns = (16, 32, 48, 64, 96, 128) if m <= 128 else (96, 128, 160) if bm == 128 else (128,)
        for bn in bns:
            for cluster, tma in itertools.product((1, 2), tmas):
                if tma and not ptx.tma_store_fits(bn, n, out_dtype):
                    continue
                for eb in epi_boxes if tma else (0,):
                    epi = ptx.epilogue_bytes(bm, bn, out_dtype, eb) if tma else 0
                    stages, cap = 8, ptx.SM90_SMEM_BYTES
                    while stages > 2 and ptx.smem_bytes(bm, bn, stages, kind, epi) > cap:
                        stages -= 1
                    for u, dbl in itertools.product(unrolls, doubles):
                        if dbl and (bm == 256 or bn > 128):
                            continue
                        out.append(ptx.PtxConfig(bm, bn, stages, cluster, u, dbl, tma, eb))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json")
    p.add_argument("--m", type=int, nargs="+", default=[4096])
    p.add_argument("--kind", default="1d2d", choices=["1d2d", "1d1d"])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--unroll", type=int, nargs="+", default=[2], help="K-loop unroll factors")
    p.add_argument("--only", nargs="+", default=None, help="configs BMxBNcC, e.g. 256x128c2")
    p.add_argument("--double", type=int, nargs="+", default=[0], help="double accumulators 0/1")
    p.add_argument("--tma", type=int, nargs="+", default=[1], help="TMA-store epilogue 0/1")
    p.add_argument("--epi-boxes", type=int, nargs="+", default=[0], help="staged boxes (0 = all)")
    args = p.parse_args()
    timer = GpuTimer(repeats=args.repeats)
    rows = []
    shapes = (
        [(m, n, k) for m in args.m for n, k in DSV3_DENSE_NK]
        if args.kind == "1d2d"
        else [(m, n, 4096) for m, n in DSV3_WGRAD_MN]
    )
    for m, n, k in shapes:
        x = torch.randn(m, k, device="cuda")
        w = torch.randn(n, k, device="cuda")
        want = x @ w.t()
        qa = per_token_cast_to_fp8(x)
        qb = per_block_cast_to_fp8(w) if args.kind == "1d2d" else per_token_cast_to_fp8(w)
        out_dtype = torch.bfloat16 if args.kind == "1d2d" else torch.float32
        cb = cublas.fp8_gemm_nt if args.kind == "1d2d" else cublas.fp8_gemm_nt_1d1d
        t_cublas = timer(lambda: cb(qa, qb))
        flops = 2.0 * m * n * k
        pick = ptx.select_config(args.kind, m, n, k, 132)
        best = None
        doubles = tuple(bool(d) for d in args.double)
        tmas = tuple(bool(t) for t in args.tma)
        cands = _candidates(
            args.kind, m, n, tuple(args.unroll), doubles, tmas, tuple(args.epi_boxes)
        )
        for cfg in cands:
            tag = f"{cfg.block_m}x{cfg.block_n}c{cfg.cluster}"
            if args.only and tag not in args.only:
                continue
            d = ptx.run_with_config(args.kind, qa, qb, cfg, out_dtype)
            diff = calc_diff(d.float(), want)
            if diff > 1e-3:
                print(f"{m} {n} {k} {cfg}: WRONG calc_diff {diff:.2e}")
                rows.append(dict(m=m, n=n, k=k, cfg=cfg.__dict__, wrong=diff))
                continue
            us = timer(lambda: ptx.run_with_config(args.kind, qa, qb, cfg, out_dtype))
            resident = None
            if cfg.cluster > 1:
                from ptxtrain.jit import load_kernel, max_active_clusters

                compiled, expr = ptx.compile_gemm(args.kind, cfg, n, k, out_dtype, False)
                # (the sweep's D is fresh and aligned, so cfg runs as given)
                epi = (
                    ptx.epilogue_bytes(cfg.block_m, cfg.block_n, out_dtype, cfg.epi_boxes)
                    if cfg.tma_store
                    else 0
                )
                smem = ptx.smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages, args.kind, epi)
                resident = max_active_clusters(
                    load_kernel(compiled, expr), cfg.cluster, cfg.num_threads, smem
                )
            row = dict(
                m=m,
                n=n,
                k=k,
                cfg=cfg.__dict__,
                us=us,
                tflops=flops / us / 1e6,
                x_cublas=t_cublas / us,
                cublas_us=t_cublas,
                picked=cfg == pick,
            )
            rows.append(row)
            if best is None or us < best["us"]:
                best = row
            print(
                f"{m:>5} {n:>6} {k:>6} {cfg.block_m:>4}x{cfg.block_n:<4} s{cfg.num_stages} "
                f"c{cfg.cluster} u{cfg.unroll_k}{'d' if cfg.double_acc else ' '}"
                f"{f't{cfg.epi_boxes}' if cfg.tma_store else '  '} {us:9.1f} µs "
                f"{row['tflops']:6.0f} TFLOPS "
                f"{row['x_cublas']:5.2f}x cuBLAS{'  <- heuristic' if row['picked'] else ''}"
                f"{f'  ({resident} clusters resident)' if resident else ''}"
            )
        print(f"BEST {m} {n} {k}: {best['cfg']} {best['x_cublas']:.2f}x cuBLAS")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(env=environment(), kind=args.kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
