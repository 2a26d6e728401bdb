"""Where each pipeline stage lives under each schedule, and the schedule object of one rank.

Placement (docs/design.md §5; DeepSeek-V3 report §3.2.1), for PP pipeline ranks:

=========== ======== ==================================================================
schedule    stages   rank r holds
=========== ======== ==================================================================
1f1b        PP       stage r
dualpipe    PP       stage r (direction 0) and stage PP-1-r (direction 1): every stage
                     has two copies, on ranks s and PP-1-s, whose gradients are summed
dualpipev   2·PP     stage r (down leg) and stage 2·PP-1-r (up leg): one copy each
=========== ======== ==================================================================

The *owner* of a stage is the rank whose copy counts once in global sums (gradient norms,
gathering the model): rank s for 1F1B and DualPipe, ``min(s, 2·PP-1-s)`` for DualPipeV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from ptxtrain.parallel.dualpipe import DualPipe
from ptxtrain.parallel.dualpipev import DualPipeV
from ptxtrain.parallel.one_f_one_b import OneFOneB
from ptxtrain.parallel.p2p import schedule_pairs

__all__ = [
    "SCHEDULES",
    "build_schedule",
    "check_pipeline",
    "min_num_chunks",
    "num_stages",
    "owner_of_stage",
    "p2p_pairs",
    "stages_of_rank",
]

SCHEDULES = ("1f1b", "dualpipe", "dualpipev")


def _check_schedule(schedule: object) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")


def num_stages(schedule: str, pp: int) -> int:
    """Pipeline stages of the model: ``2·pp`` for DualPipeV, else ``pp``."""
    _check_schedule(schedule)
    return 2 * pp if schedule == "dualpipev" else pp


def min_num_chunks(schedule: str, pp: int) -> int:
    """The fewest micro-batches a step may have: 1 for 1F1B, ``2·pp`` for DualPipe(V)."""
    _check_schedule(schedule)
    return 1 if schedule == "1f1b" else 2 * pp


def stages_of_rank(schedule: str, rank: int, pp: int) -> tuple[int, ...]:
    """The stage indices rank ``rank`` holds, in the order its schedule takes its modules."""
    _check_schedule(schedule)
    if not 0 <= rank < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    if schedule == "1f1b":
        return (rank,)
    return (rank, num_stages(schedule, pp) - 1 - rank)


def owner_of_stage(schedule: str, stage: int, pp: int) -> int:
    """The rank whose copy of ``stage`` counts once (see the module docstring)."""
    n = num_stages(schedule, pp)
    if not 0 <= stage < n:
        raise ValueError(f"stage must be in [0, {n}), got {stage}")
    return min(stage, n - 1 - stage) if schedule == "dualpipev" else stage


def check_pipeline(schedule: str, pp: int, num_chunks: int) -> None:
    """Raise ``ValueError`` for a pipeline that cannot run; the same answer on every rank.

    Checks: ``schedule`` known; ``pp >= 1``; DualPipe needs ``pp`` even; ``num_chunks`` at least
    :func:`min_num_chunks` (and even for DualPipe, whose two directions take half each). What
    each stage holds is the caller's (``ptxtrain.train.pipeline_layout``).
    """
    _check_schedule(schedule)
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an int >= 1, got {pp!r}")
    if schedule == "dualpipe" and pp % 2:
        raise ValueError(f"the dualpipe schedule needs an even number of pipeline ranks, got {pp}")
    low = min_num_chunks(schedule, pp)
    if isinstance(num_chunks, bool) or not isinstance(num_chunks, int) or num_chunks < low:
        raise ValueError(
            f"num_chunks must be an int >= {low} for {schedule} on {pp} ranks, got {num_chunks!r}"
        )
    if schedule == "dualpipe" and num_chunks % 2:
        raise ValueError(f"num_chunks must be even for dualpipe, got {num_chunks}")


def build_schedule(
    schedule: str,
    modules: Sequence[nn.Module],
    process_group: dist.ProcessGroup | None = None,
    *,
    overlap: bool = True,
    p2p_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
) -> OneFOneB | DualPipe | DualPipeV:
    """The schedule object of one rank over its stage ``modules`` (ordered as
    :func:`stages_of_rank`): one module for 1F1B, two for DualPipe / DualPipeV. ``overlap``:
    DualPipe / DualPipeV run their F&B steps through the stages' overlap hook (ignored by 1F1B,
    which has no F&B step). ``p2p_groups``: the per-direction groups of :func:`p2p_pairs`
    (see the schedule classes)."""
    _check_schedule(schedule)
    if schedule == "1f1b":
        if len(modules) != 1:
            raise ValueError(f"1f1b takes one stage module per rank, got {len(modules)}")
        return OneFOneB(modules[0], process_group, p2p_groups=p2p_groups)
    cls = DualPipe if schedule == "dualpipe" else DualPipeV
    return cls(list(modules), process_group=process_group, overlap=overlap, p2p_groups=p2p_groups)


def p2p_pairs(schedule: str, ranks: Sequence[int]) -> list[tuple[int, int]]:
    """The pairs of global ranks ``schedule`` sends messages between, for the pipeline whose
    group rank ``i`` is global rank ``ranks[i]`` (neighbours; DualPipe also mirror pairs), for
    :func:`~ptxtrain.parallel.p2p.directional_groups`."""
    _check_schedule(schedule)
    cls = {"1f1b": OneFOneB, "dualpipe": DualPipe, "dualpipev": DualPipeV}[schedule]
    return schedule_pairs(cls.peers, ranks)
