"""Training-step time of the ``small`` model with expert parallelism, per Buffer backend.

    torchrun --nproc-per-node R -m benchmarks.diag_ep_step [--steps 40] [--warmup 10]
        [--batch 8] [--seq 128] [--precision fp8] [--backends all_to_all nvlink] [--no-ep]
        [--profile] [--json OUT]

Each rank builds the same model (seed 0), splits its experts over the ``R`` ranks
(``enable_expert_parallel``, one shared Buffer), converts it to FP8 training, then runs
``--warmup`` + ``--steps`` forward + backward passes on fresh random tokens (``--batch`` x
``--seq`` per rank; the routing, hence every dispatch's row counts, changes from step to step,
as in training), synchronizing the GPU after each; the median ms per timed step is reported
(max over ranks). With ``R = 1`` the MoE layers still go through the Buffer (a one-rank
dispatch: layout, count exchange, host sync, payload), which is what a single GPU can say about
the dispatch's host path inside a training step. ``--no-ep``: the same model without the
Buffer. ``--profile``: rank 0 also prints two steps' ops by self CPU time and the sync-capable
runtime calls (device-to-host copies, synchronizes) by Python call site. Only public APIs, so
two trees compare by running this script from each.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist


def _step_ms(model, vocab: int, batch: int, seq: int, steps: int, warmup: int, seed: int):
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(seed)
    times = []
    for i in range(warmup + steps):
        ids = torch.randint(0, vocab, (batch, seq + 1), generator=gen, device=dev)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(ids[:, :-1], labels=ids[:, 1:])
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times), max(times)


def _profile(model, vocab: int, batch: int, seq: int) -> str:
    """Two steps under torch.profiler: ops by self CPU time (where the host spends a step)."""
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda", torch.cuda.current_device())
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(2):
            ids = torch.randint(0, vocab, (batch, seq + 1), device=dev)
            model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70
    )
    # Device-to-host copies (each one a host sync) by Python call site.
    syncs = [
        e
        for e in prof.key_averages(group_by_stack_n=6)
        if e.key in ("cudaMemcpyAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize")
    ]
    lines = [
        f"{e.count:5d} x {e.key}: " + " <- ".join(s for s in e.stack if "ptxtrain" in s)[:400]
        for e in sorted(syncs, key=lambda e: -e.count)[:25]
    ]
    return table + "\nsync-capable runtime calls in 2 steps, by call site:\n" + "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--precision", choices=("bf16", "fp8"), default="fp8")
    p.add_argument("--backends", nargs="+", default=["all_to_all", "nvlink"])
    p.add_argument("--profile", action="store_true", help="rank 0: host-time table of 2 steps")
    p.add_argument("--no-ep", action="store_true", help="the same model without the Buffer")
    p.add_argument("--json", default=None)
    ns = p.parse_args()

    from ptxtrain.bench.timing import environment
    from ptxtrain.model import build_model, get_preset
    from ptxtrain.model.deepseek import convert_model_to_fp8_training
    from ptxtrain.nn import Fp8LinearConfig

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    config = get_preset("small")
    rows = []
    for backend in ns.backends:
        row = {"backend": backend}
        try:
            model = build_model(config, dtype=torch.bfloat16, device=dev, seed=0)
            if not ns.no_ep:
                model.enable_expert_parallel(backend=backend, max_tokens=ns.batch * ns.seq)
            if ns.precision == "fp8":
                convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name("deepseek"))
            model.train()
            med, lo, hi = _step_ms(
                model, config.vocab_size, ns.batch, ns.seq, ns.steps, ns.warmup, seed=rank
            )
            row.update(ms_median=med, ms_min=lo, ms_max=hi)
            if ns.profile:
                row["profile"] = _profile(model, config.vocab_size, ns.batch, ns.seq)
        except Exception as e:  # reported per backend; the other backend still runs
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        per_rank = [None] * world
        dist.all_gather_object(per_rank, row)
        rows.append({"backend": backend, "per_rank": per_rank})
        if rank == 0:
            errs = [r["error"] for r in per_rank if "error" in r]
            if errs:
                print(f"{backend:>10}  error: {errs[0]}")
            else:
                med = max(r["ms_median"] for r in per_rank)
                print(
                    f"{backend:>10}  {world} rank(s), {ns.batch} x {ns.seq} tokens per rank, "
                    f"{ns.precision}: {med:.2f} ms / step (median, max rank)"
                )
                if "profile" in per_rank[0]:
                    print(per_rank[0]["profile"])
        model = None
        torch.cuda.synchronize()
    if rank == 0 and ns.json:
        record = {"bench": "diag_ep_step", "env": environment(), "args": vars(ns)}
        with open(ns.json, "w") as f:
            json.dump({**record, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
