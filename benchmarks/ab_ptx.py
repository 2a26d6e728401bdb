"""A/B the PTX GEMM's variants on a GPU: block sizes and the header's compile-time switches, each
checked (calc_diff < 1e-3) and timed against cuBLAS blockwise (or, ``--baseline triton``, the
Triton kernel) in one process (bench method).

    python3 -m benchmarks.ab_ptx --shapes 4096,7168,16384 4096,4096,7168 \
        --variants base "chunk16:#PTXTRAIN_GEMM_CHUNK=16" "c144:128x144s5c1" [--json OUT.json]

A variant is ``NAME[:SPEC[:SPEC...]]``; a SPEC is ``BMxBNsSTAGEScCLUSTER[a][d][k]`` (block sizes,
as ``benchmarks.profile_gemm --config``; default the heuristic's pick), ``sN`` (the heuristic's
block sizes with an N-stage ring; ``sNeM``: with M staged epilogue boxes per math warpgroup,
``PtxConfig.epi_boxes``), ``split`` / ``nosplit`` (the config with / without the split
tail, ``PtxConfig.split_k``), ``#MACRO=VALUE`` (a ``#define`` put before the header:
``ptx.set_source_defines``) or ``yield=MODE`` (the SASS post-pass on the promotion FFMAs' yield
bits, ``ptx.set_ffma_yield``: ``interleave``, ``all`` or ``none``; variants without it run
``off``, the bits as compiled). ``--kind 1d1d`` times the wgrad kernel (fp32 out) against cuBLAS
1D1D.

    python3 -m benchmarks.ab_ptx --kind 1d1d --shapes 7168,4096,4096 \
        --variants base il:yield=interleave all:yield=all none:yield=none
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import dataclasses
import json
import re

import torch

from benchmarks.profile_gemm import parse_config
from ptxtrain.bench.gemm import random_problem
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas, ptx
from ptxtrain.gemm import triton as triton_gemm
from ptxtrain.gemm.heuristics import SM90_SMEM_BYTES
from ptxtrain.jit.sass import FFMA_YIELD_MODES
from ptxtrain.testing import calc_diff


def parse_variant(text: str) -> tuple[str, str | None, str, bool | None, str]:
    """``"name:128x128s5c1d:#PTXTRAIN_GEMM_CHUNK=16"`` -> (name, config text or None, defines,
    split, FFMA yield mode). A SPEC ``sN`` (e.g. ``s16``) keeps the heuristic's block sizes with
    an N-stage ring (fewer where shared memory ends), ``sNeM`` with M staged epilogue boxes too;
    it is returned as the config text.
    ``split`` / ``nosplit`` set the config's ``split_k`` (split: True / False; None keeps the
    config's). ``yield=MODE`` sets the mode (default ``"off"``).

    Raises:
        ValueError: a SPEC that is neither a config, ``sN``, ``split`` / ``nosplit``,
            ``#MACRO=VALUE`` nor ``yield=MODE`` with a mode of ``ptxtrain.jit.sass``.
    """
    name, *specs = text.split(":")
    cfg, defines, split, ffma_yield = None, "", None, "off"
    for spec in specs:
        if spec.startswith("yield="):
            ffma_yield = spec.removeprefix("yield=")
            if ffma_yield not in FFMA_YIELD_MODES:
                raise ValueError(
                    f"variant {text!r}: expected yield=MODE, MODE one of {FFMA_YIELD_MODES}, "
                    f"got {spec!r}"
                )
        elif re.fullmatch(r"s\d+(e\d+)?", spec):
            cfg = spec
        elif spec in ("split", "nosplit"):
            split = spec == "split"
        elif spec.startswith("#"):
            macro, eq, value = spec[1:].partition("=")
            if not eq or not macro.isidentifier():
                raise ValueError(f"variant {text!r}: expected #MACRO=VALUE, got {spec!r}")
            defines += f"#define {macro} {value}\n"
        else:
            parse_config(spec)  # raises on a malformed config
            cfg = spec
    return name, cfg, defines, split, ffma_yield


def _with_stages(cfg, stages: int, kind: str, out_dtype) -> ptx.PtxConfig:
    """``cfg`` with ``stages`` (or as many as fit in shared memory) ring stages."""
    cfg = dataclasses.replace(cfg, num_stages=stages)
    while cfg.num_stages > 2 and ptx.config_smem_bytes(cfg, kind, out_dtype) > SM90_SMEM_BYTES:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shapes", nargs="+", required=True, help="M,N,K items")
    p.add_argument("--variants", nargs="+", default=["base"])
    p.add_argument("--kind", choices=["1d2d", "1d1d"], default="1d2d")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument(
        "--baseline",
        choices=["cublas", "triton"],
        default="cublas",
        help="the backend timed beside the variants (triton: for shapes cuBLAS cannot run)",
    )
    p.add_argument(
        "--out",
        choices=["bf16", "fp32"],
        help="D's dtype (default: bf16 for 1d2d, fp32 for 1d1d; Fp8Linear's wgrad writes bf16)",
    )
    p.add_argument("--json")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    timer = GpuTimer(repeats=args.repeats)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_out = "bf16" if args.kind == "1d2d" else "fp32"
    out_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.out or default_out]
    rows = []
    for item in args.shapes:
        m, n, k = (int(v) for v in item.split(","))
        want, qa, qb = random_problem(m, n, k, args.kind)
        mod = cublas if args.baseline == "cublas" else triton_gemm
        fn = mod.fp8_gemm_nt if args.kind == "1d2d" else mod.fp8_gemm_nt_1d1d
        base_us = timer(lambda: fn(qa, qb, out_dtype=out_dtype))
        flops = 2.0 * m * n * k
        line = f"{m} {n} {k} | {args.baseline} {base_us:8.1f} {flops / base_us / 1e6:5.0f}"
        for name, cfg_text, defines, split, ffma_yield in variants:
            cfg = ptx.select_config(args.kind, m, n, k, sms)
            if cfg_text and cfg_text[0] == "s":
                stages, _, boxes = cfg_text[1:].partition("e")
                if boxes:
                    cfg = dataclasses.replace(cfg, epi_boxes=int(boxes))
                cfg = _with_stages(cfg, int(stages), args.kind, out_dtype)
            elif cfg_text:
                cfg = parse_config(cfg_text)
            if split is not None:
                cfg = dataclasses.replace(cfg, split_k=split)
            ptx.set_source_defines(defines)
            ptx.set_ffma_yield(ffma_yield)
            try:
                diff = calc_diff(
                    ptx.run_with_config(args.kind, qa, qb, cfg, out_dtype).float(), want
                )
                us = timer(lambda: ptx.run_with_config(args.kind, qa, qb, cfg, out_dtype))
            finally:
                ptx.set_source_defines("")
                ptx.set_ffma_yield("off")
            ok = diff < 1e-3  # the GEMM contract (DESIGN §2): FP8 inputs, FP32 promotion
            rows.append(
                dict(m=m, n=n, k=k, variant=name, cfg=cfg.__dict__, defines=defines,
                     ffma_yield=ffma_yield, us=us,
                     baseline=args.baseline, baseline_us=base_us, x_baseline=base_us / us,
                     calc_diff=diff, ok=ok)
            )  # fmt: skip
            line += f" | {name} {us:8.1f} {base_us / us:.3f}{'' if ok else ' WRONG'}"
        print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "bench": "ab_ptx", "kind": args.kind, "rows": rows}, f)


if __name__ == "__main__":
    main()
