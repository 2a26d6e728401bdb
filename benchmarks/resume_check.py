"""Checkpoint / resume of a (pipelined, expert-parallel) run against the same run uninterrupted.

    torchrun --nproc-per-node 2 -m benchmarks.resume_check --pp 2 --schedule dualpipe \\
        --steps 12 --stop-after 6 --json OUT.json

Every rank runs, in this order: the whole run (``--steps`` steps, run folder ``ROOT/whole``);
the same run stopped and checkpointed after ``--stop-after`` steps (``ROOT/split``); then
``--resume`` of it to the end. Rank 0 compares the two loss trajectories step by step and writes
the record: the largest absolute difference before and after the resume point. On CPU (gloo)
the resumed run is bitwise the whole one (``tests/parallel/test_pp_checkpoint.py`` checks the
same); on GPUs a difference before the resume point measures the run-to-run nondeterminism, one
after it that much plus anything the checkpoint loses. Exit code 1 when the trajectories differ
by more than ``--tol`` anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"))
    p.add_argument("--pp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--schedule", default="dualpipe")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--stop-after", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--device", default="auto")
    p.add_argument("--root", default="/tmp/ptxtrain-resume-check")
    p.add_argument("--tol", type=float, default=0.0, help="allowed |loss difference|")
    p.add_argument("--json", help="rank 0 writes the record here")
    a = p.parse_args(argv)
    if not 0 < a.stop_after < a.steps:
        p.error(f"--stop-after must be in (0, --steps={a.steps}), got {a.stop_after}")

    from ptxtrain.bench.timing import environment
    from ptxtrain.train import TrainArgs, train

    base = dict(
        preset=a.preset, precision=a.precision, mtp=False, steps=a.steps,
        batch_size=a.batch_size, seq_len=a.seq_len, pp=a.pp, ep=a.ep,
        schedule=a.schedule if a.pp > 1 else "dualpipe", eval_every=0, sample_tokens=0,
        ckpt_every=0, progress=False, device=a.device, seed=0,
    )  # fmt: skip
    root = Path(a.root)
    whole = train(TrainArgs(**base, out=str(root / "whole"), overwrite=True))
    train(TrainArgs(**base, out=str(root / "split"), overwrite=True, stop_after=a.stop_after))
    resumed = train(TrainArgs(**base, out=str(root / "split"), resume=True))
    if whole.get("rank", 0) != 0:
        return 0
    w, r = whole["losses"], resumed["losses"]
    if len(w) != a.steps or len(r) != a.steps:
        raise RuntimeError(f"expected {a.steps} losses, got {len(w)} (whole), {len(r)} (split)")
    diffs = [abs(x - y) for x, y in zip(w, r, strict=True)]
    k = a.stop_after
    record = {
        **environment(),
        "bench": "resume_check",
        "settings": {key: v for key, v in vars(a).items() if key not in ("json", "root")},
        "losses_whole": w,
        "losses_resumed": r,
        "max_diff_before_resume": max(diffs[:k]),
        "max_diff_after_resume": max(diffs[k:]),
        "bitwise": w == r,
    }
    print(
        f"resume check ({a.precision}, pp={a.pp}, ep={a.ep}, {base['schedule']}): "
        f"max |diff| {record['max_diff_before_resume']:.3g} before step {k + 1}, "
        f"{record['max_diff_after_resume']:.3g} from it; bitwise {record['bitwise']}"
    )
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=1))
    return 0 if max(diffs) <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
