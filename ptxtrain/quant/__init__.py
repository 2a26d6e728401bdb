"""FP8 quantization with DeepSeek-V3's fine-grained scaling (1x128 tiles, 128x128 blocks).

Today every function is the pure-PyTorch reference in :mod:`ptxtrain.quant.ref`, which runs on
any device; GPU kernels arrive behind the same names.
"""

from ptxtrain.quant.ref import (
    AMAX_EPS,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    per_block_cast_back,
    per_block_cast_to_fp8,
    per_token_cast_back,
    per_token_cast_to_fp8,
    per_token_cast_to_fp8_both,
    per_token_cast_to_fp8_t,
)

__all__ = [
    "AMAX_EPS",
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "per_block_cast_back",
    "per_block_cast_to_fp8",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "per_token_cast_to_fp8_both",
    "per_token_cast_to_fp8_t",
]
