"""The multi-GPU scale-out record: EP / PP / PP x EP training runs against one GPU, in one call.

    python -m benchmarks.scale_medium --nproc 4 --steps 20 \\
        --runs ep2_fp8 ep4_fp8 ep4_bf16 pp4_dualpipe_fp8 pp4_dualpipev_fp8 pp4_1f1b_fp8 \\
        pp2ep2_fp8 --json benchmarks/results/h200x4/scale-medium.json

First the one-GPU FP8 baseline (``ptxtrain train``, ``--batch-size`` sequences of ``--seq-len``
tokens per step), then each named run under ``torchrun``, then one run with ``--ckpt-every``
and ``--async-ckpt`` (``--ckpt-run``, default the first named run). A run name is
``[pp<P>[_<schedule>]][_]ep<E>]_<precision>[_nvlink]`` (``ep4_fp8``, ``pp4_dualpipev_fp8``,
``pp2ep2_fp8``, ``ep8_fp8_nvlink``; the schedule defaults to dualpipe). Tokens per GPU:

- ``--ep E``: ``--batch-size`` x E sequences per step, so each EP rank trains on
  ``--batch-size`` sequences, as the one GPU does.
- ``--pp P``: ``--num-chunks`` micro-batches (default max(8, 2P): DualPipe needs 2P, even) of
  ``--micro-batch`` sequences per pipeline; with ``--ep E`` E pipelines, so ``--batch-size``
  micro-batch x chunks x E. DualPipeV gets ``--n-layers 2P`` where the preset has fewer layers.

Per run: ``tokens_per_s`` per GPU (the summary's ``steady_tokens_per_s``, which counts every
rank's tokens, over the ranks), ``efficiency`` (that over the one GPU's, both without the first
step), the median measured ``bubble`` and ``formula_bubble`` (DeepSeek-V3's) of the last
``--bubble-steps`` steps of a pipeline run (``--timeline``), ``peak_mem_gib`` (the largest
rank's) and ``max_load_ratio`` (the routing balance). ``--measure-last N`` takes tokens/s over
each run's last N steps instead (from ``metrics.jsonl``, logged every N steps so that they are
one logging window; N divides ``--steps``): the routers start unbalanced, and an EP run pays
for that (one rank's experts get most tokens) until the bias update catches up.
The record also holds ``first_step_s`` of the first EP run, which runs with empty JIT
caches (fresh ``PTXTRAIN_JIT_CACHE_DIR`` and ``TRITON_CACHE_DIR``), and the checkpoint run's
``checkpoint_save_s`` and ``async_step_slowdown``, then whether a ``--resume`` of that run
from its last checkpoint finished (``resume_ok``, ``resume_step``). A name ``dispatch_ep<E>``
runs ``ptxtrain bench dispatch`` on E ranks in DeepSeek-V3's setting (4,096 tokens per rank,
hidden 7,168, 256 experts, top-8) and records its rows (µs, GB/s and SMs per backend). A run
that fails is recorded with the last lines of its stderr and the others go on. The record is
rewritten after every call, so a call cut short keeps what finished. ``--dry-run`` prints the
commands.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.pp_report import bubble_record, read_summary

REPO = Path(__file__).resolve().parents[1]
SCHEDULES = ("1f1b", "dualpipe", "dualpipev")
_NAME = re.compile(
    r"^(?:pp(?P<pp>[1-9]\d*)(?:_(?P<schedule>1f1b|dualpipev|dualpipe))?_?)?"
    r"(?:ep(?P<ep>[1-9]\d*))?_(?P<precision>fp8|bf16)(?P<nvlink>_nvlink)?$"
)
ERROR_LINES = 20  # stderr lines kept for a failed run
_DISPATCH = re.compile(r"^dispatch_ep(?P<ep>[1-9]\d*)$")
# DeepSeek-V3's dispatch setting (DeepEP's normal-kernel benchmark): tokens per rank, hidden,
# routed experts, top-k.
DISPATCH_SIZES = ("--tokens", "4096", "--hidden", "7168", "--experts", "256", "--topk", "8")


def dispatch_ranks(name: str) -> int | None:
    """E of a ``dispatch_ep<E>`` name, else None."""
    m = _DISPATCH.match(name)
    return int(m["ep"]) if m else None


def dispatch_command(s: Settings, ranks: int, out: Path) -> list[str]:
    """``torchrun --nproc-per-node E -m ptxtrain bench dispatch`` at :data:`DISPATCH_SIZES`,
    its record written to ``out/dispatch.json``."""
    return [
        *s.torchrun,
        "--nproc-per-node",
        str(ranks),
        "-m",
        "ptxtrain",
        "bench",
        "dispatch",
        *DISPATCH_SIZES,
        "--json",
        str(out / "dispatch.json"),
    ]


def resume_command(ckpt_cmd: list[str]) -> list[str]:
    """The checkpoint run's command continued from its checkpoint: ``--resume`` in place of
    ``--overwrite`` (the same settings: a resume refuses others), so it loads the sharded
    state every rank wrote and finishes the run."""
    return [*(a for a in ckpt_cmd if a != "--overwrite"), "--resume"]


@dataclass(frozen=True)
class RunSpec:
    """One named run: ``pp`` pipeline ranks (1 = none) with ``schedule``, ``ep`` expert ranks."""

    name: str
    pp: int
    ep: int
    schedule: str | None
    precision: str
    nvlink: bool

    @property
    def ranks(self) -> int:
        return self.pp * self.ep


def parse_run(name: str) -> RunSpec:
    """The run a name stands for (``ep4_fp8``, ``pp4_dualpipev_fp8``, ``pp2ep2_fp8``, ...).

    Raises:
        ValueError: ``name`` does not match ``[pp<P>[_<schedule>]][_]ep<E>]_<fp8|bf16>[_nvlink]``,
            has neither ``pp`` nor ``ep`` above 1, or asks for ``_nvlink`` without ``ep`` > 1.
    """
    m = _NAME.match(name)
    pp = int(m["pp"]) if m and m["pp"] else 1
    ep = int(m["ep"]) if m and m["ep"] else 1
    if m is None or pp * ep < 2:
        raise ValueError(
            f"run name must be [pp<P>[_<schedule>]][ep<E>]_<fp8|bf16>[_nvlink] with P or E > 1 "
            f"(e.g. ep4_fp8, pp4_dualpipev_fp8, pp2ep2_fp8), got {name!r}"
        )
    if m["nvlink"] and ep < 2:
        raise ValueError(f"run {name!r}: _nvlink is an EP backend, it needs ep > 1")
    schedule = (m["schedule"] or "dualpipe") if pp > 1 else None
    return RunSpec(name, pp, ep, schedule, m["precision"], bool(m["nvlink"]))


@dataclass(frozen=True)
class Settings:
    """What every run shares: model, sizes, steps, device, launcher, run folders."""

    preset: str = "medium"
    batch_size: int = 8
    seq_len: int = 2048
    steps: int = 20
    micro_batch: int = 2
    num_chunks: int | None = None
    device: str | None = None
    torchrun: tuple[str, ...] = ("torchrun", "--standalone")
    baseline_precision: str = "fp8"
    out_dir: Path = Path("/tmp/scale-medium")
    bubble_steps: int = 5
    measure_last: int | None = None

    def common(self, precision: str) -> list[str]:
        flags = ["--preset", self.preset, "--no-mtp", "--precision", precision]
        flags += ["--seq-len", str(self.seq_len), "--steps", str(self.steps)]
        flags += ["--eval-every", "0", "--sample-tokens", "0", "--no-progress", "--overwrite"]
        if self.measure_last:  # step times are logged per window: the last one is the measured
            flags += ["--log-every", str(self.measure_last)]
        return flags + (["--device", self.device] if self.device else [])


def baseline_command(s: Settings) -> list[str]:
    """The one-GPU run (FP8 unless ``baseline_precision``): ``--batch-size`` sequences per
    step, no checkpoint."""
    out = str(s.out_dir / "1gpu")
    return [
        sys.executable,
        "-m",
        "ptxtrain",
        "train",
        *s.common(s.baseline_precision),
        "--batch-size",
        str(s.batch_size),
        "--no-checkpoint",
        "--out",
        out,
    ]


def parallel_flags(spec: RunSpec, s: Settings) -> list[str]:
    """``--ep`` / ``--pp`` / ``--schedule`` / ``--num-chunks`` / ``--batch-size`` (and
    ``--n-layers``, ``--ep-backend``, ``--timeline``) of ``spec``, per the module doc's sizes."""
    flags: list[str] = []
    if spec.pp == 1:
        flags += ["--batch-size", str(s.batch_size * spec.ep)]
    else:
        chunks = s.num_chunks or max(8, 2 * spec.pp)
        batch = s.micro_batch * chunks * spec.ep
        flags += ["--pp", str(spec.pp), "--schedule", spec.schedule, "--num-chunks", str(chunks)]
        flags += ["--batch-size", str(batch), "--timeline"]
        from ptxtrain.model import get_preset
        from ptxtrain.parallel.stages import num_stages

        # A decoder layer on every stage (the issues' DualPipeV at PP8 runs --n-layers 16).
        stages = num_stages(spec.schedule, spec.pp)
        if get_preset(s.preset).n_layers < stages:
            flags += ["--n-layers", str(stages)]
    if spec.ep > 1:
        flags += ["--ep", str(spec.ep)]
    if spec.nvlink:
        flags += ["--ep-backend", "nvlink"]
    return flags


