"""DualPipe: bidirectional pipeline schedule (DeepSeek-V3 report §3.2.1; docs/design.md §5), after
deepseek-ai/DualPipe.

Design notes:

- PP ranks (PP even) and PP stages. Micro-batches enter from both ends: direction 0 goes from rank
  0 to rank PP-1 through stages 0..PP-1, direction 1 from rank PP-1 to rank 0, also through stages
  0..PP-1. Rank r therefore holds two modules: ``modules[0]`` = stage r (its place in direction 0)
  and ``modules[1]`` = stage PP-1-r (its place in direction 1): 2x parameters per device.
- Backward is split into B (input grads, on the critical path) and W (weight grads), and W is
  deferred through a :class:`WeightGradStore` to fill the bubbles of the schedule's tail.
- Bubble ``(PP/2-1)(F&B + B - 3W)`` against 1F1B's ``(PP-1)(F+B)``; activations for PP+1
  micro-batches per device. Needs PP even and N = num_chunks even and >= 2·PP.
- The schedule is written as the paper's figure reads, per rank, with ``k = min(r, PP-1-r)`` and
  the rank's "near" direction (the one in which it comes early: 0 for r < PP/2, else 1):
  (1) warmup forwards of the near direction, (2) alternate near/far forwards,
  (3) B+W of the far direction then its forward, (4) main phase of F&B pairs,
  (5) far B then an F&B pair, (6) pairs of backwards, (7) W then near B, (8) remaining W.
  An F&B pair goes through the stages' overlap hook when their class defines one
  (``overlapped_forward_backward``, see :func:`~ptxtrain.parallel.p2p.forward_backward`): the
  receives of both chunks, one hook call computing the forward of one chunk and the backward of
  the other (on CUDA the model's stage overlaps them on two streams), then both sends. Without a
  hook (or with ``overlap=False``) the forward runs, then the backward.
- NCCL: micro-batches enter at both ends, so two neighbours can both send to each other before
  either receives (at PP=2 the first op of each rank: rank 0 sends direction 0's activations
  while rank 1 sends direction 1's), which NCCL's lazy connection set-up cannot take (CUDA
  error 700 at the first send; see :mod:`ptxtrain.parallel.p2p`). The first ``step`` therefore
  connects every rank to its neighbours and its mirror with
  :meth:`~ptxtrain.parallel.p2p.P2P.connect`, once.
- Gradients: a rank's two modules are different stages, so nothing is reduced between them. But
  stage s has two copies, on ranks s and PP-1-s, each receiving the gradient of one direction's
  micro-batches only; the model's gradient is their sum. Call :meth:`DualPipe.reduce_mirrored_grads`
  after ``step`` (or fold it into the data-parallel reduction) before the optimizer step, which
  then keeps the two copies identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ptxtrain.parallel.p2p import (
    PairGroupsMixin,
    StageRunner,
    WeightGradStore,
    check_overlap_hooks,
    check_step_args,
    check_two_stages,
    check_upstream_args,
    connect_once,
    forward_backward,
    module_device,
)
from ptxtrain.parallel.timeline import Timeline


class DualPipe(PairGroupsMixin, nn.Module):
    """Run two pipeline stages of one rank under the DualPipe schedule.

    Args:
        modules: ``(stage_r, stage_{PP-1-r})`` for group rank r: a sequence of exactly two
            ``nn.Module``; each takes the previous stage's outputs (tensor or tuple of tensors) as
            positional arguments and returns a tensor or a tuple of tensors.
        batch_dim: the dimension the inputs and labels are split along into micro-batches:
            0 (the only one ptxtrain's schedules split along; upstream's second argument).
        process_group: the pipeline's process group (default: the world).
        rank_mapping: None or the identity list: group rank ``i`` is pipeline rank ``i`` (build
            the group in pipeline order); upstream's other permutations are refused.
        p2p_groups: ``{(src, dst): group}`` of global ranks from
            :func:`~ptxtrain.parallel.p2p.directional_groups` over this pipeline's
            :meth:`peers` (one NCCL communicator per direction, so crossed large sends cannot
            block each other). None: created at the first ``step`` on the default group; with a
            subgroup, messages then travel on ``process_group`` itself.
        overlap: run the F&B steps through the stages' ``overlapped_forward_backward`` hook
            when their class defines one (see :func:`~ptxtrain.parallel.p2p.forward_backward`);
            False: forward then backward, as for stages without a hook.

    Raises:
        ValueError: ``modules`` does not hold exactly two modules; ``batch_dim`` not 0;
            ``rank_mapping`` not a permutation of the group's ranks.
        NotImplementedError: ``rank_mapping`` a permutation other than the identity.
        TypeError: an entry of ``modules`` is not an ``nn.Module``, or its class defines
            ``overlapped_forward_backward`` other than as a classmethod / staticmethod.
    """

    def __init__(
        self,
        modules: Sequence[nn.Module],
        batch_dim: int = 0,
        process_group: dist.ProcessGroup | None = None,
        rank_mapping: Sequence[int] | None = None,
        *,
        overlap: bool = True,
        p2p_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
    ):
        super().__init__()
        check_upstream_args(batch_dim, rank_mapping, process_group)
        self.module = check_two_stages(modules, "(stage_r, stage_PP-1-r)")
        check_overlap_hooks(self.module)
        self.group = process_group
        self.overlap = bool(overlap)
        self._connected: set[int] = set()  # peers whose P2P connections are set up
        self._pair_groups = p2p_groups

    @staticmethod
    def peers(rank: int, world: int) -> tuple[int, ...]:
        """The group ranks group rank ``rank`` exchanges messages with: its neighbours and its
        mirror ``world - 1 - rank`` (the gradient reduction of the mirrored stages)."""
        return tuple(
            sorted({q for q in (rank - 1, rank + 1, world - 1 - rank) if 0 <= q < world} - {rank})
        )

    def step(
        self,
        *inputs: torch.Tensor,
        num_chunks: int = 0,
        criterion: Callable | None = None,
        labels: Sequence[torch.Tensor] = (),
        return_outputs: bool = False,
        timeline: Timeline | None = None,
    ) -> tuple[torch.Tensor | None, object]:
        """One training step over ``num_chunks`` micro-batches, half entering at each end.

        Args:
            inputs: on rank 0 the batch of direction 0, on rank PP-1 the batch of direction 1;
                empty on the other ranks. Each tensor is split along dim 0 into ``num_chunks / 2``
                equal micro-batches.
            num_chunks: total micro-batches (same int on every rank), even and >= 2·PP.
            criterion: on ranks 0 and PP-1, ``criterion(*outputs, *labels) -> loss`` for one
                micro-batch (one-element tensor).
            labels: on rank PP-1 the labels of direction 0 (rank 0's inputs), on rank 0 those of
                direction 1 (rank PP-1's inputs); split like the inputs.
            return_outputs: on ranks 0 and PP-1, also return the last stage's outputs of the
                direction ending there, concatenated along dim 0 (detached).
            timeline: an optional :class:`~ptxtrain.parallel.timeline.Timeline` (per rank) that
                records this step's F / B / W / BW / send / recv cells.

        Returns:
            ``(loss, outputs)``: on rank PP-1 the SUM of direction 0's micro-batch losses, on rank
            0 that of direction 1 (0-d, detached; each rank's loss belongs to the OTHER end's
            inputs). Other ranks get ``(None, None)``. Gradients of those sums accumulate into
            the parameters; see :meth:`reduce_mirrored_grads`.

        Raises:
            ValueError: odd PP; ``num_chunks`` odd or < 2·PP; inputs missing on rank 0 / PP-1 or
                given on another rank; criterion missing on rank 0 / PP-1; dim 0 of a tensor not
                divisible by ``num_chunks / 2``; ``timeline`` not a Timeline. Every rank raises:
                global checks depend only on the world size and ``num_chunks``, local ones are
                shared by one all-gather.
            TypeError: ``num_chunks`` not an int, an input or label not a tensor.
        """
        # 0. Validation.
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int):
            raise TypeError(f"num_chunks must be an int, got {type(num_chunks).__name__}")
        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        if world % 2:
            raise ValueError(f"DualPipe needs an even number of pipeline ranks, got PP={world}")
        if num_chunks % 2 or num_chunks < 2 * world:
            raise ValueError(
                f"num_chunks must be even and >= 2*PP = {2 * world} (PP={world}), got {num_chunks}"
            )
        n = num_chunks // 2  # micro-batches per direction
        device = module_device(self.module)
        input_chunks, label_chunks = check_step_args(
            "DualPipe", inputs, labels, criterion, timeline, group=self.group, rank=rank,
            world=world, input_ranks=(0, world - 1), loss_ranks=(0, world - 1), n=n,
        )  # fmt: skip
        if timeline is not None:
            timeline.begin_step("dualpipe", rank, world, num_chunks, device)

        p2p = self._p2p(device)
        last = world - 1
        # NCCL: set up every pair's connections (neighbours, mirror) before any crossed send.
        connect_once(p2p, self._connected, self.peers(rank, world), world)
        stages = (
            StageRunner(  # direction 0: rank 0 -> rank PP-1
                self.module[0],
                p2p,
                0,
                prev=rank - 1 if rank > 0 else None,
                next_=rank + 1 if rank < last else None,
                input_chunks=input_chunks if rank == 0 else None,
                criterion=criterion,
                label_chunks=label_chunks if rank == last else None,
                keep_outputs=return_outputs,
                timeline=timeline,
            ),
            StageRunner(  # direction 1: rank PP-1 -> rank 0
                self.module[1],
                p2p,
                1,
                prev=rank + 1 if rank < last else None,
                next_=rank - 1 if rank > 0 else None,
                input_chunks=input_chunks if rank == last else None,
                criterion=criterion,
                label_chunks=label_chunks if rank == 0 else None,
                keep_outputs=return_outputs,
                timeline=timeline,
            ),
        )
        self._run_schedule(stages, rank, world, n, self.overlap)
        p2p.wait_all()
        if timeline is not None:
            timeline.end_step()

        ending = {0: stages[1], last: stages[0]}.get(rank)
        if ending is None:
            return None, None
        return ending.total_loss(), (ending.gathered_outputs() if return_outputs else None)

    @staticmethod
    def _run_schedule(stages, rank: int, world: int, n: int, overlap: bool = True) -> None:
        half = world // 2
        k = min(rank, world - 1 - rank)
        near = stages[0] if rank < half else stages[1]  # the direction this rank is early in
        far = stages[1] if rank < half else stages[0]
        wgrad = WeightGradStore()

        def _forward_backward(f: StageRunner, b: StageRunner) -> None:
            forward_backward(f, b, overlap)  # an F&B cell, through the overlap hook if any

        # 1. Warmup: forwards of the near direction only.
        for _ in range(2 * (half - k - 1)):
            near.forward_chunk()
        # 2. Forwards of both directions, alternating.
        for _ in range(k + 1):
            near.forward_chunk()
            far.forward_chunk()
        # 3. Far backward split into B then W, then a far forward.
        for _ in range(half - k - 1):
            far.backward_chunk(wgrad)
            wgrad.pop()
            far.forward_chunk()
        # 4. Main phase: F&B pairs in both directions.
        for _ in range(n - world + k + 1):
            _forward_backward(near, far)
            _forward_backward(far, near)
        # 5. Far backward, then the last far forwards paired with near backwards.
        for _ in range(half - k - 1):
            far.backward_chunk()
            _forward_backward(far, near)
        # 6. Backwards of both directions; the near ones defer W to fill the tail.
        for _ in range(k + 1):
            far.backward_chunk()
            near.backward_chunk(wgrad)
        # 7. W of an earlier chunk, then a near backward with its W deferred.
        for _ in range(half - k - 1):
            wgrad.pop()
            near.backward_chunk(wgrad)
        # 8. Cooldown: the remaining W.
        wgrad.flush()
        assert all(s.n_fwd == n and s.n_bwd == n and not s.states for s in stages)

    def reduce_mirrored_grads(self) -> None:
        """Sum the gradients of the two copies of each stage (ranks r and PP-1-r hold stage r).

        After it, ``modules[0]`` of rank r and ``modules[1]`` of rank PP-1-r carry the same
        gradient: that of the whole model. Parameters without a gradient take part as zeros.
        """
        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        mirror = world - 1 - rank
        device = module_device(self.module)
        p2p = self._p2p(device)
        mine = [
            [p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()]
            for m in self.module
        ]
        connect_once(p2p, self._connected, (mirror,), world)
        # Rank r's modules[0] is the mirror's modules[1] and vice versa. The lower rank sends
        # first, so the pair's first ops never cross (see the module docstring).
        if rank < mirror:
            p2p.send(mine[0] + mine[1], mirror, tag=4)
            theirs = p2p.recv(mirror, tag=4)
        else:
            theirs = p2p.recv(mirror, tag=4)
            p2p.send(mine[0] + mine[1], mirror, tag=4)
        n0 = len(mine[0])
        got = (theirs[len(theirs) - n0 :], theirs[: len(theirs) - n0])
        for m, own, other in zip(self.module, mine, got, strict=True):
            if len(own) != len(other):
                raise ValueError("the two copies of a stage must have the same parameters")
            for p, g_own, g_other in zip(m.parameters(), own, other, strict=True):
                p.grad = g_own + g_other
        p2p.wait_all()
