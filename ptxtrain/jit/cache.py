"""On-disk + in-memory cache of compiled kernels.

Design (STYLE habit 7, after DeepGEMM's Python-JIT cache and QuACK's per-key locks):

- The key is a sha256 over everything that changes the binary: kernel name, generated source, a
  hash of every header under ``ptxtrain/include``, compiler flags, target arch and the NVRTC
  version (``make_key``).
- One directory per key, ``<cache_dir>/<key[:2]>/<key>/``, holding ``kernel.cubin``,
  ``kernel.ptx`` and ``meta.json``; ``meta.json`` is written last and stores the sha256 of the
  cubin and of the PTX, so an entry is valid only once complete. A truncated or garbage cubin or
  PTX, a checksum mismatch or an unreadable ``meta.json`` is treated as a miss and the entry is
  rebuilt (entries written before the PTX checksum existed have their PTX unchecked).
- Every file is written atomically: a temporary file in the same directory, ``fsync``, then
  ``os.replace``; a reader never sees half a file.
- A per-key lock (``fcntl.flock`` on ``<cache_dir>/locks/<key>.lock``) serialises builders, so N
  processes (e.g. 8 ranks under torchrun) asking for one key compile it once: the first builds,
  the others wait and then read the entry from disk.
- An in-memory dict sits in front of the disk, per process.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"
"""Root of ptxtrain's CUDA headers (``#include <ptxtrain/ptx.cuh>``)."""

_CUBIN_NAME = "kernel.cubin"
_PTX_NAME = "kernel.ptx"
_SASS_NAME = "kernel.sass"
_META_NAME = "meta.json"
ELF_MAGIC = b"\x7fELF"
_META_VERSION = 1


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is on: ``1``, ``true``, ``yes`` or ``on`` (any case,
    surrounding spaces ignored); unset or anything else is off."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def debug_enabled() -> bool:
    """True when ``PTXTRAIN_JIT_DEBUG`` is set to 1 (read at every call, not at import)."""
    return env_flag("PTXTRAIN_JIT_DEBUG")


