"""Where an Fp8Linear's forward and backward spend host (CPU) time, function by function, on a
GPU machine: ``benchmarks.host_sections``' timers around the Linear's dispatch, quantizer and
GEMM layers down to the kernel launch, for one or more shapes.

    python3 -m benchmarks.diag_linear_host [--shapes M,N,K ...] [--reps 50] [--json OUT.json]

Prints, per shape, the forward / backward host µs (median; the device idle before each call)
of ``nn.Linear`` (bf16) and ``Fp8Linear``, and the per-call inclusive µs of every timed function.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.host_sections import TARGETS, Sections, linear_sections
from ptxtrain.bench.timing import environment

# Inner layers of the Fp8Linear path, beside host_sections' own list.
EXTRA = [
    "ptxtrain.nn.fp8_linear:_saved_operands",
    "ptxtrain.nn.fp8_linear:_save_operands",
    "ptxtrain.nn.fp8_linear:_autocast_off",
    "ptxtrain.nn.fp8_linear:weight_cache_key",
    "ptxtrain._checks:check_tensor",
    "ptxtrain._backend:load",
    "ptxtrain.quant:_with_layout",
    "ptxtrain.quant:_impl",
    "ptxtrain.quant.cuda:_quant_token",
    "ptxtrain.quant.cuda:_run",
    "ptxtrain.quant.cuda:_check_input",
    "ptxtrain.quant.ref:to_mn_major",
    "ptxtrain.quant.ref:empty_sf",
    "ptxtrain.gemm.ptx:_gemm",
    "ptxtrain.gemm.ptx:_write_into",
    "ptxtrain.gemm.ptx:_plan",
    "ptxtrain.gemm.ptx:_k_major",
    "ptxtrain.gemm.ptx:_mn_major_padded",
    "ptxtrain.gemm.ptx:_split_counters",
    "ptxtrain.gemm.ptx:_check_runnable",
    "ptxtrain.jit.launch:tma_2d_bytes",
    "torch.cuda:current_stream",
    "torch.cuda:is_current_stream_capturing",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", nargs="+", default=["4096,2112,7168", "2048,768,768"])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    args = ap.parse_args()
    sections = Sections()
    installed = sections.install(TARGETS + EXTRA)
    print(f"timing {len(installed)} functions", flush=True)
    record = {**environment(), "bench": "diag_linear_host", "shapes": []}
    try:
        for item in args.shapes:
            m, n, k = (int(v) for v in item.split(","))
            out = linear_sections(sections, m, n, k, args.reps, torch.device(args.device))
            record["shapes"].append({"m": m, "n": n, "k": k, **out})
    finally:
        sections.uninstall()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
