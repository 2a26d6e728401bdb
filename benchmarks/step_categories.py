"""Where a training step's GPU time goes, by kind of kernel, from a torch.profiler trace.

Each CUDA kernel of the profiled steps falls in one category by its name (first match wins):

=============  ================================================================================
gemm           matrix products: ptxtrain's PTX / Triton / Gluon FP8 GEMMs (plain and grouped),
               cuBLAS / CUTLASS BF16 and FP32 GEMMs (``nvjet``, ``xmma``, ``cutlass``, ``gemm``)
attention      the attention core (FlashAttention, cuDNN, memory-efficient SDPA kernels)
quantize       FP8 casts: the CUDA cast-transpose kernels (``cast_fp8``) and Triton quantizers
optimizer      the AdamW update and gradient clipping (fused, foreach and multi-tensor kernels)
moe_layout     routing, the experts' layout, scatter / combine, sorts and index kernels
elementwise    everything else (norms, SwiGLU, RoPE, casts, copies, reductions, fills)
idle           the step's wall time in which no kernel ran (host overhead, launch gaps, syncs)
=============  ================================================================================

``idle`` is the step span minus the union of the kernel intervals, so the categories (minus
overlaps between concurrent kernels, which are rare in one-stream training) add up to the span.
"""

from __future__ import annotations

import re

from ptxtrain.parallel.timeline import union_length

CATEGORIES = ("gemm", "attention", "quantize", "optimizer", "moe_layout", "elementwise", "idle")

# (category, pattern) in match order; names are matched case-insensitively.
_RULES: tuple[tuple[str, str], ...] = (
    ("optimizer", r"adam|multi_tensor|foreach_norm|_fused_adamw|clip_grad"),
    ("attention", r"flash|fmha|cudnn|attention|sdpa|mem_eff"),
    ("quantize", r"cast_fp8|quant|cast_transpose"),
    (
        "gemm",
        r"gemm|nvjet|xmma|cutlass|cublas|wgmma|_mm_|matmul|grouped_mm|splitk|"
        r"grouped_contiguous|grouped_masked|k_grouped",
    ),
    (
        "moe_layout",
        r"route|layout|unpermute|permute|scatter|gather|index|sort|radix|cumsum|histogram|"
        r"bincount|repeat_interleave",
    ),
)


def categorize(name: str) -> str:
    """The category of one kernel name (see the module table; ``elementwise`` by default)."""
    low = name.lower()
    for category, pattern in _RULES:
        if re.search(pattern, low):
            return category
    return "elementwise"


def breakdown(kernels: list[tuple[str, float, float]], span: float) -> dict[str, float]:
    """Per-category time from ``kernels`` = ``(name, start, end)`` (any one time unit) inside a
    span of length ``span``; ``idle`` = ``span`` minus the union of the intervals (>= 0)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, start, end in kernels:
        out[categorize(name)] += end - start
    out["idle"] = max(0.0, span - union_length((s, e) for _, s, e in kernels))
    return out


def format_breakdown(per_step_ms: dict[str, float], step_ms: float) -> str:
    """A table of ms per step and share of the step, one category per line."""
    lines = [f"{'category':<12} {'ms/step':>9} {'share':>7}"]
    for category in CATEGORIES:
        ms = per_step_ms.get(category, 0.0)
        share = ms / step_ms if step_ms else 0.0
        lines.append(f"{category:<12} {ms:9.2f} {share:7.1%}")
    lines.append(f"{'step (wall)':<12} {step_ms:9.2f}")
    return "\n".join(lines)


def kernels_of(prof) -> tuple[list[tuple[str, float, float]], float]:
    """``(kernels, span)`` in ms from a finished ``torch.profiler.profile``: every CUDA kernel
    event as ``(name, start, end)`` and the span from the first to the last kernel or CPU op."""
    events = prof.events()
    kernels, lo, hi = [], None, None
    for ev in events:
        start = ev.time_range.start / 1e3
        end = ev.time_range.end / 1e3
        lo = start if lo is None else min(lo, start)
        hi = end if hi is None else max(hi, end)
        if getattr(ev, "device_type", None) is not None and str(ev.device_type).endswith("CUDA"):
            kernels.append((ev.name, start, end))
    return kernels, (hi - lo) if lo is not None else 0.0
