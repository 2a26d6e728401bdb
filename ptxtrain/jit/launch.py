"""Loading cubins and launching kernels on PyTorch's current stream, through the CUDA driver API.

Design (docs/design.md §3, §7):

- ``cuda.bindings.driver`` is used directly: ``cuModuleLoadData`` on the cubin from
  ``compile_cuda``, ``cuModuleGetFunction`` on the symbol NVRTC lowered at compile time,
  ``cuFuncSetAttribute`` to allow more than 48 KB of dynamic shared memory, and
  ``cuLaunchKernelEx`` with an optional thread-block-cluster dimension.
- Modules are loaded into the device's primary context, the one PyTorch uses, and cached per
  (cache key, symbol, device).
- Kernel arguments are packed as an array of pointers to host copies: CUDA tensors become their
  ``data_ptr()``, ``ctypes`` scalars are passed as they are, Python ``int`` / ``float`` as
  ``int32`` / ``float32``, and ``TensorMap`` objects (``cuTensorMapEncodeTiled``) as their 128
  bytes, i.e. by value for a ``const __grid_constant__ ptxtrain::TmaDescriptor`` parameter.
- Every driver entry point first checks that ``libcuda.so.1`` can be loaded and raises a clear
  RuntimeError otherwise (docs/design.md §7: driver paths misbehave, even hang, without a driver).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ptxtrain.jit.cache import env_flag
from ptxtrain.jit.compiler import CompiledKernel

_STATIC_SMEM_LIMIT = 48 * 1024  # bytes of dynamic smem allowed without cuFuncSetAttribute
_TMAP_BYTES = 128  # sizeof(CUtensorMap)


def programmatic_launch_enabled(quant: bool = False) -> bool:
    """Whether the PTX GEMM kernels (``quant``: the CUDA quantizers) launch with programmatic
    stream serialization (Programmatic Dependent Launch, see :class:`BoundLaunch`).

    GEMMs: on unless ``PTXTRAIN_PDL`` is set to something other than 1 / true / yes / on (e.g.
    ``PTXTRAIN_PDL=0``). With the GEMM letting the next kernel in once its producer has issued the
    last loads, Fp8Linear's fwd + bwd runs 0.8-1.0% faster on an H200 (geomean 1.293 / 1.305x
    BF16 against 1.282 / 1.292x without, up to 1.7% per layer). Quantizers: only with
    ``PTXTRAIN_PDL_QUANT=1`` as well. Launched behind a GEMM, a quantizer of many CTA waves runs
    2-13% longer that way: its CTAs land on the SMs that the GEMM's early-finishing CTAs free
    (3.6% lost at 32768 x 512); with the GEMM letting it in only at its exit it is not slowed,
    and not faster than without PDL either.
    Read when a kernel's launch is first prepared (those are cached per process)."""
    value = os.environ.get("PTXTRAIN_PDL", "").strip()
    gemm = not value or env_flag("PTXTRAIN_PDL")
    return gemm and (not quant or env_flag("PTXTRAIN_PDL_QUANT"))


@functools.cache
def driver_available() -> bool:
    """True when the CUDA driver library (``libcuda.so.1``) can be loaded. Never touches
    ``cuda.bindings.driver``, so it is safe on machines without a driver."""
    for lib in ("libcuda.so.1", "libcuda.so"):
        try:
            ctypes.CDLL(lib)
        except OSError:
            continue
        return True
    return False


def _require_driver(what: str):
    """Returns ``cuda.bindings.driver`` after checking for libcuda; RuntimeError without it."""
    if not driver_available():
        raise RuntimeError(
            f"ptxtrain.jit.{what} needs the NVIDIA CUDA driver (libcuda.so.1), which was not "
            "found: launching JIT kernels and encoding TMA descriptors need a GPU machine. "
            "Compiling (ptxtrain.jit.compile_cuda) works without one."
        )
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise RuntimeError(
            f"ptxtrain.jit.{what} needs cuda-bindings: pip install 'cuda-bindings==13.0.*'"
        ) from exc
    return driver


