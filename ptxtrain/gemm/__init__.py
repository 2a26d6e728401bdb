"""Block-scaled FP8 GEMMs with DeepGEMM's contracts (docs/design.md §2), dispatched to a backend.

Backends (each a module with the functions of :mod:`ptxtrain.gemm.ref`, including
``fp8_gemm_nt_unchecked`` / ``fp8_gemm_nt_1d1d_unchecked``, the public functions minus their
checks, which this dispatcher calls after validating once):

- ``ref``: dequantize + fp32 matmul in PyTorch; any device; the oracle.
- ``cublas``: cuBLAS blockwise FP8 through ``torch._scaled_mm`` (sm_90, N and K multiples of 16).
- ``triton``: Triton block-scaled kernels (CUDA, or CPU under ``TRITON_INTERPRET=1``).
- ``ptx``: hand-written sm_90a kernels (wgmma, TMA, mbarriers), NVRTC-compiled per shape
  (:mod:`ptxtrain.gemm.ptx`; K % 16 == 0).

``auto`` (the default) picks, per call: ``ref`` for CPU tensors; on CUDA ``ptx`` where it
measured fastest (:func:`ptx_wins`: decode-sized 1D2D, and large 1D2D / 1D1D whose tiles use
at least 85% of the SMs' tile slots over their waves or split a short last wave along K), then
``cublas`` for the shapes it runs correctly (:func:`ptxtrain.gemm.cublas.supports`) except
decode-sized 1D2D, then ``ptx`` for
the large 1D2D and 1D1D shapes cuBLAS cannot run (M > 128 or 1D1D, at least 264 tiles of
128x128), otherwise ``triton``, otherwise ``ref``.
``PTXTRAIN_GEMM_BACKEND`` forces one.
"""

from __future__ import annotations

import functools

import torch

from ptxtrain import _backend
from ptxtrain._checks import ceil_div
from ptxtrain.gemm import ref
from ptxtrain.gemm.heuristics import H100_SMS
from ptxtrain.gemm.ref import Operand

BACKENDS = ("ref", "cublas", "triton", "ptx")
ENV_VAR = "PTXTRAIN_GEMM_BACKEND"


def backends() -> dict[str, str]:
    """Each GEMM backend → ``"available"`` (it imports and can run on this machine's current
    device: ``ref`` anywhere, ``triton`` on CUDA or under ``TRITON_INTERPRET=1``, ``cublas`` on
    an sm_90 GPU, ``ptx`` on an sm_90 GPU with NVRTC and the driver) or
    ``"unavailable: <reason>"``."""
    return _backend.availability(__name__, BACKENDS, _why_not)


def _why_not(name: str, module) -> str | None:
    if name == "triton":
        return _backend.triton_missing()
    if name in ("cublas", "ptx"):
        reason = _backend.hopper_missing()
        if reason is None and name == "ptx" and not module.toolchain_available():
            reason = "needs NVRTC (nvidia-cuda-nvrtc), cuda-bindings and the CUDA driver"
        return reason
    return None


def ptx_wins(kind: str, m: int, n: int, k: int) -> bool:
    """Whether ``auto`` prefers the PTX kernels for this shape (pure rule, device not checked).

    From ``ptxtrain bench gemm`` on an H200, all backends in one process, scales MN-major (see
    docs/performance.md): 1D2D at M = 64 / 128 PTX runs 0.95-1.32x the speed of the faster of
    Triton and cuBLAS on the twelve V3 shapes (ties or better on ten); at M = 4096
    1.01-1.21x cuBLAS except 0.96x at 4096 x 2112 x 7168, whose 544 tiles of 128x128 fill 4.12
    waves of 132 SMs; 1D1D (wgrad, K = 4096) 1.05-1.11x cuBLAS. So: every decode-sized 1D2D
    (M <= 128); larger 1D2D and every 1D1D where the PTX heuristic's tiles fill at least two
    waves (two waves of 128x128 tiles) and either use at least 85% of the SMs' tile slots over
    all their waves or cut the partial last wave's tiles into K-slices (``PtxConfig.split_k``).
    4096 x 2112 x 7168 fills 544 / 660 = 0.82 of the slots; with the split tail PTX runs 1.04x
    cuBLAS there, 0.97x without. The rule sizes
    the grid for 132 SMs (H100 / H200); on other SM counts the launch plans its own split.
    """
    if kind not in ("1d2d", "1d1d"):
        return False
    if kind == "1d2d" and m <= 128:
        return True
    from ptxtrain.gemm import ptx

    if ceil_div(max(m, 1), 128) * ceil_div(max(n, 1), 128) < 2 * H100_SMS:
        return False
    cfg = ptx.select_config(kind, m, n, k, H100_SMS)
    if cfg.split_k:  # the partial last wave's tiles run as K-slices on every SM (split_tail)
        return True
    tiles = ceil_div(max(m, 1), cfg.block_m) * ceil_div(max(n, 1), cfg.block_n)
    return tiles / (ceil_div(tiles, H100_SMS) * H100_SMS) >= 0.85


