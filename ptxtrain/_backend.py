"""Backend choice shared by ``ptxtrain.gemm`` and ``ptxtrain.quant``.

A backend is a module implementing the same functions as the subpackage's ``ref.py``. The choice
is made per call from the device (and, for GEMMs, the shape), and can be forced with an
environment variable (``PTXTRAIN_GEMM_BACKEND`` / ``PTXTRAIN_QUANT_BACKEND``: ``auto`` or a
backend name), read at each call so tests and benchmarks can switch it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable
from types import ModuleType

import torch


def requested(env_var: str, names: tuple[str, ...]) -> str:
    """The backend forced by ``env_var`` (``auto`` when unset).

    Raises:
        ValueError: the variable holds something other than ``auto`` or one of ``names``.
    """
    value = os.environ.get(env_var, "").strip().lower() or "auto"
    if value != "auto" and value not in names:
        raise ValueError(f"{env_var} must be one of auto, {', '.join(names)}; got {value!r}")
    return value


def cuda_index(device: torch.device) -> int | None:
    """The index of CUDA device ``device``: its own, else the current device's (None where
    CUDA is not available, e.g. a CUDA device named on a CPU-only machine)."""
    if device.index is not None or not torch.cuda.is_available():
        return device.index
    return torch.cuda.current_device()


def triton_usable(device: torch.device) -> bool:
    """Triton kernels can run on ``device``: a CUDA tensor with triton installed, or the Triton
    interpreter (``TRITON_INTERPRET=1``) for CPU tensors."""
    if not _triton_installed():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def load(package: str, name: str) -> ModuleType:
    """Import ``package.name`` (e.g. ``ptxtrain.gemm.triton``).

    Raises:
        RuntimeError: the backend's module cannot be imported here (the message says why).
    """
    try:
        return importlib.import_module(f"{package}.{name}")
    except ImportError as e:
        raise RuntimeError(f"backend {name!r} of {package} is unavailable: {e}") from e


def availability(
    package: str,
    names: tuple[str, ...],
    why_not: Callable[[str, ModuleType], str | None] | None = None,
) -> dict[str, str]:
    """For ``backends()``: each backend name → ``"available"`` or ``"unavailable: <why>"``.

    A backend is available when its module imports and ``why_not(name, module)`` (the
    subpackage's check that it can run here: a GPU of the right kind, a toolchain) returns None;
    otherwise the reason is the import error or ``why_not``'s answer.
    """
    out = {}
    for name in names:
        try:
            module = load(package, name)
        except RuntimeError as e:
            out[name] = f"unavailable: {e.__cause__ or e}"
            continue
        reason = why_not(name, module) if why_not is not None else None
        out[name] = "available" if reason is None else f"unavailable: {reason}"
    return out


def hopper_missing() -> str | None:
    """None when the current CUDA device is an sm_90 (Hopper) GPU, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    return (
        None if cap == (9, 0) else f"needs an sm_90 GPU, the current device is sm_{cap[0]}{cap[1]}"
    )


def triton_missing() -> str | None:
    """None when Triton kernels can run here (a CUDA device, or the interpreter), else why not."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if triton_usable(device):
        return None
    return "no CUDA device (CPU tensors run Triton kernels only under TRITON_INTERPRET=1)"


def sm_clock_khz(device: torch.device | int | None = None) -> int:
    """The device's SM clock in kHz as torch reports it (``clock_rate``), or an H200's 1,980 MHz
    where this torch no longer reports one: for spin loops and cycle-counted timeouts, where an
    approximate rate is enough."""
    index = torch.cuda.current_device() if device is None else device
    props = torch.cuda.get_device_properties(index)
    return int(getattr(props, "clock_rate", 0) or 1_980_000)


# How an op with a Triton kernel and a torch reference picks between them (the ``kernels``
# argument / attribute of the MoE layer and of ptxtrain.nn.functional's fused ops).
KERNEL_CHOICES = ("auto", "ref", "triton")


def use_triton_kernels(kernels: str, x: torch.Tensor) -> bool:
    """Whether an op with a Triton kernel and a torch reference runs the kernel on input ``x``.

    Args:
        kernels: ``"auto"`` (the kernel for CUDA tensors of a float32 / bfloat16 / float16 dtype
            when Triton is installed, else the reference), ``"ref"`` (always the reference) or
            ``"triton"`` (always the kernel: CUDA, or the CPU under ``TRITON_INTERPRET=1``).
        x: the op's input (its device and dtype decide ``"auto"``).

    Raises:
        ValueError: ``kernels`` is not one of :data:`KERNEL_CHOICES`; ``"triton"`` where Triton
            cannot run (a CPU tensor without ``TRITON_INTERPRET=1``, or no triton).
        TypeError: ``"triton"`` with an ``x`` dtype the kernels do not take (float64).
    """
    from ptxtrain._checks import HP_DTYPES

    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"kernels must be one of {KERNEL_CHOICES}, got {kernels!r}")
    if kernels == "ref":
        return False
    if kernels == "auto":
        return x.device.type == "cuda" and x.dtype in HP_DTYPES and triton_usable(x.device)
    if x.dtype not in HP_DTYPES:
        raise TypeError(
            f"kernels='triton' needs a float32 / bfloat16 / float16 input, got {x.dtype}; use "
            "kernels='ref' (or 'auto') for float64"
        )
    if not triton_usable(x.device):
        raise ValueError(
            f"kernels='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 on the CPU) and triton "
            f"installed, got a {x.device.type} tensor"
        )
    return True
