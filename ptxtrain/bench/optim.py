"""``ptxtrain bench optim``: one AdamW step over N parameters, against the copy bandwidth.

Timed in one process with docs/design.md §6's method (CUDA events, L2 flushed, launch hidden,
warm-up, median), over the same parameter shapes (``--mix``: the ``small`` preset's tensors or the
DeepSeek-V3 projections, repeated up to ``--numel`` elements):

- ``ptxtrain_fused``: :class:`~ptxtrain.optim.AdamW`'s fused path, BF16 weights, FP32 masters,
  BF16 moments, FP32 gradient buffers: ``step()``, and ``clip_grad_norm_() + step()``;
- ``ptxtrain_foreach``: the same optimizer with ``fused=False`` (the ``torch._foreach_*``
  path), ``step()``;
- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` over FP32 parameters of the same shapes,
  ``step()``, and ``torch.nn.utils.clip_grad_norm_() + step()`` (its foreach path on CUDA);
- ``copy``: a device-to-device copy of a 1 GiB buffer.

Bytes per parameter element are the fewest each update must move (read + write):

- ptxtrain step: read gradient 4, master 4, moments 2 + 2; write master 4, moments 2 + 2,
  BF16 weight 2: 22 (the foreach path does the same update, so it is charged the same 22);
- torch fused step (FP32 everything): read weight, gradient, moments 4 x 4; write weight and
  moments 3 x 4: 28;
- clipping adds one read of the gradient: 4 more.

GB/s is those bytes over the median time; ``/copy`` divides by the copy's GB/s (bytes read +
written) measured in the same run. ``vs torch`` is torch fused's time over the row's time.
Every timed clip leaves a coefficient pending; the untimed setup before each timed call resets
it (``zero_grad`` and marking every gradient ready, what a backward pass does), so each call
does exactly one clip and one step. ``--sweep`` also times the fused step for a few
(elements per program, warps) pairs.
"""

from __future__ import annotations

import gc

import torch

from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.testing.shapes import DSV3_DENSE_NK, DSV3_EXTRA_NK

MIXES = ("small", "dsv3")
# (elements per program, warps) pairs timed by --sweep.
SWEEP = ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8))
_BYTES = {"ptxtrain": 22, "torch": 28, "clip": 4}
_COPY_BYTES = 1 << 30
_DEVICE = "cuda"  # tests run the orchestration on the CPU with a stand-in timer
METHOD = (
    "CUDA events, L2 flushed, launch hidden (device sleep of at least twice the host time), "
    "median; GB/s = bytes per parameter x numel / time (ptxtrain 22, torch fused FP32 28, "
    "clipping +4); copy = 1 GiB device-to-device, bytes read + written; setup before each "
    "timed ptxtrain clip (untimed): zero_grad + every gradient marked ready"
)


def unit_shapes(mix: str) -> list[tuple[int, ...]]:
    """The tensor shapes that ``mix`` repeats: the ``small`` preset model's parameters (211
    tensors, 94 M elements), or the DeepSeek-V3 projections with their norm vectors.

    Raises:
        ValueError: ``mix`` is not one of :data:`MIXES`.
    """
    if mix == "small":
        from ptxtrain.model import get_preset
        from ptxtrain.model.deepseek import DeepSeekV3

        with torch.device("meta"):  # shapes only, no memory
            model = DeepSeekV3(get_preset("small"))
        return [tuple(p.shape) for p in model.parameters()]
    if mix == "dsv3":
        return [*DSV3_DENSE_NK, *DSV3_EXTRA_NK, (7168,), (7168,), (1536,), (512,)]
    raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")


def shape_mix(numel: int, mix: str = "small") -> list[tuple[int, ...]]:
    """Shapes of ``mix`` repeated in order until they hold ``numel`` elements in total; the
    last is a 1-D remainder when the next shape would not fit.

    Raises:
        ValueError: ``numel`` < 1, or an unknown ``mix``.
    """
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    unit = unit_shapes(mix)
    shapes: list[tuple[int, ...]] = []
    total = 0
    while True:
        for shape in unit:
            n = int(torch.Size(shape).numel())
            if total + n > numel:
                if numel > total:
                    shapes.append((numel - total,))
                return shapes
            shapes.append(shape)
            total += n


def _gbs(n_bytes: float, us: float) -> float:
    return n_bytes / (us * 1e-6) / 1e9


def _ours(shapes, fused: bool):
    from ptxtrain.optim import AdamW

    params = [(torch.randn(s, device=_DEVICE) * 0.02).bfloat16().requires_grad_() for s in shapes]
    opt = AdamW(params, lr=1e-4, fused=fused)  # fused=True raises without Triton
    for p in params:
        p.grad = (torch.randn(p.shape, device=_DEVICE) * 1e-3).bfloat16()
    for p in params:  # into the FP32 buffers, as after a backward pass
        opt.grad_for(p)
    return params, opt


