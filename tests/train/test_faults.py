"""A rank that dies or hangs mid-step under ``ptxtrain train --ep 2`` (CPU, gloo): the other rank
exits with status 1 within the collective timeout, with an error naming the collective, the
step and the ranks, and no process is left running; plus the pieces (the test hook's syntax,
the error translation, the bounded teardown, the flag).

The multi-process cases start real ``python -m ptxtrain train`` processes: two with torchrun's
environment variables (so that each side can be watched), and one run under torchrun itself,
whose launcher ends the hung rank once the other has failed.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ptxtrain.cli import main
from ptxtrain.train import TrainArgs, TrainConfigError, faults
from ptxtrain.train import strategy as strategy_mod
from tests._spawn import _free_port, start_python

# Long enough for two ranks on two busy cores to get through their setup collectives (the model
# build takes well under a second), short to keep the hang cases fast.
TIMEOUT_S = 4.0
STEP = 2  # the injected step: one full step first, so every collective has run once
MARKER = "PTXTRAIN_FAULTS_TEST"  # in the environment of every process a test starts
TRAIN = ["-m", "ptxtrain", "train", "--ep", "2", "--steps", "4", "--batch-size", "2",
         "--seq-len", "16", "--device", "cpu", "--overwrite", "--eval-every", "0",
         "--sample-tokens", "0", "--no-checkpoint", "--no-progress", "--log-every", "1",
         "--collective-timeout", f"{TIMEOUT_S:g}"]  # fmt: skip
GRADS = "all_reduce of the replicated parameters' gradients"


def _env(marker: str, inject: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "PTXTRAIN"))}
    env.update(OMP_NUM_THREADS="1", **{MARKER: marker, faults.INJECT_ENV: inject}, **extra)
    return env


def _marked(marker: str) -> list[int]:
    """Pids of the live processes whose environment holds ``MARKER=marker``."""
    needle = f"{MARKER}={marker}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                environ = (proc / "environ").read_bytes()
                state = (proc / "stat").read_text().split(") ")[-1][:1]
            except OSError:  # gone meanwhile, or not ours
                continue
            if needle in environ.split(b"\0") and state != "Z":
                pids.append(int(proc.name))
    return pids


def _kill_marked(marker: str) -> None:
    for pid in _marked(marker):
        with contextlib.suppress(ProcessLookupError):  # ended meanwhile
            os.kill(pid, signal.SIGKILL)


def _start_ranks(tmp_path, inject: str):
    """Two ranks of ``ptxtrain train --ep 2`` with torchrun's variables and the hook set."""
    marker, port = uuid.uuid4().hex, str(_free_port())
    torchrun = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    ranks = [
        start_python(
            [*TRAIN, "--out", str(tmp_path / "run")],
            env=_env(marker, inject, RANK=str(r), LOCAL_RANK=str(r), **torchrun),
        )
        for r in range(2)
    ]
    return marker, ranks


def _waited(err: str) -> float:
    """The seconds the error says its rank waited in the collective."""
    found = re.search(r"failed after ([0-9.]+) s", err)
    assert found, err
    return float(found[1])


@pytest.mark.parametrize("dead", [1, 0])
def test_a_rank_that_exits_mid_step_fails_its_peer_at_once(tmp_path, dead):
    # Rank `dead` exits (status 1, no teardown) after its backward in step 2; the other rank
    # notices in the gradient all-reduce without waiting for the timeout, names it, and says
    # where the dead rank was last (rank 0 hosts the store without torchrun: when it dies the
    # survivor says that the store is gone instead).
    live = 1 - dead
    marker, ranks = _start_ranks(tmp_path, f"rank={dead},step={STEP},mode=exit")
    try:
        outs = [p.communicate(timeout=90) for p in ranks]
    finally:
        _kill_marked(marker)
    codes = [p.returncode for p in ranks]
    err = outs[live][1]
    assert codes == [1, 1], (codes, outs)
    assert f"rank {dead} exits in step {STEP}" in outs[dead][1]
    assert f"ptxtrain: error: rank {live} of 2: {GRADS} in step {STEP} failed after" in err
    assert "Connection reset by peer" in err or "Connection closed" in err, err
    if dead == 1:
        assert "Rank 1 has not reached it (last seen in step 2: forward and backward" in err
    else:
        assert "the store is unreachable" in err, err
    assert _waited(err) < TIMEOUT_S  # a dead peer is seen at once, not after the timeout
    assert "Traceback" not in err  # one error line, not a traceback
    assert _marked(marker) == []


