"""Pipeline-parallel schedules: 1F1B, DualPipe and DualPipeV (DeepSeek-V3 report §3.2.1).

All run one rank's stage(s) through ``step(*inputs, num_chunks, criterion, labels,
return_outputs, timeline) -> (loss, outputs)`` over ``torch.distributed`` point-to-point messages
(gloo on CPU, NCCL on GPU); tested against an unpartitioned single-process reference in float64.
A :class:`Timeline` records what each rank ran when (``ptxtrain plot timeline`` draws it).
DualPipe / DualPipeV run their F&B steps through a stage class's ``overlapped_forward_backward``
classmethod when it has one (:func:`ptxtrain.parallel.p2p.forward_backward`), and every schedule
sets up its P2P connections before its first message (:meth:`ptxtrain.parallel.p2p.P2P.connect`).
"""

from ptxtrain.parallel.dualpipe import DualPipe
from ptxtrain.parallel.dualpipev import DualPipeV
from ptxtrain.parallel.one_f_one_b import OneFOneB
from ptxtrain.parallel.p2p import WeightGradStore
from ptxtrain.parallel.timeline import BubbleStats, Timeline, bubble_stats, read_timelines

__all__ = [
    "BubbleStats",
    "DualPipe",
    "DualPipeV",
    "OneFOneB",
    "Timeline",
    "WeightGradStore",
    "bubble_stats",
    "read_timelines",
]
