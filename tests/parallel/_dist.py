"""Spawn a CPU gloo process group for a test and fail (not hang) if it does not finish in time."""

from __future__ import annotations

import os
import socket
import sys
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args, hard_exit: bool = False) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()
    if hard_exit:
        # Skip the interpreter's teardown (see run_gloo's hard_exit).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _entry_env(rank: int, world: int, port: int, fn, args) -> None:
    # What torchrun gives a rank: the environment, no process group yet.
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )  # fmt: skip
    fn(rank, world, *args)


def run_torchrun_like(fn, world: int, *args, timeout_s: float = 60.0) -> None:
    """Like :func:`run_gloo`, but each rank gets torchrun's environment variables and no process
    group: the code under test creates it (``ptxtrain.train`` does when none exists)."""
    args = (world, _free_port(), fn, args)
    ctx = mp.start_processes(_entry_env, args=args, nprocs=world, join=False, start_method="spawn")
    _join(ctx, world, timeout_s)


def run_gloo(fn, world: int, *args, timeout_s: float = 60.0, hard_exit: bool = False) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned gloo ranks; re-raise a rank's error.

    Raises ``TimeoutError`` (after killing the ranks) when they have not all finished within
    ``timeout_s``, which is how a hang in a schedule fails a test.

    ``hard_exit``: a rank that finished ``fn`` and left the group ends with ``os._exit(0)``
    instead of the interpreter's normal teardown. For workers that ran ``torch.profiler``:
    torch 2.13's teardown after a profiled gloo run aborts ("terminate called without an active
    exception", no Python frame on the stack) now and then (about once in 100 runs on 2 cores),
    after the worker's results are written. An error raised by ``fn`` still propagates.
    """
    ctx = mp.start_processes(
        _entry, args=(world, _free_port(), fn, args, hard_exit), nprocs=world, join=False,
        start_method="spawn",
    )  # fmt: skip
    _join(ctx, world, timeout_s)


def _join(ctx, world: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=0.2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"gloo group of {world} ranks did not finish in {timeout_s} s")


def raised_on_this_rank(cases, run) -> list[bool]:
    """For each ``(call_args, match)`` in ``cases``: whether ``run(*call_args)`` raised a
    :class:`~ptxtrain.train.TrainConfigError` whose message contains ``match`` (False when it
    raised nothing). Run on every rank: each rank reports what it saw."""
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
