"""DeepSeekMoE: the router (auxiliary-loss-free balancing) and the MoE layer.

``ref.py`` holds the pure-PyTorch routing and permutation references that the modules call and
that GPU kernels are tested against.
"""

from ptxtrain.moe.layer import MoE
from ptxtrain.moe.router import Router

__all__ = ["MoE", "Router"]
