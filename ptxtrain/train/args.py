"""The arguments of a ``ptxtrain train`` run (:class:`TrainArgs`, the CLI's flags as one
validated dataclass) and the field groups a checkpoint compares or remembers on resume.

Its own module so that the helpers of the training loop (the parallelism strategy, evaluation)
can name the type without importing the loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..nn.recompute import RECOMPUTE_MODES
from .faults import DEFAULT_TIMEOUT_S
from .runtime import DEVICES, TrainConfigError

__all__ = [
    "EP_BACKENDS",
    "FP8_RECIPES",
    "PRECISIONS",
    "RESUMED_RUN_FIELDS",
    "TRAJECTORY_FIELDS",
    "TrainArgs",
]

PRECISIONS = ("bf16", "fp8")
# Fp8Linear recipes --fp8-recipe takes (ptxtrain.nn.RECIPES without "bf16", which runs no FP8).
FP8_RECIPES = ("deepseek", "deepseek_pow2", "deepseek_wgrad_bf16")
EP_BACKENDS = ("all_to_all", "nvlink")  # ptxtrain.ep.Buffer backends (--ep-backend)
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
    # write checkpoints in a background thread: training waits only for the copy to CPU
    async_ckpt: bool = False
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
    # decoder layers per pipeline stage, in stage order (pp > 1; --pp-layout 2,3,3,2); None =
    # the cost-balanced layout (ptxtrain.train.pipeline_layout)
    pp_layout: tuple[int, ...] | None = None
    # --- expert parallelism (torchrun --nproc-per-node EP -m ptxtrain train --ep EP) ---
    ep: int = 1  # expert-parallel (and data-parallel) ranks (WORLD_SIZE = pp * ep); 1 = none
    ep_backend: str = "all_to_all"  # the MoE layers' shared Buffer: "all_to_all" or "nvlink"
    # with pp * ep > 1: seconds any collective may wait for a peer before the rank gives up with
    # an error naming the collective and the ranks (ptxtrain.train.faults)
    collective_timeout: float = DEFAULT_TIMEOUT_S
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
        if not is_num(self.collective_timeout) or self.collective_timeout <= 0:
            raise bad("collective_timeout", "must be a finite number of seconds > 0")
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
        for name in ("deterministic", "cuda_graphs", "checkpoint", "async_ckpt"):
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
        if self.pp_layout is not None and (
            not isinstance(self.pp_layout, (list, tuple))
            or not all(is_int(c) and c >= 0 for c in self.pp_layout)
        ):
            raise bad("pp_layout", "must be decoder-layer counts (integers >= 0), one per stage")
        if self.pp == 1:
            if self.pp_layout is not None:
                raise TrainConfigError("--pp-layout lays out pipeline stages: it needs --pp > 1")
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
