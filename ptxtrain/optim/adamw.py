"""AdamW with BF16 moments, FP32 master weights and FP32 gradient accumulation.

Design note (DeepSeek-V3 report §3.3 "Low-Precision Storage and Communication"; docs/design.md §1):

* **Why BF16 moments.** Adam's two moment buffers are the largest part of optimizer state.
  DeepSeek-V3 keeps them in BF16 and reports no observable loss of quality. The arithmetic stays
  FP32: each step upcasts ``exp_avg`` / ``exp_avg_sq``, updates them, and rounds them back to BF16
  (round to nearest even). BF16 has FP32's exponent range, so the tiny squared gradients in
  ``exp_avg_sq`` do not underflow; FP16 would flush them to zero, which is why
  ``moment_dtype=torch.float16`` is refused. Only ``sqrt(exp_avg_sq)`` reaches the update, which
  halves the relative rounding error there (about 2^-10).
* **Why FP32 master weights and FP32 gradients.** An update ``lr·m/√v`` is often smaller than half
  a BF16 ulp of the weight and would vanish if added to the BF16 weight directly. So the optimizer
  keeps an FP32 ``master`` copy, updates it, and rounds it into the BF16 working weight. Gradients
  summed over micro-batches stay FP32 too (Megatron's ``main_grad``). Each low-precision parameter
  gets a post-accumulate-grad hook that adds its BF16 ``.grad`` into an FP32 buffer owned by the
  optimizer and then frees ``.grad``.
* **Byte accounting** (per parameter element, live during ``step``):

  ==========================  ======  ======  ======  =======  ==========  =====
  setup                       weight  grad    master  exp_avg  exp_avg_sq  total
  ==========================  ======  ======  ======  =======  ==========  =====
  torch AdamW, FP32 model     4       4       –       4        4           16
  usual BF16 mixed precision  2       4       4       4        4           18
  this AdamW (DeepSeek-V3)    2       4       4       2        2           14
  ==========================  ======  ======  ======  =======  ==========  =====

  Each parameter tensor also holds a 4-byte ``step`` counter (a 0-d FP32 tensor, as in torch);
  ``optimizer_state_bytes`` counts it under ``other``. :func:`optimizer_state_bytes` measures the
  tensors that are actually allocated, for any ``torch.optim.Optimizer``.
* **Why a multi-tensor (foreach) path.** The per-tensor update runs ~15 small ops per parameter
  (upcasts, lerp, mul/addcmul, sqrt, div, add, addcdiv, copies back, the step counter). On an H200
  the ``small`` model (94M params in 211 tensors) spends ~49 ms of host time per step (of ~350 ms)
  in ``step`` just launching those kernels. On CUDA, ``step`` and :meth:`AdamW.clip_grad_norm_`
  therefore group the parameters by (device, dtypes, master or not) and run each group through a
  fixed ~15 ``torch._foreach_*`` calls, in chunks of at most 2^25 elements so the FP32
  temporaries (upcast moments and denominator, 12 bytes/element; 16 with BF16 grads) stay
  bounded. The operation order is the per-tensor path's, and every scalar is rounded as the
  per-tensor kernels round it (CUDA's ``t / x`` multiplies by an FP32 ``1/x``). On CPU both
  paths give bitwise-identical updates. On CUDA they do not: on an H200 (torch 2.11) a few
  elements in 200 of the FP32 masters differ by one ulp after a step (the fused foreach kernels
  round some intermediate differently; not traced further), so the ``gpu`` test compares them
  within a few FP32 ulps, and low-precision copies within one of their own ulps. The CUDA
  2-norm in clipping also differs by a few ulps: ``_foreach_norm`` sums in another order.
* **Why a fused path** (``fused``, the default on CUDA). The foreach path still runs ~15 kernels
  per chunk, most of them a full pass over some operand or an FP32 temporary: training a 4.19 B
  parameter MoE on an H200, its step takes 130 ms, ~5x the bandwidth floor and 37% of the GPU
  time of a step. The update needs each element's operands once. Bytes moved per element:

  ==============================================  ==========  ===========  =====
  one step                                        read        written      total
  ==============================================  ==========  ===========  =====
  fused path (FP32 grad, master; BF16 moments)    4+4+2+2     4+2+2+2 (w)  22
  same with FP32 moments                          4+4+4+4     4+4+4+2      30
  ``torch.optim.AdamW(fused=True)``, FP32 model   4+4+4+4     4+4+4        28
  clipping (the norm pass over the gradient)      4           –            +4
  ==============================================  ==========  ===========  =====

  One Triton kernel per bucket reads and writes exactly that (:mod:`ptxtrain.optim.triton`);
  ``ptxtrain bench optim`` measures it against a device copy (the goal: at least 80% of the
  copy's bytes per second) and against torch's fused AdamW.
* **Flat buffers rather than pointer tables.** At construction the fused path moves every
  FP32/BF16/FP16 parameter that requires grad into flat buffers, one set per (param group,
  device, dtype) (:class:`~ptxtrain.optim.fused.Bucket`): working weights (``p.data`` becomes a
  view), FP32 masters, both moments, FP32 gradients (``p.main_grad``), each parameter at the
  same offset in all five, aligned to 256 elements. A multi-tensor kernel over pointer tables
  would leave the storage alone, but needs its tables built per launch (or cached and kept in
  step with the parameters), and per-tensor chunking like ``multi_tensor_apply``. With flat
  buffers a bucket is five base pointers: its block table (one entry per program of at most
  ``BLOCK`` elements inside one parameter) is built once, a program's accesses are aligned
  vectors, the gradient norm is one pass per bucket, and every address is fixed, as a CUDA
  graph needs. The costs: ``p.data`` is replaced once (tensors that aliased the old storage
  see no updates); state tensors are views, which a checkpoint writer copies out (or it would
  write the whole flat buffer for each); and the FP32 gradient buffer lives as long
  as the optimizer (4 bytes per element held through the forward, where the other paths free
  it at ``zero_grad``), as Megatron's ``main_grad``.
* **Gradients and skipping.** The post-accumulate-grad hook copies the first micro-batch's
  gradient after ``zero_grad`` into ``p.main_grad`` and adds the later ones, so
  ``zero_grad(set_to_none=True)`` needs no memset (the buffer keeps stale values, and a
  per-parameter flag says they are stale). The flags live on the device too: a parameter
  without a gradient this step is masked off inside the kernels (its step count stays, as in
  torch), so the common case and the skipping case are the same launches: one per device for
  the step counts and update scalars (the prologue), one per bucket for the update. A layer
  that writes ``p.main_grad`` itself declares the gradient with :meth:`AdamW.mark_grad_ready`.
* **No host round trip.** Step counts, per-group hyper-parameters (FP64: the Python floats
  exactly) and the clip coefficient are device tensors; the prologue computes the bias
  corrections from the step counts on the device, rounding each scalar once to FP32 as the
  per-tensor path rounds its Python floats. :meth:`AdamW.clip_grad_norm_` returns the norm as
  a device tensor and leaves the coefficient on the device for the next update to multiply in
  (a pass over the gradients saved; :meth:`AdamW.grad_for` applies it first, so it still returns
  the gradient ``step`` will use). ``clip_grad_norm_`` + ``step`` therefore capture into one CUDA
  graph; hyper-parameter changes reach a graph through :meth:`AdamW.set_lr`, called between
  replays. The host work per step left is one ``p.grad`` type check per fused parameter (to
  fold a gradient set by hand), a comparison of each group's hyper-parameters, and one
  version-counter bump over the fused parameters (the kernels write them through pointers;
  the bump is what tells cached FP8 weight quantizations that the weights changed).
* **Why ``p.grad`` holds a stand-in.** The FP32 buffers replace ``p.grad``, so code that reads
  ``p.grad`` would see no gradient: ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``
  would clip nothing and return 0. A BF16 ``p.grad`` cannot view an FP32 buffer, and a BF16
  copy costs 2 bytes per parameter; so ``p.grad`` holds a storage-less
  :class:`GradInBuffer` whose every operation raises, naming :meth:`AdamW.clip_grad_norm_` and
  :meth:`AdamW.grad_for`. A tensor hook on each parameter removes it before autograd
  accumulates the next gradient (Megatron keeps ``p.grad`` None beside its ``main_grad`` and
  relies on its own clipping function instead).
* **Reference and tolerances.** On the CPU, ``fused=True`` runs the torch reference of the fused
  update: the per-tensor update on each parameter's views of the flat buffers, driven by the
  same device tables. It is bitwise the per-tensor path. The kernels (on the GPU, or in the
  Triton interpreter) may contract a multiply-add into an FMA and multiply by ``1/√(1-β2^t)``
  where the CPU divides: a few FP32 ulps per step, and now and then a BF16 moment one BF16 ulp
  away (tests/optim/test_adamw_fused.py measures and bounds both).
"""

