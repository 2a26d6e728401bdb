"""Faults of a multi-process run (``--ep`` / ``--pp`` under torchrun): bounded waits, errors that
name the collective and the ranks, a bounded teardown, and a test hook that breaks a rank.

Design:

- Every wait for a peer is bounded by ``--collective-timeout`` seconds
  (:data:`DEFAULT_TIMEOUT_S`, as NCCL's own default of 10 min): it is the default process
  group's timeout (``init_process_group(timeout=...)``: gloo enforces it per operation, NCCL's
  watchdog per collective) and the EP buffer's ``timeout_s``. A dead peer is usually noticed at
  once (gloo: "Connection reset by peer"); a hung one after the timeout.
- NCCL: collectives are asynchronous, so a stuck one is noticed by NCCL's watchdog thread, which
  with ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (:func:`nccl_environment`; torchrun sets the same
  for its workers) aborts the communicators and ends the process with a message naming the
  collective and the rank (``[Rank 0] Watchdog caught collective operation timeout:
  WorkNCCL(SeqNum=..., OpType=ALLREDUCE, ...)``); Python's ``faulthandler`` then prints where
  each rank's training thread was.
- gloo raises a ``RuntimeError`` that names neither the collective nor a rank. The step runs its
  collectives inside :meth:`CollectiveWatch.phase` blocks, which turn such an error into a
  :class:`CollectiveError`: this rank, the step, the collective, the timeout, the original
  message, and what the other ranks were doing. For the last, each rank writes its progress
  (step, phase, state) to the process group's key-value store as it enters each phase (a few
  small writes per step), and a rank that fails writes its error there; the rank that reports
  reads the others' (bounded by a short store timeout; under torchrun the store lives in the
  launcher, so it survives any rank).
- The teardown is bounded (:func:`destroy_process_group`): ``dist.destroy_process_group`` (or,
  after a collective failed, an abort of the NCCL communicators) runs on a daemon thread; when it
  has not returned within its bound the process says so and exits without it.
- Test hook :data:`INJECT_ENV` (``PTXTRAIN_FAULT_INJECT='rank=1,step=3,mode=exit'``): the
  given rank of a ``--ep`` / ``--pp`` run exits (``os._exit(1)``, like a crash) or hangs
  (sleeps until killed) in the given step, after its forward and backward and before the
  gradient all-reduce, so that its peers wait for it in a collective.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import itertools
import os
import re
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "INJECT_ENV",
    "CollectiveError",
    "CollectiveWatch",
    "FaultInjection",
    "collective_failed",
    "destroy_process_group",
    "is_collective_failure",
    "nccl_environment",
]

DEFAULT_TIMEOUT_S = 600.0
INJECT_ENV = "PTXTRAIN_FAULT_INJECT"
INJECT_MODES = ("exit", "hang")
# How long the reporting rank waits for the store when it reads its peers' progress.
_STORE_READ_S = 2.0
# The bound on dist.destroy_process_group at the end of a run (at most the collective timeout).
DESTROY_TIMEOUT_S = 30.0
# Messages of a failed or timed-out collective from gloo, NCCL, torch's store and ptxtrain's own
# bounded waits (EP buffer, pipeline P2P); other errors (a bug, an OOM) pass through unchanged.
_COLLECTIVE_MESSAGE = re.compile(
    r"gloo|NCCL|Connection (reset|closed|refused)|Broken pipe|[Tt]imed out|"
    r"did not complete within|pipeline P2P"
)
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
_runs = itertools.count()  # one store namespace per run of this process (train() calls)
_failed = threading.Event()  # a collective failed in this process (destroy_process_group)


def collective_failed() -> bool:
    """Whether a :class:`CollectiveError` was raised in this process."""
    return _failed.is_set()


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed or timed out (a ``torch.distributed.DistError``
    or a ``RuntimeError`` whose message is a communication error's), rather than a fault of this
    rank's own computation."""
    import torch.distributed as dist

    if isinstance(exc, CollectiveError | dist.DistError):
        return True
    return type(exc) is RuntimeError and bool(_COLLECTIVE_MESSAGE.search(str(exc)))


