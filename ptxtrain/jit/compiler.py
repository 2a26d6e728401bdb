"""Run-time compilation of CUDA C++ (with inline PTX) to a cubin through NVRTC.

Design (docs/design.md §3, §7): NVRTC is reached through ``cuda.bindings.nvrtc`` (packages
``cuda-bindings`` + ``nvidia-cuda-nvrtc``), which needs neither a GPU nor a driver nor a CUDA
toolkit, so compiles (and the tests on their PTX / SASS) run on a CPU-only machine. Kernel
symbols are named at compile time: every kernel is registered as an NVRTC name expression (an
``extern "C"`` name or a template instantiation such as ``"my_kernel<128, 64>"``) and its lowered
name is read back from NVRTC — never scraped from the binary. Results go through the cache in
``cache.py``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ptxtrain.jit.cache import (
    INCLUDE_DIR,
    CacheEntry,
    atomic_write_bytes,
    cache_dir,
    cache_disabled,
    debug_log,
    default_cache,
    env_flag,
    hash_headers,
    make_key,
    write_sass,
)

_ARCH_RE = re.compile(r"^sm_\d{2,3}[af]?$")
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class JitCompileError(RuntimeError):
    """NVRTC rejected a kernel. ``name``: the kernel; ``log``: NVRTC's full compile log;
    ``options``: the command line given to NVRTC; ``detail``: the NVRTC call and result;
    ``source_path``: where the generated translation unit was saved for inspection
    (:func:`compile_cuda` sets it; None if it could not be written)."""

    def __init__(
        self,
        name: str,
        log: str,
        options: Sequence[str],
        detail: str = "",
        source_path: Path | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self.options = list(options)
        self.detail = detail
        self.source_path = source_path
        head = f"NVRTC failed to compile kernel {name!r}"
        if detail:
            head += f" ({detail})"
        where = f"\ngenerated source: {source_path}" if source_path is not None else ""
        super().__init__(f"{head}; options: {' '.join(options)}{where}\n--- NVRTC log ---\n{log}")


@dataclass(frozen=True)
class CompiledKernel:
    """A compiled module and the symbols of its kernels.

    Attributes:
        name: the kernel's name as given to ``compile_cuda``.
        arch: the target, e.g. ``"sm_90a"``.
        cubin: the ELF cubin bytes (what ``launch.load_kernel`` loads).
        symbols: name expression -> lowered (mangled) symbol, from NVRTC.
        ptx: the PTX text when ``keep_ptx=True`` or ``PTXTRAIN_JIT_DUMP_PTX=1``, else None.
        key: the cache key (sha256 hex).
        cache_path: the cache entry's directory, or None when the cache is disabled.
        how: ``"compiled"``, ``"disk"`` or ``"memory"``: where this result came from.
        log: NVRTC's log (warnings, ``ptxas info``), possibly empty.
    """

    name: str
    arch: str
    cubin: bytes
    symbols: Mapping[str, str]
    ptx: str | None = None
    key: str = ""
    cache_path: Path | None = None
    how: str = "compiled"
    log: str = field(default="", repr=False)

    def symbol(self, expression: str | None = None) -> str:
        """The lowered symbol of ``expression`` (default: the first name expression, i.e. the
        kernel named ``name``). Raises ValueError for an unknown expression."""
        if expression is None:
            return next(iter(self.symbols.values()))
        if expression not in self.symbols:
            raise ValueError(
                f"expression: {expression!r} was not registered at compile time; "
                f"registered: {sorted(self.symbols)}"
            )
        return self.symbols[expression]


def nvrtc_available() -> bool:
    """True when ``cuda.bindings.nvrtc`` imports and libnvrtc loads."""
    try:
        nvrtc_version()
    except RuntimeError:
        return False
    return True


@functools.cache
def nvrtc_version() -> str:
    """NVRTC's version, ``"<major>.<minor>"`` plus the wheel's full version when installed from
    PyPI (e.g. ``"13.0+nvidia-cuda-nvrtc-13.0.88"``). Part of every cache key."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise RuntimeError(
            "ptxtrain.jit needs NVRTC: pip install 'cuda-bindings==13.0.*' "
            f"'nvidia-cuda-nvrtc==13.0.*' ({exc})"
        ) from exc
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # libnvrtc missing: cuda-pathfinder raises its own error types
        raise RuntimeError(
            f"ptxtrain.jit: libnvrtc could not be loaded ({type(exc).__name__}: {exc}); "
            "pip install 'nvidia-cuda-nvrtc==13.0.*'"
        ) from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"ptxtrain.jit: nvrtcVersion failed: {err}")
    version = f"{major}.{minor}"
    for dist in ("nvidia-cuda-nvrtc", "nvidia-cuda-nvrtc-cu12"):
        try:
            version += f"+{dist}-{importlib.metadata.version(dist)}"
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return version


