"""Expert-parallel dispatch / combine in DeepEP's shape, on ``torch.distributed.all_to_all_single``.

Design note (DeepSeek-V3 report §3.2.2; docs/design.md §4; the API follows DeepEP's V1
``Buffer``).

Experts are split contiguously over the ``R`` ranks of the group: rank ``r`` holds the
``E_local = E / R`` experts ``[r·E_local, (r+1)·E_local)``. A token goes **once** to every rank
that holds at least one of its top-k experts (not once per expert); an id of ``-1`` in ``topk_idx``
means "no expert" and is skipped.

Layouts.

- Send side: the rows sent to rank ``r`` are the tokens ``t`` with ``is_token_in_rank[t, r]``, in
  ascending ``t``; the send buffer is these groups concatenated in rank order
  (``handle.send_src_idx`` maps a send row to its token).
- Receive side: ``recv_x [N, H]`` holds the tokens **ordered by source rank, then by source token
  index** (``handle.recv_src_rank`` / ``handle.recv_src_idx`` give both for every row).
  ``recv_topk_idx [N, k]`` holds *local* expert ids (``global - rank·E_local``) and ``-1`` for
  slots whose expert lives on another rank (or was ``-1``); ``recv_topk_weights`` is 0 in those
  slots. Rows are not grouped by expert: the receiver permutes (e.g. with
  :func:`ptxtrain.moe.ref.permute_ref`) using ``num_recv_tokens_per_expert``.
- FP8 dispatch: ``(x_fp8 [T, H] e4m3, sf [T, ⌈H/128⌉] fp32)`` travels as one ``uint8`` message
  per row (the FP8 bytes followed by the scale bytes): bit-exact, and gloo carries no FP8 dtype.

Messages per dispatch: two. (1) One small ``all_to_all_single`` of per-peer int64 counts (rows
for the peer, this rank's largest per-peer count, the number of invalid ids, the tokens for
each of the peer's experts), followed by the call's **only host sync**: one device-to-host copy
of what the host needs (receive counts to size the outputs, the send counts, the capacity
bound, the per-expert receive counts it returns, the validity flags). The id-range check of
``topk_idx`` rides on this message, so an invalid id raises ValueError on every rank alike.
(2) ONE payload message: every sent row packs, side by side as bytes, the activations (or FP8
bytes + scales), the gate weights, the global ``topk_idx`` and the source token index, moved by
one ``all_to_all_single`` (or one nvlink kernel launch). Layout, send order and every index
vector are built with device ops (no ``nonzero`` / ``bincount`` / ``.tolist()`` beyond the one
copy). The call is host-bound (every torch op costs host time and, after the sync, the GPU
waits for each), so on CUDA the whole send layout is ONE Triton launch, the payload is packed
and unpacked with one launch each, the received rows' local ids / weights / source index and
rank come from one launch (``recv_tail``) and combine sums with one launch over a slot table
(:mod:`ptxtrain.ep.layout`; CPU tensors take its torch twins, bit-identical). What needs no
host-side count (the send / receive offsets; with nvlink, the packing) is queued before the
sync, so that the host's launches after it are few: behind queued work on two H200s a
dispatch adds 0.56x (nvlink) / 0.74x (all_to_all) of the GPU time it adds with all of it
after the sync.
``combine`` is one message with the splits swapped and no layout exchange (the handle
knows everything), then an ``index_add`` per source token accumulated in fp32 (fp64 for fp64
inputs); the backward of dispatch combines the gradients of activations and weights in one
message too.

The :class:`DispatchHandle` keeps the layout (counts per peer, the token index of every sent and
received row, ``is_token_in_rank``) so that ``combine`` and the backward passes replay it with no
further count exchange. Autograd: the backward of dispatch is a combine of the gradient, the
backward of combine is a dispatch of the gradient with the handle.

Backends. ``"all_to_all"`` (default; the only one on CPU) moves everything with
``all_to_all_single``. ``"nvlink"`` (one node of NVLink-connected GPUs, NCCL group) keeps the
count exchange above but moves the payload message (and the combine rows and the autograd
counterparts) with a JIT kernel writing straight into the peers' symmetric-memory buffers on
``num_sms`` SMs (:mod:`ptxtrain.ep.nvlink` has its design note); it needs only the send and
receive offsets (prefix sums of the counts, built on the device in two launches and cached in
the handle): the kernel derives each row's peer and place from them. The receive
order, the handle and the sums are the same, so both backends give bit-identical results.

Async mode (DeepEP's ``async_finish``): ``dispatch(..., async_finish=True)`` and
``combine(..., async_finish=True)`` run on a side CUDA stream (after waiting for the current
stream); the :class:`EventOverlap` they return last (always: an already complete one without
``async_finish``) then has a ``current_stream_wait()`` to call before using the outputs on the
current stream. Inputs are
``record_stream``-ed on the side stream and outputs (and the handle's tensors) on the current
stream, so the caching allocator never hands their memory out early. On CPU the same API works
and the event is already complete. (The layout exchange still needs a host sync for the counts,
as DeepEP's normal dispatch does.)
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from ptxtrain._checks import ceil_div, check_positive_int, check_shape, check_tensor
from ptxtrain.ep.config import Config
from ptxtrain.ep.layout import (
    combine_sum,
    pack_rows,
    recv_tail,
    send_layout,
    torch_combine_sum,
    triton_usable,
    unpack_rows,
)
from ptxtrain.quant.ref import BLOCK, FP8_DTYPE

__all__ = [
    "BACKENDS",
    "DEFAULT_NVL_BYTES",
    "Buffer",
    "DispatchHandle",
    "EventOverlap",
    "dispatch_rows",
    "get_dispatch_layout",
    "move_rows",
]

_X_DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.float64)
_W_DTYPES = (torch.float32, torch.float64)
BACKENDS = ("all_to_all", "nvlink")
DEFAULT_NVL_BYTES = 1 << 30
# Experts per rank that a dispatch's count message has room for. The message goes out padded
# to this fixed width (5 + it int64 columns per peer), so ranks that disagree on num_experts
# still exchange messages of one size and the signature check raises on every rank, instead of
# the collective itself failing (gloo aborts the process; NCCL does not check sizes).
_MAX_EXPERTS_PER_RANK = 1024


def _check_topk_idx(topk_idx: object, num_experts: int) -> torch.Tensor:
    check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
    if topk_idx.numel() > 0:
        lo, hi = int(topk_idx.min()), int(topk_idx.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(
                f"topk_idx must hold expert ids in [0, num_experts={num_experts}) or -1, "
                f"got values in [{lo}, {hi}]"
            )
    return topk_idx


def _check_experts(num_experts: object, num_ranks: int) -> int:
    check_positive_int("num_experts", num_experts)
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts must be a multiple of the number of ranks {num_ranks}, got {num_experts}"
        )
    return num_experts


def get_dispatch_layout(
    topk_idx: torch.Tensor, num_experts: int, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Which ranks each token goes to, and the token counts per rank and per expert.

    Pure function (no communication); experts are split contiguously over ranks
    (rank ``r`` holds experts ``[r·E/R, (r+1)·E/R)``).

    Args:
        topk_idx: ``[T, k]`` int64 expert ids in ``[0, num_experts)``, or ``-1`` for "no expert"
            (skipped). Ids within a row are expected distinct (as top-k gives them).
        num_experts: ``E``, a multiple of ``num_ranks``.
        num_ranks: ``R``, the expert-parallel world size.

    Returns:
        ``num_tokens_per_rank [R]`` int64 (tokens sent to each rank, each token counted once per
        rank however many of its experts live there), ``num_tokens_per_expert [E]`` int64
        (tokens routed to each expert) and ``is_token_in_rank [T, R]`` bool.

    Raises:
        TypeError: ``topk_idx`` is not an int64 tensor; ``num_experts``/``num_ranks`` not ints.
        ValueError: ``topk_idx`` is not 2-D or holds ids outside ``[-1, E)``; ``num_experts``
            is not a positive multiple of ``num_ranks``.

    Source: DeepEP ``Buffer.get_dispatch_layout``, without the RDMA-rank count.
    """
    check_positive_int("num_ranks", num_ranks)
    _check_experts(num_experts, num_ranks)
    _check_topk_idx(topk_idx, num_experts)
    is_token_in_rank, counts, _, _ = send_layout(topk_idx, num_experts, num_ranks)
    num_tokens_per_rank = counts[0, :, 0].contiguous()
    num_tokens_per_expert = counts[0, :, 3:].reshape(num_experts)
    return num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank


