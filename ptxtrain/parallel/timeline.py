"""Timelines of pipeline schedules: what each rank ran when, and the bubble it left.

Recording (DeepSeek-V3 report §3.2.1, Figure 5 shows such a timeline for DualPipe):

- Make one :class:`Timeline` per rank and pass it to a schedule's ``step(..., timeline=tl)``
  (:class:`~ptxtrain.parallel.OneFOneB`, :class:`~ptxtrain.parallel.DualPipe`,
  :class:`~ptxtrain.parallel.DualPipeV`). Each ``step`` appends one step record holding a cell per
  piece of work: ``F`` (forward chunk), ``B`` (input-grad backward, its weight grads deferred),
  ``W`` (a deferred weight-grad chunk), ``BW`` (a full backward: input and weight grads together),
  ``send`` (posting the asynchronous sends of one message) and ``recv`` (a blocking receive,
  i.e. time spent waiting for a peer). Each cell carries its micro-batch id (``chunk``, counted
  per direction from 0) and its ``dir``: the direction of travel (DualPipe: 0 = from rank 0, 1 =
  from the last rank; DualPipeV: 0 = the down leg through stages 0..R-1, 1 = the up leg; 1F1B:
  always 0). Local hand-offs (DualPipeV's turn at the last rank) are not communication and
  record no cell.
- Clock: on CPU ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux, shared by the processes of
  one host, so ranks line up). On CUDA, events recorded on the current stream, resolved when the
  step ends; they are placed on the same monotonic clock through an anchor taken right after one
  ``torch.cuda.synchronize()`` at the start of the step (so a GPU timeline costs one sync per
  step). Times are integers in ns.
- :meth:`Timeline.write` writes ``RUN_DIR/timeline_rank{r}.jsonl``: per step one
  ``{"type": "step", ...}`` line (schedule, rank, world, num_chunks, clock, start_ns, end_ns)
  followed by its ``{"type": "cell", "step", "kind", "chunk", "dir", "start_ns", "end_ns"}`` lines.

Analysis: :func:`read_timelines` loads a run folder, :func:`bubble_stats` measures the bubble and
compares it with the paper's formula (see its docstring); ``ptxtrain plot timeline RUN_DIR``
(:mod:`ptxtrain.parallel.plot`) draws it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import torch

COMPUTE_KINDS = ("F", "B", "W", "BW")
COMM_KINDS = ("send", "recv")
KINDS = COMPUTE_KINDS + COMM_KINDS
SCHEDULES = ("1f1b", "dualpipe", "dualpipev")
_FILE_RE = re.compile(r"timeline_rank(\d+)\.jsonl$")


class _Cell:
    """Context manager recording one cell of the current step."""

    __slots__ = ("_chunk", "_dir", "_kind", "_start", "_tl")

    def __init__(self, tl: Timeline, kind: str, chunk: int, direction: int):
        self._tl, self._kind, self._chunk, self._dir = tl, kind, chunk, direction

    def __enter__(self) -> None:
        self._start = self._tl._now()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._tl._cells.append(
                (self._kind, self._chunk, self._dir, self._start, self._tl._now())
            )


class Timeline:
    """Per-rank recorder of pipeline-schedule cells; pass it as ``step(..., timeline=tl)``.

    One instance per rank, reusable across steps (each ``step`` appends one record to
    :attr:`steps`). Not thread-safe; a step that raises leaves no record.

    Attributes:
        steps: list of step records (dicts): ``schedule`` (one of ``SCHEDULES``), ``rank``,
            ``world``, ``num_chunks``, ``clock`` (``"perf_counter_ns"`` or ``"cuda_event"``),
            ``start_ns``, ``end_ns`` and ``cells``: a list of dicts ``{"kind", "chunk", "dir",
            "start_ns", "end_ns"}`` in the order they ended.
    """

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self._cells: list[tuple] = []
        self._meta: dict | None = None
        self._cuda = False
        self._anchor_ev = None
        self._anchor_ns = 0

    # -- used by the schedules ----------------------------------------------------------------
    def _now(self):
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter_ns()

    def cell(self, kind: str, chunk: int, direction: int) -> _Cell:
        """Context manager timing one cell of the step in progress (used by the schedules)."""
        return _Cell(self, kind, chunk, direction)

    def begin_step(
        self, schedule: str, rank: int, world: int, num_chunks: int, device: torch.device
    ) -> None:
        """Start recording one schedule step of ``schedule`` on ``rank`` of ``world`` over
        ``num_chunks`` micro-batches (the schedules call it; on CUDA it synchronizes ``device``
        once to anchor the event clock to the host's)."""
        self._cuda = device.type == "cuda"
        self._cells = []
        if self._cuda:
            torch.cuda.synchronize(device)
            self._anchor_ev = torch.cuda.Event(enable_timing=True)
            self._anchor_ev.record()
            self._anchor_ns = time.perf_counter_ns()
        self._meta = {
            "schedule": schedule,
            "rank": rank,
            "world": world,
            "num_chunks": num_chunks,
            "clock": "cuda_event" if self._cuda else "perf_counter_ns",
        }
        self._start = self._now()

    def _resolve(self, t) -> int:
        if not self._cuda:
            return t
        return self._anchor_ns + round(self._anchor_ev.elapsed_time(t) * 1e6)  # ms -> ns

    def end_step(self) -> None:
        """Finish the step begun by :meth:`begin_step`: its cells, in host nanoseconds, join
        :attr:`steps` (on CUDA after waiting for the step's last event)."""
        end = self._now()
        if self._cuda:
            end.synchronize()
        cells = [
            {
                "kind": k,
                "chunk": c,
                "dir": d,
                "start_ns": self._resolve(s),
                "end_ns": self._resolve(e),
            }
            for k, c, d, s, e in self._cells
        ]
        self.steps.append(
            {
                **self._meta,
                "start_ns": self._resolve(self._start),
                "end_ns": self._resolve(end),
                "cells": cells,
            }
        )
        self._cells, self._meta, self._anchor_ev = [], None, None

    # -- public -------------------------------------------------------------------------------
    def clear(self) -> None:
        """Forget the recorded steps."""
        self.steps.clear()

    def write(self, run_dir: str | Path) -> Path:
        """Write the recorded steps to ``run_dir/timeline_rank{r}.jsonl`` (replacing it).

        ``r`` is the pipeline-group rank of the recorded steps; the folder is created if needed.

        Returns:
            The path written.

        Raises:
            ValueError: no step was recorded, or steps of different ranks were.
        """
        if not self.steps:
            raise ValueError("Timeline.write: no step was recorded (pass timeline= to step())")
        ranks = {s["rank"] for s in self.steps}
        if len(ranks) != 1:
            raise ValueError(f"Timeline.write: steps of several ranks were recorded: {ranks}")
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / f"timeline_rank{ranks.pop()}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for i, s in enumerate(self.steps):
                head = {k: v for k, v in s.items() if k != "cells"}
                f.write(json.dumps({"type": "step", "step": i, **head}) + "\n")
                for c in s["cells"]:
                    f.write(json.dumps({"type": "cell", "step": i, **c}) + "\n")
        tmp.replace(path)
        return path


def check_timeline(timeline: object) -> list[str]:
    """``[message]`` when ``timeline`` is neither None nor a :class:`Timeline`, else ``[]``."""
    if timeline is None or isinstance(timeline, Timeline):
        return []
    return [f"timeline must be a ptxtrain.parallel.Timeline or None, got {type(timeline).__name__}"]


def read_timelines(run_dir: str | Path) -> dict[int, list[dict]]:
    """Load ``run_dir/timeline_rank*.jsonl`` as ``{rank: [step record, ...]}`` (see Timeline).

    Raises:
        FileNotFoundError: ``run_dir`` is not a folder or holds no timeline file.
        ValueError: a file is not valid timeline JSON lines (the message names file and line).
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {run_dir} does not exist")
    files = sorted(p for p in run_dir.iterdir() if _FILE_RE.search(p.name))
    if not files:
        raise FileNotFoundError(f"no timeline_rank*.jsonl in {run_dir}")
    out: dict[int, list[dict]] = {}
    for path in files:
        steps: list[dict] = []
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                    kind = rec.pop("type")
                    rec.pop("step")
                    if kind == "step":
                        steps.append({**rec, "cells": []})
                    elif kind == "cell" and steps and rec["kind"] in KINDS:
                        steps[-1]["cells"].append(rec)
                    else:
                        raise ValueError(f"unexpected record {line.strip()[:80]!r}")
                    int(rec["start_ns"]), int(rec["end_ns"])
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ValueError(f"{path}:{n}: not a timeline record ({e})") from None
        out[int(_FILE_RE.search(path.name).group(1))] = steps
    return out


@dataclass(frozen=True)
class BubbleStats:
    """Measured and predicted pipeline bubble of one step (times in ns, fractions in [0, 1]).

    Attributes:
        schedule, world, num_chunks: what ran.
        window_ns: the step's wall time: first step start to last step end over all ranks.
        busy_ns: per rank, time covered by compute cells (F, B, W, BW; union of intervals).
        measured: mean over ranks of ``1 - busy / window`` (idle share, communication waits
            included).
        f_ns, b_ns, w_ns, fb_ns: mean forward chunk, FULL backward chunk (input + weight grads),
            weight-grad chunk and F&B pair durations used in the formula.
        formula: the formula used, as text; predicted_ns: its value per rank.
        predicted: ``max(predicted_ns, 0) / (max(predicted_ns, 0) + mean busy)``.
    """

    schedule: str
    world: int
    num_chunks: int
    window_ns: int
    busy_ns: tuple[int, ...]
    measured: float
    f_ns: float
    b_ns: float
    w_ns: float
    fb_ns: float
    formula: str
    predicted_ns: float
    predicted: float


def union_length(intervals) -> float:
    """Total length covered by ``(start, end)`` intervals, overlaps counted once."""
    total, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def _mean(xs: list[int]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def bubble_stats(steps: list[dict]) -> BubbleStats:
    """Measured bubble fraction of one step and the paper's prediction from measured durations.

    Args:
        steps: one step record per rank of the pipeline group (e.g. ``[t[r][-1] for r in
            sorted(t)]`` with ``t = read_timelines(run_dir)``), all of the same schedule.

    Measured: the window is the step's wall time over all ranks (earliest start to latest end);
    a rank's idle time is the window minus the union of its compute cells (F, B, W, BW), so
    waiting in a receive counts as bubble; the result is the mean over ranks of idle / window.

    Predicted (DeepSeek-V3 report Table 2; F = mean F cell, W = mean W cell (0 if none), B = the
    FULL backward: mean BW cell, or mean B + W when every backward was split, F&B = F + B since
    the pairs run one after the other here, not overlapped), with P ranks:

    - ``1f1b``: ``(PP-1)(F+B)`` with PP = P stages;
    - ``dualpipe``: ``(PP/2-1)(F&B+B-3W)`` with PP = P stages;
    - ``dualpipev``: ``(PP/2-1)(F&B+B-3W)`` with PP = 2P stages, i.e. ``(P-1)(F&B+B-3W)``
      (DualPipe's notes on the "cut-in-half" DualPipeV: same bubble, half the devices).

    The predicted bubble time per rank (``predicted_ns``, as the formula gives it) is turned into
    a fraction by ``max(bubble, 0) / (max(bubble, 0) + mean busy time per rank)``: DualPipe's
    formula goes negative when 3W > F&B + B, which a real schedule cannot do.

    Raises:
        ValueError: no steps, ranks of different schedules or worlds, a missing rank, an unknown
            schedule, or no F cell.
    """
    if not steps:
        raise ValueError("bubble_stats: steps is empty")
    heads = {(s["schedule"], s["world"], s["num_chunks"]) for s in steps}
    if len(heads) != 1:
        raise ValueError(f"bubble_stats: steps of different runs (schedule, world, N): {heads}")
    schedule, world, num_chunks = heads.pop()
    if schedule not in SCHEDULES:
        raise ValueError(f"bubble_stats: unknown schedule {schedule!r}, expected {SCHEDULES}")
    if sorted(s["rank"] for s in steps) != list(range(world)):
        got = sorted(s["rank"] for s in steps)
        raise ValueError(f"bubble_stats: need one step of each of the {world} ranks, got {got}")
    t0 = min(s["start_ns"] for s in steps)
    window = max(s["end_ns"] for s in steps) - t0
    busy, by_kind = [], {k: [] for k in COMPUTE_KINDS}
    for s in sorted(steps, key=lambda s: s["rank"]):
        cells = [c for c in s["cells"] if c["kind"] in COMPUTE_KINDS]
        busy.append(union_length([(c["start_ns"], c["end_ns"]) for c in cells]))
        for c in cells:
            by_kind[c["kind"]].append(c["end_ns"] - c["start_ns"])
    if not by_kind["F"]:
        raise ValueError("bubble_stats: the timeline has no F cell")
    measured = _mean([1.0 - b / window for b in busy]) if window > 0 else 0.0
    f, w = _mean(by_kind["F"]), _mean(by_kind["W"])
    b = _mean(by_kind["BW"]) if by_kind["BW"] else _mean(by_kind["B"]) + w
    fb = f + b
    if schedule == "1f1b":
        formula, pred = "(PP-1)(F+B)", (world - 1) * (f + b)
    elif schedule == "dualpipe":
        formula, pred = "(PP/2-1)(F&B+B-3W)", (world / 2 - 1) * (fb + b - 3 * w)
    else:
        formula, pred = "(PP/2-1)(F&B+B-3W), PP=2*ranks", (world - 1) * (fb + b - 3 * w)
    mean_busy, bubble = _mean(busy), (pred if pred > 0 else 0.0)
    predicted = bubble / (bubble + mean_busy) if bubble + mean_busy > 0 else 0.0
    return BubbleStats(
        schedule=schedule,
        world=world,
        num_chunks=num_chunks,
        window_ns=window,
        busy_ns=tuple(busy),
        measured=measured,
        f_ns=f,
        b_ns=b,
        w_ns=w,
        fb_ns=fb,
        formula=formula,
        predicted_ns=pred,
        predicted=predicted,
    )


__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "KINDS",
    "SCHEDULES",
    "BubbleStats",
    "Timeline",
    "bubble_stats",
    "check_timeline",
    "read_timelines",
    "union_length",
]
