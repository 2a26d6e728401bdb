"""Where a whole ``Buffer.dispatch`` spends host time: launches and host µs per call.

    torchrun --nproc-per-node 2 -m benchmarks.diag_dispatch_host [--calls 200] [--json OUT]

A dispatch with a fresh layout is host-bound: its count exchange ends in one host sync, and
every launch the host makes after it is time the GPU waits. This counts, per backend, the
kernel launches of one call before and after that sync (``torch.profiler``: runtime / driver
launch calls, split at the device-to-host copy of the counts) and times ``--calls`` calls on the
host, each started with the GPU idle (barrier + synchronize):

- ``host_us``: until ``dispatch`` returns (the host's work plus its wait at the sync);
- ``total_us``: until the GPU has finished the call too.

Medians per rank, and the max over ranks. Only the public API (``Buffer``, ``bench.dispatch``'s
inputs), so two trees can be compared by running this script from each (DeepEP's setting by
default: 4096 tokens per rank, hidden 7168, 256 experts, top-8, FP8 rows).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _launches(buf, inputs: dict) -> dict:
    """Kernel launches of one dispatch, before and after its host sync (the first
    device-to-host ``cudaMemcpyAsync``)."""
    from torch.profiler import ProfilerActivity, profile

    args = (inputs["x_fp8"], inputs["topk_idx"], inputs["topk_w"], inputs["experts"])
    dist.barrier()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        buf.dispatch(*args)
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    sync = next((e.time_range.start for e in events if e.name == "cudaMemcpyAsync"), float("inf"))
    before = sum(1 for e in events if e.name in _LAUNCH and e.time_range.start < sync)
    after = sum(1 for e in events if e.name in _LAUNCH and e.time_range.start > sync)
    return {"launches_before_sync": before, "launches_after_sync": after}


def _time(buf, inputs: dict, calls: int) -> dict:
    args = (inputs["x_fp8"], inputs["topk_idx"], inputs["topk_w"], inputs["experts"])
    host, total = [], []
    for _ in range(calls):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buf.dispatch(*args)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e6)
        total.append((t2 - t0) * 1e6)
    return {"host_us": statistics.median(host), "total_us": statistics.median(total)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--json", default=None)
    ns = p.parse_args()

    from ptxtrain.bench.dispatch import make_inputs
    from ptxtrain.bench.timing import environment
    from ptxtrain.moe import Buffer

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    inputs = make_inputs(ns.tokens, ns.hidden, ns.experts, ns.topk, seed=0)
    rows = []
    for backend in ("all_to_all", "nvlink"):
        kw = {"num_sms": 24} if backend == "nvlink" else {}
        buf = Buffer(backend=backend, **kw)
        for _ in range(5):  # warm-up: JIT compiles, allocator
            buf.dispatch(inputs["x_fp8"], inputs["topk_idx"], inputs["topk_w"], ns.experts)
        row = {"backend": backend, **_launches(buf, inputs), **_time(buf, inputs, ns.calls)}
        per_rank = [None] * world
        dist.all_gather_object(per_rank, row)
        rows.append(
            {
                "backend": backend,
                "per_rank": per_rank,
                "host_us_max": max(r["host_us"] for r in per_rank),
                "total_us_max": max(r["total_us"] for r in per_rank),
            }
        )
        del buf
        torch.cuda.synchronize()
    if rank == 0:
        for r in rows:
            lb = [x["launches_before_sync"] for x in r["per_rank"]]
            la = [x["launches_after_sync"] for x in r["per_rank"]]
            print(
                f"{r['backend']:>10}  launches before / after sync {lb} / {la}  "
                f"host {r['host_us_max']:.1f} us  total {r['total_us_max']:.1f} us (max rank)"
            )
        if ns.json:
            record = {"bench": "diag_dispatch_host", "env": environment(), "args": vars(ns)}
            with open(ns.json, "w") as f:
                json.dump({**record, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