def _ok(driver, result, what: str):
    """Unpacks a driver call's ``(CUresult, *values)``; RuntimeError naming the call on error."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, msg = driver.cuGetErrorString(err)
        text = msg.decode() if isinstance(msg, bytes) else str(msg)
        raise RuntimeError(f"ptxtrain.jit: {what} failed: {err.name} ({text})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _dim3(value, arg: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, int) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims
    ):
        raise ValueError(f"{arg}: expected 1 to 3 positive ints, got {value!r}")
    return (*dims, 1, 1)[:3]  # type: ignore[return-value]


# ---- TMA descriptors ----------------------------------------------------------------------------

_SWIZZLE_BYTES = {"none": 0, "32B": 32, "64B": 64, "128B": 128}


@dataclass(frozen=True)
class Tma2dParams:
    """The arguments of ``cuTensorMapEncodeTiled`` for a row-major 2D tensor, innermost first
    (the driver's order): ``global_dim = (cols, rows)``, ``global_strides = (row_stride_bytes,)``,
    ``box_dim = (box_cols, box_rows)``."""

    global_dim: tuple[int, int]
    global_strides: tuple[int]
    box_dim: tuple[int, int]
    swizzle: str


def tma_2d_params(
    shape: Sequence[int],
    strides: Sequence[int],
    element_size: int,
    box_rows: int,
    box_cols: int,
    swizzle: str = "none",
) -> Tma2dParams:
    """Validates a 2D TMA box against the hardware's rules and returns the encode arguments.

    Args:
        shape, strides: the tensor's ``[rows, cols]`` shape and strides in elements (row-major:
            ``strides[1] == 1``).
        element_size: bytes per element (1 for FP8).
        box_rows, box_cols: the tile one copy moves, each in [1, 256]; ``box_cols * element_size``
            must be a multiple of 16 bytes and, with a swizzle, at most the swizzle span.
        swizzle: ``"none"``, ``"32B"``, ``"64B"`` or ``"128B"``.

    Raises:
        ValueError naming the offending argument (CUDA driver API, cuTensorMapEncodeTiled).
    """
    if len(shape) != 2 or len(strides) != 2:
        raise ValueError(f"shape/strides: expected 2D, got shape={shape!r}, strides={strides!r}")
    rows, cols = (int(s) for s in shape)
    if rows < 1 or cols < 1:
        raise ValueError(f"shape: expected positive dims, got {tuple(shape)}")
    if int(strides[1]) != 1:
        raise ValueError(f"strides: the inner dim must be contiguous (stride 1), got {strides!r}")
    row_bytes = int(strides[0]) * element_size
    if row_bytes % 16 != 0 or row_bytes <= 0:
        raise ValueError(
            f"strides: the row stride must be a positive multiple of 16 bytes, got {row_bytes} B"
        )
    for arg, v in (("box_rows", box_rows), ("box_cols", box_cols)):
        if not isinstance(v, int) or not 1 <= v <= 256:
            raise ValueError(f"{arg}: expected an int in [1, 256], got {v!r}")
    inner_bytes = box_cols * element_size
    if inner_bytes % 16 != 0:
        raise ValueError(
            f"box_cols: box_cols * element_size must be a multiple of 16 bytes, got {inner_bytes}"
        )
    if swizzle not in _SWIZZLE_BYTES:
        raise ValueError(f"swizzle: expected one of {sorted(_SWIZZLE_BYTES)}, got {swizzle!r}")
    if _SWIZZLE_BYTES[swizzle] and inner_bytes > _SWIZZLE_BYTES[swizzle]:
        raise ValueError(
            f"box_cols: a {swizzle} swizzle allows at most {_SWIZZLE_BYTES[swizzle]} bytes per box "
            f"row, got {inner_bytes}"
        )
    return Tma2dParams((cols, rows), (row_bytes,), (box_cols, box_rows), swizzle)


@dataclass(frozen=True)
class TensorMap:
    """A host-encoded ``CUtensorMap`` (128 bytes), passed by value to a kernel parameter of type
    ``const __grid_constant__ ptxtrain::TmaDescriptor``. Keeps its tensor alive."""

    data: bytes
    params: Tma2dParams
    owner: Any = field(repr=False, compare=False, default=None)


_ENCODED_MAX = 4096  # cached encodings (tma_2d_bytes)


def make_tma_2d_desc(tensor, box_rows: int, box_cols: int, *, swizzle: str = "none") -> TensorMap:
    """Encodes a TMA descriptor for a row-major 2D CUDA tensor (``cuTensorMapEncodeTiled``).

    dtype → element type: FP8 / int8 / uint8 → UINT8, bfloat16, float16, float32, int32. L2
    promotion 256 B, no interleave, out-of-bounds elements read as zero. The tensor's address
    must be 16-byte aligned. See ``tma_2d_params`` for the box rules. The bytes come from
    :func:`tma_2d_bytes`'s cache.

    Raises:
        TypeError / ValueError: not a 2D CUDA tensor of a supported dtype, or a bad box.
        RuntimeError: no CUDA driver, or the driver rejects the descriptor.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    data = tma_2d_bytes(tensor, box_rows, box_cols, swizzle)
    params = tma_2d_params(
        tensor.shape, tensor.stride(), tensor.element_size(), box_rows, box_cols, swizzle
    )
    return TensorMap(data, params, owner=tensor)