def test_a_rank_that_hangs_mid_step_fails_its_peer_after_the_timeout(tmp_path):
    marker, (rank0, rank1) = _start_ranks(tmp_path, f"rank=1,step={STEP},mode=hang")
    try:
        _, err = rank0.communicate(timeout=90)
        # The hung rank is still there (torchrun's launcher ends it now; see the next test).
        assert rank1.poll() is None
        os.killpg(rank1.pid, signal.SIGTERM)
        _, err1 = rank1.communicate(timeout=30)
    finally:
        _kill_marked(marker)
    assert rank0.returncode == 1, err
    assert f"rank 1 hangs in step {STEP}" in err1
    assert f"ptxtrain: error: rank 0 of 2: {GRADS} in step {STEP} failed after" in err
    assert f"(--collective-timeout {TIMEOUT_S:g} s): Timed out waiting" in err, err
    assert "Rank 1 has not reached it (last seen in step 2: forward and backward" in err
    # gloo bounds the wait by the group's timeout; 3 s of slack for a busy machine.
    assert TIMEOUT_S - 0.5 <= _waited(err) <= TIMEOUT_S + 3, err
    assert _marked(marker) == []


def test_under_torchrun_a_hung_rank_is_ended_and_no_process_is_left(tmp_path):
    marker = uuid.uuid4().hex
    argv = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
            str(_free_port()), *TRAIN, "--out", str(tmp_path / "run")]  # fmt: skip
    start = time.monotonic()
    launcher = start_python(argv, env=_env(marker, f"rank=1,step={STEP},mode=hang"))
    try:
        out, err = launcher.communicate(timeout=120)
    finally:
        _kill_marked(marker)
    wall = time.monotonic() - start
    text = out + err
    assert launcher.returncode == 1, text
    assert f"ptxtrain: error: rank 0 of 2: {GRADS} in step {STEP} failed after" in text, text
    assert "Rank 1 has not reached it" in text  # the store is torchrun's: it outlives rank 0
    # The hung rank was ended by the launcher once rank 0 had failed: nothing is left.
    assert _marked(marker) == []
    # torchrun's start (about 3 s here), the setup and one timeout, with slack for a busy machine
    assert wall < TIMEOUT_S + 45, wall


# ---- the pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, want",
    [
        ("rank=1,step=3,mode=exit", faults.FaultInjection(1, 3, "exit")),
        (" mode = hang , rank=0,step=1 ", faults.FaultInjection(0, 1, "hang")),
    ],
)
def test_fault_injection_syntax(text, want):
    assert faults.FaultInjection.parse(text) == want


@pytest.mark.parametrize(
    "text",
    ["rank=1,step=3", "rank=1,step=3,mode=crash", "rank=-1,step=3,mode=exit",
     "rank=1,step=0,mode=exit", "rank=1,step=x,mode=exit", "rank=1,rank=2,step=3,mode=exit",
     "rank=1,step=3,mode=exit,when=now", "rank 1"],
)  # fmt: skip
def test_fault_injection_rejects_malformed_text(text):
    with pytest.raises(ValueError, match=r"PTXTRAIN_FAULT_INJECT must be 'rank=R,step=S,mode="):
        faults.FaultInjection.parse(text)


def test_fault_injection_fires_only_on_its_rank_and_step(monkeypatch):
    exits = []
    monkeypatch.setattr(faults.os, "_exit", exits.append)
    hook = faults.FaultInjection(1, 3, "exit")
    for rank, step in ((0, 3), (1, 2), (1, 4)):
        hook.fire(rank, step)
    assert exits == []
    hook.fire(1, 3)
    assert exits == [1]


