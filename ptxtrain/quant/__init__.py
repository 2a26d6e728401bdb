"""FP8 quantization with DeepSeek-V3's fine-grained scaling (1x128 tiles, 128x128 blocks).

Backends (each a module with the quantizers of :mod:`ptxtrain.quant.ref`, bit-identical):

- ``ref``: PyTorch ops; any device; the oracle.
- ``triton``: Triton kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``), incl. the fused
  one-read ``per_token_cast_to_fp8_both``.
- ``cuda``: hand-written CUDA kernels compiled by NVRTC (:mod:`ptxtrain.jit`) for sm_90a: one
  read of each 128x128 tile for the transposed and fused quantizations.

``auto`` (the default) picks, for CUDA tensors, ``cuda`` for the ops in
``ptxtrain.quant.cuda.AUTO_OPS`` on an sm_90 GPU when NVRTC and the driver are present, else
``triton`` when Triton is installed, else ``ref``; ``PTXTRAIN_QUANT_BACKEND`` forces one (for
every op). Dequantization (``*_cast_back``) is always the reference.
"""

from __future__ import annotations

import functools

import torch

from ptxtrain import _backend
from ptxtrain.quant.ref import (
    AMAX_EPS,
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    SF_LAYOUTS,
    check_sf_layout,
    per_block_cast_back,
    per_token_cast_back,
    to_mn_major,
)

BACKENDS = ("ref", "triton", "cuda")
ENV_VAR = "PTXTRAIN_QUANT_BACKEND"


def backends() -> dict[str, str]:
    """Each quantization backend → ``"available"`` (it imports and can run on this machine's
    current device: ``ref`` anywhere, ``triton`` on CUDA or under ``TRITON_INTERPRET=1``,
    ``cuda`` on an sm_90 GPU with the driver) or ``"unavailable: <reason>"`` here."""
    return _backend.availability(__name__, BACKENDS, _why_not)


def _why_not(name: str, module) -> str | None:
    if name == "triton":
        return _backend.triton_missing()
    if name == "cuda":
        reason = _backend.hopper_missing()
        if reason is None and not module.usable(torch.device("cuda")):
            reason = "needs the CUDA driver library"
        return reason
    return None


def select_backend(x: torch.Tensor, op: str = "per_token_cast_to_fp8") -> str:
    """The backend ``auto`` (or ``PTXTRAIN_QUANT_BACKEND``) gives for quantizer ``op`` of ``x``.

    Args:
        x: the input tensor (its device decides).
        op: the quantizer's name, e.g. ``"per_token_cast_to_fp8_both"``.

    Raises:
        ValueError: ``PTXTRAIN_QUANT_BACKEND`` holds an unknown name.
    """
    forced = _backend.requested(ENV_VAR, BACKENDS)
    if forced != "auto":
        return forced
    if x.device.type != "cuda":
        return "ref"
    return _auto_cuda(_backend.cuda_index(x.device), op)


@functools.lru_cache(maxsize=256)
def _auto_cuda(index: int | None, op: str) -> str:
    """``select_backend``'s ``auto`` choice for ``op`` on CUDA device ``index`` (None: the
    current one); cached: it depends on the device and the installed toolchain only."""
    device = torch.device("cuda", index) if index is not None else torch.device("cuda")
    if _cuda_usable(device, op):
        return "cuda"
    if _backend.triton_usable(device):
        return "triton"
    return "ref"


def _cuda_usable(device: torch.device, op: str) -> bool:
    """The cuda backend imports (NVRTC present), runs on ``device`` and takes ``op`` in auto."""
    try:
        cuda_backend = _backend.load(__name__, "cuda")
    except RuntimeError:
        return False
    return op in cuda_backend.AUTO_OPS and cuda_backend.usable(device)


def _impl(fn_name: str, x: object):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return getattr(_backend.load(__name__, select_backend(x, fn_name)), fn_name)


def _with_layout(fn, x, block, pow2_scale, sf_layout):
    """Run a 1x128 / 128x1 quantizer ``fn`` with scales in ``sf_layout`` (the reference backend
    has only row-major scales: they are re-laid out after it)."""
    if check_sf_layout(sf_layout) == "row":
        return fn(x, block, pow2_scale=pow2_scale)
    if fn.__module__.endswith(".ref"):
        out = fn(x, block, pow2_scale=pow2_scale)
        return tuple(to_mn_major(t) if t.dtype == torch.float32 else t for t in out)
    return fn(x, block, pow2_scale=pow2_scale, sf_layout=sf_layout)


def per_token_cast_to_fp8(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 quantization on the selected backend.

    ``sf_layout``: ``"row"`` (row-major scales, the reference's layout) or ``"mn_major"`` (strides
    ``(1, 4·⌈M/4⌉)``: the layout the PTX and cuBLAS GEMMs read, so they need no transpose copy).

    Contract and errors: :func:`ptxtrain.quant.ref.per_token_cast_to_fp8`; ValueError for an
    unknown ``sf_layout``.
    """
    return _with_layout(_impl("per_token_cast_to_fp8", x), x, block, pow2_scale, sf_layout)


def per_token_cast_to_fp8_t(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 quantization stored transposed, on the selected backend.

    ``sf_layout``: of ``sf_t``, as :func:`per_token_cast_to_fp8` (strides ``(1, 4·⌈K/4⌉)``).

    Contract and errors: :func:`ptxtrain.quant.ref.per_token_cast_to_fp8_t`.
    """
    return _with_layout(_impl("per_token_cast_to_fp8_t", x), x, block, pow2_scale, sf_layout)


def per_token_cast_to_fp8_both(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both quantizations of one tensor (one read in the fused kernel), on the selected backend.

    ``sf_layout``: of both scale tensors, as :func:`per_token_cast_to_fp8`.

    Contract and errors: :func:`ptxtrain.quant.ref.per_token_cast_to_fp8_both`.
    """
    return _with_layout(_impl("per_token_cast_to_fp8_both", x), x, block, pow2_scale, sf_layout)


def per_block_cast_to_fp8(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 quantization on the selected backend.

    Contract and errors: :func:`ptxtrain.quant.ref.per_block_cast_to_fp8`.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    return _impl("per_block_cast_to_fp8", w)(w, block, pow2_scale=pow2_scale)


def per_block_cast_to_fp8_both(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """128x128 quantizations of ``w`` and ``wᵀ`` (one read in the Triton and CUDA kernels), on
    the selected backend.

    Contract and errors: :func:`ptxtrain.quant.ref.per_block_cast_to_fp8_both`.
    """
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w must be a torch.Tensor, got {type(w).__name__}")
    return _impl("per_block_cast_to_fp8_both", w)(w, block, pow2_scale=pow2_scale)


__all__ = [
    "AMAX_EPS",
    "BACKENDS",
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "SF_LAYOUTS",
    "backends",
    "per_block_cast_back",
    "per_block_cast_to_fp8",
    "per_block_cast_to_fp8_both",
    "per_token_cast_back",
    "per_token_cast_to_fp8",
    "per_token_cast_to_fp8_both",
    "per_token_cast_to_fp8_t",
    "select_backend",
    "to_mn_major",
]
