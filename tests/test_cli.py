"""``ptxtrain`` command line: a short ``train`` run in-process, resume, and user errors."""

import json
import sys
from pathlib import Path

import pytest
import torch

from ptxtrain.cli import main
from tests._spawn import run_python

FAST = ["--batch-size", "4", "--seq-len", "32", "--lr", "1e-2", "--min-lr", "1e-3",
        "--warmup-steps", "2", "--eval-batches", "2", "--no-progress",
        "--device", "cpu"]  # fmt: skip


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "run"
    code = main(["train", "--steps", "10", "--eval-every", "5", "--sample-tokens", "16",
                 "--out", str(out), *FAST])  # fmt: skip
    return code, out


def test_train_smoke(smoke_run, capsys):
    code, out = smoke_run
    assert code == 0
    for name in ("config.json", "metrics.jsonl", "loss.png", "samples.txt", "summary.json"):
        assert (out / name).is_file(), name
    assert (out / "checkpoint" / "meta.json").is_file()
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, 11))
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5  # starts at ln(256) = 5.55; drops fast
    assert [r["step"] for r in recs if "val_loss" in r] == [5, 10]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["preset"] == "tiny" and cfg["train"]["steps"] == 10


def test_resume_takes_flags_from_the_checkpoint(smoke_run, capsys):
    out = smoke_run[1]
    # No schedule flags given: they come from the checkpoint, so nothing mismatches; the run
    # is already complete, so no step runs.
    assert (
        main(["train", "--resume", "--out", str(out), "--no-progress", "--sample-tokens", "0"]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["step"] == 10 and summary["steps_run"] == 0
    # A flag that contradicts the checkpoint is refused.
    capsys.readouterr()
    assert main(["train", "--resume", "--out", str(out), "--lr", "0.5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ptxtrain: error:") and "train.lr" in err


def _error(argv, capsys):
    capsys.readouterr()
    code = main(argv)
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--steps", "0"], "--steps: must be >= 1"),
        (["train", "--steps", "ten"], "expected an integer"),
        (["train", "--lr", "-1"], "--lr: must be > 0"),
        (["train", "--lr", "nan"], "finite"),
        (["train", "--preset", "huge"], "invalid choice: 'huge'"),
        (["train", "--precision", "fp16"], "invalid choice"),
        (["train", "--bogus"], "unrecognized arguments"),
        (["train", "--ep", "0"], "--ep: must be >= 1"),
        (["train", "--fp8-recipe", "bf16"], "invalid choice: 'bf16'"),
        (["train", "--grad-accum-steps", "0"], "--grad-accum-steps: must be >= 1, got 0"),
        (["train", "--grad-accum-steps", "-3"], "--grad-accum-steps: must be >= 1, got -3"),
        (["train", "--grad-accum-steps", "two"], "expected an integer, got 'two'"),
        (["train", "--grad-accum-steps", "1.5"], "expected an integer, got '1.5'"),
        (["train", "--config"], "--config: expected one argument"),
        (["frobnicate"], "invalid choice"),
        (["bench", "matmul"], "invalid choice: 'matmul'"),
        (["bench", "gemm", "--repeats", "0"], "--repeats: must be >= 1"),
        (["bench", "linear", "--recipe", "bf16"], "invalid choice: 'bf16'"),
        (["bench", "optim", "--numel", "0"], "--numel: must be >= 1"),
        (["bench", "optim", "--mix", "medium"], "invalid choice: 'medium'"),
        ([], "required"),
    ],
)
def test_bad_flags_exit_2(argv, needle, capsys):
    code, err = _error(argv, capsys)
    assert code == 2
    # The error line first, naming the command; then one line pointing to its --help.
    prog = " ".join(["ptxtrain", *argv[:1]]) if argv[:1] != ["frobnicate"] else "ptxtrain"
    first, *rest = err.splitlines()
    assert first.startswith(f"{prog}: error: ") and needle in first, err
    assert rest == [f"(see `{prog} --help`)"], err
    assert "usage:" not in err


def test_parser_error_line_comes_first(capsys):
    code, err = _error(["train", "--steps", "x"], capsys)
    assert code == 2
    assert err.splitlines() == [
        "ptxtrain train: error: argument --steps: expected an integer, got 'x'",
        "(see `ptxtrain train --help`)",
    ]
    # Unknown flags are found by the root parser; the message still names the subcommand.
    code, err = _error(["plot", "timeline", "run", "--nope", "1"], capsys)
    assert code == 2
    assert err.splitlines() == [
        "ptxtrain plot timeline: error: unrecognized arguments: --nope 1",
        "(see `ptxtrain plot timeline --help`)",
    ]
    # Errors found after parsing (here: a run folder in use) carry no --help pointer.
    code, err = _error(["train", "--resume", "--out", "/nonexistent/run", "--no-progress"], capsys)
    assert code == 2 and err.startswith("ptxtrain: error:") and "--help" not in err, err


@pytest.mark.parametrize(
    ("flags", "world", "what"),
    [(["--pp", "4"], 4, "--pp 4"), (["--ep", "2"], 2, "--ep 2"),
     (["--pp", "2", "--ep", "4"], 8, "--pp 2 --ep 4")],
)  # fmt: skip
def test_pp_ep_without_torchrun_says_all_that_is_missing(flags, world, what, capsys, monkeypatch):
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    argv = ["train", *flags, "--no-mtp", "--batch-size", "16", "--out", "my run", "--steps", "7"]
    code, err = _error(argv, capsys)
    assert code == 2 and "Traceback" not in err
    assert err.startswith(f"ptxtrain: error: {what} needs {world} processes"), err
    assert "RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in err
    assert "this process has none of them" in err
    # The command to run: the same arguments, shell-quoted.
    assert err.splitlines()[-1] == (
        f"  torchrun --nproc-per-node {world} -m ptxtrain train {' '.join(flags)} --no-mtp "
        "--batch-size 16 --out 'my run' --steps 7"
    )
    # Only some of torchrun's variables: the message names those missing.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29500")
    code, err = _error(argv, capsys)
    assert code == 2 and "this process has no LOCAL_RANK, WORLD_SIZE, MASTER_ADDR." in err, err


def test_user_errors_exit_2(tmp_path, smoke_run, capsys):
    out = str(tmp_path / "r")
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    cases = [
        (["--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["--data", str(empty)], "holds no *.txt or *.md"),
        (["--data", sys.executable], "of its bytes are not text"),  # an executable
        (["--seq-len", "100000"], "max_seq_len"),
        (["--resume"], "no checkpoint"),
        (["--min-lr", "1", "--lr", "0.1"], "--min-lr"),
        (["--ep", "2"], "--ep 2 needs 2 processes"),  # this process is a world of 1
        (["--ep", "3"], "--batch-size 16 must be divisible by --ep 3"),
        (["--ep", "2", "--pp", "2", "--no-mtp"], "--pp 2 --ep 2 needs 4 processes"),
        (["--seed", str(2**64)], "--seed must be < 2**64"),  # torch.Generator's limit
        (["--fp8-recipe", "deepseek_pow2"], "--fp8-recipe applies to --precision fp8"),
        (["--config", str(tmp_path / "none.json")], "--config " + str(tmp_path / "none.json")),
        (["--config", str(a_file)], "is not valid JSON"),
        (["--grad-accum-steps", "2", "--pp", "2", "--no-mtp"], "cannot run with --pp 2"),
        (["--out", str(a_file)], "is a file, not a run folder"),
        (["--out", str(a_file / "run")], "cannot be used as a run folder"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "no CUDA device"))
    for extra, needle in cases:
        code, err = _error(["train", "--out", out, "--no-progress", *extra], capsys)
        assert code == 2, (extra, err)
        assert err.startswith("ptxtrain: error:") and needle in err, (extra, err)
        assert "Traceback" not in err
    # The smoke run's folder is in use: a fresh run there is refused.
    code, err = _error(["train", "--out", str(smoke_run[1]), "--no-progress"], capsys)
    assert code == 2 and "--resume" in err


def test_corrupt_checkpoint_exit_2(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--eval-every", "0", "--sample-tokens", "0",
                 "--out", str(out), *FAST]) == 0  # fmt: skip
    path = out / "checkpoint" / "__0_0.distcp"
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))
    code, err = _error(["train", "--resume", "--out", str(out), "--no-progress"], capsys)
    assert code == 2
    assert "corrupt checkpoint" in err and "__0_0.distcp does not match its" in err
    assert "Traceback" not in err


