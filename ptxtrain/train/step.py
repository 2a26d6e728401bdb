"""One optimizer step of a single-device run: eager, or captured once and replayed as a CUDA graph.

Design note (the training-step efficiency issue; PyTorch's "whole-network capture").

A step of ``ptxtrain train`` on one GPU is a few thousand kernels: the micro-batches' forward and
backward, clipping, the fused AdamW update and the routers' bias update. With nothing in it
reading the GPU back (the MoE layers size their buffers from the host's token count, the
optimizer keeps its step count and learning rate on the device, the losses and the gradient norm
stay device tensors until a logging step), the host can enqueue the whole step as one CUDA graph
and replay it: launch overhead and Python time leave the critical path.

:class:`SingleDeviceStep` runs the first ``warmup`` steps eagerly on a side stream (JIT compiles,
Triton autotuning, lazy allocations), then captures the next step into a graph over static input
buffers and replays it from then on. Capture records kernels without running them, so the
captured step is then replayed once to actually take it. Every step reads its batch from the same
device buffers (copied in from pinned host memory) and writes its losses and gradient norm into
the same device tensors; the caller copies those out before the next step.

What changes behind the graph's back, and how it stays correct:

- the learning rate: set on the optimizer's device tensor before each replay
  (:meth:`ptxtrain.optim.AdamW.set_lr`);
- the FP8 weight caches (keyed on an optimizer-step count that a replay does not advance):
  :func:`ptxtrain.nn.invalidate_fp8_weight_caches` after each replay, so an eager forward
  (evaluation, sampling) quantizes the updated weights again; inside the graph the first
  micro-batch always re-quantizes, as it did when captured;
- a capture that fails (an op that reads the device, an unsupported kernel): the step is run
  eagerly instead and every later one too, after one log line saying why; gradients and weight
  caches touched by the failed capture are reset first (capture runs no kernel, so parameters
  and optimizer state are untouched).

Eager and graphed steps run the same kernels on the same inputs, so their results are the same
bits whenever the kernels themselves are deterministic (``--deterministic``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "LOSS_TERMS",
    "NO_CLIP",
    "SingleDeviceStep",
    "accumulate_grads",
    "graphs_supported",
    "step_values",
]

LOSS_TERMS = ("lm_loss", "mtp_loss", "aux_loss")  # the ModelOutput losses a step logs
NO_CLIP = 1e30  # the max_norm of --grad-clip 0: no norm reaches it, the gradients stay unscaled


def accumulate_grads(model, x: torch.Tensor, y: torch.Tensor, n: int, shard=None):
    """Forward and backward of one step's ``n`` micro-batches; returns their mean losses.

    Args:
        model: the model (train mode).
        x, y: ``[n·B, T]`` int64 inputs and targets of the step, on the model's device;
            micro-batch ``i`` is rows ``[i·B, (i+1)·B)``.
        n: micro-batches (``grad_accum_steps``).
        shard: maps a micro-batch ``[B, T]`` to this rank's rows (None: the identity, no expert
            parallelism).

    Each micro-batch's total loss is divided by ``n`` before its backward, so the gradients
    that accumulate (in ``p.grad``, or AdamW's FP32 buffers for BF16 parameters) are those of
    the mean loss over all ``n·B`` sequences. With ``n == 1`` nothing is scaled: the step is
    the plain forward and backward.

    Returns:
        A :class:`~ptxtrain.model.ModelOutput` without logits whose ``lm_loss``, ``mtp_loss``
        and ``aux_loss`` are the detached means over the micro-batches (0-d, on the device; None
        where the model gives none). It adds no host synchronization of its own.
    """
    from ..model import ModelOutput

    sums: dict[str, torch.Tensor] = {}
    for xm, ym in zip(x.split(x.shape[0] // n), y.split(y.shape[0] // n), strict=True):
        if shard is not None:
            xm, ym = shard(xm), shard(ym)
        out = model(xm, ym)
        (out.loss if n == 1 else out.loss / n).backward()
        for name in LOSS_TERMS:
            v = getattr(out, name)
            if v is not None:
                sums[name] = v.detach() if name not in sums else sums[name] + v.detach()
    mean = ModelOutput(logits=None)
    for name, total in sums.items():
        setattr(mean, name, total if n == 1 else total / n)
    return mean


def step_values(out, grad_norm, model=None) -> dict[str, torch.Tensor | float]:
    """What a step logs, left where it is (device tensors are read back at a logging step):
    ``out``'s loss terms, ``grad_norm`` and, given a ``model`` with MoE layers, the routers'
    load after the step's bias update (``moe_counts`` ``[L, E]``, ``bias_abs_max``;
    :meth:`~ptxtrain.model.DeepSeekV3.last_router_load`)."""
    values = {name: getattr(out, name) for name in LOSS_TERMS if getattr(out, name) is not None}
    values["grad_norm"] = grad_norm
    load = model.last_router_load() if model is not None else None
    if load is not None:
        values["moe_counts"], values["bias_abs_max"] = load
    return values


def graphs_supported(optimizer, device: torch.device) -> str | None:
    """Why a step with ``optimizer`` on ``device`` cannot be captured, or None when it can."""
    if device.type != "cuda":
        return f"the run is on {device.type}, CUDA graphs need a CUDA device"
    if not getattr(optimizer, "capturable", False):
        return (
            f"{type(optimizer).__name__} is not capturable (ptxtrain's AdamW on its fused path "
            "keeps its step count and learning rate on the device)"
        )
    return None


def _reset_rng_capture_state(device: torch.device) -> None:
    """After a capture that raised: the default CUDA generator was told a capture began but not
    that it ended, and then refuses every random op outside a graph. A capture that completes
    (one tiny op) runs its begin and end hooks again and leaves it in its normal state."""
    probe = torch.zeros(1, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        probe.add_(1)
    torch.cuda.synchronize(device)


class SingleDeviceStep:
    """One training step of a single-device run (see the module note).

    Args:
        model: the model, on ``device``, in train mode.
        optimizer: its optimizer (:class:`ptxtrain.optim.AdamW`; graphs need its fused path).
        grad_accum_steps: micro-batches per step.
        grad_clip: the global gradient-norm clip (0 = no clipping; the norm is still computed).
        device: the run's device.
        cuda_graphs: capture and replay the step where :func:`graphs_supported` allows.
        warmup: eager steps before the capture (at least 1: the first step compiles kernels).
        log: called with one line when graphs are turned off or capture fails.

    Call it with a step's CPU batch ``x, y`` ``[n·B, T]`` int64 and its learning rate; it
    returns a dict of device tensors: 0-d ``lm_loss``, ``mtp_loss``, ``aux_loss`` (absent when
    the model gives none) and ``grad_norm`` (before clipping); with MoE layers also
    ``moe_counts`` ``[L, E]`` and ``bias_abs_max`` (the routers' load and bias after the step's
    update, :meth:`~ptxtrain.model.DeepSeekV3.last_router_load`). They are the step's own
    tensors when eager and static tensors overwritten by the next replay otherwise: copy what
    you keep.

    Raises:
        ValueError: ``grad_accum_steps`` or ``warmup`` out of range.
    """

    def __init__(
        self,
        model,
        optimizer,
        *,
        grad_accum_steps: int,
        grad_clip: float,
        device: torch.device,
        cuda_graphs: bool = True,
        warmup: int = 2,
        log: Callable[[str], None] = print,
    ) -> None:
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        if warmup < 1:
            raise ValueError(f"warmup must be >= 1 (the first step compiles), got {warmup}")
        self.model = model
        self.optimizer = optimizer
        self.n = grad_accum_steps
        self.clip = grad_clip or NO_CLIP
        self.device = device
        self.log = log
        self.warmup = warmup
        self.steps = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: tuple[torch.Tensor, torch.Tensor] | None = None
        self.static_out: dict[str, torch.Tensor] | None = None
        self.state_bytes: dict[str, Any] | None = None  # the optimizer's footprint, first step
        reason = graphs_supported(optimizer, device) if cuda_graphs else "turned off"
        self.graphs_off_reason = reason
        self.side = torch.cuda.Stream(device) if reason is None else None

    @property
    def mode(self) -> str:
        """``"graph"`` once a step is captured, else ``"eager"``."""
        return "graph" if self.graph is not None else "eager"

    # ------------------------------------------------------------------ the step's body
    def _body(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        out = accumulate_grads(self.model, x, y, self.n)
        grad_norm = self.optimizer.clip_grad_norm_(self.clip)
        self.optimizer.step()
        if self.state_bytes is None:  # the full footprint: after step, before zero_grad
            self.state_bytes = self.optimizer.state_bytes()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.update_router_biases(stats=False)
        return step_values(out, grad_norm, self.model)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":  # pinned: the copy is asynchronous, no stream sync
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    # ------------------------------------------------------------------ public
    def __call__(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> dict[str, torch.Tensor]:
        self.steps += 1
        if self.graph is not None:
            return self._replay(x, y, lr)
        self._set_lr(lr)
        if self.side is None or self.steps <= self.warmup:
            return self._eager(x, y)
        return self._capture_and_run(x, y, lr)

    def _set_lr(self, lr: float) -> None:
        if self.side is not None:  # capturable: also the device copy a replayed graph reads
            self.optimizer.set_lr(lr)
            return
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _eager(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.side is None:
            return self._body(self._to_device(x), self._to_device(y))
        current = torch.cuda.current_stream(self.device)
        self.side.wait_stream(current)
        with torch.cuda.stream(self.side):  # warm-up on a side stream, as capture wants
            out = self._body(self._to_device(x), self._to_device(y))
        current.wait_stream(self.side)
        return out

    def _capture_and_run(self, x, y, lr) -> dict[str, torch.Tensor]:
        from ..nn import invalidate_fp8_weight_caches

        torch.cuda.synchronize(self.device)
        self.static_in = (self._to_device(x), self._to_device(y))
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-up steps' cached blocks: the graph pool takes over
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.side):
                self.static_out = self._body(*self.static_in)
        except Exception as e:  # anything the capture cannot record: run eagerly from now on
            self.graph = self.static_out = self.static_in = None
            self.graphs_off_reason = f"capture failed: {type(e).__name__}: {str(e)[:200]}"
            self.log(f"CUDA graphs: off ({self.graphs_off_reason}); running the steps eagerly")
            self.side = None
            torch.cuda.synchronize(self.device)
            _reset_rng_capture_state(self.device)
            self.optimizer.zero_grad(set_to_none=True)
            invalidate_fp8_weight_caches()
            return self._eager(x, y)
        self.graph = graph
        return self._replay(None, None, lr)

    def _replay(self, x, y, lr) -> dict[str, torch.Tensor]:
        from ..nn import invalidate_fp8_weight_caches

        if x is not None:
            self.static_in[0].copy_(x.pin_memory(), non_blocking=True)
            self.static_in[1].copy_(y.pin_memory(), non_blocking=True)
            self._set_lr(lr)
        self.graph.replay()
        invalidate_fp8_weight_caches()
        return self.static_out