from __future__ import annotations

import functools
import math
import struct
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from ptxtrain.optim import fused as _fused
from ptxtrain.optim.fused import Bucket, DeviceTable, Slot

__all__ = ["AdamW", "GradInBuffer", "grad_ready", "mark_grad_ready", "optimizer_state_bytes"]

# Parameter dtypes narrower than FP32: these get an FP32 master copy and FP32 gradient buffers.
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Moment storage dtypes accepted (FP16 is refused: exp_avg_sq underflows, see the module note).
_MOMENT_DTYPES = (torch.bfloat16, torch.float32)
# Attribute set on a parameter to the id() of the AdamW whose FP32-gradient hook owns it. Only the
# newest AdamW built over a parameter collects its gradients; older hooks do nothing.
_OWNER_ATTR = "_ptxtrain_fp32_grad_owner"
# State keys this optimizer writes (and that ``optimizer_state_bytes`` reports by name).
_NAMED_STATE = ("master", "exp_avg", "exp_avg_sq")
# Largest number of elements one multi-tensor update handles at once: bounds the FP32 temporaries
# (upcast moments, denominator) to ~12 bytes x 2^25 = 384 MiB instead of 12 bytes per parameter
# of the whole model (the BF16 moments save only 4 bytes per parameter).
_FOREACH_CHUNK_NUMEL = 1 << 25
# Parameter dtypes the fused path takes (FP64 parameters stay on the foreach / per-tensor path).
_FUSABLE = (torch.float32, torch.bfloat16, torch.float16)
# Attribute set on a parameter held in a fused bucket: a weak reference to that AdamW, so a layer
# can reach it through the parameter alone (:func:`mark_grad_ready`, :func:`grad_ready`).
_FUSED_OWNER_ATTR = "_ptxtrain_fused_adamw"
# Elements per program and warps per program of the fused update and norm kernels.
_FUSED_BLOCK = 2048
_FUSED_WARPS = 4


def _is_real_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_hyper(name: str, value: object, *, low: float = 0.0) -> float:
    """Return ``value`` as a float; raise unless it is a finite real number ≥ ``low``."""
    if not _is_real_number(value):
        raise TypeError(f"{name} must be a real number (int or float), got {type(value).__name__}")
    value = float(value)  # type: ignore[arg-type]
    if not math.isfinite(value) or value < low:
        raise ValueError(f"{name} must be a finite number >= {low}, got {value}")
    return value


def _check_betas(value: object) -> tuple[float, float]:
    """Return ``(beta1, beta2)``; raise unless both are real numbers in [0, 1)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {value!r}")
    out = []
    for i, b in enumerate(value):
        if not _is_real_number(b):
            raise TypeError(f"betas[{i}] must be a real number, got {type(b).__name__}")
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
        out.append(float(b))
    return out[0], out[1]


def _check_group(group: Mapping[str, Any]) -> None:
    """Validate the hyper-parameters of one param group (raises naming the key)."""
    _check_hyper("lr", group["lr"])
    _check_betas(group["betas"])
    _check_hyper("eps", group["eps"])
    _check_hyper("weight_decay", group["weight_decay"])


def _round_f32(x: float) -> float:
    """``x`` rounded to the nearest FP32 value (ties to even), as a Python float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _cuda_reciprocal(x: float, dtype: torch.dtype) -> float:
    """``1/x`` as CUDA's ``tensor / x`` computes it for a ``dtype`` tensor and a Python float ``x``.

    That kernel multiplies by the reciprocal: ``x`` is rounded to the op's math type (FP32, or
    FP64 for FP64 tensors), then inverted in that type. FP32 division computed in FP64 and rounded
    once to FP32 is the correctly rounded FP32 quotient (53 ≥ 2·24 + 2 bits), so this is exact.
    """
    if dtype == torch.float64:
        return 1.0 / x
    return _round_f32(1.0 / _round_f32(x))


def _upcast(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]`` in one ``_foreach_copy_`` (the tensors share a dtype)."""
    if tensors[0].dtype == dtype:
        return tensors  # ``.to`` would alias them too
    out = [torch.empty_like(t, dtype=dtype) for t in tensors]
    torch._foreach_copy_(out, tensors)
    return out


def _chunks(items: list[Any], numel: Callable[[Any], int], limit: int) -> list[list[Any]]:
    """Split ``items`` in order into runs of ≤ ``limit`` elements (a larger item runs alone)."""
    out: list[list[Any]] = []
    run: list[Any] = []
    total = 0
    for item in items:
        n = numel(item)
        if run and total + n > limit:
            out.append(run)
            run, total = [], 0
        run.append(item)
        total += n
    if run:
        out.append(run)
    return out


def _by_device_dtype(
    items: list[Any], key: Callable[[Any], torch.Tensor] = lambda t: t
) -> dict[tuple[torch.device, torch.dtype], list[Any]]:
    """``items`` grouped by the (device, dtype) of ``key(item)``, each group in order."""
    out: dict[tuple[torch.device, torch.dtype], list[Any]] = defaultdict(list)
    for item in items:
        t = key(item)
        out[(t.device, t.dtype)].append(item)
    return out


def _hyper_of(group: Mapping[str, Any]) -> tuple[float, float, float, float, float]:
    """``(lr, β1, β2, eps, weight_decay)`` of a param group, as Python floats."""
    beta1, beta2 = (float(b) for b in group["betas"])
    return float(group["lr"]), beta1, beta2, float(group["eps"]), float(group["weight_decay"])


def _adamw_update(
    p: torch.Tensor,
    master: torch.Tensor | None,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: float,
    hyper: tuple[float, ...],
) -> None:
    """The per-tensor AdamW update of ``p`` (in place), its master and moments, at step ``step``
    (already counted); ``hyper`` = (lr, β1, β2, eps, weight_decay). Arithmetic in FP32 (FP64
    for FP64 ``p``), in torch.optim.AdamW's single-tensor operation order."""
    lr, beta1, beta2, eps, weight_decay = hyper
    compute = torch.promote_types(p.dtype, torch.float32)
    weight = master if master is not None else p.detach().to(compute)  # aliases p when FP32
    g = grad.to(compute)  # read only
    m = exp_avg.to(compute)  # a FP32 copy of BF16 moments; the state itself when FP32
    v = exp_avg_sq.to(compute)
    if weight_decay != 0:
        weight.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    weight.addcdiv_(m, denom, value=-(lr / bias_correction1))
    if m is not exp_avg:
        exp_avg.copy_(m)  # round to nearest even
    if v is not exp_avg_sq:
        exp_avg_sq.copy_(v)
    if weight is not p:
        p.copy_(weight)  # master (or FP32 working copy) → BF16/FP16 param, round to nearest


def _triton_kernels() -> Any:
    """:mod:`ptxtrain.optim.triton`, imported on first use (Triton is optional)."""
    from ptxtrain.optim import triton as kernels

    return kernels


@functools.cache
def _triton_ok() -> bool:
    """Whether :mod:`ptxtrain.optim.triton` imports (Triton installed and working)."""
    try:
        _triton_kernels()
    except ImportError:
        return False
    return True


def _nbytes(t: torch.Tensor) -> int:
    """Logical bytes of ``t``: elements x element size (a view is not charged its whole storage)."""
    return t.numel() * t.element_size()