def debug_log(message: str) -> None:
    """Prints ``[ptxtrain.jit pid=<pid> thread=<name>] message`` to stderr when
    ``PTXTRAIN_JIT_DEBUG=1`` (the thread tells a prewarm compile, ``ptxtrain-jit_*``, from one
    the training thread, ``MainThread``, waits for)."""
    if debug_enabled():
        where = f"pid={os.getpid()} thread={threading.current_thread().name}"
        print(f"[ptxtrain.jit {where}] {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """The disk cache root: ``$PTXTRAIN_JIT_CACHE_DIR``, default ``~/.cache/ptxtrain/jit``."""
    env = os.environ.get("PTXTRAIN_JIT_CACHE_DIR", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ptxtrain" / "jit"


def cache_disabled() -> bool:
    """True when ``PTXTRAIN_JIT_DISABLE_CACHE=1``: every compile runs NVRTC afresh."""
    return env_flag("PTXTRAIN_JIT_DISABLE_CACHE")


def hash_headers(include_dirs: Sequence[str | os.PathLike] = ()) -> str:
    """sha256 over the relative path and bytes of every file under ``ptxtrain/include`` and the
    given extra include directories, in sorted order (hex string). Not memoised: editing a header
    must change the key of the next compile."""
    h = hashlib.sha256()
    for root in (INCLUDE_DIR, *map(Path, include_dirs)):
        if not root.is_dir():
            continue
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            h.update(str(path.relative_to(root)).encode())
            h.update(b"\0")
            h.update(path.read_bytes())
            h.update(b"\0")
    return h.hexdigest()


def make_key(
    *,
    name: str,
    source: str,
    flags: Sequence[str],
    arch: str,
    compiler_version: str,
    header_hash: str,
    name_expressions: Sequence[str] = (),
) -> str:
    """sha256 (hex) over every input that changes the compiled binary."""
    payload = json.dumps(
        {
            "meta_version": _META_VERSION,
            "name": name,
            "source": source,
            "flags": list(flags),
            "arch": arch,
            "compiler": compiler_version,
            "headers": header_hash,
            "name_expressions": list(name_expressions),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True)
class CacheEntry:
    """What the cache stores per key: the cubin, the PTX and the kernel symbols.

    ``symbols`` maps each NVRTC name expression (or the ``extern "C"`` name) to its lowered name.
    """

    name: str
    arch: str
    cubin: bytes
    ptx: str
    symbols: dict[str, str] = field(default_factory=dict)
    log: str = ""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically: temp file in the same directory, fsync, replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


class JitCache:
    """Disk cache rooted at ``root`` with an in-memory dict in front.

    ``get_or_build(key, build)`` returns the entry for ``key``, calling ``build()`` at most once
    across all processes sharing ``root`` (per-key file lock), unless an entry is corrupt.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._memory: dict[str, CacheEntry] = {}
        self._thread_lock = threading.Lock()

    def entry_dir(self, key: str) -> Path:
        return self.root / key[:2] / key

    def lock_path(self, key: str) -> Path:
        return self.root / "locks" / f"{key}.lock"

    def load(self, key: str) -> CacheEntry | None:
        """The entry on disk, or None when it is absent or corrupt (logged under debug)."""
        d = self.entry_dir(key)
        meta_path = d / _META_NAME
        if not meta_path.is_file():
            return None
        try:
            meta = json.loads(meta_path.read_text())
            cubin = (d / _CUBIN_NAME).read_bytes()
            # (bytes decoded as written: UTF-8, no newline translation, so the checksum holds)
            ptx = (d / _PTX_NAME).read_bytes().decode() if (d / _PTX_NAME).is_file() else ""
            ok = (
                meta.get("meta_version") == _META_VERSION
                and cubin.startswith(ELF_MAGIC)
                and len(cubin) == meta["cubin_bytes"]
                and hashlib.sha256(cubin).hexdigest() == meta["cubin_sha256"]
            )
            if not ok:
                debug_log(f"corrupt entry {key[:16]} (cubin checksum/size/magic): rebuilding")
                return None
            # The PTX is what keep_ptx / PTXTRAIN_JIT_DUMP_PTX hand out: check it too.
            if "ptx_sha256" in meta and _sha256_text(ptx) != meta["ptx_sha256"]:
                debug_log(f"corrupt entry {key[:16]} (PTX checksum): rebuilding")
                return None
            return CacheEntry(
                name=meta["name"],
                arch=meta["arch"],
                cubin=cubin,
                ptx=ptx,
                symbols=dict(meta["symbols"]),
                log=meta.get("log", ""),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            debug_log(f"corrupt entry {key[:16]} ({type(exc).__name__}: {exc}): rebuilding")
            return None

    def store(self, key: str, entry: CacheEntry) -> Path:
        """Writes the entry (cubin and PTX first, ``meta.json`` last), each file atomically."""
        d = self.entry_dir(key)
        atomic_write_bytes(d / _CUBIN_NAME, entry.cubin)
        atomic_write_bytes(d / _PTX_NAME, entry.ptx.encode())
        meta = {
            "meta_version": _META_VERSION,
            "name": entry.name,
            "arch": entry.arch,
            "symbols": entry.symbols,
            "log": entry.log,
            "cubin_bytes": len(entry.cubin),
            "cubin_sha256": hashlib.sha256(entry.cubin).hexdigest(),
            "ptx_sha256": _sha256_text(entry.ptx),
        }
        atomic_write_bytes(d / _META_NAME, json.dumps(meta, indent=1).encode())
        return d

    def get_or_build(self, key: str, build: Callable[[], CacheEntry]) -> tuple[CacheEntry, str]:
        """Returns ``(entry, how)`` with ``how`` in ``{"memory", "disk", "compiled"}``."""
        with self._thread_lock:
            hit = self._memory.get(key)
        if hit is not None:
            debug_log(f"memory hit {hit.name} key={key[:16]}")
            return hit, "memory"
        with _file_lock(self.lock_path(key)):
            entry = self.load(key)
            how = "disk"
            if entry is None:
                debug_log(f"compile key={key[:16]} (miss)")
                entry = build()
                self.store(key, entry)
                how = "compiled"
            else:
                debug_log(f"disk hit {entry.name} key={key[:16]}")
        with self._thread_lock:
            self._memory[key] = entry
        return entry, how


@functools.cache
def _cache_for(root: str) -> JitCache:
    return JitCache(Path(root))


def default_cache() -> JitCache:
    """The process-wide cache for the current ``PTXTRAIN_JIT_CACHE_DIR`` (one per directory)."""
    return _cache_for(str(cache_dir()))


def write_sass(entry_dir: Path, cubin_path: Path) -> Path | None:
    """Disassembles ``cubin_path`` with ``cuobjdump -sass`` into ``kernel.sass`` beside it.

    Returns the path, or None when no cuobjdump is found (PATH, then the Triton wheel's copy).
    """
    tool = find_cuobjdump()
    if tool is None:
        debug_log("PTXTRAIN_JIT_DUMP_SASS: no cuobjdump found, skipped")
        return None
    import subprocess

    res = subprocess.run([tool, "-sass", str(cubin_path)], capture_output=True, text=True)
    if res.returncode != 0:
        debug_log(f"cuobjdump failed ({res.returncode}): {res.stderr.strip()}")
        return None
    out = entry_dir / _SASS_NAME
    atomic_write_bytes(out, res.stdout.encode())
    return out


def find_cuobjdump() -> str | None:
    """Path of a ``cuobjdump`` binary: on PATH, else in the Triton wheel, else None."""
    import importlib.util
    import shutil

    found = shutil.which("cuobjdump")
    if found:
        return found
    spec = importlib.util.find_spec("triton")
    if spec is None or spec.origin is None:
        return None
    cand = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(cand) if cand.is_file() and os.access(cand, os.X_OK) else None
