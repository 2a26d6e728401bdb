"""Where one training step of a preset goes, on a GPU machine: step ms per precision and backend,
then a torch.profiler table of the slowest step kind.

    python3 -m benchmarks.profile_step [--preset small] [--batch 32] [--seq 512] [--json OUT]

For each case (precision x ``PTXTRAIN_GEMM_BACKEND``) it builds the model as ``ptxtrain train``
does (same seed, FP8 swap), runs ``--warmup`` steps (JIT compiles, caches), then times ``--steps``
forward + backward + AdamW steps with CUDA synchronisation around each (median ms). The last case
is then profiled for 2 steps: the top CUDA kernels by total device time and the top host ops by
self CPU time, so a slow step shows whether the GPU or the host is the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def _build(preset: str, precision: str, device: torch.device):
    from ptxtrain.model import build_model, get_preset
    from ptxtrain.model.deepseek import convert_model_to_fp8_training
    from ptxtrain.nn import Fp8LinearConfig
    from ptxtrain.optim import AdamW

    cfg = get_preset(preset)
    model = build_model(cfg, dtype=torch.bfloat16, device=device, seed=0)
    if precision == "fp8":
        convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name("deepseek"))
    model.train()
    opt = AdamW(model.parameters(), lr=1e-4)
    return cfg, model, opt


def _step(model, opt, x, y) -> None:
    model(x, y).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_case(preset, precision, backend, batch, seq, warmup, steps, device) -> dict:
    """Median ms of one step (forward + backward + optimizer) after ``warmup`` steps."""
    if backend:
        os.environ["PTXTRAIN_GEMM_BACKEND"] = backend
    else:
        os.environ.pop("PTXTRAIN_GEMM_BACKEND", None)
    cfg, model, opt = _build(preset, precision, device)
    g = torch.Generator(device=device).manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g, device=device)
        for _ in range(4)
    ]
    times = []
    for i in range(warmup + steps):
        t = batches[i % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        _step(model, opt, t[:, :-1], t[:, 1:])
        _sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)
    return {
        "precision": precision,
        "backend": backend or "auto",
        "step_ms": round(ms, 2),
        "tokens_per_s": round(batch * seq / ms * 1e3, 1),
        "all_ms": [round(t, 2) for t in times],
        "model": model,
        "opt": opt,
        "batches": batches,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument(
        "--cases", nargs="+", default=["bf16:", "fp8:triton", "fp8:"], help="PRECISION:BACKEND"
    )
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument(
        "--deterministic",
        action="store_true",
        help="everything inside ptxtrain.train.loop.deterministic_mode() (ptxtrain train "
        "--deterministic)",
    )
    args = ap.parse_args()
    from ptxtrain.train.loop import deterministic_mode

    with deterministic_mode(args.deterministic):
        _run(args)


def _run(args) -> None:
    from ptxtrain.bench.timing import environment

    device = torch.device(args.device)
    results, last = [], None
    for case in args.cases:
        precision, _, backend = case.partition(":")
        r = time_case(
            args.preset, precision, backend, args.batch, args.seq, args.warmup, args.steps, device
        )
        print(
            f"{precision:>5} {r['backend']:>7}: {r['step_ms']:9.1f} ms/step "
            f"{r['tokens_per_s']:>10,.0f} tokens/s  (steps {r['all_ms']})",
            flush=True,
        )
        last = r  # the previous case's model and optimizer are freed here
        results.append({k: v for k, v in r.items() if k not in ("model", "opt", "batches")})
    from torch.profiler import ProfilerActivity, profile

    model, opt, batches = last["model"], last["opt"], last["batches"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            t = batches[i]
            _step(model, opt, t[:, :-1], t[:, 1:])
        _sync(device)
    ka = prof.key_averages()
    print(f"\n--- profile of {args.cases[-1]}: top CUDA kernels (2 steps)")
    print(ka.table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    print("\n--- top host ops by self CPU time (2 steps)")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=70))
    if args.json:
        record = {
            **environment(),
            "bench": "profile_step",
            "preset": args.preset,
            "batch": args.batch,
            "seq": args.seq,
            "method": f"{args.warmup} warm-up steps, then median of {args.steps} synced steps",
            "deterministic": args.deterministic,
            "cases": results,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
