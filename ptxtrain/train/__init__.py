"""The training job (``ptxtrain train``): loop, sharded atomic checkpoints, metrics and plots."""

from .checkpoint import (
    Checkpointer,
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    read_checkpoint_state,
    save_checkpoint,
)
from .loop import (
    PRECISIONS,
    TRAJECTORY_FIELDS,
    TrainArgs,
    TrainConfigError,
    lr_at,
    model_config,
    train,
)
from .metrics import MetricsWriter, format_summary, plot_loss_curve, read_metrics
from .mfu import achieved_flops, model_flops_per_token, peak_bf16_flops

__all__ = [
    "PRECISIONS",
    "TRAJECTORY_FIELDS",
    "CheckpointError",
    "Checkpointer",
    "MetricsWriter",
    "TrainArgs",
    "TrainConfigError",
    "achieved_flops",
    "find_checkpoint",
    "format_summary",
    "load_checkpoint",
    "lr_at",
    "model_config",
    "model_flops_per_token",
    "peak_bf16_flops",
    "plot_loss_curve",
    "read_checkpoint_meta",
    "read_checkpoint_state",
    "read_metrics",
    "save_checkpoint",
    "train",
]
