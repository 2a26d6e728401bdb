"""Hand-written CUDA FP8 quantizers (NVRTC through :mod:`ptxtrain.jit`), bit-exact twins of
:mod:`ptxtrain.quant.ref`, aimed at the transposed quantizations (DESIGN §1, §3).

Design note. One kernel template (``ptxtrain/quant/kernels/cast_transpose.cuh``, whose header
comment has the details) covers every quantizer: a CTA of 256 threads owns one 128x128 tile of
``x`` [M, K], reads it once with 16-byte loads, and writes

- the 1x128 quantization of ``x`` from registers (row amax through warp shuffles),
- the 128x1 quantization stored transposed (``xᵀ`` [K, M]) from the tile staged in shared
  memory with an XOR swizzle (conflict-free 32-bit column reads; column amax through shuffles;
  16-byte stores of 16 consecutive tokens of one channel),
- or, in block mode, both with one scale for the whole 128x128 block (``W`` and ``Wᵀ``).

One module per input dtype (float32 / bfloat16 / float16) holds the ten instantiations (five
modes x ``pow2_scale``); it is compiled once by NVRTC for ``sm_90a`` and cached on disk by
``ptxtrain.jit``. The arithmetic is the reference's, bit for bit: amax from the bits of |x| (NaN
wins), the 1e-4 clamp, ``sf = amax / 448`` as ``div.rn``, the power-of-two rounding on the bits,
``x / sf`` correctly rounded (a reciprocal and two exact-residual FMA corrections; ``div.rn``
for non-finite scales), and ``cvt.rn.satfinite.e4m3x2.f32``.

Tests: besides the GPU tests, ``tests/quant/test_cuda.py`` compiles the same kernel source as
host C++ (``kernels/host_emulation.hpp``: fibers for the threads, bounds and alignment checks on
every global access) and runs it through this module's own launch arguments, bit for bit against
the reference, on a CPU.

Only ``block == 128`` runs here; other block sizes go to the Triton backend (or the reference
when Triton is missing). Inputs whose last dimension is not unit-stride are copied first; rows
that are not 16-byte aligned take the kernel's element-wise load path, outputs whose rows are
not aligned its byte-wise store path (correct, slower).

Scales: ``sf_layout="row"`` (the reference's row-major layout) or ``"mn_major"`` (strides
``(1, 4·⌈rows/4⌉)``, as in :mod:`ptxtrain.quant.triton`). ``per_block_*`` scales are row-major.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from ptxtrain._checks import HP_DTYPES, ceil_div, check_tensor
from ptxtrain.jit import compile_cuda, driver_available, launch, load_kernel, nvrtc_available
from ptxtrain.quant.ref import BLOCK, FP8_DTYPE, _check_block

if not nvrtc_available():  # backends() reports the module unavailable, with this reason
    raise ImportError(
        "the cuda quant backend needs NVRTC: pip install cuda-bindings nvidia-cuda-nvrtc"
    )

__all__ = [
    "AUTO_OPS",
    "KERNEL_DIR",
    "SF_LAYOUTS",
    "compile_module",
    "per_block_cast_to_fp8",
    "per_block_cast_to_fp8_both",
    "per_token_cast_to_fp8",
    "per_token_cast_to_fp8_both",
    "per_token_cast_to_fp8_t",
    "usable",
]

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
SF_LAYOUTS = ("row", "mn_major")
# Ops that ``auto`` sends to this backend on sm_90: the transposed ones, where the Triton kernels
# reach only 0.50-0.67 of copy bandwidth (the plain 1x128 / 128x128 Triton kernels reach
# 0.76-0.86; move them here once ``ptxtrain bench quant`` shows this backend ahead).
AUTO_OPS = frozenset(
    {"per_token_cast_to_fp8_t", "per_token_cast_to_fp8_both", "per_block_cast_to_fp8_both"}
)

_TILE = 128
_THREADS = 256
_MN_ALIGN = 4
_IN_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# (block mode, row output, column output) of each quantizer family.
_MODES = ((False, True, False), (False, False, True), (False, True, True), (True, True, False),
          (True, True, True))  # fmt: skip


def _expression(in_kind: int, block: bool, row: bool, col: bool, pow2: bool) -> str:
    flags = ", ".join("true" if f else "false" for f in (block, row, col, pow2))
    return f"ptxtrain_quant::cast_fp8<{in_kind}, {flags}>"


@functools.cache
def compile_module(dtype: torch.dtype, arch: str = "sm_90a"):
    """Compile (or fetch from the JIT cache) the quantizer module for input ``dtype``.

    Args:
        dtype: torch.float32, torch.bfloat16 or torch.float16.
        arch: NVRTC target (``sm_90a`` for Hopper).

    Returns:
        :class:`ptxtrain.jit.CompiledKernel` with the ten instantiations of
        ``ptxtrain_quant::cast_fp8`` as name expressions.

    Raises:
        TypeError: ``dtype`` is not one of the three. ptxtrain.jit.JitCompileError: NVRTC failed.
    """
    if dtype not in _IN_KIND:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    exprs = [_expression(_IN_KIND[dtype], b, r, c, p) for b, r, c in _MODES for p in (False, True)]
    return compile_cuda(
        "#include <cast_transpose.cuh>\n",
        name="ptxtrain_quant_cast_fp8",
        arch=arch,
        include_dirs=[KERNEL_DIR],
        name_expressions=exprs,
    )


def usable(device: torch.device) -> bool:
    """True when the kernels can run on ``device``: a CUDA device of compute capability 9.0
    (Hopper; the module is built for ``sm_90a``) with the CUDA driver library present."""
    if device.type != "cuda" or not driver_available():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index) == (9, 0)


# --------------------------------------------------------------------------------------------
# Validation and allocation
# --------------------------------------------------------------------------------------------


def _check_sf_layout(sf_layout: object) -> str:
    if sf_layout not in SF_LAYOUTS:
        raise ValueError(f"sf_layout must be one of {SF_LAYOUTS}, got {sf_layout!r}")
    return sf_layout


def _check_input(name: str, x: object, block: object) -> torch.Tensor:
    """Validate like the reference, plus the device; return x with ``stride(-1) == 1``."""
    check_tensor(name, x, dtypes=HP_DTYPES, ndim=2)
    _check_block(block)
    _require_cuda(name, x)
    if x.shape[1] > 1 and x.stride(1) != 1:
        x = x.contiguous()
    return x


def _require_cuda(name: str, x: torch.Tensor) -> None:
    if x.device.type != "cuda":
        raise ValueError(
            f"{name} must be a CUDA tensor for the cuda quant backend, got device {x.device}; "
            "use ptxtrain.quant.ref (or ptxtrain.quant.triton) on the CPU"
        )


def _fallback():
    """Backend for block sizes other than 128: Triton when installed, else the reference."""
    try:
        from ptxtrain.quant import triton as fallback
    except ImportError:
        from ptxtrain.quant import ref as fallback
    return fallback


def _empty_sf(rows: int, cols: int, layout: str, device: torch.device) -> torch.Tensor:
    """fp32 scales [rows, cols]: row-major, or MN-major with strides (1, rows padded to 4)."""
    if layout == "row":
        return torch.empty((rows, cols), dtype=torch.float32, device=device)
    rows_pad = ceil_div(rows, _MN_ALIGN) * _MN_ALIGN
    return torch.empty_strided((rows, cols), (1, rows_pad), dtype=torch.float32, device=device)


def _vec_flags(x: torch.Tensor, m: int, k: int) -> int:
    """The kernel's ``vec_flags`` (see cast_transpose.cuh): which accesses may be vectorized."""
    elt = x.element_size()
    x_rows_aligned = m == 1 or (x.stride(0) * elt) % 16 == 0
    flags = int(x.data_ptr() % 16 == 0 and x_rows_aligned)
    flags |= 2 * int(k % (8 if elt == 2 else 4) == 0)
    flags |= 4 * int(m % 16 == 0)
    return flags


