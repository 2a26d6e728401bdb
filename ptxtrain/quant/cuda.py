"""Hand-written CUDA FP8 quantizers (NVRTC through :mod:`ptxtrain.jit`), bit-exact twins of
:mod:`ptxtrain.quant.ref`, aimed at the transposed quantizations (docs/design.md §1, §3).

Design note. One kernel template (``ptxtrain/include/ptxtrain/quant/cast_transpose.cuh``, whose
header comment has the details) covers every quantizer: a CTA of 256 threads owns one 128x128
tile of ``x`` [M, K], reads it once with 16-byte loads, and writes

- the 1x128 quantization of ``x`` from registers (row amax through warp shuffles),
- the 128x1 quantization stored transposed (``xᵀ`` [K, M]) from the tile staged in shared
  memory with an XOR swizzle (conflict-free 32-bit column reads; column amax through shuffles;
  16-byte stores of 16 consecutive tokens of one channel),
- or, in block mode, both with one scale for the whole 128x128 block (``W`` and ``Wᵀ``).

The kernel has ten instantiations per input dtype (float32 / bfloat16 / float16) and variant:
five modes x ``pow2_scale``. A launch compiles only its own, by NVRTC for ``sm_90a``, cached on
disk by ``ptxtrain.jit`` (:func:`compile_module` with ``mode``; without it all ten, as the
compile tests do). The arithmetic is the reference's, bit for bit: amax from the bits of |x| (NaN
wins), the ``AMAX_EPS`` clamp, ``sf = amax / 448`` as ``div.rn``, the power-of-two rounding on
the bits, ``x / sf`` correctly rounded (a reciprocal and two exact-residual FMA corrections; one for
bf16 / fp16 input, whose E4M3 bytes are then the same for every (x, amax) pair, proven by
exhaustion in the tests; ``div.rn`` for non-finite scales), and ``cvt.rn.satfinite.e4m3x2.f32``.

Tests: besides the GPU tests, ``tests/quant/test_cuda.py`` compiles the same kernel source as
host C++ (``host_emulation.hpp`` beside it: fibers for the threads, bounds and alignment checks on
every global access) and runs it through this module's own launch arguments, bit for bit against
the reference, on a CPU.

Variants: the kernel's compile-time knobs (threads per CTA, tiles per CTA with a register
prefetch of the next tile, one-multiply division for power-of-two scales, byte transpose for
``W``/``Wᵀ``) are :class:`Variant` entries of ``VARIANTS``; ``SELECT`` names the one each public
quantizer runs (all ``"default"``, the original kernel, until ``python -m benchmarks.sweep_quant
--cuda`` on an H200 says otherwise). Every variant is bit-exact (host emulation tests).

Only ``block == 128`` runs here; other block sizes go to the Triton backend (or the reference
when Triton is missing). Inputs whose last dimension is not unit-stride are copied first; rows
that are not 16-byte aligned take the kernel's element-wise load path, outputs whose rows are
not aligned its byte-wise store path (correct, slower).

Scales: ``sf_layout="row"`` (the reference's row-major layout) or ``"mn_major"`` (strides
``(1, 4·⌈rows/4⌉)``, as in :mod:`ptxtrain.quant.triton`). ``per_block_*`` scales are row-major.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ptxtrain._checks import HP_DTYPES, ceil_div, check_tensor
from ptxtrain.jit import (
    INCLUDE_DIR,
    BoundLaunch,
    compile_cuda,
    driver_available,
    load_kernel,
    nvrtc_available,
    programmatic_launch_enabled,
)
from ptxtrain.quant.ref import (
    BLOCK,
    FP8_DTYPE,
    SF_LAYOUTS,
    check_block,
    check_sf_layout,
    empty_sf,
)

if not nvrtc_available():  # backends() reports the module unavailable, with this reason
    raise ImportError(
        "the cuda quant backend needs NVRTC: pip install cuda-bindings nvidia-cuda-nvrtc"
    )

__all__ = [
    "AUTO_OPS",
    "DEFAULT_VARIANT",
    "KERNEL_DIR",
    "OP_MODES",
    "SELECT",
    "SF_LAYOUTS",
    "VARIANTS",
    "Variant",
    "auto_instantiations",
    "compile_module",
    "per_block_cast_to_fp8",
    "per_block_cast_to_fp8_both",
    "per_token_cast_to_fp8",
    "per_token_cast_to_fp8_both",
    "per_token_cast_to_fp8_t",
    "usable",
]

# The kernel source sits in the package's one CUDA source tree (``ptxtrain/include``).
KERNEL_DIR = INCLUDE_DIR / "ptxtrain" / "quant"
# Ops that ``auto`` sends to this backend on sm_90: the transposed ones, where the Triton kernels
# reach only 0.50-0.67 of copy bandwidth, and the 128x128 block cast (worst over 4096x7168,
# 7168x4096 and 16384x7168 bf16 on an H200: 0.88 of copy here against Triton's 0.79). The
# plain 1x128 cast stays on Triton
# (0.82-0.86 there against 0.81 here).
AUTO_OPS = frozenset(
    {
        "per_token_cast_to_fp8_t",
        "per_token_cast_to_fp8_both",
        "per_block_cast_to_fp8",
        "per_block_cast_to_fp8_both",
    }
)


class Variant(NamedTuple):
    """Compile-time knobs of the kernel (``ptxtrain_quant::Knobs`` in cast_transpose.cuh) and
    its grid. Every variant is bit-identical to the reference; they differ in speed only.

    Attributes:
        threads: threads per CTA, 128, 256 or 512.
        tiles_per_cta: 128x128 tiles one CTA walks (grid-stride: tile b, b + grid, ...); the
            grid is ⌈tiles / tiles_per_cta⌉ CTAs. 0: a persistent grid of
            ``SMs x CTAs per SM`` (from ``min_ctas``).
        pipe: load the CTA's next tile while quantizing the current one (register prefetch).
        mul_pow2: with ``pow2_scale`` divide by one exact multiply instead of the rcp + two
            FMA corrections (exact for power-of-two scales; see ``quantize`` in the header).
        byte_t: ``per_block_cast_to_fp8_both`` quantizes each element once and transposes the
            FP8 bytes through shared memory (W and Wᵀ share the block scale, so the bytes are
            the same) instead of quantizing the staged raw tile a second time.
        amax16: 16-bit input: the amax reductions run on the raw 16-bit |x| bits, two per
            ``max.u16x2`` (the same maximum: the bits order the magnitudes), instead of widening
            every element to fp32 first.
        fast_sf: ``sf = amax / 448`` by a multiply and one FMA correction instead of
            ``div.rn`` (bit-exact: checked over every float in the clamped amax range).
        pair: each lane loads two 16-byte chunks of one row per pass, so a row's amax takes
            one shuffle level less and its scale and scale store serve twice the elements.
        min_ctas: ``__launch_bounds__`` minimum CTAs per SM for 16-bit input (fp32: 2/3 of it,
            at least 1); 0 = 768 / threads for 16-bit input and 512 / threads for fp32 (80 /
            128 registers per thread).
        async_copy: the quantizers with a column output (1x128 + 128x1, 128x1) take their raw
            tiles into shared memory by 16-byte ``cp.async`` copies, two tile buffers per CTA,
            the next tile's copies in flight while this one is quantized (FULL launches with
            ``tiles_per_cta != 1`` and no ``pipe``; the others run as without it, two buffers
            still allocated).
    """

    threads: int = 256
    tiles_per_cta: int = 1
    pipe: bool = False
    mul_pow2: bool = False
    min_ctas: int = 0
    byte_t: bool = False
    amax16: bool = False
    fast_sf: bool = False
    pair: bool = False
    async_copy: bool = False

    def ctas_per_sm(self, dtype: torch.dtype) -> int:
        """The ``__launch_bounds__`` minimum CTAs per SM for input ``dtype``."""
        if self.min_ctas > 0:
            return self.min_ctas if dtype != torch.float32 else max(1, self.min_ctas * 2 // 3)
        return max(1, (768 if dtype != torch.float32 else 512) // self.threads)


# The variants ``benchmarks/sweep_quant.py`` times; "default" is the original kernel (one
# 128x128 tile per CTA of 256 threads).
DEFAULT_VARIANT = Variant()
_FAST = dict(mul_pow2=True, byte_t=True, amax16=True, fast_sf=True)  # exact savings
VARIANTS: dict[str, Variant] = {
    "default": DEFAULT_VARIANT,
    "lean": Variant(**_FAST),
    "pipe4_occ2": Variant(tiles_per_cta=4, pipe=True, min_ctas=2, **_FAST),
    "persist_occ2": Variant(tiles_per_cta=0, pipe=True, min_ctas=2, **_FAST),
    "t512": Variant(threads=512, **_FAST),
    "t512_pipe2": Variant(threads=512, tiles_per_cta=2, pipe=True, **_FAST),
    "t128_occ4": Variant(threads=128, min_ctas=4, **_FAST),
    "lean_pair": Variant(pair=True, **_FAST),
    "t512_pair": Variant(threads=512, pair=True, **_FAST),
    # 64 registers: 4 CTAs of 256 / 2 of 512 threads per SM (50% occupancy) instead of 3 / 1,
    # no spills. Within 1% of lean_pair / t512_pair on an H200: occupancy does not limit these
    # kernels.
    "pair_occ4": Variant(pair=True, min_ctas=4, **_FAST),
    "t512_pair_occ2": Variant(threads=512, pair=True, min_ctas=2, **_FAST),
    # cp.async double buffering (two 32 KB bf16 tiles per CTA), persistent grids: 3 CTAs of 256
    # threads per SM (shared memory allows 3), or 2. On an H200 the fused 1x128 + 128x1 kernel
    # runs 0.80-0.84 of copy with them against pair_occ4's 0.86-0.87; 128x1 alone 0.88 against
    # 0.86-0.87 at 4096 x 24576 / 32768 only.
    "async_pair": Variant(tiles_per_cta=0, async_copy=True, pair=True, min_ctas=3, **_FAST),
    "async_pair_occ2": Variant(tiles_per_cta=0, async_copy=True, pair=True, min_ctas=2, **_FAST),
}
# The variant each public quantizer runs (update from ``python -m benchmarks.sweep_quant
# --cuda``: the fastest variant per op, by the worst fraction of copy bandwidth over 4096x7168,
# 7168x4096 and 16384x7168 bf16). Measured on an H200 with the FULL kernels: both 0.74
# (lean 0.71, default 0.68), 128x1 0.78, 128x128 0.88, W+Wᵀ 0.83 (lean; lean_pair 0.82), 1x128
# 0.81 (t512_pair; default 0.79). With MN-major scales (the layout Fp8Linear asks for on CUDA;
# sweep_quant --sf-layout mn_major over 4096x7168, 8192x7168, 16384x4096), worst shape each:
# both 0.865 with pair_occ4 (lean_pair 0.842), 128x1 0.856 (lean_pair), 1x128 0.879 (t512_pair;
# lean_pair 0.876 but 0.903 on average), 128x128 0.881 (lean_pair), W+Wᵀ 0.854 (lean).
# pair_occ4 with row-major scales is within 1% of lean_pair.
SELECT: dict[str, str] = {
    "per_token_cast_to_fp8": "t512_pair",
    "per_token_cast_to_fp8_t": "lean_pair",
    "per_token_cast_to_fp8_both": "pair_occ4",
    "per_block_cast_to_fp8": "lean_pair",
    "per_block_cast_to_fp8_both": "lean",
}

_TILE = 128
_IN_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# (block mode, row output, column output) of each quantizer family.
_MODES = ((False, True, False), (False, False, True), (False, True, True), (True, True, False),
          (True, True, True))  # fmt: skip


def _b(f: bool) -> str:
    return "true" if f else "false"


def _expression(
    in_kind: int,
    block: bool,
    row: bool,
    col: bool,
    pow2: bool,
    variant: Variant = DEFAULT_VARIANT,
    full: bool = False,
) -> str:
    flags = ", ".join(_b(f) for f in (block, row, col, pow2))
    v = variant
    loop = _b(v.tiles_per_cta != 1)
    knobs = (
        f"ptxtrain_quant::Knobs<{v.threads}, {loop}, {_b(v.pipe)}, {_b(v.mul_pow2)}, "
        f"{v.min_ctas}, {_b(v.byte_t)}, {_b(v.amax16)}, {_b(v.fast_sf)}"
        f"{', true' if v.pair else (', false' if v.async_copy else '')}"
        f"{', true' if v.async_copy else ''}>"
    )
    return f"ptxtrain_quant::cast_fp8<{in_kind}, {flags}, {knobs}{', true' if full else ''}>"


def _check_variant(variant: object) -> Variant:
    if not isinstance(variant, Variant):
        raise TypeError(f"variant must be a ptxtrain.quant.cuda.Variant, got {variant!r}")
    if variant.threads not in (128, 256, 512):
        raise ValueError(f"variant.threads must be 128, 256 or 512, got {variant.threads!r}")
    for name in ("tiles_per_cta", "min_ctas"):
        val = getattr(variant, name)
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            raise ValueError(f"variant.{name} must be an int >= 0, got {val!r}")
    return variant


@functools.cache
def compile_module(
    dtype: torch.dtype,
    arch: str = "sm_90a",
    variant: Variant = DEFAULT_VARIANT,
    full: bool = False,
    mode: tuple[bool, bool, bool, bool] | None = None,
):
    """Compile (or fetch from the JIT cache) the quantizer module for input ``dtype``.

    Args:
        dtype: torch.float32, torch.bfloat16 or torch.float16.
        arch: NVRTC target (``sm_90a`` for Hopper).
        variant: the kernel's compile-time knobs (:class:`Variant`; its grid fields do not
            matter here).
        full: the ``FULL`` instantiations (whole 128x128 tiles and aligned accesses only, no
            bounds checks; :func:`_full`), a separate module compiled on first use.
        mode: ``(block, row, col, pow2)``: that one instantiation only, what a launch compiles
            (NVRTC takes 0.45 s for one against 2.8 s for all ten on a 2-core CPU; four
            ten-instantiation modules would cost the first FP8 training step 3.2-4.2 s each on
            an H200 host); None: all ten.

    Returns:
        :class:`ptxtrain.jit.CompiledKernel` with the instantiations of
        ``ptxtrain_quant::cast_fp8`` as name expressions.

    Raises:
        TypeError: ``dtype`` is not one of the three, or ``variant`` not a Variant.
        ValueError: a knob of ``variant`` is out of range, or ``mode`` is not one of the
            kernel's (block, row, col) combinations with a pow2 flag.
        ptxtrain.jit.JitCompileError: NVRTC failed.
    """
    if dtype not in _IN_KIND:
        raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
    variant = _check_variant(variant)
    kind = _IN_KIND[dtype]
    if mode is None:
        modes = [(b, r, c, p) for b, r, c in _MODES for p in (False, True)]
        name = "ptxtrain_quant_cast_fp8"
    else:
        if (
            not isinstance(mode, tuple)
            or len(mode) != 4
            or not all(isinstance(f, bool) for f in mode)
            or mode[:3] not in _MODES
        ):
            raise ValueError(
                f"mode must be (block, row, col, pow2) bools with (block, row, col) in "
                f"{_MODES}, got {mode!r}"
            )
        modes = [mode]
        name = "ptxtrain_quant_cast_fp8_" + "".join("1" if f else "0" for f in mode)
    return compile_cuda(
        "#include <ptxtrain/quant/cast_transpose.cuh>\n",
        name=name + ("_full" if full else ""),
        arch=arch,
        name_expressions=[_expression(kind, *m, variant, full) for m in modes],
    )


# (block, row, col) of each quantizer the kernels serve.
OP_MODES: dict[str, tuple[bool, bool, bool]] = {
    "per_token_cast_to_fp8": (False, True, False),
    "per_token_cast_to_fp8_t": (False, False, True),
    "per_token_cast_to_fp8_both": (False, True, True),
    "per_block_cast_to_fp8": (True, True, False),
    "per_block_cast_to_fp8_both": (True, True, True),
}


def auto_instantiations(
    dtype: torch.dtype, pow2_flags: tuple[bool, ...] = (False,)
) -> list[tuple[torch.dtype, Variant, bool, tuple[bool, bool, bool, bool]]]:
    """``(dtype, variant, full, mode)`` of every instantiation that the ``auto`` backend's CUDA
    quantizers (the ops of :data:`AUTO_OPS`, each with its :data:`SELECT` variant, FULL or not)
    may compile for input ``dtype`` and scales rounded to powers of two or not
    (``pow2_flags``): the arguments of :func:`compile_module` that a launch compiles and that
    ``ptxtrain.nn.prewarm`` compiles ahead of a first step."""
    out = []
    for op in sorted(AUTO_OPS):
        for pow2 in pow2_flags:
            for full in (False, True):
                out.append((dtype, VARIANTS[SELECT[op]], full, (*OP_MODES[op], bool(pow2))))
    return out


def usable(device: torch.device) -> bool:
    """True when the kernels can run on ``device``: a CUDA device of compute capability 9.0
    (Hopper; the module is built for ``sm_90a``) with the CUDA driver library present."""
    if device.type != "cuda":
        return False
    return _usable_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _usable_index(index: int) -> bool:
    return driver_available() and torch.cuda.get_device_capability(index) == (9, 0)


# --------------------------------------------------------------------------------------------
# Validation and allocation
# --------------------------------------------------------------------------------------------


def _check_input(name: str, x: object, block: object) -> torch.Tensor:
    """Validate like the reference, plus the device; return x with ``stride(-1) == 1``."""
    check_tensor(name, x, dtypes=HP_DTYPES, ndim=2)
    check_block(block)
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


def _vec_flags(x: torch.Tensor, m: int, k: int) -> int:
    """The kernel's ``vec_flags`` (see cast_transpose.cuh): which accesses may be vectorized."""
    elt = x.element_size()
    x_rows_aligned = m == 1 or (x.stride(0) * elt) % 16 == 0
    flags = int(x.data_ptr() % 16 == 0 and x_rows_aligned)
    flags |= 2 * int(k % (8 if elt == 2 else 4) == 0)
    flags |= 4 * int(m % 16 == 0)
    return flags


