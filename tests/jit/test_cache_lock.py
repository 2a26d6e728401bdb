"""The JIT cache's per-key file lock across processes, with a fake compile (no NVRTC needed).

What torchrun's ranks rely on: N processes asking for one key at once compile it once (the
others wait on ``<cache>/locks/<key>.lock`` and load the stored entry), all get the same bytes,
a reader never sees a half-written entry, different keys do not wait for each other, a failed
compile releases the lock, and ranks prewarming the same job list through
``ptxtrain.nn.prewarm.start`` compile every job exactly once between them.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import time
import traceback
from pathlib import Path

import pytest

from ptxtrain.jit.cache import ELF_MAGIC, CacheEntry, JitCache
from ptxtrain.nn import prewarm

CTX = mp.get_context("fork")  # the children inherit the fakes below
JOIN_S = 60  # a child that has not finished by then is stuck on a lock: the test fails


def _key(text: str) -> str:
    return hashlib.sha256(f"{text}-{os.urandom(8).hex()}".encode()).hexdigest()


def _fake_build(log: Path, nbytes: int, delay_s: float, fail_first: bool = False):
    """A compile that takes ``delay_s``, logs one line per call and returns a cubin unique to
    the calling process (so that equal bytes everywhere prove one compile was shared). With
    ``fail_first`` the first call of all processes raises."""

    def build() -> CacheEntry:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        if fail_first and len(log.read_text().splitlines()) == 1:
            raise RuntimeError("compile failed (simulated)")
        time.sleep(delay_s)
        body = os.urandom(nbytes)
        return CacheEntry(name="fake", arch="sm_90a", cubin=ELF_MAGIC + body, ptx=body.hex()[:64])

    return build


def _racer(root, key, log, nbytes, delay_s, fail_first, barrier, results) -> None:
    try:
        barrier.wait(timeout=30)
        entry, how = JitCache(Path(root)).get_or_build(
            key, _fake_build(Path(log), nbytes, delay_s, fail_first)
        )
        results.put((how, hashlib.sha256(entry.cubin).hexdigest()))
    except BaseException as e:  # reported to the test, which checks what failed
        results.put(("error", f"{type(e).__name__}: {e}"))


def _reader(root, key, stop, results) -> None:
    """Loads the entry in a loop while the racers write it: every hit is reported."""
    cache, seen = JitCache(Path(root)), set()
    while not stop.is_set():
        entry = cache.load(key)
        if entry is not None:
            seen.add(hashlib.sha256(entry.cubin).hexdigest())
    results.put(("reader", sorted(seen)))


def _start(target, *args) -> mp.Process:
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def _join(procs) -> None:
    for p in procs:
        p.join(timeout=JOIN_S)
    stuck = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not stuck, f"processes {stuck} did not finish in {JOIN_S} s (a lock never released)"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def _race(tmp_path, n: int, *, nbytes=1 << 20, delay_s=0.3, fail_first=False, reader=False):
    root, log, key = tmp_path / "cache", tmp_path / "compiles.log", _key("race")
    barrier, results, stop = CTX.Barrier(n), CTX.Queue(), CTX.Event()
    racers = [
        _start(_racer, str(root), key, str(log), nbytes, delay_s, fail_first, barrier, results)
        for _ in range(n)
    ]
    watcher = _start(_reader, str(root), key, stop, results) if reader else None
    _join(racers)
    stop.set()
    if watcher is not None:
        _join([watcher])
    got = [results.get(timeout=10) for _ in range(n + bool(reader))]
    return root, key, log.read_text().splitlines(), got


def test_racing_processes_compile_a_key_once_and_share_its_bytes(tmp_path):
    # 6 processes (more than the 2 cores: some start late, when the entry may already exist)
    # and a 1 MiB cubin, so that a non-atomic write would be seen half-done by the reader.
    n = 6
    root, key, compiles, got = _race(tmp_path, n, reader=True)
    assert len(compiles) == 1, compiles  # one compile between all processes
    racers = [g for g in got if g[0] != "reader"]
    hows = sorted(how for how, _ in racers)
    assert hows == ["compiled"] + ["disk"] * (n - 1), got
    digests = {d for _, d in racers}
    assert len(digests) == 1  # each compile's bytes are unique: all loaded the one compile
    (seen,) = [g[1] for g in got if g[0] == "reader"]
    assert set(seen) <= digests, "the reader loaded bytes no racer got (a torn entry)"
    entry_dir = JitCache(root).entry_dir(key)
    assert sorted(p.name for p in entry_dir.iterdir()) == [
        "kernel.cubin",
        "kernel.ptx",
        "meta.json",
    ]
    assert (JitCache(root).lock_path(key)).is_file()  # the lock is the key's own file


def test_a_failed_compile_releases_the_lock_for_the_next_process(tmp_path):
    n = 3
    _, _, compiles, got = _race(tmp_path, n, nbytes=4096, delay_s=0.05, fail_first=True)
    assert len(compiles) == 2, compiles  # the failed attempt, then one good compile
    assert sorted(how for how, _ in got) == ["compiled", "disk", "error"], got
    assert [d for how, d in got if how == "error"] == ["RuntimeError: compile failed (simulated)"]


def _meet(root, key, mine, theirs, results) -> None:
    """Builds ``key``; the build finishes only once the other process's build has started."""

    def build() -> CacheEntry:
        mine.set()
        if not theirs.wait(timeout=20):
            raise TimeoutError("the other key's compile never started: keys share a lock")
        return CacheEntry(name="fake", arch="sm_90a", cubin=ELF_MAGIC + os.urandom(64), ptx="")

    try:
        results.put(JitCache(Path(root)).get_or_build(key, build)[1])
    except BaseException:
        results.put(traceback.format_exc())


