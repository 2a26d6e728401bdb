"""The training job behind ``ptxtrain train``: one process, one device, byte-level LM.

Each step ``s`` (1-based, = optimizer steps completed afterwards) runs::

    lr      = lr_at(s - 1)                      linear warmup, then cosine decay to min_lr
    x, y    = corpus.get_batch("train", B·N, T, batch_generator(seed, s))
    for i in range(N):                          N = grad_accum_steps micro-batches of B sequences
        out = model(x[iB:(i+1)B], y[iB:(i+1)B]) total loss: LM + MTP + sequence-balance terms
        (out.loss / N).backward()               gradients add up to the B·N batch's mean loss
    norm    = optimizer.clip_grad_norm_(grad_clip)
    optimizer.step(); optimizer.zero_grad()
    stats   = model.update_router_biases()      auxiliary-loss-free balancing (report §2.1.2)

Every loss term is a mean over a micro-batch's tokens (LM, MTP) or sequences (the sequence-wise
balance loss), and the routers count the tokens of every forward until the bias update, so the
step equals one forward and backward of the B·N sequences up to rounding; the logged losses are
the means over the micro-batches. The model config is the preset's, with ``--config``'s fields,
then ``--n-layers`` and ``--no-mtp`` applied over it (:func:`model_config`). Every metrics record
and the summary carry the step's model TFLOP/s and MFU (:mod:`ptxtrain.train.mfu`).

The batch of a step depends on ``(seed, step)`` only, and a checkpoint holds the model, the
optimizer (FP32 master weights, BF16 moments) and the step, so a resumed run continues the
exact same trajectory (bitwise on CPU). Precision ``fp8`` swaps the eligible ``nn.Linear``
modules for FP8 ones with DeepSeek-V3's fine-grained recipe (report §3.3) before the optimizer
is built; the weights stay BF16 and the optimizer keeps their FP32 masters either way.

The run folder gets ``config.json``, ``metrics.jsonl``, ``loss.png``, ``checkpoint/`` (sharded,
:mod:`ptxtrain.train.checkpoint`; ``async_ckpt`` writes it in the background), ``samples.txt``
and ``summary.json``.

Where the run is spread over processes (``--pp``, ``--ep``), the loop stays the same:
:class:`~ptxtrain.train.strategy.ParallelStrategy` builds this rank's part of the model and
runs its step, writes and reads this rank's part of the checkpoints (layout-independent, so a
run resumes under another layout) and reduces the metrics over the ranks (its module doc
describes each layout).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import os
import platform
import shutil
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..data import VOCAB_SIZE, Corpus, batch_generator, load_corpus
from ..model.config import DeepSeekV3Config, get_preset
from .args import (
    EP_BACKENDS,
    FP8_RECIPES,
    PRECISIONS,
    RESUMED_RUN_FIELDS,
    TRAJECTORY_FIELDS,
    TrainArgs,
)
from .checkpoint import (
    CHECKPOINT_DIR,
    PREV_DIR,
    write_json_atomic,
)
from .evaluation import SAMPLE_COUNT, SAMPLE_PROMPT, SAMPLE_TEMPERATURE, evaluate
from .metrics import MetricsWriter, format_summary, plot_loss_curve, read_metrics
from .mfu import achieved_flops, model_flops_per_token, peak_bf16_flops
from .pipeline_layout import format_layout
from .progress import StepRecords
from .runtime import DEVICES, Printer, TrainConfigError, param_groups, resolve_device
from .strategy import PP_OVERLAP_ENV, ParallelStrategy

RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "samples.txt", "summary.json")


class _StopFlag:
    """The first Ctrl-C (SIGINT) asks the loop to stop after the step in flight, checkpointed;
    a second one interrupts at once (KeyboardInterrupt).

    A process whose SIGINT is ignored (a non-interactive shell's background job, ``cmd &``)
    keeps ignoring it, as Python does (no KeyboardInterrupt then): whoever launched it asked
    that a terminal's Ctrl-C not reach it."""

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def on_sigint(self):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            yield
            return
        try:
            previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: leave SIGINT alone
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def deterministic_mode(enabled: bool = True):
    """Run the block with PyTorch's deterministic algorithms; restores the previous settings.

    On CUDA, ``F.scaled_dot_product_attention``'s backward (cuDNN, Flash or memory-efficient
    attention) sums dQ in an order that depends on timing unless deterministic algorithms are
    on: a warn-only mode still runs the fast, nondeterministic kernel (PyTorch warns "cuDNN
    Attention defaults to a non-deterministic algorithm"). On an H200 one forward + backward of
    the ``small`` model in 30 gives other dQ-path gradients; a last-bit difference can flip an
    expert choice (about one FP8 training run in ten departs from the others by step 3).
    ptxtrain's own kernels (GEMMs, quantizers, MoE layout, dispatch / combine sums) are
    deterministic already. Cost on an H200 (``small``, 8 x 1024 tokens): 0.84-0.89x the
    tokens/s (cuDNN attention has no deterministic backward, PyTorch runs its memory-efficient
    kernel instead; index ops take sort-based paths).

    ``enabled=True``: ``torch.use_deterministic_algorithms(True)`` (an op without a
    deterministic implementation raises RuntimeError instead of running),
    ``torch.utils.deterministic.fill_uninitialized_memory = False`` (the NaN fill of every
    ``torch.empty`` costs time and changes no result here) and ``CUBLAS_WORKSPACE_CONFIG`` set
    to ``:4096:8`` when unset (PyTorch refuses cuBLAS calls in deterministic mode otherwise).
    ``enabled=False``: a no-op. Source: PyTorch "Reproducibility" notes; Megatron-LM's
    ``--deterministic-mode``.
    """
    if not enabled:
        yield
        return
    import torch.utils.deterministic as det

    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        det.fill_uninitialized_memory,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    det.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        det.fill_uninitialized_memory = saved[2]
        if saved[3] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)


