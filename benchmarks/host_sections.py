"""Where the host (CPU) time of a training step goes, without a profiler's distortion.

    python3 -m benchmarks.host_sections [--preset small] [--batch 32] [--seq 512] [--json OUT]
        [--env-ab NAME [--ab-rounds 2]]

Wraps a fixed list of functions (model blocks, autograd Functions, quantizer and GEMM dispatch,
kernel launches, the optimizer) with inclusive wall-clock timers (``time.perf_counter_ns``; a
recursion guard per thread, so a function calling itself is counted once), runs ``--steps``
training steps per precision after ``--warmup`` steps and prints, per function, calls per step,
host ms per step and µs per call. Also prints the step's host time (until the Python call
returns) beside its synced time: equal means host-bound. Then the same for one ``Fp8Linear``
forward + backward at ``--linear M N K`` against ``nn.Linear``.

The timers cost about a microsecond per call; numbers are host time, including time spent
waiting inside a call (e.g. a full launch queue or an allocator sync), which the synced step
time makes visible.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import threading
import time

import torch

# module:qualname of every timed function (missing ones are skipped, so the list can name
# functions of several versions).
TARGETS = [
    "ptxtrain.model.deepseek:DeepSeekV3.forward",
    "ptxtrain.model.deepseek:Block.forward",
    "ptxtrain.model.deepseek:MLA.forward",
    "ptxtrain.model.deepseek:RMSNorm.forward",
    "ptxtrain.moe.layer:MoE.forward",
    "ptxtrain.moe.layer:MLP.forward",
    "ptxtrain.moe.router:Router.forward",
    "ptxtrain.moe.experts:Experts.forward",
    "ptxtrain.nn.fp8_linear:Fp8Linear.forward",
    "ptxtrain.nn.fp8_linear:Fp8Linear._quantized_weight",
    "ptxtrain.nn.fp8_linear:_Fp8LinearFunction.forward",
    "ptxtrain.nn.fp8_linear:_Fp8LinearFunction.backward",
    "ptxtrain.nn.fp8_linear:_gemm_1d2d",
    "ptxtrain.nn.fp8_linear:_gemm_1d1d",
    "ptxtrain.nn.fp8_grouped:_Fp8GroupedLinearFunction.forward",
    "ptxtrain.nn.fp8_grouped:_Fp8GroupedLinearFunction.backward",
    "ptxtrain.nn.fp8_grouped:HostLayout.__init__",
    "ptxtrain.moe.fused:_RouteFn.forward",
    "ptxtrain.moe.fused:_RouteFn.backward",
    "ptxtrain.moe.fused:_PermuteFn.forward",
    "ptxtrain.moe.fused:_PermuteFn.backward",
    "ptxtrain.moe.fused:_UnpermuteFn.forward",
    "ptxtrain.moe.fused:_UnpermuteFn.backward",
    "ptxtrain.quant:per_token_cast_to_fp8",
    "ptxtrain.quant:per_token_cast_to_fp8_t",
    "ptxtrain.quant:per_token_cast_to_fp8_both",
    "ptxtrain.quant:per_block_cast_to_fp8",
    "ptxtrain.quant:per_block_cast_to_fp8_both",
    "ptxtrain.quant:select_backend",
    "ptxtrain.quant.cuda:_launch",
    "ptxtrain.quant.cuda:launch",
    "ptxtrain.gemm:select_backend",
    "ptxtrain.gemm.cublas:fp8_gemm_nt_unchecked",
    "ptxtrain.gemm.cublas:fp8_gemm_nt_1d1d_unchecked",
    "ptxtrain.gemm.ptx:launch_gemm",
    "ptxtrain.gemm.triton:fp8_gemm_nt_unchecked",
    "ptxtrain.gemm.triton:fp8_gemm_nt_1d1d_unchecked",
    "ptxtrain.jit.launch:make_tma_2d_desc",
    "ptxtrain.jit.launch:BoundLaunch.__call__",
    "ptxtrain.gemm.triton:_launch",
    "ptxtrain.gemm.triton:_gemm_checked",
    "triton.runtime.jit:JITFunction.run",
    "ptxtrain.gemm.grouped:_contiguous_triton",
    "ptxtrain.gemm.grouped:_k_grouped_triton",
    "ptxtrain.gemm.grouped:m_grouped_fp8_gemm_nt_contiguous",
    "ptxtrain.gemm.grouped:k_grouped_fp8_gemm_nt_contiguous",
    "ptxtrain.moe.experts:Experts._forward_fp8",
    "ptxtrain.moe.layer:MoE._routed",
    "ptxtrain.optim.adamw:AdamW.step",
    "ptxtrain.optim.adamw:AdamW.clip_grad_norm_",
    "ptxtrain.optim.adamw:AdamW._absorb_grad",
    "ptxtrain.optim.adamw:AdamW.zero_grad",
    "torch.autograd:backward",
    "torch:_scaled_mm",
]


class Sections:
    """Inclusive host-time accumulators for wrapped functions."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._local = threading.local()
        self._undo: list = []

    def _wrap(self, name: str, fn):
        sections = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            active = getattr(sections._local, "active", None)
            if active is None:
                active = sections._local.active = set()
            if name in active:
                return fn(*args, **kwargs)
            active.add(name)
            t0 = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter_ns() - t0
                active.discard(name)
                sections.ns[name] = sections.ns.get(name, 0) + dt
                sections.calls[name] = sections.calls.get(name, 0) + 1

        return timed

    def install(self, targets: list[str]) -> list[str]:
        """Wrap every target that exists; return the ones installed."""
        done = []
        for target in targets:
            mod_name, _, qual = target.partition(":")
            try:
                owner = importlib.import_module(mod_name)
            except ImportError:
                continue
            *path, attr = qual.split(".")
            for part in path:
                owner = getattr(owner, part, None)
                if owner is None:
                    break
            if owner is None or not hasattr(owner, attr):
                continue
            raw = owner.__dict__.get(attr) if isinstance(owner, type) else getattr(owner, attr)
            if isinstance(raw, staticmethod):
                wrapped = staticmethod(self._wrap(target, raw.__func__))
            else:
                wrapped = self._wrap(target, getattr(owner, attr) if raw is None else raw)
            self._undo.append((owner, attr, raw if raw is not None else getattr(owner, attr)))
            setattr(owner, attr, wrapped)
            done.append(target)
        return done

    def uninstall(self) -> None:
        for owner, attr, raw in reversed(self._undo):
            setattr(owner, attr, raw)
        self._undo.clear()

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()

    def table(self, per: int) -> list[dict]:
        rows = []
        for name, ns in sorted(self.ns.items(), key=lambda kv: -kv[1]):
            calls = self.calls[name]
            rows.append(
                {
                    "name": name,
                    "calls": calls / per,
                    "ms": ns / per / 1e6,
                    "us_per_call": ns / calls / 1e3,
                }
            )
        return rows


