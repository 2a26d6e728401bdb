"""Sharded, atomic, verified training checkpoints (``torch.distributed.checkpoint``, DCP).

Layout of ``<run_dir>/checkpoint/``::

    .metadata              DCP's index: every key's dtype, shape and place in the data files
    __<r>_<i>.distcp       DCP's data files: rank r of the save writes __r_0 ... (WRITE_THREADS)
    meta.json              {"body": {format, step, config, rng, extra, optimizer, files, ranks},
                            "sha256": sha256 of the canonical JSON of body}

The tensors are stored under the layout-independent names of
:class:`~ptxtrain.train.state_layout.StateLayout` (the full model's parameter names, one key per
routed expert and per optimizer state tensor: FP32 masters, BF16 moments, steps), so a
checkpoint written by one process, ``--ep``, ``--pp`` or both loads under any other of them.
Each rank writes the entries it owns, in parallel with the others (DCP's ``FileSystemWriter``;
an entry several ranks hold, such as a replicated weight under ``--ep``, is written once: DCP's
planner deduplicates it), and reads only the entries it holds. ``meta.json``'s body holds
``format`` (2), ``step``, ``config`` (compared on resume), ``rng`` (the lead rank's torch RNG
state), ``extra`` (the caller's bookkeeping), ``optimizer`` (``groups``: each parameter group's
hyper-parameters, ``group_of``: parameter name -> group), ``files`` (``{name: {sha256, bytes}}``
of every other file) and ``ranks`` (processes that wrote it). Format 1 (single safetensors
files, written by earlier ptxtrain versions) is refused with a clear error. Every rank must see
the run folder (one node, or a shared file system).

Writing is crash-safe: the ranks write into a fresh ``.checkpoint.tmp-*`` folder next to
``checkpoint/`` (the lead rank creates it), each fsyncs and hashes its files, and once every
rank is done the lead writes ``meta.json`` and fsyncs it; then the old ``checkpoint/`` is
renamed to ``checkpoint.prev/``, the temp folder to ``checkpoint/`` (``os.replace``, atomic on
POSIX), the parent folder is fsync'ed, and only then is ``checkpoint.prev/`` removed. A crash
(SIGKILL) of any rank at any point leaves a complete checkpoint: ``checkpoint/``, or
``checkpoint.prev/`` in the window between the two renames, which the loader falls back to.
Temp folders of crashed writes are ignored and removed by the next save.

Asynchronous saving (:class:`Checkpointer` with ``async_save``, ``ptxtrain train
--async-ckpt``): the save copies this rank's entries to CPU buffers (pinned on CUDA, kept for
the next save), which is all the training step waits for, then a background thread writes,
hashes and commits them; a second save, :meth:`Checkpointer.wait` and the end of a run wait for
it. The thread's collectives go through a process group of their own (:func:`checkpoint_group`,
gloo), so they cannot interleave with the training step's.

Loading verifies before it touches the model: ``meta.json`` parses and matches its own hash,
the format is known, every listed file exists with its recorded size, the saved config equals
the expected one, ``.metadata`` and the data files match their sha256 (one process: the files
it reads; several: each rank hashes a share, every file once, and a failure is raised on every
rank), and the stored keys and shapes fit the model (missing or unexpected weights, another
expert count). Any failure raises :class:`CheckpointError` naming the file and the fault, never
a silent restart.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..parallel.p2p import group_timeout
from .state_layout import LayoutError, StateLayout

__all__ = [
    "CHECKPOINT_DIR",
    "FORMAT_VERSION",
    "PREV_DIR",
    "CheckpointError",
    "Checkpointer",
    "capture_rng_state",
    "checkpoint_group",
    "config_mismatches",
    "find_checkpoint",
    "load_checkpoint",
    "read_checkpoint_meta",
    "read_checkpoint_state",
    "restore_rng_state",
    "save_checkpoint",
    "write_json_atomic",
]

FORMAT_VERSION = 2
CHECKPOINT_DIR = "checkpoint"
PREV_DIR = "checkpoint.prev"
TMP_PREFIX = ".checkpoint.tmp-"
META_FILE = "meta.json"
DCP_METADATA = ".metadata"  # FileSystemWriter's index file
# Files (and writer threads) per rank: DCP splits a rank's entries over them by size. At least
# 2: with one thread DCP copies CUDA tensors on the writing thread's current CUDA stream, which in
# a thread other than the main one is device 0's; with more it makes blocking copies instead.
WRITE_THREADS = 2
_META_KEYS = ("format", "step", "config", "rng", "extra", "optimizer", "files")


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not belong to the run being resumed."""


