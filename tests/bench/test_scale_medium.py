"""benchmarks/scale_medium.py: run names, the command lines' sizes, the entry math, a CPU run."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from benchmarks.scale_medium import (
    Settings,
    main,
    parallel_flags,
    parse_run,
    run_command,
    run_entry,
)


def _flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


@pytest.mark.parametrize(
    ("name", "ranks", "batch", "chunks", "schedule", "ep", "extra"),
    [
        ("ep2_fp8", 2, 16, None, None, "2", []),
        ("ep4_bf16", 4, 32, None, None, "4", []),
        ("ep8_fp8_nvlink", 8, 64, None, None, "8", ["--ep-backend"]),
        ("pp4_dualpipe_fp8", 4, 16, "8", "dualpipe", None, ["--timeline"]),
        ("pp4_dualpipev_fp8", 4, 16, "8", "dualpipev", None, ["--timeline"]),
        ("pp4_1f1b_fp8", 4, 16, "8", "1f1b", None, ["--timeline"]),
        ("pp2ep2_fp8", 4, 32, "8", "dualpipe", "2", ["--timeline"]),
        ("pp4ep2_fp8", 8, 32, "8", "dualpipe", "2", ["--timeline"]),
        ("pp8_dualpipe_fp8", 8, 32, "16", "dualpipe", None, ["--timeline"]),
        ("pp8_dualpipev_fp8", 8, 32, "16", "dualpipev", None, ["--n-layers"]),
    ],
)
def test_command_lines(name, ranks, batch, chunks, schedule, ep, extra, tmp_path):
    """8 x 2,048 tokens per EP rank; 2 x 2,048 per micro-batch and max(8, 2P) of them per
    pipeline; DualPipeV at PP 8 gets 16 layers (medium has 8)."""
    spec = parse_run(name)
    cmd = run_command(spec, Settings(), tmp_path / name)
    assert cmd[:4] == ["torchrun", "--standalone", "--nproc-per-node", str(ranks)]
    assert spec.ranks == ranks
    assert _flag(cmd, "--batch-size") == str(batch)
    assert _flag(cmd, "--num-chunks") == chunks
    assert _flag(cmd, "--schedule") == schedule
    assert _flag(cmd, "--ep") == ep
    assert _flag(cmd, "--precision") == name.split("_")[-2 if "nvlink" in name else -1]
    assert _flag(cmd, "--pp") == (None if schedule is None else str(ranks // int(ep or 1)))
    assert all(f in cmd for f in extra)
    assert "--no-checkpoint" in cmd and _flag(cmd, "--out") == str(tmp_path / name)
    assert _flag(cmd, "--n-layers") == ("16" if name == "pp8_dualpipev_fp8" else None)


def test_checkpoint_run_and_bad_names(tmp_path):
    cmd = run_command(parse_run("ep2_fp8"), Settings(steps=30), tmp_path, checkpoint=True)
    assert _flag(cmd, "--ckpt-every") == "10" and "--async-ckpt" in cmd
    assert "--no-checkpoint" not in cmd
    for bad in ("ep1_fp8", "pp4_fp16", "ep2", "pp4_zigzag_fp8", "pp2_fp8_nvlink", "fp8"):
        with pytest.raises(ValueError, match="run"):
            parse_run(bad)
    # A smaller preset with its own micro-batch: tiny's 4 layers are fewer than DualPipeV's 8.
    flags = parallel_flags(parse_run("pp4_dualpipev_bf16"), Settings(preset="tiny", micro_batch=1))
    assert _flag(flags, "--batch-size") == "8" and _flag(flags, "--n-layers") == "8"


def test_dry_run_prints_every_command(capsys):
    rc = main(["--nproc", "4", "--runs", "ep4_fp8", "pp2ep2_fp8", "--steps", "5", "--dry-run"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and len(lines) == 5  # baseline, two runs, the checkpoint run, its resume
    assert "--batch-size 8 " in lines[0] and "torchrun" not in lines[0]
    assert lines[1].startswith("PTXTRAIN_JIT_CACHE_DIR=") and "TRITON_CACHE_DIR=" in lines[1]
    assert "--async-ckpt" in lines[3] and "--overwrite" in lines[3]
    assert lines[4].endswith("--resume") and "--steps 5 " in lines[4]
    assert "--overwrite" not in lines[4]
    with pytest.raises(ValueError, match="needs 8 ranks"):
        main(["--nproc", "4", "--runs", "ep8_fp8", "--dry-run"])
    # The dispatch bench at EP8 in DeepSeek-V3's setting, on its own: no checkpoint run.
    main(["--nproc", "8", "--runs", "dispatch_ep8", "--dry-run"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and "--nproc-per-node 8 -m ptxtrain bench dispatch" in lines[1]
    assert "--tokens 4096 --hidden 7168 --experts 256 --topk 8" in lines[1]
    with pytest.raises(ValueError, match="'dispatch_ep8' needs 8 ranks"):
        main(["--nproc", "4", "--runs", "dispatch_ep8", "--dry-run"])
    # --measure-last N: the baseline and the runs log every N steps (one window measured).
    main(["--nproc", "2", "--runs", "ep2_fp8", "--steps", "6", "--measure-last", "3",
          "--ckpt-run", "none", "--dry-run"])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all("--log-every 3 " in line for line in lines), lines


def _summary(run_dir: Path, **fields) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps(fields))


def test_entry_math_on_fabricated_summaries(tmp_path):
    """Per GPU = steady tokens/s over the ranks; efficiency against the one GPU's per GPU; the
    peak memory of the largest rank (a rank without a reading left out)."""
    rng = random.Random(104)  # fixed: a failure reproduces
    steady, base, ranks = rng.uniform(1e4, 1e5), rng.uniform(1e4, 1e5), rng.choice([2, 4, 8])
    peaks = [rng.randrange(2**33, 2**37) for _ in range(ranks - 1)] + [None]
    _summary(
        tmp_path / "r",
        steady_tokens_per_s=steady,
        ranks=ranks,
        first_step_s=12.5,
        peak_memory_bytes_per_rank=peaks,
        tokens_per_step=65536,
    )
    e = run_entry(tmp_path / "r", base, 5)
    # The record rounds tokens/s to 0.1, efficiency to 4 decimals, GiB to 2.
    assert e["tokens_per_s"] == pytest.approx(steady / ranks, abs=0.05)
    assert e["efficiency"] == pytest.approx(steady / ranks / base, abs=5e-5)
    assert e["peak_mem_gib"] == pytest.approx(max(p for p in peaks if p) / 2**30, abs=0.005)
    assert e["bubble"] is None and e["formula_bubble"] is None  # no timelines: no pipeline
    assert e["first_step_s"] == 12.5 and e["ranks"] == ranks
    _summary(
        tmp_path / "cpu",
        steady_tokens_per_s=steady,
        ranks=2,
        peak_memory_bytes_per_rank=[None, None],
    )
    cpu = run_entry(tmp_path / "cpu", None, 5)
    assert cpu["efficiency"] is None and cpu["peak_mem_gib"] is None
    _summary(tmp_path / "one", steady_tokens_per_s=None, ranks=2)
    with pytest.raises(ValueError, match="steady_tokens_per_s"):
        run_entry(tmp_path / "one", base, 5)
    with pytest.raises(FileNotFoundError, match=r"summary\.json"):
        run_entry(tmp_path / "missing", base, 5)


def test_window_math_on_fabricated_metrics(tmp_path):
    """--measure-last: tokens over the last N steps' summed time, over the ranks; the routing
    balance is the median of those steps' max_load_ratio; too few steps is an error."""
    run = tmp_path / "r"
    _summary(run, steady_tokens_per_s=1.0, ranks=2, tokens_per_step=1000)
    times = [9.0, 4.0, 2.0, 1.0, 1.5, 0.5]  # the first steps are slow (unbalanced routers)
    loads = [8.0, 6.0, 3.0, 1.2, 1.4, 1.1]
    lines = [
        json.dumps({"step": i + 1, "time_s": t, "moe": {"max_load_ratio": m}})
        for i, (t, m) in enumerate(zip(times, loads, strict=True))
    ]
    (run / "metrics.jsonl").write_text("\n".join([*lines, json.dumps({"eval": 1})]) + "\n")
    e = run_entry(run, 250.0, 5, measure_last=3)
    assert e["tokens_per_s"] == pytest.approx(3 * 1000 / 3.0 / 2)  # steps 4-6: 3 s
    assert e["efficiency"] == pytest.approx(500 / 250.0)
    assert e["max_load_ratio"] == 1.2
    assert run_entry(run, None, 5)["max_load_ratio"] == 1.4  # steps 2-6
    with pytest.raises(ValueError, match="needs that many timed steps after the first"):
        run_entry(run, None, 5, measure_last=6)
    with pytest.raises(ValueError, match=r"--measure-last must be in \[1, --steps=5\)"):
        main(["--nproc", "2", "--runs", "ep2_fp8", "--steps", "5", "--measure-last", "5",
              "--dry-run"])  # fmt: skip
    # The measured steps are one logging window: N divides --steps, and runs log every N.
    with pytest.raises(ValueError, match="and divide --steps, got 4"):
        main(["--nproc", "2", "--runs", "ep2_fp8", "--steps", "6", "--measure-last", "4",
              "--dry-run"])  # fmt: skip