def select_backend(kind: str, m: int, n: int, k: int, device: torch.device) -> str:
    """The backend ``auto`` (or ``PTXTRAIN_GEMM_BACKEND``) gives a ``kind`` ("1d2d" / "1d1d")
    GEMM of this shape on ``device``.

    Raises:
        ValueError: ``PTXTRAIN_GEMM_BACKEND`` holds an unknown name.
    """
    forced = _backend.requested(ENV_VAR, BACKENDS)
    if forced != "auto":
        return forced
    if device.type != "cuda":
        return "ref"
    # The choice is a pure function of the shape and the device (its capability, the toolchain,
    # Triton's presence): cached per call site's shape, since the per-call checks cost ~10 µs of
    # host time per GEMM in a host-bound training step.
    return _auto_cuda(kind, m, n, k, _backend.cuda_index(device))


@functools.lru_cache(maxsize=4096)
def _auto_cuda(kind: str, m: int, n: int, k: int, index: int | None) -> str:
    """``select_backend``'s ``auto`` choice on CUDA device ``index`` (None: the current one)."""
    from ptxtrain.gemm import cublas, ptx

    device = torch.device("cuda", index) if index is not None else torch.device("cuda")
    if ptx_wins(kind, m, n, k) and ptx.supports(m, n, k, device=device):
        return "ptx"
    # cuBLAS next (it beats Triton at M = 4096 for both kinds); Triton takes decode-sized 1D2D
    # where PTX cannot run and every shape cuBLAS cannot run correctly.
    if cublas.supports(m, n, k, device=device) and (kind == "1d1d" or m > 128):
        return "cublas"
    # Where cuBLAS cannot run the shape (K % 512 != 0, e.g. the dgrad of the 2112-wide
    # projection) and its 128x128 tiles fill the SMs twice over, the PTX kernels run at ~cuBLAS
    # speed and beat Triton: 1.20x / 1.16x (1D2D 4096 x 7168 x 2112, 4096 x 2112 x 4160) and
    # 1.15x / 1.25x (1D1D 7168 x 2112 x 2112, 2112 x 7168 x 4160) on an H200. With fewer tiles
    # the PTX heuristic takes decode-sized tiles and loses to Triton (0.66x at 4096 x 576 x 7168).
    tiles = ceil_div(max(m, 1), 128) * ceil_div(max(n, 1), 128)
    # (two waves on the measured GPU's SMs; a constant keeps the rule pure)
    large = (kind == "1d1d" or m > 128) and tiles >= 2 * H100_SMS
    if large and ptx.supports(m, n, k, device=device):
        return "ptx"
    return "triton" if _backend.triton_usable(device) else "ref"


