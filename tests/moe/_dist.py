"""Run a function on ``world_size`` spawned processes joined in one process group.

``run_gloo(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in every process (``fn``
must be importable: a module-level function) on CPU with gloo; ``run_dist(..., backend="nccl")``
does the same with one GPU per rank. A failure on any rank is re-raised here with that
rank's traceback; a rank that does not finish within ``timeout`` seconds (a hang in a collective)
fails the test and the processes are killed.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_nccl(rank: int, world_size: int, init_method: str | None = None) -> None:
    """Join an NCCL group with GPU ``rank % device_count`` as this process's device."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        "nccl",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        device_id=torch.device("cuda", torch.cuda.current_device()),
    )


def _entry(
    fn: Callable, rank: int, world_size: int, port: int, results, args: tuple, backend: str
) -> None:
    import torch
    import torch.distributed as dist

    try:
        torch.set_num_threads(1)
        init_method = f"tcp://127.0.0.1:{port}"
        if backend == "nccl":
            init_nccl(rank, world_size, init_method)
        else:
            dist.init_process_group(
                backend, init_method=init_method, rank=rank, world_size=world_size
            )
        fn(rank, world_size, *args)
        results.put((rank, None))
    except BaseException:  # report everything, assertion failures included, before tearing down
        results.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn: Callable, world_size: int, *args, timeout: float = 60.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; raise on any failure."""
    run_dist(fn, world_size, *args, timeout=timeout, backend="gloo")


def run_dist(
    fn: Callable, world_size: int, *args, timeout: float = 60.0, backend: str = "gloo"
) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks of ``backend`` ("gloo" on CPU,
    "nccl" with one GPU per rank); raise on any rank's failure or a rank that hangs."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    env_backup = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the children: no oversubscription
    try:
        procs = [
            ctx.Process(
                target=_entry,
                args=(fn, r, world_size, port, results, args, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
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
        for _ in range(world_size):
            rank, err = results.get(timeout=timeout)
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
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=5.0 if not errors and len(done) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    if errors:
        # A peer's "connection closed" is a consequence; the root cause is another rank's error.
        rank, err = min(errors.items(), key=lambda it: ("Connection closed" in it[1], it[0]))
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{err}")
    if len(done) != world_size:
        missing = sorted(set(range(world_size)) - done)
        raise AssertionError(f"ranks {missing} of {world_size} did not finish in {timeout} s")
