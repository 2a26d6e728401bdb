"""Stages of benchmarks/run_gpu.sh that run in Python: each prints a table and writes JSON.

python benchmarks/gpu_suite.py quant|gemm|linear|train --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch


def _save(out: Path, name: str, record: dict) -> None:
    dev = record.get("env", {}).get("device", "cpu").replace(" ", "_")
    path = out / f"{time.strftime('%Y%m%d')}-{name}-{dev}.json"
    path.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {path}")


def stage_quant(out: Path) -> None:
    from ptxtrain.bench import quant

    rec = quant.bench_quant()
    print(quant.format_table(rec))
    _save(out, "quant", rec)


def stage_gemm(out: Path) -> None:
    from ptxtrain.bench import gemm

    rec = gemm.bench_1d2d()
    print(gemm.format_table(rec))
    _save(out, "gemm-1d2d", rec)
    rec = gemm.bench_1d1d()
    print(gemm.format_table(rec))
    _save(out, "gemm-1d1d", rec)


def stage_linear(out: Path) -> None:
    from ptxtrain.bench import linear

    rec = linear.bench_linear()
    print(linear.format_table(rec))
    _save(out, "linear", rec)


def stage_train(out: Path) -> None:
    from benchmarks.train_compare import compare

    rec = compare(out)
    _save(out, "train-small", rec)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("stage", choices=["quant", "gemm", "linear", "train"])
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    globals()[f"stage_{args.stage}"](args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