class GradInBuffer(torch.Tensor):
    """What ``p.grad`` holds while :class:`AdamW` keeps ``p``'s gradient in its FP32 buffer.

    A storage-less tensor of ``p``'s shape, dtype and device on which every operation raises a
    RuntimeError that says where the gradient is. It makes code that reads ``p.grad`` for such
    a parameter fail loudly instead of seeing no gradient: ``torch.nn.utils.clip_grad_norm_``
    would otherwise skip every such parameter and clip nothing (return 0). The owning AdamW
    removes it before autograd accumulates a new gradient, and on ``zero_grad``.
    """

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> GradInBuffer:
        return torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"{func}: this parameter's gradient is held in ptxtrain.optim.AdamW's FP32 buffer, "
            "not in p.grad; clip with optimizer.clip_grad_norm_(max_norm) instead of "
            "torch.nn.utils.clip_grad_norm_, read it with optimizer.grad_for(p), or build the "
            "AdamW with fp32_grads=False to keep gradients in p.grad"
        )

    def __repr__(self) -> str:
        return f"GradInBuffer(shape={tuple(self.shape)}, dtype={self.dtype}: see AdamW.grad_for)"

    def __deepcopy__(self, memo) -> None:
        return None  # a copied parameter has no gradient (the buffer is not copied)