def run_command(spec: RunSpec, s: Settings, out: Path, checkpoint: bool = False) -> list[str]:
    """``torchrun --nproc-per-node RANKS -m ptxtrain train ...`` for ``spec`` into ``out``;
    ``checkpoint``: with ``--ckpt-every`` (a third of the steps) and ``--async-ckpt``, every
    step logged (``async_step_slowdown`` per step), instead of ``--no-checkpoint``."""
    ckpt = (
        ["--ckpt-every", str(max(1, s.steps // 3)), "--async-ckpt", "--log-every", "1"]
        if checkpoint
        else ["--no-checkpoint"]
    )
    return [
        *s.torchrun,
        "--nproc-per-node",
        str(spec.ranks),
        "-m",
        "ptxtrain",
        "train",
        *s.common(spec.precision),
        *parallel_flags(spec, s),
        *ckpt,
        "--out",
        str(out),
    ]


def per_gpu_tokens_per_s(summary: dict) -> float:
    """Steady-state tokens/s per GPU: ``steady_tokens_per_s`` (every rank's tokens, the first
    step left out) over ``ranks``.

    Raises:
        ValueError: the summary has no steady throughput (fewer than 2 steps run).
    """
    steady = summary.get("steady_tokens_per_s")
    if steady is None:
        raise ValueError(f"summary of {summary.get('out')!r}: no steady_tokens_per_s (steps < 2)")
    return steady / summary.get("ranks", 1)


def run_files(run_dir: Path) -> tuple[dict, list[dict]]:
    """A finished run's ``summary.json`` and the records of ``metrics.jsonl`` that carry a
    step time (``time_s``), in step order ([] without the file).

    Raises:
        FileNotFoundError: no ``summary.json`` (the run did not finish).
    """
    from ptxtrain.train.metrics import read_metrics  # (torch: not for --dry-run)

    summary = read_summary(run_dir)
    path = run_dir / "metrics.jsonl"
    recs = read_metrics(path) if path.is_file() else []
    steps = sorted((r for r in recs if "step" in r and r.get("time_s")), key=lambda r: r["step"])
    return summary, steps


def run_tokens_per_s(summary: dict, steps: list[dict], measure_last: int | None) -> float:
    """Per-GPU tokens/s of a finished run (:func:`run_files`' values): over its last
    ``measure_last`` steps (their ``time_s``: past the first steps, where the routers are
    still unbalanced), or (None) every step after the first.

    Raises:
        ValueError: fewer than ``measure_last`` timed steps, or the first step among them; as
            :func:`per_gpu_tokens_per_s`.
    """
    if not measure_last:
        return per_gpu_tokens_per_s(summary)
    window = steps[-measure_last:]
    if len(window) < measure_last or window[0]["step"] <= 1:
        raise ValueError(
            f"{summary.get('out')!r}: --measure-last {measure_last} needs that many timed steps "
            f"after the first, metrics.jsonl has {len(steps)}"
        )
    tokens = summary["tokens_per_step"] * measure_last
    return tokens / sum(r["time_s"] for r in window) / summary.get("ranks", 1)


def max_load_ratio(steps: list[dict], last: int | None) -> float | None:
    """The median over the measured steps (the last ``last``, or all after the first) of the
    busiest expert's load over the mean (``moe.max_load_ratio``): 1 is balanced routing, E/k
    all tokens on the same experts. None without the records."""
    recs = [r for r in steps if r["step"] > 1]
    vals = sorted(r["moe"]["max_load_ratio"] for r in recs[-(last or len(recs)) :] if "moe" in r)
    return round(vals[len(vals) // 2], 3) if vals else None


def peak_mem_gib(summary: dict) -> float | None:
    """The largest rank's peak device memory in GiB (None on CPU: no rank measured one)."""
    peaks = [p for p in summary.get("peak_memory_bytes_per_rank") or () if p is not None]
    return round(max(peaks) / 2**30, 2) if peaks else None


def run_entry(
    run_dir: Path, base_per_gpu: float | None, bubble_steps: int, measure_last: int | None = None
) -> dict:
    """One run's numbers: ``tokens_per_s`` (per GPU, over the last ``measure_last`` steps or
    every step after the first), ``efficiency`` (over ``base_per_gpu``, None without it),
    ``bubble`` / ``formula_bubble`` / ``formula`` (None without timelines), ``peak_mem_gib``,
    ``max_load_ratio`` (routing balance over the measured steps), ``first_step_s``, ``ranks``,
    ``tokens_per_step``.

    Raises:
        FileNotFoundError, ValueError: from :func:`run_files`, :func:`run_tokens_per_s`.
    """
    summary, steps = run_files(run_dir)
    per_gpu = run_tokens_per_s(summary, steps, measure_last)
    b = bubble_record(run_dir, bubble_steps) or {}
    return {
        "tokens_per_s": round(per_gpu, 1),
        "efficiency": round(per_gpu / base_per_gpu, 4) if base_per_gpu else None,
        "bubble": b.get("measured_median"),
        "formula_bubble": b.get("predicted_median"),
        "formula": b.get("formula"),
        "peak_mem_gib": peak_mem_gib(summary),
        "max_load_ratio": max_load_ratio(steps, measure_last),
        "first_step_s": summary.get("first_step_s"),
        "ranks": summary.get("ranks", 1),
        "tokens_per_step": summary.get("tokens_per_step"),
    }


def execute(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> str | None:
    """Run ``cmd`` with stdout / stderr to ``log.stdout`` / ``log.stderr``; None on success,
    else the error: the last :data:`ERROR_LINES` lines of stderr (or the timeout)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    err_path = log.with_suffix(".stderr")
    with open(log.with_suffix(".stdout"), "w") as out, open(err_path, "w") as err:
        # Its own process group: a run past the timeout is killed with every rank it started.
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"timed out after {timeout:g} s"
    if rc == 0:
        return None
    lines = err_path.read_text(errors="replace").splitlines()
    # torchrun's own report of a failed rank (its traceback, the summary box) follows the ranks'
    # output, which holds the cause: the tail is taken before it.
    cut = next((i for i, line in enumerate(lines) if "failed (exitcode:" in line), len(lines))
    return f"exit status {rc}:\n" + "\n".join(lines[:cut][-ERROR_LINES:])


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return {**env, **(extra or {})}


def _fresh_caches(s: Settings, name: str) -> dict[str, str]:
    """Empty JIT caches for one run (its first step then pays every compile)."""
    root = s.out_dir / f"{name}-caches"
    return {
        "PTXTRAIN_JIT_CACHE_DIR": str(root / "ptxtrain-jit"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }


def plan(
    specs: list[RunSpec],
    s: Settings,
    ckpt_run: RunSpec | None,
    dispatch: tuple[tuple[str, int], ...] = (),
) -> list[dict]:
    """The calls in order: ``{key, name, cmd, out, env}``; ``key`` is ``baseline``, ``run``,
    ``dispatch`` (one per ``(name, ranks)`` of ``dispatch``), ``ckpt`` or ``resume``; ``env``
    (the extra variables) gives the first EP run empty JIT caches."""
    calls = [
        {
            "key": "baseline",
            "name": "1gpu",
            "cmd": baseline_command(s),
            "out": s.out_dir / "1gpu",
            "env": {},
        }
    ]
    first_ep = next((sp.name for sp in specs if sp.ep > 1), None)
    for sp in specs:
        out = s.out_dir / sp.name
        env = _fresh_caches(s, sp.name) if sp.name == first_ep else {}
        calls.append(
            {"key": "run", "name": sp.name, "cmd": run_command(sp, s, out), "out": out, "env": env}
        )
    for name, ranks in dispatch:
        out = s.out_dir / name
        cmd = dispatch_command(s, ranks, out)
        calls.append({"key": "dispatch", "name": name, "cmd": cmd, "out": out, "env": {}})
    if ckpt_run is not None:
        out = s.out_dir / f"ckpt-{ckpt_run.name}"
        cmd = run_command(ckpt_run, s, out, checkpoint=True)
        calls.append({"key": "ckpt", "name": ckpt_run.name, "cmd": cmd, "out": out, "env": {}})
        resume = resume_command(cmd)
        calls.append({"key": "resume", "name": ckpt_run.name, "cmd": resume, "out": out, "env": {}})
    return calls


def _shown(call: dict) -> str:
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in call["env"].items())
    return (env + " " if env else "") + shlex.join(call["cmd"])


def _checkpoint_fields(out: Path) -> dict:
    summary = read_summary(out)
    return {
        key: summary.get(key)
        for key in ("checkpoint_save_s", "async_step_slowdown", "checkpoint_saves")
    }


def _dispatch_fields(out: Path) -> dict:
    """The rows of ``ptxtrain bench dispatch``'s record in ``out`` (µs, GB/s, SMs per backend
    and op).

    Raises:
        FileNotFoundError: the bench wrote no record.
    """
    path = out / "dispatch.json"
    if not path.is_file():
        raise FileNotFoundError(f"{out}: no dispatch.json (did the bench finish?)")
    bench = json.loads(path.read_text())
    return {"settings": bench.get("settings"), "rows": bench.get("rows")}


def measure(calls: list[dict], s: Settings, timeout: float, on_update) -> dict:
    """Run ``calls`` (from :func:`plan`) and return the record's measured part;
    ``on_update(rec)`` after each call (the record so far)."""
    base_key = f"one_gpu_{s.baseline_precision}_tokens_per_s"
    rec: dict = {
        base_key: None,
        "first_step_s": None,
        "first_step_run": None,
        "checkpoint_save_s": None,
        "async_step_slowdown": None,
        "resume_ok": None,
        "resume_step": None,
        "runs": {},
    }
    base = None
    for call in calls:
        print(f"--- {call['name']} ({call['key']}): {_shown(call)}", flush=True)
        for cache in call["env"].values():  # empty, also when --out-dir holds an earlier call's
            shutil.rmtree(cache, ignore_errors=True)
        error = execute(
            call["cmd"], call["out"].with_suffix(".log"), _child_env(call["env"]), timeout
        )
        try:
            if error is not None:
                raise RuntimeError(error)
            if call["key"] == "baseline":
                rec["baseline_command"] = _shown(call)
                summary, steps = run_files(call["out"])
                base = run_tokens_per_s(summary, steps, s.measure_last)
                rec[base_key] = round(base, 1)
                rec["one_gpu_max_load_ratio"] = max_load_ratio(steps, s.measure_last)
            elif call["key"] == "ckpt":
                rec.update(_checkpoint_fields(call["out"]), checkpoint_command=_shown(call))
            elif call["key"] == "resume":
                summary = read_summary(call["out"])
                rec.update(resume_ok=True, resume_step=summary.get("step"))
                rec["resume_command"] = _shown(call)
            elif call["key"] == "dispatch":
                rec["runs"][call["name"]] = {
                    **_dispatch_fields(call["out"]),
                    "command": _shown(call),
                }
            else:
                entry = run_entry(call["out"], base, s.bubble_steps, s.measure_last)
                rec["runs"][call["name"]] = {**entry, "command": _shown(call)}
                if call["env"]:
                    rec.update(first_step_s=entry["first_step_s"], first_step_run=call["name"])
        except (RuntimeError, FileNotFoundError, ValueError) as e:
            print(f"    FAILED: {e}", flush=True)
            failed = {"command": _shown(call), "error": str(e)}
            if call["key"] in ("run", "dispatch"):
                rec["runs"][call["name"]] = failed
            else:
                rec[f"{call['key']}_failure"] = failed
                if call["key"] == "resume":
                    rec["resume_ok"] = False
        on_update(rec)
    return rec


def _print_table(rec: dict) -> None:
    base = next(k for k in rec if k.startswith("one_gpu_"))
    print(f"{base}: {rec[base]}")
    print(f"{'run':>20} {'tokens/s/GPU':>13} {'eff':>6} {'bubble':>7} {'formula':>7} {'GiB':>7}")
    for name, e in rec["runs"].items():
        if "error" in e:
            print(f"{name:>20} FAILED: {e['error'].splitlines()[0]}")
            continue
        if "rows" in e:  # a dispatch bench: its own table is in its log
            print(f"{name:>20} {len(e['rows'] or ())} rows (ptxtrain bench dispatch)")
            continue
        cells = [
            e["tokens_per_s"],
            e["efficiency"],
            e["bubble"],
            e["formula_bubble"],
            e["peak_mem_gib"],
        ]
        print(f"{name:>20} " + " ".join(f"{'-' if c is None else c:>7}" for c in cells))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, required=True, help="GPUs of the machine (recorded)")
    p.add_argument("--runs", nargs="+", required=True, metavar="NAME", help="run names")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run (>= 2)")
    p.add_argument("--json", help="write the record here (required unless --dry-run)")
    p.add_argument("--out-dir", default="/tmp/scale-medium", help="run folders and logs")
    p.add_argument("--preset", default="medium")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per GPU and step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per PP micro-batch")
    p.add_argument("--num-chunks", type=int, help="PP micro-batches per step (max(8, 2P))")
    p.add_argument("--device", choices=("cuda", "cpu"), help="ptxtrain train --device")
    p.add_argument(
        "--baseline-precision",
        choices=("fp8", "bf16"),
        default="fp8",
        help="the one-GPU run's (bf16: a CPU smoke run, whose FP8 is emulated)",
    )
    p.add_argument("--torchrun", default="torchrun --standalone", help="the launcher command")
    p.add_argument(
        "--ckpt-run",
        default=None,
        help="run name for the checkpoint run (default: the first of --runs; 'none' skips it)",
    )
    p.add_argument("--bubble-steps", type=int, default=5, help="last steps of the bubble")
    p.add_argument(
        "--measure-last",
        type=int,
        help="tokens/s over each run's last N steps (default: every step after the first); "
        "the routers start unbalanced, which an EP run pays for until the bias catches up",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def _settings(args: argparse.Namespace) -> Settings:
    for name in ("steps", "batch_size", "seq_len", "micro_batch", "bubble_steps"):
        low = 2 if name == "steps" else 1  # the steady throughput needs a step after the first
        got = getattr(args, name)
        if got < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {got}")
    last = args.measure_last
    if last is not None and not (1 <= last < args.steps and args.steps % last == 0):
        # A metrics record's time_s is its logging window's mean step time: with --log-every
        # N and N dividing --steps, the last N steps are exactly one window.
        raise ValueError(
            f"--measure-last must be in [1, --steps={args.steps}) and divide --steps, got {last}"
        )
    # The flags of the same names; the launcher is split into its words.
    same = ("preset", "batch_size", "seq_len", "steps", "micro_batch", "num_chunks", "device")
    return Settings(
        **{
            name: getattr(args, name)
            for name in (*same, "baseline_precision", "bubble_steps", "measure_last")
        },
        torchrun=tuple(shlex.split(args.torchrun)),
        out_dir=Path(args.out_dir),
    )


def main(argv: list[str] | None = None) -> int:
    """The CLI (module doc); returns 1 when a run failed, else 0.

    Raises:
        ValueError: a bad run name, a run with more ranks than ``--nproc``, a size below 1 or
            ``--steps`` below 2.
    """
    p = _parser()
    args = p.parse_args(argv)
    if not args.dry_run and not args.json:
        p.error("--json is required unless --dry-run")
    s = _settings(args)
    dispatch = tuple((n, r) for n in args.runs if (r := dispatch_ranks(n)) is not None)
    names = [n for n in args.runs if dispatch_ranks(n) is None]
    specs = [parse_run(n) for n in names]
    ckpt_name = args.ckpt_run or (names[0] if names else "none")
    ckpt = None if ckpt_name == "none" else parse_run(ckpt_name)
    sizes = [(sp.name, sp.ranks) for sp in [*specs, *([ckpt] if ckpt else [])]] + list(dispatch)
    for name, ranks in sizes:  # refused before any run starts
        if ranks > args.nproc:
            raise ValueError(f"run {name!r} needs {ranks} ranks, --nproc is {args.nproc}")
    calls = plan(specs, s, ckpt, dispatch)
    if args.dry_run:
        for call in calls:
            print(_shown(call))
        return 0
    from ptxtrain.bench.timing import environment

    command = shlex.join(["python", "-m", "benchmarks.scale_medium", *(argv or sys.argv[1:])])
    record = {
        **environment(),
        "command": command,
        "nproc": args.nproc,
        "preset": s.preset,
        "batch_size": s.batch_size,
        "seq_len": s.seq_len,
        "steps": s.steps,
    }

    def write(rec: dict) -> None:
        # The issues' record keeps one top-level key per run (ep2_fp8, pp4_dualpipe_fp8, ...);
        # "run_names" lists them in the order they ran.
        out = {**record, **{k: v for k, v in rec.items() if k != "runs"}}
        out.update(run_names=list(rec["runs"]), **rec["runs"])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    rec = measure(calls, s, args.timeout, on_update=write)
    _print_table(rec)
    failed = any("error" in e for e in rec["runs"].values()) or any(
        k.endswith("_failure") for k in rec
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
