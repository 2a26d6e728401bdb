"""DeepSeekMoE: the router (auxiliary-loss-free balancing), the MoE layer, its stacked routed
experts, and expert-parallel dispatch/combine.

``ref.py`` holds the pure-PyTorch routing and permutation references that the modules call and
that GPU kernels are tested against; ``dispatch.py`` the DeepEP-shaped ``Buffer`` (``all_to_all``
or ``nvlink`` backend); ``experts.py`` the routed experts (FP8 grouped GEMMs when ``fp8``).
"""

from ptxtrain.moe.dispatch import Buffer, DispatchHandle, EventOverlap, get_dispatch_layout
from ptxtrain.moe.experts import Experts
from ptxtrain.moe.layer import MoE
from ptxtrain.moe.router import Router

__all__ = [
    "Buffer",
    "DispatchHandle",
    "EventOverlap",
    "Experts",
    "MoE",
    "Router",
    "get_dispatch_layout",
]
