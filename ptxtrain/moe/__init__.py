"""DeepSeekMoE: the router (auxiliary-loss-free balancing), the MoE layer and its stacked routed
experts.

``ref.py`` holds the pure-PyTorch routing and permutation references that the modules call and
that GPU kernels are tested against; ``experts.py`` the routed experts (FP8 grouped GEMMs when
``fp8``). Expert-parallel dispatch / combine (DeepEP's ``Buffer``) lives in :mod:`ptxtrain.ep`,
which the layer uses.
"""

from ptxtrain.moe.experts import Experts
from ptxtrain.moe.layer import MoE
from ptxtrain.moe.router import Router

__all__ = [
    "Experts",
    "MoE",
    "Router",
]
