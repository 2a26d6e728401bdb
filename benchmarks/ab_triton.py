"""A/B the Triton GEMM's launch configs on a GPU: each config is checked (calc_diff < 1e-3) and
timed beside cuBLAS blockwise and the Triton heuristic's own pick, in one process (bench method).

    python3 -m benchmarks.ab_triton --shapes 4096,7168,16384 4096,2112,7168 \
        --variants "p:128x128w8s4g8:tma_persistent:p1" "g:gluon:128x128w8s4c4ws" [--json OUT]

A variant is ``NAME:TILE:VARIANT[:pN]``: ``TILE`` is ``BMxBNwWARPSsSTAGESgGROUP_M`` (a
:class:`ptxtrain.gemm.heuristics.GemmConfig`), ``VARIANT`` one of
:data:`ptxtrain.gemm.heuristics.VARIANTS`, ``pN`` the programs per SM of a persistent variant
(default 1). ``--kind 1d1d`` times the wgrad kernel (fp32 out) against cuBLAS 1D1D.
``NAME:gluon:BMxBNwWARPSsSTAGEScCHUNK[gGROUP_M][bBUFFERS][ws][k]`` times the Gluon kernel
(:mod:`ptxtrain.gemm.gluon`; ``ws``: its warp-specialized form, ``wsg`` the same with the
scales loaded from global memory by the consumers instead of brought into each stage by TMA;
a final ``k[N]``: the split tail, ``GluonConfig.split_k``, at most N slices per tile).
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import json
import re

import torch

from ptxtrain.bench.gemm import random_problem
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas
from ptxtrain.gemm import triton as triton_gemm
from ptxtrain.gemm.heuristics import GLUON_SPLIT_MAX, VARIANTS, GemmConfig
from ptxtrain.testing import calc_diff

_TILE = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)g(\d+)")
_GLUON = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)c(\d+)(?:g(\d+))?(?:b(\d))?(wsg|ws)?(k\d*)?")


def parse_variant(text: str) -> tuple[str, object]:
    """``"p:128x128w8s4g8:tma_persistent:p1"`` -> (name, GemmConfig); ``"g:gluon:..."`` ->
    (name, GluonConfig).

    Raises:
        ValueError: a malformed item, an unknown variant, or a config GemmConfig refuses.
    """
    parts = text.split(":")
    if len(parts) == 3 and parts[1] == "gluon":
        from ptxtrain.gemm.gluon import GluonConfig

        t = _GLUON.fullmatch(parts[2])
        if t is None:
            raise ValueError(f"variant {text!r}: expected NAME:gluon:BMxBNwWARPSsSTAGEScCHUNK")
        bm, bn, warps, stages, chunk = (int(v) for v in t.groups()[:5])
        group_m = int(t[6]) if t[6] else 8
        split_max = int((t[9] or "k")[1:] or GLUON_SPLIT_MAX)  # "k" alone: the default cap
        return parts[0], GluonConfig(bm, bn, warps, stages, chunk, group_m,
                                     warp_specialized=bool(t[8]), scales_tma=t[8] != "wsg",
                                     store_buffers=int(t[7] or 1), split_k=bool(t[9]),
                                     split_max=split_max)  # fmt: skip
    if len(parts) not in (3, 4):
        raise ValueError(f"variant {text!r}: expected NAME:TILE:VARIANT[:pN]")
    name, tile, variant, *rest = parts
    t = _TILE.fullmatch(tile)
    if t is None:
        raise ValueError(f"variant {text!r}: tile {tile!r} is not BMxBNwWARPSsSTAGESgGROUP_M")
    if variant not in VARIANTS:
        raise ValueError(f"variant {text!r}: {variant!r} is not one of {VARIANTS}")
    pps = 1
    if rest:
        if not re.fullmatch(r"p\d", rest[0]):
            raise ValueError(f"variant {text!r}: expected pN (programs per SM), got {rest[0]!r}")
        pps = int(rest[0][1:])
    bm, bn, warps, stages, group_m = (int(v) for v in t.groups())
    return name, GemmConfig(bm, bn, warps, stages, group_m, variant, pps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", nargs="+", required=True, help="M,N,K items")
    p.add_argument("--variants", nargs="+", required=True)
    p.add_argument("--kind", choices=["1d2d", "1d1d"], default="1d2d")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    timer = GpuTimer(repeats=args.repeats)
    out_dtype = torch.bfloat16 if args.kind == "1d2d" else torch.float32
    name = "fp8_gemm_nt" if args.kind == "1d2d" else "fp8_gemm_nt_1d1d"
    base_fn, triton_fn = getattr(cublas, name), getattr(triton_gemm, name)
    rows = []
    env = environment()
    for item in args.shapes:
        m, n, k = (int(v) for v in item.split(","))
        want, qa, qb = random_problem(m, n, k, args.kind)
        base_us = timer(lambda: base_fn(qa, qb))
        heur_us = timer(lambda: triton_fn(qa, qb))
        flops = 2.0 * m * n * k
        line = (
            f"{m} {n} {k} | cublas {base_us:8.1f} {flops / base_us / 1e6:5.0f} TFLOPS"
            f" | triton-heuristic {heur_us:8.1f} {base_us / heur_us:.3f}"
        )
        for vname, cfg in variants:
            print(f"  {m} {n} {k} {vname}: compiling and checking", flush=True)
            if isinstance(cfg, GemmConfig):

                def run():
                    return triton_gemm.fp8_gemm(args.kind, qa, qb, None, out_dtype, False, cfg)
            else:
                from ptxtrain.gemm import gluon

                def run():
                    return gluon.fp8_gemm(args.kind, qa, qb, None, out_dtype, False, cfg)

            try:
                got = run()
                diff = calc_diff(got.float(), want)
                us = timer(run)
                error = None
            except Exception as e:  # a config Triton cannot compile or launch: record, go on
                diff, us, error = float("nan"), None, f"{type(e).__name__}: {e}"[:300]
            ok = diff < 1e-3  # the GEMM contract (DESIGN §2): FP8 inputs, FP32 promotion
            rows.append(
                dict(m=m, n=n, k=k, variant=vname, cfg=dict(type=type(cfg).__name__,
                     **cfg.__dict__), us=us, cublas_us=base_us,
                     triton_heuristic_us=heur_us, x_cublas=base_us / us if us else None,
                     x_heuristic=heur_us / us if us else None, calc_diff=diff, ok=ok,
                     error=error)
            )  # fmt: skip
            if us is None:
                line += f" | {vname} ERROR"
            else:
                line += f" | {vname} {us:8.1f} {base_us / us:.3f}{'' if ok else ' WRONG'}"
        print(line, flush=True)
        if any(r["error"] for r in rows[-len(variants) :]):
            for r in rows[-len(variants) :]:
                if r["error"]:
                    print(f"  {r['variant']}: {r['error']}", flush=True)
        if args.json:  # rewritten after every shape: a later hang or time limit keeps the rest
            with open(args.json, "w") as f:
                record = {"env": env, "bench": "ab_triton", "kind": args.kind, "rows": rows}
                json.dump(record, f)


if __name__ == "__main__":
    main()