def lr_at(i: int, args: TrainArgs) -> float:
    """Learning rate of the step with 0-based index ``i``: linear warmup, then cosine decay.

    ``lr * (i + 1) / warmup_steps`` for ``i < warmup_steps``; afterwards
    ``min_lr + (lr - min_lr) * (1 + cos(π p)) / 2`` with ``p = (i - warmup) / (steps - warmup)``.
    """
    if i < args.warmup_steps:
        return args.lr * (i + 1) / args.warmup_steps
    p = (i - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(p, 1.0)))


def _device_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"type": device.type, "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        idx = torch.cuda.current_device()
        info["name"] = torch.cuda.get_device_name(idx)
        info["capability"] = list(torch.cuda.get_device_capability(idx))
    else:
        info["name"] = platform.processor() or platform.machine()
    return info


def _versions() -> dict[str, str]:
    import numpy
    import safetensors

    return {
        "ptxtrain": __version__,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "numpy": numpy.__version__,
        "safetensors": safetensors.__version__,
        "python": platform.python_version(),
    }


def _bytes_per_param(b: dict | None) -> dict[str, float | None]:
    """Optimizer state (master + moments + step counters) and the whole training footprint
    (weights + FP32 grads + state), in bytes per parameter, measured after an update."""
    if not b or not b["numel"]:
        return {"optimizer_bytes_per_param": None, "training_bytes_per_param": None}
    state = b["master"] + b["exp_avg"] + b["exp_avg_sq"] + b["other"]
    return {
        "optimizer_bytes_per_param": state / b["numel"],
        "training_bytes_per_param": b["total"] / b["numel"],
    }


PROFILE_ENV = "PTXTRAIN_PROFILE_STEP"


def _profile_step() -> int:
    """The step ``PTXTRAIN_PROFILE_STEP`` asks to profile (-1: none).

    Raises:
        TrainConfigError: the variable is set to something other than a positive integer.
    """
    raw = os.environ.get(PROFILE_ENV, "").strip()
    if not raw:
        return -1
    if not raw.isdigit() or int(raw) < 1:
        raise TrainConfigError(f"{PROFILE_ENV} must be a step number >= 1, got {raw!r}")
    return int(raw)


