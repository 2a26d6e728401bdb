"""Point-to-point plumbing and per-stage bookkeeping shared by the pipeline schedules.

- Every P2P message is self-describing: the sender first sends an int64 ``[n, tag]`` prefix, then
  an int64 header ``[n, 2 + MAX_NDIM]`` (dtype code, ndim, shape padded with -1), then the n
  payloads. Shapes and dtypes are therefore inferred per message; there is no
  ``set_p2p_tensor_shapes`` and no module-level mutable state. FP8 payloads travel as ``uint8``
  views (gloo cannot carry FP8).
- Tags are carried in the message, not by the backend: NCCL ignores the ``tag`` of
  ``isend``/``recv`` and matches the messages of one (src, dst) pair purely in issue order, so a
  schedule whose receiver asks for the messages of one pair in another tag order than they were
  sent (DualPipeV on 4 ranks does) would hand activations to a gradient receive there while
  gloo, which honours tags, runs it correctly. Every message therefore travels on one wire tag,
  in send order, and :meth:`P2P.recv` demultiplexes: it takes the next messages of the pair,
  keeping those of other tags for their own ``recv``. gloo and NCCL then see the same traffic.
- Sends are asynchronous (``isend``; the handles are kept until :meth:`P2P.wait_all`), receives
  block. A schedule is then deadlock-free exactly when its dependency graph is acyclic, and the
  order of messages on one channel (src, dst, tag) is the program order on both sides.
- ``_StageRunner`` runs one stage for one direction of micro-batches: ``forward_chunk`` /
  ``backward_chunk`` in micro-batch order, optionally deferring the weight-grad part (W) to a
  :class:`WeightGradStore`. Its neighbours are group ranks, or a :class:`_Loopback` when the
  neighbouring stage lives on the same rank (DualPipeV's turn at the last rank). With a
  :class:`~ptxtrain.parallel.timeline.Timeline` it records F / B / W / BW / send / recv cells.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

MAX_NDIM = 8
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_CODE = {d: i for i, d in enumerate(_DTYPES)}
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# Message kinds; the tag of a message is 2 * direction + kind, so every (src, dst, tag) channel
# carries one stream of messages in micro-batch order.
FWD, BWD = 0, 1
# The backend tag every message travels on (the logical tag is in the message's prefix).
_WIRE_TAG = 0


def as_tuple(x: object) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class P2P:
    """Self-describing tensor-list send/recv between ranks of one process group.

    ``send(tensors, dst, tag)`` / ``recv(src, tag)``: messages of one (src, dst, tag) channel arrive
    in send order whatever the backend (see the module docstring: the tag is demultiplexed here,
    not by NCCL). Messages received ahead of their ``recv`` wait in a per-(src, tag) queue.
    """

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group = group
        self.device = device
        self._pending: list = []  # (work, tensors kept alive until the send completes)
        self._early: dict[tuple[int, int], deque] = {}  # (src, tag) -> messages received early

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
        dst = self._global(dst)
        header = torch.full((len(tensors), 2 + MAX_NDIM), -1, dtype=torch.int64)
        payloads = []
        for i, t in enumerate(tensors):
            if t.dtype not in _CODE:
                raise TypeError(f"pipeline P2P cannot send dtype {t.dtype}")
            if t.dim() > MAX_NDIM:
                raise ValueError(
                    f"pipeline P2P sends at most {MAX_NDIM}-D tensors, got {t.dim()}-D"
                )
            header[i, 0] = _CODE[t.dtype]
            header[i, 1] = t.dim()
            header[i, 2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
            t = t.detach().contiguous()
            payloads.append(t.view(torch.uint8) if t.dtype in _FP8 else t)
        prefix = torch.tensor([len(tensors), tag], dtype=torch.int64, device=self.device)
        msgs = [prefix, header.to(self.device), *payloads]
        for m in msgs:
            self._pending.append((dist.isend(m, dst, group=self.group, tag=_WIRE_TAG), m))

    def _recv_next(self, src: int) -> tuple[int, list[torch.Tensor]]:
        """The next message from global rank ``src`` on the wire: ``(tag, tensors)``."""
        prefix = torch.empty(2, dtype=torch.int64, device=self.device)
        dist.recv(prefix, src, group=self.group, tag=_WIRE_TAG)
        n, tag = prefix.tolist()
        header = torch.empty((n, 2 + MAX_NDIM), dtype=torch.int64, device=self.device)
        dist.recv(header, src, group=self.group, tag=_WIRE_TAG)
        out = []
        for code, ndim, *shape in header.tolist():
            dtype = _DTYPES[code]
            shape = shape[:ndim]
            wire = torch.uint8 if dtype in _FP8 else dtype
            buf = torch.empty(shape, dtype=wire, device=self.device)
            dist.recv(buf, src, group=self.group, tag=_WIRE_TAG)
            out.append(buf.view(dtype) if dtype in _FP8 else buf)
        return tag, out

    def recv(self, src: int, tag: int) -> list[torch.Tensor]:
        src = self._global(src)
        early = self._early.get((src, tag))
        if early:
            return early.popleft()
        while True:
            got, tensors = self._recv_next(src)
            if got == tag:
                return tensors
            self._early.setdefault((src, got), deque()).append(tensors)

    def wait_all(self) -> None:
        """Wait for every posted send; raise ``RuntimeError`` if a received message was never
        asked for (a schedule whose sends and receives do not pair up)."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        left = {k: len(q) for k, q in self._early.items() if q}
        self._early.clear()
        if left:
            raise RuntimeError(
                f"pipeline P2P: messages received but never asked for, per (src, tag): {left}"
            )


