"""The per-step records of ``ptxtrain train``: steps queue their device values, a logging step
reads them back in one copy, times them, checks the loss and writes ``metrics.jsonl`` records
and the progress bar."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .metrics import MetricsWriter
from .mfu import achieved_flops

__all__ = ["StepRecords", "read_pending"]


class StepRecords:
    """The steps run since the last logging step, and the run's totals so far.

    Args:
        writer: the lead rank's ``metrics.jsonl`` writer (None on the other ranks).
        bar: the tqdm progress bar.
        tokens_per_step: tokens of one step (all ranks).
        flops_per_token, peak, devices: for each record's model TFLOP/s and MFU
            (:func:`~ptxtrain.train.mfu.achieved_flops`).
        start: the step the run (re)starts from (the last checkpointed one).

    Attributes: ``done`` (the last step recorded), ``last_saved`` (the last checkpointed
    step), ``losses`` (this call's train losses), ``step_time`` (seconds of this call's
    steps), ``first_step_s`` (the first step's seconds: JIT compiles, autotuning, allocator
    warm-up; None before it is recorded), ``val_loss`` (the last validation loss or None).
    """

    def __init__(
        self,
        writer: MetricsWriter | None,
        bar,
        tokens_per_step: int,
        flops_per_token: float,
        peak: float | None,
        devices: int,
        start: int,
    ) -> None:
        self.writer, self.bar = writer, bar
        self.tokens_per_step = tokens_per_step
        self.flops_per_token, self.peak, self.devices = flops_per_token, peak, devices
        self.done = self.last_saved = start
        self.losses: list[float] = []
        self.step_time = 0.0
        self.first_step_s: float | None = None
        self.val_loss: float | None = None
        self.pending: list[dict[str, Any]] = []  # values maybe still on the device
        self.window_start: float | None = None  # when the first pending step began

    def begin_step(self) -> None:
        """Start the clock of the pending window (a no-op while it runs)."""
        if self.window_start is None:
            self.window_start = time.perf_counter()

    def add(self, step: int, lr: float, values: dict[str, Any], ckpt_writing: bool = False) -> None:
        """Queue ``step``'s values (:meth:`ParallelStrategy.step`'s, left on the device);
        ``ckpt_writing``: a background checkpoint write ran during the step (its record then
        says ``"ckpt_writing": true``)."""
        self.pending.append({"step": step, "lr": lr, **values, "ckpt_writing": ckpt_writing})

    def flush(self, evaluate: Callable[[], float | None] | None, run_dir: Path) -> None:
        """Read the pending steps' values (one host sync), check the loss, write the records.

        ``evaluate``: called after the last pending step (every rank; None = no evaluation
        now); its value, when not None, goes into that step's record as ``val_loss``.

        Raises:
            FloatingPointError: a train loss is NaN or infinite (its record is written first).
        """
        if not self.pending:
            return
        host = read_pending(self.pending)
        dt = (time.perf_counter() - self.window_start) / len(self.pending)
        self.window_start = None
        for i, record in enumerate(host):
            self._record(record, dt, run_dir)
            if i == len(host) - 1 and evaluate is not None:
                val = evaluate()
                if val is not None:
                    self.val_loss = record["val_loss"] = val
            if self.writer is not None:
                self.writer.write(record)
            self.done = record["step"]
        self.bar.update(len(host))
        self.bar.set_postfix_str(
            f"loss {host[-1]['loss']:.3f}"
            + (f" val {self.val_loss:.3f}" if self.val_loss is not None else "")
            + f" {self.tokens_per_step / dt:,.0f} tok/s"
        )
        self.pending.clear()

    def _record(self, record: dict[str, Any], dt: float, run_dir: Path) -> None:
        """Time one record, add its throughput, and refuse a non-finite loss."""
        self.step_time += dt
        if self.first_step_s is None:
            self.first_step_s = dt
        record.update(
            tokens_per_s=self.tokens_per_step / dt,
            **achieved_flops(
                self.flops_per_token, self.tokens_per_step / dt, self.peak, self.devices
            ),
            time_s=dt,
        )
        loss = record["loss"]
        self.losses.append(loss)
        if not math.isfinite(loss):
            if self.writer is not None:
                self.writer.write(record)
            raise FloatingPointError(
                f"the train loss became {loss} at step {record['step']}; the checkpoint in "
                f"{run_dir} holds step {self.last_saved} (try a lower --lr)"
            )


def read_pending(pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pending steps' metrics records, every device value read back in ONE device-to-host
    copy (the only host sync of the steps it covers): ``loss`` (the LM loss), ``lr``,
    ``grad_norm``, ``mtp_loss`` / ``aux_loss`` where present, and ``moe`` from the step's router
    load (``moe_counts`` / ``bias_abs_max``) where present, and ``ckpt_writing`` (true) where a
    background checkpoint write overlapped the step."""
    from ..model.deepseek import router_stats_from

    tensors = [v for rec in pending for v in rec.values() if isinstance(v, torch.Tensor)]
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]).cpu() if tensors else None
    offset = 0
    out = []
    for rec in pending:
        host: dict[str, Any] = {}
        for k, v in rec.items():
            if isinstance(v, torch.Tensor):
                n = v.numel()
                part = flat[offset : offset + n].view(v.shape)
                host[k] = part if v.dim() else float(part)
                offset += n
            else:
                host[k] = v
        record = {"step": host["step"], "loss": float(host["lm_loss"]), "lr": host["lr"]}
        record["grad_norm"] = float(host["grad_norm"])
        if host.get("ckpt_writing"):
            record["ckpt_writing"] = True
        for name in ("mtp_loss", "aux_loss"):
            if name in host:
                record[name] = float(host[name])
        if "moe_counts" in host:
            record["moe"] = router_stats_from(host["moe_counts"], float(host["bias_abs_max"]))
        elif host.get("moe"):  # statistics the pipeline runner computed on the host
            record["moe"] = host["moe"]
        out.append(record)
    return out
