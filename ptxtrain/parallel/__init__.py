"""Pipeline-parallel schedules: 1F1B and DualPipe (DeepSeek-V3 report §3.2.1), pure PyTorch.

Both run one rank's stage(s) through ``step(*inputs, num_chunks, criterion, labels,
return_outputs) -> (loss, outputs)`` over ``torch.distributed`` point-to-point messages (gloo on
CPU, NCCL on GPU); tested against an unpartitioned single-process reference in float64.
"""

from ptxtrain.parallel._p2p import WeightGradStore
from ptxtrain.parallel.dualpipe import DualPipe
from ptxtrain.parallel.one_f_one_b import OneFOneB

__all__ = ["DualPipe", "OneFOneB", "WeightGradStore"]
