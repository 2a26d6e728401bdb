"""Where one training step goes on a GPU: ms per step, tokens/s and MFU per precision, then the
step's GPU time by category (GEMM, attention, quantize, optimizer, MoE layout, elementwise, idle).

    python3 -m benchmarks.profile_step [--preset medium] [--batch-size 8] [--seq-len 2048]
        [--grad-accum-steps 4] [--precisions bf16 fp8] [--no-cuda-graphs] [--json OUT]

Each precision builds the model as ``ptxtrain train`` does (same seed, FP8 swap, fused AdamW) and
runs the very step object of ``ptxtrain train`` (:class:`ptxtrain.train.step.SingleDeviceStep`:
eager warm-up, then a captured CUDA graph unless ``--no-cuda-graphs``). ``--warmup`` steps (JIT
compiles, capture) are followed by ``--steps`` steps enqueued back to back and timed as a whole
(host clock around a synchronized span: the host may run ahead, as in training). Then two more
steps run under ``torch.profiler`` and every kernel is put in a category
(:mod:`benchmarks.step_categories`); ``idle`` is the span in which no kernel ran.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.step_categories import breakdown, categorize, format_breakdown, kernels_of


def _build(args, precision: str, device: torch.device):
    from ptxtrain.model import build_model
    from ptxtrain.model.deepseek import convert_model_to_fp8_training
    from ptxtrain.nn import Fp8LinearConfig
    from ptxtrain.optim import AdamW
    from ptxtrain.train import TrainArgs, model_config
    from ptxtrain.train.runtime import param_groups
    from ptxtrain.train.step import SingleDeviceStep

    targs = TrainArgs(preset=args.preset, mtp=not args.no_mtp, config=args.config)
    cfg = model_config(targs)
    model = build_model(cfg, dtype=torch.bfloat16, device=device, seed=0)
    if precision == "fp8":
        convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name(args.fp8_recipe))
    model.train()
    opt = AdamW(param_groups(model, 0.1), lr=1e-4)
    step = SingleDeviceStep(
        model, opt, grad_accum_steps=args.grad_accum_steps, grad_clip=1.0, device=device,
        cuda_graphs=not args.no_cuda_graphs,
    )  # fmt: skip
    return cfg, model, step


def _one(train_step, batches, i):
    t = batches[i % len(batches)]
    return train_step(t[:, :-1], t[:, 1:], 1e-4)


def run_case(args, precision: str, device: torch.device) -> dict:
    from ptxtrain.train.mfu import model_flops_per_token, peak_bf16_flops

    cfg, model, train_step = _build(args, precision, device)
    rows = args.batch_size * args.grad_accum_steps
    g = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, cfg.vocab_size, (rows, args.seq_len + 1), generator=g) for _ in range(4)
    ]

    for i in range(args.warmup):
        _one(train_step, batches, i)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        out = _one(train_step, batches, i)
    loss = float(out["lm_loss"])  # the span ends when the last step's loss is on the host
    ms = (time.perf_counter() - t0) * 1e3 / args.steps
    tokens = rows * args.seq_len
    flops = model_flops_per_token(cfg, args.seq_len)
    peak = peak_bf16_flops(device)
    result = {
        "precision": precision,
        "mode": train_step.mode,
        "graphs_off_reason": train_step.graphs_off_reason,
        "step_ms": round(ms, 2),
        "tokens_per_s": round(tokens / ms * 1e3, 1),
        "mfu": round(flops * tokens / ms * 1e3 / peak, 4) if peak else None,
        "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
        # What stays between steps: weights, optimizer state, gradient buffers, FP8 weight caches
        # and the CUDA graph's pool; the peak minus this is the step's transient memory.
        "resident_mem_gib": round(torch.cuda.memory_allocated(device) / 2**30, 2),
        "loss": loss,
    }
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(2):
            _one(train_step, batches, i)
        torch.cuda.synchronize(device)
    kernels, span = kernels_of(prof)
    per_step = {k: v / 2 for k, v in breakdown(kernels, span).items()}
    result["breakdown_ms"] = {k: round(v, 2) for k, v in per_step.items()}
    totals: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name, start, end in kernels:
        totals[name] = totals.get(name, 0.0) + (end - start) / 2
        calls[name] = calls.get(name, 0) + 1
    top = sorted(totals.items(), key=lambda kv: -kv[1])[: args.kernels]
    # [category, ms per step, launches per step, name]: the launch count tells which call a
    # kernel is (e.g. 28 = once per MoE layer and micro-batch of the medium preset); template
    # arguments sit at the end of long names, so the name keeps 400 characters.
    result["kernels_ms"] = [[categorize(n), round(ms, 3), calls[n] // 2, n[:400]] for n, ms in top]
    result["profiled_step_ms"] = round(span / 2, 2)
    print(
        f"\n{precision} ({train_step.mode}): {ms:.1f} ms/step, "
        f"{result['tokens_per_s']:,.0f} tokens/s, MFU {result['mfu']}, "
        f"peak {result['peak_mem_gib']} GiB (resident {result['resident_mem_gib']} GiB)"
    )
    print(format_breakdown(per_step, span / 2))
    if args.top:
        ka = prof.key_averages()
        print(ka.table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
    del model, train_step
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--config", default=None, help="DeepSeekV3Config fields (JSON file)")
    ap.add_argument("--no-mtp", action="store_true")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--grad-accum-steps", type=int, default=4)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--fp8-recipe", default="deepseek")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--top", type=int, default=0, help="also print the top N kernels")
    ap.add_argument("--kernels", type=int, default=60, help="kernels listed in the JSON record")
    ap.add_argument("--json")
    args = ap.parse_args()
    from ptxtrain.bench.timing import environment

    device = torch.device("cuda")
    results = [run_case(args, p, device) for p in args.precisions]
    if args.json:
        record = {
            **environment(),
            "bench": "profile_step",
            "args": vars(args),
            "cases": results,
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
