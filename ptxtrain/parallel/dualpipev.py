"""DualPipeV: DualPipe "cut in half", PP stages on PP/2 ranks in a V (docs/design.md §5), after
deepseek-ai/DualPipe's DualPipeV.

Design notes:

- R ranks, 2R stages. Rank r holds ``modules[0]`` = stage r and ``modules[1]`` = stage 2R-1-r.
  Every micro-batch enters at rank 0, goes down through stages 0..R-1 (ranks 0..R-1, "phase 0"),
  turns at rank R-1, which holds both stage R-1 and stage R (the hand-off is local, no message),
  and comes back up through stages R..2R-1 (ranks R-1..0, "phase 1"); the loss is computed on
  rank 0. Each stage has one copy, so no gradient reduction is needed (unlike DualPipe).
- This is DualPipe's schedule with the two directions replaced by the two legs of the V: phase 0
  plays DualPipe's "near" direction and phase 1 the "far" one on every rank, with ``k = r``.
  Per rank r, N = num_chunks (phases as in the paper's figure):
  (1) ``2(R-r-1)`` phase-0 forwards, (2) ``r+1`` x (phase-0 F, phase-1 F),
  (3) ``R-r-1`` x (phase-1 B, W, phase-1 F), (4) ``N-2R+r+1`` x (F0 & B1, F1 & B0) pairs,
  (5) ``R-r-1`` x (phase-1 B, F1 & B0), (6) ``r+1`` x (phase-1 B, phase-0 B), the last ``r+1`` of
  these backwards deferring W, (7) ``R-r-1`` x (W, phase-0 B deferring W), (8) remaining W.
  Each of the N micro-batches thus gets one F and one B per phase on every rank; needs
  N >= 2R. F&B pairs go through the stages' overlap hook when they define one, as in DualPipe
  (:func:`~ptxtrain.parallel.p2p.forward_backward`); otherwise forward, then backward.
- The first ``step`` sets up the P2P connections to both neighbours
  (:meth:`~ptxtrain.parallel.p2p.P2P.connect`; see :mod:`ptxtrain.parallel.p2p` for why NCCL
  needs it).
- Bubble ``(PP/2-1)(F&B+B-3W)`` with PP = 2R stages, as DualPipe's on PP ranks, for half the
  devices; 2 stages of parameters per rank and activations of up to PP+1 micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ptxtrain.parallel.p2p import (
    Loopback,
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


class DualPipeV(PairGroupsMixin, nn.Module):
    """Run the two stages of one rank under the DualPipeV (V-shaped) schedule.

    Args:
        modules: ``(stage_r, stage_{2R-1-r})`` for group rank r of R: exactly two ``nn.Module``;
            each takes the previous stage's outputs (tensor or tuple of tensors) as positional
            arguments and returns a tensor or a tuple of tensors. Stage R-1's outputs feed stage
            R on the same rank.
        batch_dim: the dimension the inputs and labels are split along into micro-batches:
            0 (the only one ptxtrain's schedules split along; upstream's second argument).
        process_group: the pipeline's process group (default: the world); any size R >= 1.
        rank_mapping: None or the identity list: group rank ``i`` is pipeline rank ``i`` (build
            the group in pipeline order); upstream's other permutations are refused.
        p2p_groups: ``{(src, dst): group}`` of global ranks from
            :func:`~ptxtrain.parallel.p2p.directional_groups` over this pipeline's
            :meth:`peers` (one NCCL communicator per direction, so crossed large sends cannot
            block each other). None: created at the first ``step`` on the default group; with a
            subgroup, messages then travel on ``process_group`` itself.
        overlap: run the F&B steps through the stages' ``overlapped_forward_backward`` hook
            when their class defines one; False: forward then backward.

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
        self.module = check_two_stages(modules, "(stage_r, stage_2R-1-r)")
        check_overlap_hooks(self.module)
        self.group = process_group
        self.overlap = bool(overlap)
        self._connected: set[int] = set()  # peers whose P2P connections are set up
        self._pair_groups = p2p_groups

    def step(
        self,
        *inputs: torch.Tensor,
        num_chunks: int = 0,
        criterion: Callable | None = None,
        labels: Sequence[torch.Tensor] = (),
        return_outputs: bool = False,
        timeline: Timeline | None = None,
    ) -> tuple[torch.Tensor | None, object]:
        """One training step (forward + backward) over ``num_chunks`` micro-batches.

        Args:
            inputs: the batch, on rank 0 only (empty elsewhere); every tensor is split along dim
                0 into ``num_chunks`` equal micro-batches.
            num_chunks: number of micro-batches N (same int on every rank), N >= 2R.
            criterion: on rank 0, ``criterion(*outputs, *labels) -> loss`` for one micro-batch
                (one-element tensor) applied to stage 2R-1's outputs; ignored elsewhere.
            labels: on rank 0, tensors split along dim 0 like the inputs.
            return_outputs: on rank 0, also return stage 2R-1's outputs, concatenated over the
                micro-batches along dim 0 (detached).
            timeline: an optional :class:`~ptxtrain.parallel.timeline.Timeline` (per rank) that
                records this step's cells; ``dir`` 0 = down leg (stage r), 1 = up leg.

        Returns:
            ``(loss, outputs)``: on rank 0 ``loss`` is the SUM of the N micro-batch losses (0-d,
            detached) and both stages of every rank accumulate the gradients of that sum (scale
            the criterion by 1/N for a mean). Other ranks get ``(None, None)``; ``outputs`` is
            None unless ``return_outputs``.

        Raises:
            ValueError: ``num_chunks`` < 2R; inputs or criterion missing on rank 0 or inputs
                given on another rank; a tensor whose dim 0 is not divisible by ``num_chunks``;
                ``timeline`` of a wrong type. Checks of what only one rank sees are shared by one
                all-gather, so every rank raises with every rank's message.
            TypeError: ``num_chunks`` not an int.
        """
        # 0. Validation: global checks (same on every rank) first, then the local ones.
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int):
            raise TypeError(f"num_chunks must be an int, got {type(num_chunks).__name__}")
        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        if num_chunks < 2 * world:
            raise ValueError(
                f"num_chunks must be >= 2*R = {2 * world} for DualPipeV on R={world} ranks, "
                f"got {num_chunks}"
            )
        first, last = rank == 0, rank == world - 1
        device = module_device(self.module)
        input_chunks, label_chunks = check_step_args(
            "DualPipeV", inputs, labels, criterion, timeline, group=self.group, rank=rank,
            world=world, input_ranks=(0,), loss_ranks=(0,), n=num_chunks,
        )  # fmt: skip
        if timeline is not None:
            timeline.begin_step("dualpipev", rank, world, num_chunks, device)

        p2p = self._p2p(device)
        connect_once(p2p, self._connected, self.peers(rank, world), world)
        turn = Loopback() if last else None  # stage R-1 -> stage R on rank R-1
        stages = (
            StageRunner(  # phase 0, stage r: down from rank r-1 to rank r+1
                self.module[0],
                p2p,
                0,
                prev=rank - 1 if not first else None,
                next_=turn if last else rank + 1,
                input_chunks=input_chunks,
                criterion=None,
                label_chunks=None,
                keep_outputs=False,
                timeline=timeline,
            ),
            StageRunner(  # phase 1, stage 2R-1-r: up from rank r+1 to rank r-1
                self.module[1],
                p2p,
                1,
                prev=turn if last else rank + 1,
                next_=rank - 1 if not first else None,
                input_chunks=None,
                criterion=criterion,
                label_chunks=label_chunks,
                keep_outputs=return_outputs,
                timeline=timeline,
            ),
        )
        self._run_schedule(stages, rank, world, num_chunks, self.overlap)
        p2p.wait_all()
        if timeline is not None:
            timeline.end_step()

        if not first:
            return None, None
        up = stages[1]
        return up.total_loss(), (up.gathered_outputs() if return_outputs else None)

    @staticmethod
    def _run_schedule(stages, rank: int, world: int, n: int, overlap: bool = True) -> None:
        down, up = stages
        wgrad = WeightGradStore()
        rest = world - rank - 1  # ranks below this one

        def _forward_backward(f: StageRunner, b: StageRunner) -> None:
            forward_backward(f, b, overlap)  # an F&B cell, through the overlap hook if any

        # 1. Warmup: down-leg forwards only.
        for _ in range(2 * rest):
            down.forward_chunk()
        # 2. Forwards of both legs, alternating.
        for _ in range(rank + 1):
            down.forward_chunk()
            up.forward_chunk()
        # 3. Up-leg B then its W at once (zero bubble), then an up-leg forward.
        for _ in range(rest):
            up.backward_chunk(wgrad)
            wgrad.pop()
            up.forward_chunk()
        # 4. Main phase: F&B pairs of both legs.
        for _ in range(n - 2 * world + rank + 1):
            _forward_backward(down, up)
            _forward_backward(up, down)
        # 5. Up-leg backward, then the last up-leg forwards paired with down-leg backwards.
        for _ in range(rest):
            up.backward_chunk()
            _forward_backward(up, down)
        # 6. Backwards of both legs; the last rank+1 of these 2(rank+1) defer their W.
        for j in range(2 * (rank + 1)):
            (up if j % 2 == 0 else down).backward_chunk(wgrad if j >= rank + 1 else None)
        # 7. W of an earlier chunk, then a down-leg backward with its W deferred.
        for _ in range(rest):
            wgrad.pop()
            down.backward_chunk(wgrad)
        # 8. Cooldown: the remaining W.
        wgrad.flush()
        assert all(s.n_fwd == n and s.n_bwd == n and not s.states for s in stages)
