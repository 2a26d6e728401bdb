"""Processes for tests: ranks of a process group, and a fresh Python interpreter.

``run_gloo(fn, world, *args)`` calls ``fn(rank, world, *args)`` in ``world`` spawned processes
joined in one gloo group on CPU; ``run_dist(..., backend="nccl")`` does the same with one GPU per
rank, and ``run_torchrun_like`` gives each rank only torchrun's environment variables (the code
under test creates the group). ``fn`` must be importable (a module-level function). Each rank
runs with one intra-op thread (``OMP_NUM_THREADS=1``): a 2-core machine runs 2 to 8 ranks at
once. A failure on any rank is re-raised here as an ``AssertionError`` carrying that rank's
traceback (the root cause first, a peer's "connection closed" last); a rank that dies without
reporting, or ranks that have not all finished within the timeout (a hang in a collective),
fail the test and the processes are killed.

``run_python(argv)`` runs ``python argv...`` in a fresh interpreter whose ``PYTHONPATH`` starts
with this checkout, so it imports the ptxtrain under test; ``start_python`` starts one without
waiting.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("gloo", "nccl", None)  # None: torchrun's environment, no group


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_nccl(rank: int, world_size: int) -> None:
    """Join an NCCL group (``env://``) with GPU ``rank % device_count`` as this process's device."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl",
        rank=rank,
        world_size=world_size,
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )


def _entry(
    fn: Callable, rank: int, world: int, port: int, results, args: tuple, backend, hard_exit: bool
) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend is None:  # what torchrun gives a rank
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            init_nccl(rank, world)
        elif backend is not None:
            dist.init_process_group(backend, rank=rank, world_size=world)
        fn(rank, world, *args)
        results.put((rank, None))
    except BaseException:  # report everything, assertion failures included, before tearing down
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if hard_exit:
        # Skip the interpreter's teardown (see run_dist's hard_exit), once the result is sent.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_gloo(
    fn: Callable, world: int, *args, timeout: float = 60.0, hard_exit: bool = False
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise on any failure."""
    run_dist(fn, world, *args, timeout=timeout, backend="gloo", hard_exit=hard_exit)


def run_torchrun_like(fn: Callable, world: int, *args, timeout: float = 60.0) -> None:
    """Like :func:`run_gloo`, but each rank gets torchrun's environment variables (RANK,
    LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and no process group: the code under test
    creates it (``ptxtrain.train`` does when none exists)."""
    run_dist(fn, world, *args, timeout=timeout, backend=None)


def run_dist(
    fn: Callable,
    world: int,
    *args,
    timeout: float = 60.0,
    backend: str | None = "gloo",
    hard_exit: bool = False,
) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks of ``backend`` ("gloo" on CPU, "nccl"
    with one GPU per rank, None: torchrun's environment and no group).

    ``hard_exit``: a rank that finished ``fn`` and reported ends with ``os._exit(0)`` instead of
    the interpreter's normal teardown. For workers that ran ``torch.profiler``: torch 2.13's
    teardown after a profiled gloo run aborts ("terminate called without an active exception",
    no Python frame on the stack) now and then (about once in 100 runs on 2 cores), after the
    worker's results are written.

    Raises:
        ValueError: unknown ``backend``.
        AssertionError: a rank raised (its traceback in the message), exited with a nonzero
            status, or the ranks did not all finish within ``timeout`` seconds.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    entry_args = [(fn, r, world, port, results, args, backend, hard_exit) for r in range(world)]
    procs = [ctx.Process(target=_entry, args=a, daemon=True) for a in entry_args]
    env_backup = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children: no oversubscription
    try:
        for p in procs:
            p.start()
    finally:
        if env_backup is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_backup
    errors: dict[int, str] = {}
    done: set[int] = set()
    try:
        _collect(procs, results, errors, done, time.monotonic() + timeout)
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors and len(done) == world else 0.5)
        killed = [p for p in procs if p.is_alive()]
        for p in killed:
            p.kill()
            p.join(timeout=5.0)
    _raise_failures(procs, killed, errors, done, timeout)


def _collect(procs, results, errors: dict[int, str], done: set[int], deadline: float) -> None:
    """Gather ``(rank, traceback or None)`` reports until every rank reported, one failed, a rank
    died silently, or ``deadline`` passed."""
    while len(done) < len(procs) and time.monotonic() < deadline:
        try:
            rank, err = results.get(timeout=0.2)
        except queue.Empty:
            silent = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if any(r not in done for r in silent):
                return  # a rank died without reporting (a crash): its peers may now hang
            continue
        done.add(rank)
        if err is not None:
            errors[rank] = err
            break  # the other ranks may now hang in a collective: stop waiting
    if errors:  # gather the peers' errors for a moment, to report the root cause first
        with contextlib.suppress(queue.Empty):
            while True:
                rank, err = results.get(timeout=1.0)
                if err is not None:
                    errors[rank] = err


def _raise_failures(procs, killed, errors: dict[int, str], done: set[int], timeout: float):
    world = len(procs)
    if errors:
        # A peer's "connection closed" is a consequence; the root cause is another rank's error.
        rank, err = min(errors.items(), key=lambda it: ("Connection closed" in it[1], it[0]))
        raise AssertionError(f"rank {rank} of {world} failed:\n{err}")
    crashed = {r: p.exitcode for r, p in enumerate(procs) if p not in killed and p.exitcode}
    if crashed:
        raise AssertionError(f"ranks of {world} exited with nonzero status (rank: code) {crashed}")
    if len(done) != world:
        missing = sorted(set(range(world)) - done)
        raise AssertionError(f"ranks {missing} of {world} did not finish in {timeout} s")


def run_python(
    argv: list[str], *, env: dict[str, str] | None = None, timeout: float = 120.0, check=False
) -> subprocess.CompletedProcess:
    """Run ``python *argv`` in a fresh interpreter with this checkout first on ``PYTHONPATH``,
    from the checkout's root; stdout and stderr captured as text.

    ``env``: the child's environment (default: this process's), ``PYTHONPATH`` prepended.
    ``check``: raise ``subprocess.CalledProcessError`` on a nonzero exit status.
    """
    return subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO,
        env=_python_env(env), check=check,
    )  # fmt: skip


def start_python(argv: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python *argv`` as :func:`run_python` runs it, without waiting: stdout and stderr
    are pipes (text), the child leads a process group of its own (so that a test can kill it
    and its children), and the caller waits for it (``communicate``)."""
    return subprocess.Popen(
        [sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=REPO, env=_python_env(env), start_new_session=True,
    )  # fmt: skip


def _python_env(env: dict[str, str] | None) -> dict[str, str]:
    """``env`` (default: this process's environment) with this checkout first on PYTHONPATH."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def raised_on_this_rank(cases, run) -> list[bool]:
    """For each ``(call_args, match)`` in ``cases``: whether ``run(*call_args)`` raised a
    :class:`~ptxtrain.train.TrainConfigError` whose message contains ``match`` (False when it
    raised nothing). Run on every rank (a worker of :func:`run_gloo`): each rank reports what
    it saw."""
    from ptxtrain.train import TrainConfigError

    seen = []
    for call_args, match in cases:
        try:
            run(*call_args)
        except TrainConfigError as e:
            seen.append(match in str(e))
        else:
            seen.append(False)
    return seen