@pytest.mark.slow
def test_cpu_run_records_every_entry(tmp_path):
    """The whole script on CPU (tiny preset, gloo): baseline, EP 2 with fresh JIT caches, a
    1F1B pipeline with its bubble, a dispatch bench that fails (recorded, the script goes on),
    the checkpoint run and its resume."""
    out, stale = tmp_path / "rec.json", tmp_path / "runs" / "ep2_bf16-caches" / "triton" / "old"
    stale.parent.mkdir(parents=True)
    stale.write_text("an earlier call's cache")
    rc = main(
        [
            "--nproc",
            "2",
            "--runs",
            "ep2_bf16",
            "pp2_1f1b_bf16",
            "dispatch_ep2",
            "--preset",
            "tiny",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--steps",
            "3",
            "--micro-batch",
            "1",
            "--num-chunks",
            "4",
            "--bubble-steps",
            "2",
            "--measure-last",
            "1",
            "--device",
            "cpu",
            "--baseline-precision",
            "bf16",  # FP8 is emulated on a CPU: 10x slower
            "--torchrun",
            f"{sys.executable} -m torch.distributed.run --standalone",
            "--out-dir",
            str(tmp_path / "runs"),
            "--json",
            str(out),
        ]
    )
    rec = json.loads(out.read_text())
    assert rc == 1  # the dispatch bench needs CUDA GPUs: recorded as failed, the rest goes on
    names = ["ep2_bf16", "pp2_1f1b_bf16", "dispatch_ep2"]
    assert rec["run_names"] == names, rec["run_names"]
    failed = rec["dispatch_ep2"]
    assert "CUDA" in failed["error"] and "bench dispatch" in failed["command"], failed
    # The checkpoint run, then a resume that loads its sharded state (at its last step).
    assert rec["resume_ok"] is True and rec["resume_step"] == 3, rec.get("resume_failure")
    assert "--resume" in rec["resume_command"] and "--overwrite" not in rec["resume_command"]
    assert rec["one_gpu_bf16_tokens_per_s"] > 0 and rec["device"] == "cpu"
    for name in ("ep2_bf16", "pp2_1f1b_bf16"):
        e = rec[name]
        assert e["tokens_per_s"] > 0 and e["efficiency"] > 0 and e["ranks"] == 2, e
    assert rec["ep2_bf16"]["max_load_ratio"] >= 1 and rec["one_gpu_max_load_ratio"] >= 1
    pp = rec["pp2_1f1b_bf16"]
    assert 0 < pp["bubble"] < 1 and 0 < pp["formula_bubble"] < 1
    assert rec["first_step_run"] == "ep2_bf16" and rec["first_step_s"] > 0
    assert not stale.exists() and "TRITON_CACHE_DIR=" in rec["ep2_bf16"]["command"]
    assert rec["checkpoint_save_s"] > 0 and len(rec["checkpoint_saves"]) >= 2
    for key in ("git_sha", "date", "torch", "command"):
        assert rec[key]
