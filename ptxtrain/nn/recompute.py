"""Activation recomputation for the DeepSeek-V3 blocks (``--recompute``), and the flag that tells
a layer its forward is being re-run.

Design note (DeepSeek-V3 report §3.2.3, "Recomputation of RMSNorm and MLA Up-Projection").

``torch.utils.checkpoint`` (non-reentrant) keeps only a region's inputs and runs its forward again
during backward. Three modes:

- ``none``: everything the backward needs is kept.
- ``selective``: DeepSeek-V3's choice: every RMSNorm, and MLA's up-projections together with
  the norm in front of them (``wq_b(q_norm(·))``, ``wkv_b(kv_norm(·))``), are recomputed. Their
  outputs are cheap to recompute (one norm, or one norm and a GEMM over a low-rank input) and
  each would otherwise be kept as a full-width activation (an RMSNorm keeps an FP32 copy of
  its input).
- ``full``: each decoder layer keeps only its input; its whole forward runs again in backward.

A recomputed forward must not repeat side effects that belong to the step: the MoE router counts
the tokens it routes for the auxiliary-loss-free bias update, so it asks :func:`recomputing`
and does not count twice. The FP8 weight caches are hit in the re-run (the weights have not
changed), and every kernel is deterministic, so the recomputed values are the kept values bit
for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["RECOMPUTE_MODES", "check_recompute", "recompute", "recomputing"]

RECOMPUTE_MODES = ("none", "selective", "full")

_depth = 0  # > 0 while a checkpointed region is re-run in backward


def recomputing() -> bool:
    """True while :func:`recompute` re-runs a region's forward during backward."""
    return _depth > 0


@contextlib.contextmanager
def _rerun():
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def _contexts():
    return contextlib.nullcontext(), _rerun()


def check_recompute(mode: object) -> str:
    """``mode`` if it is one of :data:`RECOMPUTE_MODES`.

    Raises:
        ValueError: anything else (the message lists the modes).
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {list(RECOMPUTE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def recompute(fn: Callable[..., torch.Tensor], *args: torch.Tensor, enabled: bool = True):
    """``fn(*args)``, its activations dropped and recomputed in backward when ``enabled`` and
    grad mode is on (``torch.utils.checkpoint``, non-reentrant); else a plain call."""
    if not (enabled and torch.is_grad_enabled()):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)