class CollectiveError(RuntimeError):
    """A collective of a multi-process step failed or timed out on this rank.

    Attributes: ``rank`` (this global rank), ``world`` (ranks of the run), ``step``, ``collective``
    (what was running, e.g. ``"all_reduce of the gradient norm"``), ``timeout_s`` (the
    collective timeout), ``elapsed_s`` (seconds this rank waited in it), ``peers`` (what the
    other ranks last reported: a sentence, "" when unknown), ``cause`` (the original message's
    first line).
    """

    def __init__(self, *, rank, world, step, collective, timeout_s, elapsed_s, peers, cause):
        self.rank, self.world, self.step = rank, world, step
        self.collective, self.timeout_s, self.elapsed_s = collective, timeout_s, elapsed_s
        self.peers, self.cause = peers, cause
        text = (
            f"rank {rank} of {world}: {collective} in step {step} failed after {elapsed_s:.1f} s "
            f"(--collective-timeout {timeout_s:g} s): {cause}"
        )
        super().__init__(f"{text}. {peers}" if peers else text)


@dataclass(frozen=True)
class FaultInjection:
    """The test hook :data:`INJECT_ENV`: rank ``rank`` exits or hangs (``mode``) in step
    ``step``, between its backward and its gradient all-reduce."""

    rank: int
    step: int
    mode: str

    @classmethod
    def parse(cls, text: str) -> FaultInjection:
        """``"rank=R,step=S,mode=exit|hang"`` (any order, spaces ignored).

        Raises:
            ValueError: a missing, unknown or repeated key, a rank < 0, a step < 1, or an
                unknown mode; the message quotes the text and the form it needs.
        """
        want = f"{INJECT_ENV} must be 'rank=R,step=S,mode=exit|hang' (R >= 0, S >= 1)"
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, eq, value = (s.strip() for s in part.partition("="))
            if not eq or key not in ("rank", "step", "mode") or key in fields:
                raise ValueError(f"{want}, got {text!r}")
            fields[key] = value
        try:
            rank, step, mode = int(fields["rank"]), int(fields["step"]), fields["mode"]
        except (KeyError, ValueError):
            raise ValueError(f"{want}, got {text!r}") from None
        if rank < 0 or step < 1 or mode not in INJECT_MODES:
            raise ValueError(f"{want}, got {text!r}")
        return cls(rank, step, mode)

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        """The hook set in the environment, or None; raises ``parse``'s ValueError."""
        text = os.environ.get(INJECT_ENV, "").strip()
        return cls.parse(text) if text else None

    def fire(self, rank: int, step: int) -> None:
        """On rank ``rank`` in step ``step``: exit at once (status 1, no teardown, as a crash)
        or sleep until the process is killed. Elsewhere nothing."""
        if (rank, step) != (self.rank, self.step):
            return
        print(f"ptxtrain: {INJECT_ENV}: rank {rank} {self.mode}s in step {step}", file=sys.stderr)
        sys.stderr.flush()
        if self.mode == "exit":
            os._exit(1)
        else:
            while True:  # hang: until torchrun (or the test) kills this process
                time.sleep(3600)