def _check(nvrtc, result, what: str, name: str, options: Sequence[str], prog=None) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if err == nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return
    log = _program_log(nvrtc, prog) if prog is not None else ""
    raise JitCompileError(name, log, options, detail=f"{what}: {err.name}")


def _program_log(nvrtc, prog) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0").decode(errors="replace").strip()


def _nvrtc_compile(
    source: str, name: str, options: Sequence[str], expressions: Sequence[str], arch: str
) -> CacheEntry:
    """One NVRTC run: source -> (cubin, PTX, lowered names, log). Raises JitCompileError."""
    from cuda.bindings import nvrtc

    opts = [o.encode() for o in options]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(nvrtc, err, "nvrtcCreateProgram", name, options)
    try:
        for expr in expressions:
            _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, expr.encode()), "name", name, options)
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        _check(nvrtc, res, "nvrtcCompileProgram", name, options, prog)
        log = _program_log(nvrtc, prog)
        symbols = {}
        for expr in expressions:
            res = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            _check(nvrtc, res, f"nvrtcGetLoweredName({expr!r})", name, options, prog)
            symbols[expr] = res[1].decode()
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, err, "nvrtcGetCUBINSize", name, options, prog)
        cubin = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN", name, options, prog)
        err, size = nvrtc.nvrtcGetPTXSize(prog)
        _check(nvrtc, err, "nvrtcGetPTXSize", name, options, prog)
        ptx = b" " * size
        _check(nvrtc, nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX", name, options, prog)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return CacheEntry(
        name=name,
        arch=arch,
        cubin=bytes(cubin),
        ptx=ptx.rstrip(b"\0").decode(),
        symbols=symbols,
        log=log,
    )


def _save_failed_source(
    source: str, name: str, key: str, options: Sequence[str], expressions: Sequence[str]
) -> Path | None:
    """Writes a translation unit NVRTC rejected to ``<cache dir>/failed/<name>-<key[:16]>.cu``
    (the system temp dir's ``ptxtrain-jit-failed/`` instead with ``PTXTRAIN_JIT_DISABLE_CACHE``;
    atomically, with the options and name expressions as a leading comment) and returns the
    path, or None if it cannot be written (the compile error is raised either way)."""
    if cache_disabled():
        root = Path(tempfile.gettempdir()) / "ptxtrain-jit-failed"
    else:
        root = cache_dir() / "failed"
    path = root / f"{name}-{key[:16]}.cu"
    head = "".join(f"// nvrtc option: {o}\n" for o in options)
    head += "".join(f"// name expression: {e}\n" for e in expressions)
    try:
        atomic_write_bytes(path, (head + source).encode())
    except OSError as exc:
        debug_log(f"could not save the failed source of {name} at {path}: {exc}")
        return None
    debug_log(f"NVRTC rejected {name}: source saved at {path}")
    return path


def _str_tuple(value, arg: str) -> tuple[str, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"{arg}: expected a sequence of str, got {type(value).__name__}")
    for item in value:
        if not isinstance(item, str):
            raise TypeError(f"{arg}: expected a sequence of str, got an item {item!r}")
    return tuple(value)


