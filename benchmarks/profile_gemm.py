"""Launch one FP8 GEMM a few times on fresh random operands, for ``ncu`` (run_gpu.sh ncugemm).

    ncu --nvtx --nvtx-include measure/ -k regex:fp8_gemm_nt_kernel --launch-skip 1 \
        --launch-count 1 python3 -m benchmarks.profile_gemm --shape 4096 7168 16384
    ncu --nvtx --nvtx-include measure/ -k regex:'gemm|nvjet|xmma|cutlass' --launch-skip 1 \
        --launch-count 1 python3 -m benchmarks.profile_gemm --shape 4096 7168 16384 --backend cublas

The operands are quantized and one warm-up call made (JIT compile, cuBLAS 1D1D's layout probe)
outside the NVTX "measure" ranges, so only the measured GEMM calls match. ``--grid 1d2d`` (or
``1d1d``) instead runs every DeepSeek-V3 shape of the benchmarks once (M = 64, 128, 4096 over
the six (N, K); the wgrad pairs at K = 4096), in the order it prints, for one ncu pass over all
of them (``benchmarks.ncu_table`` turns that pass into a table). ``--config 128x128s5c1d`` runs
the PTX kernel with explicit block sizes (``BMxBNsSTAGEScCLUSTER``, ``d`` = double
accumulators); the default is the heuristic's pick, printed first. ``--backend triton`` runs
:mod:`ptxtrain.gemm.triton`'s default (kernel regex ``_gemm_ws_kernel|_fp8_gemm_kernel``).
"""

from __future__ import annotations

import argparse
import importlib
import re

import torch

from ptxtrain.bench.gemm import SF_LAYOUT
from ptxtrain.gemm import cublas, ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing.shapes import DSV3_DENSE_NK, DSV3_M, DSV3_WGRAD_MN

_CONFIG_RE = re.compile(r"^(\d+)x(\d+)s(\d+)c([12])(a?)(d?)(k?)(?:e(\d+))?$")


def parse_config(text: str) -> ptx.PtxConfig:
    """``"128x128s5c1d"`` -> PtxConfig(128, 128, 5, cluster=1, double_acc=True, tma_store=True);
    ``a`` after the cluster (``"64x16s16c2ad"``) multicasts A instead of B; ``k`` splits
    the last partial wave's tiles along K (``PtxConfig.split_k``); a final ``eN`` stages N
    epilogue boxes per math warpgroup (``PtxConfig.epi_boxes``; default 1 for 256-row tiles,
    else 0 = all; ``256x128s3c2e4``: both waves of a 256-row tile at once).

    Raises:
        ValueError: ``text`` does not match ``BMxBNsSTAGEScCLUSTER[a][d][k][eN]``.
    """
    match = _CONFIG_RE.match(text)
    if match is None:
        raise ValueError(
            "--config must look like 128x128s5c1d (BMxBNsSTAGEScCLUSTER[a][d][k][eN]), "
            f"got {text!r}"
        )
    bm, bn, stages, cluster = (int(g) for g in match.groups()[:4])
    return ptx.PtxConfig(
        bm, bn, stages, cluster, double_acc=bool(match.group(6)), tma_store=True,
        epi_boxes=int(match.group(8)) if match.group(8) else 1 if bm == 256 else 0,
        multicast_a=bool(match.group(5)),
        split_k=bool(match.group(7)),
    )  # fmt: skip


def grid(kind: str) -> list[tuple[int, int, int]]:
    """The (M, N, K) shapes of ``ptxtrain bench gemm`` for ``kind``, in its order."""
    if kind == "1d2d":
        return [(m, n, k) for m in DSV3_M for n, k in DSV3_DENSE_NK]
    return [(m, n, 4096) for m, n in DSV3_WGRAD_MN]


def _operands(kind: str, m: int, n: int, k: int):
    a = per_token_cast_to_fp8(torch.randn(m, k, device="cuda"), sf_layout=SF_LAYOUT)
    w = torch.randn(n, k, device="cuda")
    if kind == "1d2d":
        return a, per_block_cast_to_fp8(w)
    return a, per_token_cast_to_fp8(w, sf_layout=SF_LAYOUT)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", type=int, nargs=3, default=[4096, 7168, 16384], help="M N K")
    p.add_argument("--kind", choices=["1d2d", "1d1d"], default="1d2d")
    p.add_argument("--backend", choices=["ptx", "cublas", "triton"], default="ptx")
    p.add_argument("--config", default=None, help="PTX block sizes, e.g. 128x128s5c1d")
    p.add_argument("--iters", type=int, default=4)
    p.add_argument(
        "--out",
        choices=["bf16", "fp32"],
        default=None,
        help="D's dtype for --shape (default bf16 for 1d2d, fp32 for 1d1d; Fp8Linear's wgrad "
        "writes bf16)",
    )
    p.add_argument("--grid", choices=["1d2d", "1d1d"], default=None, help="every V3 shape once")
    args = p.parse_args()
    if args.grid:
        kind = args.grid
        fn = {"1d2d": cublas.fp8_gemm_nt, "1d1d": cublas.fp8_gemm_nt_1d1d}[kind]
        out_dtype = torch.bfloat16 if kind == "1d2d" else torch.float32
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        # Outside the "measure" ranges (ncu --nvtx-include measure/): cuBLAS 1D1D probes its
        # scale layouts on its first call, which must not count as a shape's kernels.
        a, b = _operands(kind, 256, 256, 512)
        fn(a, b)
        for m, n, k in grid(kind):
            a, b = _operands(kind, m, n, k)
            cfg = ptx.select_config(kind, m, n, k, sms)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("measure")
            if args.backend == "cublas":
                fn(a, b)
            else:
                ptx.run_with_config(kind, a, b, cfg, out_dtype)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            print(f"shape {kind} {m} {n} {k} {args.backend} {cfg if args.backend == 'ptx' else ''}")
        return
    m, n, k = args.shape
    a, b = _operands(args.kind, m, n, k)
    out_dtype = torch.bfloat16 if args.kind == "1d2d" else torch.float32
    if args.out:
        out_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.out]
    if args.backend in ("cublas", "triton"):
        mod = (
            cublas if args.backend == "cublas" else importlib.import_module("ptxtrain.gemm.triton")
        )
        fn = mod.fp8_gemm_nt if args.kind == "1d2d" else mod.fp8_gemm_nt_1d1d

        def run():
            return fn(a, b, out_dtype=out_dtype)
    else:
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        pick = ptx.select_config(args.kind, m, n, k, sms)
        cfg = parse_config(args.config) if args.config else pick
        print(f"ptx config: {cfg}", flush=True)

        def run():
            return ptx.run_with_config(args.kind, a, b, cfg, out_dtype)

    run()  # outside the "measure" ranges: JIT compile, cuBLAS 1D1D's first-call layout probe
    torch.cuda.synchronize()
    for _ in range(args.iters):
        torch.cuda.nvtx.range_push("measure")
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
