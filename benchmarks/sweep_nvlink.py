"""Sweep the nvlink dispatch/combine kernel's knobs in DeepEP's setting (2+ GPUs of one node).

    PTXTRAIN_GIT_SHA=$(git rev-parse HEAD) torchrun --nproc-per-node 2 \
        -m benchmarks.sweep_nvlink --out benchmarks/results/sweep_nvlink.json

For every (threads per block, 16-byte loads in flight per lane, pipelined variant, num_sms) of
the grid, a ``Buffer(backend="nvlink")`` is built and the four operations of ``ptxtrain bench
dispatch`` are timed with its helpers (same inputs, same CUDA-event method, same logical-byte
GB/s): the full ``dispatch`` call (FP8 + scales + weights + topk_idx), the FP8 payload alone
(``dispatch_payload``, kernel only), the full BF16 ``combine`` and its move alone
(``combine_payload``). The ``all_to_all`` (NCCL) backend is timed once as the baseline.
``--pipeline 0 1`` times both kernel variants (``pipeline=True``: per-block flags, see
:mod:`ptxtrain.moe.nvlink`); ``*`` marks the default knobs. Rank 0 prints one table line per
configuration and writes the JSON record (environment: device, versions, git sha from
``PTXTRAIN_GIT_SHA`` or git, date) to ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ptxtrain.bench.dispatch import _nvlink_possible, make_inputs, nvl_bytes, time_buffer
from ptxtrain.bench.timing import environment
from ptxtrain.moe.dispatch import Buffer
from ptxtrain.moe.nvlink import DEFAULT_THREADS, DEFAULT_UNROLL, UNROLLS, check_knobs

_OPS = ("dispatch", "dispatch_payload", "combine", "combine_payload")


def _line(label: str, rows: list[dict]) -> str:
    by_op = {r["op"]: r for r in rows}
    cells = [f"{by_op[op]['gbs_mean']:8.1f} {by_op[op]['us_max']:8.1f}" for op in _OPS]
    return f"{label:>22} " + " ".join(cells)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="JSON results path (written by rank 0)")
    p.add_argument("--threads", type=int, nargs="+", default=[256, 512, 1024])
    p.add_argument("--unroll", type=int, nargs="+", default=[2, 4, 8], help=f"in {UNROLLS}")
    p.add_argument("--pipeline", type=int, nargs="+", default=[0, 1], choices=[0, 1])
    p.add_argument("--num-sms", type=int, nargs="+", default=[8, 16, 24, 32])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--aggressive-ptx", action="store_true")
    args = p.parse_args()
    for t in args.threads:
        for u in args.unroll:
            check_knobs(t, u)  # fail before any GPU work

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        why = _nvlink_possible()
        if why is not None:
            raise SystemExit(f"nvlink backend unavailable: {why}")
        inputs = make_inputs(args.tokens, args.hidden, args.experts, args.topk, seed=0)
        nvl = nvl_bytes(args.tokens, args.hidden, args.topk)
        header = f"{'config':>22} " + " ".join(f"{op[:17]:>17}" for op in _OPS)
        if rank == 0:
            print(
                f"EP{world}: {args.tokens} tokens/rank, hidden {args.hidden}, {args.experts} "
                f"experts, top-{args.topk}; GB/s (mean of ranks) and µs (max rank) per op"
            )
            print(header)
        configs = []
        base = Buffer(backend="all_to_all")
        rows = time_buffer(base, inputs, args.repeats, args.warmup)
        configs.append({"backend": "all_to_all", "rows": rows})
        if rank == 0:
            print(_line("nccl all_to_all", rows), flush=True)
        grid = itertools.product(args.threads, args.unroll, args.pipeline, args.num_sms)
        for threads, unroll, pipe, sms in grid:
            buf = Buffer(
                backend="nvlink",
                num_sms=sms,
                num_nvl_bytes=nvl,
                aggressive_ptx=args.aggressive_ptx,
                nvl_threads=threads,
                nvl_unroll=unroll,
                nvl_pipeline=bool(pipe),
                nvl_send_sms=0,  # the split variant is timed by benchmarks/diag_nvlink.py
            )
            rows = time_buffer(buf, inputs, args.repeats, args.warmup)
            buf.check_errors()
            torch.cuda.synchronize()
            dist.barrier()  # no rank frees a buffer a peer still writes to
            del buf
            knobs = dict(threads=threads, unroll=unroll, pipeline=pipe, num_sms=sms)
            configs.append({"backend": "nvlink", **knobs, "rows": rows})
            if rank == 0:
                default = (threads, unroll, pipe) == (DEFAULT_THREADS, DEFAULT_UNROLL, 0)
                label = f"{'*' if default else ''}t{threads} u{unroll} p{pipe} sms{sms}"
                print(_line(label, rows), flush=True)
        if rank == 0:
            nv = [c for c in configs if c["backend"] == "nvlink"]
            for op in _OPS:
                best = max(
                    nv, key=lambda c, op=op: next(r for r in c["rows"] if r["op"] == op)["gbs_mean"]
                )
                gbs = next(r for r in best["rows"] if r["op"] == op)["gbs_mean"]
                print(
                    f"best {op}: {gbs:.1f} GB/s at threads={best['threads']} "
                    f"unroll={best['unroll']} pipeline={best['pipeline']} num_sms={best['num_sms']}"
                )
            record = {
                "bench": "sweep_nvlink",
                "env": environment(),
                "settings": {
                    "world_size": world,
                    "tokens_per_rank": args.tokens,
                    "hidden": args.hidden,
                    "experts": args.experts,
                    "topk": args.topk,
                    "repeats": args.repeats,
                    "aggressive_ptx": args.aggressive_ptx,
                    "num_nvl_bytes": nvl,
                    "routing": "uniform random top-k",
                    "dispatch": "fp8 (e4m3 + fp32 scale per 128)",
                    "combine": "bf16",
                },
                "method": "ptxtrain.bench.dispatch.time_buffer: per rank barrier + sync before "
                "each call, CUDA events, median; GB/s = logical bytes received / time",
                "configs": configs,
            }
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(record, indent=1))
            print(f"wrote {out}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
