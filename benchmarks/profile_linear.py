"""Where the time of one ``Fp8Linear`` forward + backward goes, per GPU kernel (torch.profiler),
for the DeepSeek-V3 layer shapes of ``ptxtrain bench linear`` (M = 4096 tokens).

    python3 -m benchmarks.profile_linear [--json OUT.json] [--iters 5]

Prints, per (N, K), each kernel's device time per fwd + bwd (µs, summed over its launches) next
to the BF16 ``nn.Linear``'s kernels. No L2 flush between iterations (unlike the bench), so the
totals read a little lower than ``bench linear``'s.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from ptxtrain._backend import sm_clock_khz
from ptxtrain.bench.linear import fwd_bwd_call  # the timed call of `ptxtrain bench linear`
from ptxtrain.bench.timing import L2_FLUSH_BYTES, environment
from ptxtrain.nn import Fp8Linear, Fp8LinearConfig
from ptxtrain.testing.shapes import DSV3_DENSE_NK


def kernel_times(run, iters: int) -> dict[str, float]:
    """µs of device time per call of ``run``, per kernel name."""
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            out[evt.name[:90]] += evt.device_time / iters
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def timeline(run, sleep_us: float = 2000.0) -> list[dict]:
    """The kernels of one call of ``run`` as the bench times it (L2 flushed, then a device sleep
    long enough for the host to enqueue the whole call): name, start and end in µs from the
    first kernel's start, and the idle gap before each (the device waiting between kernels)."""
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    cycles = int(sleep_us * sm_clock_khz(0) / 1e3)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        flush.zero_()
        torch.cuda._sleep(cycles)
        run()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    # the call's kernels: everything after the sleep
    last_sleep = max(
        i for i, e in enumerate(kernels) if "sleep" in e.name.lower() or "spin" in e.name.lower()
    )
    kernels = kernels[last_sleep + 1 :]
    t0 = kernels[0].time_range.start
    out, prev_end = [], t0
    for e in kernels:
        start, end = e.time_range.start - t0, e.time_range.end - t0
        out.append(dict(name=e.name[:90], start=start, end=end, gap=start - (prev_end - t0)))
        prev_end = e.time_range.end
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--m", type=int, default=4096)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--recipe", default="deepseek", help="Fp8Linear recipe (ptxtrain.nn.RECIPES)")
    p.add_argument(
        "--timeline",
        action="store_true",
        help="also one bench-timed call per layer: each kernel's start / end and the idle gaps",
    )
    args = p.parse_args()
    rows = []
    for n, k in DSV3_DENSE_NK:
        bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        fp8 = Fp8Linear.from_linear(bf16, Fp8LinearConfig.from_recipe_name(args.recipe))
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.m, n, device="cuda", dtype=torch.bfloat16)
        row = {"m": args.m, "n": n, "k": k, "recipe": args.recipe}
        for name, layer in (("bf16", bf16), ("fp8", fp8)):
            times = kernel_times(fwd_bwd_call(layer, x, dy), args.iters)
            row[name] = times
            if args.timeline:
                tl = timeline(fwd_bwd_call(layer, x, dy))
                row[f"{name}_timeline"] = tl
                busy = sum(k["end"] - k["start"] for k in tl)
                print(
                    f"  timeline {name}: span {tl[-1]['end']:.1f} µs, kernels {busy:.1f}, gaps "
                    + " ".join(f"{k['gap']:.1f}" for k in tl),
                    flush=True,
                )
            print(f"--- {args.m} x {n} x {k} {name}: {sum(times.values()):.1f} µs", flush=True)
            for kname, us in times.items():
                print(f"  {us:8.1f}  {kname}")
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"env": environment(), "bench": "profile_linear", "rows": rows}, f)


if __name__ == "__main__":
    main()
