"""One rank's share of a pipeline-parallel training step (``ptxtrain train --pp N``).

Every rank builds the whole model from the seed (so initialization is the single-process one),
cuts it into stages by a layout (decoder layers per stage, :mod:`ptxtrain.train.pipeline_layout`:
``--pp-layout``, or the cost-balanced one) with
:class:`~ptxtrain.train.pipeline_stage.DeepSeekV3Stage`, which share the model's submodules, and
keeps the ones :func:`~ptxtrain.parallel.stages.stages_of_rank` gives it; the optimizer is built
over those stages' parameters only. A step (docs/design.md §5)::

    micro-batches = the batch split into num_chunks along dim 0
    schedule.step(...)          1F1B / DualPipe / DualPipeV; loss per micro-batch
                                (lm_loss + aux_loss) / num_chunks, so the gradients are those of
                                the batch mean, as in the single-process step
    reduce_grads()              DualPipe: sum the gradients of the two copies of every stage
    clip_grad_norm_()           the global norm, each stage counted once (its owner's copy)
    optimizer.step()            each rank updates its stages; mirrored copies stay identical
    update_router_biases()      DualPipe: expert counts of the two copies summed first

Checkpoints (:mod:`ptxtrain.train.checkpoint`): each rank writes the stages it owns
(``PipelineRunner.owned``) under the full model's names and reads every stage it holds.

Expert parallelism inside the stages (``--pp PP --ep EP``, DeepSeek-V3's layout, report §3.2):
:func:`pipeline_groups` lays ``PP x EP`` ranks out as ``rank = pipeline_rank * EP + ep_rank``.
The ``PP`` ranks of one ``ep_rank`` form a pipeline (a replica that runs the schedule on its own
``1/EP`` of the batch); the ``EP`` ranks of one ``pipeline_rank`` hold the same stages, each with
``1/EP`` of every MoE layer's routed experts, and exchange tokens inside those MoE layers (they
run the same schedule in lockstep, so their collectives line up). Pass ``ep_group`` to the runner:
after the mirror sum, :meth:`PipelineRunner.reduce_grads` averages the replicated gradients over
the EP group and divides the expert gradients by ``EP`` (they already sum every replica's
tokens); the clipping norm, the losses and the router load are reduced over the EP group too.

Not supported here: multi-token prediction and tied embeddings (see ``check_stageable``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..model.deepseek import DeepSeekV3, aggregate_router_stats
from ..moe.router import Router
from ..parallel.p2p import directional_groups, group_timeout
from ..parallel.stages import (
    build_schedule,
    check_pipeline,
    num_stages,
    owner_of_stage,
    p2p_pairs,
    stages_of_rank,
)
from ..parallel.timeline import Timeline
from .pipeline_layout import check_layout, even_layout
from .pipeline_stage import DeepSeekV3Stage

__all__ = [
    "PipelineGroups",
    "PipelineRunner",
    "StepLosses",
    "all_reduce_grads",
    "pipeline_groups",
]


@dataclass
class PipelineGroups:
    """The process groups of one rank of a ``PP x EP`` run (see :func:`pipeline_groups`).

    ``pipeline``: the ``PP`` ranks running one schedule together; ``expert``: the ``EP`` ranks
    holding the same stages (None when ``EP == 1``); ``mirror``: DualPipe's two-rank group of
    this rank and its mirror inside the pipeline (None for other schedules; the pipeline group
    itself when ``PP == 2``). ``pipeline_rank`` / ``ep_rank``: this rank's place in each.
    ``p2p``: the schedule's per-direction message groups ``{(src, dst): group}`` (global ranks;
    :func:`~ptxtrain.parallel.p2p.directional_groups`), this rank's directions only.
    """

    pipeline: dist.ProcessGroup | None
    expert: dist.ProcessGroup | None
    mirror: dist.ProcessGroup | None
    pipeline_rank: int
    ep_rank: int
    p2p: dict = dataclasses.field(default_factory=dict)


def pipeline_groups(pp: int, ep: int, schedule: str) -> PipelineGroups:
    """Create the groups of a ``pp x ep`` layout (a collective: every rank of the world calls it,
    and ``dist.new_group`` is called for every group in the same order on every rank).

    Layout: global rank ``r = pipeline_rank * ep + ep_rank``. Pipeline group ``e`` holds ranks
    ``{s * ep + e : s < pp}``, expert group ``s`` ranks ``{s * ep + e : e < ep}``, DualPipe mirror
    pairs ``{q * ep + e, (pp - 1 - q) * ep + e}`` inside each pipeline. With ``ep == 1`` the
    pipeline group is the default group (None) and there is no expert group.

    Raises:
        ValueError: ``pp``/``ep`` not positive ints, or a world size other than ``pp * ep``.
    """
    for name, v in (("pp", pp), ("ep", ep)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != pp * ep:
        raise ValueError(f"pp={pp} x ep={ep} needs a world of {pp * ep} ranks, got {world}")
    p_rank, e_rank = divmod(rank, ep)
    # Every group gets the default group's timeout (--collective-timeout), not new_group's own
    # default (gloo 30 min, NCCL 10 min), so a dead peer ends a pipeline collective as fast.
    timeout = group_timeout()
    if ep == 1:
        pipe_group, expert_group = None, None
    else:
        pipe_group = expert_group = None
        for e in range(ep):  # every rank creates every group, in this order
            g = dist.new_group([s * ep + e for s in range(pp)], timeout=timeout)
            if e == e_rank:
                pipe_group = g
        for s in range(pp):
            g = dist.new_group([s * ep + e for e in range(ep)], timeout=timeout)
            if s == p_rank:
                expert_group = g
    mirror = None
    if schedule == "dualpipe" and pp == 2:
        mirror = pipe_group if pipe_group is not None else dist.group.WORLD
    elif schedule == "dualpipe":
        for e in range(ep):
            for q in range(pp // 2):
                g = dist.new_group([q * ep + e, (pp - 1 - q) * ep + e], timeout=timeout)
                if e == e_rank and p_rank in (q, pp - 1 - q):
                    mirror = g
    pairs = [p for e in range(ep) for p in p2p_pairs(schedule, [s * ep + e for s in range(pp)])]
    p2p = directional_groups(pairs)
    return PipelineGroups(pipe_group, expert_group, mirror, p_rank, e_rank, p2p)


@torch.no_grad()
def clip_global_norm_(
    counted, scaled, max_norm: float, ep: int, groups, device: torch.device
) -> torch.Tensor:
    """Clip by the L2 norm of a model whose gradients are spread over ranks, on the device.

    ``counted``: ``(grad, is_expert)`` of the gradients this rank contributes to the norm;
    their per-tensor norms (FP32 or wider, as :meth:`~ptxtrain.optim.AdamW.clip_grad_norm_`)
    are squared and summed in float64 into [replicated, experts] and all-reduced over each of
    ``groups``. The replicated sum is then divided by ``ep`` (every EP rank holds the same
    replicated gradients). ``scaled``: the gradients multiplied by ``min(1, max_norm / (norm +
    1e-6))`` (a factor of 1 leaves their bits unchanged). Returns the norm before clipping, a
    float64 scalar on ``device``; nothing is read back to the host.
    """
    sq = torch.zeros(2, dtype=torch.float64, device=device)  # [replicated, experts]
    for g, is_expert in counted:
        n = torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
        sq[int(is_expert)] += n.double() ** 2
    for group in groups:
        dist.all_reduce(sq, group=group)
    total = torch.sqrt(sq[0] / ep + sq[1])
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0).float()
    for g in scaled:
        g.mul_(coef.to(g.dtype))
    return total


@torch.no_grad()
def all_reduce_grads(params, optimizer, group, device, divide_by: int = 1) -> None:
    """Sum the gradients ``optimizer.grad_for(p)`` of ``params`` over ``group`` (one all-reduce,
    fp32 or fp64), divided by ``divide_by`` when it is not 1. A parameter without a gradient on
    every rank keeps none (the optimizer then skips it, as in the single-process run)."""
    if not params:
        return
    grads = [optimizer.grad_for(p) for p in params]
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    flat = torch.cat(
        [
            (g if g is not None else p.new_zeros(p.shape)).reshape(-1).to(dtype)
            for p, g in zip(params, grads, strict=True)
        ]
        + [torch.tensor([float(g is not None) for g in grads], dtype=dtype, device=device)]
    )
    dist.all_reduce(flat, group=group)
    has = flat[-len(params) :].tolist()
    offset = 0
    for p, g, h in zip(params, grads, has, strict=True):
        part = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        if h == 0:
            continue
        if g is None:
            p.grad = torch.zeros_like(p)
            g = optimizer.grad_for(p)
        g.copy_(part if divide_by == 1 else part / divide_by)


@dataclass
class StepLosses:
    """Batch-mean losses of one pipeline step (0-d float64 CPU tensors), named as in
    :class:`~ptxtrain.model.ModelOutput`; ``aux_loss`` is None when the model has none."""

    lm_loss: torch.Tensor
    aux_loss: torch.Tensor | None = None
    mtp_loss: None = None


class PipelineRunner:
    """The stages, schedule and cross-rank reductions of one pipeline rank.

    Args:
        model: the full model, built identically on every rank (same seed); the runner uses the
            parts of it that belong to this rank's stages and leaves the rest untouched.
        schedule: ``"1f1b"``, ``"dualpipe"`` or ``"dualpipev"``.
        num_chunks: micro-batches per step.
        group: the pipeline process group (default: the world); its size is PP.
        ep_group: the expert-parallel group of the ranks holding the same stages (``--pp`` with
            ``--ep``, see the module doc; the model's experts must already be split over it with
            :meth:`~ptxtrain.model.DeepSeekV3.enable_expert_parallel`); None = no EP.
        mirror_group: DualPipe's mirror-pair group from :func:`pipeline_groups`; needed with
            ``ep_group`` (every rank of the world must create every pair). None: with DualPipe the
            runner creates the pairs of ``group`` itself (every rank of ``group`` must be the
            whole world then).
        p2p_groups: the per-direction message groups of :func:`pipeline_groups` (``.p2p``);
            needed with ``ep_group`` for NCCL runs whose crossed messages exceed NCCL's buffers.
            None: on the default group the schedule creates them at its first step.
        layout: decoder layers per stage, ``num_stages(schedule, PP)`` counts
            (:func:`~ptxtrain.train.pipeline_layout.check_layout`; ``ptxtrain train`` passes
            ``--pp-layout`` or :func:`~ptxtrain.train.pipeline_layout.balanced_layout`'s). None:
            :func:`~ptxtrain.train.pipeline_layout.even_layout`.
        overlap: DualPipe / DualPipeV: run the F&B steps through
            :meth:`DeepSeekV3Stage.overlapped_forward_backward` (two CUDA streams). None (the
            default) reads the environment variable ``PTXTRAIN_PP_OVERLAP``: ``1`` turns it on,
            unset or ``0`` leaves it off. Off by default because it is slower on H200s
            (``small``, 32 x 512 tokens): DualPipe 48,635 tokens/s without it against 37,351
            with it at PP = 2, 34,332 against 33,141 at PP = 4. The MoE layer reads its
            expert counts back to the host in the forward, so the host waits for the device
            mid-cell and the two streams' work cannot overlap; those reads take 3x longer with
            the overlap on (cudaMemcpyAsync 54 vs 16 µs per call, torch.profiler).

    Raises:
        ValueError: an invalid combination (:func:`~ptxtrain.parallel.stages.check_pipeline`),
            a model that cannot be cut into stages (MTP on, tied embeddings, layer count), a bad
            ``layout``, or
            DualPipe with ``ep_group`` but no ``mirror_group``, or ``overlap`` under DualPipe /
            DualPipeV with the model's EP buffer on the ``"nvlink"`` backend (two streams would
            share it).
    """

    def __init__(
        self,
        model: DeepSeekV3,
        schedule: str,
        num_chunks: int,
        group: dist.ProcessGroup | None = None,
        overlap: bool | None = None,
        ep_group: dist.ProcessGroup | None = None,
        mirror_group: dist.ProcessGroup | None = None,
        p2p_groups: dict | None = None,
        layout: tuple[int, ...] | None = None,
    ) -> None:
        self.group = group
        self.ep_group = ep_group
        self.ep = dist.get_world_size(ep_group) if ep_group is not None else 1
        self.rank = dist.get_rank(group)
        self.pp = dist.get_world_size(group)
        check_pipeline(schedule, self.pp, num_chunks)
        self.model, self.schedule, self.num_chunks = model, schedule, num_chunks
        self.n_stages = num_stages(schedule, self.pp)
        n_layers = model.config.n_layers
        if layout is None:
            layout = even_layout(n_layers, self.n_stages)
        self.layout = check_layout(layout, n_layers, self.n_stages)
        ids = stages_of_rank(schedule, self.rank, self.pp)
        self.stages = [DeepSeekV3Stage(model, s, self.layout) for s in ids]
        self.module = nn.ModuleList(self.stages)  # for the optimizer: this rank's parameters
        if overlap is None:
            overlap = os.environ.get("PTXTRAIN_PP_OVERLAP", "0").strip() == "1"
        self.overlap = bool(overlap)
        if (
            self.overlap
            and schedule in ("dualpipe", "dualpipev")
            and getattr(model.ep_buffer, "backend", None) == "nvlink"
        ):
            # DualPipe's overlapped F&B steps would use the one shared nvlink Buffer from two
            # CUDA streams at once (one symmetric buffer, one epoch counter): a race. (1F1B
            # ignores `overlap`.)
            raise ValueError(
                f"overlap=True (PTXTRAIN_PP_OVERLAP=1) with schedule={schedule!r} cannot run "
                "with the model's nvlink EP buffer: use overlap=False or the all_to_all backend"
            )
        self.runner = build_schedule(
            schedule, self.stages, group, overlap=self.overlap, p2p_groups=p2p_groups
        )
        self.owned = [
            st for st in self.stages if owner_of_stage(schedule, st.index, self.pp) == self.rank
        ]
        self.last = next((st for st in self.stages if st.is_last), None)
        self.device = next(model.parameters()).device
        # DualPipe: one two-rank group per mirror pair {r, PP-1-r} (every rank creates all). With
        # PP = 2 the only pair is the pipeline group itself: reuse it rather than open a second
        # NCCL communicator over the same two GPUs.
        self.mirror_group = mirror_group
        # Expert parameters (sharded over ep_group): reduced and counted apart from the rest.
        self._expert_ids = {id(p) for p in model.expert_parameters()} if self.ep > 1 else set()
        if schedule == "dualpipe" and mirror_group is None:
            if ep_group is not None:
                raise ValueError(
                    "dualpipe with ep_group needs the mirror_group of pipeline_groups() (every "
                    "rank of the world must create every mirror pair)"
                )
            if self.pp == 2:
                self.mirror_group = group if group is not None else dist.group.WORLD
            else:
                for r in range(self.pp // 2):
                    pair = [r, self.pp - 1 - r]
                    if group is not None:
                        pair = [dist.get_global_rank(group, q) for q in pair]
                    g = dist.new_group(pair, timeout=group_timeout())  # --collective-timeout
                    if self.rank in (r, self.pp - 1 - r):
                        self.mirror_group = g

    # ------------------------------------------------------------------ the step
    def _inputs_and_labels(self, x: torch.Tensor, y: torch.Tensor):
        """This rank's part of the batch for ``step``: ``(inputs, labels)`` tuples."""
        last = self.pp - 1
        if self.schedule == "1f1b":
            return ((x,) if self.rank == 0 else ()), ((y,) if self.rank == last else ())
        if self.schedule == "dualpipev":
            return ((x,), (y,)) if self.rank == 0 else ((), ())
        half = x.shape[0] // 2  # dualpipe: direction 0 takes the first half, direction 1 the rest
        inputs: tuple = ()
        labels: tuple = ()
        if self.rank == 0:
            inputs, labels = (x[:half],), (y[half:],)
        if self.rank == last:  # PP is even, so never rank 0 as well
            inputs, labels = (x[half:],), (y[:half],)
        return inputs, labels

    def step(
        self, x: torch.Tensor, y: torch.Tensor, timeline: Timeline | None = None
    ) -> StepLosses:
        """Forward and backward of one batch ``x, y [B, T]`` int64 (the same on every rank).

        Gradients accumulate into this rank's parameters (through the optimizer's hooks, if
        any). Returns the batch-mean losses, the same on every rank.
        """
        records: list[tuple[torch.Tensor, torch.Tensor]] = []
        n = self.num_chunks
        last = self.last

        def criterion(logits, aux, labels):
            total, lm_loss = last.loss(logits, aux, labels)
            records.append((lm_loss.detach(), aux.detach()))
            return total / n

        inputs, labels = self._inputs_and_labels(x, y)
        self.runner.step(
            *inputs,
            num_chunks=n,
            criterion=criterion if last is not None else None,
            labels=labels,
            timeline=timeline,
        )
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for lm_loss, aux in records:
            sums[0] += lm_loss.double()
            sums[1] += aux.double()
        dist.all_reduce(sums, group=self.group)
        if self.ep > 1:  # every replica's micro-batches have the same size: the global mean
            dist.all_reduce(sums, group=self.ep_group)
        means = (sums / (n * self.ep)).cpu()
        cfg = self.model.config
        has_aux = cfg.n_moe_layers > 0 and cfg.seq_aux_loss_alpha > 0
        return StepLosses(lm_loss=means[0], aux_loss=means[1] if has_aux else None)

    # ------------------------------------------------------------------ reductions
    def _mirror_order(self) -> list[DeepSeekV3Stage]:
        return sorted(self.stages, key=lambda st: st.index)  # same order on both mirrors

    @torch.no_grad()
    def reduce_grads(self, optimizer) -> None:
        """The cross-rank gradient reductions after the schedule's backward passes.

        DualPipe: sum the gradients of the two copies of every stage. With ``ep_group``: then
        average the replicated parameters' gradients over the EP group and divide the expert
        gradients by ``EP`` (each already sums every replica's tokens), which gives the gradient
        of the global batch-mean loss. A no-op for 1F1B / DualPipeV without EP.

        Works on the gradients ``optimizer.step`` will use (``optimizer.grad_for``, the FP32
        buffers of :class:`~ptxtrain.optim.AdamW`). A parameter without a gradient on every rank
        of a reduction keeps none (so the optimizer skips it, as in the single-process run).
        """
        params = [p for st in self._mirror_order() for p in st.parameters() if p.requires_grad]
        if self.mirror_group is not None:
            all_reduce_grads(params, optimizer, self.mirror_group, self.device)
        if self.ep == 1:
            return
        replicated = []
        for p in params:
            if id(p) not in self._expert_ids:
                replicated.append(p)
                continue
            g = optimizer.grad_for(p)
            if g is not None:
                g.div_(self.ep)
        all_reduce_grads(replicated, optimizer, self.ep_group, self.device, divide_by=self.ep)

    @torch.no_grad()
    def clip_grad_norm_(self, optimizer, max_norm: float) -> torch.Tensor:
        """Clip every gradient of this rank by the global L2 norm over the whole model
        (:func:`clip_global_norm_`): each stage counts once (its owner's copy), a replicated
        gradient once over the EP group, the expert shards of the EP group summed. Returns the
        norm before clipping, a float64 device scalar.
        """
        counted = [
            (g, id(p) in self._expert_ids)
            for st in self.owned
            for p in st.parameters()
            if (g := optimizer.grad_for(p)) is not None
        ]
        scaled = [g for p in self.module.parameters() if (g := optimizer.grad_for(p)) is not None]
        # Replicated gradients are equal over the EP group: the formula counts them once.
        groups = [self.group] + ([self.ep_group] if self.ep > 1 else [])
        return clip_global_norm_(counted, scaled, max_norm, self.ep, groups, self.device)

    def _routers(self, stages) -> list[Router]:
        return [m for st in stages for m in st.modules() if isinstance(m, Router)]

    @torch.no_grad()
    def update_router_biases(self) -> dict[str, float]:
        """Auxiliary-loss-free bias update of every router of this rank (DualPipe: the expert
        counts of the two copies summed first, so the copies stay identical; with ``ep_group``
        the counts are then summed over it: the global expert load).

        Returns the statistics of :meth:`DeepSeekV3.update_router_biases` over the whole model
        (all ranks' routers, each once), on every rank.
        """
        routers = self._routers(self._mirror_order())
        groups = [g for g in (self.mirror_group, self.ep_group) if g is not None]
        if routers and groups:
            counts = torch.cat([r.expert_counts.reshape(-1) for r in routers])
            for g in groups:
                dist.all_reduce(counts, group=g)
            offset = 0
            for r in routers:
                k = r.expert_counts.numel()
                r.expert_counts.copy_(counts[offset : offset + k].view_as(r.expert_counts))
                offset += k
        owned = {id(r) for r in self._routers(self.owned)}
        mine = []
        for r in self._routers(self.stages):
            stats = r.update_bias()
            if id(r) in owned:
                mine.append({**stats, "bias_abs_max": float(r.bias.abs().max())})
        gathered: list = [None] * self.pp
        dist.all_gather_object(gathered, mine, group=self.group)
        stats = [s for part in gathered for s in part]
        bias_abs_max = max((s["bias_abs_max"] for s in stats), default=0.0)
        return aggregate_router_stats(stats, bias_abs_max)

    # ------------------------------------------------------------------ whole-model view
    @torch.no_grad()
    def gather_model(self, dst: int = 0) -> None:
        """Copy every stage's current weights and buffers into the model of group rank ``dst``
        (for evaluation and sampling there); every rank must call it."""
        mine = {st.index for st in self.stages}
        at_dst = set(stages_of_rank(self.schedule, dst, self.pp))
        for s in range(self.n_stages):
            if s in at_dst:
                continue
            src = owner_of_stage(self.schedule, s, self.pp)
            if self.rank not in (src, dst):
                continue
            tensors = list(DeepSeekV3Stage(self.model, s, self.layout).state_dict().values())
            g_src, g_dst = src, dst
            if self.group is not None:
                g_src = dist.get_global_rank(self.group, src)
                g_dst = dist.get_global_rank(self.group, dst)
            for t in tensors:
                if self.rank == src:
                    assert s in mine
                    dist.send(t.contiguous(), g_dst, group=self.group)
                else:
                    buf = torch.empty_like(t)
                    dist.recv(buf, g_src, group=self.group)
                    t.copy_(buf)