def test_different_keys_compile_at_the_same_time(tmp_path):
    # Each build waits for the other to start: with one lock for all keys this deadlocks (and
    # the builds raise after 20 s); with per-key locks both compile at once.
    root, results = str(tmp_path / "cache"), CTX.Queue()
    a, b = CTX.Event(), CTX.Event()
    procs = [
        _start(_meet, root, _key("a"), a, b, results),
        _start(_meet, root, _key("b"), b, a, results),
    ]
    _join(procs)
    assert [results.get(timeout=10) for _ in procs] == ["compiled", "compiled"]


def _prewarm_rank(root, log, jobs, rank, ranks, barrier, results) -> None:
    """One node-local rank: ``prewarm.start`` over ``jobs`` with a fake job runner that goes
    through the cache (one key per job), as the real compiles do."""
    cache = JitCache(Path(root))

    def run_job(job) -> None:
        cache.get_or_build(_job_key(job), _fake_build(Path(log), 256, 0.02))

    try:
        prewarm._run_job = run_job  # this child's copy of the module only
        barrier.wait(timeout=30)
        warm = prewarm.start(jobs, max_workers=2, rank=rank, ranks=ranks)
        result = warm.wait(timeout=JOIN_S)
        first = warm.jobs[0][1] if warm.jobs else None
        results.put((rank, result["failed"], first))
    except BaseException:
        results.put((rank, traceback.format_exc(), None))


def _job_key(job) -> str:
    return hashlib.sha256(repr(job).encode()).hexdigest()


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_prewarming_one_job_list_compile_each_job_once(tmp_path, ranks):
    # 4 quantizer jobs and 9 GEMM jobs (stand-ins: start() only looks at the kind), shared by
    # the ranks of a node; each rank starts at another point of each list.
    salt = os.urandom(4).hex()
    jobs = [("quant", (salt, i)) for i in range(4)] + [("gemm", (salt, i)) for i in range(9)]
    root, log = str(tmp_path / "cache"), str(tmp_path / "compiles.log")
    barrier, results = CTX.Barrier(ranks), CTX.Queue()
    procs = [
        _start(_prewarm_rank, root, log, jobs, r, ranks, barrier, results) for r in range(ranks)
    ]
    _join(procs)
    got = sorted(results.get(timeout=10) for _ in procs)
    assert [failed for _, failed, _ in got] == [[]] * ranks, got
    assert len(Path(log).read_text().splitlines()) == len(jobs)  # each job compiled once
    firsts = [first for _, _, first in got]
    assert len(set(firsts)) == ranks  # the ranks start on different quantizers
    cache = JitCache(Path(root))
    assert all(cache.load(_job_key(job)) is not None for job in jobs)


def test_start_orders_quantizers_first_and_rotates_by_rank(monkeypatch):
    ran: queue.SimpleQueue = queue.SimpleQueue()
    monkeypatch.setattr(prewarm, "_run_job", ran.put)
    jobs = [("gemm", 0), ("quant", 0), ("gemm", 1), ("quant", 1), ("gemm", 2), ("gemm", 3)]
    orders = []
    for rank in range(2):
        warm = prewarm.start(jobs, max_workers=1, rank=rank, ranks=2)
        assert warm.wait(timeout=10) == {"jobs": 6, "failed": []}
        orders.append(warm.jobs)
    assert orders[0] == [("quant", 0), ("quant", 1), ("gemm", 0), ("gemm", 1), ("gemm", 2),
                         ("gemm", 3)]  # fmt: skip
    assert orders[1] == [("quant", 1), ("quant", 0), ("gemm", 2), ("gemm", 3), ("gemm", 0),
                         ("gemm", 1)]  # fmt: skip
    assert ran.qsize() == 12
    for bad in (dict(rank=2, ranks=2), dict(rank=0, ranks=0), dict(rank=-1, ranks=1)):
        with pytest.raises(ValueError, match="rank must be in"):
            prewarm.start(jobs, **bad)