def _own_grad(p: torch.Tensor) -> torch.Tensor | None:
    """``p.grad`` unless it is a :class:`GradInBuffer` stand-in (then None)."""
    g = p.grad
    return None if isinstance(g, GradInBuffer) else g


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with BF16 moments and FP32 master weights and gradients.

    The DeepSeek-V3 optimizer recipe (report §3.3; docs/design.md §1 "AdamW"). The update is exactly
    ``torch.optim.AdamW``'s, in FP32 (or FP64 for FP64 params), per element::

        w ← w · (1 − lr·weight_decay)
        m ← β1·m + (1 − β1)·g            v ← β2·v + (1 − β2)·g²
        w ← w − lr/(1 − β1^t) · m / (√v / √(1 − β2^t) + eps)

    Storage:

    * ``state[p]["exp_avg"]``, ``state[p]["exp_avg_sq"]``: shape of ``p``, dtype ``moment_dtype``.
      They are upcast to FP32 for the update and rounded back (to nearest even).
    * ``state[p]["master"]``: FP32 copy of ``p``, only when ``p`` is BF16/FP16 and
      ``master_weights``. ``step`` updates the master and rounds it into ``p``. Without a master,
      a low-precision ``p`` is updated in FP32 and rounded back each step.
    * ``state[p]["step"]``: 0-d FP32 CPU tensor (torch's convention); on the fused path a 0-d
      view of a device tensor (as torch's ``capturable`` optimizers keep it).

    FP32 gradients (``fp32_grads=True``): at construction, every BF16/FP16 parameter that
    requires grad gets a ``register_post_accumulate_grad_hook``. After autograd has accumulated
    ``p.grad``, the hook adds it (upcast) into an FP32 buffer held by the optimizer and puts a
    :class:`GradInBuffer` stand-in (no storage) in ``p.grad``. Summing over micro-batches
    therefore happens in FP32, and only the FP32 buffer stays in memory. Consequences:

    * Build the optimizer **before** the first backward whose gradients it should see.
    * After backward, ``p.grad`` of those parameters is the stand-in, on which every operation
      raises a RuntimeError: ``torch.nn.utils.clip_grad_norm_`` over them raises instead of
      clipping nothing. Read gradients with :meth:`grad_for`, and clip with
      :meth:`clip_grad_norm_`. ``model.zero_grad(set_to_none=False)`` raises too; use
      :meth:`zero_grad`.
    * :meth:`zero_grad` frees the buffers (``set_to_none=True``) or zeroes them.
    * A ``p.grad`` set by hand is folded into the buffer by :meth:`step`, :meth:`grad_for` and
      :meth:`clip_grad_norm_`.
    * Only the newest ``AdamW`` built over a parameter collects its gradients. The hook of an
      older one does nothing, so you can build a fresh optimizer over the same model (e.g. to
      resume) without removing the old one's hooks. :meth:`remove_hooks` removes them by hand.
    * This does not mix with ``DistributedDataParallel``'s gradient buckets, which all-reduce
      ``p.grad``. Under DDP use ``fp32_grads=False``, or all-reduce the buffers from
      :meth:`grad_for` yourself.

    Fused path (``fused``; the module note has the design): at construction every FP32/BF16/FP16
    parameter that requires grad moves into flat buffers, one set per (param group, device,
    dtype); ``p.data`` becomes a view of the flat working-weight buffer and ``p.main_grad`` a
    view of the flat FP32 gradient buffer. :meth:`step` then updates each bucket in one kernel
    launch, and differs from the other paths in these ways:

    * FP32 parameters get the FP32-gradient hook too: after backward their ``p.grad`` is None.
    * ``zero_grad(set_to_none=True)`` only marks gradients absent; the buffers stay allocated
      and the next gradient overwrites instead of adding. A layer that writes ``p.main_grad``
      itself declares it with :meth:`mark_grad_ready` (see there).
    * :meth:`clip_grad_norm_` leaves the gradients as they are and records the coefficient on
      the device; the next :meth:`step` multiplies by it inside the update, and
      :meth:`grad_for` applies it first, so it still returns the gradient step will use.
    * :meth:`step` and :meth:`clip_grad_norm_` read no device value on the host and copy
      nothing from the host: learning rate and other hyper-parameters live in device tensors,
      refreshed from the param groups at each eager :meth:`step` (or by :meth:`set_lr`, the way
      to change the learning rate of a captured CUDA graph), bias corrections are computed on
      the device from the device step counts.
    * Memory from ``p``'s old storage is released; tensors that aliased it (not the Parameter
      object itself) no longer see the updates.

    CUDA graphs: capture ``clip_grad_norm_`` and ``step`` after a few eager steps (Triton
    compiles at the first launch), then per step, eagerly: ``zero_grad()``, backward (the
    hooks fill the buffers and flags), :meth:`set_lr`; then ``graph.replay()``. Host-side
    effects of ``step`` happen at capture only: torch's step hooks, the version bump that
    invalidates cached FP8 weight quantizations (after each replay call
    :func:`ptxtrain.nn.invalidate_fp8_weight_caches`, as ``ptxtrain.train.step`` does, or turn
    ``cache_weight_fp8`` off) and :meth:`grad_for`'s knowledge of a pending clip coefficient
    (after a replay it returns the buffer without the coefficient the replayed step used).

    Parameter groups: ``lr``, ``betas``, ``eps`` and ``weight_decay`` may differ per group and
    may be changed between steps (``group["lr"] = ...``, as a warmup + cosine schedule does).
    They are checked again at every :meth:`step`. ``moment_dtype``, ``master_weights`` and
    ``fp32_grads`` apply to the whole optimizer and are not stored in param groups, so
    ``state_dict()["param_groups"]`` holds only JSON-friendly numbers.

    Args:
        params: iterable of parameters or of param-group dicts. Parameters must be floating-point
            leaf tensors (FP32, FP64, BF16 or FP16).
        lr: learning rate, finite and ≥ 0.
        betas: ``(β1, β2)``, each in [0, 1).
        eps: added to the denominator, finite and ≥ 0.
        weight_decay: decoupled decay coefficient, finite and ≥ 0 (applied as ``w *= 1 − lr·wd``).
        moment_dtype: storage dtype of both moments: ``torch.bfloat16`` (default) or
            ``torch.float32``.
        master_weights: keep an FP32 master copy of each BF16/FP16 parameter.
        fp32_grads: accumulate gradients of BF16/FP16 parameters in FP32 buffers (see above).
        foreach: how :meth:`step` and :meth:`clip_grad_norm_` run. ``None`` (default): the
            multi-tensor path (``torch._foreach_*`` ops over groups of parameters, a fixed
            number of kernel launches per group) for CUDA tensors, the per-tensor path elsewhere.
            ``True`` / ``False`` force one path for every device. Both paths give bitwise-equal
            results on CPU; on CUDA they agree to about one FP32 ulp per step (see the module
            note). The multi-tensor path only saves host launch overhead. On the fused path it
            applies to the parameters left outside the flat buffers (FP64 or frozen ones).
        fused: ``None`` (default): the fused path for CUDA parameters when Triton imports,
            else ``foreach``'s choice. ``True``: the fused path for every device (CUDA through
            the Triton kernels; other devices through their torch reference, the per-tensor
            update run on each parameter's views of the flat buffers, bitwise the per-tensor
            path). ``False``: never.

    Raises:
        TypeError: a hyper-parameter has the wrong type, ``moment_dtype`` is not BF16/FP32,
            ``master_weights``/``fp32_grads`` is not a bool, ``foreach`` / ``fused`` is not None
            or a bool, or a parameter is not floating point.
        ValueError: a hyper-parameter is out of range (the message names it), a parameter is
            not a leaf or appears twice, or ``fused=True`` with ``fp32_grads=False``.
        RuntimeError: ``fused=True`` with CUDA parameters and Triton not importable.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        *,
        moment_dtype: torch.dtype = torch.bfloat16,
        master_weights: bool = True,
        fp32_grads: bool = True,
        foreach: bool | None = None,
        fused: bool | None = None,
    ) -> None:
        if not isinstance(moment_dtype, torch.dtype):
            raise TypeError(
                f"moment_dtype must be a torch.dtype (torch.bfloat16 or torch.float32), "
                f"got {type(moment_dtype).__name__}"
            )
        if moment_dtype not in _MOMENT_DTYPES:
            raise TypeError(
                f"moment_dtype must be torch.bfloat16 or torch.float32, got {moment_dtype}"
                + (
                    " (FP16 moments underflow: squared gradients below 6e-8 become 0)"
                    if moment_dtype == torch.float16
                    else ""
                )
            )
        for name, flag in (("master_weights", master_weights), ("fp32_grads", fp32_grads)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        for name, flag in (("foreach", foreach), ("fused", fused)):
            if flag is not None and not isinstance(flag, bool):
                raise TypeError(f"{name} must be None or a bool, got {type(flag).__name__}")
        if fused and not fp32_grads:
            raise ValueError(
                "fused=True needs fp32_grads=True (the fused update reads the FP32 gradient "
                "buffers), got fp32_grads=False"
            )
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        _check_group(defaults)
        self.moment_dtype = moment_dtype
        self.master_weights = master_weights
        self.fp32_grads = fp32_grads
        self.foreach = foreach
        # Elements per multi-tensor update (bounds the FP32 temporaries; see the module note).
        self._foreach_chunk_numel = _FOREACH_CHUNK_NUMEL
        # FP32 gradient buffers of hooked parameters (Megatron's main_grad); not optimizer state,
        # so never part of state_dict().
        self._main_grads: dict[torch.Tensor, torch.Tensor] = {}
        self._hook_handles: dict[torch.Tensor, Any] = {}
        self._pre_hook_handles: dict[torch.Tensor, Any] = {}
        self._stand_ins: dict[torch.Tensor, GradInBuffer] = {}
        # The fused path: flat buffers per (group, device, dtype), per-device tables, where each
        # fused parameter lives, each group's other parameters, and the order clipping walks.
        self.fused = fused
        self._buckets: list[Bucket] = []
        self._tables: dict[torch.device, DeviceTable] = {}
        self._slots: dict[torch.Tensor, Slot] = {}
        self._unfused: list[list[torch.Tensor]] = []
        self._norm_plan: list[torch.Tensor | Bucket | Slot] = []
        self._scale_pending = False  # a clip coefficient not yet multiplied into the buffers
        self._fused_params: list[torch.Tensor] = []
        self._fused_block, self._fused_warps = _FUSED_BLOCK, _FUSED_WARPS
        # Filled by add_param_group, which torch.optim.Optimizer.__init__ calls once per group.
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ param groups and hooks
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (see ``torch.optim.Optimizer.add_param_group``) and hook its params.

        Raises:
            TypeError / ValueError: as for the constructor, for the group's own hyper-parameters
                or parameters (ValueError for a parameter given twice, in this group or another).
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        params = param_group.get("params")
        if isinstance(params, torch.Tensor):
            params = [params]
        elif not isinstance(params, (set, type(None))):  # torch itself rejects sets (no order)
            params = list(params)  # a generator must be consumed once, here
        param_group["params"] = params
        seen: dict[int, int] = {}
        for i, p in enumerate(params if isinstance(params, list) else []):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
            if not p.is_floating_point():
                raise TypeError(f"params[{i}] must be a floating-point tensor, got {p.dtype}")
            # torch only warns here, and then updates the parameter twice per step.
            if id(p) in seen:
                raise ValueError(
                    f"params[{i}] is the same tensor as params[{seen[id(p)]}]: a parameter may "
                    "appear only once (it would be updated twice per step)"
                )
            seen[id(p)] = i
        _check_group({k: param_group.get(k, v) for k, v in self.defaults.items()})
        super().add_param_group(param_group)
        self._add_buckets(len(self.param_groups) - 1)
        if self.fp32_grads:
            for p in self.param_groups[-1]["params"]:
                if p.requires_grad and (p.dtype in _LOW_PRECISION or p in self._slots):
                    self._register_hook(p)

    @property
    def capturable(self) -> bool:
        """Whether :meth:`clip_grad_norm_`, :meth:`step` and :meth:`zero_grad` can be captured
        in a CUDA graph: every parameter that trains sits in a flat bucket updated by the
        Triton kernels on a CUDA device (the step counts and hyper-parameters then live on the
        device; change the learning rate between replays with :meth:`set_lr`)."""
        trained = [p for p in self._params() if p.requires_grad]
        return bool(trained) and all(
            (slot := self._slots.get(p)) is not None
            and slot.bucket.device.type == "cuda"
            and slot.bucket.table.impl == "triton"
            for p in trained
        )

    def _fusable(self, p: torch.Tensor) -> bool:
        """Whether ``p`` goes into the flat buffers (see ``fused``)."""
        if self.fused is False or not (self.fp32_grads and p.requires_grad and p.dtype in _FUSABLE):
            return False
        if p.device.type == "cuda" and not _triton_ok():
            if self.fused:
                raise RuntimeError(
                    "fused=True needs Triton for CUDA parameters, and ptxtrain.optim.triton "
                    "does not import here; pass fused=None or False"
                )
            return False
        return bool(self.fused) or p.device.type == "cuda"

    def _add_buckets(self, index: int) -> None:
        """Move the fusable parameters of param group ``index`` into flat buckets."""
        group = self.param_groups[index]
        by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for p in group["params"]:
            if self._fusable(p):
                by_kind.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), params in by_kind.items():
            table = self._tables.get(device)
            if table is None:
                table = self._tables[device] = DeviceTable(device, _fused.default_impl(device))
            if dtype == torch.float32:
                mode = _fused.MODE_FP32
            else:
                mode = _fused.MODE_MASTER if self.master_weights else _fused.MODE_NO_MASTER
            bucket = Bucket(index, params, mode, self.moment_dtype, table)
            table.write_hyper(index, _hyper_of(group))
            bucket.block_table(self._fused_block)  # built now: step() must copy nothing
            self._buckets.append(bucket)
            for i, p in enumerate(params):
                self._slots[p] = Slot(bucket, i, bucket.base + i)
                p.main_grad = bucket.views[i]["grad"]
                setattr(p, _FUSED_OWNER_ATTR, weakref.ref(self))
            for i, q in enumerate(table.params):  # table.add reallocated the step counts
                if table.exposed[i]:
                    self.state[q]["step"] = table.steps[i]
        self._unfused.append([p for p in group["params"] if p not in self._slots])
        self._fused_params = list(self._slots)
        self._norm_plan = self._make_norm_plan()

    def _make_norm_plan(self) -> list[torch.Tensor | Bucket | Slot]:
        """What :meth:`clip_grad_norm_` visits, in parameter order: a parameter outside the flat
        buffers, a bucket of the Triton kernels (once, where its first parameter stands), or
        the slot of a parameter of a torch-reference bucket (so its norm is the per-tensor
        path's, in the same order)."""
        plan: list[torch.Tensor | Bucket | Slot] = []
        seen: set[int] = set()
        for p in self._params():
            slot = self._slots.get(p)
            if slot is None:
                plan.append(p)
            elif slot.bucket.table.impl != "triton":
                plan.append(slot)
            elif id(slot.bucket) not in seen:
                seen.add(id(slot.bucket))
                plan.append(slot.bucket)
        return plan

    def _register_hook(self, p: torch.Tensor) -> None:
        opt_ref = weakref.ref(self)  # the hook must not keep the optimizer alive
        token = id(self)

        def hook(param: torch.Tensor) -> None:
            opt = opt_ref()
            if opt is not None and getattr(param, _OWNER_ATTR, None) == token:
                opt._absorb_grad(param)

        def clear_stand_in(grad: torch.Tensor | None) -> torch.Tensor | None:
            # Runs before autograd accumulates into p.grad, which must not meet the stand-in
            # (None: a layer that wrote main_grad itself returned no gradient; nothing comes).
            if grad is not None and isinstance(p_ref().grad, GradInBuffer):
                p_ref().grad = None
            return grad

        p_ref = weakref.ref(p)
        setattr(p, _OWNER_ATTR, token)
        self._stand_ins[p] = GradInBuffer(p)
        self._pre_hook_handles[p] = p.register_hook(clear_stand_in)
        self._hook_handles[p] = p.register_post_accumulate_grad_hook(hook)

    def _owns(self, p: torch.Tensor) -> bool:
        return p in self._hook_handles and getattr(p, _OWNER_ATTR, None) == id(self)

    @torch.no_grad()
    def _absorb_grad(self, p: torch.Tensor) -> None:
        """Add ``p.grad`` (upcast) into the FP32 buffer of ``p`` and leave the
        :class:`GradInBuffer` stand-in in ``p.grad``."""
        g = _own_grad(p)
        if g is None:
            return
        if g.is_sparse:
            raise TypeError("AdamW needs dense gradients, got a sparse gradient")
        slot = self._slots.get(p)
        if slot is not None:
            if self._scale_pending:  # the coefficient applies to what is there, not to g
                self._apply_pending_scale()
            table = slot.bucket.table
            buf = slot.bucket.views[slot.index]["grad"]
            if table.ready[slot.table_index]:
                buf.add_(g)
            else:  # the first gradient since zero_grad: the buffer holds stale values
                buf.copy_(g)
                table.set_ready(slot.table_index)
            p.grad = self._stand_in(p)
            return
        buf = self._main_grads.get(p)
        if buf is None:
            self._main_grads[p] = g.to(torch.float32, copy=True)
        else:
            buf.add_(g)  # FP32 += BF16: the BF16 value converts exactly, the sum rounds in FP32
        p.grad = self._stand_in(p)

    def _stand_in(self, p: torch.Tensor) -> GradInBuffer | None:
        """The :class:`GradInBuffer` ``p.grad`` holds while the gradient is in the buffer (None
        when the hooks are removed: nothing would clear it before the next accumulation)."""
        return self._stand_ins.get(p)

    def _clear_stand_ins(self) -> None:
        for p in self._stand_ins:
            if isinstance(p.grad, GradInBuffer):
                p.grad = None

    def remove_hooks(self) -> None:
        """Remove the FP32-gradient hooks. Later backward passes leave gradients in ``p.grad``.

        Existing FP32 buffers stay until :meth:`zero_grad`; :meth:`step` still uses them.
        """
        for p, handle in self._hook_handles.items():
            handle.remove()
            self._pre_hook_handles[p].remove()
            if getattr(p, _OWNER_ATTR, None) == id(self):
                delattr(p, _OWNER_ATTR)
        self._hook_handles.clear()
        self._pre_hook_handles.clear()
        self._clear_stand_ins()
        self._stand_ins.clear()

    def _use_foreach(self, device: torch.device) -> bool:
        """Whether tensors on ``device`` take the multi-tensor path (see ``foreach``)."""
        foreach = getattr(self, "foreach", None)  # absent on an optimizer unpickled from before
        return device.type == "cuda" if foreach is None else foreach

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def grad_for(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient :meth:`step` will use for ``p``, or ``None`` if it has none.

        This is the FP32 buffer for a hooked BF16/FP16 parameter (shape of ``p``, FP32), otherwise
        ``p.grad``. A ``p.grad`` set by hand on a hooked parameter is first folded into the buffer.
        In-place changes to the returned tensor (e.g. an all-reduce) affect the next step. On the
        fused path it is ``p.main_grad`` (a view of the flat buffer) once ``p`` has a gradient;
        a clip coefficient that :meth:`clip_grad_norm_` left pending is multiplied in first.
        """
        slot = self._slots.get(p)
        if slot is None:
            if self._owns(p) and _own_grad(p) is not None:
                self._absorb_grad(p)
            buf = self._main_grads.get(p)
            return buf if buf is not None else _own_grad(p)
        if _own_grad(p) is not None:
            self._absorb_grad(p)
        if self._scale_pending:
            self._apply_pending_scale()
        ready = slot.bucket.table.ready[slot.table_index]
        return slot.bucket.views[slot.index]["grad"] if ready else None

    def grad_ready(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has a gradient since the last :meth:`zero_grad` (for a fused parameter:
        whether ``p.main_grad`` holds this step's partial sum rather than stale values)."""
        slot = self._slots.get(p)
        if slot is None:
            return self.grad_for(p) is not None
        return _own_grad(p) is not None or slot.bucket.table.ready[slot.table_index]

    def mark_grad_ready(self, p: torch.Tensor) -> None:
        """Declare that ``p.main_grad`` holds ``p``'s gradient for this step.

        For a layer that writes its weight gradient straight into the FP32 buffer (an FP8 wgrad
        GEMM with ``D +=``) instead of returning it to autograd. The buffer is not zeroed by
        ``zero_grad(set_to_none=True)``, so such a layer writes ``D = dW`` when
        :meth:`grad_ready` is False and ``D += dW`` when it is True, then calls this::

            beta = 1.0 if opt.grad_ready(w) else 0.0
            gemm(dy_t, x, out=w.main_grad, beta=beta)  # D = beta·D + dyᵀ·x
            opt.mark_grad_ready(w)

        A parameter marked ready takes part in :meth:`clip_grad_norm_` and :meth:`step`; one
        never marked (and without a hooked gradient) is skipped, its step count unchanged. Write
        the buffer before :meth:`clip_grad_norm_`: a coefficient it leaves pending applies to
        what the buffer holds. :func:`ptxtrain.optim.mark_grad_ready` /
        :func:`ptxtrain.optim.grad_ready` do the same through the parameter alone.

        Raises:
            ValueError: ``p`` is not in this optimizer's flat buffers (no ``p.main_grad``).
        """
        slot = self._slots.get(p)
        if slot is None:
            raise ValueError(
                f"mark_grad_ready: the parameter of shape {tuple(p.shape)} is not in this "
                "AdamW's flat buffers (only fused parameters have p.main_grad)"
            )
        slot.bucket.table.set_ready(slot.table_index)
        if p.grad is None and self._owns(p):
            p.grad = self._stand_in(p)

    def set_lr(self, lr: float, group: int | None = None) -> None:
        """Set the learning rate of param group ``group`` (default: every group).

        Writes ``group["lr"]`` and, for fused parameters, the device copy the kernels read
        (with the group's other hyper-parameters where they changed), without a host-to-device
        copy. Eager :meth:`step` picks up ``group["lr"] = ...`` by itself; a CUDA graph that
        captured :meth:`step` reads only the device copy, so between its replays change the
        learning rate with this method, called outside the graph.

        Raises:
            TypeError / ValueError: ``lr`` is not a finite real number ≥ 0, or ``group`` is not
                an index of :attr:`param_groups`.
        """
        lr = _check_hyper("lr", lr)
        if group is None:
            indices = range(len(self.param_groups))
        elif isinstance(group, int) and not isinstance(group, bool):
            if not 0 <= group < len(self.param_groups):
                raise ValueError(
                    f"group must index one of the {len(self.param_groups)} param groups, "
                    f"got {group}"
                )
            indices = range(group, group + 1)
        else:
            raise TypeError(f"group must be None or an int, got {type(group).__name__}")
        for i in indices:
            self.param_groups[i]["lr"] = lr
            for table in self._tables.values():
                table.write_hyper(i, _hyper_of(self.param_groups[i]))

    def _grad_buffers(self) -> dict[torch.Tensor, torch.Tensor]:
        """Every FP32 gradient buffer this optimizer holds, by parameter (fused: all of them,
        allocated whether or not the parameter has a gradient now)."""
        out = dict(self._main_grads)
        for p, slot in self._slots.items():
            out[p] = slot.bucket.views[slot.index]["grad"]
        return out

    def _fold_fused_grads(self) -> None:
        """Fold a ``p.grad`` set by hand on a fused parameter into its buffer (after backward
        the hooks have already moved every gradient: this is one attribute read each)."""
        for p in [p for p in self._slots if _own_grad(p) is not None]:
            self._absorb_grad(p)

    @torch.no_grad()
    def _apply_pending_scale(self) -> None:
        """Multiply the flat gradient buffers by the clip coefficient and reset it to 1."""
        for bucket in self._buckets:
            bucket.grad.mul_(bucket.table.scale)
        for table in self._tables.values():
            table.scale.fill_(1.0)
        self._scale_pending = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset gradients: ``p.grad`` as torch does, and the FP32 buffers.

        ``set_to_none=True`` frees the buffers; ``False`` zeroes them in place. Fused buffers
        are never freed: ``set_to_none=True`` marks their gradients absent (one launch per
        device, no memset), ``False`` zeroes them. Either drops a pending clip coefficient.
        """
        self._clear_stand_ins()
        super().zero_grad(set_to_none=set_to_none)
        if set_to_none:
            self._main_grads.clear()
        else:
            for buf in self._main_grads.values():
                buf.zero_()
        for table in self._tables.values():
            if set_to_none:
                table.clear_ready()  # the buffers stay; the next gradient overwrites
            table.scale.fill_(1.0)
        if not set_to_none:
            for bucket in self._buckets:
                bucket.grad.zero_()
        self._scale_pending = False

    # ------------------------------------------------------------------ clipping
    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip the gradients :meth:`step` will use, like ``torch.nn.utils.clip_grad_norm_``.

        The norm runs over all parameters of all groups, using the FP32 buffers where
        ``fp32_grads`` keeps them and ``p.grad`` elsewhere. Each tensor's norm is computed in FP32
        (or wider). Gradients are scaled in place by ``min(1, max_norm / (total + 1e-6))``.
        On the multi-tensor path (``foreach``) the per-tensor norms come from one
        ``torch._foreach_norm`` and the scaling from one ``torch._foreach_mul_`` per (device,
        dtype) of the gradients. The result is bitwise the per-tensor one on CPU, and for
        ``norm_type=inf`` on CUDA; CUDA's multi-tensor 2-norm sums in another order (within a few
        FP32 ulps).

        Fused parameters: the Triton kernel sums squares (or takes the largest magnitude) over
        each bucket's flat gradient buffer, one launch per bucket, for 2- and inf-norms (other
        orders take each parameter's view); the CPU reference takes the per-tensor norms. The
        gradients are not scaled here: the coefficient stays on the device, the next
        :meth:`step` multiplies it in, and :meth:`grad_for` (or another gradient arriving)
        applies it to the buffers first. No host read unless ``error_if_nonfinite``, so it can
        be captured in a CUDA graph with :meth:`step`. Call it after every gradient of the step
        is in (as with torch).

        Returns:
            The total norm before clipping: a 0-d FP32 tensor on the first gradient's device
            (``tensor(0.)`` on CPU if no parameter has a gradient).

        Raises:
            TypeError: ``max_norm`` or ``norm_type`` is not a real number.
            ValueError: ``max_norm`` is negative or not finite, or ``norm_type`` is not > 0.
            RuntimeError: ``error_if_nonfinite`` and the total norm is NaN or infinite (as torch).
        """
        max_norm = _check_hyper("max_norm", max_norm)
        if not _is_real_number(norm_type):
            raise TypeError(f"norm_type must be a real number, got {type(norm_type).__name__}")
        if not float(norm_type) > 0:
            raise ValueError(f"norm_type must be > 0 (or inf), got {norm_type}")
        if self._slots:
            self._fold_fused_grads()
            if self._scale_pending:
                self._apply_pending_scale()
        items, plain = self._norm_items(float(norm_type))
        if not items:
            return torch.tensor(0.0)
        device = items[0].device
        norms = self._item_norms(items, plain, norm_type, device)
        # Stacked in parameter order whatever the path, so the total sums in the same order.
        total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
        if error_if_nonfinite and not bool(torch.isfinite(total)):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite ({total}); "
                "pass error_if_nonfinite=False to clip anyway"
            )
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        grads = [items[i] for i in plain]
        foreach = [g for g in grads if self._use_foreach(g.device)]
        for (dev, dtype), group in _by_device_dtype(foreach).items():
            torch._foreach_mul_(group, coef.to(device=dev, dtype=dtype))
        for g in grads:
            if not self._use_foreach(g.device):
                g.mul_(coef.to(device=g.device, dtype=g.dtype))
        if self._tables:  # fused: multiplied in by the next step (or grad_for)
            for table in self._tables.values():
                table.scale.copy_(coef)
            self._scale_pending = True
        return total

    def _norm_items(self, norm_type: float) -> tuple[list[Any], list[int]]:
        """What the norm runs over, in parameter order: gradient tensors (those outside the
        flat buffers are listed in ``plain`` by index: they are scaled in place) and Triton
        buckets (2- and inf-norms only; other orders take each parameter's view)."""
        items: list[Any] = []
        plain: list[int] = []
        for item in self._norm_plan:
            if isinstance(item, torch.Tensor):
                g = self.grad_for(item)
                if g is not None:
                    plain.append(len(items))
                    items.append(g)
                continue
            if isinstance(item, Bucket) and norm_type in (2.0, math.inf):
                items.append(item)
                continue
            slots = [self._slots[p] for p in item.params] if isinstance(item, Bucket) else [item]
            for slot in slots:
                if slot.bucket.table.ready[slot.table_index]:
                    items.append(slot.bucket.views[slot.index]["grad"])
        return items, plain

    def _item_norms(
        self, items: list[Any], plain: list[int], norm_type: float, device: torch.device
    ) -> list[torch.Tensor]:
        """One 0-d FP32 norm on ``device`` per item of :meth:`_norm_items`."""
        fp32 = torch.float32
        norms: list[torch.Tensor | None] = [None] * len(items)
        foreach = [i for i in plain if self._use_foreach(items[i].device)]
        for (_, dtype), idx in _by_device_dtype(foreach, key=lambda i: items[i]).items():
            bucket_norms = torch._foreach_norm(
                [items[i] for i in idx], norm_type, dtype=torch.promote_types(dtype, fp32)
            )
            stacked = torch.stack(bucket_norms).float().to(device)  # [len(idx)]
            for i, norm in zip(idx, stacked.unbind(0)):
                norms[i] = norm
        for i, item in enumerate(items):
            if norms[i] is not None:
                continue
            if isinstance(item, Bucket):
                norm = _triton_kernels().grad_norm(
                    item, item.table, norm_type, self._fused_block, self._fused_warps
                )
            else:
                norm = torch.linalg.vector_norm(
                    item, norm_type, dtype=torch.promote_types(item.dtype, fp32)
                )
            norms[i] = norm.float().to(device)
        return norms  # type: ignore[return-value]

    # ------------------------------------------------------------------ the update
    def _init_state(self, p: torch.Tensor, state: dict[str, Any]) -> None:
        """Create any missing state entry of ``p`` (first step, or a partial checkpoint)."""
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                state[key] = torch.zeros_like(
                    p, dtype=self.moment_dtype, memory_format=torch.preserve_format
                )
        if self._needs_master(p) and "master" not in state:
            state["master"] = p.detach().to(torch.float32, copy=True)

    def _needs_master(self, p: torch.Tensor) -> bool:
        return self.master_weights and p.dtype in _LOW_PRECISION

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Do one AdamW update of every parameter that has a gradient; return ``closure()``'s loss.

        Parameters without a gradient (no FP32 buffer and ``p.grad is None``) are skipped, and
        their ``step`` count does not advance, as in torch. On the multi-tensor path (``foreach``)
        each param group's parameters are bucketed by (device, param dtype, grad dtype, moment
        dtypes, master or not) and each bucket is updated by ~15 ``torch._foreach_*``
        calls (bitwise the per-tensor update on CPU, within about an FP32 ulp on CUDA).

        On the fused path: one launch per device advances the step counts of the parameters
        with a gradient and computes their update scalars, then one launch per flat bucket
        updates them (weights, masters, moments), multiplying gradients by the clip coefficient
        of :meth:`clip_grad_norm_`. No host read, no host-to-device copy: capturable in a CUDA
        graph (hyper-parameters are refreshed from the param groups before the launches, which
        in a graph happens at capture only; see :meth:`set_lr`).

        Raises:
            ValueError / TypeError: a group's ``lr``, ``betas``, ``eps`` or ``weight_decay`` was set
                to an invalid value (the message names it).
            TypeError: a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):
            _check_group(group)
            lr, beta1, beta2, eps, weight_decay = _hyper_of(group)
            buckets: dict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor, dict]]] = {}
            for p in self._unfused[index]:
                grad = self.grad_for(p)
                if grad is None:
                    continue
                if grad.is_sparse:
                    raise TypeError("AdamW needs dense gradients, got a sparse gradient")
                state = self.state[p]
                self._init_state(p, state)
                if not self._use_foreach(p.device):
                    self._update_one(p, grad, state, lr, beta1, beta2, eps, weight_decay)
                    continue
                has_master = self._needs_master(p) and "master" in state
                key = (
                    p.device,
                    p.dtype,
                    grad.dtype,
                    state["exp_avg"].dtype,
                    state["exp_avg_sq"].dtype,
                    has_master,
                )
                buckets.setdefault(key, []).append((p, grad, state))
            for (_, _, _, _, _, has_master), bucket in buckets.items():
                for chunk in _chunks(bucket, lambda e: e[0].numel(), self._foreach_chunk_numel):
                    hyper = (lr, beta1, beta2, eps, weight_decay)
                    self._update_foreach(chunk, has_master, hyper)
        if self._buckets:
            self._step_fused()
        return loss

    def _step_fused(self) -> None:
        self._fold_fused_grads()
        for index, group in enumerate(self.param_groups):
            for table in self._tables.values():
                table.write_hyper(index, _hyper_of(group))
        for table in self._tables.values():
            if table.impl == "triton":
                _triton_kernels().prologue(table)
            else:
                table.steps.add_(table.flags)
        for bucket in self._buckets:
            if bucket.table.impl == "triton":
                kernels = _triton_kernels()
                kernels.update(bucket, bucket.table, self._fused_block, self._fused_warps)
            else:
                self._update_reference(bucket)
        for table in self._tables.values():
            if table.n_exposed < len(table.params):
                self._expose_state(table)
        # The kernels write the weights through pointers, unseen by the version counters that
        # key the cached FP8 weight quantizations (ptxtrain.nn.weight_cache_key): bump them.
        torch.autograd.graph.increment_version(self._fused_params)

    def _update_reference(self, bucket: Bucket) -> None:
        """The torch reference of the fused update: the per-tensor update on each flagged
        parameter's views, with the device tables' step counts, hyper-parameters and clip
        coefficient (FP64 hyper-parameters: the very Python floats of the param group)."""
        table = bucket.table
        hyper = tuple(table.hyper[bucket.group].tolist())
        for i, p in enumerate(bucket.params):
            if not table.ready[bucket.base + i]:
                continue
            views = bucket.views[i]
            step = float(table.steps[bucket.base + i])
            master = views.get("master")
            if master is not None and step == 1:
                master.copy_(p.detach())  # as the per-tensor path creates it at the first step
            grad = views["grad"] * table.scale
            _adamw_update(p, master, grad, views["exp_avg"], views["exp_avg_sq"], step, hyper)

    def _expose_state(self, table: DeviceTable) -> None:
        """Give every parameter of ``table`` that has been updated its ``state`` entry (views),
        as torch creates state at a parameter's first step."""
        for i, p in enumerate(table.params):
            if table.ready[i] and not table.exposed[i]:
                slot = self._slots[p]
                self.state[p] = slot.bucket.state_entry(slot.index)
                table.expose(i)

    def _update_foreach(
        self,
        entries: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]],
        has_master: bool,
        hyper: tuple[float, float, float, float, float],
    ) -> None:
        """:meth:`_update_one` for many ``(param, grad, state)`` at once, in the same op order;
        ``hyper`` = (lr, β1, β2, eps, weight_decay).

        All entries share device, param dtype, grad dtype, moment dtypes and ``has_master``.
        Every list below holds one tensor per entry; each ``_foreach_*`` call is one (or a few)
        kernel launches on CUDA and a loop of the per-tensor op on CPU.
        """
        lr, beta1, beta2, eps, weight_decay = hyper
        params = [p for p, _, _ in entries]
        states = [s for _, _, s in entries]
        device, dtype = params[0].device, params[0].dtype
        compute = torch.promote_types(dtype, torch.float32)  # FP32, or FP64 for FP64 params
        # Working FP32 (FP64) tensors: the state/param itself where it has the compute dtype
        # (updated in place), else a fresh upcast copy written back at the end.
        weights_are_params = not has_master and dtype == compute
        if has_master:
            weights = [s["master"] for s in states]
        else:
            weights = _upcast([p.detach() for p in params], compute)  # aliases p when FP32/FP64
        grads = _upcast([g for _, g, _ in entries], compute)  # read only
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        ms = _upcast(exp_avgs, compute)
        vs = _upcast(exp_avg_sqs, compute)

        # The 0-d FP32 CPU step counters: one add over all, one stack to read them.
        step_tensors = [s["step"] for s in states]
        torch._foreach_add_(step_tensors, 1)
        steps = torch.stack(step_tensors).tolist()
        bc1: dict[float, float] = {}  # per distinct step: 1 - β1^t and √(1 - β2^t)
        bc2_sqrt: dict[float, float] = {}
        for t in set(steps):
            bc1[t] = 1 - beta1**t
            bc2_sqrt[t] = (1 - beta2**t) ** 0.5

        if weight_decay != 0:
            torch._foreach_mul_(weights, 1 - lr * weight_decay)
        torch._foreach_lerp_(ms, grads, 1 - beta1)
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        denoms = torch._foreach_sqrt(vs)
        if device.type == "cuda":
            # CUDA's per-tensor ``t / x`` multiplies by the reciprocal, its foreach div divides.
            torch._foreach_mul_(denoms, [_cuda_reciprocal(bc2_sqrt[t], compute) for t in steps])
        else:
            torch._foreach_div_(denoms, [bc2_sqrt[t] for t in steps])
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(weights, ms, denoms, [-(lr / bc1[t]) for t in steps])

        if ms is not exp_avgs:
            torch._foreach_copy_(exp_avgs, ms)  # round to nearest even
        if vs is not exp_avg_sqs:
            torch._foreach_copy_(exp_avg_sqs, vs)
        if not weights_are_params:
            torch._foreach_copy_([p.detach() for p in params], weights)

    def _update_one(
        self,
        p: torch.Tensor,
        grad: torch.Tensor,
        state: dict[str, Any],
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
    ) -> None:
        state["step"] += 1
        step = float(state["step"].item())
        master = state.get("master") if self._needs_master(p) else None
        hyper = (lr, beta1, beta2, eps, weight_decay)
        _adamw_update(p, master, grad, state["exp_avg"], state["exp_avg_sq"], step, hyper)

    # ------------------------------------------------------------------ checkpointing
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` and keep every tensor's precision exactly.

        ``torch.optim.Optimizer.load_state_dict`` casts state tensors to the parameter's dtype.
        That would round the FP32 master of a BF16 parameter to BF16, and widen BF16 moments of an
        FP32 parameter to FP32. This override instead loads ``master`` as FP32, ``exp_avg`` and
        ``exp_avg_sq`` as ``moment_dtype``, and ``step`` as a 0-d FP32 CPU tensor. Other tensors go
        to the parameter's device with their own dtype. A state saved in the same configuration
        therefore round-trips bitwise. Tensors are always copied, so the loaded optimizer never
        shares storage with ``state_dict``. The tensors may come from safetensors files
        (plain tensors, same keys); state keys may be ints or int strings (as after JSON). A
        ``master`` is dropped where this optimizer keeps none, and a missing one is rebuilt from
        the parameter at the next step.

        Load model weights and optimizer state from the same checkpoint: the master overwrites
        the parameter at the next step. Load-state-dict pre/post hooks run as in torch.

        Raises:
            TypeError: ``state_dict`` is not a mapping with ``"state"`` and ``"param_groups"``, or
                a state tensor has a non-floating dtype where a float is needed.
            ValueError: the group structure differs from this optimizer's (as torch), a state
                tensor's shape differs from its parameter's, or a group hyper-parameter is invalid.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict must be a mapping, got {type(state_dict).__name__}")
        for key in ("state", "param_groups"):
            if key not in state_dict:
                raise TypeError(
                    f"state_dict needs keys 'state' and 'param_groups', missing {key!r}"
                )
        state_dict = dict(state_dict)  # shallow copy, as torch
        for pre_hook in getattr(self, "_optimizer_load_state_dict_pre_hooks", {}).values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result

        groups = self.param_groups
        saved_groups = [dict(g) for g in state_dict["param_groups"]]
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"state_dict has {len(saved_groups)} param groups, this optimizer has {len(groups)}"
            )
        for i, (g, sg) in enumerate(zip(groups, saved_groups)):
            if len(g["params"]) != len(sg["params"]):
                raise ValueError(
                    f"param group {i} of state_dict has {len(sg['params'])} params, this "
                    f"optimizer's has {len(g['params'])}"
                )
            # A group saved without a key keeps this optimizer's value. (torch's __setstate__
            # adds "differentiable" to the defaults only, so not every default is in a group.)
            for k in self.defaults:
                if k in g:
                    sg.setdefault(k, g[k])
            _check_group(sg)
        id_map: dict[int, torch.Tensor] = {}
        for g, sg in zip(groups, saved_groups):
            for saved_id, p in zip(sg["params"], g["params"]):
                id_map[int(saved_id)] = p

        state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for key, entry in state_dict["state"].items():
            try:
                param = id_map.get(int(key))
            except (TypeError, ValueError):
                param = None
            if param is None:
                continue  # state of a parameter this optimizer does not hold
            state[param] = self._restore_entry(param, int(key), entry)

        new_groups = []
        for g, sg in zip(groups, saved_groups):
            sg["params"] = g["params"]
            if "param_names" in g and "param_names" not in sg:
                sg["param_names"] = g["param_names"]
            new_groups.append(sg)
        if self._slots:
            self._load_fused(state)
        self.__setstate__({"state": state, "param_groups": new_groups})
        for post_hook in getattr(self, "_optimizer_load_state_dict_post_hooks", {}).values():
            post_hook(self)

    @torch.no_grad()
    def _load_fused(self, state: dict[torch.Tensor, dict[str, Any]]) -> None:
        """Copy the restored entries of fused parameters into the flat buffers and replace them
        in ``state`` by the usual views; reset the others (no state: as never updated)."""
        for table in self._tables.values():
            table.clear_exposed()
        for p, slot in self._slots.items():
            bucket, table = slot.bucket, slot.bucket.table
            views = bucket.views[slot.index]
            entry = state.pop(p, None)
            step = table.steps[slot.table_index]
            if entry is None:
                for t in (step, views["exp_avg"], views["exp_avg_sq"]):
                    t.zero_()
                continue
            if "step" in entry:
                step.copy_(entry["step"])
            else:
                step.zero_()
            for key in ("exp_avg", "exp_avg_sq"):
                if key in entry:
                    views[key].copy_(entry[key])
                else:
                    views[key].zero_()
            if "master" in views:  # a missing master restarts from the working weight
                views["master"].copy_(entry["master"] if "master" in entry else p.detach())
            others = {k: v for k, v in entry.items() if k not in (*_NAMED_STATE, "step")}
            state[p] = {**bucket.state_entry(slot.index), **others}
            table.expose(slot.table_index)

    def _restore_entry(
        self, p: torch.Tensor, saved_id: int, entry: Mapping[str, Any]
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in entry.items():
            where = f"state_dict['state'][{saved_id}][{key!r}]"
            if key == "step":
                out[key] = torch.as_tensor(value).to(device="cpu", dtype=torch.float32, copy=True)
                if out[key].numel() != 1:
                    raise ValueError(f"{where} must be a scalar, got shape {tuple(out[key].shape)}")
                out[key] = out[key].reshape(())
                continue
            if key == "master" and not self._needs_master(p):
                continue
            if not isinstance(value, torch.Tensor):
                out[key] = value
                continue
            if value.shape != p.shape:
                raise ValueError(
                    f"{where} must have the parameter's shape {tuple(p.shape)}, "
                    f"got {tuple(value.shape)}"
                )
            if key in _NAMED_STATE and not value.is_floating_point():
                raise TypeError(f"{where} must be a floating-point tensor, got {value.dtype}")
            if key == "master":
                dtype = torch.float32
            elif key in ("exp_avg", "exp_avg_sq"):
                dtype = self.moment_dtype
            else:
                dtype = value.dtype
            out[key] = value.to(device=p.device, dtype=dtype, copy=True)
        return out

    # ------------------------------------------------------------------ accounting
    def state_bytes(self) -> dict[str, int | float]:
        """Bytes held for this optimizer's parameters by category; see ``optimizer_state_bytes``."""
        return optimizer_state_bytes(self)


def _fused_owner(p: torch.Tensor, caller: str) -> AdamW:
    ref = getattr(p, _FUSED_OWNER_ATTR, None)
    opt = ref() if ref is not None else None
    if opt is None or p not in opt._slots:
        raise ValueError(
            f"{caller}: the parameter of shape {tuple(p.shape)} is in no live AdamW's flat "
            "buffers (only fused parameters have p.main_grad)"
        )
    return opt


def mark_grad_ready(p: torch.Tensor) -> None:
    """:meth:`AdamW.mark_grad_ready` of the fused AdamW that holds ``p`` (for a layer that has
    the parameter but not the optimizer).

    Raises:
        ValueError: ``p`` is not held by a fused AdamW.
    """
    _fused_owner(p, "mark_grad_ready").mark_grad_ready(p)


def grad_ready(p: torch.Tensor) -> bool:
    """:meth:`AdamW.grad_ready` of the fused AdamW that holds ``p``: whether ``p.main_grad``
    holds this step's partial gradient (accumulate into it) or stale values (overwrite it).

    Raises:
        ValueError: ``p`` is not held by a fused AdamW.
    """
    return _fused_owner(p, "grad_ready").grad_ready(p)


def optimizer_state_bytes(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor] | None = None
) -> dict[str, int | float]:
    """Measure the memory an optimizer's parameters, gradients and state occupy now, in bytes.

    Works for any ``torch.optim.Optimizer``, so the saving of :class:`AdamW` over, say,
    ``torch.optim.AdamW`` is one call each. Only tensors that exist at call time are counted
    (logical size: elements x element size). Call it after backward and step and before
    ``zero_grad`` to see the full training-time footprint. Before the first step there is no
    state, and after ``zero_grad()`` there are no gradients.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        params: restrict the count to these parameters (each must be in ``optimizer``). Default:
            every parameter of every group, each counted once.

    Returns:
        A dict with int byte counts ``param`` (the parameters themselves), ``grad`` (``p.grad``,
        plus :class:`AdamW`'s FP32 gradient buffers), ``master``, ``exp_avg``, ``exp_avg_sq``
        (state tensors under those keys), ``other`` (every other state tensor: ``step`` counters,
        amsgrad's ``max_exp_avg_sq``, SGD's ``momentum_buffer``, ...), ``total`` (sum of the
        above), ``numel`` (parameter elements), and the float ``per_param`` = ``total / numel``
        (0.0 when there are no elements). Example: torch AdamW over an FP32 model after a step
        gives 4 + 4 + 0 + 4 + 4 = 16 bytes/param plus 4 bytes of ``step`` per tensor. This
        AdamW over a BF16 model gives 2 + 4 + 4 + 2 + 2 = 14 plus the same ``step`` bytes.

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or ``params`` holds a
            non-tensor.
        ValueError: a tensor in ``params`` is not a parameter of ``optimizer``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    held: dict[int, torch.Tensor] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            held.setdefault(id(p), p)
    if params is None:
        chosen = list(held.values())
    else:
        chosen, seen = [], set()
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"params[{i}] must be a torch.Tensor, got {type(p).__name__}")
            if id(p) not in held:
                raise ValueError(
                    f"params[{i}] (shape {tuple(p.shape)}) is not a parameter of the optimizer"
                )
            if id(p) not in seen:
                seen.add(id(p))
                chosen.append(p)

    main_grads = optimizer._grad_buffers() if isinstance(optimizer, AdamW) else {}
    out: dict[str, int | float] = dict.fromkeys(
        ("param", "grad", "master", "exp_avg", "exp_avg_sq", "other"), 0
    )
    numel = 0
    for p in chosen:
        numel += p.numel()
        out["param"] += _nbytes(p)
        for g in (_own_grad(p), main_grads.get(p)):
            if g is not None:
                out["grad"] += _nbytes(g)
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[key if key in _NAMED_STATE else "other"] += _nbytes(value)
    out["total"] = sum(out.values())
    out["numel"] = numel
    out["per_param"] = out["total"] / numel if numel else 0.0
    return out