@dataclass(frozen=True, eq=False)
class DispatchHandle:
    """The communication layout of one :meth:`Buffer.dispatch`, replayed by ``combine``.

    Attributes:
        rank / num_ranks: this rank and the group size.
        num_experts: ``E`` (global).
        num_tokens: ``T``, tokens this rank dispatched.
        send_counts: rows sent to each rank (``R`` ints; = ``num_tokens_per_rank``).
        recv_counts: rows received from each rank (``R`` ints).
        send_src_idx: ``[S]`` int64, the token index of every sent row (grouped by destination,
            ascending within a group).
        recv_src_rank / recv_src_idx: ``[N]`` int64, source rank and source token index of every
            received row (the receive order: by source rank, then source token index).
        is_token_in_rank: ``[T, R]`` bool.
        group: the process group (``None`` = the default group).
        max_rows_per_pair: the largest row count between any two ranks of the group in this
            layout (the same on every rank; the nvlink backend's capacity check).
        hidden: ``H`` of the dispatched rows (the same on every rank, checked by the dispatch),
            which ``combine`` requires of its rows too.
        timeout_s: the buffer's ``timeout_s`` (bounds the gloo exchanges).
        transport: the :class:`ptxtrain.ep.nvlink.NvlinkTransport` moving the payload rows,
            or ``None`` for ``all_to_all_single``.
    """

    rank: int
    num_ranks: int
    num_experts: int
    num_tokens: int
    send_counts: tuple[int, ...]
    recv_counts: tuple[int, ...]
    send_src_idx: torch.Tensor
    recv_src_rank: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    group: dist.ProcessGroup | None
    hidden: int
    timeout_s: float
    max_rows_per_pair: int = 0
    transport: object | None = field(default=None, repr=False)
    _nvl_index: dict = field(default_factory=dict, repr=False)

    @property
    def num_recv_tokens(self) -> int:
        """``N``, rows received by this rank."""
        return sum(self.recv_counts)


def _all_to_all(out, inp, group, what: str, timeout_s: float, **splits) -> None:
    """``all_to_all_single(out, inp, **splits)``; on a gloo group the wait is bounded by
    ``timeout_s`` and a failed or late exchange raises ``RuntimeError`` naming ``what`` (the
    Buffer call) instead of waiting for the group's timeout (gloo's default: 30 min). NCCL
    groups keep the group's timeout and NCCL's watchdog (their wait does not block the host)."""
    if dist.get_backend(group) != "gloo":
        dist.all_to_all_single(out, inp, group=group, **splits)
        return
    work = dist.all_to_all_single(out, inp, group=group, async_op=True, **splits)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"{what}: the all_to_all_single on rank {dist.get_rank()} did not complete within "
            f"timeout_s={timeout_s:g} s: a rank failed, hangs, or did not make the same call "
            f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})"
        ) from e


def _exchange(
    t: torch.Tensor,
    in_splits: tuple[int, ...],
    out_splits: tuple[int, ...],
    group,
    what: str,
    timeout_s: float,
) -> torch.Tensor:
    """``all_to_all_single`` of the rows of ``t`` (dim 0), any trailing shape (:func:`_all_to_all`
    bounds its wait on gloo)."""
    t = t.contiguous()
    out = t.new_empty((sum(out_splits), *t.shape[1:]))
    _all_to_all(
        out, t, group, what, timeout_s,
        output_split_sizes=list(out_splits), input_split_sizes=list(in_splits),
    )  # fmt: skip
    return out


def _nvl_index(handle: DispatchHandle, combine: bool) -> tuple[torch.Tensor, ...]:
    """(send_row, send_off, recv_off) of the nvlink kernel, cached in the handle.

    Dispatch: the send list is ``send_src_idx`` grouped by destination (``send_off``, prefix
    sums of the send counts), the output grouped by source (``recv_off``). Combine sends the
    received rows in order (``send_row = arange``) and swaps the offsets. Built from the device
    offsets that ``dispatch`` leaves in the cache (key ``"off"``, built on the device from the
    exchanged counts before its host sync): no host-to-device copy. The combine's ``arange``
    is built at the first combine.
    """
    cache = handle._nvl_index
    key = "combine" if combine else "dispatch"
    if key not in cache:
        dev = handle.send_src_idx.device
        if "off" not in cache:  # a handle built elsewhere: a small host-to-device copy
            both = torch.tensor([handle.send_counts, handle.recv_counts], dtype=torch.int64)
            cache["off"] = _offsets(both.to(dev))
        send_off, recv_off = cache["off"][0], cache["off"][1]
        if combine:
            n = handle.num_recv_tokens
            cache["combine"] = (torch.arange(n, device=dev), recv_off, send_off)
        else:
            cache["dispatch"] = (handle.send_src_idx.contiguous(), send_off, recv_off)
    return cache[key]


def _offsets(counts: torch.Tensor) -> torch.Tensor:
    """``[2, R]`` send / receive counts -> ``[2, R + 1]`` offsets (``send_off``, ``recv_off``)."""
    return torch.nn.functional.pad(counts.cumsum(1), (1, 0))


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``[M, ...]`` -> ``[M, row bytes]`` uint8 view (contiguous)."""
    t = t.contiguous()
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _pack(parts: list[torch.Tensor], width: int, rows: torch.Tensor | None) -> torch.Tensor:
    """The rows of ``parts`` side by side as one ``[M, width]`` uint8 matrix (one message).

    ``rows`` (int64) selects and orders the rows (``None``: all). Bytes past the parts (padding
    to ``width``) are left uninitialized: they travel but are never read. One Triton launch on
    CUDA (:func:`ptxtrain.ep.layout.pack_rows`).
    """
    if len(parts) == 1 and _row_bytes(parts[0]) == width:  # nothing to pack: no copy
        v = _as_bytes(parts[0])
        if rows is not None:
            return v.index_select(0, rows)
        return v.clone() if v.data_ptr() % 16 else v  # the kernel loads 16-byte words
    return pack_rows(parts, width, rows)


def _unpack(rows: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack` on the moved ``[K, width]`` rows: ``[K, ...]`` per part
    (a view when one part fills the rows, else one Triton launch on CUDA)."""
    if len(parts) == 1 and _row_bytes(parts[0]) == rows.shape[1]:
        return [rows.view(parts[0].dtype).reshape(rows.shape[0], *parts[0].shape[1:])]
    return unpack_rows(rows, parts)


