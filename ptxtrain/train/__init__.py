"""The training job (``ptxtrain train``): loop, atomic checkpoints, metrics and plots."""

from .checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from .loop import PRECISIONS, TRAJECTORY_FIELDS, TrainArgs, TrainConfigError, lr_at, train
from .metrics import MetricsWriter, format_summary, plot_loss_curve, read_metrics

__all__ = [
    "PRECISIONS",
    "TRAJECTORY_FIELDS",
    "CheckpointError",
    "MetricsWriter",
    "TrainArgs",
    "TrainConfigError",
    "find_checkpoint",
    "format_summary",
    "load_checkpoint",
    "lr_at",
    "plot_loss_curve",
    "read_checkpoint_meta",
    "read_metrics",
    "save_checkpoint",
    "train",
]
