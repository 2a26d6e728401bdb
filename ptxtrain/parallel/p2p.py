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
- Sends are asynchronous (``isend``; the handles and the sent tensors are kept until
  :meth:`P2P.wait_all`), receives block. A schedule is then deadlock-free exactly when its
  dependency graph is acyclic, and the order of messages on one channel (src, dst, tag) is the
  program order on both sides. Payloads are made contiguous and moved to the P2P device before
  they are posted; 0-element payloads are described by the header only (never posted).
- Every wait is bounded by the timeout of the group the message travels on (gloo enforces it per
  operation, NCCL through its watchdog), and :func:`directional_groups` gives its groups the
  default group's timeout (``new_group``'s own default is gloo's 30 min / NCCL's 10 min,
  whatever ``init_process_group(timeout=...)`` said). A failed or timed-out wait raises
  ``RuntimeError`` naming the operation, the peer and the message's tag, so a rank whose
  neighbour failed but stays alive (or hangs) gives up instead of waiting on.
- One communicator per direction. NCCL runs the ops of one communicator in issue order on one
  stream, and a send larger than its buffers (a few MiB) cannot finish before the peer's receive
  runs. torch sends all unbatched traffic of a pair of ranks over one lazily created 2-rank
  communicator, so when two neighbours both post a large send to each other before their
  receives (DualPipe's two directions do this every step; 1F1B can too), each receive queues
  behind a send that waits for it: a hang (PP = 4 DualPipe with 8192-token micro-batches hung
  this way on 4 x H200; 2048-token ones fit NCCL's buffers and ran). Schedules therefore send
  ``src -> dst`` traffic on a 2-rank group used for that direction only
  (:func:`directional_groups`, passed to :class:`P2P` as ``pair_groups``): a pending send never
  blocks a receive, and the schedule is deadlock-free exactly when its dependency graph is
  acyclic, as on gloo. :func:`directional_groups` is a collective over the whole world (every
  rank creates every group in the same order): a schedule on the default group creates them at
  its first ``step``; with a subgroup the caller passes them (``pipeline_groups`` in
  :mod:`ptxtrain.train.pipeline` does); without them traffic falls back to the pipeline group.
- Connections are set up eagerly (:meth:`P2P.connect`): one tiny message each way per pair, in
  an order every rank agrees on, lower rank sending first. On the shared 2-rank communicator
  this is also what avoids an NCCL bug: when two ranks both *send* first on a fresh pair, each
  side's connect-info exchange carries send-side info where the other expects the recv side and
  the first send kernel faults (CUDA error 700 on both ranks; NVIDIA/nccl PR #2407). With
  per-direction groups the first op of each communicator is always a matched send / receive.
- ``StageRunner`` runs one stage for one direction of micro-batches: ``forward_chunk`` /
  ``backward_chunk`` in micro-batch order, optionally deferring the weight-grad part (W) to a
  :class:`WeightGradStore`. Its neighbours are group ranks, or a :class:`Loopback` when the
  neighbouring stage lives on the same rank (DualPipeV's turn at the last rank). With a
  :class:`~ptxtrain.parallel.timeline.Timeline` it records F / B / W / BW / send / recv cells.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import deque
from collections.abc import Callable, Iterable, Sequence

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


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta | None:
    """The timeout ``group`` (None: the default group) was created with, or None when this torch
    does not expose it (a private attribute of the group's backend)."""
    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for that device, or the private API moved
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def _describe(tag: int | None) -> str:
    if tag is None:
        return "any message"
    kind = "activations" if tag % 2 == FWD else "input gradients"
    return f"{kind} of direction {tag // 2} (tag {tag})"


class P2P:
    """Self-describing tensor-list send/recv between ranks of one process group.

    ``send(tensors, dst, tag)`` / ``recv(src, tag)``: messages of one (src, dst, tag) channel arrive
    in send order whatever the backend (see the module docstring: the tag is demultiplexed here,
    not by NCCL). Messages received ahead of their ``recv`` wait in a per-(src, tag) queue.

    A receive or send that fails or runs past its group's timeout raises ``RuntimeError`` naming
    the operation, the peer and the message's tag (module docstring).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        pair_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
    ):
        self.group = group
        self.device = device
        # (src, dst) global ranks -> the 2-rank group carrying that direction (module docstring);
        # a pair not in it travels on ``group``.
        self.pair_groups = pair_groups or {}
        self._pending: list = []  # (work, tensor kept alive until it is sent, dst, tag)
        self._early: dict[tuple[int, int], deque] = {}  # (src, tag) -> messages received early

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def _wire(self, src: int, dst: int) -> dist.ProcessGroup | None:
        """The group the ``src -> dst`` messages (global ranks) travel on."""
        return self.pair_groups.get((src, dst), self.group)

    @staticmethod
    def _failed(op: str, peer: int, tag: int | None, e: Exception) -> RuntimeError:
        """The error of an ``op`` with global rank ``peer`` that failed or ran past the group's
        timeout: it names the operation, the peer and the message."""
        return RuntimeError(
            f"pipeline P2P: rank {dist.get_rank()} could not {op} rank {peer} "
            f"({_describe(tag)}); the peer failed, hangs, or is not running the same "
            f"schedule step: {e}"
        )

    def _wait(self, work, op: str, peer: int, tag: int | None) -> None:
        """``work.wait()`` for an ``op`` with global rank ``peer``, raising :meth:`_failed`."""
        try:
            work.wait()
        except RuntimeError as e:
            raise self._failed(op, peer, tag, e) from e

    def _recv_into(self, buf: torch.Tensor, src: int, pg, tag: int | None) -> None:
        """Blocking receive from global rank ``src``, raising :meth:`_failed`."""
        try:
            dist.recv(buf, src, group=pg, tag=_WIRE_TAG)
        except RuntimeError as e:
            raise self._failed("receive from", src, tag, e) from e

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> None:
        """Post one message (``tensors`` under logical ``tag``) to group rank ``dst``.

        Every payload is detached, made contiguous and moved to this P2P's device first; the
        posted tensors (and so their storage) are kept alive, unmodified, until
        :meth:`wait_all`. 0-element payloads travel in the header only.

        Raises:
            TypeError: a dtype the wire format does not know.
            ValueError: a tensor of more than ``MAX_NDIM`` dimensions.
        """
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
            if t.numel() == 0:
                continue
            t = t.detach().to(self.device).contiguous()
            payloads.append(t.view(torch.uint8) if t.dtype in _FP8 else t)
        prefix = torch.tensor([len(tensors), tag], dtype=torch.int64, device=self.device)
        msgs = [prefix, header.to(self.device), *payloads]
        pg = self._wire(dist.get_rank(), dst)
        for m in msgs:
            self._pending.append((dist.isend(m, dst, group=pg, tag=_WIRE_TAG), m, dst, tag))

    def connect(self, peers: Iterable[int]) -> None:
        """Set up the connections to group ranks ``peers`` before any traffic (module docstring).

        Per peer one 1-element int64 message each way, through the unbatched ``isend`` / ``recv``
        the traffic uses: the pairs are taken in increasing ``(low rank, high rank)`` order on
        every rank (so the exchange cannot deadlock), and within a pair the lower rank sends
        first, so each side's first op toward the other is matched by the opposite op. Every
        rank named in another's ``peers`` must call it with that rank among its own. Cheap on
        gloo, where it only checks the pairing.

        Raises:
            RuntimeError: a peer answered with another rank's id (the pairs do not match).
        """
        me = dist.get_rank(self.group)
        for peer in sorted(set(peers) - {me}, key=lambda q: (min(me, q), max(me, q))):
            g_peer = self._global(peer)
            mine = torch.tensor([self._global(me)], dtype=torch.int64, device=self.device)
            got = torch.full((1,), -1, dtype=torch.int64, device=self.device)
            out_wire = self._wire(self._global(me), g_peer)
            in_wire = self._wire(g_peer, self._global(me))
            if me < peer:
                send = dist.isend(mine, g_peer, group=out_wire, tag=_WIRE_TAG)
                self._wait(send, "connect (send) to", g_peer, None)
                self._recv_into(got, g_peer, in_wire, None)
            else:
                self._recv_into(got, g_peer, in_wire, None)
                send = dist.isend(mine, g_peer, group=out_wire, tag=_WIRE_TAG)
                self._wait(send, "connect (send) to", g_peer, None)
            if int(got.item()) != g_peer:
                raise RuntimeError(
                    f"pipeline P2P connect: rank {self._global(me)} expected a message from "
                    f"rank {g_peer}, got one from rank {int(got.item())}"
                )

    def _recv_next(self, src: int, want: int) -> tuple[int, list[torch.Tensor]]:
        """The next message from global rank ``src`` on the wire: ``(tag, tensors)``; ``want``
        is the tag the caller waits for (for error messages)."""
        pg = self._wire(src, dist.get_rank())
        prefix = torch.empty(2, dtype=torch.int64, device=self.device)
        self._recv_into(prefix, src, pg, want)
        n, tag = prefix.tolist()
        header = torch.empty((n, 2 + MAX_NDIM), dtype=torch.int64, device=self.device)
        self._recv_into(header, src, pg, tag)
        out = []
        for code, ndim, *shape in header.tolist():
            dtype = _DTYPES[code]
            shape = shape[:ndim]
            wire = torch.uint8 if dtype in _FP8 else dtype
            buf = torch.empty(shape, dtype=wire, device=self.device)
            if buf.numel():  # 0-element payloads are not posted (see send)
                self._recv_into(buf, src, pg, tag)
            out.append(buf.view(dtype) if dtype in _FP8 else buf)
        return tag, out

    def recv(self, src: int, tag: int) -> list[torch.Tensor]:
        src = self._global(src)
        early = self._early.get((src, tag))
        if early:
            return early.popleft()
        while True:
            got, tensors = self._recv_next(src, tag)
            if got == tag:
                return tensors
            self._early.setdefault((src, got), deque()).append(tensors)

    def wait_all(self) -> None:
        """Wait for every posted send; raise ``RuntimeError`` if a received message was never
        asked for (a schedule whose sends and receives do not pair up), or if a send failed or
        did not complete within its group's timeout (the message names it)."""
        pending, self._pending = self._pending, []
        for work, _, dst, tag in pending:
            self._wait(work, "send to", dst, tag)
        left = {k: len(q) for k, q in self._early.items() if q}
        self._early.clear()
        if left:
            raise RuntimeError(
                f"pipeline P2P: messages received but never asked for, per (src, tag): {left}"
            )


def directional_groups(
    pairs: Iterable[tuple[int, int]],
    timeout: datetime.timedelta | None = None,
) -> dict[tuple[int, int], dist.ProcessGroup]:
    """Two new 2-rank process groups per pair ``(a, b)`` of global ranks: one for the ``a -> b``
    messages, one for ``b -> a`` (module docstring: one communicator per direction).

    A collective over the whole world: every rank calls it with the same ``pairs`` in the same
    order (``dist.new_group`` for every group, members or not). Duplicate pairs (either order)
    are created once. ``timeout``: the groups' timeout, which bounds every wait for a message;
    None: the default group's (``init_process_group(timeout=...)``), not ``new_group``'s default.

    Returns:
        ``{(src, dst): group}`` for the directions this rank takes part in.

    Raises:
        ValueError: a pair of equal ranks or a rank outside the world.
    """
    world, me = dist.get_world_size(), dist.get_rank()
    if timeout is None:
        timeout = group_timeout(None)
    out: dict[tuple[int, int], dist.ProcessGroup] = {}
    seen: set[tuple[int, int]] = set()
    for a, b in pairs:
        if a == b or not (0 <= a < world and 0 <= b < world):
            raise ValueError(f"pairs must hold two different ranks in [0, {world}), got {(a, b)}")
        key = (min(a, b), max(a, b))
        if key in seen:
            continue
        seen.add(key)
        for src, dst in ((key[0], key[1]), (key[1], key[0])):
            g = dist.new_group([src, dst], timeout=timeout)
            if me in (src, dst):
                out[(src, dst)] = g
    return out


def schedule_pairs(peers_of: Callable[[int, int], Iterable[int]], ranks: Sequence[int]):
    """The pairs of global ranks a schedule exchanges messages over, for the pipeline whose group
    rank ``i`` is global rank ``ranks[i]``: ``(ranks[i], ranks[q])`` for every ``q`` in
    ``peers_of(i, len(ranks))`` inside the pipeline, each pair once, in a fixed order."""
    world = len(ranks)
    pairs = {
        (min(i, q), max(i, q))
        for i in range(world)
        for q in peers_of(i, world)
        if 0 <= q < world and q != i
    }
    return [(ranks[i], ranks[q]) for i, q in sorted(pairs)]


class PairGroupsMixin:
    """The per-direction groups of a schedule (module docstring), for the schedule classes.

    A schedule sets ``self.group`` and ``self._pair_groups`` (from its ``p2p_groups`` argument);
    ``peers(rank, world)`` says which ranks it talks to (its neighbours here; DualPipe adds the
    mirror) and :meth:`_p2p` gives a :class:`P2P` over the groups. On the
    default group (``self.group is None``) without given groups, the first call creates them
    (every rank of the world runs the schedule, so the collective is matched).
    """

    group: dist.ProcessGroup | None
    _pair_groups: dict[tuple[int, int], dist.ProcessGroup] | None

    @staticmethod
    def peers(rank: int, world: int) -> tuple[int, ...]:
        """The group ranks group rank ``rank`` exchanges messages with: its neighbours."""
        return tuple(q for q in (rank - 1, rank + 1) if 0 <= q < world)

    def _p2p(self, device: torch.device) -> P2P:
        if self._pair_groups is None and self.group is None and dist.get_world_size() > 1:
            self._pair_groups = directional_groups(
                schedule_pairs(self.peers, list(range(dist.get_world_size())))
            )
        return P2P(self.group, device, self._pair_groups)


def connect_once(p2p: P2P, done: set[int], peers: Iterable[int], world: int) -> None:
    """:meth:`P2P.connect` to the group ranks of ``peers`` in ``[0, world)`` not yet in ``done``
    (a schedule's set of connected peers, updated); every rank calls it at the same point."""
    new = sorted({q for q in peers if 0 <= q < world} - done)
    if new:
        p2p.connect(new)
        done.update(new)


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


def check_upstream_args(batch_dim: object, rank_mapping: object, group) -> None:
    """DualPipe's ``batch_dim`` and ``rank_mapping`` (deepseek-ai/DualPipe's constructor), as far
    as ptxtrain's schedules take them: micro-batches are split along dim 0, and group rank ``i``
    is pipeline rank ``i``.

    Raises:
        TypeError: ``batch_dim`` not an int; ``rank_mapping`` not None or a list / tuple of ints.
        ValueError: ``batch_dim`` other than 0; ``rank_mapping`` not a permutation of the group's
            ranks (checked when the default group is initialized).
        NotImplementedError: ``rank_mapping`` another permutation than the identity.
    """
    if isinstance(batch_dim, bool) or not isinstance(batch_dim, int):
        raise TypeError(f"batch_dim must be an int, got {type(batch_dim).__name__}")
    if batch_dim != 0:
        raise ValueError(
            f"batch_dim must be 0 (ptxtrain's schedules split micro-batches along dim 0), "
            f"got {batch_dim}"
        )
    if rank_mapping is None:
        return
    if not isinstance(rank_mapping, (list, tuple)) or not all(
        isinstance(r, int) and not isinstance(r, bool) for r in rank_mapping
    ):
        raise TypeError(f"rank_mapping must be None or a list of ints, got {rank_mapping!r}")
    world = dist.get_world_size(group) if dist.is_initialized() else len(rank_mapping)
    if sorted(rank_mapping) != list(range(world)):
        raise ValueError(
            f"rank_mapping must be a permutation of the {world} group ranks, got {rank_mapping}"
        )
    if list(rank_mapping) != list(range(world)):
        raise NotImplementedError(
            f"rank_mapping must be None or the identity: group rank i is pipeline rank i in "
            f"ptxtrain's schedules (build the process group in pipeline order), got {rank_mapping}"
        )


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


class Loopback:
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


class StageRunner:
    """One pipeline stage for one direction of micro-batches.

    ``prev`` / ``next`` are the group ranks holding the previous / next stage (None at the ends,
    a :class:`Loopback` when that stage is on this rank). The first stage takes
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
        if isinstance(peer, Loopback):
            return peer.pop(kind)
        with self._cell("recv", chunk):
            return self.p2p.recv(peer, self.tag_fwd if kind == FWD else self.tag_bwd)

    def _send(self, tensors: Sequence[torch.Tensor], peer, kind: int, chunk: int) -> None:
        if isinstance(peer, Loopback):
            peer.push(tensors, kind)
            return
        with self._cell("send", chunk):
            self.p2p.send(tensors, peer, self.tag_fwd if kind == FWD else self.tag_bwd)

    # A forward chunk is _forward_begin (inputs), the compute, _forward_end (loss, send); a
    # backward chunk is _backward_begin (grads), the compute, _backward_end (send input grads).
    # forward_chunk / backward_chunk run them in a row; forward_backward (below) runs the begin
    # halves of an F&B pair, then both computes through the stage's overlap hook, then the ends.
    def _forward_begin(self) -> tuple[int, tuple]:
        i = self.n_fwd
        self.n_fwd += 1
        if self.prev is None:
            return i, tuple(self.input_chunks[i])
        inputs = tuple(
            t.requires_grad_() if t.is_floating_point() else t
            for t in self._recv(self.prev, FWD, i)
        )
        return i, inputs

    def _loss_args(self, i: int) -> tuple[Callable | None, tuple]:
        """``(criterion, labels)`` of chunk ``i``: the criterion on the last stage only."""
        if self.next is None:
            return self.criterion, tuple(self.label_chunks[i])
        return None, ()

    def _forward_end(self, i: int, inputs: tuple, outputs: tuple, loss) -> None:
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

    def forward_chunk(self) -> None:
        i, inputs = self._forward_begin()
        criterion, labels = self._loss_args(i)
        with self._cell("F", i):  # on the last stage the loss is part of the forward cell
            outputs = as_tuple(self.module(*inputs))
            loss = criterion(*outputs, *labels) if criterion is not None else None
        self._forward_end(i, inputs, outputs, loss)

    def _backward_begin(self) -> tuple[int, tuple, list, list]:
        """``(chunk, stage inputs, outputs to backward from, their grads)``; on the last stage
        the outputs are ``[loss]`` and the grads ``[None]``. Outputs that do not require grad
        are left out."""
        i = self.n_bwd
        self.n_bwd += 1
        inputs, outs = self.states.pop(i)
        grads = [None] if self.next is None else self._recv(self.next, BWD, i)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad]
        return i, inputs, [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_end(self, i: int, inputs: tuple) -> None:
        if self.prev is not None:
            self._send(
                [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs],
                self.prev,
                BWD,
                i,
            )

    def backward_chunk(self, wgrad_store: WeightGradStore | None = None) -> None:
        """Backward of the oldest pending chunk; with ``wgrad_store`` only B now, W queued."""
        i, inputs, outs, grads = self._backward_begin()
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
        self._backward_end(i, inputs)

    def total_loss(self) -> torch.Tensor:
        return torch.stack([lo.reshape(()) for lo in self.losses]).sum()

    def gathered_outputs(self):
        cat = tuple(torch.cat(parts, dim=0) for parts in zip(*self.outputs, strict=True))
        return cat[0] if len(cat) == 1 else cat


OVERLAP_HOOK = "overlapped_forward_backward"


def overlap_hook(module_f: nn.Module, module_b: nn.Module) -> Callable | None:
    """The overlap hook an F&B step of ``module_f`` (forward) and ``module_b`` (backward) uses.

    The hook is the attribute ``overlapped_forward_backward`` of the stage class, a classmethod
    (or staticmethod) called as ``hook(module_f, inputs_f, criterion_f, labels_f, module_b,
    loss_b, outputs_b, output_grads_b) -> (outputs_f, loss_f)`` (see :func:`forward_backward`).
    It is used when both modules are instances of the same class that defines it; otherwise
    (None) the step runs the forward, then the backward.

    Raises:
        TypeError: the class defines ``overlapped_forward_backward`` as a plain (instance)
            method or a non-callable.
    """
    cls = type(module_f)
    if type(module_b) is not cls:
        return None
    for klass in cls.__mro__:
        if OVERLAP_HOOK in vars(klass):
            raw = vars(klass)[OVERLAP_HOOK]
            break
    else:
        return None
    if raw is None:  # a subclass may switch the hook off
        return None
    if not isinstance(raw, (classmethod, staticmethod)):
        raise TypeError(
            f"{cls.__name__}.{OVERLAP_HOOK} must be a classmethod or staticmethod taking "
            f"(module_f, inputs_f, criterion_f, labels_f, module_b, loss_b, outputs_b, "
            f"output_grads_b), got {type(raw).__name__}"
        )
    return getattr(cls, OVERLAP_HOOK)


def check_overlap_hooks(modules: Sequence[nn.Module]) -> None:
    """Raise ``TypeError`` at schedule construction for a malformed hook (see
    :func:`overlap_hook`), rather than in the middle of a step."""
    for m in modules:
        overlap_hook(m, m)


def sequential_forward_backward(
    module_f: nn.Module,
    inputs_f: tuple,
    criterion_f: Callable | None,
    labels_f: tuple,
    module_b: nn.Module,
    loss_b: torch.Tensor | None,
    outputs_b: Sequence[torch.Tensor],
    output_grads_b: Sequence[torch.Tensor],
) -> tuple[tuple, torch.Tensor | None]:
    """The reference F&B compute: ``module_f``'s forward (and loss), then ``module_b``'s full
    backward; the contract every ``overlapped_forward_backward`` hook must match numerically.

    Args:
        module_f: the stage whose forward runs; ``inputs_f`` its positional inputs.
        criterion_f: on the last stage ``criterion_f(*outputs_f, *labels_f) -> loss``, else None.
        module_b: the stage whose backward runs (its graph was built by an earlier forward).
        loss_b: on the last stage the chunk's loss to backward from (then ``outputs_b`` and
            ``output_grads_b`` are empty), else None.
        outputs_b, output_grads_b: the stage outputs that require grad and the gradients the
            next stage sent for them (same length; may be empty, then nothing is run).

    Returns:
        ``(outputs_f, loss_f)``: the forward's outputs as a tuple, and the loss (None when
        ``criterion_f`` is None). Parameter grads of ``module_b`` and the ``.grad`` of its
        stage inputs are accumulated as by ``torch.autograd.backward``.
    """
    outputs_f = as_tuple(module_f(*inputs_f))
    loss_f = criterion_f(*outputs_f, *labels_f) if criterion_f is not None else None
    if loss_b is not None:
        torch.autograd.backward([loss_b])
    elif outputs_b:
        torch.autograd.backward(list(outputs_b), list(output_grads_b))
    return outputs_f, loss_f


def forward_backward(f: StageRunner, b: StageRunner, overlap: bool = True) -> None:
    """One F&B step: ``f``'s next forward chunk and ``b``'s next backward chunk (B and W).

    Without a hook (or with ``overlap=False``) it is ``f.forward_chunk(); b.backward_chunk()``.
    With one (:func:`overlap_hook`) the receives of both chunks come first, then one hook call
    computes both, then both sends; with a timeline, the hook's span is recorded as the F cell of
    ``f``'s chunk and the BW cell of ``b``'s (the two overlap).
    """
    hook = overlap_hook(f.module, b.module) if overlap else None
    if hook is None:
        f.forward_chunk()
        b.backward_chunk()
        return
    i_f, inputs_f = f._forward_begin()
    criterion_f, labels_f = f._loss_args(i_f)
    i_b, inputs_b, outs_b, grads_b = b._backward_begin()
    loss_b = outs_b[0] if b.next is None and outs_b else None
    if loss_b is not None:
        outs_b, grads_b = [], []
    with f._cell("F", i_f), b._cell("BW", i_b):
        outputs_f, loss_f = hook(
            f.module, inputs_f, criterion_f, labels_f, b.module, loss_b, outs_b, grads_b
        )
    f._forward_end(i_f, inputs_f, as_tuple(outputs_f), loss_f)
    b._backward_end(i_b, inputs_b)
