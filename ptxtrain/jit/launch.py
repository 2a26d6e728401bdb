"""Loading cubins and launching kernels on PyTorch's current stream, through the CUDA driver API.

Design (DESIGN §3, §7):

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
  RuntimeError otherwise (DESIGN §7: driver paths misbehave, even hang, without a driver).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ptxtrain.jit.compiler import CompiledKernel

_STATIC_SMEM_LIMIT = 48 * 1024  # bytes of dynamic smem allowed without cuFuncSetAttribute
_TMAP_BYTES = 128  # sizeof(CUtensorMap)


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


# Encoded descriptors by (address, dtype, shape, strides, device, box, swizzle): the driver call
# costs tens of µs of host time per descriptor from Python, and GEMMs see the same operands
# (cached weights) or the same allocator blocks again and again.
_encoded: dict[tuple, tuple[bytes, Tma2dParams]] = {}
_ENCODED_MAX = 4096


def make_tma_2d_desc(tensor, box_rows: int, box_cols: int, *, swizzle: str = "none") -> TensorMap:
    """Encodes a TMA descriptor for a row-major 2D CUDA tensor (``cuTensorMapEncodeTiled``).

    dtype → element type: FP8 / int8 / uint8 → UINT8, bfloat16, float16, float32, int32. L2
    promotion 256 B, no interleave, out-of-bounds elements read as zero. The tensor's address
    must be 16-byte aligned. See ``tma_2d_params`` for the box rules.

    Raises:
        TypeError / ValueError: not a 2D CUDA tensor of a supported dtype, or a bad box.
        RuntimeError: no CUDA driver, or the driver rejects the descriptor.
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
    key = (
        tensor.data_ptr(),
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.device,
        box_rows,
        box_cols,
        swizzle,
    )
    hit = _encoded.get(key)
    if hit is not None:
        # The encoding depends only on the key, so a tensor that reuses a freed tensor's memory
        # with the same geometry gets the same (valid) descriptor; only bytes are cached, never
        # the tensor, so the cache keeps nothing alive.
        return TensorMap(hit[0], hit[1], owner=tensor)
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
    data = ctypes.string_at(tmap.getPtr(), _TMAP_BYTES)
    if len(_encoded) >= _ENCODED_MAX:
        _encoded.pop(next(iter(_encoded)))  # oldest first (dicts keep insertion order)
    _encoded[key] = (data, params)
    return TensorMap(data, params, owner=tensor)


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