def _check_capacity(handle: DispatchHandle, padded: int) -> None:
    """Raises ValueError (on every rank alike) if rows of ``padded`` bytes overflow the nvlink
    buffer's region for one peer."""
    transport = handle.transport
    cap = transport.capacity_rows(padded)
    if handle.max_rows_per_pair > cap:
        raise ValueError(
            f"nvlink buffer too small: a rank sends {handle.max_rows_per_pair} rows of "
            f"{padded} bytes to one peer, the buffer holds {cap} per peer "
            f"(num_nvl_bytes={transport.num_nvl_bytes} over {transport.num_ranks} ranks); "
            f"create the Buffer with num_nvl_bytes >= "
            f"{handle.max_rows_per_pair * padded * transport.num_ranks}"
        )


def _nvl_row_bytes(width: int) -> int:
    """Bytes of one nvlink message row holding ``width`` bytes of parts (padded to 16)."""
    return max(16, ceil_div(width, 16) * 16)


def move_rows(
    parts: list[torch.Tensor],
    handle: DispatchHandle,
    combine: bool,
    packed: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Token rows ``[T, ...]`` -> received rows ``[N, ...]`` of every part (``combine``: the
    reverse, received rows -> sent rows ``[S, ...]``), in ONE message: the parts' rows are
    packed side by side into one byte matrix, moved by one ``all_to_all_single`` or one nvlink
    kernel launch, and unpacked (bit-exact, any dtypes). ``packed``: the nvlink message of
    ``parts`` already packed (``pack_rows(parts, _nvl_row_bytes(width), None)``; dispatch packs
    it before its host sync)."""
    width = sum(_row_bytes(p) for p in parts)
    transport = handle.transport
    if transport is None:
        send = _pack(parts, width, None if combine else handle.send_src_idx)
        splits = (handle.send_counts, handle.recv_counts)
        what = "Buffer.combine" if combine else "Buffer.dispatch"
        splits = splits[::-1] if combine else splits
        moved = _exchange(send, *splits, handle.group, what, handle.timeout_s)
        return _unpack(moved, parts)
    padded = _nvl_row_bytes(width)
    _check_capacity(handle, padded)
    send = _pack(parts, padded, None) if packed is None else packed
    num_out = sum(handle.send_counts) if combine else handle.num_recv_tokens
    moved = transport.exchange(send, *_nvl_index(handle, combine), num_out)  # [K, padded]
    return _unpack(moved, parts)


def _combine_sum(back: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Sent-order rows ``[S, ...]`` -> per-token sums ``[T, ...]`` (fp32/fp64 accumulation):
    one Triton launch over the handle's slot table where the layout kernel built one, else
    ``index_add`` (:mod:`ptxtrain.ep.layout`)."""
    if "slot" in handle._nvl_index and triton_usable(back):
        return combine_sum(back, handle._nvl_index["slot"][0])
    return torch_combine_sum(back, handle.send_src_idx, handle.num_tokens)


def dispatch_rows(t: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Token rows ``[T, ...]`` -> received rows ``[N, ...]`` (no gradient tracking)."""
    return move_rows([t], handle, combine=False)[0]


def _combine_rows(t: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Received rows ``[N, ...]`` -> per-token sums ``[T, ...]`` (fp32/fp64 accumulation).

    The nvlink backend's split kernel sums bf16 rows as they arrive (``combine_sum`` of
    :class:`ptxtrain.ep.nvlink.NvlinkTransport`: no copy-out of the received rows), with the
    same order and rounding as the copy-then-sum path it replaces."""
    transport = handle.transport
    fused = getattr(transport, "can_combine_sum", None)
    if fused is not None and "slot" in handle._nvl_index:
        t = t.contiguous()
        if fused(t):  # the same answer on every rank (see can_combine_sum)
            _check_capacity(handle, _row_bytes(t))
            send_row, send_off, recv_off = _nvl_index(handle, combine=True)
            slot = handle._nvl_index["slot"][0]
            return transport.combine_sum(t, send_row, send_off, recv_off, slot, handle.num_tokens)
    return _combine_sum(move_rows([t], handle, combine=True)[0], handle)


# A dispatch's signature, (hidden, num_experts, k, x code, topk_weights dtype) with x code the
# index in _X_DTYPES (len(_X_DTYPES): an FP8 pair), travels as two int64 columns of the count
# message: hidden, and the rest packed as ((E · 4096 + k) · 8 + x code) · 2 + weights code.
def _encode_signature(sig: tuple) -> tuple[int, int]:
    hidden, num_experts, k, x_code, w_dtype = sig
    return hidden, ((num_experts * 4096 + k) * 8 + x_code) * 2 + _W_DTYPES.index(w_dtype)


def _describe_signature(pair: tuple[int, int]) -> str:
    hidden, code = pair
    w_code, code = code % 2, code // 2
    x_code, code = code % 8, code // 8
    k, num_experts = code % 4096, code // 4096
    plausible = 0 < hidden < 2**31 and k > 0 and 0 < num_experts < 2**20
    if not (plausible and x_code <= len(_X_DTYPES)):
        # The count message holds 5 + num_experts / ranks columns (padded to one width for the
        # exchange): a peer with another num_experts has its signature in other columns, and
        # these two are its per-expert counts or the padding's zeros.
        return "a count message of another width (another num_experts)"
    x_name = "(float8_e4m3fn, sf)" if x_code == len(_X_DTYPES) else str(_X_DTYPES[x_code])
    w_name = str(_W_DTYPES[w_code]).removeprefix("torch.")
    return (
        f"hidden={hidden}, num_experts={num_experts}, k={k}, "
        f"x dtype {x_name.removeprefix('torch.')}, topk_weights dtype {w_name}"
    )


def _check_signatures(mine: tuple[int, int], peers: list[tuple[int, int]], rank: int) -> None:
    """Raises ValueError if a peer's encoded dispatch signature (received with the counts)
    differs from this rank's."""
    bad = [r for r, sig in enumerate(peers) if sig != mine]
    if bad:
        raise ValueError(
            "Buffer.dispatch: every rank must pass x, topk_idx and topk_weights of the same "
            f"hidden size, k and dtypes, and the same num_experts; rank {rank} has "
            f"{_describe_signature(mine)}, rank {bad[0]} has {_describe_signature(peers[bad[0]])}"
            " (raised on every rank)"
        )


class EventOverlap:
    """What ``dispatch`` / ``combine`` return with ``async_finish=True`` (DeepEP's name).

    Wraps the CUDA event recorded on the communication stream after the operation, or ``None``
    on CPU (then every method is a no-op: the work is already done).

    Source: DeepEP ``EventOverlap``.
    """

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self.event = event

    def current_stream_wait(self) -> None:
        """Makes the current CUDA stream wait for the communication (no host blocking)."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        """Blocks the host until the communication has finished."""
        if self.event is not None:
            self.event.synchronize()

    def is_complete(self) -> bool:
        """True when the communication has finished (always on CPU)."""
        return self.event is None or self.event.query()


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor in a (nested) tuple / list / DispatchHandle."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in _tensors(item)]
    if isinstance(obj, DispatchHandle):
        found = [obj.send_src_idx, obj.recv_src_rank, obj.recv_src_idx, obj.is_token_in_rank]
        cached = [(v,) if isinstance(v, torch.Tensor) else v for v in obj._nvl_index.values()]
        return found + [t for v in cached for t in v]
    return []


class _DispatchFn(torch.autograd.Function):
    """Differentiable dispatch of several token-row tensors in one message; backward = one
    combine of all the floating-point gradients (one message too)."""

    @staticmethod
    def forward(ctx, handle: DispatchHandle, packed: torch.Tensor | None, *parts: torch.Tensor):
        ctx.handle = handle
        ctx.set_materialize_grads(False)
        outs = move_rows(list(parts), handle, combine=False, packed=packed)
        ctx.outs = [(o.shape, o.dtype) for o in outs]
        ctx.device = parts[0].device
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        # Every floating-point input that needs a gradient is combined (a zero gradient where
        # the output was unused), so the message depends only on what requires grad: the same
        # on every rank.
        want = [
            i
            for i, (shape, dtype) in enumerate(ctx.outs)
            if ctx.needs_input_grad[i + 2] and dtype.is_floating_point
        ]
        result = [None] * len(grads)
        if want:
            gs = [
                grads[i].contiguous()
                if grads[i] is not None
                else torch.zeros(ctx.outs[i][0], dtype=ctx.outs[i][1], device=ctx.device)
                for i in want
            ]
            back = move_rows(gs, ctx.handle, combine=True)
            for i, b in zip(want, back, strict=True):
                result[i] = _combine_sum(b, ctx.handle)
        return None, None, *result


class _RecvTailFn(torch.autograd.Function):
    """:func:`ptxtrain.ep.layout.recv_tail` with the gate weights' gradient: it flows back to
    the received weights where the expert is local (``recv_topk_idx >= 0``), as through the
    ``torch.where`` of the twin."""

    @staticmethod
    def forward(ctx, recv_w, recv_global, recv_src, recv_off, rank: int, experts_per_rank: int):
        idx, w, src, src_rank = recv_tail(
            recv_w, recv_global, recv_src, recv_off, rank, experts_per_rank
        )
        ctx.save_for_backward(idx)
        ctx.mark_non_differentiable(idx, src, src_rank)
        return idx, w, src, src_rank

    @staticmethod
    def backward(ctx, _g_idx, g_w, _g_src, _g_rank):
        (idx,) = ctx.saved_tensors
        return torch.where(idx >= 0, g_w, 0.0), None, None, None, None, None


class _CombineFn(torch.autograd.Function):
    """Differentiable combine of received rows; backward = dispatch of the gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        ctx.handle = handle
        return _combine_rows(t, handle)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return dispatch_rows(grad, ctx.handle), None


def _check_x(x: object) -> tuple[int, torch.device]:
    """Validates dispatch's ``x`` (a ``[T, H]`` tensor or the FP8 pair); returns ``(T, device)``."""
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"x as a tuple must be (x_fp8, sf), got {len(x)} items")
        x_fp8, sf = x
        check_tensor("x[0] (x_fp8)", x_fp8, dtypes=(FP8_DTYPE,), ndim=2)
        check_tensor("x[1] (sf)", sf, dtypes=(torch.float32,), ndim=2)
        n_tokens, hidden = x_fp8.shape
        check_shape("x[1] (sf)", sf, (n_tokens, ceil_div(hidden, BLOCK)), "[T, ⌈H/128⌉]")
        if sf.device != x_fp8.device:
            raise ValueError(f"sf must be on x_fp8's device {x_fp8.device}, got {sf.device}")
        return n_tokens, x_fp8.device
    check_tensor("x", x, dtypes=_X_DTYPES, ndim=2)
    return x.shape[0], x.device


def _require_zero(name: str, value: object, why: str) -> None:
    """A DeepEP int argument whose feature ptxtrain lacks: TypeError unless an int,
    NotImplementedError unless 0 (the message names it and says ``why``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value:
        raise NotImplementedError(f"{name} must be 0 ({why}), got {value}")


def _check_deepep_only_args(num_rdma_bytes, low_latency_mode, num_qps_per_rank) -> None:
    """DeepEP constructor arguments for what ptxtrain does not have (RDMA, low-latency mode)."""
    _require_zero("num_rdma_bytes", num_rdma_bytes, "ptxtrain's Buffer is intranode only (no RDMA)")
    if not isinstance(low_latency_mode, bool):
        raise TypeError(f"low_latency_mode must be a bool, got {low_latency_mode!r}")
    if low_latency_mode:
        raise NotImplementedError(
            "low_latency_mode=True: ptxtrain's Buffer has no low-latency kernels "
            "(normal dispatch / combine only)"
        )
    check_positive_int("num_qps_per_rank", num_qps_per_rank)


def _check_dispatch_extras(num_tokens_per_rdma_rank, num_worst_tokens, expert_alignment) -> None:
    if num_tokens_per_rdma_rank is not None:
        raise NotImplementedError(
            "num_tokens_per_rdma_rank must be None: ptxtrain's Buffer is intranode only (no RDMA)"
        )
    _require_zero("num_worst_tokens", num_worst_tokens, "the outputs are sized by the counts")
    check_positive_int("expert_alignment", expert_alignment)


def _resolve_num_experts(num_experts: object, num_tokens_per_expert: object) -> int:
    """``E`` from the ``num_experts`` keyword or the length of ``num_tokens_per_expert``."""
    if num_tokens_per_expert is not None:
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, ndim=1)
        n = num_tokens_per_expert.shape[0]
        if num_experts is not None and num_experts != n:
            raise ValueError(
                f"num_experts={num_experts} disagrees with num_tokens_per_expert of length {n}"
            )
        return n
    if num_experts is None:
        raise ValueError(
            "dispatch needs the number of experts: num_tokens_per_expert (from "
            "get_dispatch_layout) or num_experts="
        )
    return num_experts


def _check_layout_shapes(num_tokens_per_rank, is_token_in_rank, topk_idx, num_ranks) -> None:
    if num_tokens_per_rank is not None:
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, ndim=1)
        check_shape("num_tokens_per_rank", num_tokens_per_rank, (num_ranks,), "[R]")
    if is_token_in_rank is not None:
        check_tensor("is_token_in_rank", is_token_in_rank, dtypes=(torch.bool,), ndim=2)
        want = (topk_idx.shape[0], num_ranks)
        check_shape("is_token_in_rank", is_token_in_rank, want, "[T, R]")


def _align(counts: list[int], alignment: int) -> list[int]:
    """Counts rounded up to a multiple of ``alignment`` (DeepEP's ``expert_alignment``)."""
    return counts if alignment == 1 else [ceil_div(c, alignment) * alignment for c in counts]


def _check_bias(bias, x: torch.Tensor, handle: DispatchHandle) -> tuple[torch.Tensor, ...]:
    """combine's ``bias``: None, a tensor or a tuple of up to two, each ``[T, H]`` in ``x``'s
    dtype on its device; returned as a tuple."""
    biases = () if bias is None else tuple(bias) if isinstance(bias, (tuple, list)) else (bias,)
    if len(biases) > 2:
        raise ValueError(f"bias must be a tensor or a tuple of at most two, got {len(biases)}")
    for i, b in enumerate(biases):
        name = f"bias[{i}]" if isinstance(bias, (tuple, list)) else "bias"
        check_tensor(name, b, dtypes=(x.dtype,), ndim=2)
        check_shape(name, b, (handle.num_tokens, handle.hidden), "[T, H]")
        if b.device != x.device:
            raise ValueError(f"{name} must be on x's device {x.device}, got {b.device}")
    return biases


def _nvlink_transport(group, config: Config, num_nvl_bytes: int, aggressive_ptx: bool,
                      timeout_s: float):  # fmt: skip
    """The :class:`ptxtrain.ep.nvlink.NvlinkTransport` of an ``"nvlink"`` Buffer."""
    if not torch.cuda.is_available():
        raise ValueError("backend='nvlink' needs CUDA GPUs; use backend='all_to_all'")
    n_sm = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if config.num_sms > n_sm:
        raise ValueError(f"config.num_sms must be <= the device's {n_sm} SMs, got {config.num_sms}")
    from ptxtrain.ep.nvlink import NvlinkTransport

    return NvlinkTransport(
        group,
        config.num_sms,
        num_nvl_bytes,
        aggressive_ptx=aggressive_ptx,
        timeout_s=timeout_s,
        threads=config.nvl_threads,
        unroll=config.nvl_unroll,
        pipeline=config.nvl_pipeline,
        send_sms=config.nvl_send_sms,
        round_rows=config.nvl_round_rows,
    )


class Buffer:
    """Expert-parallel communication buffer for one process group (DeepEP's ``Buffer`` shape).

    Args:
        group: the expert-parallel process group; ``None`` uses the default group, which must be
            initialized (``torch.distributed.init_process_group``).
        num_nvl_bytes: bytes of each rank's nvlink receive buffer (default 1 GiB; unused by
            ``"all_to_all"``). A dispatch or combine whose rows from one rank to another exceed
            ``num_nvl_bytes / (R · row bytes)`` raises ValueError on every rank;
            :meth:`nvl_bytes_hint` sizes it.
        num_rdma_bytes: must be 0: ptxtrain's Buffer is intranode (no RDMA).
        low_latency_mode: must be False: there are no low-latency kernels.
        num_qps_per_rank: RDMA queue pairs in DeepEP; validated (a positive int), unused.

    Keyword-only (ptxtrain's own):
        backend: ``"all_to_all"`` — ``torch.distributed.all_to_all_single`` (NCCL on GPUs, gloo
            on CPU; any world size); ``"nvlink"`` — payload rows moved by a JIT kernel through
            PyTorch symmetric memory (NCCL group of the GPUs of one node, one GPU per rank, the
            current CUDA device being this rank's; :mod:`ptxtrain.ep.nvlink`).
        config: the kernels' :class:`~ptxtrain.ep.Config` (default
            :meth:`get_dispatch_config`); the nvlink kernel is compiled for it here, so a
            ``dispatch`` / ``combine`` may only pass this same config.
        aggressive_ptx: compile the nvlink kernel with ``PTXTRAIN_AGGRESSIVE_PTX`` (DeepEP's
            ``ld.global.nc.L1::no_allocate.L2::256B`` loads of peer-written data; default off).
        timeout_s: bound on every flag wait of the nvlink kernel, and on a gloo group on each
            ``all_to_all_single`` of a dispatch / combine (then RuntimeError naming the call, no
            hang). NCCL exchanges keep the group's timeout and NCCL's watchdog.

    Every rank of the group must construct the buffer with the same arguments and call
    ``dispatch`` / ``combine`` (and their backward passes) in the same order, as with any
    collective.

    Raises:
        TypeError: ``num_nvl_bytes`` / ``num_rdma_bytes`` / ``num_qps_per_rank`` not ints,
            ``low_latency_mode`` not a bool, ``config`` not a Config, ``timeout_s`` not a number.
        ValueError: unknown ``backend``, a non-positive ``num_nvl_bytes`` / ``num_qps_per_rank``
            / ``timeout_s``, ``config.num_sms`` above the device's SM count, ``"nvlink"``
            without CUDA, or the default group is not initialized.
        NotImplementedError: ``num_rdma_bytes > 0`` or ``low_latency_mode=True``.

    Source: DeepEP V1 ``Buffer``; docs/design.md §4.
    """

    #: SMs of the default config (:meth:`set_num_sms`, :meth:`get_dispatch_config`).
    num_sms: int = 24

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        num_nvl_bytes: int = DEFAULT_NVL_BYTES,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        *,
        backend: str = "all_to_all",
        config: Config | None = None,
        aggressive_ptx: bool = False,
        timeout_s: float = 30.0,
    ):
        _check_deepep_only_args(num_rdma_bytes, low_latency_mode, num_qps_per_rank)
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        check_positive_int("num_nvl_bytes", num_nvl_bytes)
        if config is None:
            config = self.get_dispatch_config(1)
        if not isinstance(config, Config):
            raise TypeError(f"config must be a ptxtrain.ep.Config, got {type(config).__name__}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "Buffer needs an initialized torch.distributed process group "
                "(call torch.distributed.init_process_group first)"
            )
        self.timeout_s = float(timeout_s)
        self.group = group
        self.backend = backend
        self.config = config
        self.num_sms = config.num_sms
        self.num_nvl_bytes = num_nvl_bytes
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self._transport = None
        self._comm_stream: torch.cuda.Stream | None = None
        if backend == "nvlink":
            self._transport = _nvlink_transport(group, config, num_nvl_bytes, aggressive_ptx,
                                                timeout_s)  # fmt: skip

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Sets the SMs of the default :class:`~ptxtrain.ep.Config` of buffers built afterwards
        (DeepEP's ``Buffer.set_num_sms``). Raises TypeError / ValueError unless a positive int."""
        Buffer.num_sms = check_positive_int("new_num_sms", new_num_sms)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        """The default :class:`~ptxtrain.ep.Config` for ``num_ranks`` ranks: ``Buffer.num_sms``
        SMs and the nvlink kernel's default knobs (measured best at EP2 / EP4 on H200s; one
        config serves every group size). Raises TypeError / ValueError unless ``num_ranks`` is
        a positive int."""
        check_positive_int("num_ranks", num_ranks)
        return Config(Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        """As :meth:`get_dispatch_config`: the nvlink buffer is built for one config, and its
        combine derives its own launch shape from it (see :mod:`ptxtrain.ep.nvlink`)."""
        return Buffer.get_dispatch_config(num_ranks)

    @staticmethod
    def nvl_bytes_hint(num_max_tokens: int, row_bytes: int, num_ranks: int) -> int:
        """``num_nvl_bytes`` for up to ``num_max_tokens`` rows of ``row_bytes`` from each rank.

        ``row_bytes`` is the largest message row: ``2·H`` for BF16 combine, ``4·H`` for float32;
        a dispatch row also carries the weights, ``topk_idx`` and the token index: ``x``'s row
        bytes + ``12·k + 8`` (fp32 weights; ``16·k + 8`` for fp64), e.g. ``H + 4·⌈H/128⌉ +
        12·k + 8`` for FP8.
        """
        check_positive_int("num_max_tokens", num_max_tokens)
        check_positive_int("row_bytes", row_bytes)
        check_positive_int("num_ranks", num_ranks)
        return num_max_tokens * max(16, ceil_div(row_bytes, 16) * 16) * num_ranks

    def check_errors(self) -> None:
        """Waits for the last nvlink kernel and raises RuntimeError if it timed out (no-op for
        ``"all_to_all"``).

        A kernel whose flag wait timed out (a peer failed or stalled past ``timeout_s``) still
        finishes, with wrong rows in its output; the error is raised by the next operation or
        here. Call it before the results of the last operation are used for anything lasting:
        ``ptxtrain train`` does before every optimizer step. The nvlink kernels also refuse CUDA
        graph capture (RuntimeError): a replay would repeat their sequence numbers."""
        if self._transport is not None:
            self._transport.check_errors(synchronize=True)

    # ------------------------------------------------------------------ validation
    def _check_dispatch_args(self, x, topk_idx, topk_weights, num_experts):
        _check_experts(num_experts, self.num_ranks)
        if num_experts // self.num_ranks > _MAX_EXPERTS_PER_RANK:
            raise ValueError(
                f"num_experts must be at most {_MAX_EXPERTS_PER_RANK} per rank (the count "
                f"message's width) x {self.num_ranks} ranks, got {num_experts}"
            )
        n_tokens, device = _check_x(x)
        # The id range is checked on the device and reported with the count exchange (no sync).
        check_tensor("topk_idx", topk_idx, dtypes=(torch.int64,), ndim=2)
        if topk_idx.shape[0] != n_tokens:
            raise ValueError(
                f"topk_idx must be [T={n_tokens}, k] like x, got {tuple(topk_idx.shape)}"
            )
        check_tensor("topk_weights", topk_weights, dtypes=_W_DTYPES, ndim=2)
        check_shape("topk_weights", topk_weights, tuple(topk_idx.shape), "like topk_idx")
        for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
            if t.device != device:
                raise ValueError(f"{name} must be on x's device {device}, got {t.device}")
        self._check_device(device)

    def _check_device(self, device: torch.device) -> None:
        if self._transport is not None and device != self._transport.device:
            raise ValueError(
                f"x must be on the nvlink buffer's device {self._transport.device}, got {device}"
            )

    def _check_handle(self, handle: object) -> DispatchHandle:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        if handle.num_ranks != self.num_ranks or handle.rank != self.rank:
            raise ValueError(
                f"handle was made on rank {handle.rank} of {handle.num_ranks}, this buffer is "
                f"rank {self.rank} of {self.num_ranks}"
            )
        if handle.transport is not self._transport:
            raise ValueError("handle was made by another Buffer (different transport)")
        return handle

    def _check_options(self, config, previous_event, async_finish, allocate_on_comm_stream):
        """The stream / config arguments shared by dispatch, combine and get_dispatch_layout."""
        if config is not None and config != self.config:
            raise ValueError(
                f"config must be None or the Buffer's own config {self.config} (the nvlink "
                f"kernel is built for it at construction), got {config!r}; pass other knobs "
                "to Buffer(..., config=...)"
            )
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            got = type(previous_event).__name__
            raise TypeError(f"previous_event must be an EventOverlap or None, got {got}")
        for name, flag in (("async_finish", async_finish), ("allocate_on_comm_stream",
                                                             allocate_on_comm_stream)):  # fmt: skip
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        if allocate_on_comm_stream and not async_finish:
            raise ValueError("allocate_on_comm_stream=True needs async_finish=True (as in DeepEP)")

    # ------------------------------------------------------------------ public API
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple:
        """:func:`get_dispatch_layout` over this buffer's group size, in DeepEP's shape.

        Returns:
            ``(num_tokens_per_rank [R] int64, num_tokens_per_rdma_rank (always None: no RDMA),
            num_tokens_per_expert [E] int64, is_token_in_rank [T, R] bool, event)``, ``event``
            an :class:`EventOverlap` (already complete unless ``async_finish``).

        Raises: as :func:`get_dispatch_layout`; the stream arguments as :meth:`dispatch`.
        """
        self._check_options(None, previous_event, async_finish, allocate_on_comm_stream)

        def run():
            per_rank, per_expert, in_rank = get_dispatch_layout(topk_idx, num_experts,
                                                                self.num_ranks)  # fmt: skip
            return per_rank, None, per_expert, in_rank

        return self._run(run, [topk_idx], previous_event, async_finish)

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        handle: DispatchHandle | None = None,
        num_tokens_per_rank: torch.Tensor | None = None,
        num_tokens_per_rdma_rank: torch.Tensor | None = None,
        is_token_in_rank: torch.Tensor | None = None,
        num_tokens_per_expert: torch.Tensor | None = None,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        *,
        num_experts: int | None = None,
    ) -> tuple:
        """Send every token once to each rank holding at least one of its experts.

        Args:
            x: ``[T, H]`` bfloat16 / float32 / float16 / float64 tokens, or the FP8 pair
                ``(x_fp8 [T, H] float8_e4m3fn, sf [T, ⌈H/128⌉] float32)`` from
                :func:`ptxtrain.quant.ref.per_token_cast_to_fp8` (sent bit-exact). ``T`` may be 0.
            handle: ``None``, or the handle of an earlier dispatch to send ``x`` with the same
                layout again (DeepEP's cached dispatch; then give no ``topk_*`` / layout
                tensors; high-precision ``x`` only is differentiable, as below).
            num_tokens_per_rank / is_token_in_rank / num_tokens_per_expert: the layout from
                :meth:`get_dispatch_layout`, accepted for DeepEP's call shape. The dispatch
                builds the layout from ``topk_idx`` in the same launch as its count message
                (no extra launch), so only their shapes are checked (``[R]``, ``[T, R]``,
                ``[E]``) and ``num_tokens_per_expert`` gives ``E``.
            num_tokens_per_rdma_rank: must be None (no RDMA).
            topk_idx: ``[T, k]`` int64 global expert ids in ``[0, E)``, or ``-1`` (no expert).
            topk_weights: ``[T, k]`` float32 / float64 gate weights (required with ``topk_idx``:
                they travel with the rows).
            expert_alignment: ``num_recv_tokens_per_expert_list`` is rounded up to a multiple
                of it (a positive int; 1: exact counts).
            num_worst_tokens: must be 0 (outputs are sized by the exchanged counts).
            config: None or this buffer's :attr:`config`.
            previous_event: an :class:`EventOverlap` the communication waits for first.
            async_finish: run on a side CUDA stream (after waiting for the current one);
                wait on the returned event before using the outputs on the current stream.
            allocate_on_comm_stream: needs ``async_finish``; the outputs of an async call are
                always allocated on the side stream and ``record_stream``-ed for the current
                one, so both values behave the same.
            num_experts: ``E`` (keyword; ptxtrain's): instead of ``num_tokens_per_expert``,
                which saves the layout launches; a multiple of the group size.

        Returns:
            Always six items: ``recv_x``: ``[N, H]`` in ``x``'s dtype (or the pair
            ``(recv_x_fp8 [N, H], recv_sf [N, ⌈H/128⌉])``), ordered by source rank, then
            source token index; ``recv_topk_idx [N, k]`` int64 local expert ids (``global -
            rank·E/R``), ``-1`` where the expert is on another rank or was ``-1``;
            ``recv_topk_weights [N, k]`` in ``topk_weights``' dtype, 0 where ``recv_topk_idx``
            is ``-1``; ``num_recv_tokens_per_expert_list``: ``E/R`` ints, the rows each local
            expert gets (aligned up to ``expert_alignment``); ``handle``: the
            :class:`DispatchHandle` for :meth:`combine`; ``event``: an :class:`EventOverlap`
            (complete unless ``async_finish``). A cached dispatch returns ``(recv_x, None,
            None, [], handle, event)``.

            Differentiable with respect to ``x`` (high-precision path) and ``topk_weights``:
            the backward combines the gradients back to the source tokens (collective: every
            rank must run its backward).

        Raises:
            TypeError: a wrong dtype or a non-tensor argument (the message names it).
            ValueError: wrong shapes, missing ``topk_idx`` / ``topk_weights`` / ``E``, ids
                outside ``[-1, E)``, ``E`` not a multiple of the group size or above 1024
                experts per rank (the count message's width), tensors on different devices (or
                not on the nvlink buffer's GPU), another ``config``: raised before any
                communication, except ids outside ``[-1, E)`` (any rank's) and ranks
                disagreeing on the hidden size, ``k``, the dtypes of ``x`` / ``topk_weights``
                or ``E``, raised on every rank after the count exchange, before the payload
                moves. ``"nvlink"``: rows from one rank to another over the buffer's capacity
                (raised on every rank, after the count exchange).
            NotImplementedError: ``num_tokens_per_rdma_rank`` given or ``num_worst_tokens > 0``.
            RuntimeError: ``"nvlink"``: an earlier kernel timed out waiting for a peer.

        Source: DeepEP ``Buffer.dispatch``; docs/design.md §4.
        """
        self._check_options(config, previous_event, async_finish, allocate_on_comm_stream)
        _check_dispatch_extras(num_tokens_per_rdma_rank, num_worst_tokens, expert_alignment)
        if handle is not None:
            if not isinstance(handle, DispatchHandle):
                raise TypeError(
                    f"handle must be a DispatchHandle or None, got {type(handle).__name__} "
                    "(dispatch's second positional argument is handle, as in DeepEP; pass "
                    "topk_idx= and topk_weights= by keyword)"
                )
            layout = (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert)
            if any(t is not None for t in (*layout, topk_idx, topk_weights)):
                raise ValueError(
                    "a cached dispatch (handle given) takes no topk_idx / topk_weights / layout "
                    "tensors: the handle holds the layout"
                )
            return self._cached_dispatch(x, handle, previous_event, async_finish)
        if topk_idx is None or topk_weights is None:
            raise ValueError("dispatch needs topk_idx and topk_weights (or a handle)")
        num_experts = _resolve_num_experts(num_experts, num_tokens_per_expert)
        self._check_dispatch_args(x, topk_idx, topk_weights, num_experts)
        _check_layout_shapes(num_tokens_per_rank, is_token_in_rank, topk_idx, self.num_ranks)

        def run():
            out = self._dispatch(x, topk_idx, topk_weights, num_experts)
            return (*out[:3], _align(out[3], expert_alignment), out[4])

        return self._run(run, [*_tensors(x), topk_idx, topk_weights], previous_event,
                         async_finish)  # fmt: skip

    def _cached_dispatch(self, x, handle, previous_event, async_finish) -> tuple:
        """``x`` sent with an earlier dispatch's layout (:meth:`dispatch` with ``handle``)."""
        handle = self._check_handle(handle)
        n_tokens, device = _check_x(x)
        self._check_device(device)
        hidden = (x[0] if isinstance(x, (tuple, list)) else x).shape[1]
        if n_tokens != handle.num_tokens or hidden != handle.hidden:
            raise ValueError(
                f"x must be [T={handle.num_tokens}, H={handle.hidden}] like the handle's "
                f"dispatch, got [{n_tokens}, {hidden}]"
            )

        def run():
            if isinstance(x, (tuple, list)):
                rx, rsf = _DispatchFn.apply(handle, None, x[0].view(torch.uint8), x[1].detach())
                return (rx.view(FP8_DTYPE), rsf), None, None, [], handle
            return _DispatchFn.apply(handle, None, x)[0], None, None, [], handle

        return self._run(run, [*_tensors(x), *_tensors(handle)], previous_event, async_finish)

    def _dispatch(self, x, topk_idx, topk_weights, num_experts):
        fp8 = isinstance(x, (tuple, list))
        x_code = len(_X_DTYPES) if fp8 else _X_DTYPES.index(x.dtype)
        hidden = (x[0] if fp8 else x).shape[1]
        signature = (hidden, num_experts, topk_idx.shape[1], x_code, topk_weights.dtype)
        tokens = torch.arange(topk_idx.shape[0], dtype=torch.int64, device=topk_idx.device)
        meta = [topk_weights, topk_idx, tokens.unsqueeze(1)]  # travel with the payload rows
        # ONE message per dispatch: payload + weights + topk_idx + source index, packed per row.
        # FP8 rows are bytes (as before, no gradient flows to the pair; weights still get one).
        head = [x[0].view(torch.uint8), x[1].detach()] if fp8 else [x]
        parts = [*head, *meta]
        handle, num_recv_tokens_per_expert, packed = self._make_handle(
            topk_idx, num_experts, signature, parts
        )
        outs = _DispatchFn.apply(handle, packed, *parts)
        recv_w, recv_global, recv_src = outs[-3:]
        recv_x = (outs[0].view(FP8_DTYPE), outs[1]) if fp8 else outs[0]
        # One launch on CUDA (ptxtrain.ep.layout.recv_tail): local ids and weights, the source
        # token index and source rank of every received row.
        recv_topk_idx, recv_topk_weights, recv_src_idx, recv_src_rank = _RecvTailFn.apply(
            recv_w, recv_global, recv_src, handle._nvl_index["off"][1], self.rank,
            num_experts // self.num_ranks,
        )  # fmt: skip
        handle = replace(handle, recv_src_rank=recv_src_rank, recv_src_idx=recv_src_idx)
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert, handle

    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: torch.Tensor | None = None,
        bias: torch.Tensor | tuple[torch.Tensor, ...] | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> tuple:
        """Send every received row back to its source token and sum the contributions.

        A plain sum (the caller applies the gate weights, as in DeepEP): ``combined_x[t] =
        Σ_{rows n of token t} x[n]`` over the ranks token ``t`` was dispatched to; a token sent
        nowhere gets zeros. Accumulated in fp32 (fp64 for fp64 input), returned in ``x``'s dtype.

        Args:
            x: ``[N, H]`` bfloat16 / float32 / float16 / float64, rows in the receive order of
                ``handle`` (``N = handle.num_recv_tokens``).
            handle: the :class:`DispatchHandle` returned by this buffer's :meth:`dispatch`.
            topk_weights: optional ``[N, k]`` float32 / float64 rows, summed back the same way
                (one more message), e.g. the received gate weights.
            bias: optional ``[T, H]`` tensor in ``x``'s dtype, or a tuple of up to two, added
                to ``combined_x`` (after its sum is rounded to ``x``'s dtype).
            config / previous_event / async_finish / allocate_on_comm_stream: as
                :meth:`dispatch`.

        Returns:
            Always three items: ``combined_x [T, H]`` in ``x``'s dtype,
            ``combined_topk_weights [T, k]`` (None without ``topk_weights``) and an
            :class:`EventOverlap` (complete unless ``async_finish``). Differentiable: the
            backward dispatches the gradient with the handle (collective).

        Raises:
            TypeError: ``x`` / ``topk_weights`` / ``bias`` has a wrong dtype or ``handle`` is
                not a :class:`DispatchHandle`.
            ValueError: ``x`` is not ``[N, H]`` with the dispatch's ``H`` (rows of another
                width would be cut short or misread by the peers; the dispatch checked that
                every rank has the same ``H``), ``topk_weights`` not ``[N, k]`` / ``bias`` not
                ``[T, H]``, the handle belongs to another group size or another buffer's
                backend, another ``config``, or (``"nvlink"``) rows over the buffer's capacity.
                Every rank must pass ``x`` of the same dtype and the same optional arguments
                (not checked: that would cost a message).
            RuntimeError: ``"nvlink"``: an earlier kernel timed out waiting for a peer.

        Source: DeepEP ``Buffer.combine``; docs/design.md §4.
        """
        self._check_options(config, previous_event, async_finish, allocate_on_comm_stream)
        handle = self._check_handle(handle)
        check_tensor("x", x, dtypes=_X_DTYPES, ndim=2)
        if x.shape[0] != handle.num_recv_tokens:
            raise ValueError(
                f"x must have handle.num_recv_tokens={handle.num_recv_tokens} rows, "
                f"got shape {tuple(x.shape)}"
            )
        if x.shape[1] != handle.hidden:
            raise ValueError(
                f"x must have the dispatched rows' hidden size {handle.hidden} (the same on every "
                f"rank), got shape {tuple(x.shape)}"
            )
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, dtypes=_W_DTYPES, ndim=2)
            if topk_weights.shape[0] != x.shape[0]:
                raise ValueError(
                    f"topk_weights must be [N={x.shape[0]}, k], got {tuple(topk_weights.shape)}"
                )
        biases = _check_bias(bias, x, handle)

        def run():
            out = _CombineFn.apply(x, handle)
            for b in biases:
                out = out + b
            w = None if topk_weights is None else _CombineFn.apply(topk_weights, handle)
            return out, w

        if not async_finish:
            return self._run(run, [x], previous_event, False)
        # The handle's index tensors are read on the side stream too: kept from reuse until it
        # is done, even if the caller drops the handle (no autograd context holds it then).
        if handle.transport is not None:
            _nvl_index(handle, combine=True)  # cached on this stream, recorded on the side one
        inputs = [x, *_tensors(handle), *_tensors(topk_weights), *biases]
        return self._run(run, inputs, previous_event, True)

    def _run(
        self,
        fn: Callable[[], tuple],
        inputs: list[torch.Tensor],
        previous_event: EventOverlap | None,
        async_finish: bool,
    ) -> tuple:
        """``fn()``'s results plus an :class:`EventOverlap`: on the current stream, or with
        ``async_finish`` on the side stream (after the current stream and ``previous_event``)."""
        device = inputs[0].device
        if not async_finish or device.type != "cuda":
            if previous_event is not None:
                previous_event.current_stream_wait()
            return (*fn(), EventOverlap(None))
        compute = torch.cuda.current_stream(device)
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=device)
        comm = self._comm_stream
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            if previous_event is not None:
                previous_event.current_stream_wait()
            out = fn()
            event = torch.cuda.Event()
            event.record(comm)
        for t in inputs:  # freed by the caller: not reused before the side stream is done
            if t.device.type == "cuda":
                t.record_stream(comm)
        for t in _tensors(out):  # allocated on the side stream, used on the current one
            if t.device.type == "cuda":
                t.record_stream(compute)
        return (*out, EventOverlap(event))

    # ------------------------------------------------------------------ internals
    def _make_handle(
        self, topk_idx: torch.Tensor, num_experts: int, signature: tuple, parts: list
    ) -> tuple[DispatchHandle, list[int], torch.Tensor | None]:
        """Layout + the one count exchange + the one host sync of a dispatch.

        Row ``r`` of the count message goes to rank ``r``: (rows for ``r``, this rank's largest
        count, this rank's number of ids outside ``[-1, E)``, the tokens for each of ``r``'s
        experts). So every rank learns its receive counts, the largest count between any two
        ranks (the nvlink capacity check agrees everywhere), whether any rank's ids are invalid
        (every rank raises alike) and its per-expert receive counts, in one small
        ``all_to_all_single`` and one device-to-host copy. The send order is built on the
        device meanwhile. Two more columns carry the call's ``signature`` (hidden size, ``E``,
        ``k``, the dtypes of ``x`` and the weights): payload rows of another size or dtype
        would be cut short or misread by the peers, so a rank whose signature differs from a
        peer's raises ValueError (every rank does, as some peer differs from each). Returns
        the handle (its ``recv_src_rank`` / ``recv_src_idx`` still empty: the second travels
        with the payload), ``num_recv_tokens_per_expert`` and, for the nvlink backend, the
        payload message of ``parts`` (None otherwise).

        Everything that needs no host-side count is queued before the host sync: the send /
        receive offsets (kept in the handle's cache as ``"off"``) and, for nvlink, the packing
        of the payload rows (all ``T`` rows in token order; the kernel picks the sent ones). The
        sync then also waits for them, but after it the host has fewer launches to make while
        the GPU waits for each; behind queued work (a training step) their launches cost the
        host nothing the GPU waits for.
        """
        n_ranks, group = self.num_ranks, self.group
        n_tokens = topk_idx.shape[0]
        experts_per_rank = num_experts // n_ranks
        # Triton kernels on CUDA: is_token_in_rank, the count message (counts[0], the call's
        # signature in its last two columns), the send order and the slot table; counts[1]
        # receives the exchange, so ONE copy to the host carries both sides.
        sig = _encode_signature(signature)
        in_rank, counts, order, slot = send_layout(topk_idx, num_experts, n_ranks, extra=sig)
        # Padded with zeros to one width on every rank whatever its num_experts (one launch),
        # read back at this rank's width: a peer whose E differs has its signature elsewhere, so
        # the signature check below raises on every rank.
        width = counts.shape[-1]
        counts = torch.nn.functional.pad(counts, (0, 5 + _MAX_EXPERTS_PER_RANK - width))
        _all_to_all(counts[1], counts[0], group, "Buffer.dispatch", self.timeout_s)
        off = _offsets(counts[:, :, 0])  # [2, R + 1]: send_off, recv_off
        packed = None
        if self._transport is not None:
            row_bytes = _nvl_row_bytes(sum(_row_bytes(p) for p in parts))
            packed = _pack(parts, row_bytes, None)
        sent, rows = counts[:, :, :width].tolist()  # the one host sync
        _check_signatures(sig, [tuple(row[-2:]) for row in rows], self.rank)

        bad = [s for s, row in enumerate(rows) if row[2]]
        if bad:
            if self.rank in bad:
                lo, hi = int(topk_idx.min()), int(topk_idx.max())
                got = f"got values in [{lo}, {hi}]"
            else:
                got = f"rank(s) {bad} passed others (raised on every rank)"
            raise ValueError(
                f"topk_idx must hold expert ids in [0, num_experts={num_experts}) or -1, {got}"
            )
        send_counts = tuple(row[0] for row in sent)
        recv_counts = tuple(row[0] for row in rows)
        max_rows_per_pair = max(row[1] for row in rows)
        # column sums over the sources (zip: one pass, no per-element indexing)
        per_source = [row[3 : 3 + experts_per_rank] for row in rows]
        num_recv_tokens_per_expert = [sum(col) for col in zip(*per_source, strict=True)]
        cache = {"off": off}
        if slot is not None:
            cache["slot"] = (slot,)
        handle = DispatchHandle(
            rank=self.rank,
            num_ranks=n_ranks,
            num_experts=num_experts,
            num_tokens=n_tokens,
            send_counts=send_counts,
            recv_counts=recv_counts,
            send_src_idx=order[: sum(send_counts)],
            recv_src_rank=off.new_empty(0),
            recv_src_idx=off.new_empty(0),
            is_token_in_rank=in_rank,
            group=group,
            hidden=signature[0],
            timeout_s=self.timeout_s,
            max_rows_per_pair=max_rows_per_pair,
            transport=self._transport,
            _nvl_index=cache,
        )
        return handle, num_recv_tokens_per_expert, packed