def _start_profile():
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


def _write_profile(prof, run_dir: Path, step: int, rank: int) -> None:
    """Stop ``prof`` (synchronizing the device first) and write its tables, top ops by self CPU
    time, by call count and by device time, to ``RUN_DIR/profile_step{step}_rank{rank}.txt``."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.__exit__(None, None, None)
    ka = prof.key_averages()
    parts = [f"torch.profiler, step {step}, rank {rank}"]
    for key in ("self_cpu_time_total", "count", "self_device_time_total"):
        try:
            parts.append(
                f"--- by {key}\n" + ka.table(sort_by=key, row_limit=30, max_name_column_width=70)
            )
        except (KeyError, AttributeError, RuntimeError):  # a sort key this torch lacks
            continue
    (run_dir / f"profile_step{step}_rank{rank}.txt").write_text("\n\n".join(parts) + "\n")


def _prepare_run_dir(run_dir: Path, args: TrainArgs) -> None:
    """Check the run folder (``--resume``) or empty it of an old run's files and create it.

    Raises:
        TrainConfigError: ``--resume`` without the folder; a run there without ``--resume`` /
            ``--overwrite``; ``--out`` that is (or lies under) a file, or cannot be written.
    """
    if args.resume:
        if not run_dir.is_dir():
            raise TrainConfigError(f"--resume: run folder {run_dir} does not exist")
        return
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainConfigError(f"--out {run_dir} is a file, not a run folder")
    in_use = [n for n in (CHECKPOINT_DIR, PREV_DIR, "metrics.jsonl") if (run_dir / n).exists()]
    if in_use and not args.overwrite:
        raise TrainConfigError(
            f"run folder {run_dir} already holds a run ({', '.join(in_use)}); pass --resume "
            "to continue it, --overwrite to replace it, or --out for a new folder"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in (CHECKPOINT_DIR, PREV_DIR):
            if (run_dir / name).is_dir():
                shutil.rmtree(run_dir / name)
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        for path in (*run_dir.glob("timeline_rank*.jsonl"), run_dir / "timeline.png"):
            path.unlink(missing_ok=True)
    except OSError as e:
        raise TrainConfigError(
            f"--out {run_dir} cannot be used as a run folder: {e.strerror or e}"
        ) from None


_JSON_TYPES = {
    dict: "object", list: "array", str: "string", int: "number", float: "number",
    bool: "boolean", type(None): "null",
}  # fmt: skip


def _read_config_fields(path: str) -> dict[str, Any]:
    """The JSON object in ``path`` (``--config``), checked for unknown or repeated fields.

    Raises:
        TrainConfigError: the file cannot be read, is not JSON, holds something other than an
            object, repeats a field or names one ``DeepSeekV3Config`` does not have; the
            message names the file (and the field).
    """
    where = f"--config {path}"
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise TrainConfigError(f"{where}: cannot read the file: {reason}") from None

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:  # json keeps the last silently; which one was meant is unclear
                raise TrainConfigError(f"{where}: field {key!r} is given more than once")
            seen.add(key)
        return dict(pairs)

    try:
        fields = json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise TrainConfigError(
            f"{where} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})"
        ) from None
    if not isinstance(fields, dict):
        raise TrainConfigError(
            f"{where} must hold one JSON object of DeepSeekV3Config fields, e.g. "
            f'{{"dim": 256, "n_layers": 6}}; got a JSON {_JSON_TYPES.get(type(fields), "value")}'
        )
    names = [f.name for f in dataclasses.fields(DeepSeekV3Config)]
    for key in fields:
        if key not in names:
            near = difflib.get_close_matches(key, names, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TrainConfigError(
                f"{where}: unknown field {key!r}{hint}; DeepSeekV3Config's fields: {names}"
            )
    return fields


def model_config(
    args: TrainArgs, model_overrides: dict[str, Any] | None = None
) -> DeepSeekV3Config:
    """The run's ``DeepSeekV3Config``: the preset's, then each of these over it, in order:
    ``args.config`` (``--config``: a JSON file's fields, or a dict), ``model_overrides``,
    ``args.n_layers`` (``--n-layers``), ``mtp_depth = 0`` when ``not args.mtp`` (``--no-mtp``).

    Reads the file but builds nothing. Does not call ``args.validate()``.

    Raises:
        TrainConfigError: an unknown preset; a ``vocab_size`` below the corpus's 256 byte
            tokens; ``--config`` unreadable, not a JSON object, or
            with an unknown or repeated field; a field of the wrong type or out of range, or a
            model that is inconsistent (e.g. ``n_activated_experts > n_routed_experts``) after a
            step; the message names the step (``--config FILE``, ``--n-layers``, ...) and the
            field.
    """
    try:
        config = get_preset(args.preset)
    except ValueError as e:
        raise TrainConfigError(str(e)) from None
    overlays: list[tuple[str, dict[str, Any]]] = []  # (where the fields come from, fields)
    if isinstance(args.config, dict):
        overlays.append(("config", args.config))
    elif args.config is not None:
        overlays.append((f"--config {args.config}", _read_config_fields(args.config)))
    if model_overrides:
        overlays.append(("model_overrides", model_overrides))
    if args.n_layers is not None:
        overlays.append((f"--n-layers {args.n_layers}", {"n_layers": args.n_layers}))
    if not args.mtp:
        overlays.append(("--no-mtp", {"mtp_depth": 0}))
    for where, fields in overlays:
        try:
            config = DeepSeekV3Config.from_dict({**config.to_dict(), **fields})
        except (ValueError, TypeError) as e:
            raise TrainConfigError(f"{where}: {e}") from None
    if config.vocab_size < VOCAB_SIZE:  # the model checks ids on a GPU only asynchronously
        raise TrainConfigError(
            f"vocab_size {config.vocab_size} is below the {VOCAB_SIZE} byte tokens the corpus "
            f"holds; the model needs vocab_size >= {VOCAB_SIZE}"
        )
    return config


def train(
    args: TrainArgs,
    *,
    model_overrides: dict[str, Any] | None = None,
    param_dtype: torch.dtype = torch.bfloat16,
) -> dict[str, Any]:
    """Train (or resume) a model on the byte corpus and return the run summary.

    Args:
        args: the run's arguments (validated here).
        model_overrides: fields replacing those of the preset's ``DeepSeekV3Config`` (e.g. a
            smaller model for tests), applied after ``args.config`` (:func:`model_config`);
            they are part of the checkpointed config.
        param_dtype: floating dtype the model is built in (bf16 for training; fp32 to compare a
            pipeline run with the single-process one at fp32 precision).

    With ``args.pp > 1`` (``args.ep > 1``) this runs one pipeline (expert-parallel) rank: call
    it on every rank (``torchrun``, or inside an initialized default process group of ``pp``
    (``ep``) ranks; ``pp * ep`` ranks with both, see the module doc). Rank 0 returns the
    summary below; the other ranks return ``{"out", "rank", "step", "losses"}`` and write
    nothing.

    Returns:
        A JSON-able dict: ``out``, ``preset``, ``precision``, ``device``, ``step`` (steps done
        in total), ``steps_run`` / ``tokens_run`` / ``time_s`` / ``tokens_per_s`` (this call),
        ``first_step_s`` (the first step of this call: it includes the JIT compiles) and
        ``steady_tokens_per_s`` (the steps after it; None with fewer than 2 steps),
        ``tokens_per_step`` (``batch_size * grad_accum_steps * seq_len``),
        ``grad_accum_steps``, ``flops_per_token``
        (:func:`~ptxtrain.train.mfu.model_flops_per_token`), ``peak_tflops`` (one device's
        dense BF16 peak; None when unknown, e.g. on CPU), ``model_tflops`` and ``mfu`` (per
        device, from ``steady_tokens_per_s``; None when that is, ``mfu`` also without a peak),
        ``losses`` (train loss of every step of the run, from step 1),
        ``first_loss``, ``last_loss``, ``best_val_loss``, ``last_val_loss``,
        ``unigram_entropy`` (nats/byte), ``optimizer_bytes_per_param`` (FP32 master + BF16
        moments), ``training_bytes_per_param`` (plus weights and FP32 grads; both None when no
        step ran in this call), ``peak_memory_bytes`` (rank 0's; CUDA only, else None),
        ``peak_memory_bytes_per_rank`` (a list in rank order; one entry without torchrun),
        ``ranks`` (processes of the run), ``async_ckpt``, ``checkpoint_saves`` (each save of
        this call: ``step``, ``blocking_s`` = seconds the loop waited for it, the whole save or
        with ``async_ckpt`` the copy to CPU plus any wait for the write, ``total_s`` = seconds
        until it was committed), ``checkpoint_save_s`` (the blocking seconds summed; None
        without a save), ``async_step_slowdown`` (the mean time of this call's steps that
        overlapped a background write over that of the others after the first; None without
        both; per step with ``log_every`` 1, else per logging window), ``params`` and
        ``samples``. It is also written to
        ``summary.json`` and printed as a table.

    Raises:
        TrainConfigError: invalid arguments or overrides, an unknown preset, a bad ``--config``
            (see :func:`model_config`; raised before anything is built or written), an
            unusable device or run folder; ``grad_accum_steps > 1`` with ``pp > 1``; with
            ``pp > 1`` also a world size other than ``pp``, a model that
            cannot be cut into the schedule's stages (MTP on, tied embeddings, layer count) or a
            bad schedule / ``num_chunks`` combination, raised on every rank; with ``ep > 1`` a
            world size other than ``ep``, ``n_routed_experts`` or ``batch_size`` not divisible
            by ``ep``, or a model without MoE layers; with both a world size other than
            ``pp * ep`` or ``batch_size`` not divisible by ``ep * num_chunks``;
            ``ep_backend="nvlink"`` without ``ep > 1``, off CUDA, on a non-NCCL process group or
            with DualPipe / DualPipeV under ``PTXTRAIN_PP_OVERLAP=1`` (before any communication).
        CorpusError: ``--data`` missing, unreadable, empty or too short for ``seq_len``.
        CheckpointError: ``resume`` with a missing, corrupt or mismatched checkpoint (with
            ``pp > 1`` or ``ep > 1`` raised on every rank).
        OSError: a checkpoint could not be written (on every rank; the previous one stays).
        FloatingPointError: the train loss became NaN or infinite.

    A first Ctrl-C stops the run after the step in flight and checkpoints it (the summary then
    has ``interrupted=True``); a second one raises ``KeyboardInterrupt`` at once.
    """
    args.validate()
    config = model_config(args, model_overrides)
    if args.seq_len > config.max_seq_len:
        raise TrainConfigError(
            f"--seq-len {args.seq_len} exceeds the model's max_seq_len {config.max_seq_len} "
            f"(preset {args.preset}{', with --config' if args.config is not None else ''})"
        )
    strategy = ParallelStrategy(args, config, param_dtype, resolve_device(args.device))
    with deterministic_mode(args.deterministic):
        return _train(args, config, strategy, model_overrides)


def _train(args: TrainArgs, config, strategy: ParallelStrategy, model_overrides) -> dict[str, Any]:
    log, run_dir = strategy.log, args.run_dir()
    corpus, corpus_info = _load_corpus(args, log)
    strategy.on_lead(_prepare_run_dir, run_dir, args)
    model, _ = strategy.build(config)
    ckpt_config = {
        "model": config.to_dict(),
        "train": args.trajectory(),
        "corpus_sha256": corpus_info["sha256"],
    }
    ckpt_kw = dict(config=ckpt_config, extra=_resume_extra(args, strategy.describe()))
    start = 0
    if args.resume:
        meta = strategy.load(run_dir, expected_config=ckpt_config)
        start = int(meta["step"])
        log(f"resumed from {meta['path']} at step {start}")
    if strategy.is_lead:
        _write_config(run_dir, args, config, model, corpus_info, strategy, model_overrides, start)
    flops_per_token = model_flops_per_token(config, args.seq_len)
    log(_model_line(args, model, flops_per_token, strategy, run_dir))
    strategy.reset_peak_memory()
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    batch = args.batch_size * args.grad_accum_steps  # sequences per step
    t0 = time.perf_counter()
    writer = None
    if strategy.is_lead:
        keep = start if args.resume else None
        writer = MetricsWriter(run_dir / "metrics.jsonl", keep_until=keep)
    timeline = strategy.new_timeline()
    log.bar = bar = _progress_bar(args, start, strategy.is_lead)
    rec = StepRecords(
        writer, bar, batch * args.seq_len, flops_per_token, peak_bf16_flops(strategy.device),
        strategy.world_size, start,
    )  # fmt: skip
    stop, profile_at = _StopFlag(), _profile_step()

    def save(step: int) -> None:
        if args.checkpoint:
            with strategy.watch.phase("checkpoint: every rank writing its shards"):
                strategy.save(run_dir, step, **ckpt_kw)
        rec.last_saved = step

    try:
        with stop.on_sigint():
            for step in range(start + 1, end + 1):
                prof = _start_profile() if step == profile_at else None
                rec.begin_step()
                lr = lr_at(step - 1, args)
                x, y = corpus.get_batch(
                    "train", batch, args.seq_len, batch_generator(args.seed, step)
                )
                saving = strategy.saving  # a checkpoint write overlaps this step
                values = strategy.step(x, y, lr, timeline, step=step)
                rec.add(step, lr, values, ckpt_writing=saving)
                if prof is not None:
                    _write_profile(prof, run_dir, step, strategy.rank)
                eval_now = bool(
                    args.eval_every and (step % args.eval_every == 0 or step == args.steps)
                )
                checkpoint_now = bool(args.ckpt_every and step % args.ckpt_every == 0)
                stopping = strategy.agree_to_stop(stop.requested)
                if (
                    rec.first_step_s is None  # this call's first step: timed on its own
                    or step % args.log_every == 0
                    or eval_now
                    or checkpoint_now
                    or stopping
                    or step == end
                ):
                    rec.flush(partial(strategy.evaluate, corpus) if eval_now else None, run_dir)
                if stopping:
                    break
                if checkpoint_now and step < end:
                    save(step)
            rec.flush(None, run_dir)
            if rec.done > rec.last_saved:
                save(rec.done)
            strategy.wait_for_save()  # the run ends with its last checkpoint committed
    finally:
        strategy.wait_for_save(raise_errors=False)  # an exception is leaving: commit, quietly
        bar.close()
        log.bar = None
        if writer is not None:
            writer.close()
        strategy.close()
    if timeline is not None:
        timeline.write(run_dir)
    if stop.requested:
        saved = "checkpoint saved, continue with --resume" if args.checkpoint else "no checkpoint"
        log(f"interrupted: stopped after step {rec.done}; {saved}")
    wall = time.perf_counter() - t0
    samples, peaks = strategy.finish()
    if not strategy.is_lead:  # the other ranks write nothing
        return {"out": str(run_dir), "rank": strategy.rank, "step": rec.done, "losses": rec.losses}
    records = read_metrics(run_dir / "metrics.jsonl")
    entropy = corpus_info["unigram_entropy_nats"]
    title = f"ptxtrain {args.preset} {args.precision}: byte-level LM"
    plot_loss_curve(records, run_dir / "loss.png", entropy=entropy, title=title)
    _write_samples(run_dir, samples, rec.done, log)
    summary = _summary(args, strategy, rec, records, start, wall, entropy, stop.requested)
    summary.update(
        peak_memory_bytes=peaks[0],
        peak_memory_bytes_per_rank=peaks,
        ranks=len(peaks),  # processes of the run (PP x EP under torchrun)
        params=model.num_params(),
        pipeline=strategy.describe(),
        ep=args.ep,
        samples=samples,
    )
    write_json_atomic(run_dir / "summary.json", summary)
    log("\n" + format_summary(summary))
    return summary


def _load_corpus(args: TrainArgs, log: Printer) -> tuple[Corpus, dict[str, Any]]:
    """The run's corpus (``--data``, checked against ``seq_len``) and its description."""
    t_load = time.perf_counter()
    corpus = load_corpus(args.data)
    corpus.check_seq_len(args.seq_len)
    info = corpus.describe()
    log(
        f"corpus: {info['source']} ({len(corpus.files)} documents, "
        f"{info['bytes']:,} bytes: {info['train_bytes']:,} train / "
        f"{info['val_bytes']:,} val) loaded in {time.perf_counter() - t_load:.2f} s; "
        f"byte-unigram entropy {info['unigram_entropy_nats']:.4f} nats/byte"
    )
    return corpus, info


def _resume_extra(args: TrainArgs, pipeline: dict[str, Any] | None) -> dict[str, Any]:
    """The checkpoint's ``extra``: not compared on resume (the corpus hash is); lets
    ``ptxtrain train --resume`` find the data, keep the run's evaluation / checkpoint / sample
    settings and, under the same ``--pp`` and ``--schedule``, the stage layout (``pipeline``:
    :meth:`ParallelStrategy.describe`)."""
    data_path = str(Path(args.data).expanduser().resolve()) if args.data else None
    run = {k: getattr(args, k) for k in RESUMED_RUN_FIELDS}
    return {"data": data_path, "run": run, "pipeline": pipeline}


def _write_config(
    run_dir: Path, args: TrainArgs, config, model, corpus_info, strategy, model_overrides, start
) -> None:
    """``config.json``: the model, the arguments, the corpus, the device and the versions."""
    write_json_atomic(
        run_dir / "config.json",
        {
            "model": config.to_dict(),
            "preset": args.preset,
            "model_overrides": model_overrides or {},
            "train": {k: v for k, v in dataclasses.asdict(args).items() if k != "progress"},
            "params": model.num_params(),
            "corpus": corpus_info,
            "device": _device_info(strategy.device),
            "versions": _versions(),
            "resumed_from_step": start if args.resume else None,
            "pipeline": strategy.describe(),
            "ep": args.ep,
        },
    )


def _model_line(args: TrainArgs, model, flops_per_token: float, strategy, run_dir: Path) -> str:
    """The log line that describes the model, the numerics, the device and the run folder."""
    params = model.num_params()
    return (
        f"model: {args.preset}{f' + {args.config}' if isinstance(args.config, str) else ''} "
        f"({params['total']:,} params, {params['activated']:,} activated "
        f"per token; {flops_per_token / 1e9:.3g} GFLOP/token), precision {args.precision}"
        f"{f' ({args.fp8_recipe})' if args.precision == 'fp8' else ''}, device {strategy.device}"
        f"{' (deterministic algorithms)' if args.deterministic else ''}; "
        f"run folder {run_dir}"
        + strategy.note()
        + _layout_note(strategy.describe(), args.pp_layout is not None)
        + (
            f"; {args.grad_accum_steps} micro-batches of {args.batch_size} sequences per step"
            if args.grad_accum_steps > 1
            else ""
        )
    )


def _layout_note(pipeline: dict[str, Any] | None, given: bool) -> str:
    """``"; pipeline stages of 2,3,3,2 decoder layers (...)"`` for the run's first log line
    (how the layout was chosen in brackets), or "" without a pipeline."""
    if pipeline is None:
        return ""
    how = "--pp-layout or the resumed checkpoint's"
    if not given:
        how = "cost-balanced, --pp-layout overrides"
    return f"; pipeline stages of {format_layout(pipeline['layout'])} decoder layers ({how})"


def _progress_bar(args: TrainArgs, start: int, lead: bool):
    from tqdm.auto import tqdm

    return tqdm(
        total=args.steps,
        initial=start,
        desc="train",
        unit="step",
        disable=not (args.progress and lead),
        dynamic_ncols=True,
        file=sys.stdout,
    )


def _write_samples(run_dir: Path, samples: list[str], step: int, log: Printer) -> None:
    """``samples.txt`` and the log's copy of the end-of-run samples (none: nothing)."""
    if not samples:
        return
    text = "".join(
        f"--- sample {i + 1} (prompt {SAMPLE_PROMPT!r}, temperature {SAMPLE_TEMPERATURE}, "
        f"step {step}) ---\n{s}\n\n"
        for i, s in enumerate(samples)
    )
    (run_dir / "samples.txt").write_text(text, encoding="utf-8")
    log(f"\nsamples (step {step}):\n" + text.rstrip())


def _summary(
    args: TrainArgs, strategy, rec: StepRecords, records, start, wall, entropy, interrupted
) -> dict[str, Any]:
    """The summary's throughput, loss and footprint fields (see :func:`train`)."""
    tokens_per_step = rec.tokens_per_step
    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    steps_run = rec.done - start
    step_time, first_step_s = rec.step_time, rec.first_step_s
    steady = (
        (steps_run - 1) * tokens_per_step / (step_time - first_step_s)
        if steps_run > 1 and step_time > first_step_s
        else None
    )
    return {
        "out": str(args.run_dir()),
        "preset": args.preset,
        "precision": args.precision,
        "device": str(strategy.device),
        "step": rec.done,
        "interrupted": interrupted,
        "steps_run": steps_run,
        "tokens_per_step": tokens_per_step,
        "grad_accum_steps": args.grad_accum_steps,
        "tokens_run": steps_run * tokens_per_step,
        "time_s": wall,
        "train_time_s": step_time,
        "tokens_per_s": steps_run * tokens_per_step / step_time if step_time else 0.0,
        "first_step_s": first_step_s,
        "steady_tokens_per_s": steady,
        "flops_per_token": rec.flops_per_token,
        "peak_tflops": rec.peak / 1e12 if rec.peak else None,
        **achieved_flops(rec.flops_per_token, steady, rec.peak, rec.devices),  # model_tflops, mfu
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "best_val_loss": min(vals) if vals else None,
        "last_val_loss": vals[-1] if vals else None,
        "unigram_entropy": entropy,
        **_bytes_per_param(strategy.state_bytes),
        **_checkpoint_times(args, strategy, records, start),
    }


def _checkpoint_times(args: TrainArgs, strategy, records, start: int) -> dict[str, Any]:
    """The summary's checkpoint fields (see :func:`train`)."""
    saves = strategy.checkpoint_times()
    later = [r for r in records if r["step"] > start][1:]  # this call's steps after its first
    busy = [r["time_s"] for r in later if r.get("ckpt_writing")]
    idle = [r["time_s"] for r in later if not r.get("ckpt_writing")]
    slowdown = (sum(busy) / len(busy)) / (sum(idle) / len(idle)) if busy and idle else None
    return {
        "async_ckpt": args.async_ckpt,
        "checkpoint_saves": saves,
        "checkpoint_save_s": sum(s["blocking_s"] for s in saves) if saves else None,
        "async_step_slowdown": slowdown,
    }


__all__ = [
    "DEVICES",
    "EP_BACKENDS",
    "FP8_RECIPES",
    "PP_OVERLAP_ENV",
    "PRECISIONS",
    "RESUMED_RUN_FIELDS",
    "SAMPLE_COUNT",
    "SAMPLE_PROMPT",
    "TRAJECTORY_FIELDS",
    "TrainArgs",
    "TrainConfigError",
    "deterministic_mode",
    "evaluate",
    "lr_at",
    "model_config",
    "param_groups",
    "resolve_device",
    "train",
]
