"""What the training loop and its parallelism strategy share: the error type of bad arguments,
the device, the optimizer's parameter groups and the printer of the rank that reports."""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["DEVICES", "Printer", "TrainConfigError", "param_groups", "resolve_device"]

DEVICES = ("auto", "cpu", "cuda")


class TrainConfigError(ValueError):
    """Training arguments that cannot work (bad value, missing device, run folder in use)."""


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` if available else ``cpu``.

    Raises:
        TrainConfigError: ``cuda`` asked for but unavailable, or an unknown name.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TrainConfigError("--device cuda, but torch sees no CUDA device")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise TrainConfigError(f"--device must be one of {list(DEVICES)}, got {name!r}")


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW parameter groups of ``model``'s trainable parameters: the matrices (``ndim >= 2``:
    linear weights, embeddings) with ``weight_decay``, then (when there are any) the norms and
    biases with none. The order is that of ``model.parameters()``: a checkpoint's optimizer
    state is numbered in it."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class Printer:
    """Writes lines to stdout, through tqdm while a bar is active so the bar stays intact;
    ``enabled=False`` (a rank that does not report) writes nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.bar = None
        self.enabled = enabled

    def __call__(self, msg: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
        else:
            print(msg, flush=True)
