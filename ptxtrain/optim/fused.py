"""Flat buffers of :class:`~ptxtrain.optim.AdamW`'s fused path (its design note says why).

A :class:`Bucket` holds the parameters of one (param group, device, dtype): one flat buffer
each for the working weights (the parameters' own storage from then on), the FP32 masters,
both moments and the FP32 gradients, with parameter ``i`` at ``offsets[i]`` in every one of
them. A :class:`DeviceTable` holds, per device, what the kernels look up per parameter: step
count, gradient flag, group, the eight update scalars, plus each group's hyper-parameters and
the clip coefficient. Both are plain containers; :class:`~ptxtrain.optim.AdamW` drives them
and :mod:`ptxtrain.optim.triton` runs the kernels over them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ALIGN", "SCALARS", "Bucket", "DeviceTable", "Slot", "default_impl"]

# Every parameter's slice of a flat buffer starts at a multiple of ALIGN elements: 512 bytes of
# BF16 (what torch's caching allocator gives a fresh tensor, so GEMMs and TMA descriptors see
# the alignment they would otherwise), and 16-byte vectors for every kernel access.
ALIGN = 256
# The per-parameter row of DeviceTable.scalars the prologue writes and the update reads.
SCALARS = (
    "decay",  # 1 - lr·weight_decay
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "inv_bc2_sqrt",  # FP32 reciprocal of fp32(√(1 - β2^t))
    "eps",
    "step_size",  # -lr / (1 - β1^t)
    "step",  # t, after this step's increment
)
# Hyper-parameters of a group, the columns of DeviceTable.hyper (FP64: exactly the Python floats).
HYPER = ("lr", "beta1", "beta2", "eps", "weight_decay")
# Update modes (the kernels' MODE): the FP32 weight is the parameter itself, an FP32 master
# of a BF16/FP16 parameter, or a BF16/FP16 parameter updated in FP32 without a master.
MODE_FP32, MODE_MASTER, MODE_NO_MASTER = 0, 1, 2


def default_impl(device: torch.device) -> str:
    """How a fused bucket on ``device`` is updated: ``"triton"`` (the kernels) on CUDA, else
    ``"torch"`` (the reference: the per-tensor update on each parameter's views)."""
    return "triton" if device.type == "cuda" else "torch"


def _dense_strides(p: torch.Tensor) -> tuple[int, ...]:
    """``p``'s strides when they tile ``p.numel()`` slots without gaps (any dim order), so the
    flat slice keeps its layout and gradients copy in without a transpose; else contiguous."""
    if p.numel() > 0:
        expected = 1
        dims = sorted((d for d in range(p.dim()) if p.shape[d] != 1), key=p.stride)
        for d in dims:
            if p.stride(d) != expected:
                break
            expected *= p.shape[d]
        else:  # the non-unit dims tile [0, numel) in some order
            return tuple(p.stride())
    strides, step = [], 1
    for size in reversed(p.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives: its bucket, its index there, its index in the device table."""

    bucket: Bucket
    index: int
    table_index: int


class DeviceTable:
    """Per-parameter and per-group device tensors of one device (see the module docstring).

    Tensors (``n`` parameters, ``G`` groups):

    * ``steps`` FP32 ``[n]``: completed updates per parameter (torch's ``state["step"]``).
    * ``flags`` int32 ``[n]``: 1 where the parameter has a gradient since ``zero_grad``.
    * ``group_of`` int32 ``[n]``: row of ``hyper`` of each parameter.
    * ``scalars`` FP32 ``[n, 8]``: the update scalars (:data:`SCALARS`).
    * ``hyper`` FP64 ``[G, 5]``: each group's :data:`HYPER`.
    * ``scale`` FP32 ``[]``: the clip coefficient the next update multiplies gradients by.

    ``ready`` mirrors ``flags`` on the host; ``exposed[i]``: parameter ``i`` has an entry in the
    optimizer's ``state``. :meth:`add` reallocates the per-parameter tensors: views of the old
    ``steps`` must be taken again.
    """

    def __init__(self, device: torch.device, impl: str) -> None:
        self.device, self.impl = device, impl
        self.params: list[torch.Tensor] = []
        self.steps = torch.zeros(0, dtype=torch.float32, device=device)
        self.flags = torch.zeros(0, dtype=torch.int32, device=device)
        self.group_of = torch.zeros(0, dtype=torch.int32, device=device)
        self.scalars = torch.zeros(0, len(SCALARS), dtype=torch.float32, device=device)
        self.hyper = torch.zeros(0, len(HYPER), dtype=torch.float64, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.ready: list[bool] = []
        self.exposed: list[bool] = []
        self.n_ready = 0
        self.n_exposed = 0
        self._hyper_written: list[tuple[float, ...] | None] = []
        self._flag_views: list[torch.Tensor] = []

    def add(self, params: list[torch.Tensor], group: int) -> int:
        """Append ``params`` of param group ``group``; return the index of the first."""
        start, k = len(self.params), len(params)
        self.params.extend(params)

        def grow(t: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
            new = torch.full((k, *t.shape[1:]), fill, dtype=t.dtype, device=self.device)
            return torch.cat([t, new])

        self.steps, self.flags = grow(self.steps), grow(self.flags)
        self.group_of, self.scalars = grow(self.group_of, group), grow(self.scalars)
        self.ready += [False] * k
        self.exposed += [False] * k
        self._flag_views = list(self.flags.unbind(0))
        while len(self._hyper_written) <= group:
            self._hyper_written.append(None)
        missing = len(self._hyper_written) - self.hyper.shape[0]
        if missing > 0:
            self.hyper = torch.cat([self.hyper, self.hyper.new_zeros(missing, len(HYPER))])
        return start

    def write_hyper(self, group: int, values: tuple[float, ...]) -> None:
        """Make row ``group`` of ``hyper`` hold ``values`` (writes only what changed, each with a
        ``fill_``: a kernel argument, no host-to-device copy)."""
        if group >= len(self._hyper_written):
            return  # no parameter of that group on this device
        old = self._hyper_written[group]
        if old == values:
            return
        for k, value in enumerate(values):
            if old is None or old[k] != value:
                self.hyper[group, k].fill_(value)
        self._hyper_written[group] = values

    def set_ready(self, i: int) -> None:
        """Flag parameter ``i`` as having a gradient this step (host and device)."""
        if not self.ready[i]:
            self.ready[i] = True
            self.n_ready += 1
            self._flag_views[i].fill_(1)

    def expose(self, i: int) -> None:
        """Record that parameter ``i`` has its entry in the optimizer's ``state``."""
        if not self.exposed[i]:
            self.exposed[i] = True
            self.n_exposed += 1

    def clear_exposed(self) -> None:
        """No parameter has a ``state`` entry (before ``load_state_dict`` rebuilds them)."""
        self.exposed = [False] * len(self.params)
        self.n_exposed = 0

    def clear_ready(self) -> None:
        """No parameter has a gradient any more (``zero_grad(set_to_none=True)``)."""
        if self.n_ready:
            self.flags.zero_()
            self.ready = [False] * len(self.params)
            self.n_ready = 0


class Bucket:
    """Flat buffers of the parameters of one (param group, device, dtype).

    Built from ``params`` (all of one device and dtype; at least one): copies each into its
    slice of ``param`` and makes that slice its storage (``p.data = slice``). Flat tensors,
    each of ``numel`` elements (the parameters' sizes each rounded up to :data:`ALIGN`):

    * ``param``: the working weights (the parameters' dtype);
    * ``master``: FP32 masters (mode :data:`MODE_MASTER`), else None;
    * ``grad``: FP32 gradients (``p.main_grad`` is each parameter's slice);
    * ``exp_avg`` / ``exp_avg_sq``: ``moment_dtype``.

    ``views[i]`` maps those names to parameter ``i``'s slices (shape and strides of the
    parameter). Padding between slices is never read as data by the update or the norm.
    """

    def __init__(
        self,
        group: int,
        params: list[torch.Tensor],
        mode: int,
        moment_dtype: torch.dtype,
        table: DeviceTable,
    ) -> None:
        self.group, self.mode, self.params = group, mode, list(params)
        self.device, self.dtype = params[0].device, params[0].dtype
        self.numels = [p.numel() for p in params]
        self.offsets, total = [], 0
        for n in self.numels:
            self.offsets.append(total)
            total += _round_up(n, ALIGN)
        self.numel = total

        def flat(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(total, dtype=dtype, device=self.device)

        self.param = flat(self.dtype)
        self.master = flat(torch.float32) if mode == MODE_MASTER else None
        self.grad = flat(torch.float32)
        self.exp_avg, self.exp_avg_sq = flat(moment_dtype), flat(moment_dtype)
        self.views: list[dict[str, torch.Tensor]] = []
        for p, offset in zip(params, self.offsets):
            strides = _dense_strides(p)
            views = {
                name: buf.as_strided(p.shape, strides, offset)
                for name, buf in (
                    ("param", self.param),
                    ("master", self.master),
                    ("grad", self.grad),
                    ("exp_avg", self.exp_avg),
                    ("exp_avg_sq", self.exp_avg_sq),
                )
                if buf is not None
            }
            views["param"].copy_(p.detach())
            p.data = views["param"]
            self.views.append(views)
        self.table = table
        self.base = table.add(self.params, group)
        self._block_tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def state_entry(self, i: int) -> dict[str, Any]:
        """Parameter ``i``'s optimizer state: views of the flat buffers and of the step count."""
        views = self.views[i]
        entry: dict[str, Any] = {"step": self.table.steps[self.base + i]}
        entry["exp_avg"], entry["exp_avg_sq"] = views["exp_avg"], views["exp_avg_sq"]
        if "master" in views:
            entry["master"] = views["master"]
        return entry

    def block_table(self, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The programs of a kernel over this bucket with ``block`` elements each (cached).

        Returns ``(starts, lengths, params)`` on the bucket's device, one entry per program: the
        flat offset where it starts (int64), how many elements it covers (int32, ``block``
        except in a parameter's last block), and its parameter's device-table index (int32).
        A program never crosses parameters; an empty parameter has none.
        """
        if block not in self._block_tables:
            numels = torch.tensor(self.numels, dtype=torch.int64)
            offsets = torch.tensor(self.offsets, dtype=torch.int64)
            n_blocks = (numels + block - 1) // block
            owner = torch.repeat_interleave(torch.arange(len(self.params)), n_blocks)
            first = torch.cumsum(n_blocks, 0) - n_blocks
            k = torch.arange(owner.numel()) - first[owner]  # block number inside its parameter
            starts = offsets[owner] + k * block
            lengths = torch.clamp(numels[owner] - k * block, max=block)
            self._block_tables[block] = (
                starts.to(self.device),
                lengths.to(device=self.device, dtype=torch.int32),
                (owner + self.base).to(device=self.device, dtype=torch.int32),
            )
        return self._block_tables[block]
