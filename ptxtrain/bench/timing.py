"""GPU timing with docs/design.md §6's method, and the environment record every result carries."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ptxtrain._backend import sm_clock_khz

# Bytes of the buffer zeroed before each timed call to evict L2: well above the H100's 50 MB
# and the H200's 60 MB of L2.
L2_FLUSH_BYTES = 256 << 20


class GpuTimer:
    """Times a callable on the current CUDA stream, one call per measurement.

    Each measurement: memset a 256 MB buffer (evicts L2), queue a device sleep so the host can
    enqueue the call before the device reaches it (launch overhead hidden), record the start
    event, call, record the end event. Returns the median in microseconds. The sleep is
    ``sleep_us`` or twice the host time of one call measured during warm-up, whichever is longer,
    so a callable that launches many kernels is still timed on the device alone; the host time
    itself is kept in :attr:`last_host_us` (report it beside the device time).
    """

    def __init__(
        self, *, warmup: int = 5, repeats: int = 50, flush_l2: bool = True, sleep_us: float = 200.0
    ):
        if not torch.cuda.is_available():
            raise RuntimeError("GpuTimer needs a CUDA device")
        self.warmup, self.repeats, self.flush_l2 = warmup, repeats, flush_l2
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")
        self._clock_khz = sm_clock_khz(0)
        self._sleep_us = sleep_us
        self.last_host_us = float("nan")

    def host_us(
        self,
        fn: Callable[[], object],
        calls: int = 10,
        setup: Callable[[], object] | None = None,
    ) -> float:
        """Median host (CPU) time of one call of ``fn`` in µs: what it costs to enqueue its work.

        Each call starts after the device is idle (and after ``setup``, untimed), so the host
        never waits on a full queue.
        """
        times = []
        for _ in range(calls):
            if setup is not None:
                setup()
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times)

    def __call__(
        self, fn: Callable[[], object], setup: Callable[[], object] | None = None
    ) -> float:
        """Median device time of ``fn`` in µs. ``setup``, when given, runs before every call
        and is not timed (e.g. to restore state that ``fn`` consumes)."""

        def prepared() -> Callable[[], object]:
            if setup is not None:
                setup()
                torch.cuda.synchronize()
            return fn

        for _ in range(self.warmup):
            prepared()()
        self.last_host_us = self.host_us(fn, calls=max(3, self.warmup), setup=setup)
        sleep_us = max(self._sleep_us, 2.0 * self.last_host_us)
        sleep_cycles = int(sleep_us * self._clock_khz / 1e3)
        torch.cuda.synchronize()
        times = []
        for _ in range(self.repeats):
            call = prepared()
            if self.flush_l2:
                self._flush.zero_()
            torch.cuda._sleep(sleep_cycles)
            times.append(event_us(call))
        return statistics.median(times)


def event_us(fn: Callable[[], object]) -> float:
    """Device time of one call of ``fn`` on the current stream in µs (CUDA events around it;
    waits for it to finish)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3  # ms -> µs


def git_sha() -> str:
    """The repository's HEAD sha (with ``-dirty`` if the tree has changes), or ``unknown``.

    ``PTXTRAIN_GIT_SHA`` wins when set: the GPU machines get a copy of the tree without ``.git``.
    """
    if os.environ.get("PTXTRAIN_GIT_SHA"):
        return os.environ["PTXTRAIN_GIT_SHA"]
    root = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict:
    """Device, versions, git sha, date and command line for a results record."""
    env = {
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "command": shlex.join(sys.argv),  # the process's command line, as it was started
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(
            device=p.name,
            sm_count=p.multi_processor_count,
            capability=f"{p.major}.{p.minor}",
            gpu_memory_gib=round(p.total_memory / 2**30, 1),
            # which physical GPU: device calls may land on different machines, whose
            # timings can differ by a few percent
            gpu_uuid=str(getattr(p, "uuid", "")),
        )
    else:
        env["device"] = "cpu"
    return env
