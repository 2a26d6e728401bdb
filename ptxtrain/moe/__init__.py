"""DeepSeekMoE: the router (auxiliary-loss-free balancing), the MoE layer, and expert-parallel
dispatch/combine.

``ref.py`` holds the pure-PyTorch routing and permutation references that the modules call and
that GPU kernels are tested against; ``dispatch.py`` the DeepEP-shaped ``Buffer``.
"""

from ptxtrain.moe.dispatch import Buffer, DispatchHandle, get_dispatch_layout
from ptxtrain.moe.layer import MoE
from ptxtrain.moe.router import Router

__all__ = ["Buffer", "DispatchHandle", "MoE", "Router", "get_dispatch_layout"]
