"""Run metrics: the ``metrics.jsonl`` log, the loss-curve PNG and the closing summary table.

``metrics.jsonl`` holds one JSON object per optimizer step: ``step`` (1-based, steps completed),
``loss`` (train next-token cross-entropy, nats/byte; the mean over the step's micro-batches),
``lr``, ``tokens_per_s`` (all ranks together), ``model_tflops`` (model TFLOP/s per device, see
:mod:`ptxtrain.train.mfu`), ``mfu`` (their fraction of the device's dense BF16 peak, 0-1; null
where no peak is known, e.g. on CPU), ``grad_norm`` (before clipping), ``time_s`` (wall time of
the step), optionally ``val_loss`` (nats/byte) on eval steps and ``moe`` (the load-balance
statistics of ``model.update_router_biases()``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch


def json_ready(obj: Any) -> Any:
    """Turn tensors (scalars → float/int, others → lists), tuples and numpy scalars into JSON."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach().cpu()
        if obj.dim() == 0:
            return obj.item()
        return obj.tolist()
    if isinstance(obj, dict):
        return {str(k): json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        return obj.item()
    return obj  # floats incl. nan/inf: Python's json writes and reads NaN/Infinity


def read_metrics(path: str | Path) -> list[dict]:
    """Read ``metrics.jsonl``; a torn last line (a crash mid-write) is skipped.

    Raises:
        OSError: the file cannot be read.
    """
    records = []
    for line in Path(path).read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class MetricsWriter:
    """Append-only writer of ``metrics.jsonl`` (one line per record, flushed at once).

    Args:
        path: the file.
        keep_until: when resuming, records with ``step > keep_until`` (written after the
            checkpoint by an interrupted run) are dropped first, so the log stays one sequence;
            ``None`` starts a fresh file.
    """

    def __init__(self, path: str | Path, *, keep_until: int | None = None) -> None:
        self.path = Path(path)
        if keep_until is None:
            self.path.write_text("")
        else:
            kept = (
                [r for r in read_metrics(self.path) if r.get("step", 0) <= keep_until]
                if self.path.exists()
                else []
            )
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(tmp, self.path)
        self._f = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict) -> None:
        """Append one record (made JSON-ready) and flush."""
        self._f.write(json.dumps(json_ready(record)) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_loss_curve(
    records: Sequence[dict],
    path: str | Path,
    *,
    entropy: float | None = None,
    title: str | None = None,
) -> Path:
    """Draw train and validation loss against step into a PNG (matplotlib's Agg canvas).

    Uses ``Figure`` + ``FigureCanvasAgg`` directly, so pyplot's global backend is untouched.

    Args:
        records: metrics records (``step``, ``loss``, optional ``val_loss``).
        path: the PNG to write.
        entropy: the corpus's byte-unigram entropy (nats/byte), drawn as a dashed reference.
        title: the figure title.

    Returns:
        ``path`` as a ``Path``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records if "loss" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if steps:
        ax.plot(steps, losses, color="tab:blue", alpha=0.35, linewidth=0.8, label="train loss")
        smooth = _ema(losses, 0.9)
        ax.plot(steps, smooth, color="tab:blue", linewidth=1.5, label="train loss (EMA 0.9)")
    if val:
        ax.plot(*zip(*val), "o-", color="tab:orange", markersize=3, label="val loss")
    if entropy is not None:
        ax.axhline(
            entropy, color="gray", linestyle="--", linewidth=1,
            label=f"byte-unigram entropy {entropy:.3f}",
        )  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    return path


def _ema(values: Sequence[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (as Adam's moments): no pull toward v[0]."""
    out, acc = [], 0.0
    for t, v in enumerate(values, start=1):
        acc = beta * acc + (1 - beta) * v
        out.append(acc / (1 - beta**t))
    return out


def format_table(rows: Iterable[tuple[str, str]], title: str = "") -> str:
    """A two-column text table with a rule above and below."""
    rows = list(rows)
    kw = max((len(k) for k, _ in rows), default=0)
    vw = max((len(v) for _, v in rows), default=0)
    rule = "-" * (kw + vw + 3)
    lines = [title, rule] if title else [rule]
    lines += [f"{k:<{kw}} : {v}" for k, v in rows]
    lines.append(rule)
    return "\n".join(lines)


def _throughput(summary: dict) -> str:
    text = f"{summary['tokens_per_s']:,.0f} tokens/s"
    steady, first = summary.get("steady_tokens_per_s"), summary.get("first_step_s")
    if steady is not None and first is not None:
        text += f" ({steady:,.0f} after the first step, which took {first:.1f} s)"
    ranks = summary.get("ranks", 1)
    if ranks > 1:
        per = (steady if steady is not None else summary["tokens_per_s"]) / ranks
        text += f"; {per:,.0f} per rank over {ranks} ranks"
    return text


def _mfu(summary: dict) -> str:
    """The MFU row: steady-state MFU with the model TFLOP/s and the peak behind it."""
    mfu, tflops = summary.get("mfu"), summary.get("model_tflops")
    peak, per_token = summary.get("peak_tflops"), summary["flops_per_token"]
    basis = f"{per_token / 1e9:,.3g} GFLOP/token"
    if tflops is None:
        return f"n/a (needs 2 steps or more: the first one is left out; {basis})"
    text = f"{tflops:,.3g} model TFLOP/s per device, {basis}"
    if mfu is None:
        return f"n/a (no dense BF16 peak known for this device; {text})"
    return f"{mfu:.1%} of the {peak:,.0f} TFLOPS dense BF16 peak ({text}, after the first step)"


def format_summary(summary: dict) -> str:
    """The closing table of a training run from ``train()``'s summary dict."""

    def loss(v: float | None) -> str:
        return "-" if v is None else f"{v:.4f}"

    ent = summary.get("unigram_entropy")
    n = summary.get("grad_accum_steps", 1)
    micro = f" in {n} micro-batches" if n > 1 else ""
    rows = [
        ("steps", f"{summary['steps_run']} run, {summary['step']} total"),
        ("tokens", f"{summary['tokens_run']:,} run ({summary['tokens_per_step']:,}/step{micro})"),
        ("time", f"{summary['time_s']:.1f} s (training loop, evaluations and checkpoints)"),
        ("throughput", _throughput(summary)),
        ("train loss", f"{loss(summary['first_loss'])} first -> {loss(summary['last_loss'])} last"),
    ]
    if "flops_per_token" in summary:
        rows.insert(4, ("MFU", _mfu(summary)))
    if summary.get("best_val_loss") is not None:
        rows.append(
            (
                "val loss",
                f"{loss(summary['best_val_loss'])} best, {loss(summary['last_val_loss'])} last",
            )
        )
    if ent is not None:
        rows.append(("unigram entropy", f"{ent:.4f} nats/byte (reference)"))
        if summary.get("last_val_loss") is not None:
            rows.append(("val / entropy", f"{summary['last_val_loss'] / ent:.3f}"))
    if summary.get("optimizer_bytes_per_param") is not None:
        rows.append(
            (
                "optimizer state",
                f"{summary['optimizer_bytes_per_param']:.2f} B/param (FP32 master + BF16 moments); "
                f"{summary['training_bytes_per_param']:.2f} B/param with weights and FP32 grads",
            )
        )
    peaks = [p for p in summary.get("peak_memory_bytes_per_rank") or () if p is not None]
    if len(peaks) > 1:
        per = ", ".join(f"{p / 2**20:,.0f}" for p in peaks)
        rows.append(("peak CUDA memory", f"max {max(peaks) / 2**20:,.1f} MiB (per rank: {per})"))
    elif summary.get("peak_memory_bytes") is not None:
        rows.append(("peak CUDA memory", f"{summary['peak_memory_bytes'] / 2**20:,.1f} MiB"))
    saves = summary.get("checkpoint_saves") or []
    if saves:
        last = saves[-1]
        mode = "async" if summary.get("async_ckpt") else "blocking"
        total = "" if last["total_s"] is None else f", {last['total_s']:.2f} s to commit"
        rows.append(
            (
                "checkpoints",
                f"{len(saves)} saved ({mode}), {summary['checkpoint_save_s']:.2f} s waited in "
                f"all; last: {last['blocking_s']:.2f} s waited{total}",
            )
        )
    rows.append(("run dir", str(summary["out"])))
    return format_table(rows, title=f"ptxtrain train: {summary['preset']} {summary['precision']}")