def _build(preset: str, precision: str, device: torch.device):
    """``(config, model, AdamW)`` of a preset as ``ptxtrain train`` builds them (seed 0)."""
    from ptxtrain.model import build_model, get_preset
    from ptxtrain.model.deepseek import convert_model_to_fp8_training
    from ptxtrain.nn import Fp8LinearConfig
    from ptxtrain.optim import AdamW

    cfg = get_preset(preset)
    model = build_model(cfg, dtype=torch.bfloat16, device=device, seed=0)
    if precision == "fp8":
        convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name("deepseek"))
    return cfg, model.train(), AdamW(model.parameters(), lr=1e-4)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _print(rows: list[dict], title: str) -> None:
    print(f"\n--- {title}")
    print(f"{'function':<64} {'calls':>8} {'ms':>9} {'µs/call':>9}")
    for r in rows:
        print(f"{r['name']:<64} {r['calls']:8.1f} {r['ms']:9.2f} {r['us_per_call']:9.1f}")


def step_sections(sections, preset, precision, batch, seq, warmup, steps, device) -> dict:
    """Host sections of ``steps`` training steps (forward, backward, clip, AdamW, zero_grad)."""

    cfg, model, opt = _build(preset, precision, device)
    g = torch.Generator(device=device).manual_seed(0)
    data = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=g, device=device)
    x, y = data[:, :-1], data[:, 1:]

    def one() -> float:
        t0 = time.perf_counter()
        model(x, y).loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(warmup):
        one()
    _sync(device)
    sections.reset()
    host, synced = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        host.append(one() * 1e3)
        _sync(device)
        synced.append((time.perf_counter() - t0) * 1e3)
    rows = sections.table(steps)
    _print(
        rows,
        f"{precision}: host {statistics.median(host):.1f} ms / synced "
        f"{statistics.median(synced):.1f} ms per step (median of {steps})",
    )
    return {
        "precision": precision,
        "host_ms": statistics.median(host),
        "step_ms": statistics.median(synced),
        "tokens_per_s": batch * seq / statistics.median(synced) * 1e3,
        "sections": rows,
    }