def _encode_2d(tensor, box_rows: int, box_cols: int, swizzle: str) -> bytes:
    """One ``cuTensorMapEncodeTiled`` call (uncached): the 128 bytes of the descriptor.

    Raises:
        as :func:`make_tma_2d_desc`.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor: expected a torch.Tensor, got {type(tensor).__name__}")
    kinds = {
        torch.uint8: "UINT8",
        torch.int8: "UINT8",
        torch.float8_e4m3fn: "UINT8",
        torch.float8_e5m2: "UINT8",
        torch.bfloat16: "BFLOAT16",
        torch.float16: "FLOAT16",
        torch.float32: "FLOAT32",
        torch.int32: "INT32",
    }
    if tensor.dtype not in kinds:
        raise TypeError(f"tensor: dtype {tensor.dtype} has no TMA element type; use {list(kinds)}")
    params = tma_2d_params(
        tensor.shape, tensor.stride(), tensor.element_size(), box_rows, box_cols, swizzle
    )
    if tensor.device.type != "cuda":
        raise ValueError(f"tensor: expected a CUDA tensor, got device {tensor.device}")
    if tensor.data_ptr() % 16 != 0:
        raise ValueError(f"tensor: data_ptr must be 16-byte aligned, got {tensor.data_ptr():#x}")
    driver = _require_driver("make_tma_2d_desc")
    swz = {
        "none": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_NONE,
        "32B": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_32B,
        "64B": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_64B,
        "128B": driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
    }[swizzle]
    tmap = _ok(
        driver,
        driver.cuTensorMapEncodeTiled(
            getattr(driver.CUtensorMapDataType, f"CU_TENSOR_MAP_DATA_TYPE_{kinds[tensor.dtype]}"),
            2,
            tensor.data_ptr(),
            [driver.cuuint64_t(v) for v in params.global_dim],
            [driver.cuuint64_t(v) for v in params.global_strides],
            [driver.cuuint32_t(v) for v in params.box_dim],
            [driver.cuuint32_t(1), driver.cuuint32_t(1)],
            driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            swz,
            driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        ),
        "cuTensorMapEncodeTiled",
    )
    return ctypes.string_at(tmap.getPtr(), _TMAP_BYTES)


# ---- loading and launching ----------------------------------------------------------------------


@dataclass
class LoadedKernel:
    """A ``CUfunction`` loaded in a device's primary context."""

    function: Any
    module: Any
    symbol: str
    device: int
    max_dynamic_smem: int = _STATIC_SMEM_LIMIT


_loaded: dict[tuple[str, str, int], LoadedKernel] = {}
_loaded_lock = threading.Lock()