class CollectiveWatch:
    """Names the collective a multi-process step is in, for the errors of its failures.

    ``rank`` / ``world``: this global rank and the run's size; ``timeout_s``: the collective
    timeout; ``store``: the default group's key-value store (None: no progress is shared, the
    errors then name this rank and the collective only); ``inject``: the test hook, if any.
    With ``world == 1`` every method does nothing.
    """

    def __init__(self, rank: int, world: int, timeout_s: float, store=None, inject=None) -> None:
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.store, self.inject = store, inject
        self.step = 0
        self._seq = 0  # phases entered in this step
        self._prefix = f"ptxtrain/progress/{next(_runs)}/"  # the same on every rank

    @classmethod
    def for_default_group(cls, timeout_s: float) -> CollectiveWatch:
        """The watch of the initialized default group (its store when torch exposes it), with
        the hook of :data:`INJECT_ENV` (its ValueError propagates). Enables ``faulthandler``,
        so that a rank ended by NCCL's watchdog prints where its Python threads were."""
        import torch.distributed as dist

        store = None
        with contextlib.suppress(Exception):  # a private helper; without it no peer report
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        if not faulthandler.is_enabled():
            faulthandler.enable()
        inject = FaultInjection.from_env()
        return cls(dist.get_rank(), dist.get_world_size(), timeout_s, store, inject)

    def begin_step(self, step: int) -> None:
        """Start step ``step`` (1-based, as the loop counts)."""
        self.step, self._seq = step, 0

    def fault_point(self) -> None:
        """Where the test hook fires: after the step's backward, before its reductions."""
        if self.inject is not None:
            self.inject.fire(self.rank, self.step)

    @contextlib.contextmanager
    def phase(self, collective: str) -> Iterator[None]:
        """Run the block as ``collective`` of the current step: a collective failure raised in
        it becomes a :class:`CollectiveError` naming this rank, the step, ``collective`` and
        what the other ranks last reported; any other error is published to the peers (so
        that their errors name it) and re-raised unchanged."""
        if self.world == 1:
            yield
            return
        self._seq += 1
        start = time.monotonic()
        try:
            self._publish(f"in|{collective}")
            yield
        except CollectiveError:
            raise
        except Exception as e:
            if not is_collective_failure(e):
                with contextlib.suppress(Exception):  # the error itself matters more
                    self._publish(f"failed|{type(e).__name__}: {_first_line(e)}")
                raise
            _failed.set()
            raise CollectiveError(
                rank=self.rank,
                world=self.world,
                step=self.step,
                collective=collective,
                timeout_s=self.timeout_s,
                elapsed_s=time.monotonic() - start,
                peers=self.peers_report(),
                cause=_first_line(e),
            ) from e

    def _publish(self, state: str) -> None:
        if self.store is not None:
            self.store.set(f"{self._prefix}{self.rank}", f"{self.step}|{self._seq}|{state}")

    def peers_report(self) -> str:
        """A sentence on the other ranks: which failed (their error), which had not reached this
        rank's phase (where they were last), which reported nothing; from the store, "" when
        there is none."""
        import torch.distributed as dist

        if self.store is None:
            return ""
        with contextlib.suppress(Exception):
            self.store.set_timeout(datetime.timedelta(seconds=_STORE_READ_S))
        failed, behind, silent = [], [], []
        for r in (q for q in range(self.world) if q != self.rank):
            key = f"{self._prefix}{r}"
            try:
                if not self.store.check([key]):  # (get would wait for it)
                    silent.append(r)
                    continue
                got = self.store.get(key).decode()
            except dist.DistNetworkError as e:  # the store's host is gone: stop asking
                return (
                    f"The other ranks' progress is unknown: the store is unreachable "
                    f"({_first_line(e)}); its host (rank 0's process when torchrun does not "
                    "host it) is gone"
                )
            except Exception:  # a store error for this key only
                silent.append(r)
                continue
            step, seq, state, what = [*got.split("|", 3), "", "", ""][:4]
            if state == "failed":
                failed.append(f"rank {r} failed in step {step} ({what})")
            elif _position(step, seq) < (self.step, self._seq):
                behind.append(f"rank {r} has not reached it (last seen in step {step}: {what})")
        parts = failed + behind + ([f"ranks {silent} reported nothing"] if silent else [])
        text = "; ".join(parts) or "every other rank reached it too"
        return text[0].upper() + text[1:]


def _position(step: str, seq: str) -> tuple[int, int]:
    """(step, phase) of a stored progress record; (0, 0) for one that does not parse."""
    try:
        return int(step), int(seq)
    except ValueError:
        return 0, 0


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type when empty) without a C++ source location
    prefix (gloo's ``[.../pair.cc:537] ``), at most 300 characters."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return _SOURCE_PREFIX.sub("", line)[:300]


def nccl_environment() -> None:
    """Before an NCCL group is created: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` unless set (what
    torchrun gives its workers), so that a collective past the timeout aborts the communicators
    and ends the process instead of leaving it waiting."""
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")


def destroy_process_group(timeout_s: float = DESTROY_TIMEOUT_S, *, failed: bool = False) -> bool:
    """Tear down the default process group, waiting at most ``timeout_s`` seconds.

    ``failed``: a collective failed in this process, so pending NCCL work may never finish:
    abort the communicators (``_abort_process_group``, where torch has it) instead of the
    orderly destroy. The call runs on a daemon thread; returns True when it returned in time
    (or there was no group), False when it is still blocked (the caller should then exit
    without the interpreter's teardown, which would wait for it again).
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True

    def teardown() -> None:
        with contextlib.suppress(Exception):  # a broken group may raise on the way down
            if failed and "nccl" in str(dist.get_backend()):
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            else:
                dist.destroy_process_group()

    worker = threading.Thread(target=teardown, name="ptxtrain-destroy", daemon=True)
    worker.start()
    worker.join(timeout_s)
    return not worker.is_alive()