def linear_sections(sections, m, n, k, reps, device) -> dict:
    """Host sections of one Fp8Linear forward + backward (device idle before each call)."""
    from ptxtrain.nn import Fp8Linear

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    out = {}
    for name, layer in (
        ("bf16", torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)),
        ("fp8", Fp8Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)),
    ):
        fwd, bwd = [], []
        for i in range(reps + 3):
            _sync(device)
            if i == 3:
                sections.reset()
            t0 = time.perf_counter()
            yv = layer(x)
            t1 = time.perf_counter()
            yv.backward(dy)
            t2 = time.perf_counter()
            if i >= 3:
                fwd.append((t1 - t0) * 1e6)
                bwd.append((t2 - t1) * 1e6)
            layer.weight.grad = None
            x.grad = None
        rows = sections.table(reps)
        _print(
            rows,
            f"{name} Linear {m}x{n}x{k}: forward {statistics.median(fwd):.1f} µs, backward "
            f"{statistics.median(bwd):.1f} µs host (median of {reps})",
        )
        out[name] = {
            "fwd_us": statistics.median(fwd),
            "bwd_us": statistics.median(bwd),
            "sections": rows,
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--precisions", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--linear", type=int, nargs=3, default=[4096, 2112, 7168])
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument(
        "--env-ab",
        metavar="NAME",
        help="A/B an environment switch in this process: every case runs with NAME=1 and NAME=0, "
        "alternating, --ab-rounds times (each record says which)",
    )
    ap.add_argument("--ab-rounds", type=int, default=2)
    args = ap.parse_args()
    from ptxtrain.bench.timing import environment

    sections = Sections()
    installed = sections.install(TARGETS)
    print(f"timing {len(installed)} of {len(TARGETS)} functions", flush=True)
    device = torch.device(args.device)
    record = {**environment(), "bench": "host_sections", "preset": args.preset}
    record.update(batch=args.batch, seq=args.seq, steps=args.steps, cases=[])
    settings = [None]
    if args.env_ab:
        settings = ["1", "0"] * args.ab_rounds
        record.update(env_ab=args.env_ab, linear_ab=[])
    try:
        for value in settings:
            if value is not None:
                os.environ[args.env_ab] = value
                print(f"=== {args.env_ab}={value}", flush=True)
            for precision in args.precisions:
                case = step_sections(
                    sections,
                    args.preset,
                    precision,
                    args.batch,
                    args.seq,
                    args.warmup,
                    args.steps,
                    device,
                )
                record["cases"].append({**case, "env": value})
            m, n, k = args.linear
            linear = linear_sections(sections, m, n, k, args.reps, device)
            if value is None:
                record["linear"] = {"m": m, "n": n, "k": k, **linear}
            else:
                record["linear_ab"].append({"m": m, "n": n, "k": k, "env": value, **linear})
    finally:
        sections.uninstall()  # the wrapped functions are module globals: always restore them
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
