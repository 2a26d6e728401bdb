"""Accuracy metrics: DeepGEMM's ``calc_diff`` (defined in :mod:`ptxtrain._checks`, which
library code uses too), torchao's SQNR, and a bit-exact comparison."""

from __future__ import annotations

import math

import torch

from ptxtrain._checks import calc_diff

__all__ = ["assert_bitwise_equal", "calc_diff", "sqnr_db"]


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
