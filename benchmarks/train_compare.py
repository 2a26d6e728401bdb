"""``ptxtrain train --preset small`` in BF16 and FP8 on a GPU, same seed and batches.

    python3 -m benchmarks.train_compare --json benchmarks/results/h200/train-small.json \
        [--out DIR]

Reports both runs' train/val loss at equal steps (relative gap), tokens/s, and the optimizer-state
bytes per parameter of ptxtrain's AdamW vs ``torch.optim.AdamW`` on the same model, and writes
them to ``--json``; ``--out`` receives each run's loss plot and samples. ``PTXTRAIN_CMP_STEPS``
(default 250), ``PTXTRAIN_CMP_RECIPE`` (the FP8 run's recipe, default deepseek) and
``PTXTRAIN_CMP_DEVICE`` (``cpu``: a smoke run) change the setting; the record keeps it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

STEPS = int(os.environ.get("PTXTRAIN_CMP_STEPS", "250"))
RUN_ROOT = Path(os.environ.get("PTXTRAIN_CMP_RUNS", "/tmp/ptxtrain-runs"))
DEVICE = os.environ.get("PTXTRAIN_CMP_DEVICE", "cuda")  # cpu: a smoke run of this script
RECIPE = os.environ.get("PTXTRAIN_CMP_RECIPE", "deepseek")  # the FP8 run's --fp8-recipe


def _torch_adamw_bytes(device: torch.device) -> dict:
    """torch.optim.AdamW over the same model in FP32 (its usual setting): bytes per parameter."""
    from ptxtrain.model import build_model, get_preset
    from ptxtrain.optim import optimizer_state_bytes

    model = build_model(get_preset("small"), dtype=torch.float32, device=device, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 128), device=device)
    model(x, x).loss.backward()
    opt.step()
    out = optimizer_state_bytes(opt)
    del model, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def compare(out_dir: Path | None) -> dict:
    from ptxtrain.bench.timing import environment
    from ptxtrain.train.loop import TrainArgs, train

    common = dict(
        preset="small",
        steps=STEPS,
        batch_size=8,
        seq_len=1024,
        lr=1.5e-3,
        min_lr=1.5e-4,
        warmup_steps=30,
        eval_every=50,
        eval_batches=8,
        ckpt_every=0,
        sample_tokens=300,
        device=DEVICE,
        seed=0,
        progress=False,
        overwrite=True,
    )
    runs = {}
    for precision in ("bf16", "fp8"):
        run_dir = RUN_ROOT / f"small-{precision}"  # checkpoints stay out of the results folder
        recipe = {"fp8_recipe": RECIPE} if precision == "fp8" else {}
        args = TrainArgs(precision=precision, out=str(run_dir), **recipe, **common)
        runs[precision] = train(args)
        for name in ("loss.png", "samples.txt"):
            if out_dir is not None:
                shutil.copyfile(run_dir / name, out_dir / f"small-{precision}-{name}")
    bf16, fp8 = runs["bf16"], runs["fp8"]
    gap = {}
    for frac in (0.25, 0.5, 0.75, 1.0):
        i = max(1, int(STEPS * frac)) - 1
        # Mean of the 10 steps ending at i: one batch's loss is noisy.
        a = sum(bf16["losses"][max(0, i - 9) : i + 1]) / len(bf16["losses"][max(0, i - 9) : i + 1])
        b = sum(fp8["losses"][max(0, i - 9) : i + 1]) / len(fp8["losses"][max(0, i - 9) : i + 1])
        gap[f"step_{i + 1}"] = {"bf16": a, "fp8": b, "rel_gap": (b - a) / a}
    torch_bytes = _torch_adamw_bytes(torch.device(DEVICE))
    keep = (
        "step",
        "tokens_per_s",
        "steady_tokens_per_s",
        "first_step_s",
        "first_loss",
        "last_loss",
        "best_val_loss",
        "last_val_loss",
        "unigram_entropy",
        "optimizer_bytes_per_param",
        "training_bytes_per_param",
        "peak_memory_bytes",
        "params",
        "samples",
        "time_s",
    )
    record = {
        "bench": "train_small_bf16_vs_fp8",
        "env": environment(),
        "args": common,
        "fp8_recipe": RECIPE,
        "runs": {p: {k: r.get(k) for k in keep} | {"losses": r["losses"]} for p, r in runs.items()},
        "train_loss_gap_10step_mean": gap,
        "val_loss_rel_gap": (fp8["last_val_loss"] - bf16["last_val_loss"]) / bf16["last_val_loss"],
        "tokens_per_s_ratio_fp8_over_bf16": fp8["tokens_per_s"] / bf16["tokens_per_s"],
        # Without the first step (JIT compiles on a fresh machine).
        "steady_tokens_per_s_ratio_fp8_over_bf16": (
            fp8["steady_tokens_per_s"] / bf16["steady_tokens_per_s"]
            if fp8.get("steady_tokens_per_s") and bf16.get("steady_tokens_per_s")
            else None
        ),
        "torch_adamw_fp32_bytes": torch_bytes,
    }
    print(f"{'':>6} {'tok/s':>9} {'steady':>9} {'last val':>9} {'opt B/param':>11}")
    for p, r in runs.items():
        print(
            f"{p:>6} {r['tokens_per_s']:9.0f} {r.get('steady_tokens_per_s') or 0:9.0f} "
            f"{r['last_val_loss']:9.4f} {r['optimizer_bytes_per_param']}"
        )
    for k, v in gap.items():
        print(f"{k}: bf16 {v['bf16']:.4f} fp8 {v['fp8']:.4f} rel gap {v['rel_gap']:+.4%}")
    print(
        f"val rel gap {record['val_loss_rel_gap']:+.4%}; torch AdamW fp32 bytes/param "
        f"{torch_bytes['per_param']:.2f}"
    )
    return record


def main() -> None:
    import argparse
    import json

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", type=Path, required=True, help="write the results record here")
    p.add_argument("--out", type=Path, help="folder for both runs' loss plots and samples")
    args = p.parse_args()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    record = compare(args.out)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=1, default=str))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