def _output(d: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor | None:
    """``d`` (DeepGEMM's positional output) or its keyword spelling ``out``; not both."""
    if d is not None and out is not None:
        raise TypeError("give the output once: as d (DeepGEMM's third argument) or as out=")
    return d if d is not None else out


def _check_c(c: torch.Tensor, d: torch.Tensor | None, m: int, n: int) -> None:
    """``c`` (the accumulator of ``D = C + A·Bᵀ``) must be an fp32 [M, N] tensor beside an fp32
    ``d``, as in DeepGEMM."""
    if not isinstance(c, torch.Tensor) or c.dtype != torch.float32 or tuple(c.shape) != (m, n):
        got = f"{c.dtype} {tuple(c.shape)}" if isinstance(c, torch.Tensor) else type(c).__name__
        raise ValueError(f"c must be a float32 [M, N] = [{m}, {n}] tensor, got {got}")
    if d is None or d.dtype != torch.float32 or tuple(d.shape) != (m, n):
        raise ValueError(f"with c, d must be a float32 [M, N] = [{m}, {n}] tensor (D = C + A·Bᵀ)")


def fp8_gemm_nt(
    a: Operand,
    b: Operand,
    d: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``D = C + A · Bᵀ``, A scaled per 1x128 tile, B per 128x128 block (1D2D), on the selected
    backend, in DeepGEMM's argument order: ``fp8_gemm_nt(a, b, d, c=None)`` writes ``d`` in
    place and returns it.

    Args:
        a, b: ``(e4m3 [M, K], fp32 sf)`` and ``(e4m3 [N, K], fp32 sf)``.
        d: optional [M, N] output (its dtype wins over ``out_dtype``); ``out=`` is the same.
        c: optional float32 [M, N] accumulator (``d`` must then be float32); ``c`` may be ``d``
            itself (``D += A·Bᵀ``).
        out_dtype: torch.bfloat16 or torch.float32 when no output is given.

    Contract, shapes and the other errors: :func:`ptxtrain.gemm.ref.fp8_gemm_nt`.

    Raises:
        TypeError: both ``d`` and ``out`` given.
        ValueError: ``c`` not float32 [M, N], or ``c`` without a float32 ``d``.

    Source: DeepGEMM ``fp8_gemm_nt(a, b, d, c=None, ...)``.
    """
    d = _output(d, out)
    m, n, k = ref.validate_1d2d(a, b, d, out_dtype)
    if c is not None:
        _check_c(c, d, m, n)
        # D = C + A·Bᵀ: the product first, then C added (elementwise, so c may be d itself)
        return torch.add(c, fp8_gemm_nt(a, b, out_dtype=torch.float32), out=d)
    # Validated once here: every backend's ``fp8_gemm_nt_unchecked`` is fp8_gemm_nt minus checks.
    mod = _backend.load(__name__, select_backend("1d2d", m, n, k, a[0].device))
    return mod.fp8_gemm_nt_unchecked(a, b, d, out_dtype)


def fp8_gemm_nt_1d1d(
    a: Operand,
    b: Operand,
    d: torch.Tensor | None = None,
    c: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``D = C + A · Bᵀ``, both operands scaled per 1x128 tile (1D1D, wgrad), fp32 (or bf16)
    out, on the selected backend, in DeepGEMM's argument order (``d`` written in place and
    returned). ``c is d`` (or ``accumulate=True``) adds into ``d`` inside the GEMM; another
    ``c`` is copied into ``d`` first. Contract, shapes and errors:
    :func:`ptxtrain.gemm.ref.fp8_gemm_nt_1d1d`; ``c`` / ``d`` / ``out`` as in
    :func:`fp8_gemm_nt`.

    Source: DeepGEMM ``fp8_gemm_nt`` with 1D1D scaling (``k_grouped`` wgrad's dense case).
    """
    d = _output(d, out)
    accumulate = accumulate or c is not None
    m, n, k = ref.validate_1d1d(a, b, d, accumulate, out_dtype)
    if c is not None:
        _check_c(c, d, m, n)
        if c is not d:
            d.copy_(c)
    mod = _backend.load(__name__, select_backend("1d1d", m, n, k, a[0].device))
    return mod.fp8_gemm_nt_1d1d_unchecked(a, b, d, accumulate, out_dtype)


# DeepGEMM's grouped GEMMs (the MoE experts'), exported here as DeepGEMM does. They live in
# ptxtrain.gemm.grouped, which imports Triton: loaded on first use, so ``import ptxtrain.gemm``
# works on an installation without Triton.
GROUPED = (
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "k_grouped_fp8_gemm_nt_contiguous",
)


def __getattr__(name: str):
    if name in GROUPED:
        from ptxtrain.gemm import grouped

        return getattr(grouped, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "backends",
    "fp8_gemm_nt",
    "fp8_gemm_nt_1d1d",
    "k_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nt_masked",
    "ptx_wins",
    "select_backend",
]
