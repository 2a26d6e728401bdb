"""Accuracy bounds shared by the FP8 GEMM tests (dense and grouped, every backend)."""

import os

# DeepGEMM's FP8 x FP8 bar (docs/design.md §2): e4m3's 3 mantissa bits give each operand ~2.6% RMS
# relative error per element, so calc_diff of a random-input GEMM sits near 6-8e-4; a wrong scale
# index, a missed K block, a wrong group or a transposed tile pushes it far above 1e-2.
CALC_DIFF_MAX = 1e-3

# A Triton kernel against the reference (same FP8 operands, dequantize-then-fp32-matmul), per
# element, relative to Σ|terms| = |A|·|B|ᵀ. Interpreter: both sum the same exact fp32 products in
# different orders, |error| <= ~2·K·2^-24·Σ|terms| (< 7e-5 for the K <= 512 the tests use),
# bound 1e-4. GPU: Hopper's FP8 tensor cores keep only ~14 bits while summing each 128-K block
# (DeepSeek-V3 §3.3), ~2^-14·Σ|terms| per block, bound 1e-3 (measured just over 1e-4 on an H200).
# One wrong scale, group or missed block is an O(1) fraction of Σ|terms| either way.
REF_REL = 1e-4 if os.environ.get("TRITON_INTERPRET") == "1" else 1e-3

# bf16 output: one rounding of the fp32 result, at most 2^-8 relative (RNE on the GPU and in the
# patched interpreter) or 2^-7 (the unpatched interpreter truncates).
BF16_REL = 2.0**-7
