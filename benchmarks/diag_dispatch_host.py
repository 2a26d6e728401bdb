"""Where a whole ``Buffer.dispatch`` spends host time: launches and host µs per call.

    torchrun --nproc-per-node 2 -m benchmarks.diag_dispatch_host [--calls 200] [--json OUT]

A dispatch with a fresh layout is host-bound: its count exchange ends in one host sync, and
every launch the host makes after it is time the GPU waits. This counts, per backend, the
kernel launches of one call before and after that sync (``torch.profiler``: runtime / driver
launch calls, split at the device-to-host copy of the counts) and times ``--calls`` calls on the
host, each started with the GPU idle (barrier + synchronize):

- ``host_us``: until ``dispatch`` returns (the host's work plus its wait at the sync);
- ``total_us``: until the GPU has finished the call too;
- ``pipelined_us``: the GPU time the call adds behind queued work (:func:`_pipelined`), what a
  training step sees when the host runs ahead of the GPU.

Medians per rank, and the max over ranks. It uses ``Buffer`` and ``bench.dispatch``'s inputs and
aligned timing (``_time`` with ``spin_us``, 1436c17 and later), so two such trees can be compared
by running this script from each; session 20's call 4 ran an earlier copy with the same
loop written out (CUDA events around each call behind an all_reduce and the spin). DeepEP's
setting by default: 4096 tokens per rank, hidden 7168, 256 experts, top-8, FP8 rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

_LAUNCH = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def _launches(buf, inputs: dict, calls: int = 3) -> dict:
    """Kernel launches of one dispatch, before and after its host sync (the first
    device-to-host ``cudaMemcpyAsync``), and the call's timeline: host ops and runtime calls of
    at least 5 us and every GPU activity (kernels, copies), start and duration in us from the
    call's start. Profiles ``calls`` calls (the first pays the profiler's buffer setup) and
    reports the last."""
    from torch.profiler import ProfilerActivity, profile, record_function

    args = (inputs["x_fp8"], inputs["topk_idx"], inputs["topk_w"], inputs["experts"])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            dist.barrier()
            torch.cuda.synchronize()
            with record_function(f"call{i}"):
                buf.dispatch(*args)
            torch.cuda.synchronize()
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    mark = next(e for e in events if e.name == f"call{calls - 1}")
    t0, t1 = mark.time_range.start, mark.time_range.end
    cpu = [e for e in events if e.device_type.name == "CPU" and t0 <= e.time_range.start <= t1]
    gpu = [e for e in events if e.device_type.name != "CPU" and e.time_range.start >= t0]
    sync = next((e.time_range.start for e in cpu if e.name == "cudaMemcpyAsync"), float("inf"))
    before = sum(1 for e in cpu if e.name in _LAUNCH and e.time_range.start < sync)
    after = sum(1 for e in cpu if e.name in _LAUNCH and e.time_range.start > sync)
    timeline = [
        (
            ("GPU " if e.device_type.name != "CPU" else "") + e.name[:60],
            round(e.time_range.start - t0, 1),
            round(e.time_range.elapsed_us(), 1),
        )
        for e in sorted(cpu + gpu, key=lambda e: e.time_range.start)
        if e.device_type.name != "CPU" or e.time_range.elapsed_us() >= 5.0
    ]
    return {
        "launches_before_sync": before,
        "launches_after_sync": after,
        "call_us": round(t1 - t0, 1),
        "timeline": timeline,
    }


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


def _pipelined(buf, inputs: dict, calls: int, spin_ms: float = 3.0) -> dict:
    """GPU time a dispatch adds behind queued work: ``bench dispatch``'s aligned timing (each
    call behind a one-element all_reduce and a GPU spin, CUDA events around it) with a
    ``spin_ms`` spin, longer than the host's work before the sync, so that only what the GPU
    must wait for counts: the layout, the count exchange, the host's wake-up and its work after
    the sync, the payload. Median."""
    from ptxtrain.bench.dispatch import _time

    args = (inputs["x_fp8"], inputs["topk_idx"], inputs["topk_w"], inputs["experts"])
    us = _time(lambda: buf.dispatch(*args), calls, 0, spin_us=spin_ms * 1e3)
    return {"pipelined_us": statistics.median(us)}


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
        row = {
            "backend": backend,
            **_launches(buf, inputs),
            **_time(buf, inputs, ns.calls),
            **_pipelined(buf, inputs, ns.calls),
        }
        per_rank = [None] * world
        dist.all_gather_object(per_rank, row)
        rows.append(
            {
                "backend": backend,
                "per_rank": per_rank,
                "host_us_max": max(r["host_us"] for r in per_rank),
                "total_us_max": max(r["total_us"] for r in per_rank),
                "pipelined_us_max": max(r["pipelined_us"] for r in per_rank),
            }
        )
        del buf
        torch.cuda.synchronize()
    if rank == 0:
        for r in rows:
            print(f"{r['backend']} timeline of one call on rank 0 (name, start us, us):")
            for name, start, dur in r["per_rank"][0]["timeline"][:90]:
                print(f"  {start:9.1f} {dur:9.1f}  {name}")
        for r in rows:
            lb = [x["launches_before_sync"] for x in r["per_rank"]]
            la = [x["launches_after_sync"] for x in r["per_rank"]]
            print(
                f"{r['backend']:>10}  launches before / after sync {lb} / {la}  "
                f"host {r['host_us_max']:.1f} us  total {r['total_us_max']:.1f} us  "
                f"pipelined {r['pipelined_us_max']:.1f} us (max rank)"
            )
        if ns.json:
            record = {"bench": "diag_dispatch_host", "env": environment(), "args": vars(ns)}
            with open(ns.json, "w") as f:
                json.dump({**record, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
