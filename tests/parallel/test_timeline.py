"""Timeline recording, its JSON-lines files, the bubble computation and ``ptxtrain plot timeline``.

- bubble_stats on hand-made timelines: an ideal 1F1B schedule simulated with random integer F and
  B durations and free communication, whose measured bubble must equal the formula's exactly
  (the formula is exact for that case), and a small timeline whose numbers are worked by hand.
- One gloo group of 2 ranks records 1F1B, DualPipe and DualPipeV steps, writes them, and the plot
  command draws each and prints the numbers bubble_stats gives for the files.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from ptxtrain.cli import main
from ptxtrain.parallel import DualPipe, DualPipeV, OneFOneB, Timeline, bubble_stats, read_timelines
from ptxtrain.parallel.plot import select_step
from tests._spawn import run_gloo
from tests.parallel.test_schedules import criterion, make_batch, make_stage

EXACT = 1e-12  # the fractions are ratios of integers ns computed in float64: ~1e-16 relative


def simulate_1f1b(pp: int, n: int, f: int, b: int) -> list[dict]:
    """Ideal 1F1B (each op starts when its rank is free and its input has arrived, no comm)."""
    programs = []
    for s in range(pp):
        warm = min(pp - 1 - s, n)
        prog = [("F", i) for i in range(warm)]
        for i in range(n - warm):
            prog += [("F", warm + i), ("BW", i)]
        prog += [("BW", n - warm + i) for i in range(warm)]
        programs.append(prog)
    done: dict[tuple, int] = {}  # (kind, stage, chunk) -> end time
    free, pos = [0] * pp, [0] * pp
    cells: list[list[dict]] = [[] for _ in range(pp)]
    while any(pos[s] < len(programs[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            if pos[s] == len(programs[s]):
                continue
            kind, i = programs[s][pos[s]]
            dep = ("F", s - 1, i) if kind == "F" else ("BW", s + 1, i)
            if (kind == "F" and s == 0) or (kind == "BW" and s == pp - 1):
                dep = None
            if dep is not None and dep not in done:
                continue
            start = max(free[s], done[dep] if dep else 0)
            end = start + (f if kind == "F" else b)
            done[(kind, s, i)], free[s] = end, end
            cells[s].append({"kind": kind, "chunk": i, "dir": 0, "start_ns": start, "end_ns": end})
            pos[s] += 1
            progressed = True
        assert progressed, "simulated schedule deadlocked"
    span = max(free)
    return [
        {"schedule": "1f1b", "rank": s, "world": pp, "num_chunks": n, "start_ns": 0}
        | {"end_ns": span, "cells": cells[s]}
        for s in range(pp)
    ]


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_bubble_stats_ideal_1f1b(pp):
    rng = random.Random(pp)
    f, b = rng.randint(10, 100), rng.randint(10, 200)
    for n in (pp, 2 * pp + 1):
        stats = bubble_stats(simulate_1f1b(pp, n, f, b))
        # Every rank computes N(F+B); the ideal step lasts (N+PP-1)(F+B).
        assert stats.f_ns == f and stats.b_ns == b and stats.w_ns == 0, stats
        assert stats.window_ns == (n + pp - 1) * (f + b), stats
        assert stats.predicted_ns == (pp - 1) * (f + b), stats
        assert abs(stats.measured - stats.predicted) < EXACT, stats
        assert abs(stats.measured - (pp - 1) / (n + pp - 1)) < EXACT, stats


def test_bubble_stats_hand_made():
    rng = random.Random(7)
    f, b, w, bw = (rng.randint(5, 50) for _ in range(4))

    def cell(kind, start, length, d=0):
        return {"kind": kind, "chunk": 0, "dir": d, "start_ns": start, "end_ns": start + length}

    # rank 0: F at 0, B right after, W after a gap of 3, and a recv overlapping the gap (comm
    # is not compute); rank 1 starts 2 later, runs F, then BW, and a second F overlapping its BW
    # by 1 (overlapping cells count once).
    r0 = [cell("F", 0, f), cell("B", f, b), cell("recv", f + b, 3), cell("W", f + b + 3, w)]
    r1 = [cell("F", 2, f, 1), cell("BW", 2 + f, bw, 1), cell("F", 1 + f + bw, f, 1)]
    end0, end1 = f + b + 3 + w, 1 + 2 * f + bw
    steps = [
        {"schedule": "dualpipe", "rank": r, "world": 2, "num_chunks": 4, "start_ns": s}
        | {"end_ns": e, "cells": c}
        for r, s, e, c in ((1, 2, end1, r1), (0, 0, end0, r0))
    ]
    stats = bubble_stats(steps)
    window = max(end0, end1)
    busy0, busy1 = f + b + w, 2 * f + bw - 1
    assert stats.window_ns == window and stats.busy_ns == (busy0, busy1), stats
    want = ((1 - busy0 / window) + (1 - busy1 / window)) / 2
    assert abs(stats.measured - want) < EXACT, (stats.measured, want)
    # B = the mean full backward: only one BW cell. PP=2: (PP/2-1) = 0, no predicted bubble.
    assert stats.f_ns == f and stats.b_ns == bw and stats.w_ns == w and stats.fb_ns == f + bw
    assert stats.predicted_ns == 0 and stats.predicted == 0
    # The same timeline read as DualPipeV on 2 ranks (4 stages): (2-1)(F&B+B-3W).
    v = bubble_stats([s | {"schedule": "dualpipev"} for s in steps])
    pred = f + 2 * bw - 3 * w
    assert v.predicted_ns == pred and abs(v.predicted - pred / (pred + (busy0 + busy1) / 2)) < EXACT
    # Without BW cells, the full backward is B + W.
    no_bw = [s | {"cells": [c for c in s["cells"] if c["kind"] != "BW"]} for s in steps]
    assert bubble_stats(no_bw).b_ns == b + w


def test_bubble_stats_rejects_bad_input():
    steps = simulate_1f1b(2, 2, 3, 5)
    with pytest.raises(ValueError, match="empty"):
        bubble_stats([])
    with pytest.raises(ValueError, match="each of the 2 ranks"):
        bubble_stats(steps[:1])
    with pytest.raises(ValueError, match="different runs"):
        bubble_stats([steps[0], steps[1] | {"num_chunks": 3}])
    with pytest.raises(ValueError, match="unknown schedule"):
        bubble_stats([s | {"schedule": "gpipe"} for s in steps])


def test_timeline_write_read_roundtrip(tmp_path):
    tl = Timeline()
    for n in (2, 3):
        tl.begin_step("1f1b", 0, 1, n, torch.device("cpu"))
        for i in range(n):
            with tl.cell("F", i, 0):
                torch.randn(64, 64).sum()
        with tl.cell("recv", 0, 1):
            pass
        tl.end_step()
    path = tl.write(tmp_path / "run")
    assert path.name == "timeline_rank0.jsonl"
    assert read_timelines(tmp_path / "run") == {0: tl.steps}
    (rec,) = select_step({0: tl.steps}, 0)
    assert rec["num_chunks"] == 2 and [c["kind"] for c in rec["cells"]] == ["F", "F", "recv"]
    assert all(
        rec["start_ns"] <= c["start_ns"] <= c["end_ns"] <= rec["end_ns"] for c in rec["cells"]
    )
    with pytest.raises(ValueError, match="out of range"):
        select_step({0: tl.steps}, 2)
    with pytest.raises(ValueError, match="no step was recorded"):
        Timeline().write(tmp_path)
    with pytest.raises(FileNotFoundError, match="no timeline_rank"):
        read_timelines(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "timeline_rank0.jsonl").write_text('{"type": "cell", "step": 0}\n')
    with pytest.raises(ValueError, match=r"timeline_rank0\.jsonl:1"):
        read_timelines(bad)


def record_worker(rank: int, world: int, root: str) -> None:
    last = world - 1
    n = 2 * world
    x, y = make_batch(3, 2 * n)
    for name in ("1f1b", "dualpipe", "dualpipev"):
        tl = Timeline()
        for _ in range(2 if name == "1f1b" else 1):  # two steps: the plot draws the last
            if name == "1f1b":
                pipe = OneFOneB(make_stage(rank))
                ins, lab = {0: (x,)}.get(rank, ()), {last: (y,)}.get(rank, ())
            elif name == "dualpipe":
                pipe = DualPipe((make_stage(rank), make_stage(last - rank)))
                ins, lab = {0: (x,), last: (x,)}.get(rank, ()), {0: (y,), last: (y,)}.get(rank, ())
            else:
                pipe = DualPipeV((make_stage(rank), make_stage(2 * world - 1 - rank)))
                ins, lab = {0: (x,)}.get(rank, ()), {0: (y,)}.get(rank, ())
            pipe.step(
                *ins, num_chunks=n, criterion=criterion if lab else None, labels=lab, timeline=tl
            )
        # One F cell per micro-batch and stage on this rank (DualPipe: n/2 per direction).
        f_cells = [c for c in tl.steps[-1]["cells"] if c["kind"] == "F"]
        assert len(f_cells) == (2 * n if name == "dualpipev" else n), (name, rank, len(f_cells))
        tl.write(f"{root}/{name}")


def test_plot_timeline_from_a_gloo_run(tmp_path, capsys):
    run_gloo(record_worker, 2, str(tmp_path), timeout=90)
    for name in ("1f1b", "dualpipe", "dualpipev"):
        run_dir = tmp_path / name
        steps = read_timelines(run_dir)
        assert sorted(steps) == [0, 1] and len(steps[0]) == (2 if name == "1f1b" else 1)
        png = tmp_path / "png" / f"{name}.png"
        assert main(["plot", "timeline", str(run_dir), "--out", str(png)]) == 0
        printed = capsys.readouterr().out
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        stats = bubble_stats(select_step(steps, -1))
        m = re.search(r"measured ([0-9.]+), formula (.+) = -?[0-9.]+ ms -> ([0-9.]+)", printed)
        assert m is not None, printed
        assert float(m.group(1)) == pytest.approx(stats.measured, abs=1e-3)  # printed to 3 places
        assert float(m.group(3)) == pytest.approx(stats.predicted, abs=1e-3)
        assert m.group(2) == stats.formula and 0 < stats.measured < 1, printed
    # The default output goes into the run folder.
    assert main(["plot", "timeline", str(tmp_path / "dualpipe")]) == 0
    assert (tmp_path / "dualpipe" / "timeline.png").is_file()


@pytest.mark.gpu
def test_timeline_cuda_events(tmp_path):
    dev = torch.device("cuda")
    a = torch.randn(2048, 2048, device=dev)
    tl = Timeline()
    tl.begin_step("1f1b", 0, 1, 2, dev)
    for i in range(2):
        with tl.cell("F", i, 0):
            a @ a
    tl.end_step()
    (rec,) = tl.steps
    c0, c1 = rec["cells"]
    assert rec["clock"] == "cuda_event"
    times = [rec["start_ns"], c0["start_ns"], c0["end_ns"], c1["start_ns"], c1["end_ns"]]
    assert times == sorted(times) and times[-1] <= rec["end_ns"], rec
    assert c0["end_ns"] > c0["start_ns"], "a 2048^3 matmul takes more than 1 ns"
    assert read_timelines(tl.write(tmp_path).parent) == {0: tl.steps}
