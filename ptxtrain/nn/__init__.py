"""FP8 training modules: DeepSeek-V3's fine-grained FP8 Linear (report §3.3, docs/design.md §1).

Design note. For ``y = x·Wᵀ`` with x [M, K] (M tokens) and W [N, K], all three GEMMs run in
E4M3 with fp32 dequantization scales computed online:

- Fprop  ``y = x·Wᵀ``  — x per 1x128 tile along K, W per 128x128 block: ``fp8_gemm_nt`` (1D2D).
  Output in x's dtype; the bias is added in fp32 before the one rounding.
- Dgrad  ``dx = dy·W`` — dy per 1x128 tile along N; W's forward blocks transposed
  (``w_fp8.t()``, ``sf.t()``) are a 128x128 quantization of Wᵀ: ``fp8_gemm_nt`` (1D2D).
- Wgrad  ``dW = dyᵀ·x`` — contracts over tokens, so dy and x are both quantized 1x128 along M
  (128x1 tiles of the originals, stored transposed): ``fp8_gemm_nt_1d1d`` (1D1D), fp32 result
  cast to the weight's dtype.

Saved for backward: only FP8 data and their scales — xᵀ's 128x1 quantization (made in the forward
from the same read of x as the fprop quantization, ``per_token_cast_to_fp8_both``) and W's 128x128
quantization from the forward. The high-precision x is not kept: that is DeepSeek's "cache the
activations in FP8" saving (1 byte + 4/128 per element instead of 2 or 4), and the wgrad sees the
very x that was quantized once. A GEMM configured off runs in the activation dtype and then saves
what it needs in high precision (x for wgrad, the weight Parameter itself for dgrad).
"""

from ptxtrain.nn.fp8_grouped import fp8_grouped_linear
from ptxtrain.nn.fp8_linear import (
    RECIPES,
    Fp8Linear,
    Fp8LinearConfig,
    convert_to_fp8_training,
    invalidate_fp8_weight_caches,
    register_fp8_cache_hooks,
    shared_input_quantization,
)

__all__ = [
    "RECIPES",
    "Fp8Linear",
    "Fp8LinearConfig",
    "convert_to_fp8_training",
    "fp8_grouped_linear",
    "invalidate_fp8_weight_caches",
    "register_fp8_cache_hooks",
    "shared_input_quantization",
]