class WeightGradStore:
    """FIFO of deferred weight-gradient (W) closures, one entry per zero-bubble backward chunk.

    ``put`` queues the W work of one chunk, ``pop`` runs the oldest, ``flush`` runs them all.
    Instances live for one ``step()`` only (no class-level state).
    """

    def __init__(self) -> None:
        self._queue: deque[Callable[[], None]] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def put(self, fn: Callable[[], None]) -> None:
        self._queue.append(fn)

    def pop(self) -> None:
        if self._queue:
            self._queue.popleft()()

    def flush(self) -> None:
        while self._queue:
            self.pop()


def split_chunks(name: str, tensors: Sequence[object], n: int) -> list[tuple[torch.Tensor, ...]]:
    """Split every tensor along dim 0 into ``n`` equal micro-batches; ``[n]`` tuples of tensors."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() == 0 or t.shape[0] % n:
            raise ValueError(
                f"{name}[{i}] must have a dim 0 divisible by the {n} micro-batches it is split "
                f"into, got shape {tuple(t.shape)}"
            )
    if not tensors:
        return [() for _ in range(n)]
    return list(zip(*(t.chunk(n, dim=0) for t in tensors), strict=True))


def agree_on_errors(errors: list[str], group, rank: int, world: int) -> None:
    """Share every rank's failed local checks, then raise ``ValueError`` on every rank if any.

    One small ``all_gather_object``, so a bad argument seen by one rank raises on every rank (with
    every rank's message) instead of leaving the others waiting in a receive.
    """
    gathered: list = [None] * world
    dist.all_gather_object(gathered, list(errors), group=group)
    msgs = [f"rank {r}: {m}" for r, errs in enumerate(gathered) for m in errs]
    if msgs:
        raise ValueError("invalid pipeline step() arguments: " + "; ".join(msgs))


def check_two_stages(modules: object, layout: str) -> nn.ModuleList:
    """The ``modules`` argument of a two-stages-per-rank schedule (DualPipe, DualPipeV).

    Raises:
        ValueError: not a tuple/list of exactly two entries (the message names ``layout``).
        TypeError: an entry is not an ``nn.Module``.
    """
    if not isinstance(modules, (tuple, list)) or len(modules) != 2:
        got = len(modules) if isinstance(modules, (tuple, list)) else type(modules).__name__
        raise ValueError(f"modules must be {layout}: exactly two modules, got {got}")
    for i, m in enumerate(modules):
        if not isinstance(m, nn.Module):
            raise TypeError(f"modules[{i}] must be an nn.Module, got {type(m).__name__}")
    return nn.ModuleList(modules)


def check_step_args(
    schedule: str,
    inputs: Sequence[object],
    labels: Sequence[object],
    criterion: Callable | None,
    timeline: object,
    *,
    group,
    rank: int,
    world: int,
    input_ranks: Sequence[int],
    loss_ranks: Sequence[int],
    n: int,
) -> tuple[list | None, list | None]:
    """The checks of a schedule's ``step`` that depend on what one rank was given.

    Inputs must be given exactly on ``input_ranks``, the criterion on ``loss_ranks`` (which also
    hold the labels), every tensor must split along dim 0 into ``n`` micro-batches, and
    ``timeline`` must be a Timeline or None. The failures of all ranks are shared by one
    all-gather (:func:`agree_on_errors`), so every rank raises with every rank's message.

    Returns:
        ``(input_chunks, label_chunks)`` of this rank (None where it holds none).

    Raises:
        ValueError: any rank failed a check.
    """
    from ptxtrain.parallel.timeline import check_timeline  # timeline.py imports nothing of ours

    errors: list[str] = []
    input_chunks = label_chunks = None
    holds_inputs, holds_loss = rank in input_ranks, rank in loss_ranks
    try:
        if holds_inputs != bool(inputs):
            where = f"are missing on rank {rank}" if holds_inputs else f"were given on rank {rank}"
            takes = " and ".join(str(r) for r in sorted(set(input_ranks)))
            errors.append(f"inputs {where}; {schedule} takes inputs on rank {takes} only")
        if holds_loss and criterion is None:
            errors.append(f"criterion is missing on rank {rank}, where the loss is computed")
        if holds_inputs:
            input_chunks = split_chunks("inputs", inputs, n)
        if holds_loss:
            label_chunks = split_chunks("labels", tuple(labels), n)
    except (TypeError, ValueError) as e:
        errors.append(str(e))
    errors += check_timeline(timeline)
    agree_on_errors(errors, group, rank, world)
    return input_chunks, label_chunks


def module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    return torch.device("cpu")


class _Loopback:
    """In-process hand-off between two stages of one rank (no communication).

    ``push(tensors, kind)`` / ``pop(kind)`` with kind ``FWD`` (activations, from the earlier stage
    to the later) or ``BWD`` (input grads, from the later stage to the earlier), FIFO per kind.
    Activations are detached, so the later stage starts its own graph as after a P2P receive.
    """

    def __init__(self) -> None:
        self._queues: tuple[deque, deque] = (deque(), deque())

    def push(self, tensors: Sequence[torch.Tensor], kind: int) -> None:
        self._queues[kind].append([t.detach() for t in tensors])

    def pop(self, kind: int) -> list[torch.Tensor]:
        return self._queues[kind].popleft()


_NO_CELL = contextlib.nullcontext()


class _StageRunner:
    """One pipeline stage for one direction of micro-batches.

    ``prev`` / ``next`` are the group ranks holding the previous / next stage (None at the ends,
    a :class:`_Loopback` when that stage is on this rank). The first stage takes
    ``input_chunks``; the last one applies ``criterion(*outputs, *labels)``. ``timeline``: an
    optional :class:`~ptxtrain.parallel.timeline.Timeline` whose current step gets the cells.
    """

    def __init__(
        self,
        module: nn.Module,
        p2p: P2P,
        direction: int,
        prev: int | None,
        next_: int | None,
        input_chunks: list[tuple] | None,
        criterion: Callable | None,
        label_chunks: list[tuple] | None,
        keep_outputs: bool,
        timeline=None,
    ):
        self.module, self.p2p = module, p2p
        self.direction, self.timeline = direction, timeline
        self.prev, self.next = prev, next_
        self.tag_fwd, self.tag_bwd = 2 * direction + FWD, 2 * direction + BWD
        self.input_chunks, self.criterion, self.label_chunks = input_chunks, criterion, label_chunks
        self.keep_outputs = keep_outputs
        self.n_fwd = self.n_bwd = 0
        self.states: dict[int, tuple] = {}  # chunk -> (stage inputs, tensors to backward from)
        self.losses: list[torch.Tensor] = []
        self.outputs: list[tuple] = []

    def _cell(self, kind: str, chunk: int):
        if self.timeline is None:
            return _NO_CELL
        return self.timeline.cell(kind, chunk, self.direction)

    def _recv(self, peer, kind: int, chunk: int) -> list[torch.Tensor]:
        if isinstance(peer, _Loopback):
            return peer.pop(kind)
        with self._cell("recv", chunk):
            return self.p2p.recv(peer, self.tag_fwd if kind == FWD else self.tag_bwd)

    def _send(self, tensors: Sequence[torch.Tensor], peer, kind: int, chunk: int) -> None:
        if isinstance(peer, _Loopback):
            peer.push(tensors, kind)
            return
        with self._cell("send", chunk):
            self.p2p.send(tensors, peer, self.tag_fwd if kind == FWD else self.tag_bwd)

    def forward_chunk(self) -> None:
        i = self.n_fwd
        self.n_fwd += 1
        if self.prev is None:
            inputs = tuple(self.input_chunks[i])
        else:
            inputs = tuple(
                t.requires_grad_() if t.is_floating_point() else t
                for t in self._recv(self.prev, FWD, i)
            )
        with self._cell("F", i):  # on the last stage the loss is part of the forward cell
            outputs = as_tuple(self.module(*inputs))
            if self.next is None:
                loss = self.criterion(*outputs, *self.label_chunks[i])
        if self.next is None:
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ValueError(f"criterion must return a one-element loss tensor, got {loss!r}")
            self.losses.append(loss.detach())
            if self.keep_outputs:
                self.outputs.append(tuple(o.detach() for o in outputs))
            self.states[i] = (inputs, (loss,))
        else:
            self._send(outputs, self.next, FWD, i)
            self.states[i] = (inputs, outputs)

    def backward_chunk(self, wgrad_store: WeightGradStore | None = None) -> None:
        """Backward of the oldest pending chunk; with ``wgrad_store`` only B now, W queued."""
        i = self.n_bwd
        self.n_bwd += 1
        inputs, outs = self.states.pop(i)
        grads = [None] if self.next is None else self._recv(self.next, BWD, i)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
        in_req = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        params = [p for p in self.module.parameters() if p.requires_grad]
        if outs and wgrad_store is not None:
            # B: input grads only (keeping the graph); W: the parameter grads, later. Generic
            # modules do W by a second pass over the graph restricted to the parameters; a real
            # model splits W inside its linear layers instead (see the module docstrings).
            with self._cell("B", i):
                if in_req:
                    torch.autograd.backward(outs, grads, inputs=in_req, retain_graph=bool(params))
            if params:

                def weight_chunk() -> None:
                    with self._cell("W", i):
                        torch.autograd.backward(outs, grads, inputs=params)

                wgrad_store.put(weight_chunk)
        elif outs:
            with self._cell("BW", i):
                torch.autograd.backward(outs, grads)
        if self.prev is not None:
            self._send(
                [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs],
                self.prev,
                BWD,
                i,
            )

    def total_loss(self) -> torch.Tensor:
        return torch.stack([lo.reshape(()) for lo in self.losses]).sum()

    def gathered_outputs(self):
        cat = tuple(torch.cat(parts, dim=0) for parts in zip(*self.outputs, strict=True))
        return cat[0] if len(cat) == 1 else cat
