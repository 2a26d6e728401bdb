"""``ptxtrain bench linear``: forward + backward of ``Fp8Linear`` vs BF16 ``nn.Linear``.

Both layers hold the same BF16 weight; each timed call runs the forward and the backward (input
and weight gradients) for M tokens. The FP8 side is timed twice:

- ``fp8``: the weight's 128x128 quantization (W and Wᵀ) cached, as in every micro-batch of an
  optimizer step after its first (``Fp8Linear`` reuses it until the weight changes);
  the activations and gradients are quantized in every call;
- ``fp8_requant_w``: the weight quantized in every call too, as with one micro-batch per step.

With ``n`` micro-batches per step a step's mean lies between the two, 1/n of the way from
``fp8`` to ``fp8_requant_w``. The SQNR of the output and of both gradients against an fp32
``nn.Linear`` is reported beside the time, as torchao does (bars: output ≥ 25 dB).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.testing import sqnr_db
from ptxtrain.testing.shapes import DSV3_DENSE_NK


def fwd_bwd_call(
    layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, *, requant_w: bool = False
) -> Callable[[], None]:
    """The call :func:`bench_linear` times (and ``benchmarks/profile_linear.py`` profiles): a
    function that runs ``layer(x).backward(dy)`` after clearing ``layer.weight.grad`` and
    ``x.grad``, so every call computes the input and weight gradients afresh.

    Args:
        layer: an ``nn.Linear`` or ``Fp8Linear`` with K inputs and N outputs.
        x: [M, K] input with ``requires_grad``, on the layer's device and in its dtype.
        dy: [M, N] output gradient.
        requant_w: before each call, mark cached FP8 weight quantizations stale
            (:func:`ptxtrain.nn.invalidate_fp8_weight_caches`), so an ``Fp8Linear`` quantizes
            its weight in every call, as with one micro-batch per step.

    Checks nothing itself: the returned function raises what the layer's forward and backward
    raise.
    """
    from ptxtrain.nn import invalidate_fp8_weight_caches

    def run():
        layer.weight.grad = None
        x.grad = None
        if requant_w:  # drop the cached weight quantization (host only)
            invalidate_fp8_weight_caches()
        layer(x).backward(dy)

    return run


# The quantizers Fp8Linear runs (x and dy: 1x128 and 128x1; W: 128x128 and its transpose).
_LINEAR_QUANT_OPS = ("per_token_cast_to_fp8_both", "per_block_cast_to_fp8_both")


def bench_linear(
    m: int = 4096, shapes=DSV3_DENSE_NK, *, recipe: str = "deepseek", repeats: int = 30
) -> dict:
    """Time fwd+bwd of ``Fp8Linear(recipe)`` and BF16 ``nn.Linear`` per (N, K); SQNR vs fp32."""
    from ptxtrain import gemm, quant
    from ptxtrain.nn import Fp8Linear, Fp8LinearConfig

    timer = GpuTimer(repeats=repeats)
    config = Fp8LinearConfig.from_recipe_name(recipe)
    rows = []
    for n, k in shapes:
        ref = nn.Linear(k, n, bias=False, device="cuda")  # fp32 reference
        bf16 = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            bf16.weight.copy_(ref.weight)
        fp8 = Fp8Linear.from_linear(bf16, config)  # shares bf16's weight
        x32 = torch.randn(m, k, device="cuda", requires_grad=True)
        dy32 = torch.randn(m, n, device="cuda")
        x = x32.detach().bfloat16().requires_grad_()
        dy = dy32.bfloat16()
        ref(x32).backward(dy32)
        y = fp8(x)
        y.backward(dy)
        row = {
            "m": m,
            "n": n,
            "k": k,
            "recipe": recipe,
            "backends": {
                "gemm_1d2d": gemm.select_backend("1d2d", m, n, k, x.device),
                "gemm_1d1d": gemm.select_backend("1d1d", n, k, m, x.device),
                "quant": {op: quant.select_backend(x, op) for op in _LINEAR_QUANT_OPS},
            },
            "sqnr_db": {
                "y": sqnr_db(ref(x32).detach(), y.detach()),
                "dx": sqnr_db(x32.grad, x.grad),
                "dw": sqnr_db(ref.weight.grad, bf16.weight.grad),
            },
        }
        row["us"], row["host_us"] = {}, {}
        timed = (("bf16", bf16, False), ("fp8", fp8, False), ("fp8_requant_w", fp8, True))
        for name, layer, requant_w in timed:
            row["us"][name] = timer(fwd_bwd_call(layer, x, dy, requant_w=requant_w))
            row["host_us"][name] = timer.last_host_us
        row["speedup_fp8_over_bf16"] = row["us"]["bf16"] / row["us"]["fp8"]
        row["speedup_fp8_requant_w_over_bf16"] = row["us"]["bf16"] / row["us"]["fp8_requant_w"]
        rows.append(row)
        del ref, bf16, fp8, x32, dy32, x, dy, y

    def geo(key: str) -> float:
        vals = [r[key] for r in rows]
        return float(torch.tensor(vals).log().mean().exp()) if vals else float("nan")

    return {
        "bench": "linear_fwd_bwd",
        "env": environment(),
        "rows": rows,
        "summary": {
            "geomean_speedup_fp8_over_bf16": geo("speedup_fp8_over_bf16"),
            "geomean_speedup_fp8_requant_w_over_bf16": geo("speedup_fp8_requant_w_over_bf16"),
        },
        "method": "CUDA events around forward+backward, L2 flushed, launch hidden (device sleep "
        "of at least twice the host time), median; host_us = CPU time to enqueue one fwd+bwd; "
        "fp8: the weight's quantization cached (every micro-batch of a step after the first), "
        "fp8_requant_w: the weight quantized in every call (one micro-batch per step)",
    }


def format_table(result: dict) -> str:
    """Render a linear results record."""
    lines = [
        f"{'M':>6} {'N':>6} {'K':>6} {'bf16 µs':>9} {'fp8 µs':>9} {'speedup':>8} "
        f"{'fp8 +W µs':>9} {'speedup':>8} "
        f"{'host bf16':>9} {'host fp8':>9} {'SQNR y':>7} {'dx':>5} {'dw':>5}  backends"
    ]
    for r in result["rows"]:
        s = r["sqnr_db"]
        lines.append(
            f"{r['m']:>6} {r['n']:>6} {r['k']:>6} {r['us']['bf16']:9.1f} {r['us']['fp8']:9.1f} "
            f"{r['speedup_fp8_over_bf16']:8.2f} {r['us']['fp8_requant_w']:9.1f} "
            f"{r['speedup_fp8_requant_w_over_bf16']:8.2f} {r['host_us']['bf16']:9.1f} "
            f"{r['host_us']['fp8']:9.1f} {s['y']:7.1f} {s['dx']:5.1f} {s['dw']:5.1f}  "
            f"{r['backends']}"
        )
    for key, val in result["summary"].items():
        lines.append(f"{key}: {val:.3f}")
    return "\n".join(lines)