def _ensure_context(driver, device: int) -> None:
    import torch

    torch.cuda.init()
    _ok(driver, driver.cuInit(0), "cuInit")
    ctx = _ok(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is None or int(ctx) == 0:
        dev = _ok(driver, driver.cuDeviceGet(device), "cuDeviceGet")
        ctx = _ok(driver, driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        _ok(driver, driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


def load_kernel(compiled: CompiledKernel, expression: str | None = None) -> LoadedKernel:
    """Loads ``compiled.cubin`` on the current CUDA device and returns the kernel named by
    ``expression`` (default: the first name expression; see ``CompiledKernel.symbol``).

    Raises:
        TypeError: ``compiled`` is not a CompiledKernel.
        RuntimeError: no CUDA driver, or a driver call failed (its name and error in the message).
    """
    if not isinstance(compiled, CompiledKernel):
        raise TypeError(f"compiled: expected a CompiledKernel, got {type(compiled).__name__}")
    symbol = compiled.symbol(expression)
    driver = _require_driver("load_kernel")
    import torch

    device = torch.cuda.current_device()
    cache_key = (compiled.key or str(hash(compiled.cubin)), symbol, device)
    with _loaded_lock:
        hit = _loaded.get(cache_key)
        if hit is not None:
            return hit
        _ensure_context(driver, device)
        module = _ok(driver, driver.cuModuleLoadData(compiled.cubin), "cuModuleLoadData")
        function = _ok(
            driver, driver.cuModuleGetFunction(module, symbol.encode()), "cuModuleGetFunction"
        )
        kernel = LoadedKernel(function, module, symbol, device)
        _loaded[cache_key] = kernel
        return kernel


def _pack_arg(arg, index: int):
    import torch

    if isinstance(arg, torch.Tensor):
        if arg.device.type != "cuda":
            raise ValueError(f"args[{index}]: expected a CUDA tensor, got device {arg.device}")
        return ctypes.c_uint64(arg.data_ptr())
    if isinstance(arg, TensorMap):
        return (ctypes.c_ubyte * _TMAP_BYTES).from_buffer_copy(arg.data)
    if isinstance(arg, ctypes._SimpleCData):
        return arg
    if isinstance(arg, bool):
        raise TypeError(f"args[{index}]: pass bools as ctypes.c_bool / c_int32, got {arg!r}")
    if isinstance(arg, int):
        if not -(2**31) <= arg < 2**31:
            raise ValueError(f"args[{index}]: {arg} does not fit int32; pass a ctypes.c_int64")
        return ctypes.c_int32(arg)
    if isinstance(arg, float):
        return ctypes.c_float(arg)
    raise TypeError(
        f"args[{index}]: expected a CUDA tensor, TensorMap, ctypes scalar, int or float, "
        f"got {type(arg).__name__}"
    )


def max_active_clusters(kernel: LoadedKernel, cluster: int, block: int, smem_bytes: int) -> int:
    """How many clusters of ``cluster`` CTAs (``block`` threads, ``smem_bytes`` of dynamic shared
    memory each) can be resident on the GPU at once (``cuOccupancyMaxActiveClusters``).

    A persistent kernel must launch at most this many clusters: GPCs whose SM count is not a
    multiple of the cluster size leave SMs idle, and clusters beyond the resident ones run as a
    second wave, which doubles the time. Cached per (kernel, arguments).

    Raises:
        TypeError / ValueError: malformed arguments; RuntimeError: no driver or a failed call.
    """
    if not isinstance(kernel, LoadedKernel):
        raise TypeError(f"kernel: expected a LoadedKernel, got {type(kernel).__name__}")
    for arg, v in (("cluster", cluster), ("block", block)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{arg}: expected a positive int, got {v!r}")
    key = (id(kernel), cluster, block, smem_bytes)
    hit = _max_clusters.get(key)
    if hit is not None:
        return hit
    driver = _require_driver("max_active_clusters")
    if smem_bytes > kernel.max_dynamic_smem:
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _ok(driver, driver.cuFuncSetAttribute(kernel.function, attr, smem_bytes), "cuFuncSetAttr")
        kernel.max_dynamic_smem = smem_bytes
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = cluster, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
    config.sharedMemBytes = smem_bytes
    attr = driver.CUlaunchAttribute()
    attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster, 1, 1
    config.attrs = [attr]
    config.numAttrs = 1
    n = int(
        _ok(
            driver,
            driver.cuOccupancyMaxActiveClusters(kernel.function, config),
            "cuOccupancyMaxActiveClusters",
        )
    )
    _max_clusters[key] = n
    return n


_max_clusters: dict[tuple, int] = {}


# Launch configurations by (kernel, grid, block, smem, cluster, stream); kernels are cached for
# the process's life (load_kernel), so their id() is a stable key.
_configs: dict = {}
_MAX_CONFIGS = 4096


def launch(
    kernel: LoadedKernel,
    grid,
    block,
    args: Sequence[Any],
    *,
    smem_bytes: int = 0,
    cluster=None,
    stream=None,
) -> None:
    """Launches ``kernel`` asynchronously on ``stream`` (default: PyTorch's current stream).

    Args:
        kernel: from ``load_kernel``.
        grid, block: an int or a 1- to 3-tuple of positive ints.
        args: the kernel's parameters in order (see the module docstring for the packing).
        smem_bytes: dynamic shared memory per block; above 48 KB the function's
            ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` is raised first.
        cluster: thread-block-cluster dims (sm_90); each grid dim must divide by it.
        stream: a ``torch.cuda.Stream``; default ``torch.cuda.current_stream()``.

    Raises:
        TypeError / ValueError: malformed arguments; RuntimeError: no driver or a failed call.
    """
    if not isinstance(kernel, LoadedKernel):
        raise TypeError(f"kernel: expected a LoadedKernel, got {type(kernel).__name__}")
    grid3, block3 = _dim3(grid, "grid"), _dim3(block, "block")
    cluster3 = _dim3(cluster, "cluster") if cluster is not None else None
    if cluster3 is not None and any(g % c for g, c in zip(grid3, cluster3)):
        raise ValueError(f"cluster: grid {grid3} is not divisible by cluster {cluster3}")
    if not isinstance(smem_bytes, int) or smem_bytes < 0:
        raise ValueError(f"smem_bytes: expected a non-negative int, got {smem_bytes!r}")
    packed = [_pack_arg(a, i) for i, a in enumerate(args)]
    driver = _require_driver("launch")
    import torch

    if smem_bytes > kernel.max_dynamic_smem:
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _ok(driver, driver.cuFuncSetAttribute(kernel.function, attr, smem_bytes), "cuFuncSetAttr")
        kernel.max_dynamic_smem = smem_bytes
    if stream is None:
        stream = torch.cuda.current_stream()
    # The launch configuration is built once per (kernel, geometry, stream) and reused: building
    # cuda-bindings objects costs tens of µs of host time per launch.
    key = (id(kernel), grid3, block3, smem_bytes, cluster3, stream.cuda_stream)
    config = _configs.get(key)
    if config is None:
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid3
        config.blockDimX, config.blockDimY, config.blockDimZ = block3
        config.sharedMemBytes = smem_bytes
        config.hStream = driver.CUstream(stream.cuda_stream)
        attrs = []
        if cluster3 is not None:
            attr = driver.CUlaunchAttribute()
            attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster3
            attrs.append(attr)
        if (
            attrs
        ):  # assign once: re-assigning CUlaunchConfig.attrs double-frees (cuda-bindings 13.0.3)
            config.attrs = attrs
        config.numAttrs = len(attrs)
        if len(_configs) >= _MAX_CONFIGS:
            _configs.clear()
        _configs[key] = config
    pointers = (ctypes.c_void_p * max(len(packed), 1))(*[ctypes.addressof(p) for p in packed])
    _ok(
        driver,
        driver.cuLaunchKernelEx(config, kernel.function, ctypes.addressof(pointers), 0),
        "cuLaunchKernelEx",
    )


# ---- bound launches: the per-call host path of hot kernels --------------------------------------
#
# ``launch`` validates and packs every argument through ctypes objects and calls the driver
# through cuda-bindings: about 70 µs of host time per launch on the H200 test machines
# (benchmarks/host_sections.py), paid by every quantizer and GEMM call of a training step. A
# ``BoundLaunch`` does the validation and the layout work once per (kernel, signature, block,
# shared memory, cluster): each call packs all arguments with one ``struct.pack_into`` into a
# per-thread parameter block whose pointer array is built once, and calls ``cuLaunchKernel`` /
# ``cuLaunchKernelEx`` of libcuda through ctypes. The driver copies the parameter values before
# the call returns, so the block is reused by the next call; it is per thread because ctypes
# releases the GIL during the call (the autograd engine launches backward kernels from its own
# thread).

# Signature characters → (struct code, bytes, alignment) of one kernel parameter.
_SIG = {
    "p": ("Q", 8, 8),  # a device pointer, passed as an int address (tensor.data_ptr())
    "q": ("q", 8, 8),  # int64
    "i": ("i", 4, 4),  # int32
    "f": ("f", 4, 4),  # float32
    "T": ("128s", _TMAP_BYTES, 64),  # a CUtensorMap by value (TensorMap.data, 128 bytes)
}
_CUDA_ERROR_INVALID_CONTEXT = 201


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` (cuda.h): an enum id padded to 8 bytes, then a 64-byte union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint * 16)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` (cuda.h)."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("numAttrs", ctypes.c_uint),
    ]


@functools.cache
def _libcuda():
    """libcuda's launch entry points with their argument types (ctypes)."""
    lib = None
    for name in ("libcuda.so.1", "libcuda.so"):  # as driver_available() looks for it
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    if lib is None:
        raise RuntimeError("ptxtrain.jit.BoundLaunch needs the CUDA driver (libcuda.so.1)")
    u = ctypes.c_uint
    lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p]
    lib.cuLaunchKernel.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernel.restype = ctypes.c_int
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.argtypes += [ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def param_layout(signature: str) -> tuple[str, list[int], int]:
    """The parameter block of a :class:`BoundLaunch` signature: ``(struct format, offset of each
    parameter, total bytes)``, every parameter at a multiple of its alignment.

    Raises:
        ValueError: an unknown signature character (see :class:`BoundLaunch`).
    """
    if not isinstance(signature, str):
        raise TypeError(f"signature: expected a str, got {type(signature).__name__}")
    fmt, offsets, off = "<", [], 0
    for i, ch in enumerate(signature):
        if ch not in _SIG:
            raise ValueError(
                f"signature[{i}]: expected one of {''.join(_SIG)} (pointer, int64, int32, float, "
                f"TensorMap), got {ch!r}"
            )
        code, size, align = _SIG[ch]
        pad = -off % align
        if pad:
            fmt += f"{pad}x"
            off += pad
        offsets.append(off)
        fmt += code
        off += size
    return fmt, offsets, off


def raw_stream(device: int) -> int:
    """The current CUDA stream of device index ``device`` as a raw ``cudaStream_t`` (int), read
    through torch's C binding when it has one (no Python stream object), else from
    ``torch.cuda.current_stream``."""
    import torch

    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is not None:
        return getter(device)
    return torch.cuda.current_stream(device).cuda_stream


class BoundLaunch:
    """Launches of one kernel with a fixed parameter signature, block, shared memory and cluster,
    prepared once so each call costs a few µs of host time (see the note above).

    Args:
        kernel: from :func:`load_kernel`.
        signature: one character per kernel parameter, in order: ``p`` a device pointer (pass
            ``tensor.data_ptr()``), ``q`` int64, ``i`` int32, ``f`` float32, ``T`` a
            ``CUtensorMap`` by value (pass ``TensorMap.data`` or :func:`tma_2d_bytes`).
        block: threads per CTA (an int or 1- to 3-tuple).
        smem_bytes: dynamic shared memory per CTA (above 48 KB the kernel's limit is raised here).
        cluster: thread-block-cluster dims (sm_90), or None.
        programmatic: launch with programmatic stream serialization (sm_90, Programmatic
            Dependent Launch, CUDA programming guide): the grid may start while the previous
            kernel on the stream finishes, so the launch latency and the kernel's prologue
            overlap that kernel's tail. Only for kernels that execute ``griddepcontrol.wait``
            (``ptxtrain/ptx.cuh``: ``grid_dependency_wait``) before their first global memory
            access; such a kernel launched without it waits for nothing.

    Call: ``bound(grid, *values, stream=None)`` with ``grid`` an int or a 3-tuple of ints, one
    value per signature character, ``stream`` a raw ``cudaStream_t`` handle (default: PyTorch's
    current stream on the kernel's device). Launches asynchronously on the kernel's device.

    Raises:
        TypeError / ValueError: malformed arguments at construction; at a call, values that do not
            fit the signature (the message names the parameter) or a grid not divisible by the
            cluster.
        RuntimeError: no CUDA driver, or the driver rejected the launch (its error in the message).
    """

    def __init__(
        self,
        kernel,
        signature: str,
        block,
        *,
        smem_bytes: int = 0,
        cluster=None,
        programmatic: bool = False,
    ):
        if not isinstance(kernel, LoadedKernel):
            raise TypeError(f"kernel: expected a LoadedKernel, got {type(kernel).__name__}")
        fmt, self.offsets, self.nbytes = param_layout(signature)
        self.signature = signature
        self.block = _dim3(block, "block")
        self.cluster = _dim3(cluster, "cluster") if cluster is not None else None
        if not isinstance(programmatic, bool):
            raise TypeError(f"programmatic: expected a bool, got {programmatic!r}")
        self.programmatic = programmatic
        if not isinstance(smem_bytes, int) or smem_bytes < 0:
            raise ValueError(f"smem_bytes: expected a non-negative int, got {smem_bytes!r}")
        self.smem_bytes = smem_bytes
        self.kernel = kernel
        self._struct = struct.Struct(fmt)
        self._tls = threading.local()
        driver = _require_driver("BoundLaunch")
        if smem_bytes > kernel.max_dynamic_smem:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _ok(
                driver,
                driver.cuFuncSetAttribute(kernel.function, attr, smem_bytes),
                "cuFuncSetAttr",
            )
            kernel.max_dynamic_smem = smem_bytes
        self._function = int(kernel.function)
        ids = driver.CUlaunchAttributeID
        self._cluster_attr_id = int(ids.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        self._pdl_attr_id = int(ids.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._lib = _libcuda()

    def _state(self):
        """This thread's (parameter block, pointer array, launch config or None)."""
        state = getattr(self._tls, "state", None)
        if state is None:
            block = ctypes.create_string_buffer(max(self.nbytes, 1))
            base = ctypes.addressof(block)
            n = max(len(self.offsets), 1)
            pointers = (ctypes.c_void_p * n)(*[base + o for o in self.offsets])
            config = None
            if self.cluster is not None or self.programmatic:
                attrs = (_LaunchAttribute * 2)()
                n_attrs = 0
                if self.cluster is not None:
                    attrs[n_attrs].id = self._cluster_attr_id
                    attrs[n_attrs].value[0], attrs[n_attrs].value[1], attrs[n_attrs].value[2] = (
                        self.cluster
                    )
                    n_attrs += 1
                if self.programmatic:
                    attrs[n_attrs].id = self._pdl_attr_id
                    attrs[n_attrs].value[0] = 1  # programmaticStreamSerializationAllowed
                    n_attrs += 1
                config = _LaunchConfig()
                config.blockDimX, config.blockDimY, config.blockDimZ = self.block
                config.sharedMemBytes = self.smem_bytes
                config.attrs = ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute))
                config.numAttrs = n_attrs
                config._attrs = attrs  # keep the attributes alive with the config
            state = self._tls.state = (block, pointers, config)
        return state

    def _bad_values(self, values, exc: Exception) -> Exception:
        if len(values) != len(self.signature):
            return TypeError(
                f"expected {len(self.signature)} values for signature {self.signature!r}, "
                f"got {len(values)}"
            )
        for i, (ch, v) in enumerate(zip(self.signature, values)):
            try:
                struct.pack("<" + _SIG[ch][0], v)
            except struct.error as e:
                return ValueError(f"value {i} (signature {ch!r}): {v!r} does not fit: {e}")
        return ValueError(f"values do not fit signature {self.signature!r}: {exc}")

    def __call__(self, grid, *values, stream: int | None = None) -> None:
        block_buf, pointers, config = self._state()
        try:
            self._struct.pack_into(block_buf, 0, *values)
        except struct.error as e:
            raise self._bad_values(values, e) from None
        gx, gy, gz = (grid, 1, 1) if type(grid) is int else grid
        if stream is None:
            stream = raw_stream(self.kernel.device)
        for _ in range(2):
            if config is None:
                bx, by, bz = self.block
                err = self._lib.cuLaunchKernel(
                    self._function, gx, gy, gz, bx, by, bz, self.smem_bytes, stream, pointers, None
                )
            else:
                cx, cy, cz = self.cluster or (1, 1, 1)
                if gx % cx or gy % cy or gz % cz:
                    raise ValueError(
                        f"grid {(gx, gy, gz)} is not divisible by cluster {self.cluster}"
                    )
                config.gridDimX, config.gridDimY, config.gridDimZ = gx, gy, gz
                config.hStream = stream
                err = self._lib.cuLaunchKernelEx(
                    ctypes.addressof(config), self._function, pointers, None
                )
            if err != _CUDA_ERROR_INVALID_CONTEXT:
                break
            # A thread that has not touched the device yet has no current context: make the
            # primary one current (as load_kernel does) and try once more.
            _ensure_context(_require_driver("BoundLaunch"), self.kernel.device)
        if err:
            driver = _require_driver("BoundLaunch")
            _ok(driver, (driver.CUresult(err),), f"cuLaunchKernel of {self.kernel.symbol}")


# TMA descriptor bytes by (address, dtype, shape, strides, box, swizzle): the driver call costs
# tens of µs of host time per descriptor from Python, and GEMMs see the same operands (cached
# weights) or the same allocator blocks again and again. Unified addressing makes an address
# unique across the process's devices. Only bytes are cached, never a tensor.
_encoded_bytes: dict[tuple, bytes] = {}
# Per geometry (the key without the address): the last encoding, its address, and where the
# address sits in the 128 bytes once seen: encoding one geometry at two addresses must differ in
# exactly that 8-byte little-endian field, holding each address, twice in a row; then a new
# address is written into the template instead of calling the driver (~30 µs of host time per
# encode on the H200 machines; activations move between steps). -1: never patch this geometry.
_geometry: dict[tuple, list] = {}
_PATCH_CHECKS = 2


def _address_field(a: bytes, a_ptr: int, b: bytes, b_ptr: int) -> int:
    """The offset of the one 8-byte field in which encodings ``a`` and ``b`` differ, if it holds
    ``a_ptr`` and ``b_ptr``; -1 otherwise."""
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    if not diff or len(a) != len(b):
        return -1
    start = diff[0] - diff[0] % 8
    if diff[-1] >= start + 8:
        return -1
    ok = int.from_bytes(a[start : start + 8], "little") == a_ptr
    return start if ok and int.from_bytes(b[start : start + 8], "little") == b_ptr else -1


def tma_2d_bytes(tensor, box_rows: int, box_cols: int, swizzle: str = "none") -> bytes:
    """The 128 bytes of :func:`make_tma_2d_desc` ``(tensor, box_rows, box_cols, swizzle)``, for a
    ``T`` parameter of a :class:`BoundLaunch`: cached by address and geometry, and for a tensor
    of a known geometry at a new address, the cached encoding with the address rewritten (once
    two encodings showed where it sits, see above). The caller keeps ``tensor`` alive until the
    launch has been queued (the bytes hold its address).

    Raises:
        as :func:`make_tma_2d_desc`.
    """
    ptr = tensor.data_ptr()
    geom = (tensor.dtype, tensor.shape, tensor.stride(), box_rows, box_cols, swizzle)
    key = (ptr, geom)
    hit = _encoded_bytes.get(key)
    if hit is not None:
        return hit
    known = _geometry.get(geom)
    if known is not None and known[2] >= _PATCH_CHECKS and ptr % 16 == 0 and tensor.is_cuda:
        off = known[3]
        hit = known[0][:off] + ptr.to_bytes(8, "little") + known[0][off + 8 :]
    else:
        hit = _encode_2d(tensor, box_rows, box_cols, swizzle)
        if known is None:
            if len(_geometry) >= _ENCODED_MAX:  # bounded like _encoded_bytes (MoE shapes vary)
                _geometry.pop(next(iter(_geometry)))
            _geometry[geom] = [hit, ptr, 0, -1]
        elif known[2] >= 0 and known[1] != ptr:
            off = _address_field(known[0], known[1], hit, ptr)
            if off < 0 or (known[3] >= 0 and off != known[3]):
                known[2] = -1  # something besides the address changed: always encode
            else:
                known[0], known[1], known[2], known[3] = hit, ptr, known[2] + 1, off
    if len(_encoded_bytes) >= _ENCODED_MAX:
        _encoded_bytes.pop(next(iter(_encoded_bytes)))
    _encoded_bytes[key] = hit
    return hit