# --------------------------------------------------------------------------------------------
# Small file helpers
# --------------------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds (Windows): nothing to sync
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_json_atomic(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` through a temp file and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _quiet_single_process_dcp() -> None:
    """DCP warns at every single-process save and load that it assumes one process: that is
    what a ``no_dist`` call asks for, so the line says nothing here."""
    warnings.filterwarnings(
        "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
    )


# --------------------------------------------------------------------------------------------
# RNG state
# --------------------------------------------------------------------------------------------


def capture_rng_state() -> dict:
    """torch's CPU (and, where present, every CUDA device's) RNG state as base64 strings."""
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def restore_rng_state(state: dict) -> None:
    """Restore what ``capture_rng_state`` returned (CUDA states only where CUDA is present)."""

    def decode(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()

    torch.set_rng_state(decode(state["cpu"]))
    if "cuda" in state and torch.cuda.is_available():
        states = [decode(s) for s in state["cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


# --------------------------------------------------------------------------------------------
# Collectives of a save
# --------------------------------------------------------------------------------------------

_GROUPS: dict[int, tuple[Any, Any]] = {}  # id(default group) -> (default group, its ckpt group)


def checkpoint_group():
    """The gloo process group over every rank that checkpoints use (created at the first call
    after each ``init_process_group``: a collective, every rank must call it), or None without
    an initialized default group.

    Its own group lets a background save's collectives run while the training step uses the
    default group (NCCL or gloo), and gives DCP's object collectives a CPU transport."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    cached = _GROUPS.get(id(world))
    if cached is None or cached[0] is not world:
        # The default group's timeout (--collective-timeout), not gloo's 30 min default: a
        # peer that died mid-save ends the wait as it would a training collective.
        group = dist.new_group(backend="gloo", timeout=group_timeout())
        cached = _GROUPS[id(world)] = (world, group)
    return cached[1]


def _on_ranks(group, fn, *, lead_only: bool = False) -> list:
    """``fn()`` on every rank of ``group`` (rank 0 only with ``lead_only``); returns every rank's
    result (None where it did not run). A failure on any rank raises on every rank: the failed
    rank's own exception there, an ``OSError`` naming it elsewhere. ``group`` None: one process."""
    rank = 0 if group is None else dist.get_rank(group)
    result, err, text = None, None, None
    if rank == 0 or not lead_only:
        try:
            result = fn()
        except Exception as e:  # shared below, then re-raised
            err, text = e, f"{type(e).__name__}: {e}"
    if group is None:
        if err is not None:
            raise err
        return [result]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, (result, text), group=group)
    if err is not None:
        raise err
    for r, (_, failed) in enumerate(every):
        if failed is not None:
            raise OSError(f"checkpoint save failed on rank {r}: {failed}")
    return [res for res, _ in every]


def _fresh_tmp_dir(run_dir: Path) -> str:
    """Remove temp folders of crashed saves and create this save's (the lead rank's part)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=TMP_PREFIX, dir=run_dir)


def _hash_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"sha256", "bytes"}}`` of ``names`` in ``folder`` (hashed in parallel)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), WRITE_THREADS))) as pool:
        digests = list(pool.map(lambda n: _sha256_file(folder / n), names))
    return {
        n: {"sha256": d, "bytes": (folder / n).stat().st_size}
        for n, d in zip(names, digests, strict=True)
    }


def _own_files(folder: Path, rank: int) -> list[str]:
    """The files rank ``rank`` of the save wrote (DCP names them ``__<rank>_<i>.distcp``); the
    lead also owns DCP's index."""
    names = sorted(p.name for p in folder.glob(f"__{rank}_*.distcp"))
    return [*names, DCP_METADATA] if rank == 0 else names


def _commit(run_dir: Path, tmp: Path, body: dict) -> None:
    """Write ``meta.json`` into ``tmp`` and swap ``tmp`` in as ``checkpoint/`` (the lead's part;
    see the module docstring)."""
    meta = {"body": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
    _write_bytes(tmp / META_FILE, json.dumps(meta, indent=1).encode())
    _fsync_dir(tmp)
    final, prev = run_dir / CHECKPOINT_DIR, run_dir / PREV_DIR
    if final.is_dir():
        if prev.exists():
            shutil.rmtree(prev)
        os.replace(final, prev)
        _fsync_dir(run_dir)
    os.replace(tmp, final)
    _fsync_dir(run_dir)
    shutil.rmtree(prev, ignore_errors=True)


def _dcp_failure(e: CheckpointException) -> str:
    """The first rank's error of a DCP ``CheckpointException``, on one line."""
    if not e.failures:
        return _one_line(e)
    rank, (exc, _) = min(e.failures.items(), key=lambda item: item[0])
    return f"rank {rank}: {type(exc).__name__}: {_one_line(exc)}"


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------


@dataclass
class _SaveJob:
    """One save: what to write, and its timing (seconds, for the run summary)."""

    run_dir: Path
    state: dict[str, torch.Tensor]
    body: dict[str, Any]
    groups: dict[str, dict[str, Any]]
    started: float
    record: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None


class Checkpointer:
    """Writes and reads the sharded checkpoints of one run (see the module docstring).

    Args:
        layout: this rank's entries (:class:`~ptxtrain.train.state_layout.StateLayout`).
        group: the process group of the save's collectives (:func:`checkpoint_group`; every
            rank of it saves together); None = one process.
        async_save: write in a background thread after copying the entries to CPU.

    Attributes:
        saves: one record per save of this object: ``step``, ``blocking_s`` (seconds the
            caller waited: the whole save, or with ``async_save`` the copy to CPU plus any wait
            for the write) and ``total_s`` (from the call to the committed checkpoint; None
            while the write runs).
    """

    def __init__(self, layout: StateLayout, *, group=None, async_save: bool = False) -> None:
        self.layout, self.group, self.async_save = layout, group, bool(async_save)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.saves: list[dict[str, Any]] = []
        self._job: _SaveJob | None = None
        self._thread: threading.Thread | None = None
        self._staged: dict[str, torch.Tensor] = {}  # CPU buffers of async saves, reused
        _quiet_single_process_dcp()

    @property
    def writing(self) -> bool:
        """Whether a background write is still running."""
        return self._thread is not None and self._thread.is_alive()

    def save(self, run_dir: str | Path, *, step: int, config: dict, extra: dict | None = None):
        """Write the checkpoint of ``step`` to ``<run_dir>/checkpoint/`` (a collective over
        ``group``: every rank calls it); with ``async_save`` return once the entries are
        copied, the write continuing in the background. Waits for the previous save first.

        Args:
            step: optimizer steps completed.
            config: JSON-able; compared on load against what the resuming run expects.
            extra: JSON-able bookkeeping returned on load (e.g. the data settings).

        Raises:
            OSError: the file system failed on some rank (the previous checkpoint is then left
                intact); from a background write, raised by the next save or :meth:`wait`.
            TypeError: an optimizer state value that is not a tensor.
        """
        self.wait()
        t0 = time.perf_counter()
        state = self.layout.save_state()
        if self.async_save:
            state = self._stage(state)
        body = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "config": config,
            "rng": capture_rng_state(),
            "extra": extra or {},
            "ranks": 1 if self.group is None else dist.get_world_size(self.group),
        }
        record = {"step": int(step), "blocking_s": 0.0, "total_s": None}
        self.saves.append(record)
        job = _SaveJob(Path(run_dir), state, body, self.layout.param_groups(), t0, record)
        if self.async_save:
            self._job = job
            self._thread = threading.Thread(target=self._run, args=(job,), daemon=True)
            self._thread.start()
            record["blocking_s"] = time.perf_counter() - t0
            return
        self._run(job)
        record["blocking_s"] = time.perf_counter() - t0
        if job.error is not None:
            raise job.error

    def wait(self) -> None:
        """Wait for a background write to be committed (its time counts as blocking).

        Raises:
            OSError: the write failed (on this rank or another).
        """
        if self._thread is None:
            return
        t0 = time.perf_counter()
        self._thread.join()
        job = self._job
        job.record["blocking_s"] += time.perf_counter() - t0
        self._thread = self._job = None
        if job.error is not None:
            raise job.error

    @torch.no_grad()
    def _stage(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """CPU copies of ``state`` in buffers kept for the next save (pinned for CUDA tensors,
        copied asynchronously, then one synchronize)."""
        out, cuda = {}, False
        for k, t in state.items():
            buf = self._staged.get(k)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            buf.copy_(t, non_blocking=t.is_cuda)
            cuda |= t.is_cuda
            out[k] = buf
        if cuda:
            torch.cuda.synchronize()
        self._staged = out
        return out

    def _run(self, job: _SaveJob) -> None:
        """Write, hash and commit ``job`` (in the caller, or the background thread)."""
        try:
            self._write(job)
            job.record["total_s"] = time.perf_counter() - job.started
        except BaseException as e:  # kept for the caller (wait() raises it)
            job.error = e

    def _write(self, job: _SaveJob) -> None:
        group = self.group
        tmp = Path(_on_ranks(group, lambda: _fresh_tmp_dir(job.run_dir), lead_only=True)[0])
        try:
            writer = FileSystemWriter(tmp, thread_count=WRITE_THREADS, sync_files=True)
            try:
                dcp.save(
                    job.state, storage_writer=writer, process_group=group, no_dist=group is None
                )
            except CheckpointException as e:
                raise OSError(f"checkpoint save failed: {_dcp_failure(e)}") from None
            parts = _on_ranks(
                group, lambda: (_hash_files(tmp, _own_files(tmp, self.rank)), job.groups)
            )
            files, group_of, groups = {}, {}, []
            for hashes, hyper in parts:
                files.update(hashes)
                for name, h in hyper.items():
                    if h not in groups:
                        groups.append(h)
                    group_of[name] = groups.index(h)
            body = {
                **job.body,
                "files": files,
                "optimizer": {"groups": groups, "group_of": group_of},
            }
            _on_ranks(group, lambda: _commit(job.run_dir, tmp, body), lead_only=True)
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    # ------------------------------------------------------------------ load
    def load(
        self, run_dir: str | Path, *, expected_config: dict | None = None, restore_rng: bool = True
    ) -> dict:
        """Verify the checkpoint of ``run_dir`` and read this rank's entries into the layout's
        model (in place) and optimizer (``load_state_dict``). Needs no collective: each rank
        reads what it holds. With a ``group`` each rank checks the sha256 of its share of the
        files (each file once over the ranks, whichever ranks read it): call it on every rank
        and raise everywhere when any rank fails (``ParallelStrategy.load`` does); alone it
        checks the files it reads.

        Args:
            expected_config: when given, must equal the saved ``config`` (after a JSON round
                trip); the error lists each differing key.
            restore_rng: also restore torch's global RNG state (the lead rank's at the save).

        Returns:
            The meta body (see :func:`read_checkpoint_meta`).

        Raises:
            CheckpointError: everything :func:`read_checkpoint_meta` checks, a config mismatch,
                a data file that does not match its sha256, unreadable tensors, or state that
                does not fit the model or the optimizer.
        """
        meta = read_checkpoint_meta(run_dir, verify_files=False)
        ckpt = Path(meta["path"])
        if expected_config is not None:
            diffs = config_mismatches(meta["config"], expected_config)
            if diffs:
                raise CheckpointError(
                    f"checkpoint {ckpt} was written by a different configuration; differences: "
                    + "; ".join(diffs)
                )
        stored, reader = _read_index(ckpt, meta)
        layout = self.layout
        try:
            model_targets = layout.model_targets(stored)
        except LayoutError as e:
            raise CheckpointError(
                f"checkpoint {ckpt}: model weights do not fit this model: {e}"
            ) from None
        try:
            opt_targets, state = layout.optimizer_targets(stored)
            groups = meta["optimizer"]
            opt_sd = layout.optimizer_state_dict(state, groups["groups"], groups["group_of"])
        except (LayoutError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt}: optimizer state does not fit this optimizer: {e}"
            ) from None
        share = None if self.group is None else (self.rank, dist.get_world_size(self.group))
        _read_tensors(ckpt, meta, reader, {**model_targets, **opt_targets}, share)
        try:
            layout.optimizer.load_state_dict(opt_sd)
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt}: optimizer state does not fit this optimizer: {_one_line(e)}"
            ) from None
        if restore_rng:
            try:
                restore_rng_state(meta["rng"])
            except (KeyError, ValueError, TypeError, RuntimeError) as e:
                raise CheckpointError(f"corrupt checkpoint {ckpt}: bad RNG state: {e}") from None
        return meta


def save_checkpoint(
    run_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    step: int,
    config: dict,
    extra: dict | None = None,
) -> Path:
    """Write the checkpoint of one process's ``model`` and ``optimizer`` to
    ``<run_dir>/checkpoint/`` atomically (see the module docstring) and return its path.

    Raises:
        OSError: the file system fails; the previous checkpoint is then left intact.
        TypeError: an optimizer state value that is not a tensor.
    """
    Checkpointer(StateLayout(model, optimizer)).save(run_dir, step=step, config=config, extra=extra)
    return Path(run_dir) / CHECKPOINT_DIR


def load_checkpoint(
    run_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    expected_config: dict | None = None,
    restore_rng: bool = True,
) -> dict:
    """Verify the checkpoint of ``run_dir`` and load it into one process's ``model`` and
    ``optimizer`` (whatever layout wrote it); see :meth:`Checkpointer.load`.

    Raises:
        CheckpointError: missing, corrupt, another configuration, or state that does not fit.
    """
    checkpointer = Checkpointer(StateLayout(model, optimizer))
    return checkpointer.load(run_dir, expected_config=expected_config, restore_rng=restore_rng)


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------


def find_checkpoint(run_dir: str | Path) -> Path:
    """The checkpoint folder of ``run_dir``: ``checkpoint/``, else ``checkpoint.prev/``.

    Raises:
        CheckpointError: neither exists.
    """
    run_dir = Path(run_dir)
    for name in (CHECKPOINT_DIR, PREV_DIR):
        if (run_dir / name).is_dir():
            return run_dir / name
    raise CheckpointError(
        f"no checkpoint to resume in {run_dir} (expected {run_dir / CHECKPOINT_DIR}/)"
    )


def read_checkpoint_meta(run_dir: str | Path, *, verify_files: bool = True) -> dict:
    """Load and verify the metadata of the checkpoint of ``run_dir`` without reading tensors.

    Checks that ``meta.json`` parses, matches its own hash, has the expected keys and a known
    format, and that every listed file exists with its recorded size; with ``verify_files``
    also that each matches its sha256 (reads every file: the whole training state).

    Returns:
        The meta body: ``format``, ``step``, ``config``, ``rng``, ``extra``, ``optimizer``,
        ``files``, ``ranks`` and ``path`` (the checkpoint folder, as a string).

    Raises:
        CheckpointError: missing checkpoint or file, bad JSON, hash mismatch, missing key,
            another format version, a file of another size or (``verify_files``) content.
    """
    ckpt = find_checkpoint(run_dir)
    meta_path = ckpt / META_FILE
    try:
        meta = json.loads(meta_path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} is missing") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: cannot parse {META_FILE}: {e}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("body"), dict):
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} has no 'body' object")
    body = meta["body"]
    if hashlib.sha256(_canonical(body)).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} does not match its sha256")
    if body.get("format") == 1:
        raise CheckpointError(
            f"checkpoint {ckpt} has format 1 (single safetensors files, written by an earlier "
            f"ptxtrain); this ptxtrain reads the sharded format {FORMAT_VERSION} only: resume it "
            "with the ptxtrain that wrote it, or start a new run"
        )
    missing = [k for k in _META_KEYS if k not in body]
    if missing:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} lacks {missing}")
    if body["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt} has format {body['format']}, this ptxtrain reads {FORMAT_VERSION}"
        )
    if DCP_METADATA not in body["files"]:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} lists no {DCP_METADATA}")
    for name, info in body["files"].items():
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"corrupt checkpoint {ckpt}: {name} is missing")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"corrupt checkpoint {ckpt}: {name} has {size} bytes, {META_FILE} records "
                f"{info['bytes']} (truncated or modified)"
            )
    if verify_files:
        _verify_hashes(ckpt, body["files"], list(body["files"]))
    return {**body, "path": str(ckpt)}


def _verify_hashes(ckpt: Path, files: dict, names) -> None:
    got = _hash_files(ckpt, sorted(names))
    for name in sorted(names):
        if got[name]["sha256"] != files[name]["sha256"]:
            raise CheckpointError(
                f"corrupt checkpoint {ckpt}: {name} does not match its recorded sha256 "
                "(truncated or modified)"
            )


class _IndexedReader(FileSystemReader):
    """A ``FileSystemReader`` that hands DCP the index already read (and verified) here."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.index = super().read_metadata()

    def read_metadata(self, *args: Any, **kwargs: Any):
        return self.index


def _read_index(ckpt: Path, meta: dict) -> tuple[dict, _IndexedReader]:
    """``({key: (shape, dtype)}, reader)`` of a checkpoint whose meta is verified."""
    _verify_hashes(ckpt, meta["files"], [DCP_METADATA])
    try:
        reader = _IndexedReader(ckpt)
    except Exception as e:  # unpickling a bad index can raise anything
        raise CheckpointError(
            f"corrupt checkpoint {ckpt}: cannot read {DCP_METADATA}: {e}"
        ) from None
    stored = {
        k: (md.size, md.properties.dtype)
        for k, md in reader.index.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }
    return stored, reader


def _read_tensors(
    ckpt: Path, meta: dict, reader, targets: dict[str, torch.Tensor], share: tuple[int, int] | None
) -> None:
    """Read ``targets`` (in place) after checking sha256s: of the data files they lie in
    (``share`` None), or of share ``(i, n)`` of all files (the n ranks of a load each check one
    share, so that every file is hashed once; their failures must then be shared)."""
    storage = reader.index.storage_data
    needed = {info.relative_path for i, info in storage.items() if i.fqn in targets}
    files = meta["files"]
    unknown = sorted(n for n in needed if n not in files)
    if unknown:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} does not list {unknown}")
    if share is not None:  # the largest first, dealt round-robin (the index is verified already)
        data = (n for n in files if n != DCP_METADATA)
        needed = sorted(data, key=lambda n: (-files[n]["bytes"], n))[share[0] :: share[1]]
    _verify_hashes(ckpt, files, needed)
    try:
        dcp.load(targets, storage_reader=reader, no_dist=True)
    except Exception as e:
        detail = _dcp_failure(e) if isinstance(e, CheckpointException) else _one_line(e)
        raise CheckpointError(f"corrupt checkpoint {ckpt}: cannot read tensors: {detail}") from None


def read_checkpoint_state(run_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint of ``run_dir`` (CPU, stored dtype) under its
    layout-independent name (:mod:`~ptxtrain.train.state_layout`), every file verified.

    Raises:
        CheckpointError: see :func:`read_checkpoint_meta`.
    """
    meta = read_checkpoint_meta(run_dir, verify_files=False)
    ckpt = Path(meta["path"])
    stored, reader = _read_index(ckpt, meta)
    targets = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in stored.items()}
    _quiet_single_process_dcp()
    _read_tensors(ckpt, meta, reader, targets, share=(0, 1))
    return targets


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _flat_items(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flat_items(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: obj}


def config_mismatches(saved: dict, expected: dict) -> list[str]:
    """``"key: checkpoint X, now Y"`` for each dotted key whose value differs (JSON-normalized)."""
    a = _flat_items(json.loads(json.dumps(saved)))
    b = _flat_items(json.loads(json.dumps(expected)))
    missing = object()
    return [
        f"{k}: checkpoint {a.get(k, '<absent>')!r}, now {b.get(k, '<absent>')!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k, missing) != b.get(k, missing)
    ]
