"""One optimizer step of an expert-parallel run without a pipeline (``--ep E``, ``--pp 1``).

Every rank holds the full model but ``1/E`` of each MoE layer's routed experts, and trains on its
shard of every micro-batch: rows ``[e·B/E, (e+1)·B/E)`` of the step's batch for EP rank ``e``
(DeepSeek-V3 report §3.2.2: EP ranks are data parallel for everything but the experts). The MoE
layers move tokens to their experts with dispatch / combine (:class:`ptxtrain.ep.Buffer`).

After backward:

- the replicated parameters' gradients are averaged over the ranks (one all-reduce) and the
  experts' gradients, which already sum every rank's tokens, are divided by ``E``: together the
  gradient of the global batch-mean loss, as one process computes it;
- clipping uses the global L2 norm (replicated gradients counted once, expert shards summed);
- the losses are averaged over the ranks.

The norm, the clipping coefficient and the losses stay on the device, as in
:class:`~ptxtrain.train.step.SingleDeviceStep`: the step reads nothing back to the host beyond
what the dispatch's split sizes need. Each collective runs as a named phase of a
:class:`~ptxtrain.train.faults.CollectiveWatch`, so a dead or hung peer is reported by name.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .evaluation import shard_rows
from .pipeline import all_reduce_grads, clip_global_norm_
from .step import LOSS_TERMS, NO_CLIP, accumulate_grads, step_values

__all__ = ["ExpertParallelStep", "apply_update"]


def apply_update(optimizer, buffer, watch, state_bytes: int | None) -> int:
    """The optimizer update of a distributed step: first the EP ``buffer``'s nvlink kernels
    report a wait on a peer that timed out (they find out only at the next operation, after
    writing wrong rows, so no update may use them; None: no buffer), then ``optimizer.step()``
    and ``zero_grad``. Returns the optimizer's footprint in bytes: ``state_bytes`` when known,
    else measured now, after the first update and before ``zero_grad`` frees the gradients."""
    if buffer is not None:
        with watch.phase("the EP buffer's nvlink kernels (their waits on the peers)"):
            buffer.check_errors()
    optimizer.step()
    if state_bytes is None:
        state_bytes = optimizer.state_bytes()
    optimizer.zero_grad(set_to_none=True)
    return state_bytes


class ExpertParallelStep:
    """One training step of an expert-parallel run (see the module note).

    Args:
        model: the :class:`~ptxtrain.model.DeepSeekV3` after ``enable_expert_parallel`` (this
            rank's experts only), on ``device``, in train mode.
        optimizer: its optimizer (``grad_for(p)`` gives the gradient ``step`` uses:
            :class:`ptxtrain.optim.AdamW`).
        rank, ranks: this rank's index in the expert-parallel group (the default group) and the
            group's size ``E``.
        grad_accum_steps: micro-batches per step; each micro-batch's rows must divide by ``E``.
        grad_clip: the global-norm bound (0: no clipping).
        device: where the model lives.
        watch: the :class:`~ptxtrain.train.faults.CollectiveWatch` naming each collective.
        buffer: the MoE layers' shared :class:`ptxtrain.ep.Buffer` whose nvlink kernels report
            their errors after the backward (None: nothing to check).

    Raises:
        ValueError: ``ranks`` < 2 or ``rank`` outside ``[0, ranks)``.
    """

    def __init__(
        self, model, optimizer, *, rank: int, ranks: int, grad_accum_steps: int,
        grad_clip: float, device: torch.device, watch, buffer=None,
    ) -> None:  # fmt: skip
        if not (isinstance(ranks, int) and ranks >= 2 and isinstance(rank, int)):
            raise ValueError(f"ranks must be an int >= 2 and rank an int, got {ranks!r}, {rank!r}")
        if not 0 <= rank < ranks:
            raise ValueError(f"rank must be in [0, ranks={ranks}), got {rank}")
        self.model, self.optimizer, self.device = model, optimizer, device
        self.rank, self.ranks = rank, ranks
        self.grad_accum_steps = grad_accum_steps
        self.clip = grad_clip or NO_CLIP
        self.watch, self.buffer = watch, buffer
        self.state_bytes: int | None = None  # the optimizer's footprint, after the first step

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[e·B/E, (e+1)·B/E)`` of a batch ``t [B, T]``."""
        return shard_rows(t, self.rank, self.ranks)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, lr: float) -> dict[str, Any]:
        """One optimizer step on the step's batch ``x, y [B·N, T]`` int64 (the same on every
        rank) at learning rate ``lr``; returns :func:`~ptxtrain.train.step.step_values` (global
        losses, the norm before clipping, the routers' load) as unread device tensors.

        Raises:
            CollectiveError: a collective failed or ran past the group's timeout (from
                ``watch``'s phases).
        """
        model, optimizer, watch = self.model, self.optimizer, self.watch
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        with watch.phase("forward and backward: the MoE dispatch / combine all_to_all"):
            out = accumulate_grads(model, x, y, self.grad_accum_steps, self.shard)
        watch.fault_point()
        with watch.phase("all_reduce of the replicated parameters' gradients"):
            self.reduce_grads()
        with watch.phase("all_reduce of the gradient norm"):
            grad_norm = self.clip_grad_norm_(self.clip)
        with watch.phase("all_reduce of the losses"):
            out = self.mean_losses(out)
        self.state_bytes = apply_update(optimizer, self.buffer, watch, self.state_bytes)
        with watch.phase("all_reduce of the router load (expert counts)"):
            model.update_router_biases(stats=False)
        return step_values(out, grad_norm, model)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """Average the replicated parameters' gradients over the ranks (one all-reduce, fp32 or
        fp64) and divide the expert gradients by ``E``. Works on ``optimizer.grad_for(p)`` (the
        FP32 buffers of :class:`~ptxtrain.optim.AdamW`); a replicated parameter without a
        gradient on every rank keeps none (the optimizer then skips it, as one process does)."""
        model, optimizer = self.model, self.optimizer
        experts = {id(p) for p in model.expert_parameters()}
        for p in model.expert_parameters():
            g = optimizer.grad_for(p)
            if g is not None:
                g.div_(self.ranks)
        params = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
        all_reduce_grads(params, optimizer, None, self.device, divide_by=self.ranks)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient by the global L2 norm (per-tensor norms in FP32 or wider, their
        squares summed in float64: replicated ones once, expert shards over the ranks, as
        :meth:`~ptxtrain.optim.AdamW.clip_grad_norm_` sums one process's). Returns the norm
        before clipping, a float64 device scalar; the scale ``min(1, max_norm / (norm + 1e-6))``
        is applied on the device (a factor of 1 leaves the gradients' bits unchanged)."""
        model, optimizer = self.model, self.optimizer
        experts = {id(p) for p in model.expert_parameters()}
        counted = [
            (g, id(p) in experts)
            for p in model.parameters()
            if (g := optimizer.grad_for(p)) is not None
        ]
        grads = [g for g, _ in counted]
        return clip_global_norm_(counted, grads, max_norm, self.ranks, [None], self.device)

    def mean_losses(self, out):
        """The step's losses averaged over the ranks (the global batch means), float64 device
        scalars in a :class:`~ptxtrain.model.ModelOutput` without logits (one all-reduce)."""
        from ..model import ModelOutput

        names = [n for n in LOSS_TERMS if getattr(out, n) is not None]
        mean = ModelOutput(logits=None)
        if not names:
            return mean
        vals = torch.stack([getattr(out, n).detach().to(self.device, torch.float64) for n in names])
        dist.all_reduce(vals)
        vals /= self.ranks
        for i, n in enumerate(names):
            setattr(mean, n, vals[i])
        return mean
