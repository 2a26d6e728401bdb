"""Expert-parallel communication: DeepEP's ``Buffer`` (dispatch / combine over a process group).

``buffer.py`` holds :class:`Buffer` (``all_to_all`` or ``nvlink`` backend) and its handle;
``config.py`` its tuning :class:`Config`; ``nvlink.py`` the host side of the NVLink kernel (its
CUDA source is ``ptxtrain/include/ptxtrain/ep_nvlink.cuh``); ``layout.py`` the few-launch send
layout, row packing and combine sum. A lower layer than :mod:`ptxtrain.moe`: nothing here
imports the MoE model layers.
"""

from ptxtrain.ep.buffer import Buffer, DispatchHandle, EventOverlap, get_dispatch_layout
from ptxtrain.ep.config import Config

__all__ = ["Buffer", "Config", "DispatchHandle", "EventOverlap", "get_dispatch_layout"]