def _run(x, *, block_mode: bool, row: bool, col: bool, pow2: bool, q, sf, qt, sft) -> None:
    """Launch one instantiation over the ⌈M/128⌉·⌈K/128⌉ tiles of ``x`` (M, K > 0)."""
    m, k = x.shape
    k_tiles = ceil_div(k, _TILE)
    tiles = ceil_div(m, _TILE) * k_tiles
    if tiles >= 2**31:
        raise ValueError(f"x has too many 128x128 tiles for one launch ({tiles}), shape {(m, k)}")
    smem = (_TILE * _TILE * x.element_size() if col else 0) + 4 * (_THREADS // 32)
    args = [
        x,
        q if q is not None else x,  # unused pointers: never dereferenced
        sf,
        qt if qt is not None else x,
        sft if sft is not None else sf,
        m,
        k,
        x.stride(0),
        sf.stride(0),
        sf.stride(1),
        sft.stride(0) if sft is not None else 0,
        sft.stride(1) if sft is not None else 0,
        k_tiles,
        _vec_flags(x, m, k),
    ]
    _launch(x, (block_mode, row, col, bool(pow2)), tiles, smem, args)


def _launch(x: torch.Tensor, variant: tuple, tiles: int, smem: int, args: list) -> None:
    """Compile / load the instantiation ``variant`` = (block, row, col, pow2) for ``x.dtype``
    and launch it on the current stream of ``x``'s device. ``args``: tensors, then the int64
    sizes and strides, then the int32 ``vec_flags`` (the kernel's parameter order).

    Raises:
        RuntimeError: the device is not an sm_90 GPU with the CUDA driver (e.g. the backend was
            forced through ``PTXTRAIN_QUANT_BACKEND`` on another GPU).
    """
    if not usable(x.device):
        cap = torch.cuda.get_device_capability(x.device) if driver_available() else None
        raise RuntimeError(
            f"the cuda quant backend runs on sm_90 GPUs with the CUDA driver; {x.device} has "
            f"compute capability {cap}; use PTXTRAIN_QUANT_BACKEND=triton or ref"
        )
    kernel = load_kernel(compile_module(x.dtype), _expression(_IN_KIND[x.dtype], *variant))
    packed = [a if isinstance(a, torch.Tensor) else ctypes.c_int64(a) for a in args[:-1]]
    packed.append(ctypes.c_int32(args[-1]))
    with torch.cuda.device(x.device):
        launch(kernel, tiles, _THREADS, packed, smem_bytes=smem)


def _quant_token(x, pow2_scale, sf_layout, *, row: bool, col: bool) -> tuple[torch.Tensor, ...]:
    m, k = x.shape
    dev = x.device
    q = sf = qt = sft = None
    if row:
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=dev)
        sf = _empty_sf(m, ceil_div(k, _TILE), sf_layout, dev)
    if col:
        qt = torch.empty((k, m), dtype=FP8_DTYPE, device=dev)
        sft = _empty_sf(k, ceil_div(m, _TILE), sf_layout, dev)
    if m > 0 and k > 0:
        _run(
            x,
            block_mode=False,
            row=row,
            col=col,
            pow2=pow2_scale,
            q=q,
            sf=sf if row else sft,
            qt=qt,
            sft=sft,
        )
    return tuple(t for t in (q, sf, qt, sft) if t is not None)


