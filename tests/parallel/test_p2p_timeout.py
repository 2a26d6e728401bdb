"""A rank that fails mid-step but stays alive must not hang its neighbours past the timeout.

On the default group the schedules send over per-direction groups (``directional_groups``);
those must inherit ``init_process_group``'s timeout rather than ``new_group``'s 30 min default,
and a wait that runs past it must raise an error naming the operation and the peer.
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from ptxtrain.parallel import OneFOneB
from tests._spawn import run_torchrun_like
from tests.parallel.test_schedules import make_batch, make_stage

# The default group's timeout. Long enough for 2 spawned ranks on 2 busy cores to get through
# the argument check and the connect exchange (well under 1 s measured), short to keep this fast.
TIMEOUT_S = 4.0
N_CHUNKS = 4


def _failing_criterion(*args):
    raise RuntimeError("criterion failed (simulated)")


def worker_stuck_peer(rank: int, world: int, flag_dir) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        _stuck_peer(rank, world, flag_dir)
    finally:
        dist.destroy_process_group()


def _stuck_peer(rank: int, world: int, flag_dir) -> None:
    last = rank == world - 1
    x, y = make_batch(0, N_CHUNKS)
    pipe = OneFOneB(make_stage(rank))  # default group: per-direction groups, made at step
    if last:
        with pytest.raises(RuntimeError, match="simulated"):
            pipe.step(num_chunks=N_CHUNKS, criterion=_failing_criterion, labels=(y,))
        # Stay alive, as a rank stuck elsewhere would, until the others have given up (or 20 s).
        deadline = time.monotonic() + 20
        while len(list(flag_dir.glob("done*"))) < world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    start = time.monotonic()
    try:
        # Rank r waits for the input gradients of rank r+1, which never come.
        with pytest.raises(
            RuntimeError,
            match=rf"pipeline P2P: rank {rank} could not receive from rank {rank + 1} "
            r"\(input gradients of direction 0",
        ):
            pipe.step(*((x,) if rank == 0 else ()), num_chunks=N_CHUNKS)
        elapsed = time.monotonic() - start
    finally:
        (flag_dir / f"done{rank}").write_text("")
    # Gives up after about one timeout (rank 0 may wait for rank 1's own timeout first, or see
    # rank 1 leave); 3x leaves room for a slow spawn, and is far below the 20 s the stuck rank
    # stays alive, which is what an unbounded wait would take.
    assert elapsed < 3 * TIMEOUT_S, f"rank {rank} waited {elapsed:.1f} s"


def test_neighbours_of_a_stuck_rank_time_out_naming_the_receive(tmp_path):
    run_torchrun_like(worker_stuck_peer, 2, tmp_path, timeout=60)
