"""Atomic, verified training checkpoints.

Layout of ``<run_dir>/checkpoint/``::

    model.safetensors       model.state_dict() (parameters and buffers, e.g. router biases)
    optimizer.safetensors   every tensor of optimizer.state_dict(), under flattened string keys
    optimizer.json          the rest of optimizer.state_dict() (param groups, ints, floats), with
                            {"__tensor__": key} where a tensor was
    meta.json               {"body": {format, step, config, rng, extra, files: {name: sha256}},
                             "sha256": sha256 of the canonical JSON of body}

Writing is crash-safe: everything goes into a fresh ``.checkpoint.tmp-*`` folder next to
``checkpoint/`` and is fsync'ed, ``meta.json`` last; then the old ``checkpoint/`` is renamed to
``checkpoint.prev/``, the temp folder to ``checkpoint/`` (``os.replace``, atomic on POSIX), the
parent folder is fsync'ed, and only then is ``checkpoint.prev/`` removed. A crash at any point
leaves a complete checkpoint: ``checkpoint/``, or ``checkpoint.prev/`` in the window between the
two renames, which the loader falls back to. Temp folders of crashed writes are ignored and
cleaned up by the next save.

Sharded models (expert or pipeline parallelism) save and load the full layout: the caller
gathers the shards (expert slices, pipeline stages) and passes the full state dicts
(``model_state`` / ``optimizer_state``) to the rank that writes, and every rank loads through a
``state_transform`` that keeps its own slice (its experts, its stages' optimizer state).

Loading verifies before it touches the model: meta.json parses and matches its own hash, every
listed file exists and matches its sha256, the saved config equals the expected one, and the
state dicts load strictly. Any failure raises ``CheckpointError`` naming the file and the fault,
never a silent restart.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

FORMAT_VERSION = 1
CHECKPOINT_DIR = "checkpoint"
PREV_DIR = "checkpoint.prev"
TMP_PREFIX = ".checkpoint.tmp-"
MODEL_FILE = "model.safetensors"
OPTIM_TENSORS_FILE = "optimizer.safetensors"
OPTIM_JSON_FILE = "optimizer.json"
META_FILE = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, corrupt, or does not belong to the run being resumed."""


# --------------------------------------------------------------------------------------------
# Small file helpers
# --------------------------------------------------------------------------------------------


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


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


# --------------------------------------------------------------------------------------------
# Nested state <-> (tensors, JSON)
# --------------------------------------------------------------------------------------------


def flatten_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """Split a nested state (dicts, lists, tuples, tensors, scalars) into JSON and tensors.

    Tensors move into ``tensors`` under dotted path keys and are replaced by
    ``{"__tensor__": key}``; dicts become ``{"__dict__": [[key, value], ...]}`` so non-string
    keys (an optimizer's integer param ids) keep their type; tuples become ``{"__tuple__": ...}``.

    Raises:
        TypeError: a value of another type (its path is named).
    """
    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = obj.detach()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise TypeError(f"state key {k!r} at {prefix or '<root>'} must be str or int")
            items.append([k, flatten_state(v, tensors, f"{prefix}.{k}" if prefix else str(k))])
        return {"__dict__": items}
    if isinstance(obj, (list, tuple)):
        vals = [
            flatten_state(v, tensors, f"{prefix}.{i}" if prefix else str(i))
            for i, v in enumerate(obj)
        ]
        return {"__tuple__": vals} if isinstance(obj, tuple) else vals
    if isinstance(obj, torch.dtype):
        return {"__dtype__": str(obj).removeprefix("torch.")}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} at {prefix or '<root>'} in a checkpoint")