def _full(m: int, k: int, vec_flags: int, row: bool, col: bool) -> bool:
    """Whether the ``FULL`` kernel may run: whole 128x128 tiles (M, K multiples of 128) and
    every vectorized access the mode makes allowed (x always; q with a row output, qt with a
    column output), so its unchecked 16-byte loads and vector stores stay in range and aligned."""
    need = 1 | (2 if row else 0) | (4 if col else 0)
    return m % _TILE == 0 and k % _TILE == 0 and vec_flags & need == need


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _grid(tiles: int, variant: Variant, x: torch.Tensor) -> int:
    """CTAs for ``tiles`` tiles under ``variant`` (each CTA walks its tiles grid-stride)."""
    if variant.tiles_per_cta > 0:
        return ceil_div(tiles, variant.tiles_per_cta)
    index = x.device.index
    if index is None:
        index = torch.cuda.current_device() if x.device.type == "cuda" else 0
    return max(1, min(tiles, _sm_count(index) * variant.ctas_per_sm(x.dtype)))


def _run(
    x, *, block_mode: bool, row: bool, col: bool, pow2: bool, q, sf, qt, sft, variant: Variant
) -> None:
    """Launch one instantiation over the ⌈M/128⌉·⌈K/128⌉ tiles of ``x`` (M, K > 0)."""
    m, k = x.shape
    k_tiles = ceil_div(k, _TILE)
    tiles = ceil_div(m, _TILE) * k_tiles
    if tiles >= 2**31:
        raise ValueError(f"x has too many 128x128 tiles for one launch ({tiles}), shape {(m, k)}")
    tile_bytes = _TILE * _TILE * (1 if block_mode and variant.byte_t else x.element_size())
    buffers = 2 if variant.async_copy and not block_mode else 1  # (the kernel's kAsyncLayout)
    smem = (buffers * tile_bytes if col else 0) + 4 * (variant.threads // 32)
    flags = _vec_flags(x, m, k)
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
        flags,
    ]
    mode = (block_mode, row, col, bool(pow2), _full(m, k, flags, row, col))
    _launch(x, mode, variant, _grid(tiles, variant, x), smem, args)


