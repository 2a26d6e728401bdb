"""The parallelism strategy of a ``ptxtrain train`` run: one process, expert parallelism (EP),
pipeline parallelism (PP) or both (PP x EP).

:class:`ParallelStrategy` is configured by ``(pp, ep)`` as torchtitan's ``ParallelDims`` is by
its degrees; it owns the process groups and this rank's place in them.

Pipeline parallelism (``pp > 1``, one process per rank under ``torchrun``): the forward and
backward of the single-process step (:mod:`ptxtrain.train.loop`) become one schedule step over
``num_chunks`` micro-batches (1F1B, DualPipe or DualPipeV; see :mod:`ptxtrain.train.pipeline`),
followed by the cross-rank gradient reduction and a global
clipping norm. Rank 0 writes the run folder; with ``timeline`` every rank writes
``timeline_rank{r}.jsonl``. Checkpoints (:mod:`ptxtrain.train.checkpoint`, sharded): each rank
writes the parameters, buffers (router biases) and optimizer state of the stages it owns (a
DualPipe mirror copy is identical and written once) under the full model's names, in parallel
with the others, so a pipeline run resumes with any ``--pp`` / ``--schedule`` / ``--ep`` or none,
and a single-process checkpoint resumes under ``--pp``. On ``--resume`` every rank reads its own
stages; with the same pipeline the resumed losses are bitwise those of a straight run.

Expert parallelism (``ep > 1``, one process per rank under ``torchrun``; DeepSeek-V3 report
§3.2.2): every rank builds the same full model (same seed), then keeps ``1/ep`` of every MoE
layer's routed experts (:meth:`~ptxtrain.model.DeepSeekV3.enable_expert_parallel`); tokens reach
their experts through :class:`ptxtrain.ep.Buffer` dispatch/combine. The ranks are also data
parallel: rank ``r`` trains on sequences ``[r·B/ep, (r+1)·B/ep)`` of the step's batch, so the
global batch is the single-process one. The step is :class:`~ptxtrain.train.ep_step.
ExpertParallelStep`: after backward the replicated parameters' gradients are averaged over the
ranks and the expert gradients (which already sum every rank's tokens) are divided by ``ep``,
which gives the single-process gradient of the batch-mean loss; clipping uses the global norm;
the router bias update uses the global expert load. Losses, evaluation and
samples are computed collectively and agree on every rank. Checkpoints: each rank writes its
experts (one entry per expert, by global index) and the replicated entries are written once, so
a run can be resumed with another ``ep`` or none; every rank reads its experts' entries.

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
pipeline rank). Checkpoints: each rank writes its experts of the stages it owns; resume reads
them back under any layout.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..data import ByteTokenizer
from . import evaluation
from .checkpoint import Checkpointer, CheckpointError, checkpoint_group
from .ep_step import ExpertParallelStep, apply_update
from .evaluation import SAMPLE_COUNT, SAMPLE_PROMPT, shard_rows
from .faults import DESTROY_TIMEOUT_S, CollectiveWatch, collective_failed, nccl_environment
from .pipeline import pipeline_groups
from .runtime import Printer, TrainConfigError, param_groups, resolve_device
from .state_layout import StateLayout
from .step import NO_CLIP, SingleDeviceStep, step_values

if TYPE_CHECKING:
    from .args import TrainArgs

__all__ = [
    "PP_OVERLAP_ENV",
    "ParallelStrategy",
    "destroy_default_group",
    "local_rank",
    "peak_memory_per_rank",
]

PP_OVERLAP_ENV = "PTXTRAIN_PP_OVERLAP"  # read by ptxtrain.train.pipeline.PipelineRunner


class ParallelStrategy:
    """How one ``ptxtrain train`` run spreads over processes, configured by ``(pp, ep)`` as
    torchtitan's ``ParallelDims`` is by its degrees: one process (``pp = ep = 1``), expert
    parallelism (``ep > 1``), pipeline parallelism (``pp > 1``) or both (``pp * ep`` ranks).

    It owns what differs between them, so that the training loop does not branch on them:
    the process groups and this rank's place in them, the device, the model's split over the
    ranks (:meth:`build`: experts, pipeline stages), the optimizer step with its gradient
    reductions and clipping (:meth:`step`), the checkpoints (:meth:`save` / :meth:`load`: each
    rank writes and reads its own entries under layout-independent names), evaluation and sampling
    (:meth:`evaluate`, :meth:`finish`), the metrics gathered over ranks (losses, router load,
    peak memory) and which rank prints and writes (:attr:`is_lead`, :attr:`log`).

    Args:
        args: the run's validated ``TrainArgs``.
        config: the model's ``DeepSeekV3Config``.
        param_dtype: the floating dtype the model is built in.
        device: the resolved ``--device`` (None: resolve ``args.device`` here); under torchrun
            a CUDA device becomes this rank's ``cuda:LOCAL_RANK``.

    Raises (on every rank alike, since the checks depend on the arguments only):
        TrainConfigError: the model cannot be cut into the schedule's stages (pp), the routed
            experts cannot be split over the ranks (ep), WORLD_SIZE (or an existing process
            group) does not match ``--pp`` / ``--ep`` (``pp * ep`` with both), or no CUDA device
            is visible.

    With both, ``pp_group`` / ``ep_group`` / ``mirror_group`` and ``pp_rank`` / ``ep_rank``
    describe this rank's place (:func:`~ptxtrain.train.pipeline.pipeline_groups`); otherwise
    the groups are None (the world) and the ranks follow the one parallelism in use.
    """

    def __init__(
        self, args: TrainArgs, config, param_dtype: torch.dtype, device: torch.device | None = None
    ) -> None:
        self.args, self.param_dtype = args, param_dtype
        self.pipeline = args.pp > 1
        self.ep = args.ep
        self.active = self.pipeline or self.ep > 1
        self.rank = 0
        # rank = pp_rank * ep + ep_rank (ptxtrain.train.pipeline.pipeline_groups)
        self.pp_rank, self.ep_rank = 0, 0
        self.pp_group = self.ep_group = self.mirror_group = None  # None: the world
        self.p2p_groups = None  # None: the schedule creates them (a world-wide pipeline)
        self.model = self.optimizer = self.runner = self.checkpointer = None  # set by build()
        self.ep_buffer = self.warm = self.single_step = self.ep_step = None
        self.state_bytes: dict[str, Any] | None = None  # the optimizer's footprint, first step
        self.layout: tuple[int, ...] | None = None  # pp > 1: decoder layers per stage
        if self.active:
            self._check_model(config)
        device = resolve_device(args.device) if device is None else device
        # Names the collective a failed step was in (ptxtrain.train.faults); a no-op until the
        # process group exists.
        self.watch = CollectiveWatch(0, 1, args.collective_timeout)
        if self.active:
            device = self._init_process_group(device)
            self._init_groups()
            try:
                self.watch = CollectiveWatch.for_default_group(args.collective_timeout)
            except ValueError as e:  # the test hook's variable is malformed
                raise TrainConfigError(str(e)) from None
        self.device = device
        self.log = Printer(enabled=self.is_lead)  # the lead rank prints

    @property
    def is_lead(self) -> bool:
        """Whether this rank prints and writes the run folder (global rank 0)."""
        return self.rank == 0

    @property
    def world_size(self) -> int:
        """Processes of the run, one device each (``pp * ep``; MFU is per device)."""
        return self.args.pp * self.ep

    def _check_model(self, config) -> None:
        args = self.args
        if self.pipeline:
            from .pipeline_layout import format_layout, resolve_layout

            flags = f"--pp {args.pp} --schedule {args.schedule}"
            if args.pp_layout is not None:
                flags += f" --pp-layout {format_layout(args.pp_layout)}"
            kw = dict(
                seq_len=args.seq_len, micro_batch_tokens=self.micro_batch_tokens(), ep=self.ep
            )
            try:
                self.layout = resolve_layout(
                    config, args.schedule, args.pp, layout=args.pp_layout, **kw
                )
            except ValueError as e:
                raise TrainConfigError(f"{flags}: {e}") from None
        if self.ep > 1:
            if config.n_routed_experts % self.ep:
                raise TrainConfigError(
                    f"--ep {self.ep}: the model's n_routed_experts={config.n_routed_experts} must "
                    "be divisible by --ep (each rank holds n_routed_experts / ep experts per "
                    "MoE layer)"
                )
            if config.n_moe_layers == 0:
                raise TrainConfigError(f"--ep {self.ep}: the model has no MoE layer")

    def _init_process_group(self, device: torch.device) -> torch.device:
        """Check the world size, pick this rank's GPU and join (or create) the default process
        group; returns this rank's device."""
        import torch.distributed as dist

        args = self.args
        if self.pipeline and self.ep > 1:
            flags, want = f"--pp {args.pp} --ep {self.ep}", args.pp * self.ep
            what = "pipeline rank x expert-parallel rank"
        elif self.pipeline:
            flags, want, what = f"--pp {args.pp}", args.pp, "pipeline rank"
        else:
            flags, want, what = f"--ep {self.ep}", self.ep, "expert-parallel rank"
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
            # (An existing group keeps the timeout it was created with.)
            backend = "nccl" if device.type == "cuda" else "gloo"
            if backend == "nccl":
                nccl_environment()
            timeout = datetime.timedelta(seconds=args.collective_timeout)
            dist.init_process_group(backend, timeout=timeout)
            atexit.register(destroy_default_group, min(DESTROY_TIMEOUT_S, args.collective_timeout))
        self.rank = dist.get_rank()
        return device

    def _init_groups(self) -> None:
        """This rank's groups and ranks: the ``pp x ep`` layout's groups with both, else the
        world and the global rank."""
        if self.pipeline and self.ep > 1:
            groups = pipeline_groups(self.args.pp, self.ep, self.args.schedule)  # every rank
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

        with self.watch.phase("all_reduce of the stop flag (after the step)"):
            flag = torch.tensor([int(requested)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return bool(flag.item())

    def describe(self) -> dict[str, Any] | None:
        """The run's pipeline for ``config.json``, ``summary.json`` and the checkpoint: ``pp``,
        ``schedule``, ``num_chunks`` and ``layout`` (decoder layers per stage, a list); None
        without ``--pp``."""
        if not self.pipeline:
            return None
        a = self.args
        layout = list(self.layout) if self.layout is not None else None
        return {"pp": a.pp, "schedule": a.schedule, "num_chunks": a.chunks(), "layout": layout}

    def note(self) -> str:
        """What the run's first log line adds about the parallelism ("" for one process)."""
        return f"; experts split over {self.ep} ranks" if self.ep > 1 else ""

    # ------------------------------------------------------------------ model and optimizer
    def build(self, config) -> tuple[torch.nn.Module, Any]:
        """This rank's model and optimizer: the full model built from the seed (the same on
        every rank), this rank's experts kept (``ep > 1``), FP8 layers (``--precision fp8``)
        and recomputation applied, then the pipeline stages cut (``pp > 1``: the optimizer
        holds their parameters only) and the checkpointer and step set up. Returns
        ``(model, optimizer)``: the full model (evaluation, sampling, checkpoints) and
        :class:`~ptxtrain.optim.AdamW` over ``param_groups`` of this rank's parameters."""
        from ..model import build_model
        from ..model.deepseek import convert_model_to_fp8_training
        from ..nn import Fp8LinearConfig
        from ..optim import AdamW

        a = self.args
        model = build_model(config, dtype=self.param_dtype, device=self.device, seed=a.seed)
        self.split_experts(model)  # ep > 1: keep this rank's experts of the full model
        if a.precision == "fp8":
            convert_model_to_fp8_training(model, Fp8LinearConfig.from_recipe_name(a.fp8_recipe))
        model.set_recompute(a.recompute)
        model.train()
        self.runner = self._pipeline_runner(model)  # None when pp == 1
        trained = model if self.runner is None else self.runner.module  # this rank's parameters
        self._prewarm(trained)
        optimizer = AdamW(param_groups(trained, a.weight_decay), lr=a.lr)
        self.model, self.optimizer = model, optimizer
        # ep > 1: this rank's experts, pp > 1: its stages, under the full model's names
        self.checkpointer = self.checkpointer_of(model, optimizer, self.runner)
        # The MoE layers' shared Buffer (ep > 1). Its nvlink kernels report a flag wait that
        # timed out (a peer failed or stalled) only at the next operation, after writing wrong
        # rows: checked before every optimizer step so that no step uses them (a no-op for
        # "all_to_all"; the step has synchronized for the gradient norm already).
        self.ep_buffer = getattr(model, "ep_buffer", None)
        if not self.active:
            self.single_step = self._single_device_step(model, optimizer)
        elif self.runner is None:
            self.ep_step = ExpertParallelStep(
                model, optimizer, rank=self.ep_rank, ranks=self.ep,
                grad_accum_steps=a.grad_accum_steps, grad_clip=a.grad_clip, device=self.device,
                watch=self.watch, buffer=self.ep_buffer,
            )  # fmt: skip
        return model, optimizer

    def _prewarm(self, module) -> None:
        """FP8 on GPUs: compile the NVRTC kernels of this rank's step on background threads
        while the host sets up and runs the first forward (ptxtrain.nn.prewarm;
        PTXTRAIN_JIT_PREWARM=0: off). ``module``: what this rank runs (its pipeline stages
        with ``pp > 1``, its experts with ``ep > 1``); the rows are one micro-batch's of this
        rank (:meth:`micro_batch_tokens`). The ranks of a node share the JIT cache, so each
        kernel is compiled once per node (module note of ptxtrain.nn.prewarm)."""
        a = self.args
        if a.precision != "fp8" or self.device.type != "cuda":
            return
        from ..nn.prewarm import prewarm

        rank, ranks = local_rank()
        self.warm = prewarm(module, self.micro_batch_tokens(), self.device, rank=rank, ranks=ranks)

    def micro_batch_tokens(self) -> int:
        """Rows of every dense layer's input in one forward on this rank: the micro-batch's
        sequences (its ``1/ep`` share with ``ep > 1``, one of ``num_chunks`` pipeline
        micro-batches with ``pp > 1``) times ``seq_len``."""
        a = self.args
        sequences = a.batch_size // self.ep
        if self.pipeline:
            sequences //= a.chunks()
        return max(sequences, 1) * a.seq_len

    def _pipeline_runner(self, model):
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
            layout=self.layout,
        )

    def _single_device_step(self, model, optimizer) -> SingleDeviceStep:
        """One process: the step object (eager, or a replayed CUDA graph). Its losses and
        gradient norm stay on the device until a logging step reads the pending ones at once."""
        a = self.args
        step = SingleDeviceStep(
            model,
            optimizer,
            grad_accum_steps=a.grad_accum_steps,
            grad_clip=a.grad_clip,
            device=self.device,
            cuda_graphs=a.cuda_graphs,
            log=self.log,
        )
        if a.cuda_graphs and self.device.type == "cuda" and step.graphs_off_reason is not None:
            self.log(f"CUDA graphs: off ({step.graphs_off_reason}); running the steps eagerly")
        return step

    def close(self) -> None:
        """Cancel the FP8 kernel compiles not started yet (a short run does not need them)."""
        if self.warm is not None:
            self.warm.cancel()

    # ------------------------------------------------------------------ the step
    def step(
        self, x: torch.Tensor, y: torch.Tensor, lr: float, timeline=None, step: int | None = None
    ) -> dict[str, Any]:
        """One optimizer step on the step's batch ``x, y [B·N, T]`` int64 (CPU, the same on
        every rank) at learning rate ``lr``; ``timeline`` records the pipeline schedule;
        ``step``: its number (1-based; None: the one after the last), which errors name.

        Returns what the step logs (:func:`~ptxtrain.train.step.step_values`: losses, gradient
        norm before clipping, router load), device tensors left unread; every rank returns the
        global values (means over the ranks' sequences).

        Raises:
            CollectiveError: with ``pp > 1`` or ``ep > 1``, a collective failed or ran past
                ``--collective-timeout`` (a peer died or hangs); the message names this rank,
                the step, the collective and what the other ranks last reported.
        """
        self.watch.begin_step(self.watch.step + 1 if step is None else step)
        if self.single_step is not None:
            values = self.single_step(x, y, lr)
            values = {k: v.clone() for k, v in values.items()}  # graph outputs are reused
            self.state_bytes = self.state_bytes or self.single_step.state_bytes
            return values
        if self.ep_step is not None:
            values = self.ep_step(x, y, lr)
            self.state_bytes = self.state_bytes or self.ep_step.state_bytes
            return values
        return self._pipeline_step(x, y, lr, timeline)

    def _pipeline_step(self, x, y, lr: float, timeline) -> dict[str, Any]:
        """``pp > 1`` (with or without ``ep > 1``): the schedule's step, the optimizer update
        and the routers' bias update over the pipeline (see :meth:`step`)."""
        optimizer, runner, watch = self.optimizer, self.runner, self.watch
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        out, grad_norm = self._pipeline_grads(x, y, timeline, self.args.grad_clip or NO_CLIP)
        self.state_bytes = apply_update(optimizer, self.ep_buffer, watch, self.state_bytes)
        with watch.phase("all_reduce of the router load (expert counts)"):
            values = step_values(out, grad_norm)  # the pipeline's routers live on several ranks
            values["moe"] = runner.update_router_biases()  # a collective
            return values

    def _pipeline_grads(self, x, y, timeline, clip: float):
        """``pp > 1``: the schedule's forward and backward on this pipeline's share of the
        batch (``ep > 1``: its sequences), the gradient reductions and the clipping; returns
        ``(losses, grad_norm)``. Each collective runs as a phase of :attr:`watch`."""
        runner, watch = self.runner, self.watch
        moe = "; the MoE dispatch / combine all_to_all" if self.ep > 1 else ""
        schedule = (
            f"pipeline schedule {self.args.schedule}: P2P send / recv between the stages{moe}; "
            "the losses' all_reduce"
        )
        with watch.phase(schedule):
            out = runner.step(self.shard(x), self.shard(y), timeline)
        watch.fault_point()
        with watch.phase("all_reduce of the gradients (mirror / expert-parallel groups)"):
            runner.reduce_grads(self.optimizer)
        with watch.phase("all_reduce of the gradient norm"):
            grad_norm = runner.clip_grad_norm_(self.optimizer, clip)
        return out, grad_norm

    # ------------------------------------------------------------------ checkpoints
    def save(self, run_dir: Path, step: int, *, config: dict, extra: dict) -> None:
        """Write the checkpoint of ``step`` (a collective: every rank calls it and writes its
        entries; ``--async-ckpt``: returns once they are copied to CPU, see :meth:`wait_for_save`).
        ``config`` / ``extra``: :meth:`~ptxtrain.train.checkpoint.Checkpointer.save`'s.

        Raises:
            OSError: on every rank when the write failed on any (from a background write: at
                the next save or :meth:`wait_for_save`).
        """
        self.checkpointer.save(run_dir, step=step, config=config, extra=extra)

    def wait_for_save(self, raise_errors: bool = True) -> None:
        """Wait until the last checkpoint (``--async-ckpt``: written in the background) is
        committed; ``raise_errors=False`` ignores its failure (an exception is already on its way
        out of the run). The same outcome reaches every rank (the write's collectives share it)."""
        if self.checkpointer is None:
            return
        try:
            self.checkpointer.wait()
        except Exception:
            if raise_errors:
                raise

    @property
    def saving(self) -> bool:
        """Whether a background checkpoint write is running now."""
        return self.checkpointer is not None and self.checkpointer.writing

    def checkpoint_times(self) -> list[dict[str, Any]]:
        """Each save of this run: ``step``, ``blocking_s``, ``total_s`` (this rank's clock;
        :attr:`~ptxtrain.train.checkpoint.Checkpointer.saves`)."""
        return [] if self.checkpointer is None else list(self.checkpointer.saves)

    def load(self, run_dir: Path, *, expected_config: dict) -> dict[str, Any]:
        """Load the checkpoint in ``run_dir`` on every rank, each reading the entries it holds
        (whatever layout wrote it); returns its metadata.

        Raises:
            CheckpointError: on every rank when any rank fails to load (:meth:`on_every_rank`).
        """
        return self.on_every_rank(
            lambda: self.checkpointer.load(run_dir, expected_config=expected_config)
        )

    # ------------------------------------------------------------------ evaluation, metrics
    def evaluate(self, corpus) -> float | None:
        """The validation loss (:func:`~ptxtrain.train.evaluation.evaluate`) on the ranks that
        evaluate (:attr:`evaluates`), None elsewhere; every rank must call it (``pp > 1``
        gathers the stages to pipeline rank 0 first)."""
        with self.watch.phase("evaluation: the stages' gather and the model's collectives"):
            if self.runner is not None:
                self.runner.gather_model()
            if not self.evaluates:  # ep > 1: a collective over the EP group
                return None
            return evaluation.evaluate(self.model, corpus, self.args, self.device)

    def reset_peak_memory(self) -> None:
        """Start the peak-memory count of the run (CUDA; nothing on CPU)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def finish(self) -> tuple[list[str] | None, list[int | None]]:
        """``(samples, peaks)`` at the end of the run (a collective: every rank calls it).

        ``samples``: the end-of-run samples (:func:`~ptxtrain.train.evaluation.sample_texts`;
        ``[]`` with ``sample_tokens`` 0) on the lead rank, None on the others (``ep > 1``:
        sampled collectively by the ranks that evaluate, rank 0's kept). ``peaks``: each rank's
        peak CUDA memory (:func:`peak_memory_per_rank`)."""
        a = self.args
        with self.watch.phase("end of run: sampling and the peak-memory all_gather_object"):
            if self.runner is not None and a.sample_tokens:
                self.runner.gather_model()
            collective = a.sample_tokens and self.ep > 1 and self.evaluates
            samples = evaluation.sample_texts(self.model, a, self.device) if collective else None
            peaks = peak_memory_per_rank(self.device)  # an all_gather_object under torchrun
        if samples is None and self.is_lead:
            samples = evaluation.sample_texts(self.model, a, self.device) if a.sample_tokens else []
        return samples, peaks

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
                    self.ep_group,
                    backend=a.ep_backend,
                    max_tokens=max_tokens,
                    timeout_s=a.collective_timeout,
                )
            except ValueError as e:
                raise TrainConfigError(f"--ep {self.ep} --ep-backend {a.ep_backend}: {e}") from e

    def shard(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's sequences of a batch ``[B, T]`` (all of them unless ``ep > 1``): rows
        ``[e·B/ep, (e+1)·B/ep)`` for EP rank ``e`` (with ``pp > 1``: its pipeline's share)."""
        return shard_rows(t, self.ep_rank, self.ep) if self.ep > 1 else t

    def checkpointer_of(self, model, optimizer, runner=None) -> Checkpointer:
        """This rank's :class:`~ptxtrain.train.checkpoint.Checkpointer` (a collective under
        torchrun: it creates the checkpoints' gloo group on first use). Every rank writes the
        entries it owns and reads those it holds, under layout-independent names
        (:class:`~ptxtrain.train.state_layout.StateLayout`): ``ep > 1`` its experts (found in
        the model's ``Experts``), ``pp > 1`` (``runner`` given) its stages, written by their
        owner (a DualPipe mirror copy once) and read by every rank that holds them."""
        save = load = None  # the whole model
        if runner is not None:
            save, load = runner.owned, runner.stages
        layout = StateLayout(model, optimizer, save_modules=save, load_modules=load)
        group = checkpoint_group() if self.active else None
        return Checkpointer(layout, group=group, async_save=self.args.async_ckpt)

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


def local_rank() -> tuple[int, int]:
    """``(local rank, processes on this node)`` from torchrun's ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE``; without them the default group's rank and size (one node), or
    ``(0, 1)`` without a group."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if grouped else 1
    rank = dist.get_rank() if grouped else 0
    ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1)
    return int(os.environ.get("LOCAL_RANK", rank)) % ranks, ranks


def destroy_default_group(timeout_s: float = DESTROY_TIMEOUT_S) -> None:
    """At exit: destroy the default process group, bounded by ``timeout_s`` seconds
    (:func:`ptxtrain.train.faults.destroy_process_group`; the NCCL communicators are aborted
    instead after a collective failed). When it does not return in time, say so on stderr and
    end the process with status 1 at once: the interpreter's own teardown would wait for the
    group again."""
    from .faults import destroy_process_group

    if destroy_process_group(timeout_s, failed=collective_failed()):
        return
    print(
        f"ptxtrain: destroy_process_group did not return within {timeout_s:g} s (a peer is gone "
        "or hangs); exiting without it",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def peak_memory_per_rank(device: torch.device) -> list[int | None]:
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