def unflatten_state(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of ``flatten_state``.

    Raises:
        KeyError: a ``{"__tensor__": key}`` whose key is not in ``tensors``.
    """
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__dict__" in obj:
            return {k: unflatten_state(v, tensors) for k, v in obj["__dict__"]}
        if "__tuple__" in obj:
            return tuple(unflatten_state(v, tensors) for v in obj["__tuple__"])
        if "__dtype__" in obj:
            return getattr(torch, obj["__dtype__"])
        raise ValueError(f"unknown encoded object with keys {sorted(obj)}")
    if isinstance(obj, list):
        return [unflatten_state(v, tensors) for v in obj]
    return obj


def _safetensors_ready(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """CPU, contiguous, and no two entries sharing storage (safetensors refuses shared memory)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for k, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.numel() > 0:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
                t = t.clone()
            seen.add((t.untyped_storage().data_ptr(), t.storage_offset()))
        out[k] = t
    return out


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
# Save
# --------------------------------------------------------------------------------------------


def save_checkpoint(
    run_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    step: int,
    config: dict,
    extra: dict | None = None,
    model_state: dict[str, torch.Tensor] | None = None,
    optimizer_state: dict | None = None,
) -> Path:
    """Write ``<run_dir>/checkpoint/`` atomically (see the module docstring) and return its path.

    Args:
        run_dir: the run folder (created if missing).
        model: its ``state_dict()`` goes to ``model.safetensors``.
        optimizer: anything with ``state_dict()`` / ``load_state_dict()``.
        step: optimizer steps completed.
        config: JSON-able; compared on load against what the resuming run expects.
        extra: JSON-able bookkeeping returned on load (e.g. tokens seen, best val loss).
        model_state / optimizer_state: state dicts to write instead of ``model.state_dict()`` /
            ``optimizer.state_dict()`` (e.g. expert shards gathered from every rank).

    Raises:
        TypeError: the optimizer state holds a value that cannot be stored.
        OSError: the file system fails; the previous checkpoint is then left intact.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob(TMP_PREFIX + "*"):
        shutil.rmtree(stale, ignore_errors=True)
    final, prev = run_dir / CHECKPOINT_DIR, run_dir / PREV_DIR
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=run_dir))
    try:
        opt_tensors: dict[str, torch.Tensor] = {}
        if optimizer_state is None:
            optimizer_state = optimizer.state_dict()
        if model_state is None:
            model_state = model.state_dict()
        opt_json = flatten_state(optimizer_state, opt_tensors)
        _write_safetensors(tmp / MODEL_FILE, model_state)
        _write_safetensors(tmp / OPTIM_TENSORS_FILE, opt_tensors)
        _write_bytes(tmp / OPTIM_JSON_FILE, _canonical(opt_json))
        files = {
            name: _sha256_file(tmp / name)
            for name in (MODEL_FILE, OPTIM_TENSORS_FILE, OPTIM_JSON_FILE)
        }
        body = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "config": config,
            "rng": capture_rng_state(),
            "extra": extra or {},
            "files": files,
        }
        meta = {"body": body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}
        _write_bytes(tmp / META_FILE, json.dumps(meta, indent=1).encode())
        _fsync_dir(tmp)
        if final.is_dir():
            if prev.exists():
                shutil.rmtree(prev)
            os.replace(final, prev)
            _fsync_dir(run_dir)
        os.replace(tmp, final)
        _fsync_dir(run_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(prev, ignore_errors=True)
    return final


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(_safetensors_ready(tensors), str(path))
    _fsync_file(path)


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


def read_checkpoint_meta(run_dir: str | Path) -> dict:
    """Load and verify the checkpoint of ``run_dir`` without reading tensors into a model.

    Checks that ``meta.json`` parses, matches its own hash and has the expected keys, and that
    every listed file exists and matches its sha256.

    Returns:
        The meta body: ``format``, ``step``, ``config``, ``rng``, ``extra``, ``files`` and
        ``path`` (the checkpoint folder, as a string).

    Raises:
        CheckpointError: missing checkpoint or file, bad JSON, hash mismatch, missing key,
            unknown format version.
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
    missing = [k for k in ("format", "step", "config", "rng", "extra", "files") if k not in body]
    if missing:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} lacks {missing}")
    if body["format"] != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt} has format {body['format']}, this ptxtrain reads {FORMAT_VERSION}"
        )
    for name in (MODEL_FILE, OPTIM_TENSORS_FILE, OPTIM_JSON_FILE):
        if name not in body["files"]:
            raise CheckpointError(f"corrupt checkpoint {ckpt}: {META_FILE} lists no {name}")
        path = ckpt / name
        if not path.is_file():
            raise CheckpointError(f"corrupt checkpoint {ckpt}: {name} is missing")
        if _sha256_file(path) != body["files"][name]:
            raise CheckpointError(
                f"corrupt checkpoint {ckpt}: {name} does not match its recorded sha256 "
                "(truncated or modified)"
            )
    return {**body, "path": str(ckpt)}


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


def load_checkpoint(
    run_dir: str | Path,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    expected_config: dict | None = None,
    restore_rng: bool = True,
    state_transform: Callable[[dict, dict], tuple[dict, dict]] | None = None,
) -> dict:
    """Verify the checkpoint of ``run_dir`` and load it into ``model`` and ``optimizer``.

    Tensors are loaded on the device of the model's first parameter; ``load_state_dict`` is
    strict for the model.

    Args:
        expected_config: when given, must equal the saved ``config`` (after a JSON round trip).
        restore_rng: also restore torch's global RNG state.
        state_transform: ``fn(model_state, optimizer_state) -> (model_state, optimizer_state)``
            applied to the verified state dicts before they are loaded (e.g. keep this rank's
            expert shards); a ``KeyError`` / ``ValueError`` it raises becomes a
            ``CheckpointError``.

    Returns:
        The meta body (see ``read_checkpoint_meta``).

    Raises:
        CheckpointError: everything ``read_checkpoint_meta`` checks, a config mismatch (listing
            each differing key), unreadable tensors, or state dicts that do not fit.
    """
    meta = read_checkpoint_meta(run_dir)
    ckpt = Path(meta["path"])
    if expected_config is not None:
        diffs = config_mismatches(meta["config"], expected_config)
        if diffs:
            raise CheckpointError(
                f"checkpoint {ckpt} was written by a different configuration; differences: "
                + "; ".join(diffs)
            )
    try:
        device = next(model.parameters()).device
    except StopIteration:
        device = torch.device("cpu")
    dev = str(device) if device.type != "cuda" else f"cuda:{device.index or 0}"
    try:
        model_sd = load_file(str(ckpt / MODEL_FILE), device=dev)
        opt_tensors = load_file(str(ckpt / OPTIM_TENSORS_FILE), device=dev)
        opt_json = json.loads((ckpt / OPTIM_JSON_FILE).read_bytes())
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupt checkpoint {ckpt}: cannot read tensors: {e}") from None
    try:
        opt_sd = unflatten_state(opt_json, opt_tensors)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(
            f"corrupt checkpoint {ckpt}: {OPTIM_JSON_FILE} refers to a missing tensor: {e}"
        ) from None
    if state_transform is not None:
        try:
            model_sd, opt_sd = state_transform(model_sd, opt_sd)
        except (KeyError, ValueError, TypeError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt}: state does not fit this model: {_one_line(e)}"
            ) from None
    try:
        model.load_state_dict(model_sd, strict=True)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(
            f"checkpoint {ckpt}: model weights do not fit this model: {_one_line(e)}"
        ) from None
    try:
        optimizer.load_state_dict(opt_sd)
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
