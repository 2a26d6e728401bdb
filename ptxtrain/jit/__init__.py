"""Run-time compilation (NVRTC), caching and launching of CUDA C++ kernels with inline PTX.

Generic: this package knows nothing of GEMMs. A kernel family generates a small ``.cu`` that
includes ``<ptxtrain/*.cuh>`` (``ptxtrain/include``) and instantiates a template with shape
constants, compiles it with ``compile_cuda`` (cached on disk), loads it with ``load_kernel`` and
launches it with ``launch`` on PyTorch's current stream (or, on hot paths, through a
``BoundLaunch`` prepared once per kernel and signature: a few µs of host time per call).
Compiling needs only the pip packages ``cuda-bindings`` and ``nvidia-cuda-nvrtc`` (no GPU, driver
or CUDA toolkit); loading and launching need a GPU and its driver.

Environment variables (read at each call):

- ``PTXTRAIN_JIT_CACHE_DIR``: the disk cache directory (default ``~/.cache/ptxtrain/jit``). One
  subdirectory per key holds ``kernel.cubin``, ``kernel.ptx`` and ``meta.json``.
- ``PTXTRAIN_JIT_DEBUG=1``: print compile / cache-hit / corrupt-entry events to stderr.
- ``PTXTRAIN_JIT_DUMP_PTX=1``: keep the PTX on the returned ``CompiledKernel`` (``.ptx``) and
  print where ``kernel.ptx`` lies beside the cubin (with ``PTXTRAIN_JIT_DEBUG=1``).
- ``PTXTRAIN_JIT_DUMP_SASS=1``: on a fresh compile, write ``kernel.sass`` beside the cubin with
  ``cuobjdump -sass`` (from PATH or the Triton wheel; skipped if none is found).
- ``PTXTRAIN_JIT_DISABLE_CACHE=1``: always compile; nothing is read from or written to disk.
- ``PTXTRAIN_JIT_FFMA_YIELD``: ``off`` (default), ``interleave``, ``all`` or ``none``: the SASS
  post-pass on the yield bits of long FFMA runs (``ptxtrain.jit.sass``), for kernel families
  that apply it to their cubins before loading them (read when they load a kernel).

The cache key is a sha256 over the kernel name, the generated source, every header under
``ptxtrain/include`` (and extra include directories), the NVRTC options, the arch and the NVRTC
version; writes are atomic and a per-key file lock makes concurrent processes compile once.
"""

from ptxtrain.jit.cache import INCLUDE_DIR, cache_dir
from ptxtrain.jit.compiler import (
    CompiledKernel,
    JitCompileError,
    compile_cuda,
    nvrtc_available,
    nvrtc_version,
)
from ptxtrain.jit.launch import (
    BoundLaunch,
    LoadedKernel,
    TensorMap,
    driver_available,
    launch,
    load_kernel,
    make_tma_2d_desc,
    max_active_clusters,
    param_layout,
    programmatic_launch_enabled,
    tma_2d_bytes,
    tma_2d_params,
)

__all__ = [
    "INCLUDE_DIR",
    "BoundLaunch",
    "CompiledKernel",
    "JitCompileError",
    "LoadedKernel",
    "TensorMap",
    "cache_dir",
    "compile_cuda",
    "driver_available",
    "launch",
    "load_kernel",
    "make_tma_2d_desc",
    "max_active_clusters",
    "nvrtc_available",
    "nvrtc_version",
    "param_layout",
    "programmatic_launch_enabled",
    "tma_2d_bytes",
    "tma_2d_params",
]
