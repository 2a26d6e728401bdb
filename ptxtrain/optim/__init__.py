"""Optimizers: AdamW with BF16 moments and FP32 master weights (DeepSeek-V3 report §3.3)."""

from ptxtrain.optim.adamw import (
    AdamW,
    GradInBuffer,
    grad_ready,
    mark_grad_ready,
    optimizer_state_bytes,
)

__all__ = ["AdamW", "GradInBuffer", "grad_ready", "mark_grad_ready", "optimizer_state_bytes"]
