"""1F1B pipeline schedule (one forward, one backward), the baseline DualPipe is measured against.

Design notes (docs/design.md §5; the baseline of deepseek-ai/DualPipe's bubble comparison):

- PP ranks, rank s holds stage s; micro-batches enter at rank 0 and the loss is computed at rank
  PP-1. Each rank runs (1) warmup: ``min(PP-1-s, N)`` forwards, (2) steady state: one forward then
  one backward until every forward is issued, (3) cooldown: the remaining backwards. At most
  ``PP - s`` micro-batches' activations are alive on rank s (PP on rank 0).
- Bubble per rank: ``(PP-1)(F+B)`` (F, B: one chunk's forward / full backward time).
- Communication is plain async send + blocking receive (``p2p``); compute/communication overlap is
  not attempted here. The first ``step`` sets up the P2P connections to both neighbours
  (:meth:`~ptxtrain.parallel.p2p.P2P.connect`), as the other schedules do.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ptxtrain.parallel.p2p import (
    PairGroupsMixin,
    StageRunner,
    check_step_args,
    connect_once,
    module_device,
)
from ptxtrain.parallel.timeline import Timeline


class OneFOneB(PairGroupsMixin, nn.Module):
    """Run one pipeline stage under the 1F1B schedule.

    Args:
        module: this rank's stage. It takes the previous stage's outputs (a tensor or a tuple of
            tensors) as positional arguments and returns a tensor or a tuple of tensors.
        process_group: the pipeline's process group (default: the world); group rank s holds
            stage s.
        p2p_groups: ``{(src, dst): group}`` of global ranks from
            :func:`~ptxtrain.parallel.p2p.directional_groups` over this pipeline's
            :meth:`peers` (one NCCL communicator per direction, so crossed large sends cannot
            block each other). None: created at the first ``step`` on the default group; with a
            subgroup, messages then travel on ``process_group`` itself.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        p2p_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        self.module = module
        self.group = process_group
        self._connected: set[int] = set()  # peers whose P2P connections are set up
        self._pair_groups = p2p_groups

    def step(
        self,
        *inputs: torch.Tensor,
        num_chunks: int,
        criterion: Callable | None = None,
        labels: Sequence[torch.Tensor] = (),
        return_outputs: bool = False,
        timeline: Timeline | None = None,
    ) -> tuple[torch.Tensor | None, object]:
        """One training step (forward + backward) over ``num_chunks`` micro-batches.

        Args:
            inputs: the batch, given on rank 0 only (empty elsewhere); every tensor is split along
                dim 0 into ``num_chunks`` equal micro-batches.
            num_chunks: number of micro-batches N (same int on every rank), N >= 1.
            criterion: on the last rank, ``criterion(*outputs, *labels) -> loss`` for one
                micro-batch (one-element tensor); ignored elsewhere.
            labels: on the last rank, tensors split along dim 0 like the inputs.
            return_outputs: on the last rank, also return the stage outputs, concatenated over
                the micro-batches along dim 0 (detached).
            timeline: an optional :class:`~ptxtrain.parallel.timeline.Timeline` (per rank) that
                records this step's F / B / W / BW / send / recv cells.

        Returns:
            ``(loss, outputs)``: on the last rank ``loss`` is the SUM of the N micro-batch losses
            (0-d, detached) and the gradients accumulated into every stage's parameters are those
            of that sum, as if one backward ran on it (scale the criterion by 1/N for a mean).
            Elsewhere ``(None, None)``; ``outputs`` is None unless ``return_outputs``.

        Raises:
            ValueError: ``num_chunks`` < 1; inputs missing on rank 0 or given on another rank;
                criterion missing on the last rank; a tensor whose dim 0 is not divisible by
                ``num_chunks``; ``timeline`` not a Timeline. Checks on arguments only one rank
                sees are shared through one all-gather, so every rank raises (none is left
                waiting).
            TypeError: ``num_chunks`` not an int, an input or label not a tensor.
        """
        # 0. Validation: global checks first (same result on every rank), then the local ones.
        if isinstance(num_chunks, bool) or not isinstance(num_chunks, int):
            raise TypeError(f"num_chunks must be an int, got {type(num_chunks).__name__}")
        if num_chunks < 1:
            raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
        rank = dist.get_rank(self.group)
        world = dist.get_world_size(self.group)
        first, last = rank == 0, rank == world - 1
        device = module_device(self.module)
        input_chunks, label_chunks = check_step_args(
            "1F1B", inputs, labels, criterion, timeline, group=self.group, rank=rank,
            world=world, input_ranks=(0,), loss_ranks=(world - 1,), n=num_chunks,
        )  # fmt: skip
        if timeline is not None:
            timeline.begin_step("1f1b", rank, world, num_chunks, device)

        p2p = self._p2p(device)
        connect_once(p2p, self._connected, self.peers(rank, world), world)
        stage = StageRunner(
            self.module,
            p2p,
            direction=0,
            prev=None if first else rank - 1,
            next_=None if last else rank + 1,
            input_chunks=input_chunks,
            criterion=criterion,
            label_chunks=label_chunks,
            keep_outputs=return_outputs,
            timeline=timeline,
        )
        n_warmup = min(world - 1 - rank, num_chunks)

        # 1. Warmup: forwards only, filling the pipeline.
        for _ in range(n_warmup):
            stage.forward_chunk()
        # 2. Steady state: one forward, one backward.
        for _ in range(num_chunks - n_warmup):
            stage.forward_chunk()
            stage.backward_chunk()
        # 3. Cooldown: drain the remaining backwards.
        for _ in range(n_warmup):
            stage.backward_chunk()
        p2p.wait_all()
        if timeline is not None:
            timeline.end_step()

        if not last:
            return None, None
        return stage.total_loss(), (stage.gathered_outputs() if return_outputs else None)
