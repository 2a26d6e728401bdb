"""One results record from several ``ptxtrain train`` run folders (issue 7's pipeline runs).

    python -m benchmarks.pp_report --json OUT.json 1gpu=/tmp/pp-1gpu pp4-dualpipe=/tmp/pp-dualpipe

For each ``label=run_dir``: tokens/s (and per GPU), step time (ms per optimizer step), train /
val loss, the peak CUDA memory of every rank, and, where the folder holds ``timeline_rank*.jsonl``
(``--timeline``), the measured bubble fraction beside the DeepSeek-V3 formula's
(:func:`ptxtrain.parallel.bubble_stats`) for each of the last ``--steps`` recorded steps (the
first steps include warm-up, so they are left out) and their median. Device, versions and git sha
come from this process (:func:`ptxtrain.bench.timing.environment`); the runs must have been made
on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def bubble_record(run_dir: Path, last: int) -> dict | None:
    """The bubble of a pipeline run folder's last ``last`` recorded steps, for a results record.

    ``run_dir`` holds ``timeline_rank*.jsonl`` (``ptxtrain train --timeline``); each step's
    bubble is :func:`ptxtrain.parallel.bubble_stats` over the ranks' records of that step.
    Returns None without timelines, else a dict: ``schedule``, ``ranks``, ``num_chunks``,
    ``steps_used``, ``measured`` / ``predicted`` (per step, fractions of the step's window),
    their medians ``measured_median`` / ``predicted_median``, ``formula`` (DeepSeek-V3's, as
    text) and ``mean_ms_last_step`` (F, B_full, W, FB and the window, ms).

    Raises:
        ValueError: the timelines are not of one run (from ``bubble_stats``).
    """
    from ptxtrain.parallel import bubble_stats, read_timelines

    if not any(run_dir.glob("timeline_rank*.jsonl")):
        return None
    timelines = read_timelines(run_dir)
    n = min(len(steps) for steps in timelines.values())
    picked = range(max(0, n - last), n)
    stats = [bubble_stats([timelines[r][i] for r in sorted(timelines)]) for i in picked]
    s = stats[-1]
    return {
        "schedule": s.schedule,
        "ranks": s.world,
        "num_chunks": s.num_chunks,
        "steps_used": len(stats),
        "measured": [round(x.measured, 4) for x in stats],
        "measured_median": round(statistics.median(x.measured for x in stats), 4),
        "formula": s.formula,
        "predicted": [round(x.predicted, 4) for x in stats],
        "predicted_median": round(statistics.median(x.predicted for x in stats), 4),
        "mean_ms_last_step": {
            "F": round(s.f_ns * 1e-6, 3),
            "B_full": round(s.b_ns * 1e-6, 3),
            "W": round(s.w_ns * 1e-6, 3),
            "FB": round(s.fb_ns * 1e-6, 3),
            "window": round(s.window_ns * 1e-6, 3),
        },
    }


def read_summary(run_dir: Path) -> dict:
    """``run_dir/summary.json``.

    Raises:
        FileNotFoundError: there is none (the run did not finish).
    """
    path = run_dir / "summary.json"
    if not path.is_file():
        raise FileNotFoundError(f"{run_dir}: no summary.json (did the run finish?)")
    return json.loads(path.read_text())


def run_record(run_dir: Path, last: int) -> dict:
    """The numbers of one run folder (``summary.json`` + ``config.json`` + timelines).

    Raises:
        FileNotFoundError: ``run_dir`` has no ``summary.json`` (the run did not finish).
    """
    s = read_summary(run_dir)
    cfg = json.loads((run_dir / "config.json").read_text())
    peaks = s.get("peak_memory_bytes_per_rank") or [s.get("peak_memory_bytes")]
    gpus = s["ranks"]
    step_ms = 1e3 * s["train_time_s"] / s["steps_run"] if s.get("steps_run") else None
    first = s.get("first_step_s")
    steady_ms = (
        1e3 * (s["train_time_s"] - first) / (s["steps_run"] - 1)
        if first is not None and s["steps_run"] > 1
        else None
    )
    return {
        "precision": s["precision"],
        "pipeline": s.get("pipeline"),
        "ep": s.get("ep", 1),
        "batch_size": cfg["train"]["batch_size"],
        "seq_len": cfg["train"]["seq_len"],
        "steps_run": s["steps_run"],
        "tokens_per_step": s["tokens_per_step"],
        "gpus": gpus,
        "tokens_per_s": round(s["tokens_per_s"], 1),
        "tokens_per_s_per_gpu": round(s["tokens_per_s"] / gpus, 1),
        "first_step_s": s.get("first_step_s"),
        "steady_tokens_per_s": s.get("steady_tokens_per_s"),
        "steady_tokens_per_s_per_gpu": (
            None if s.get("steady_tokens_per_s") is None else s["steady_tokens_per_s"] / gpus
        ),
        "step_ms": None if step_ms is None else round(step_ms, 2),
        "steady_step_ms": None if steady_ms is None else round(steady_ms, 2),
        "first_loss": s["first_loss"],
        "last_loss": s["last_loss"],
        "last_val_loss": s["last_val_loss"],
        "peak_memory_mib_per_rank": [None if p is None else round(p / 2**20, 1) for p in peaks],
        "bubble": bubble_record(run_dir, last),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    p.add_argument("--json", required=True, help="write the record here")
    p.add_argument("--steps", type=int, default=5, help="last recorded steps for the bubble")
    p.add_argument("--command", default="", help="the command line the runs used (recorded)")
    args = p.parse_args(argv)
    from ptxtrain.bench.timing import environment

    record = {**environment(), "command": args.command, "runs": {}, "missing": {}}
    for item in args.runs:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            p.error(f"runs must be LABEL=RUN_DIR, got {item!r}")
        try:
            record["runs"][label] = run_record(Path(path), args.steps)
        except (FileNotFoundError, ValueError) as e:
            record["missing"][label] = str(e)
    # Steady state (the first step, which JIT-compiles, left out) where the runs recorded it.
    key = (
        "steady_tokens_per_s"
        if all(r.get("steady_tokens_per_s") for r in record["runs"].values())
        else "tokens_per_s"
    )
    record["compared"] = key
    base = record["runs"].get("1gpu", {}).get(key)
    print(f"tokens/s: {key}")
    print(f"{'run':>22} {'GPUs':>4} {'tokens/s':>10} {'x 1gpu':>7} {'step ms':>9} {'loss':>7} "
          f"{'bubble':>7} {'formula':>7} {'peak MiB per rank':>20}")  # fmt: skip
    for label, r in record["runs"].items():
        ratio = f"{r[key] / base:.2f}" if base else "-"
        b = r["bubble"] or {}
        peaks = "/".join("-" if x is None else f"{x:.0f}" for x in r["peak_memory_mib_per_rank"])
        print(
            f"{label:>22} {r['gpus']:>4} {r[key]:>10,.0f} {ratio:>7} "
            f"{r['steady_step_ms'] or r['step_ms'] or 0:>9.1f} "
            f"{r['last_loss']:>7.4f} {b.get('measured_median', float('nan')):>7.3f} "
            f"{b.get('predicted_median', float('nan')):>7.3f} {peaks:>20}"
        )
    for label, why in record["missing"].items():
        print(f"{label:>22} MISSING: {why}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=1))
    return 1 if record["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
