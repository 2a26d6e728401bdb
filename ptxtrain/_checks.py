"""Argument validation shared by every public entry point.

Each check raises ``TypeError`` (wrong type or dtype) or ``ValueError`` (wrong shape, layout,
device or value) with a message that names the argument, what it got and what it needs, so no
``AssertionError`` or ``IndexError`` from deep inside an op reaches a user. Also the one
numeric check library code makes on its own results (:func:`calc_diff`; tests reach it through
:mod:`ptxtrain.testing`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def ceil_div(a: int, b: int) -> int:
    """⌈a / b⌉ for non-negative ``a`` and positive ``b``."""
    return (a + b - 1) // b


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


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    ndim: int | Iterable[int] | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Validate one tensor argument and return it.

    Raises:
        TypeError: ``t`` is not a tensor, or its dtype is not in ``dtypes``.
        ValueError: its rank is not ``ndim``, or it is not contiguous while ``contiguous``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {t.dtype}")
    if ndim is not None:
        ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in ndims:
            want = " or ".join(f"{n}-D" for n in ndims)
            raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous (row-major), got strides {t.stride()} for shape "
            f"{tuple(t.shape)}; call .contiguous() first"
        )
    return t


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], what: str = "") -> None:
    """Raise ``ValueError`` unless ``t.shape == shape``; ``what`` says why."""
    if tuple(t.shape) != tuple(shape):
        hint = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {tuple(shape)}{hint}, got {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    """Raise ``ValueError`` unless all tensors live on one device."""
    devices = {n: t.device for n, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device, got {listing}")


def check_positive_int(name: str, value: object) -> int:
    """Raise unless ``value`` is an int > 0 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value
