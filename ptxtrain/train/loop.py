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

The run folder gets ``config.json``, ``metrics.jsonl``, ``loss.png``, ``checkpoint/``,
``samples.txt`` and ``summary.json``.

Pipeline parallelism (``pp > 1``, one process per rank under ``torchrun``): the forward/backward
above becomes one schedule step over ``num_chunks`` micro-batches (1F1B, DualPipe or DualPipeV;
see :mod:`ptxtrain.train.pipeline`), followed by the cross-rank gradient reduction and a global
clipping norm. Rank 0 writes the run folder; with ``timeline`` every rank writes
``timeline_rank{r}.jsonl``. Checkpoints gather every stage's parameters, buffers (router biases)
and optimizer state to rank 0 by parameter name, each stage from its owner (a DualPipe mirror copy
is identical and written once), so rank 0 writes the single-process layout: a pipeline run resumes
with any ``--pp`` / ``--schedule`` or none, and a single-process checkpoint resumes under
``--pp``. On ``--resume`` every rank loads the full files, the full model and its own stages'
optimizer state; with the same pipeline the resumed losses are bitwise those of a straight run.

Expert parallelism (``ep > 1``, one process per rank under ``torchrun``; DeepSeek-V3 report
§3.2.2): every rank builds the same full model (same seed), then keeps ``1/ep`` of every MoE
layer's routed experts (:meth:`~ptxtrain.model.DeepSeekV3.enable_expert_parallel`); tokens reach
their experts through :class:`ptxtrain.ep.Buffer` dispatch/combine. The ranks are also data
parallel: rank ``r`` trains on sequences ``[r·B/ep, (r+1)·B/ep)`` of the step's batch, so the
global batch is the single-process one. After backward the replicated parameters' gradients are
averaged over the ranks and the expert gradients (which already sum every rank's tokens) are
divided by ``ep``, which gives the single-process gradient of the batch-mean loss; clipping uses
the global norm; the router bias update uses the global expert load. Losses, evaluation and
samples are computed collectively and agree on every rank. Checkpoints gather the expert shards
to rank 0, which writes the single-process layout (so a run can be resumed with another ``ep``);
every rank loads the full files and keeps its slice.

Both (``pp > 1`` and ``ep > 1``, ``pp · ep`` processes; DeepSeek-V3's layout, EP inside a
pipeline stage): rank ``r = pipeline_rank · ep + ep_rank``
(:func:`~ptxtrain.train.pipeline.pipeline_groups`). The ``pp`` ranks of one ``ep_rank`` run the
schedule together on sequences ``[e·B/ep, (e+1)·B/ep)`` of the batch (``num_chunks``
micro-batches of them); the ``ep`` ranks of one pipeline rank hold the same stages with ``1/ep``
of the experts each and exchange tokens inside the MoE layers. After the schedule: DualPipe's
mirror sum, then the EP average / expert scaling above; the clipping norm, the losses and the
router load are reduced over both groups. Evaluation and sampling run on the ``ep`` ranks of
pipeline rank 0 (each gathers the stages of its own pipeline, then they run the model
collectively); with ``timeline`` only the pipeline of ``ep_rank`` 0 records (files named by
pipeline rank). Checkpoints: expert shards gathered over the EP group, then stages over the
pipeline of rank 0, which writes the single-process layout; resume slices both back.
"""

from __future__ import annotations

import atexit
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..data import VOCAB_SIZE, ByteTokenizer, Corpus, batch_generator, load_corpus
from ..model.config import DeepSeekV3Config, get_preset
from ..nn.recompute import RECOMPUTE_MODES
from .checkpoint import (
    CHECKPOINT_DIR,
    PREV_DIR,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    write_json_atomic,
)
from .metrics import MetricsWriter, format_summary, plot_loss_curve, read_metrics
from .mfu import achieved_flops, model_flops_per_token, peak_bf16_flops
from .pipeline import all_reduce_grads
from .step import LOSS_TERMS, NO_CLIP, SingleDeviceStep, accumulate_grads, step_values

PRECISIONS = ("bf16", "fp8")
# Fp8Linear recipes --fp8-recipe takes (ptxtrain.nn.RECIPES without "bf16", which runs no FP8).
FP8_RECIPES = ("deepseek", "deepseek_pow2", "deepseek_wgrad_bf16")
DEVICES = ("auto", "cpu", "cuda")
EP_BACKENDS = ("all_to_all", "nvlink")  # ptxtrain.ep.Buffer backends (--ep-backend)
PP_OVERLAP_ENV = "PTXTRAIN_PP_OVERLAP"  # read by ptxtrain.train.pipeline.PipelineRunner
# TrainArgs fields that shape the training trajectory: a resumed run must match them exactly.
TRAJECTORY_FIELDS = (
    "preset",
    "precision",
    "fp8_recipe",  # (left out of the checkpoint while it is the default: see trajectory())
    "steps",
    "batch_size",
    "grad_accum_steps",  # (left out of the checkpoint while it is 1: see trajectory())
    "seq_len",
    "lr",
    "min_lr",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "seed",
)
# Run fields (not part of the trajectory, so not compared on resume) that the checkpoint
# remembers, so that `ptxtrain train --resume` without them evaluates, checkpoints and samples
# as the interrupted run did (the eval schedule and eval_batches shape the val-loss record) and
# keeps its deterministic algorithms.
RESUMED_RUN_FIELDS = (
    "log_every",
    "eval_every",
    "eval_batches",
    "ckpt_every",
    "sample_tokens",
    "deterministic",
)
RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "samples.txt", "summary.json")
SAMPLE_PROMPT = "\n"
SAMPLE_COUNT = 3
SAMPLE_TEMPERATURE = 0.8


class _StopFlag:
    """The first Ctrl-C (SIGINT) asks the loop to stop after the step in flight, checkpointed;
    a second one interrupts at once (KeyboardInterrupt)."""

    def __init__(self) -> None:
        self.requested = False

    @contextlib.contextmanager
    def on_sigint(self):
        def handler(signum, frame):
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True

        try:
            previous = signal.signal(signal.SIGINT, handler)
        except ValueError:  # not the main thread: leave SIGINT alone
            yield
            return
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


class TrainConfigError(ValueError):
    """Training arguments that cannot work (bad value, missing device, run folder in use)."""


@dataclass
class TrainArgs:
    """Arguments of ``train()``; the CLI flags of ``ptxtrain train`` map one to one.

    Units: steps are optimizer steps; ``batch_size`` is sequences per micro-batch and
    ``grad_accum_steps`` micro-batches make a step; ``seq_len`` is tokens (bytes) per sequence,
    so one step sees ``batch_size * grad_accum_steps * seq_len`` tokens.
    """

    # --- model and numerics ---
    preset: str = "tiny"  # model preset name (ptxtrain.model.PRESETS)
    # DeepSeekV3Config fields over the preset's: a JSON file's path (--config), or the fields
    # as a dict (what `ptxtrain train --resume` passes: the checkpoint's model config)
    config: str | dict[str, Any] | None = None
    precision: str = "bf16"  # "bf16", or "fp8" = DeepSeek-V3 fine-grained FP8 Linear layers
    # with precision "fp8": the Fp8Linear recipe (FP8_RECIPES); "deepseek_pow2" rounds every
    # scale up to a power of two, as Transformer Engine's Float8BlockScaling does by default
    fp8_recipe: str = "deepseek"
    # activations recomputed in backward instead of kept (ptxtrain.nn.recompute): "none",
    # "selective" (RMSNorms and MLA up-projections, DeepSeek-V3's choice) or "full" (each layer)
    recompute: str = "none"
    # --- schedule ---
    steps: int = 500  # optimizer steps in total (the cosine schedule spans them)
    batch_size: int = 16  # sequences per micro-batch (per step when grad_accum_steps is 1)
    grad_accum_steps: int = 1  # micro-batches per optimizer step (gradient accumulation)
    seq_len: int = 128  # tokens per sequence (<= the model's max_seq_len)
    # --- optimizer ---
    lr: float = 3e-3  # peak learning rate, reached after warmup
    min_lr: float = 3e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 30  # linear warmup from lr/warmup_steps to lr
    weight_decay: float = 0.1  # decoupled AdamW decay of matrices (not of norms or biases)
    grad_clip: float = 1.0  # clip the global gradient L2 norm to this; 0 = no clipping
    seed: int = 0  # model init and batch sampling (batch of step s = f(seed, s))
    # --- run ---
    device: str = "auto"  # "auto" (cuda if available), "cpu" or "cuda"
    # deterministic_mode(): every op with a deterministic algorithm (on CUDA the attention
    # backward's dQ is otherwise summed in a timing-dependent order), so runs repeat bit for bit
    deterministic: bool = False
    # one process on a GPU: capture the step once as a CUDA graph and replay it (ptxtrain.train.
    # step); falls back to eager steps, with one line saying why, where it cannot be captured
    cuda_graphs: bool = True
    out: str | None = None  # run folder; None = runs/<preset>-<precision>
    resume: bool = False  # continue from <out>/checkpoint
    overwrite: bool = False  # start fresh even if <out> already holds a run
    # --- evaluation, checkpoints, samples ---
    # read the step's losses back to the host every this many steps (and at evaluation,
    # checkpoint and last steps): in between the GPU runs ahead of the host
    log_every: int = 10
    eval_every: int = 50  # validate every this many steps (and at the last step); 0 = never
    eval_batches: int = 8  # validation batches per evaluation (fixed batches, same every time)
    ckpt_every: int = 200  # checkpoint every this many steps (and at the end); 0 = end only
    # False: write no checkpoint at all (benchmark runs of large models; no --resume then)
    checkpoint: bool = True
    sample_tokens: int = 200  # bytes sampled per sample at the end; 0 = no samples
    # --- data ---
    data: str | None = None  # text file or folder; None = the embedded Shakespeare corpus
    mtp: bool = True  # False drops the MTP module (mtp_depth=0); needed with pp > 1
    n_layers: int | None = None  # decoder layers of the main model; None = the preset's
    # --- pipeline parallelism (torchrun --nproc-per-node PP -m ptxtrain train --pp PP) ---
    pp: int = 1  # pipeline ranks (WORLD_SIZE = pp * ep); 1 = one process, no pipeline
    schedule: str = "dualpipe"  # pipeline schedule with pp > 1: "dualpipe", "dualpipev", "1f1b"
    num_chunks: int | None = None  # micro-batches per step (pp > 1); None = 2 * pp
    timeline: bool = False  # write each rank's schedule timeline into the run folder (pp > 1)
    # --- expert parallelism (torchrun --nproc-per-node EP -m ptxtrain train --ep EP) ---
    ep: int = 1  # expert-parallel (and data-parallel) ranks (WORLD_SIZE = pp * ep); 1 = none
    ep_backend: str = "all_to_all"  # the MoE layers' shared Buffer: "all_to_all" or "nvlink"
    # --- Python API only ---
    progress: bool = True  # show a tqdm progress bar
    stop_after: int | None = None  # stop (checkpointed) after this many steps of this call

    def validate(self) -> None:
        """Raise ``TrainConfigError`` naming the flag of the first invalid value."""

        def bad(name: str, want: str) -> TrainConfigError:
            flag = "--" + name.replace("_", "-")
            return TrainConfigError(f"{flag} {want}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

        for name in (
            "steps", "batch_size", "grad_accum_steps", "seq_len", "eval_batches", "log_every"
        ):  # fmt: skip
            v = getattr(self, name)
            if not is_int(v) or v <= 0:
                raise bad(name, "must be an integer > 0")
        if self.config is not None and not isinstance(self.config, (str, dict)):
            raise bad("config", "must be a JSON file's path or a dict of DeepSeekV3Config fields")
        if self.n_layers is not None and (not is_int(self.n_layers) or self.n_layers <= 0):
            raise bad("n_layers", "must be an integer > 0")
        for name in ("warmup_steps", "eval_every", "ckpt_every", "sample_tokens", "seed"):
            v = getattr(self, name)
            if not is_int(v) or v < 0:
                raise bad(name, "must be an integer >= 0")
        if self.seed >= 2**64:  # torch.Generator.manual_seed takes at most 64 bits
            raise bad("seed", "must be < 2**64")
        for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not is_num(v) or v < 0:
                raise bad(name, "must be a finite number >= 0")
        if self.lr <= 0:
            raise bad("lr", "must be > 0")
        if self.min_lr > self.lr:
            raise TrainConfigError(f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr})")
        if self.precision not in PRECISIONS:
            raise bad("precision", f"must be one of {list(PRECISIONS)}")
        if self.fp8_recipe not in FP8_RECIPES:
            raise bad("fp8_recipe", f"must be one of {list(FP8_RECIPES)}")
        if self.fp8_recipe != "deepseek" and self.precision != "fp8":
            raise bad("fp8_recipe", "applies to --precision fp8 only")
        if self.recompute not in RECOMPUTE_MODES:
            raise bad("recompute", f"must be one of {list(RECOMPUTE_MODES)}")
        if self.device not in DEVICES:
            raise bad("device", f"must be one of {list(DEVICES)}")
        if self.stop_after is not None and (not is_int(self.stop_after) or self.stop_after <= 0):
            raise TrainConfigError(f"stop_after must be an integer > 0, got {self.stop_after!r}")
        for name in ("deterministic", "cuda_graphs", "checkpoint"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a bool")
        if self.resume and self.overwrite:
            raise TrainConfigError("--resume and --overwrite exclude each other")
        self._validate_pipeline(bad, is_int)

    def _validate_pipeline(self, bad, is_int) -> None:
        from ..parallel.stages import SCHEDULES, check_pipeline

        if not isinstance(self.mtp, bool):
            raise bad("mtp", "must be a bool")
        if not is_int(self.pp) or self.pp < 1:
            raise bad("pp", "must be an integer >= 1")
        if not is_int(self.ep) or self.ep < 1:
            raise bad("ep", "must be an integer >= 1")
        if self.ep > 1 and self.batch_size % self.ep:
            raise TrainConfigError(
                f"--batch-size {self.batch_size} must be divisible by --ep {self.ep} (each "
                "rank trains on batch_size / ep sequences of every micro-batch)"
            )
        if self.pp > 1 and self.grad_accum_steps > 1:
            raise TrainConfigError(
                f"--grad-accum-steps {self.grad_accum_steps} cannot run with --pp {self.pp}: "
                "the pipeline already splits each step into --num-chunks micro-batches; raise "
                "--batch-size and --num-chunks instead"
            )
        if self.ep_backend not in EP_BACKENDS:
            raise bad("ep_backend", f"must be one of {list(EP_BACKENDS)}")
        if self.ep_backend == "nvlink" and self.ep == 1:
            raise TrainConfigError(
                "--ep-backend nvlink moves the MoE layers' tokens between expert-parallel "
                "ranks: it needs --ep > 1"
            )
        if self.schedule not in SCHEDULES:
            raise bad("schedule", f"must be one of {list(SCHEDULES)}")
        if self.num_chunks is not None and (not is_int(self.num_chunks) or self.num_chunks < 1):
            raise bad("num_chunks", "must be an integer >= 1")
        if self.pp == 1:
            if self.timeline:
                raise TrainConfigError("--timeline records a pipeline schedule: it needs --pp > 1")
            if self.num_chunks is not None:
                raise TrainConfigError("--num-chunks splits a pipeline step: it needs --pp > 1")
            return
        chunks = self.chunks()
        try:
            check_pipeline(self.schedule, self.pp, chunks)
        except ValueError as e:
            raise TrainConfigError(f"--pp {self.pp} --schedule {self.schedule}: {e}") from None
        if self.batch_size % chunks:
            raise TrainConfigError(
                f"--batch-size {self.batch_size} must be divisible by the {chunks} micro-batches "
                "of a pipeline step (--num-chunks)"
            )
        if self.ep > 1 and self.batch_size % (chunks * self.ep):
            raise TrainConfigError(
                f"--batch-size {self.batch_size} must be divisible by --ep {self.ep} x the "
                f"{chunks} micro-batches of a pipeline step (each of the ep pipelines runs "
                "batch_size / ep sequences in num_chunks micro-batches)"
            )

    def chunks(self) -> int:
        """Micro-batches per pipeline step: ``num_chunks``, or ``2 * pp`` when it is None."""
        return self.num_chunks if self.num_chunks is not None else 2 * self.pp

    def run_dir(self) -> Path:
        """``out``, or ``runs/<preset>-<precision>`` when it is None."""
        return Path(self.out) if self.out else Path("runs") / f"{self.preset}-{self.precision}"

    def trajectory(self) -> dict[str, Any]:
        """The fields a resumed run must share with the checkpoint (``TRAJECTORY_FIELDS``).

        ``fp8_recipe`` is left out while it is the default ``"deepseek"`` and
        ``grad_accum_steps`` while it is 1, so checkpoints from before those fields existed
        (which trained that way) still resume."""
        out = {k: getattr(self, k) for k in TRAJECTORY_FIELDS}
        for name, default in (("fp8_recipe", "deepseek"), ("grad_accum_steps", 1)):
            if out[name] == default:
                del out[name]
        return out


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


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` if available else ``cpu``.

    Raises:
        TrainConfigError: ``cuda`` asked for but unavailable, or an unknown name.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda":
        if not torch.cuda.is_available():
            raise TrainConfigError("--device cuda, but torch sees no CUDA device")
        return torch.device("cuda")
    if name == "cpu":
        return torch.device("cpu")
    raise TrainConfigError(f"--device must be one of {list(DEVICES)}, got {name!r}")


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


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (``ndim >= 2``: linear weights, embeddings); not norms or biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


class _Printer:
    """Writes lines to stdout, through tqdm while a bar is active so the bar stays intact."""

    def __init__(self, enabled: bool = True) -> None:
        self.bar = None
        self.enabled = enabled

    def __call__(self, msg: str = "") -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
        else:
            print(msg, flush=True)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, corpus: Corpus, args: TrainArgs, device: torch.device
) -> float:
    """Mean next-token loss (nats/byte) over ``eval_batches`` fixed validation batches.

    Validation batch ``i`` is ``batch_size * grad_accum_steps`` sequences drawn with
    ``batch_generator(seed, i, "val")`` (the same bytes every time, so successive values are
    comparable), run in micro-batches of ``batch_size`` as training runs them. With expert
    parallelism (``model.ep_size > 1``) every rank of the group must call this: each evaluates
    its ``1/ep`` share of every micro-batch and the result, averaged over the group, is the same
    on every rank.
    """
    was_training = model.training
    model.eval()
    ep = getattr(model, "ep_size", 1)
    rank = _group_rank(model.ep_group) if ep > 1 else 0
    total = 0.0
    n = args.grad_accum_steps
    for i in range(args.eval_batches):
        x, y = corpus.get_batch(
            "val", args.batch_size * n, args.seq_len, batch_generator(args.seed, i, "val")
        )
        for xm, ym in zip(x.split(args.batch_size), y.split(args.batch_size), strict=True):
            out = model(_shard(xm, rank, ep).to(device), _shard(ym, rank, ep).to(device))
            total += float(out.lm_loss)
    model.train(was_training)
    if ep > 1:
        total = _all_reduce_mean([total], model.ep_group, device)[0]
    return total / (args.eval_batches * n)


def _group_rank(group) -> int:
    import torch.distributed as dist

    return dist.get_rank(group)


def _shard(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    """Rows ``[rank·B/n, (rank+1)·B/n)`` of ``t [B, ...]`` (``n`` divides ``B``)."""
    per = t.shape[0] // n
    return t[rank * per : (rank + 1) * per]


def _read_pending(pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The pending steps' metrics records, every device value read back in ONE device-to-host
    copy (the only host sync of the steps it covers): ``loss`` (the LM loss), ``lr``,
    ``grad_norm``, ``mtp_loss`` / ``aux_loss`` where present, and ``moe`` from the step's router
    load (``moe_counts`` / ``bias_abs_max``) where present."""
    from ..model.deepseek import router_stats_from

    tensors = [v for rec in pending for v in rec.values() if isinstance(v, torch.Tensor)]
    flat = torch.cat([t.detach().reshape(-1).double() for t in tensors]).cpu() if tensors else None
    offset = 0
    out = []
    for rec in pending:
        host: dict[str, Any] = {}
        for k, v in rec.items():
            if isinstance(v, torch.Tensor):
                n = v.numel()
                part = flat[offset : offset + n].view(v.shape)
                host[k] = part if v.dim() else float(part)
                offset += n
            else:
                host[k] = v
        record = {"step": host["step"], "loss": float(host["lm_loss"]), "lr": host["lr"]}
        record["grad_norm"] = float(host["grad_norm"])
        for name in ("mtp_loss", "aux_loss"):
            if name in host:
                record[name] = float(host[name])
        if "moe_counts" in host:
            record["moe"] = router_stats_from(host["moe_counts"], float(host["bias_abs_max"]))
        elif host.get("moe"):  # statistics the pipeline runner computed on the host
            record["moe"] = host["moe"]
        out.append(record)
    return out


def _all_reduce_mean(values: list[float], group, device: torch.device) -> list[float]:
    """The mean of each value over the ranks of ``group`` (float64, one all-reduce on
    ``device``, which must suit the group's backend)."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return (t / dist.get_world_size(group)).tolist()


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


def _samples(model: torch.nn.Module, args: TrainArgs, device: torch.device) -> list[str]:
    from ..model import generate

    tok = ByteTokenizer()
    prompt = tok.encode(SAMPLE_PROMPT).to(device)
    prompt = prompt[None, :].expand(SAMPLE_COUNT, -1).contiguous()  # [B, T0]
    gen = torch.Generator(device=device).manual_seed(args.seed)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids = generate(
            model, prompt, args.sample_tokens, temperature=SAMPLE_TEMPERATURE, generator=gen
        )
    model.train(was_training)
    return [tok.decode(row) for row in ids[:, prompt.shape[1] :].cpu()]


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


class _ExpertStates:
    """Converts checkpointed state dicts between the expert-parallel and the full layout.

    The full layout is the single-process one: every stacked expert weight ``[E, ...]`` and its
    optimizer state (``master``, ``exp_avg``, ``exp_avg_sq``) whole. Rank ``r`` of the ``R``
    ranks of ``group`` (the expert-parallel group; None = the world) holds rows
    ``[r·E/R, (r+1)·E/R)`` of each; every other entry is replicated.
    """

    def __init__(self, model, optimizer, rank: int, n_ranks: int, group=None) -> None:
        self.rank, self.n_ranks, self.group = rank, n_ranks, group  # group None: the world
        experts = {id(p) for p in model.expert_parameters()}
        self.model_keys = [n for n, p in model.named_parameters() if id(p) in experts]
        order = [id(p) for g in optimizer.param_groups for p in g["params"]]
        self.opt_indices = {i for i, pid in enumerate(order) if pid in experts}

    def _expert_entries(self, model_sd: dict, opt_sd: dict):
        """``(container, key)`` of every sharded tensor of the two state dicts."""
        for k in self.model_keys:
            yield model_sd, k
        for i, st in opt_sd["state"].items():
            if int(i) in self.opt_indices:
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        yield st, k

    @staticmethod
    def _copy(opt_sd: dict) -> dict:
        """A copy of ``opt_sd`` whose per-parameter state dicts may be edited."""
        return {**opt_sd, "state": {i: dict(st) for i, st in opt_sd["state"].items()}}

    @torch.no_grad()
    def gather(self, model, optimizer) -> tuple[dict, dict]:
        """The full-layout model and optimizer state dicts (a collective; every rank gets them).

        The shards travel as raw bytes (bit-exact for any dtype, whatever the backend supports).
        """
        import torch.distributed as dist

        model_sd = dict(model.state_dict())
        opt_sd = self._copy(optimizer.state_dict())
        for box, k in list(self._expert_entries(model_sd, opt_sd)):
            t = box[k].detach().contiguous()
            raw = t.reshape(t.shape[0], -1).view(torch.uint8)  # [E_local, bytes per expert]
            parts = [torch.empty_like(raw) for _ in range(self.n_ranks)]
            dist.all_gather(parts, raw, group=self.group)
            full = torch.cat(parts).view(t.dtype)
            box[k] = full.reshape(t.shape[0] * self.n_ranks, *t.shape[1:])
        return model_sd, opt_sd

    def slice(self, model_sd: dict, opt_sd: dict) -> tuple[dict, dict]:
        """This rank's part of full-layout state dicts (for ``load_checkpoint``).

        Raises:
            ValueError: a sharded entry's first dim is not a multiple of the rank count.
        """
        model_sd = dict(model_sd)
        opt_sd = self._copy(opt_sd)
        for box, k in list(self._expert_entries(model_sd, opt_sd)):
            t = box[k]
            if t.shape[0] % self.n_ranks:
                raise ValueError(
                    f"{k}: {t.shape[0]} experts cannot be split over {self.n_ranks} ranks"
                )
            per = t.shape[0] // self.n_ranks
            box[k] = t[self.rank * per : (self.rank + 1) * per].clone()
        return model_sd, opt_sd


class _StageStates:
    """Converts checkpointed state dicts between a pipeline rank's stages and the full layout.

    The full layout is the single-process one: ``model.state_dict()`` of the whole model, and the
    state dict of an optimizer built over ``_param_groups(model)`` (parameters numbered in that
    order). A pipeline rank's optimizer holds its stages' parameters only, numbered in its own
    order; the two are matched by parameter name. Every rank holds the whole model (the stages
    share its submodules), so loading needs only the optimizer state re-indexed.

    Raises:
        ValueError: the rank's optimizer has another number of parameter groups than the full
            layout (cannot happen with ``_param_groups``: every stage holds matrices and norms).
    """

    def __init__(self, model, optimizer, runner, weight_decay: float) -> None:
        self.runner = runner
        pname = {id(p): n for n, p in model.named_parameters()}
        sname = {id(t): n for n, t in model.state_dict(keep_vars=True).items()}
        full = _param_groups(model, weight_decay)
        self.full_groups = [[pname[id(p)] for p in g["params"]] for g in full]
        self.full_index = {n: i for i, n in enumerate(n for g in self.full_groups for n in g)}
        self.local_groups = [[pname[id(p)] for p in g["params"]] for g in optimizer.param_groups]
        self.local_names = [n for g in self.local_groups for n in g]
        if len(self.local_groups) != len(self.full_groups):
            raise ValueError(
                f"pipeline rank {runner.rank}: its optimizer has {len(self.local_groups)} "
                f"parameter groups, the single-process one {len(self.full_groups)}"
            )
        # What this rank writes: the state of the stages it owns (each stage counted once).
        self.owned_state = {
            sname[id(t)]: t for st in runner.owned for t in st.state_dict(keep_vars=True).values()
        }
        self.owned_params = {pname[id(p)] for st in runner.owned for p in st.parameters()}

    @staticmethod
    def _cpu(v):
        return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v

    @torch.no_grad()
    def gather(
        self, model, optimizer, model_sd: dict | None = None, opt_sd: dict | None = None
    ) -> tuple[dict | None, dict | None]:
        """The full-layout model and optimizer state dicts on group rank 0, ``(None, None)``
        elsewhere (a collective: every rank of the pipeline must call it).

        Each rank sends its owned stages' tensors (CPU copies, pickled: bit-exact) by name.
        ``model_sd`` / ``opt_sd``: this rank's state dicts to take them from (``--ep``: with the
        expert shards already gathered, :class:`_ExpertStates`); None = the live ones.
        """
        import torch.distributed as dist

        local = optimizer.state_dict() if opt_sd is None else opt_sd
        if model_sd is None:
            part_model = {n: self._cpu(t) for n, t in self.owned_state.items()}
        else:
            part_model = {n: self._cpu(model_sd[n]) for n in self.owned_state}
        part_opt = {}
        for i, entry in local["state"].items():
            name = self.local_names[int(i)]
            if name in self.owned_params:
                part_opt[name] = {k: self._cpu(v) for k, v in entry.items()}
        group = self.runner.group
        lead = 0 if group is None else dist.get_global_rank(group, 0)
        parts: list | None = [None] * self.runner.pp if self.runner.rank == 0 else None
        dist.gather_object((part_model, part_opt), parts, dst=lead, group=group)
        if parts is None:
            return None, None
        # keys outside every stage: rank 0's (untrained)
        model_sd = dict(model.state_dict() if model_sd is None else model_sd)
        state: dict[int, dict] = {}
        for got_model, got_opt in parts:
            model_sd.update(got_model)
            for name, entry in got_opt.items():
                state[self.full_index[name]] = entry
        groups, offset = [], 0
        for g, names in zip(local["param_groups"], self.full_groups, strict=True):
            hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": list(range(offset, offset + len(names)))})
            offset += len(names)
        return model_sd, {"state": dict(sorted(state.items())), "param_groups": groups}

    def slice(self, model_sd: dict, opt_sd: dict) -> tuple[dict, dict]:
        """This rank's optimizer state out of full-layout state dicts (for ``load_checkpoint``);
        the model state stays whole (every rank holds the whole model).

        Raises:
            ValueError: the saved parameter groups do not have the full layout's sizes.
        """
        saved = opt_sd["param_groups"]
        want = [len(g) for g in self.full_groups]
        got = [len(g["params"]) for g in saved]
        if got != want:
            raise ValueError(
                f"the optimizer state has parameter groups of {got} parameters, this model's "
                f"single-process layout {want}"
            )
        saved_ids = [int(i) for g in saved for i in g["params"]]  # full position -> saved key
        full_state = {int(k): v for k, v in opt_sd["state"].items()}
        state = {}
        for i, name in enumerate(self.local_names):
            key = saved_ids[self.full_index[name]]
            if key in full_state:  # a parameter that never had a gradient has no state
                state[i] = full_state[key]
        groups, offset = [], 0
        for g, names in zip(saved, self.local_groups, strict=True):
            hyper = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            groups.append({**hyper, "params": list(range(offset, offset + len(names)))})
            offset += len(names)
        return model_sd, {"state": state, "param_groups": groups}


class _StageExpertStates:
    """``--pp`` with ``--ep``: the two conversions composed. Saving gathers the expert shards
    over the EP group first (:class:`_ExpertStates`), then the stages over the pipeline group to
    its rank 0 (:class:`_StageStates`; only the pipeline of global rank 0 does, the others'
    result would be dropped); loading re-indexes the optimizer state to this rank's stages
    first, then slices this rank's experts out of it and out of the model state."""

    def __init__(self, experts: _ExpertStates, stages: _StageStates, gather_stages: bool):
        self.experts, self.stages, self.gather_stages = experts, stages, gather_stages

    def gather(self, model, optimizer) -> tuple[dict | None, dict | None]:
        """Full-layout state dicts on global rank 0, ``(None, None)`` elsewhere (a collective)."""
        model_sd, opt_sd = self.experts.gather(model, optimizer)
        if not self.gather_stages:
            return None, None
        return self.stages.gather(model, optimizer, model_sd, opt_sd)

    def slice(self, model_sd: dict, opt_sd: dict) -> tuple[dict, dict]:
        """This rank's part of full-layout state dicts (for ``load_checkpoint``); raises the
        ``ValueError`` of either step."""
        return self.experts.slice(*self.stages.slice(model_sd, opt_sd))