def _quant_block(w, pow2_scale, *, transposed: bool) -> tuple[torch.Tensor, ...]:
    n, k = w.shape
    dev = w.device
    q = torch.empty((n, k), dtype=FP8_DTYPE, device=dev)
    qt = torch.empty((k, n), dtype=FP8_DTYPE, device=dev) if transposed else None
    sf = torch.empty((ceil_div(n, _TILE), ceil_div(k, _TILE)), dtype=torch.float32, device=dev)
    if n > 0 and k > 0:
        _run(
            w,
            block_mode=True,
            row=True,
            col=transposed,
            pow2=pow2_scale,
            q=q,
            sf=sf,
            qt=qt,
            sft=None,
        )
    if transposed:
        return q, sf, qt, sf.t().contiguous()
    return q, sf


# --------------------------------------------------------------------------------------------
# Public quantizers
# --------------------------------------------------------------------------------------------


def per_token_cast_to_fp8(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA twin of :func:`ptxtrain.quant.ref.per_token_cast_to_fp8` (1 x ``block`` tiles).

    Args:
        x: [M, K] float32 / bfloat16 / float16 on a CUDA device (sm_90). Any M and K, 0
            included; ``stride(-1) != 1`` is copied first.
        block: tile width along K; 128 runs here, other positive ints go to the Triton backend.
        pow2_scale: round each ``sf`` up to a power of two.
        sf_layout: ``"row"`` (as the reference) or ``"mn_major"`` (strides ``(1, 4·⌈M/4⌉)``).

    Returns:
        ``(x_fp8, sf)``: x_fp8 [M, K] float8_e4m3fn, row-major; sf [M, ⌈K/block⌉] float32 in
        ``sf_layout``. Bit-identical to the reference.

    Raises:
        TypeError: ``x`` is not a float32/bfloat16/float16 tensor.
        ValueError: ``x`` is not 2-D or not on CUDA, ``block`` is not a positive int, or
            ``sf_layout`` is unknown.
        RuntimeError: the CUDA driver is missing or a launch failed.

    Source: DeepSeek-V3 report §3.3 (fine-grained quantization); DESIGN §1.
    """
    x = _check_input("x", x, block)
    sf_layout = _check_sf_layout(sf_layout)
    if block != _TILE:
        return _fallback().per_token_cast_to_fp8(x, block, pow2_scale=pow2_scale, **_kw(sf_layout))
    return _quant_token(x, pow2_scale, sf_layout, row=True, col=False)


def per_token_cast_to_fp8_t(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA twin of :func:`ptxtrain.quant.ref.per_token_cast_to_fp8_t` (``block`` x 1 tiles,
    stored transposed).

    Args:
        x: [M, K], as :func:`per_token_cast_to_fp8`.
        block: tile height along M (128 here; others go to the Triton backend).
        pow2_scale: as :func:`per_token_cast_to_fp8`.
        sf_layout: layout of ``sf_t``: ``"row"`` or ``"mn_major"`` (strides ``(1, 4·⌈K/4⌉)``).

    Returns:
        ``(xt_fp8, sf_t)``: xt_fp8 [K, M] float8_e4m3fn, row-major (xᵀ, K-major for the wgrad
        NT GEMM); sf_t [K, ⌈M/block⌉] float32. Bit-identical to the reference.

    Raises:
        TypeError / ValueError / RuntimeError: as :func:`per_token_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 (wgrad operands quantized along tokens); DESIGN §1.
    """
    x = _check_input("x", x, block)
    sf_layout = _check_sf_layout(sf_layout)
    if block != _TILE:
        fb = _fallback()
        return fb.per_token_cast_to_fp8_t(x, block, pow2_scale=pow2_scale, **_kw(sf_layout))
    return _quant_token(x, pow2_scale, sf_layout, row=False, col=True)


def per_token_cast_to_fp8_both(
    x: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False, sf_layout: str = "row"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`per_token_cast_to_fp8` and :func:`per_token_cast_to_fp8_t` of one tensor from a
    single read of ``x`` (one fused kernel).

    Args:
        x, block, pow2_scale: as :func:`per_token_cast_to_fp8`.
        sf_layout: layout of both ``sf`` and ``sf_t`` (``"row"`` or ``"mn_major"``).

    Returns:
        ``(x_fp8 [M, K], sf [M, ⌈K/block⌉], xt_fp8 [K, M], sf_t [K, ⌈M/block⌉])``,
        bit-identical to :func:`ptxtrain.quant.ref.per_token_cast_to_fp8_both`.

    Raises:
        TypeError / ValueError / RuntimeError: as :func:`per_token_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 (the transposed re-quantization it names as a memory-traffic
    cost); DESIGN §1.
    """
    x = _check_input("x", x, block)
    sf_layout = _check_sf_layout(sf_layout)
    if block != _TILE:
        fb = _fallback()
        return fb.per_token_cast_to_fp8_both(x, block, pow2_scale=pow2_scale, **_kw(sf_layout))
    return _quant_token(x, pow2_scale, sf_layout, row=True, col=True)


def per_block_cast_to_fp8(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA twin of :func:`ptxtrain.quant.ref.per_block_cast_to_fp8` (``block``² blocks).

    Args:
        w: [N, K] float32 / bfloat16 / float16 on a CUDA device (sm_90); any N and K, 0 included.
        block: block edge; 128 runs here, other positive ints go to the Triton backend.
        pow2_scale: round each ``sf`` up to a power of two.

    Returns:
        ``(w_fp8, sf)``: w_fp8 [N, K] float8_e4m3fn, row-major; sf [⌈N/block⌉, ⌈K/block⌉]
        float32, row-major. Bit-identical to the reference.

    Raises:
        TypeError / ValueError / RuntimeError: as :func:`per_token_cast_to_fp8` (naming ``w``).

    Source: DeepSeek-V3 report §3.3; DESIGN §1.
    """
    w = _check_input("w", w, block)
    if block != _TILE:
        return _fallback().per_block_cast_to_fp8(w, block, pow2_scale=pow2_scale)
    return _quant_block(w, pow2_scale, transposed=False)


def per_block_cast_to_fp8_both(
    w: torch.Tensor, block: int = BLOCK, *, pow2_scale: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """CUDA twin of :func:`ptxtrain.quant.ref.per_block_cast_to_fp8_both`: one read of ``w``
    writes the 128x128 quantization of ``w`` and, through shared memory, that of ``wᵀ``.

    Args:
        w, block, pow2_scale: as :func:`per_block_cast_to_fp8`.

    Returns:
        ``(w_fp8 [N, K], sf [⌈N/block⌉, ⌈K/block⌉], wt_fp8 [K, N], sf_t [⌈K/block⌉, ⌈N/block⌉])``,
        row-major, bit-identical to the reference.

    Raises:
        TypeError / ValueError / RuntimeError: as :func:`per_block_cast_to_fp8`.

    Source: DeepSeek-V3 report §3.3 (Fprop reads W, Dgrad reads Wᵀ); DESIGN §1.
    """
    w = _check_input("w", w, block)
    if block != _TILE:
        return _fallback().per_block_cast_to_fp8_both(w, block, pow2_scale=pow2_scale)
    return _quant_block(w, pow2_scale, transposed=True)


def _kw(sf_layout: str) -> dict:
    """Keyword for the fallback: the reference has no ``sf_layout`` (row-major only)."""
    if sf_layout == "row":
        return {}
    if _fallback().__name__.endswith(".ref"):
        raise ValueError(
            f"sf_layout={sf_layout!r} with a block other than 128 needs the Triton backend"
        )
    return {"sf_layout": sf_layout}
