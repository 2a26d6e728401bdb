"""Accuracy metrics: DeepGEMM's ``calc_diff``, torchao's SQNR, and a bit-exact comparison."""

from __future__ import annotations

import math

import torch


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's GEMM oracle: ``1 - 2·Σxy / Σ(x² + y²)``, computed in float64.

    0 for identical tensors, about ``‖x - y‖² / (2‖y‖²)`` for nearby ones, 1 for orthogonal ones.
    FP8 x FP8 GEMMs pass at ``< 1e-3`` against a high-precision matmul of the unquantized inputs
    (docs/design.md §2). Empty tensors give 0; a NaN anywhere gives NaN, failing any ``<`` check.

    Raises:
        ValueError: the shapes differ.
    """
    if x.shape != y.shape:
        raise ValueError(f"calc_diff needs equal shapes, got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.numel() == 0:
        return 0.0
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1.0 - 2.0 * (x * y).sum() / denom)


def sqnr_db(signal: torch.Tensor, estimate: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio ``20·log10(‖signal‖ / ‖signal - estimate‖)`` in dB.

    ``signal`` is the high-precision reference. torchao's bars: ≥ 28 dB for an FP8 GEMM, ≥ 25 dB
    for an FP8 Linear output, ≥ 30 dB for its input/weight gradients. Identical tensors give +inf.

    Raises:
        ValueError: the shapes differ.
    """
    if signal.shape != estimate.shape:
        raise ValueError(
            f"sqnr_db needs equal shapes, got {tuple(signal.shape)} and {tuple(estimate.shape)}"
        )
    s, e = signal.double(), estimate.double()
    noise = torch.linalg.vector_norm(s - e)
    if noise == 0:
        return math.inf
    return float(20.0 * torch.log10(torch.linalg.vector_norm(s) / noise))


def assert_bitwise_equal(
    actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor"
) -> None:
    """Assert two tensors have equal shape, dtype and bytes (NaN payloads included).

    FP8 tensors are compared through a ``uint8`` view since CPU FP8 lacks comparison ops. The
    message names the first differing index and both values.
    """
    if actual.shape != expected.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        raise AssertionError(f"{name}: dtype {actual.dtype} != {expected.dtype}")
    if actual.numel() == 0:
        return
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        actual.element_size()
    ]
    a = actual.detach().cpu().contiguous().view(int_dtype)
    e = expected.detach().cpu().contiguous().view(int_dtype)
    diff = a != e
    if diff.any():
        idx = tuple(int(i) for i in diff.nonzero()[0])
        n = int(diff.sum())
        raise AssertionError(
            f"{name}: {n} of {a.numel()} elements differ; first at {idx}: "
            f"{actual[idx].float().item()!r} != {expected[idx].float().item()!r}"
        )