class _Store:
    """The part of a torch.distributed Store the watch uses, in memory (one for all ranks)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        return self.data[key]

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        pass


def _watches(world: int, store) -> list[faults.CollectiveWatch]:
    """The watches of ``world`` ranks of one run (their store keys agree)."""
    watches = [faults.CollectiveWatch(r, world, TIMEOUT_S, store) for r in range(world)]
    for w in watches[1:]:
        w._prefix = watches[0]._prefix
    return watches


def test_a_gloo_error_in_a_phase_names_the_collective_the_step_and_the_ranks(monkeypatch):
    monkeypatch.setattr(faults, "_failed", threading.Event())  # this process's flag, restored
    store = _Store()
    w0, w1, w2, w3 = _watches(4, store)
    for w in (w0, w1, w2, w3):
        w.begin_step(5)
    with w2.phase("forward"):
        pass
    with pytest.raises(ValueError, match="shapes differ"), w1.phase("forward"):
        raise ValueError("shapes differ")  # not a collective failure: passes through, shared
    with w0.phase("forward"):
        pass
    gloo = RuntimeError(
        "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
        "[127.0.0.1]:36747: Connection reset by peer. This is typically caused by ..."
    )
    with pytest.raises(faults.CollectiveError) as info, w0.phase("all_reduce of X"):
        raise gloo
    e = info.value
    assert (e.rank, e.world, e.step, e.collective) == (0, 4, 5, "all_reduce of X")
    assert e.__cause__ is gloo and faults.collective_failed()
    assert str(e) == (
        f"rank 0 of 4: all_reduce of X in step 5 failed after {e.elapsed_s:.1f} s "
        f"(--collective-timeout {TIMEOUT_S:g} s): Read error [127.0.0.1]:36747: Connection "
        "reset by peer. This is typically caused by .... Rank 1 failed in step 5 (ValueError: "
        "shapes differ); rank 2 has not reached it (last seen in step 5: forward); ranks [3] "
        "reported nothing"
    )
    # Every other rank at the same point: said so. Without a store: this rank's part only.
    for w in (w1, w2, w3):
        w._seq = 0
        with w.phase("forward"):
            pass
        w._seq = 1
        with w.phase("all_reduce of X"):
            pass
    with pytest.raises(faults.CollectiveError, match=r"Every other rank reached it too$"):
        w0._seq = 1
        with w0.phase("all_reduce of X"):
            raise RuntimeError("Timed out waiting 4000ms for recv operation to complete")
    alone = faults.CollectiveWatch(2, 4, TIMEOUT_S)
    with pytest.raises(faults.CollectiveError, match=r"complete$"), alone.phase("recv"):
        raise RuntimeError("Timed out waiting 4000ms for recv operation to complete")
    # One process: no bookkeeping, errors unchanged.
    with (
        pytest.raises(RuntimeError, match=r"^Timed out"),
        faults.CollectiveWatch(0, 1, 1).phase("x"),
    ):
        raise RuntimeError("Timed out")


@pytest.mark.parametrize(
    "exc, want",
    [
        (RuntimeError("Timed out waiting 4000ms for recv operation to complete"), True),
        (RuntimeError("[gloo/pair.cc:537] Read error: Connection reset by peer"), True),
        (
            RuntimeError(
                "Buffer.dispatch: the all_to_all_single on rank 1 did not complete within "
                "timeout_s=4 s: a rank failed, hangs, ..."
            ),
            True,
        ),
        (dist.DistBackendError("NCCL communicator was aborted"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (torch.OutOfMemoryError("CUDA out of memory (NCCL buffers)"), False),
        (ValueError("Connection reset by peer"), False),
    ],
)
def test_which_errors_are_collective_failures(exc, want):
    assert faults.is_collective_failure(exc) is want


def test_destroy_is_bounded_and_aborts_after_a_failure(monkeypatch):
    release, calls = threading.Event(), []
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda *a: "nccl")
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.append("destroy"))
    from torch.distributed import distributed_c10d

    monkeypatch.setattr(distributed_c10d, "_abort_process_group", lambda: calls.append("abort"))
    assert faults.destroy_process_group(5.0) is True
    assert faults.destroy_process_group(5.0, failed=True) is True
    assert calls == ["destroy", "abort"]
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))
    start = time.monotonic()
    try:
        assert faults.destroy_process_group(0.3) is False  # still blocked: the caller exits
        assert time.monotonic() - start < 5  # bounded (0.3 s asked; slack for a busy machine)
    finally:
        release.set()


def test_a_teardown_that_does_not_return_ends_the_process(monkeypatch, capsys):
    ended = []
    monkeypatch.setattr(faults, "destroy_process_group", lambda timeout_s, failed: False)
    monkeypatch.setattr(strategy_mod.os, "_exit", ended.append)
    strategy_mod.destroy_default_group(2.0)
    assert ended == [1]
    assert "destroy_process_group did not return within 2 s" in capsys.readouterr().err
    monkeypatch.setattr(faults, "destroy_process_group", lambda timeout_s, failed: True)
    strategy_mod.destroy_default_group(2.0)
    assert ended == [1]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_collective_timeout_must_be_positive_seconds(tmp_path, bad):
    with pytest.raises(TrainConfigError, match="--collective-timeout must be a finite number"):
        TrainArgs(collective_timeout=bad, out=str(tmp_path)).validate()


def test_collective_timeout_flag(capsys):
    from ptxtrain.cli import _train_args_from, build_parser

    parse = build_parser().parse_args
    assert (
        _train_args_from(parse(["train", "--collective-timeout", "7.5"])).collective_timeout == 7.5
    )
    assert _train_args_from(parse(["train"])).collective_timeout == faults.DEFAULT_TIMEOUT_S == 600
    assert main(["train", "--collective-timeout", "0"]) == 2
    assert "--collective-timeout: must be > 0" in capsys.readouterr().err


def _worker_side_groups_take_the_timeout(rank: int, world: int) -> None:
    from ptxtrain.parallel.p2p import group_timeout
    from ptxtrain.train.checkpoint import checkpoint_group

    timeout = datetime.timedelta(seconds=7)
    dist.init_process_group("gloo", timeout=timeout)
    try:
        assert group_timeout() == timeout  # what the others are compared with
        # The checkpoint's own gloo group (saves, async writes) waits on a peer as long as a
        # training collective does, not gloo's 30 min default.
        assert group_timeout(checkpoint_group()) == timeout
    finally:
        dist.destroy_process_group()


def test_side_groups_take_the_collective_timeout():
    from tests._spawn import run_torchrun_like

    run_torchrun_like(_worker_side_groups_take_the_timeout, 2, timeout=60)