def compile_cuda(
    source: str,
    *,
    name: str,
    arch: str = "sm_90a",
    flags: Sequence[str] = (),
    include_dirs: Sequence[str | os.PathLike] = (),
    name_expressions: Sequence[str] = (),
    keep_ptx: bool = False,
) -> CompiledKernel:
    """Compiles CUDA C++ ``source`` to a cubin for ``arch`` through NVRTC, with caching.

    Args:
        source: a complete translation unit; ``#include <ptxtrain/ptx.cuh>`` etc. resolve to
            ``ptxtrain/include``.
        name: the kernel's name (a C identifier), used for messages, the cache and, when
            ``name_expressions`` is empty, as the single name expression (so it must then be an
            ``extern "C" __global__`` function or otherwise resolvable by that name).
        arch: ``"sm_<NN>[a|f]"``; wgmma and setmaxnreg need ``"sm_90a"``.
        flags: extra NVRTC options, e.g. ``("-DPTXTRAIN_AGGRESSIVE_PTX", "-lineinfo")``.
        include_dirs: extra ``--include-path`` directories (their files join the cache key).
        name_expressions: kernels to name, e.g. ``("fp8_gemm<128, 112>",)``; their lowered names
            are in ``CompiledKernel.symbols``.
        keep_ptx: keep the PTX text in the result (also on with ``PTXTRAIN_JIT_DUMP_PTX=1``).

    Options always given: ``-arch=<arch> -std=c++17 --include-path=<ptxtrain/include>``.

    Returns:
        CompiledKernel.

    Raises:
        TypeError / ValueError: malformed arguments (the message names the argument).
        JitCompileError: NVRTC rejected the source; the message names the kernel and holds the
            full NVRTC log.
        RuntimeError: NVRTC is not installed.
    """
    if not isinstance(source, str) or not source.strip():
        raise ValueError(f"source: expected non-empty CUDA C++ text, got {source!r:.60}")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"name: expected a C identifier, got {name!r}")
    if not isinstance(arch, str) or not _ARCH_RE.match(arch):
        raise ValueError(f"arch: expected 'sm_<NN>' with optional 'a'/'f', got {arch!r}")
    flags = _str_tuple(flags, "flags")
    expressions = _str_tuple(name_expressions, "name_expressions") or (name,)
    if isinstance(include_dirs, str | bytes) or not isinstance(include_dirs, Sequence):
        raise TypeError(f"include_dirs: expected a sequence of paths, got {include_dirs!r}")
    extra_dirs = tuple(str(Path(d).resolve()) for d in include_dirs)
    for d in extra_dirs:
        if not Path(d).is_dir():
            raise ValueError(f"include_dirs: {d!r} is not a directory")

    options = (
        f"-arch={arch}",
        "-std=c++17",
        f"--include-path={INCLUDE_DIR}",
        *(f"--include-path={d}" for d in extra_dirs),
        *flags,
    )
    want_ptx = keep_ptx or env_flag("PTXTRAIN_JIT_DUMP_PTX")
    key = make_key(
        name=name,
        source=source,
        flags=options,
        arch=arch,
        compiler_version=nvrtc_version(),
        header_hash=hash_headers(extra_dirs),
        name_expressions=expressions,
    )

    def build() -> CacheEntry:
        try:
            entry = _nvrtc_compile(source, name, options, expressions, arch)
        except JitCompileError as exc:
            saved = _save_failed_source(source, name, key, options, expressions)
            raise JitCompileError(exc.name, exc.log, exc.options, exc.detail, saved) from None
        debug_log(f"compiled {name} for {arch}: {len(entry.cubin)} B cubin, key={key[:16]}")
        return entry

    if cache_disabled():
        debug_log(f"cache disabled: compiling {name}")
        entry, how, path = build(), "compiled", None
    else:
        cache = default_cache()
        entry, how = cache.get_or_build(key, build)
        path = cache.entry_dir(key)
        if how == "compiled" and env_flag("PTXTRAIN_JIT_DUMP_SASS"):
            sass = write_sass(path, path / "kernel.cubin")
            if sass is not None:
                debug_log(f"SASS of {name} at {sass}")
        if how == "compiled" and want_ptx:
            debug_log(f"PTX of {name} at {path / 'kernel.ptx'}")
    return CompiledKernel(
        name=name,
        arch=arch,
        cubin=entry.cubin,
        symbols=dict(entry.symbols),
        ptx=entry.ptx if want_ptx else None,
        key=key,
        cache_path=path,
        how=how,
        log=entry.log,
    )