class _Rows(dict):
    """name -> {bytes_per_param, us, host_us, gbs} of the timed calls."""

    def __init__(self, timer: GpuTimer, numel: int) -> None:
        super().__init__()
        self.timer, self.numel = timer, numel

    def time(self, name: str, bytes_per_param: int, fn, setup=None) -> float:
        us = self.timer(fn, setup)
        self[name] = {
            "bytes_per_param": bytes_per_param,
            "us": us,
            "host_us": self.timer.last_host_us,
            "gbs": _gbs(bytes_per_param * self.numel, us),
        }
        return us


def _release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _time_copy(timer: GpuTimer) -> dict:
    src = torch.empty(_COPY_BYTES // 4, device=_DEVICE)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src))
    return {"bytes": 2 * _COPY_BYTES, "us": us, "gbs": _gbs(2 * _COPY_BYTES, us)}


def _time_fused(shapes, rows: _Rows, max_norm: float, sweep: bool) -> list[dict]:
    params, opt = _ours(shapes, fused=True)

    def regrad() -> None:  # what backward does: gradients present, no clip pending
        opt.zero_grad(set_to_none=True)
        for p in params:
            opt.mark_grad_ready(p)

    def clip_step() -> None:
        opt.clip_grad_norm_(max_norm)
        opt.step()

    rows.time("ptxtrain_fused", _BYTES["ptxtrain"], opt.step)
    rows.time("ptxtrain_fused+clip", _BYTES["ptxtrain"] + _BYTES["clip"], clip_step, regrad)
    swept = []
    for block, warps in SWEEP if sweep else ():
        opt._fused_block, opt._fused_warps = block, warps
        us = rows.timer(opt.step)
        swept.append({"block": block, "num_warps": warps, "us": us,
                      "gbs": _gbs(_BYTES["ptxtrain"] * rows.numel, us)})  # fmt: skip
    return swept


def _time_foreach(shapes, rows: _Rows) -> None:
    _, opt = _ours(shapes, fused=False)
    rows.time("ptxtrain_foreach", _BYTES["ptxtrain"], opt.step)


def _time_torch(shapes, rows: _Rows, max_norm: float) -> None:
    params = [(torch.randn(s, device=_DEVICE) * 0.02).requires_grad_() for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=_DEVICE) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)

    def clip_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)  # foreach on CUDA
        opt.step()

    rows.time("torch_fused", _BYTES["torch"], opt.step)
    rows.time("torch_fused+clip", _BYTES["torch"] + _BYTES["clip"], clip_step)


def bench_optim(
    numel: int = 1_000_000_000,
    mix: str = "small",
    *,
    repeats: int = 20,
    sweep: bool = False,
    max_norm: float = 1.0,
) -> dict:
    """Time the rows of the module docstring; return a results record.

    Raises:
        ValueError: ``numel`` < 1 or an unknown ``mix``.
    """
    shapes = shape_mix(numel, mix)
    timer = GpuTimer(repeats=repeats, warmup=5)
    rows = _Rows(timer, numel)
    copy = _time_copy(timer)
    # One optimizer at a time: each frees its buffers before the next is built.
    swept = _time_fused(shapes, rows, max_norm, sweep)
    _release()
    _time_foreach(shapes, rows)
    _release()
    _time_torch(shapes, rows, max_norm)
    _release()
    torch_us = rows["torch_fused"]["us"]
    for row in rows.values():
        row["frac_copy"] = row["gbs"] / copy["gbs"]
        row["speedup_vs_torch_fused"] = torch_us / row["us"]
    for row in swept:
        row["frac_copy"] = row["gbs"] / copy["gbs"]
    return {
        "bench": "optim",
        "env": environment(),
        "numel": numel,
        "mix": mix,
        "n_tensors": len(shapes),
        "max_norm": max_norm,
        "copy": copy,
        "rows": dict(rows),
        "sweep": swept,
        "method": METHOD,
    }


def format_table(result: dict) -> str:
    """Render an optim results record: ms, GB/s, fraction of copy, ratio to torch fused."""
    c = result["copy"]
    lines = [
        f"{result['numel']:,} parameters in {result['n_tensors']} tensors ({result['mix']} mix); "
        f"copy {c['gbs']:.0f} GB/s",
        f"{'':22} {'B/param':>7} {'ms':>8} {'host ms':>8} {'GB/s':>7} {'/copy':>6} {'vs torch':>8}",
    ]
    for name, r in result["rows"].items():
        lines.append(
            f"{name:22} {r['bytes_per_param']:>7} {r['us'] / 1e3:8.3f} {r['host_us'] / 1e3:8.3f} "
            f"{r['gbs']:7.0f} {r['frac_copy']:6.2f} {r['speedup_vs_torch_fused']:8.2f}"
        )
    for r in result.get("sweep", []):
        lines.append(
            f"  sweep block {r['block']:>5} x {r['num_warps']} warps: {r['us'] / 1e3:8.3f} ms "
            f"{r['gbs']:7.0f} GB/s {r['frac_copy']:6.2f} of copy"
        )
    return "\n".join(lines)
