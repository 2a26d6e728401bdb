"""Compile a model's FP8 kernels ahead of its first step, on background threads.

Design note (the first run's JIT cost is among the complaints DeepGEMM's users raise most).
On a fresh H200 the first FP8 step of ``ptxtrain train --preset small`` at 8 x 1024 tokens
compiles 16 NVRTC kernels (the GEMMs 0.3-1.0 s each, the quantizer instantiations) and 13
Triton kernels. The step needs them one after another, so it waits for each in turn.

Yet the NVRTC kernels the step will need follow from the model's shapes:
- the PTX GEMM configs come from :func:`ptxtrain.gemm.ptx.compile_args`, the same function the
  launch uses;
- the quantizer instantiations come from :func:`ptxtrain.quant.cuda.auto_instantiations`.

NVRTC releases the GIL, so a thread pool compiles them side by side while the host builds the
model and runs the first forward. The JIT cache makes a kernel that the step reaches first
wait for the thread already compiling it (per-key file lock) instead of compiling it twice; a
kernel that nobody has started yet is compiled by the step itself.

A wrong guess costs a background compile and never a result: the launch path still compiles
what it actually needs. The guesses are the experts' row count (the routing varies it: the
m-grouped GEMMs' configs of a band of row counts around the expected one are compiled after
the expected ones) and the token count of MTP or pipeline stages. Triton kernels are not
covered: their specializations depend on run-time argument properties (Triton's own cache,
``~/.triton/cache`` or ``TRITON_CACHE_DIR``, is shared by the ranks of a node and written
atomically).

Under torchrun (``--ep`` / ``--pp``) every rank prewarms the kernels of its own shapes: its
micro-batch's rows for the dense layers, the rows its local experts receive from the whole
expert-parallel group for the grouped GEMMs, the layers of its pipeline stages. The ranks of a
node share the disk cache, and its per-key file lock makes one process compile each kernel
while the others wait for it and load the cubin. Each rank starts at another point of the job
list (:func:`start`'s ``rank`` / ``ranks``), so the ranks of a node compile different kernels
at once and then find the rest in the cache, rather than all queueing on the same first lock.

Effect (same setting, empty caches): first step 9.6-11.3 s with prewarm against 14.5-15.6 s
without; no NVRTC compile is left on the training thread.
``PTXTRAIN_JIT_PREWARM=0`` turns it off (``ptxtrain train`` calls :func:`prewarm` for FP8 runs
on GPUs).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Prewarm", "fp8_kernels", "prewarm", "start"]

ENV_VAR = "PTXTRAIN_JIT_PREWARM"


def fp8_kernels(
    model: torch.nn.Module,
    tokens: int,
    *,
    num_sms: int,
    gemm_backend: Callable[[str, int, int, int], str],
    grouped_ptx: Callable[[int, int, int], bool],
    quant_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,),
) -> list[tuple[str, tuple]]:
    """The NVRTC kernels an FP8 training step of ``model`` on ``tokens`` rows compiles (pure).

    Args:
        model: a module holding :class:`ptxtrain.nn.Fp8Linear` layers and modules that run FP8
            grouped linears, which say so through a method ``fp8_grouped_linears(tokens)``
            returning ``[(weight [G, N_out, K], rows, config), ...]``: each stacked weight, the
            padded rows it expects per step, and its resolved :class:`Fp8LinearConfig` (e.g.
            :meth:`ptxtrain.moe.MoE.fp8_grouped_linears`). Other modules are ignored.
        tokens: rows of every Linear's input in one forward of this process (its micro-batch's
            batch x sequence; under ``--ep`` its share of the sequences, under ``--pp`` one
            pipeline micro-batch's).
        num_sms: the GPU's SM count (the GEMM heuristics size tiles by it).
        gemm_backend: ``(kind, m, n, k) -> backend name``, as
            :func:`ptxtrain.gemm.select_backend` on the device; only ``"ptx"`` GEMMs compile.
        grouped_ptx: ``(m, n, k) -> bool``, whether the grouped GEMMs run on the PTX kernels.
        quant_dtypes: input dtypes of the CUDA quantizers (the activations', gradients' and
            weights' dtypes); empty: none. Their scale rounding (power of two or not) follows
            the FP8 layers' recipes.

    Returns:
        ``[("quant", compile_module args), ("gemm", compile_gemm args), ...]`` without duplicates:
        ``("quant", (dtype, variant, full, mode))`` for
        :func:`ptxtrain.quant.cuda.compile_module`, and
        ``("gemm", (kind, cfg, n, k, out_dtype, accumulate))`` for
        :func:`ptxtrain.gemm.ptx.compile_gemm`; the quantizers first, then the GEMMs of the
        expected shapes, then the grouped GEMMs' configs of nearby row counts.

    Raises:
        ValueError: ``tokens`` or ``num_sms`` not positive.
    """
    from ptxtrain.gemm import ptx
    from ptxtrain.nn.fp8_linear import Fp8Linear
    from ptxtrain.quant import cuda as qcuda

    if tokens < 1 or num_sms < 1:
        raise ValueError(f"tokens and num_sms must be positive, got {tokens} and {num_sms}")
    jobs: dict[tuple, None] = {}
    band: dict[tuple, None] = {}  # configs of other row counts the routing may give
    pow2_flags = set()
    for mod in model.modules():
        if isinstance(mod, Fp8Linear) and mod.config.any_fp8:
            pow2_flags.add(bool(mod.config.pow2_scale))
            shapes, others = _linear_gemms(mod, tokens, gemm_backend), []
        elif callable(grouped := getattr(mod, "fp8_grouped_linears", None)):
            shapes, others = [], []
            for weight, rows, cfg in grouped(tokens):
                pow2_flags.add(bool(cfg.pow2_scale))
                shapes += _grouped_gemms(weight, rows, cfg, grouped_ptx)
                for near in _row_band(rows, weight.shape[0]):
                    others += _grouped_gemms(weight, near, cfg, grouped_ptx)
        else:
            continue
        for found, shape_list in ((jobs, shapes), (band, others)):
            found.update(dict.fromkeys(shape_list))
    # Layers repeat each other's shapes: plan each distinct shape once (a plan is ~0.2 ms of
    # host time, and a deep MoE model's row bands give tens of thousands of shapes).
    jobs, band = (
        {("gemm", ptx.compile_args(kind, m, n, k, out, False, num_sms, groups)): None
         for kind, m, n, k, out, groups in found}
        for found in (jobs, band)
    )  # fmt: skip
    quant = {
        ("quant", args): None
        for dtype in quant_dtypes
        for args in qcuda.auto_instantiations(dtype, tuple(sorted(pow2_flags)))
    }
    return [*quant, *jobs, *(job for job in band if job not in jobs)]


def _row_band(rows: int, groups: int) -> list[int]:
    """Padded row counts near the expected ``rows`` of ``groups`` experts (multiples of 128,
    the expected one left out): each expert's padding moves the total by up to 128 rows, so
    ``rows ± groups x 128`` covers a routing a little off balance."""
    from ptxtrain.gemm.ref import M_GROUPED_ALIGNMENT as align

    spread = max(groups, 1) * align
    low = max(align, rows - spread)
    return [r for r in range(low, rows + spread + 1, align) if r != rows]


def _linear_gemms(mod, tokens: int, gemm_backend) -> list[tuple]:
    """``(kind, m, n, k, out_dtype, groups)`` of an Fp8Linear's FP8 GEMMs on the PTX backend."""
    from ptxtrain.nn.fp8_linear import gemm_out_dtype

    cfg, n, k, m = mod.config, mod.out_features, mod.in_features, tokens
    act = gemm_out_dtype(mod.weight.dtype)  # the activations share the weight's dtype
    fprop_out = act if mod.bias is None else torch.float32
    return [
        (kind, mm, nn_, kk, out, 1)
        for on, kind, mm, nn_, kk, out in (
            (cfg.fprop, "1d2d", m, n, k, fprop_out),
            (cfg.dgrad, "1d2d", m, k, n, act),
            (cfg.wgrad, "1d1d", n, k, m, act),
        )
        if on and gemm_backend(kind, mm, nn_, kk) == "ptx"
    ]


def _grouped_gemms(weight: torch.Tensor, rows: int, cfg, grouped_ptx) -> list[tuple]:
    """``(kind, m, n, k, out_dtype, groups)`` of a grouped FP8 linear's PTX GEMMs: weight
    ``[G, N_out, K]`` on ``rows`` padded rows (m-grouped Fprop and Dgrad, k-grouped Wgrad)."""
    from ptxtrain.nn.fp8_linear import gemm_out_dtype

    groups, n, k = weight.shape
    out = gemm_out_dtype(weight.dtype)
    return [
        (kind, mm, nn_, kk, out_dtype, groups)
        for on, kind, mm, nn_, kk, out_dtype in (
            (cfg.fprop, "m_grouped", rows, n, k, out),
            (cfg.dgrad, "m_grouped", rows, k, n, out),
            (cfg.wgrad, "k_grouped", n, k, rows, torch.float32),
        )
        if on and grouped_ptx(mm, nn_, kk)
    ]


@dataclass
class Prewarm:
    """Background compiles started by :func:`prewarm`: ``wait()`` blocks until they finish and
    returns ``{"jobs": n, "failed": [(job, error text), ...]}``; ``cancel()`` drops the ones not
    started (the running ones finish). A failed compile is recorded, never raised: the launch
    path compiles that kernel again and raises there."""

    jobs: list[tuple[str, tuple]]
    futures: list[concurrent.futures.Future] = field(default_factory=list)
    executor: concurrent.futures.ThreadPoolExecutor | None = None

    def wait(self, timeout: float | None = None) -> dict:
        concurrent.futures.wait(self.futures, timeout=timeout)
        failed = [
            (job, repr(f.exception()))
            for job, f in zip(self.jobs, self.futures, strict=True)
            if f.done() and not f.cancelled() and f.exception() is not None
        ]
        return {"jobs": len(self.jobs), "failed": failed}

    def cancel(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)


def _run_job(job: tuple[str, tuple]) -> None:
    kind, args = job
    if kind == "quant":
        from ptxtrain.quant import cuda as qcuda

        dtype, variant, full, mode = args
        qcuda.compile_module(dtype, variant=variant, full=full, mode=mode)  # as _bound calls it
    else:
        from ptxtrain.gemm import ptx

        ptx.compile_gemm(*args)


def start(
    jobs: list[tuple[str, tuple]],
    max_workers: int | None = None,
    *,
    rank: int = 0,
    ranks: int = 1,
) -> Prewarm:
    """Compile ``jobs`` (from :func:`fp8_kernels`) on a pool of ``max_workers`` threads; returns
    at once.

    ``rank`` / ``ranks``: this process's place among the ``ranks`` processes of a node that
    prewarm the same cache (torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``): the quantizers
    still come first, and within the quantizers and within the GEMMs this process starts
    ``rank / ranks`` of the way into the list and wraps around, so that the processes compile
    different kernels at once and find the others' in the cache (module note).
    ``max_workers`` defaults to this process's share of the CPUs less one, between 1 and 8.

    Raises:
        ValueError: ``ranks`` < 1 or ``rank`` outside ``[0, ranks)``.
    """
    if not (isinstance(ranks, int) and isinstance(rank, int) and 0 <= rank < ranks):
        raise ValueError(f"rank must be in [0, ranks) with ranks >= 1, got {rank=}, {ranks=}")
    if max_workers is None:
        max_workers = max(1, min(8, _cpus() // ranks - 1))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="ptxtrain-jit")
    # The quantizers first: the step's first launches are quantizations.
    order = [
        job
        for quant in (True, False)
        for job in _rotated([j for j in jobs if (j[0] == "quant") == quant], rank, ranks)
    ]
    futures = {job: pool.submit(_run_job, job) for job in order}
    pool.shutdown(wait=False)  # no more submissions; the queued jobs still run
    return Prewarm(jobs=order, futures=[futures[j] for j in order], executor=pool)


def _rotated(items: list, rank: int, ranks: int) -> list:
    """``items`` starting ``rank / ranks`` of the way in, wrapped around."""
    cut = len(items) * rank // ranks
    return items[cut:] + items[:cut]


def _cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks (macOS)
        return os.cpu_count() or 2


def prewarm(
    model: torch.nn.Module,
    tokens: int,
    device: torch.device,
    max_workers: int | None = None,
    *,
    rank: int = 0,
    ranks: int = 1,
) -> Prewarm | None:
    """Start compiling ``model``'s FP8 kernels for forwards of ``tokens`` rows (see
    :func:`fp8_kernels`) on ``device`` in background threads (see the module note); ``rank`` /
    ``ranks``: this process's local rank and the processes per node (:func:`start`). Returns
    None when there is nothing to do: not an sm_90 CUDA device, NVRTC missing,
    ``PTXTRAIN_JIT_PREWARM=0``, or no kernel to compile."""
    from ptxtrain import _backend, gemm, quant
    from ptxtrain.gemm import ptx
    from ptxtrain.jit.cache import env_flag

    if os.environ.get(ENV_VAR, "").strip() and not env_flag(ENV_VAR):
        return None
    if device.type != "cuda" or not ptx.supports(128, 128, 128, device=device):
        return None
    from ptxtrain.quant import cuda as qcuda

    probe = torch.empty(0, device=device, dtype=torch.bfloat16)
    want_quant = any(quant.select_backend(probe, op) == "cuda" for op in qcuda.AUTO_OPS)
    forced = _backend.requested(gemm.ENV_VAR, gemm.BACKENDS)
    jobs = fp8_kernels(
        model,
        tokens,
        num_sms=torch.cuda.get_device_properties(device).multi_processor_count,
        gemm_backend=lambda kind, m, n, k: gemm.select_backend(kind, m, n, k, device),
        grouped_ptx=lambda m, n, k: (
            forced in ("auto", "ptx") and ptx.supports(m, n, k, device=device)
        ),
        quant_dtypes=(torch.bfloat16,) if want_quant else (),
    )
    return start(jobs, max_workers, rank=rank, ranks=ranks) if jobs else None