def test_async_ckpt_run_commits_and_resumes(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--steps", "3", "--ckpt-every", "1", "--eval-every", "0",
            "--sample-tokens", "0", "--async-ckpt", "--out", str(out), *FAST]  # fmt: skip
    assert main(argv) == 0
    assert "checkpoints     : 3 saved (async)" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["async_ckpt"] is True
    saves = summary["checkpoint_saves"]
    # Every save was committed (total_s recorded) before the run ended.
    assert [s["step"] for s in saves] == [1, 2, 3]
    assert all(s["blocking_s"] >= 0 and s["total_s"] > 0 for s in saves)
    assert summary["checkpoint_save_s"] == pytest.approx(sum(s["blocking_s"] for s in saves))
    assert not list(out.glob(".checkpoint.tmp-*")) and not (out / "checkpoint.prev").exists()
    # --async-ckpt is a run flag: not remembered by the checkpoint, the resume continues.
    assert main(["train", "--resume", "--steps", "4", "--out", str(out), "--no-progress"]) == 2
    assert main(["train", "--resume", "--out", str(out), "--no-progress"]) == 0
    assert json.loads((out / "summary.json").read_text())["async_ckpt"] is False


def test_python_m_ptxtrain_help():
    r = run_python(["-m", "ptxtrain", "train", "--help"])
    assert r.returncode == 0, r.stderr
    for flag in ("--precision", "--steps", "--batch-size", "--seq-len", "--lr", "--min-lr",
                 "--warmup-steps", "--weight-decay", "--grad-clip", "--seed", "--device",
                 "--out", "--resume", "--eval-every", "--eval-batches", "--ckpt-every",
                 "--sample-tokens", "--data", "--config", "--grad-accum-steps",
                 "medium"):  # fmt: skip
        assert flag in r.stdout, flag
    help_text = " ".join(r.stdout.split())  # argparse wraps the help at the terminal width
    assert "--grad-accum-steps N micro-batches per optimizer step" in help_text
    assert "then --n-layers and --no-mtp on top" in help_text
    r = run_python(["-m", "ptxtrain", "train", "--steps", "-3"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("ptxtrain train: error: argument --steps: must be >= 1"), r.stderr


def test_resume_inherits_data_path(tmp_path, capsys):
    g = torch.Generator().manual_seed(4)
    words = ["to", "be", "or", "not", "that", "is", "the", "question", "\n"]
    idx = torch.randint(0, len(words), (3000,), generator=g).tolist()
    (tmp_path / "mine.txt").write_text(" ".join(words[i] for i in idx))
    out = tmp_path / "run"
    argv = ["train", "--data", str(tmp_path / "mine.txt"), "--steps", "2", "--eval-every", "0",
            "--sample-tokens", "0", "--out", str(out), *FAST]  # fmt: skip
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["corpus"]["source"] == str((tmp_path / "mine.txt").resolve())
    # --data is not repeated: the checkpoint remembers it (otherwise the corpus hash differs).
    resume = ["train", "--resume", "--out", str(out), "--no-progress", "--sample-tokens", "0"]
    code, err = _error(resume, capsys)
    assert code == 0, err
    # Another corpus is refused: its hash differs from the checkpoint's.
    (tmp_path / "other.txt").write_text("something else entirely " * 100)
    code, err = _error([*resume, "--data", str(tmp_path / "other.txt")], capsys)
    assert code == 2 and "corpus_sha256" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_is_a_clear_error(capsys):
    code, err = _error(["bench", "quant"], capsys)
    assert code == 2 and "no CUDA device is visible" in err and "Traceback" not in err


def _write_timeline(run_dir: Path, world: int, rng: torch.Generator) -> None:
    """A hand-made 1F1B timeline: per rank one F then one BW cell of random lengths (ns)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        f, b = (int(v) for v in torch.randint(10, 1000, (2,), generator=rng))
        head = {"type": "step", "step": 0, "schedule": "1f1b", "rank": rank, "world": world,
                "num_chunks": 1, "clock": "perf_counter_ns", "start_ns": 0,
                "end_ns": 2000 * world}  # fmt: skip
        cells = [("F", rank * 1000, f), ("BW", rank * 1000 + f, b)]
        lines = [head] + [
            {"type": "cell", "step": 0, "kind": k, "chunk": 0, "dir": 0, "start_ns": s,
             "end_ns": s + n} for k, s, n in cells
        ]  # fmt: skip
        (run_dir / f"timeline_rank{rank}.jsonl").write_text(
            "".join(json.dumps(rec) + "\n" for rec in lines)
        )


def test_plot_timeline(tmp_path, capsys):
    _write_timeline(tmp_path / "run", 3, torch.Generator().manual_seed(0))
    assert main(["plot", "timeline", str(tmp_path / "run"), "--out", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "bubble fraction: measured" in out and "formula (PP-1)(F+B)" in out, out
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_timeline_user_errors(tmp_path, capsys):
    code, err = _error(["plot", "timeline", str(tmp_path / "missing")], capsys)
    assert code == 2 and "does not exist" in err and "Traceback" not in err
    code, err = _error(["plot", "timeline", str(tmp_path)], capsys)
    assert code == 2 and "no timeline_rank" in err
    _write_timeline(tmp_path / "run", 2, torch.Generator().manual_seed(1))
    code, err = _error(["plot", "timeline", str(tmp_path / "run"), "--step", "1"], capsys)
    assert code == 2 and "out of range" in err
    code, err = _error(["plot"], capsys)
    assert code == 2


def test_resume_keeps_the_runs_eval_checkpoint_and_sample_flags(smoke_run):
    from ptxtrain.cli import _train_args_from, build_parser

    parse = build_parser().parse_args
    out = str(smoke_run[1])
    # The smoke run used --eval-every 5, --eval-batches 2 and --sample-tokens 16 (defaults 50, 8,
    # 200): a bare --resume must evaluate as it did, or the val losses after the resume would
    # be means over other batches at other steps than an uninterrupted run's.
    args = _train_args_from(parse(["train", "--resume", "--out", out]))
    assert (args.eval_every, args.eval_batches, args.sample_tokens) == (5, 2, 16)
    assert args.ckpt_every == 200  # not given to the smoke run: its default, remembered
    # A flag given with --resume still wins (these are not part of the trajectory).
    args = _train_args_from(parse(["train", "--resume", "--out", out, "--eval-batches", "3"]))
    assert args.eval_batches == 3 and args.eval_every == 5


def test_deterministic_flag_and_resume(smoke_run, tmp_path):
    from ptxtrain.cli import _train_args_from, build_parser

    parse = build_parser().parse_args
    assert _train_args_from(parse(["train", "--deterministic"])).deterministic is True
    assert _train_args_from(parse(["train"])).deterministic is False
    # The smoke run ran without it: a bare --resume stays off, the flag turns it on.
    out = str(smoke_run[1])
    assert _train_args_from(parse(["train", "--resume", "--out", out])).deterministic is False
    args = _train_args_from(parse(["train", "--resume", "--out", out, "--deterministic"]))
    assert args.deterministic is True
    # A run started with it keeps it on --resume unless --no-deterministic says otherwise.
    run = tmp_path / "det"
    argv = ["train", "--steps", "1", "--eval-every", "0", "--sample-tokens", "0",
            "--deterministic", "--out", str(run), *FAST]  # fmt: skip
    assert main(argv) == 0
    assert _train_args_from(parse(["train", "--resume", "--out", str(run)])).deterministic
    off = _train_args_from(parse(["train", "--resume", "--out", str(run), "--no-deterministic"]))
    assert off.deterministic is False


def test_ep_flag_reaches_train_args(smoke_run):
    from ptxtrain.cli import _train_args_from, build_parser

    parse = build_parser().parse_args
    assert _train_args_from(parse(["train", "--ep", "4"])).ep == 4
    assert _train_args_from(parse(["train"])).ep == 1
    # --ep is a run flag, not part of the trajectory: a resume takes it from the command line
    # (the checkpoint's names do not depend on the layout that wrote it).
    out = str(smoke_run[1])
    assert _train_args_from(parse(["train", "--resume", "--out", out, "--ep", "2"])).ep == 2
    assert _train_args_from(parse(["train", "--resume", "--out", out])).ep == 1


def test_n_layers_overrides_the_preset_and_resume_keeps_it(tmp_path, capsys):
    # tiny has 4 layers (1 dense); --n-layers 2 builds 2, and the checkpoint remembers it.
    out = tmp_path / "run"
    argv = ["train", "--n-layers", "2", "--steps", "2", "--eval-every", "0",
            "--sample-tokens", "0", "--out", str(out), *FAST]  # fmt: skip
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["n_layers"] == 2
    resume = ["train", "--resume", "--out", str(out), "--no-progress", "--sample-tokens", "0"]
    code, err = _error(resume, capsys)
    assert code == 0, err
    # Another depth contradicts the checkpoint.
    code, err = _error([*resume, "--n-layers", "3"], capsys)
    assert code == 2 and "n_layers" in err
    # A depth below 1 is refused by the parser, before any work.
    code, err = _error(["train", "--n-layers", "0", *FAST], capsys)
    assert code == 2 and "--n-layers: must be >= 1" in err


def test_config_file_grad_accum_and_resume(tmp_path, capsys):
    model = {"dim": 64, "n_layers": 2, "n_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32,
             "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
             "moe_inter_dim": 32, "n_routed_experts": 4, "n_expert_groups": 2,
             "n_limited_groups": 1}  # fmt: skip
    cfg = tmp_path / "model.json"
    cfg.write_text(json.dumps(model))
    out = tmp_path / "run"
    argv = ["train", "--config", str(cfg), "--grad-accum-steps", "2", "--steps", "2",
            "--eval-every", "0", "--sample-tokens", "0", "--out", str(out), *FAST]  # fmt: skip
    capsys.readouterr()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "MFU" in printed and "n/a (no dense BF16 peak known" in printed  # a CPU
    saved = json.loads((out / "config.json").read_text())
    assert {k: saved["model"][k] for k in model} == model
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grad_accum_steps"] == 2 and summary["tokens_per_step"] == 2 * 4 * 32
    assert summary["mfu"] is None and summary["flops_per_token"] > 0
    # --resume without --config takes the model (and the accumulation) from the checkpoint.
    from ptxtrain.cli import _train_args_from, build_parser

    resume = ["train", "--resume", "--out", str(out), "--no-progress", "--sample-tokens", "0"]
    args = _train_args_from(build_parser().parse_args(resume))
    assert args.config == saved["model"] and args.grad_accum_steps == 2
    code, err = _error(resume, capsys)
    assert code == 0, err
    assert main([*resume, "--config", str(cfg)]) == 0  # the same file: the same model
    # Another model or another accumulation contradicts the checkpoint.
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**model, "moe_inter_dim": 48}))
    code, err = _error([*resume, "--config", str(other)], capsys)
    assert code == 2 and "model.moe_inter_dim: checkpoint 32, now 48" in err, err
    code, err = _error([*resume, "--grad-accum-steps", "1"], capsys)
    assert code == 2 and "train.grad_accum_steps: checkpoint 2" in err, err
    # A bad file: refused before anything is built, the field named.
    cfg.write_text(json.dumps({**model, "n_activated_experts": 5}))
    fresh = tmp_path / "fresh"
    code, err = _error(["train", "--config", str(cfg), "--out", str(fresh), *FAST], capsys)
    assert code == 2 and err.startswith(f"ptxtrain: error: --config {cfg}: "), err
    assert "n_activated_experts" in err and "Traceback" not in err
    assert not fresh.exists()