class _PipeSetup:
    """The process group and rank of a ``--pp > 1`` or ``--ep > 1`` run; with neither, every
    method is a no-op answering for a single process.

    Raises (on every rank alike, since the checks depend on the arguments only):
        TrainConfigError: the model cannot be cut into the schedule's stages (pp), the routed
            experts cannot be split over the ranks (ep), WORLD_SIZE (or an existing process
            group) does not match ``--pp`` / ``--ep`` (``pp * ep`` with both), or no CUDA device
            is visible.

    With both, ``pp_group`` / ``ep_group`` / ``mirror_group`` and ``pp_rank`` / ``ep_rank``
    describe this rank's place (:func:`~ptxtrain.train.pipeline.pipeline_groups`); otherwise
    the groups are None (the world) and the ranks follow the one parallelism in use.
    """

    def __init__(self, args: TrainArgs, config, param_dtype: torch.dtype) -> None:
        self.args, self.param_dtype = args, param_dtype
        self.pipeline = args.pp > 1
        self.ep = args.ep
        self.active = self.pipeline or self.ep > 1
        self.rank, self.device = 0, None
        # rank = pp_rank * ep + ep_rank (ptxtrain.train.pipeline.pipeline_groups)
        self.pp_rank, self.ep_rank = 0, 0
        self.pp_group = self.ep_group = self.mirror_group = None  # None: the world
        self.p2p_groups = None  # None: the schedule creates them (a world-wide pipeline)
        if not self.active:
            return
        import torch.distributed as dist

        if self.pipeline:
            from ..model.stages import check_stageable
            from ..parallel.stages import num_stages

            try:
                check_stageable(config, num_stages(args.schedule, args.pp))
            except ValueError as e:
                raise TrainConfigError(f"--pp {args.pp} --schedule {args.schedule}: {e}") from None
        if self.ep > 1:
            if config.n_routed_experts % self.ep:
                raise TrainConfigError(
                    f"--ep {self.ep}: the model's n_routed_experts={config.n_routed_experts} must "
                    "be divisible by --ep (each rank holds n_routed_experts / ep experts per "
                    "MoE layer)"
                )
            if config.n_moe_layers == 0:
                raise TrainConfigError(f"--ep {self.ep}: the model has no MoE layer")
        if self.pipeline and self.ep > 1:
            flags, want = f"--pp {args.pp} --ep {self.ep}", args.pp * self.ep
            what = "pipeline rank x expert-parallel rank"
        elif self.pipeline:
            flags, want, what = f"--pp {args.pp}", args.pp, "pipeline rank"
        else:
            flags, want, what = f"--ep {self.ep}", self.ep, "expert-parallel rank"
        device = resolve_device(args.device)
        if args.ep_backend == "nvlink":
            self._check_nvlink(device)
        if dist.is_initialized():
            world = dist.get_world_size()
        else:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        if world != want:
            raise TrainConfigError(
                f"{flags} needs {want} processes, one per {what}, got a world "
                f"of {world}: launch with torchrun --nproc-per-node {want} -m ptxtrain train "
                f"{flags} ..."
            )
        if device.type == "cuda":
            local = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
            device = torch.device("cuda", local % torch.cuda.device_count())
            torch.cuda.set_device(device)
        if not dist.is_initialized():
            # Kept after this run (destroyed at exit): a second train() in the same torchrun
            # process reuses it, where re-initializing after a destroy hangs in the rendezvous.
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
            atexit.register(_destroy_default_group)
        self.rank, self.device = dist.get_rank(), device
        if self.pipeline and self.ep > 1:
            from .pipeline import pipeline_groups

            groups = pipeline_groups(args.pp, self.ep, args.schedule)  # every rank, same order
            self.pp_group, self.ep_group, self.mirror_group = (
                groups.pipeline,
                groups.expert,
                groups.mirror,
            )
            self.pp_rank, self.ep_rank = groups.pipeline_rank, groups.ep_rank
            self.p2p_groups = groups.p2p
        elif self.pipeline:
            self.pp_rank = self.rank
        else:
            self.ep_rank = self.rank

    def _check_nvlink(self, device: torch.device) -> None:
        """``--ep-backend nvlink``: raise before any communication unless it can work."""
        import torch.distributed as dist

        args = self.args
        if device.type != "cuda":
            raise TrainConfigError(
                f"--ep-backend nvlink needs CUDA GPUs (NVLink-connected, one node), got device "
                f"{device.type!r}; use --ep-backend all_to_all (the default) on CPU"
            )
        if dist.is_initialized() and "nccl" not in str(dist.get_backend()):
            raise TrainConfigError(
                f"--ep-backend nvlink needs an NCCL process group, got {dist.get_backend()!r}; "
                "use --ep-backend all_to_all"
            )
        overlap = os.environ.get(PP_OVERLAP_ENV, "0").strip() == "1"
        if self.pipeline and args.schedule in ("dualpipe", "dualpipev") and overlap:
            # The overlap hook runs one micro-batch's forward and another's backward on two
            # CUDA streams; the nvlink kernels of the shared Buffer assume one operation at a
            # time in issue order (one epoch counter, one symmetric buffer), so they would race.
            raise TrainConfigError(
                f"--ep-backend nvlink cannot run with {PP_OVERLAP_ENV}=1 (--schedule "
                f"{args.schedule}): the overlapped forward and backward would use the MoE "
                f"layers' shared nvlink buffer from two CUDA streams at once; unset "
                f"{PP_OVERLAP_ENV} or use --ep-backend all_to_all"
            )

    @property
    def evaluates(self) -> bool:
        """Whether this rank takes part in evaluation and sampling: rank 0, or with ``--ep``
        every expert-parallel rank of pipeline rank 0 (they hold the gathered model; the
        forward is a collective over their EP group)."""
        return self.pp_rank == 0 if self.ep > 1 else self.rank == 0

    def runner(self, model):
        if not self.pipeline:
            return None
        from .pipeline import PipelineRunner

        return PipelineRunner(
            model,
            self.args.schedule,
            self.args.chunks(),
            group=self.pp_group,
            ep_group=self.ep_group,
            mirror_group=self.mirror_group,
            p2p_groups=self.p2p_groups,
        )

    def on_lead(self, fn, *fn_args) -> None:
        """Run ``fn`` on rank 0 only; a ``TrainConfigError`` there is raised on every rank."""
        if not self.active:
            fn(*fn_args)
            return
        import torch.distributed as dist

        msg = [None]
        if self.rank == 0:
            try:
                fn(*fn_args)
            except TrainConfigError as e:
                msg = [str(e)]
        dist.broadcast_object_list(msg, src=0)
        if msg[0] is not None:
            raise TrainConfigError(msg[0])

    def new_timeline(self):
        if not self.args.timeline or self.ep_rank != 0:  # one pipeline's timelines (--ep)
            return None
        from ..parallel.timeline import Timeline

        return Timeline()

    def agree_to_stop(self, requested: bool) -> bool:
        """Whether any rank saw a Ctrl-C (all ranks then stop after the same step)."""
        if not self.active:
            return requested
        import torch.distributed as dist

        flag = torch.tensor([int(requested)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def describe(self) -> dict[str, Any] | None:
        if not self.pipeline:
            return None
        a = self.args
        return {"pp": a.pp, "schedule": a.schedule, "num_chunks": a.chunks()}

    # ------------------------------------------------------------------ expert parallelism
    def split_experts(self, model) -> None:
        """``ep > 1``: keep this rank's experts of the (identically built) full model; every MoE
        layer uses one ``Buffer`` of ``--ep-backend`` (nvlink: sized for the largest forward)."""
        if self.ep > 1:
            a = self.args
            # The most tokens one rank's forward sees: an evaluation batch (batch_size / ep
            # sequences; training micro-batches are no larger) or a sampling step (SAMPLE_COUNT
            # sequences of up to max_seq_len tokens, on every rank).
            sample = 0
            if a.sample_tokens:
                prompt = len(ByteTokenizer().encode(SAMPLE_PROMPT))
                sample = SAMPLE_COUNT * min(model.config.max_seq_len, prompt + a.sample_tokens)
            max_tokens = max(a.batch_size // self.ep * a.seq_len, sample, 1)
            try:
                model.enable_expert_parallel(
                    self.ep_group, backend=a.ep_backend, max_tokens=max_tokens
                )
            except ValueError as e:
                raise TrainConfigError(f"--ep {self.ep} --ep-backend {a.ep_backend}: {e}") from e

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's sequences of a batch ``[B, T]`` (all of them unless ``ep > 1``): rows
        ``[e·B/ep, (e+1)·B/ep)`` for EP rank ``e`` (with ``pp > 1``: its pipeline's share)."""
        return _shard(t, self.ep_rank, self.ep) if self.ep > 1 else t

    @torch.no_grad()
    def reduce_grads(self, model, optimizer) -> None:
        """``ep > 1``: average the replicated parameters' gradients over the ranks (one
        all-reduce, fp32 or fp64) and divide the expert gradients by ``ep`` (they already sum
        every rank's tokens), giving the gradient of the global batch-mean loss.

        Works on the gradients ``optimizer.step`` uses (``optimizer.grad_for``, the FP32 buffers
        of :class:`~ptxtrain.optim.AdamW`). A replicated parameter without a gradient on every
        rank keeps none (the optimizer then skips it, as in the single-process run).
        """
        if self.ep == 1:
            return
        experts = {id(p) for p in model.expert_parameters()}
        for p in model.expert_parameters():
            g = optimizer.grad_for(p)
            if g is not None:
                g.div_(self.ep)
        params = [p for p in model.parameters() if p.requires_grad and id(p) not in experts]
        all_reduce_grads(params, optimizer, None, self.device, divide_by=self.ep)

    @torch.no_grad()
    def clip_grad_norm_(self, model, optimizer, max_norm: float) -> float:
        """``ep > 1``: clip by the global L2 norm (replicated gradients counted once, expert
        shards summed over the ranks; per-tensor norms in FP32 or wider, as
        :meth:`~ptxtrain.optim.AdamW.clip_grad_norm_`). Returns the norm before clipping."""
        import torch.distributed as dist

        experts = {id(p) for p in model.expert_parameters()}
        sq = torch.zeros(2, dtype=torch.float64, device=self.device)  # [replicated, experts]
        grads = []
        for p in model.parameters():
            g = optimizer.grad_for(p)
            if g is None:
                continue
            grads.append(g)
            n = torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32))
            sq[int(id(p) in experts)] += n.double() ** 2
        dist.all_reduce(sq)
        total = math.sqrt(float(sq[0]) / self.ep + float(sq[1]))  # replicated: same on all ranks
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for g in grads:
                g.mul_(torch.tensor(coef, dtype=torch.float32).to(g.dtype))
        return total

    def mean_losses(self, out):
        """``ep > 1``: the step's losses averaged over the ranks (= the global batch means),
        as a :class:`~ptxtrain.model.ModelOutput` without logits; ``out`` itself otherwise."""
        if self.ep == 1:
            return out
        from ..model import ModelOutput

        names = [n for n in LOSS_TERMS if getattr(out, n) is not None]
        vals = _all_reduce_mean([float(getattr(out, n).detach()) for n in names], None, self.device)
        mean = ModelOutput(logits=None)
        for n, v in zip(names, vals, strict=True):
            setattr(mean, n, torch.tensor(v, dtype=torch.float64))
        return mean

    def state_codec(
        self, model, optimizer, runner=None
    ) -> _ExpertStates | _StageStates | _StageExpertStates | None:
        """Converts checkpointed state dicts to and from the single-process layout: ``ep > 1``
        gathers / slices the expert shards, ``pp > 1`` (``runner`` given) the stages, both
        composed with both; None for a single process."""
        if runner is not None and self.ep > 1:
            return _StageExpertStates(
                _ExpertStates(model, optimizer, self.ep_rank, self.ep, self.ep_group),
                _StageStates(model, optimizer, runner, self.args.weight_decay),
                gather_stages=self.ep_rank == 0,
            )
        if runner is not None:
            return _StageStates(model, optimizer, runner, self.args.weight_decay)
        return _ExpertStates(model, optimizer, self.rank, self.ep) if self.ep > 1 else None

    def on_every_rank(self, fn, *fn_args):
        """``fn(*fn_args)`` on every rank; if it raises on any rank, every rank raises (its own
        exception, else a ``CheckpointError`` / ``RuntimeError`` naming the first failed rank),
        so a fault one rank sees cannot leave the others waiting in a collective."""
        if not self.active:
            return fn(*fn_args)
        import torch.distributed as dist

        err, result = None, None
        try:
            result = fn(*fn_args)
        except Exception as e:  # shared below, then re-raised
            err = e
        mine = None if err is None else (isinstance(err, CheckpointError), f"{err}")
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        if err is not None:
            raise err
        for r, got in enumerate(every):
            if got is not None:
                is_ckpt, text = got
                raise (CheckpointError if is_ckpt else RuntimeError)(f"rank {r} failed: {text}")
        return result

    def run_on_lead(self, fn, *fn_args) -> None:
        """Run ``fn`` on rank 0 only; any exception there is raised on every rank (as an
        ``OSError`` elsewhere when it is not a ``TrainConfigError``)."""
        if not self.active:
            fn(*fn_args)
            return
        import torch.distributed as dist

        msg: list = [None]
        if self.rank == 0:
            try:
                fn(*fn_args)
            except Exception as e:
                msg = [(isinstance(e, TrainConfigError), f"{type(e).__name__}: {e}")]
                err = e
        dist.broadcast_object_list(msg, src=0)
        if msg[0] is not None:
            if self.rank == 0:
                raise err
            is_config, text = msg[0]
            raise (TrainConfigError if is_config else OSError)(f"rank 0 failed: {text}")


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _peak_memory_per_rank(device: torch.device) -> list[int | None]:
    """Peak CUDA memory allocated since the run started (bytes), one entry per rank of the
    default process group in rank order (one entry without torchrun); None on CPU. Under torchrun
    this is an ``all_gather_object``: every rank must call it."""
    import torch.distributed as dist

    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [peak]
    peaks: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    return peaks


# What a JSON value of each Python type is called (for --config's "got a JSON array" message).
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
        ``ranks`` (processes of the run),
        ``params`` and ``samples``. It is also written to
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
        FloatingPointError: the train loss became NaN or infinite.

    A first Ctrl-C stops the run after the step in flight and checkpoints it (the summary then
    has ``interrupted=True``); a second one raises ``KeyboardInterrupt`` at once.
    """
    args.validate()
    config = model_config(args, model_overrides)
    pipe = _PipeSetup(args, config, param_dtype)  # pp == 1: a no-op
    with deterministic_mode(args.deterministic):
        return _train(args, config, pipe, model_overrides)


def _train(args: TrainArgs, config, pipe: _PipeSetup, model_overrides) -> dict[str, Any]:
    from ..model import build_model
    from ..model.deepseek import convert_model_to_fp8_training
    from ..nn import Fp8LinearConfig
    from ..optim import AdamW

    lead = pipe.rank == 0  # the rank that prints and writes the run folder
    log = _Printer(enabled=lead)
    if args.seq_len > config.max_seq_len:
        raise TrainConfigError(
            f"--seq-len {args.seq_len} exceeds the model's max_seq_len {config.max_seq_len} "
            f"(preset {args.preset}{', with --config' if args.config is not None else ''})"
        )
    device = pipe.device if pipe.active else resolve_device(args.device)
    run_dir = args.run_dir()

    t_load = time.perf_counter()
    corpus = load_corpus(args.data)
    corpus.check_seq_len(args.seq_len)
    corpus_info = corpus.describe()
    entropy = corpus_info["unigram_entropy_nats"]
    log(
        f"corpus: {corpus_info['source']} ({len(corpus.files)} documents, "
        f"{corpus_info['bytes']:,} bytes: {corpus_info['train_bytes']:,} train / "
        f"{corpus_info['val_bytes']:,} val) loaded in {time.perf_counter() - t_load:.2f} s; "
        f"byte-unigram entropy {entropy:.4f} nats/byte"
    )
    pipe.on_lead(_prepare_run_dir, run_dir, args)

    model = build_model(config, dtype=pipe.param_dtype, device=device, seed=args.seed)
    pipe.split_experts(model)  # ep > 1: keep this rank's experts of the full model
    if args.precision == "fp8":
        convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name(args.fp8_recipe))
    model.set_recompute(args.recompute)
    model.train()
    # One process on a GPU: compile the FP8 step's NVRTC kernels on background threads while the
    # host sets up and runs the first forward (ptxtrain.nn.prewarm; PTXTRAIN_JIT_PREWARM=0: off).
    warm = None
    if args.precision == "fp8" and args.pp == 1 and args.ep == 1 and device.type == "cuda":
        from ..nn.prewarm import prewarm

        warm = prewarm(model, args.batch_size * args.seq_len, device)  # one micro-batch's M
    runner = pipe.runner(model)  # None when pp == 1
    trained = model if runner is None else runner.module  # this rank's parameters
    optimizer = AdamW(_param_groups(trained, args.weight_decay), lr=args.lr)
    ckpt_config = {
        "model": config.to_dict(),
        "train": args.trajectory(),
        "corpus_sha256": corpus_info["sha256"],
    }

    # Not compared on resume (the corpus hash is); lets `ptxtrain train --resume` find the data
    # and keep the run's evaluation / checkpoint / sample settings.
    data_path = str(Path(args.data).expanduser().resolve()) if args.data else None
    extra = {"data": data_path, "run": {k: getattr(args, k) for k in RESUMED_RUN_FIELDS}}
    ckpt_kw = dict(model=model, optimizer=optimizer, config=ckpt_config, extra=extra)
    # ep > 1: expert shards, pp > 1: stages <-> the full (single-process) layout
    codec = pipe.state_codec(model, optimizer, runner)

    def save(step: int) -> None:
        if not args.checkpoint:
            return
        if codec is None:
            save_checkpoint(run_dir, step=step, **ckpt_kw)
            return
        model_state, optimizer_state = codec.gather(model, optimizer)  # every rank
        pipe.run_on_lead(
            lambda: save_checkpoint(
                run_dir,
                step=step,
                model_state=model_state,
                optimizer_state=optimizer_state,
                **ckpt_kw,
            )
        )

    start = 0
    if args.resume:
        meta = pipe.on_every_rank(
            lambda: load_checkpoint(
                run_dir,
                model=model,
                optimizer=optimizer,
                expected_config=ckpt_config,
                state_transform=None if codec is None else codec.slice,
            )
        )
        start = int(meta["step"])
        log(f"resumed from {meta['path']} at step {start}")

    params = model.num_params()
    if lead:
        write_json_atomic(
            run_dir / "config.json",
            {
                "model": config.to_dict(),
                "preset": args.preset,
                "model_overrides": model_overrides or {},
                "train": {k: v for k, v in dataclasses.asdict(args).items() if k != "progress"},
                "params": params,
                "corpus": corpus_info,
                "device": _device_info(device),
                "versions": _versions(),
                "resumed_from_step": start if args.resume else None,
                "pipeline": pipe.describe(),
                "ep": args.ep,
            },
        )
    flops_per_token = model_flops_per_token(config, args.seq_len)
    peak = peak_bf16_flops(device)
    log(
        f"model: {args.preset}{f' + {args.config}' if isinstance(args.config, str) else ''} "
        f"({params['total']:,} params, {params['activated']:,} activated "
        f"per token; {flops_per_token / 1e9:.3g} GFLOP/token), precision {args.precision}"
        f"{f' ({args.fp8_recipe})' if args.precision == 'fp8' else ''}, device {device}"
        f"{' (deterministic algorithms)' if args.deterministic else ''}; "
        f"run folder {run_dir}"
        + (f"; experts split over {args.ep} ranks" if args.ep > 1 else "")
        + (
            f"; {args.grad_accum_steps} micro-batches of {args.batch_size} sequences per step"
            if args.grad_accum_steps > 1
            else ""
        )
    )

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    batch = args.batch_size * args.grad_accum_steps  # sequences per step
    tokens_per_step = batch * args.seq_len
    devices = args.pp * args.ep  # processes of the run, one device each (MFU is per device)
    done = last_saved = start
    step_time = 0.0
    first_step_s = None  # this call's first step: JIT compiles, autotuning, allocator warm-up
    t0 = time.perf_counter()
    writer = (
        MetricsWriter(run_dir / "metrics.jsonl", keep_until=start if args.resume else None)
        if lead
        else None
    )
    timeline = pipe.new_timeline()
    run_losses: list[float] = []
    from tqdm.auto import tqdm

    bar = tqdm(
        total=args.steps,
        initial=start,
        desc="train",
        unit="step",
        disable=not (args.progress and lead),
        dynamic_ncols=True,
        file=sys.stdout,
    )
    log.bar = bar
    stop = _StopFlag()
    state_bytes = None
    val_loss = None
    profile_at = _profile_step()
    # The MoE layers' shared Buffer (ep > 1). Its nvlink kernels report a flag wait that timed out
    # (a peer failed or stalled) only at the next operation, after writing wrong rows: checked
    # before every optimizer step so that no step uses them (a no-op for "all_to_all"; the step
    # has synchronized for the gradient norm already).
    ep_buffer = getattr(model, "ep_buffer", None)
    # One process: the step object (eager, or a replayed CUDA graph). Its losses and gradient
    # norm stay on the device until a logging step reads the pending ones in one go.
    single = runner is None and args.ep == 1
    step_fn = None
    if single:
        step_fn = SingleDeviceStep(
            model,
            optimizer,
            grad_accum_steps=args.grad_accum_steps,
            grad_clip=args.grad_clip,
            device=device,
            cuda_graphs=args.cuda_graphs,
            log=log,
        )
        if args.cuda_graphs and device.type == "cuda" and step_fn.graphs_off_reason is not None:
            log(f"CUDA graphs: off ({step_fn.graphs_off_reason}); running the steps eagerly")
    pending: list[dict[str, Any]] = []  # steps run since the last flush, values maybe on device
    window_start: float | None = None  # when the first pending step began

    def flush(eval_now: bool) -> None:
        """Read the pending steps' values (one host sync), check the loss, write the records."""
        nonlocal step_time, first_step_s, val_loss, window_start, done
        if not pending:
            return
        host = _read_pending(pending)
        dt = (time.perf_counter() - window_start) / len(pending)
        window_start = None
        for i, record in enumerate(host):
            step = record["step"]
            step_time += dt
            if first_step_s is None:
                first_step_s = dt
            record.update(
                tokens_per_s=tokens_per_step / dt,
                **achieved_flops(flops_per_token, tokens_per_step / dt, peak, devices),
                time_s=dt,
            )
            loss = record["loss"]
            run_losses.append(loss)
            if not math.isfinite(loss):
                if writer is not None:
                    writer.write(record)
                raise FloatingPointError(
                    f"the train loss became {loss} at step {step}; the checkpoint in "
                    f"{run_dir} holds step {last_saved} (try a lower --lr)"
                )
            if i == len(host) - 1 and eval_now:
                if runner is not None:
                    runner.gather_model()
                if pipe.evaluates:  # ep > 1: a collective over the EP group
                    val_loss = evaluate(model, corpus, args, device)
                    record["val_loss"] = val_loss
            if writer is not None:
                writer.write(record)
            done = step
        bar.update(len(host))
        bar.set_postfix_str(
            f"loss {host[-1]['loss']:.3f}"
            + (f" val {val_loss:.3f}" if val_loss is not None else "")
            + f" {tokens_per_step / dt:,.0f} tok/s"
        )
        pending.clear()

    try:
        with stop.on_sigint():
            for step in range(start + 1, end + 1):
                prof = _start_profile() if step == profile_at else None
                if window_start is None:
                    window_start = time.perf_counter()
                lr = lr_at(step - 1, args)
                x, y = corpus.get_batch(
                    "train", batch, args.seq_len, batch_generator(args.seed, step)
                )
                if step_fn is not None:
                    values = step_fn(x, y, lr)
                    values = {k: v.clone() for k, v in values.items()}  # graph outputs are reused
                    state_bytes = state_bytes or step_fn.state_bytes
                else:
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    clip = args.grad_clip or NO_CLIP
                    if runner is not None:  # ep > 1: this pipeline's share of the batch
                        out = runner.step(pipe.shard(x), pipe.shard(y), timeline)
                        runner.reduce_grads(optimizer)
                        grad_norm = runner.clip_grad_norm_(optimizer, clip)
                    else:  # ep > 1: this rank's sequences of every micro-batch
                        out = accumulate_grads(model, x, y, args.grad_accum_steps, pipe.shard)
                        pipe.reduce_grads(model, optimizer)
                        grad_norm = pipe.clip_grad_norm_(model, optimizer, clip)
                        out = pipe.mean_losses(out)
                    if ep_buffer is not None:
                        ep_buffer.check_errors()
                    optimizer.step()
                    if state_bytes is None:  # the full footprint: after step, before zero_grad
                        state_bytes = optimizer.state_bytes()
                    optimizer.zero_grad(set_to_none=True)
                    if runner is None:
                        model.update_router_biases(stats=False)
                        values = step_values(out, grad_norm, model)
                    else:  # the pipeline's routers live on several ranks: a collective
                        values = step_values(out, grad_norm)
                        values["moe"] = runner.update_router_biases()
                pending.append({"step": step, "lr": lr, **values})
                if prof is not None:
                    _write_profile(prof, run_dir, step, pipe.rank)
                eval_now = bool(
                    args.eval_every and (step % args.eval_every == 0 or step == args.steps)
                )
                checkpoint_now = bool(args.ckpt_every and step % args.ckpt_every == 0)
                stopping = pipe.agree_to_stop(stop.requested)
                if (
                    first_step_s is None  # this call's first step: timed on its own
                    or step % args.log_every == 0
                    or eval_now
                    or checkpoint_now
                    or stopping
                    or step == end
                ):
                    flush(eval_now)
                if stopping:
                    break
                if checkpoint_now and step < end:
                    save(step)
                    last_saved = step
            flush(False)
            if done > last_saved:
                save(done)
                last_saved = done
    finally:
        bar.close()
        log.bar = None
        if writer is not None:
            writer.close()
        if warm is not None:
            warm.cancel()  # compiles not started yet (a short run): not needed any more
    if timeline is not None:
        timeline.write(run_dir)
    if stop.requested:
        saved = "checkpoint saved, continue with --resume" if args.checkpoint else "no checkpoint"
        log(f"interrupted: stopped after step {done}; {saved}")
    wall = time.perf_counter() - t0
    if runner is not None and args.sample_tokens:
        runner.gather_model()
    # ep > 1: sampling is a collective (every rank runs the same generation; rank 0's is kept).
    collective = args.sample_tokens and args.ep > 1 and pipe.evaluates
    samples = _samples(model, args, device) if collective else None
    peaks = _peak_memory_per_rank(device)  # a collective under torchrun: every rank calls it
    if not lead:  # the other ranks write nothing
        return {"out": str(run_dir), "rank": pipe.rank, "step": done, "losses": run_losses}

    records = read_metrics(run_dir / "metrics.jsonl")
    plot_loss_curve(
        records,
        run_dir / "loss.png",
        entropy=entropy,
        title=f"ptxtrain {args.preset} {args.precision}: byte-level LM",
    )
    if samples is None:
        samples = _samples(model, args, device) if args.sample_tokens else []  # lead rank only
    if samples:
        text = "".join(
            f"--- sample {i + 1} (prompt {SAMPLE_PROMPT!r}, temperature {SAMPLE_TEMPERATURE}, "
            f"step {done}) ---\n{s}\n\n"
            for i, s in enumerate(samples)
        )
        (run_dir / "samples.txt").write_text(text, encoding="utf-8")
        log(f"\nsamples (step {done}):\n" + text.rstrip())

    losses = [r["loss"] for r in records]
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    steps_run = done - start
    steady = (
        (steps_run - 1) * tokens_per_step / (step_time - first_step_s)
        if steps_run > 1 and step_time > first_step_s
        else None
    )
    summary = {
        "out": str(run_dir),
        "preset": args.preset,
        "precision": args.precision,
        "device": str(device),
        "step": done,
        "interrupted": stop.requested,
        "steps_run": steps_run,
        "tokens_per_step": tokens_per_step,
        "grad_accum_steps": args.grad_accum_steps,
        "tokens_run": steps_run * tokens_per_step,
        "time_s": wall,
        "train_time_s": step_time,
        "tokens_per_s": steps_run * tokens_per_step / step_time if step_time else 0.0,
        "first_step_s": first_step_s,
        "steady_tokens_per_s": steady,
        "flops_per_token": flops_per_token,
        "peak_tflops": peak / 1e12 if peak else None,
        **achieved_flops(flops_per_token, steady, peak, devices),  # model_tflops, mfu
        "losses": losses,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "best_val_loss": min(vals) if vals else None,
        "last_val_loss": vals[-1] if vals else None,
        "unigram_entropy": entropy,
        **_bytes_per_param(state_bytes),
        "peak_memory_bytes": peaks[0],
        "peak_memory_bytes_per_rank": peaks,
        "ranks": len(peaks),  # processes of the run (PP x EP under torchrun)
        "params": params,
        "pipeline": pipe.describe(),
        "ep": args.ep,
        "samples": samples,
    }
    write_json_atomic(run_dir / "summary.json", summary)
    log("\n" + format_summary(summary))
    return summary


__all__ = [
    "FP8_RECIPES",
    "PRECISIONS",
    "RESUMED_RUN_FIELDS",
    "TRAJECTORY_FIELDS",
    "TrainArgs",
    "TrainConfigError",
    "deterministic_mode",
    "evaluate",
    "lr_at",
    "model_config",
    "resolve_device",
    "train",
]
