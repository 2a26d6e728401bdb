"""ptxtrain: DeepSeek-V3's training-efficiency stack for Hopper GPUs, with a CPU reference path.

Subpackages: :mod:`ptxtrain.quant` (FP8 quantizers), :mod:`ptxtrain.gemm` (block-scaled FP8
GEMMs), :mod:`ptxtrain.nn` (FP8 Linear), :mod:`ptxtrain.optim` (BF16-state AdamW),
:mod:`ptxtrain.model` / :mod:`ptxtrain.moe` (the DeepSeek-V3-style model), :mod:`ptxtrain.data`,
:mod:`ptxtrain.train`, :mod:`ptxtrain.bench`, :mod:`ptxtrain.testing`.
"""

__version__ = "0.1.0"

from ptxtrain.gemm import fp8_gemm_nt, fp8_gemm_nt_1d1d
from ptxtrain.model import DeepSeekV3, DeepSeekV3Config, build_model, get_preset
from ptxtrain.nn import Fp8Linear, Fp8LinearConfig, convert_to_fp8_training
from ptxtrain.optim import AdamW
from ptxtrain.quant import (
    per_block_cast_to_fp8,
    per_token_cast_to_fp8,
    per_token_cast_to_fp8_both,
    per_token_cast_to_fp8_t,
)

__all__ = [
    "AdamW",
    "DeepSeekV3",
    "DeepSeekV3Config",
    "Fp8Linear",
    "Fp8LinearConfig",
    "__version__",
    "build_model",
    "convert_to_fp8_training",
    "fp8_gemm_nt",
    "fp8_gemm_nt_1d1d",
    "get_preset",
    "per_block_cast_to_fp8",
    "per_token_cast_to_fp8",
    "per_token_cast_to_fp8_both",
    "per_token_cast_to_fp8_t",
]
