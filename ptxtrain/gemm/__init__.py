"""Block-scaled FP8 GEMMs with DeepGEMM's contracts (DESIGN §2).

Today every function is the pure-PyTorch reference in :mod:`ptxtrain.gemm.ref`, which runs on any
device; Triton and PTX kernels arrive behind the same names.
"""

from ptxtrain.gemm.ref import fp8_gemm_nt, fp8_gemm_nt_1d1d

__all__ = ["fp8_gemm_nt", "fp8_gemm_nt_1d1d"]