# The kernel's parameters: x, q, sf, qt, sft (pointers), then M, K, x's row stride, sf's and
# sft's strides, k_tiles (int64) and vec_flags (int32).
_SIGNATURE = "ppppp" + "q" * 8 + "i"


@functools.lru_cache(maxsize=256)
def _bound(dtype: torch.dtype, mode: tuple, variant: Variant, index: int, smem: int) -> BoundLaunch:
    """The instantiation ``mode`` = (block, row, col, pow2, full) of ``variant`` for ``dtype``,
    loaded on device ``index`` and bound for launches (compiled once, then a lookup per call)."""
    module = compile_module(dtype, variant=variant, full=mode[4], mode=mode[:4])
    with torch.cuda.device(index):
        kernel = load_kernel(module, _expression(_IN_KIND[dtype], *mode[:4], variant, mode[4]))
    # (the kernel waits for the previous one before reading x: grid_dependency_wait)
    return BoundLaunch(
        kernel,
        _SIGNATURE,
        variant.threads,
        smem_bytes=smem,
        programmatic=programmatic_launch_enabled(quant=True),
    )


def _launch(
    x: torch.Tensor, mode: tuple, variant: Variant, grid: int, smem: int, args: list
) -> None:
    """Compile / load the instantiation ``mode`` = (block, row, col, pow2, full) of ``variant`` for
    ``x.dtype`` and launch ``grid`` CTAs of it on the current stream of ``x``'s device (the
    kernel derives the tile count from M and k_tiles). ``args``: tensors, then the int64
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
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    bound = _bound(x.dtype, mode, variant, index, smem)
    values = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
    if torch.cuda.current_device() == index:
        bound(grid, *values)
    else:
        with torch.cuda.device(index):
            bound(grid, *values)


def quant_token_unchecked(
    x, pow2_scale, sf_layout, *, row: bool, col: bool, variant: Variant | None = None
) -> tuple[torch.Tensor, ...]:
    """The 128-tile launcher behind :func:`per_token_cast_to_fp8` (``row``),
    :func:`per_token_cast_to_fp8_t` (``col``) and :func:`per_token_cast_to_fp8_both` (both),
    without their checks.

    Args:
        x: [M, K] float32 / bfloat16 / float16 on an sm_90 device, ``stride(1) == 1``.
        pow2_scale: round each scale up to a power of two.
        sf_layout: ``"row"`` or ``"mn_major"`` (already checked).
        row, col: write the 1x128 quantization of ``x`` and / or the 128x1 one stored
            transposed (at least one).
        variant: a :class:`Variant` of the kernel (``benchmarks/sweep_quant.py --cuda``), or
            None for the op's entry of :data:`SELECT`.

    Returns:
        ``(x_fp8 [M, K], sf [M, ⌈K/128⌉])`` with ``row``, then ``(xt_fp8 [K, M],
        sf_t [K, ⌈M/128⌉])`` with ``col``: e4m3 and float32, bit-identical to the reference.

    Raises:
        RuntimeError: the device is not an sm_90 GPU with the CUDA driver.
        ValueError: ``x`` has 2³¹ or more 128x128 tiles.
    """
    if variant is None:
        op = {(True, False): "", (False, True): "_t", (True, True): "_both"}[(row, col)]
        variant = VARIANTS[SELECT["per_token_cast_to_fp8" + op]]
    m, k = x.shape
    dev = x.device
    q = sf = qt = sft = None
    if row:
        q = torch.empty((m, k), dtype=FP8_DTYPE, device=dev)
        sf = empty_sf(m, ceil_div(k, _TILE), sf_layout, dev)
    if col:
        qt = torch.empty((k, m), dtype=FP8_DTYPE, device=dev)
        sft = empty_sf(k, ceil_div(m, _TILE), sf_layout, dev)
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
            variant=variant,
        )
    return tuple(t for t in (q, sf, qt, sft) if t is not None)


def quant_block_unchecked(
    w, pow2_scale, *, transposed: bool, variant: Variant | None = None
) -> tuple[torch.Tensor, ...]:
    """The 128x128 launcher behind :func:`per_block_cast_to_fp8` (and ``_both`` with
    ``transposed``), without their checks: ``w`` [N, K] and ``variant`` as
    :func:`quant_token_unchecked`'s ``x`` and ``variant``.

    Returns:
        ``(w_fp8 [N, K], sf [⌈N/128⌉, ⌈K/128⌉])``, plus ``(wt_fp8 [K, N],
        sf_t [⌈K/128⌉, ⌈N/128⌉])`` with ``transposed``; e4m3 and float32, row-major.

    Raises:
        RuntimeError / ValueError: as :func:`quant_token_unchecked`.
    """
    if variant is None:
        variant = VARIANTS[SELECT["per_block_cast_to_fp8" + ("_both" if transposed else "")]]
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
            variant=variant,
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

    Source: DeepSeek-V3 report §3.3 (fine-grained quantization); docs/design.md §1.
    """
    x = _check_input("x", x, block)
    sf_layout = check_sf_layout(sf_layout)
    if block != _TILE:
        return _fallback().per_token_cast_to_fp8(x, block, pow2_scale=pow2_scale, **_kw(sf_layout))
    return quant_token_unchecked(x, pow2_scale, sf_layout, row=True, col=False)


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

    Source: DeepSeek-V3 report §3.3 (wgrad operands quantized along tokens); docs/design.md §1.
    """
    x = _check_input("x", x, block)
    sf_layout = check_sf_layout(sf_layout)
    if block != _TILE:
        fb = _fallback()
        return fb.per_token_cast_to_fp8_t(x, block, pow2_scale=pow2_scale, **_kw(sf_layout))
    return quant_token_unchecked(x, pow2_scale, sf_layout, row=False, col=True)


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
    cost); docs/design.md §1.
    """
    x = _check_input("x", x, block)
    sf_layout = check_sf_layout(sf_layout)
    if block != _TILE:
        fb = _fallback()
        return fb.per_token_cast_to_fp8_both(x, block, pow2_scale=pow2_scale, **_kw(sf_layout))
    return quant_token_unchecked(x, pow2_scale, sf_layout, row=True, col=True)


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

    Source: DeepSeek-V3 report §3.3; docs/design.md §1.
    """
    w = _check_input("w", w, block)
    if block != _TILE:
        return _fallback().per_block_cast_to_fp8(w, block, pow2_scale=pow2_scale)
    return quant_block_unchecked(w, pow2_scale, transposed=False)


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

    Source: DeepSeek-V3 report §3.3 (Fprop reads W, Dgrad reads Wᵀ); docs/design.md §1.
    """
    w = _check_input("w", w, block)
    if block != _TILE:
        return _fallback().per_block_cast_to_fp8_both(w, block, pow2_scale=pow2_scale)
    return quant_block_unchecked(w, pow2_scale, transposed=True)


def _kw(sf_layout: str) -> dict:
    """Keyword for the fallback: the reference has no ``sf_layout`` (row-major only)."""
    if sf_layout == "row":
        return {}
    if _fallback().__name__.endswith(".ref"):
        raise ValueError(
            f"sf_layout={sf_layout!r} with a block other than 128 needs the Triton backend"
        )
    return {"sf_layout": sf_layout}
