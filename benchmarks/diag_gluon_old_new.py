"""Time the warp-specialized Gluon kernel of two source trees in one process (same inputs,
alternating), and save each launch's cubin, to tell a kernel change from machine variance.

    python3 -m benchmarks.diag_gluon_old_new OLD_TREE [--json OUT.json] [--cubins DIR]

``OLD_TREE`` holds an older ``ptxtrain/gemm/gluon.py``; it is loaded as a separate module.
"""

# ruff: noqa: B023
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

from ptxtrain.bench.gemm import random_problem
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas
from ptxtrain.gemm import gluon as new
from ptxtrain.testing import calc_diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("old_tree")
    p.add_argument("--shapes", nargs="+", default=["4096,4096,7168", "4096,7168,16384"])
    p.add_argument("--json")
    p.add_argument("--cubins")
    args = p.parse_args()
    spec = importlib.util.spec_from_file_location(
        "gluon_old", os.path.join(args.old_tree, "ptxtrain/gemm/gluon.py")
    )
    old = importlib.util.module_from_spec(spec)
    sys.modules["gluon_old"] = old  # (dataclasses look their module up there)
    spec.loader.exec_module(old)
    timer = GpuTimer(repeats=30)
    rows = []
    for item in args.shapes:
        m, n, k = (int(v) for v in item.split(","))
        want, qa, qb = random_problem(m, n, k, "1d2d")
        base = timer(lambda: cublas.fp8_gemm_nt(qa, qb))
        line = f"{m} {n} {k} | cublas {base:7.1f}"
        for rep in range(2):
            for name, mod in (("old", old), ("new", new)):
                cfg = mod.GluonConfig(256, 128, 8, 3, 4, warp_specialized=True, store_buffers=2)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                mod.fp8_gemm("1d2d", qa, qb, out, out.dtype, False, cfg)
                diff = calc_diff(out.float(), want)
                us = timer(lambda: mod.fp8_gemm("1d2d", qa, qb, out, out.dtype, False, cfg))
                rows.append(dict(m=m, n=n, k=k, tree=name, rep=rep, us=us, cublas_us=base,
                                 x_cublas=base / us, calc_diff=diff))  # fmt: skip
                line += f" | {name} {us:7.1f} {base / us:.3f}"
        print(line, flush=True)
    if args.cubins:
        os.makedirs(args.cubins, exist_ok=True)
        for name, mod in (("old", old), ("new", new)):
            for i, kern in enumerate(mod._gemm_ws_kernel.device_caches[0][0].values()):
                with open(os.path.join(args.cubins, f"{name}{i}.cubin"), "wb") as f:
                    f.write(kern.asm["cubin"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "bench": "diag_gluon_old_new", "rows": rows}, f)


if __name__ == "__main__":
    main()
