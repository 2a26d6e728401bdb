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
stream) and return an :class:`EventOverlap` as an extra last result; call its
``current_stream_wait()`` before using the outputs on the current stream. Inputs are
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
from ptxtrain.ep.layout import (
    combine_sum,
    pack_rows,
    recv_tail,
    send_layout,
    torch_combine_sum,
    triton_usable,
    unpack_rows,
)
from ptxtrain.ep.nvlink import DEFAULT_PIPELINE, DEFAULT_SEND_SMS
from ptxtrain.quant.ref import BLOCK, FP8_DTYPE

__all__ = ["Buffer", "DispatchHandle", "EventOverlap", "get_dispatch_layout"]

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


def _move(
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


def _dispatch_rows(t: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Token rows ``[T, ...]`` -> received rows ``[N, ...]`` (no gradient tracking)."""
    return _move([t], handle, combine=False)[0]


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
    return _combine_sum(_move([t], handle, combine=True)[0], handle)


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
        outs = _move(list(parts), handle, combine=False, packed=packed)
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
            back = _move(gs, ctx.handle, combine=True)
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
        return _dispatch_rows(grad, ctx.handle), None


class Buffer:
    """Expert-parallel communication buffer for one process group (DeepEP's ``Buffer`` shape).

    Args:
        group: the expert-parallel process group; ``None`` uses the default group, which must be
            initialized (``torch.distributed.init_process_group``).
        backend: ``"all_to_all"`` — ``torch.distributed.all_to_all_single`` (NCCL on GPUs, gloo
            on CPU; any world size); ``"nvlink"`` — payload rows moved by a JIT kernel through
            PyTorch symmetric memory (NCCL group of the GPUs of one node, one GPU per rank, the
            current CUDA device being this rank's; :mod:`ptxtrain.ep.nvlink`).
        num_sms: thread blocks (one per SM) of the nvlink kernel, at most the device's SM count
            (ignored by ``"all_to_all"``, still validated). DeepEP's README uses 24.
        num_nvl_bytes: bytes of each rank's nvlink receive buffer (default 1 GiB). A dispatch or
            combine whose rows from one rank to another exceed ``num_nvl_bytes / (R · row
            bytes)`` raises ValueError on every rank; :meth:`nvl_bytes_hint` sizes it.
        aggressive_ptx: compile the nvlink kernel with ``PTXTRAIN_AGGRESSIVE_PTX`` (DeepEP's
            ``ld.global.nc.L1::no_allocate.L2::256B`` loads of peer-written data; default off).
        timeout_s: bound on every flag wait of the nvlink kernel, and on a gloo group on each
            ``all_to_all_single`` of a dispatch / combine (then RuntimeError naming the call, no
            hang). NCCL exchanges keep the group's timeout and NCCL's watchdog.
        nvl_threads / nvl_unroll / nvl_pipeline: the nvlink kernel's tuning knobs, threads per
            block (a multiple of 32, at most 1024), 16-byte loads in flight per lane (1, 2, 4 or
            8) and the per-block-flag pipelined variant (bool, default on); validated for every
            backend, used by ``"nvlink"`` (:func:`ptxtrain.ep.nvlink.compile_kernel`).
        nvl_send_sms: the split variant's sender SMs out of ``num_sms`` (the rest copy out;
            default ``None``: half, or no split with ``nvl_pipeline=False``; 0: no split,
            ``nvl_pipeline`` picks the variant;
            :class:`ptxtrain.ep.nvlink.NvlinkTransport`).

    Every rank of the group must construct the buffer with the same arguments and call
    ``dispatch`` / ``combine`` (and their backward passes) in the same order, as with any
    collective.

    Raises:
        TypeError: ``num_sms`` / ``num_nvl_bytes`` / ``nvl_threads`` / ``nvl_unroll`` not ints,
            ``nvl_pipeline`` not a bool, ``timeout_s`` not a number.
        ValueError: unknown ``backend``, a non-positive ``num_sms`` / ``num_nvl_bytes`` /
            ``timeout_s``, bad ``nvl_threads`` / ``nvl_unroll``, ``num_sms`` above the
            device's SM count, ``"nvlink"`` without CUDA, or the default group is not
            initialized.

    Source: DeepEP V1 ``Buffer``; docs/design.md §4.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        backend: str = "all_to_all",
        num_sms: int = 24,
        num_nvl_bytes: int = DEFAULT_NVL_BYTES,
        *,
        aggressive_ptx: bool = False,
        timeout_s: float = 30.0,
        nvl_threads: int = 1024,
        nvl_unroll: int = 4,
        nvl_pipeline: bool = DEFAULT_PIPELINE,
        nvl_send_sms: int | None = DEFAULT_SEND_SMS,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        check_positive_int("num_sms", num_sms)
        check_positive_int("num_nvl_bytes", num_nvl_bytes)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise TypeError(f"timeout_s must be a number of seconds, got {timeout_s!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        from ptxtrain.ep.nvlink import check_knobs, check_send_sms

        check_knobs(nvl_threads, nvl_unroll)
        check_send_sms(nvl_send_sms, num_sms)
        if not isinstance(nvl_pipeline, bool):
            raise TypeError(f"nvl_pipeline must be a bool, got {nvl_pipeline!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "Buffer needs an initialized torch.distributed process group "
                "(call torch.distributed.init_process_group first)"
            )
        self.group = group
        self.backend = backend
        self.num_sms = num_sms
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self._transport = None
        self._comm_stream: torch.cuda.Stream | None = None
        if backend == "nvlink":
            if not torch.cuda.is_available():
                raise ValueError("backend='nvlink' needs CUDA GPUs; use backend='all_to_all'")
            n_sm = torch.cuda.get_device_properties(
                torch.cuda.current_device()
            ).multi_processor_count
            if num_sms > n_sm:
                raise ValueError(f"num_sms must be <= the device's {n_sm} SMs, got {num_sms}")
            from ptxtrain.ep.nvlink import NvlinkTransport

            self._transport = NvlinkTransport(
                group,
                num_sms,
                num_nvl_bytes,
                aggressive_ptx=aggressive_ptx,
                timeout_s=timeout_s,
                threads=nvl_threads,
                unroll=nvl_unroll,
                pipeline=nvl_pipeline,
                send_sms=nvl_send_sms,
            )

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
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"x as a tuple must be (x_fp8, sf), got {len(x)} items")
            x_fp8, sf = x
            check_tensor("x[0] (x_fp8)", x_fp8, dtypes=(FP8_DTYPE,), ndim=2)
            check_tensor("x[1] (sf)", sf, dtypes=(torch.float32,), ndim=2)
            n_tokens, hidden = x_fp8.shape
            check_shape("x[1] (sf)", sf, (n_tokens, ceil_div(hidden, BLOCK)), "[T, ⌈H/128⌉]")
            device = x_fp8.device
            if sf.device != device:
                raise ValueError(f"sf must be on x_fp8's device {device}, got {sf.device}")
        else:
            check_tensor("x", x, dtypes=_X_DTYPES, ndim=2)
            n_tokens, device = x.shape[0], x.device
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
        if self._transport is not None and device != self._transport.device:
            raise ValueError(
                f"x must be on the nvlink buffer's device {self._transport.device}, got {device}"
            )

    # ------------------------------------------------------------------ public API
    def get_dispatch_layout(
        self, topk_idx: torch.Tensor, num_experts: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`get_dispatch_layout` over this buffer's group size."""
        return get_dispatch_layout(topk_idx, num_experts, self.num_ranks)

    def dispatch(
        self,
        x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        num_experts: int,
        *,
        async_finish: bool = False,
    ) -> tuple:
        """Send every token once to each rank holding at least one of its experts.

        Args:
            x: ``[T, H]`` bfloat16 / float32 / float16 / float64 tokens, or the FP8 pair
                ``(x_fp8 [T, H] float8_e4m3fn, sf [T, ⌈H/128⌉] float32)`` from
                :func:`ptxtrain.quant.ref.per_token_cast_to_fp8` (sent bit-exact). ``T`` may be 0.
            topk_idx: ``[T, k]`` int64 global expert ids in ``[0, E)``, or ``-1`` (no expert).
            topk_weights: ``[T, k]`` float32 / float64 gate weights.
            num_experts: ``E`` (global), a multiple of the group size.

        Returns:
            ``recv_x``: ``[N, H]`` in ``x``'s dtype (or the pair ``(recv_x_fp8 [N, H],
            recv_sf [N, ⌈H/128⌉])``), ordered by source rank, then source token index;
            ``recv_topk_idx [N, k]`` int64 local expert ids (``global - rank·E/R``), ``-1`` where
            the expert is on another rank or was ``-1``; ``recv_topk_weights [N, k]`` in
            ``topk_weights``' dtype, 0 where ``recv_topk_idx`` is ``-1``;
            ``num_recv_tokens_per_expert``: ``E/R`` ints, the rows each local expert gets;
            ``handle``: the :class:`DispatchHandle` for :meth:`combine`; with
            ``async_finish=True`` a sixth item, the :class:`EventOverlap` to wait on before
            using the outputs on the current stream.

            Differentiable with respect to ``x`` (high-precision path) and ``topk_weights``:
            the backward combines the gradients back to the source tokens (collective: every
            rank must run its backward).

        Raises:
            TypeError: a wrong dtype or a non-tensor argument (the message names it).
            ValueError: wrong shapes, ids outside ``[-1, E)``, ``E`` not a multiple of the
                group size or above 1024 experts per rank (the count message's width),
                tensors on different devices (or not on the nvlink buffer's GPU):
                raised before any communication, except ids outside ``[-1, E)`` (any rank's)
                and ranks disagreeing on the hidden size, ``k``, the dtypes of ``x`` /
                ``topk_weights`` or ``E``, raised on every rank after the count exchange,
                before the payload moves.
                ``"nvlink"``: rows from one rank to another over the buffer's capacity (raised
                on every rank, after the count exchange).
            RuntimeError: ``"nvlink"``: an earlier kernel timed out waiting for a peer.

        Source: DeepEP ``Buffer.dispatch``; docs/design.md §4.
        """
        self._check_dispatch_args(x, topk_idx, topk_weights, num_experts)
        if not async_finish:
            return self._dispatch(x, topk_idx, topk_weights, num_experts)
        inputs = [*_tensors(x), topk_idx, topk_weights]
        return self._run_async(
            lambda: self._dispatch(x, topk_idx, topk_weights, num_experts), inputs
        )

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
        self, x: torch.Tensor, handle: DispatchHandle, *, async_finish: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, EventOverlap]:
        """Send every received row back to its source token and sum the contributions.

        A plain sum (the caller applies the gate weights, as in DeepEP): ``combined_x[t] =
        Σ_{rows n of token t} x[n]`` over the ranks token ``t`` was dispatched to; a token sent
        nowhere gets zeros. Accumulated in fp32 (fp64 for fp64 input), returned in ``x``'s dtype.

        Args:
            x: ``[N, H]`` bfloat16 / float32 / float16 / float64, rows in the receive order of
                ``handle`` (``N = handle.num_recv_tokens``).
            handle: the :class:`DispatchHandle` returned by this buffer's :meth:`dispatch`.
            async_finish: run on a side stream and also return an :class:`EventOverlap`.

        Returns:
            ``combined_x [T, H]`` in ``x``'s dtype (``(combined_x, event)`` with
            ``async_finish``). Differentiable: the backward dispatches the gradient with the
            handle (collective).

        Raises:
            TypeError: ``x`` has a wrong dtype or ``handle`` is not a :class:`DispatchHandle`.
            ValueError: ``x`` is not ``[N, H]`` with the dispatch's ``H`` (rows of another
                width would be cut short or misread by the peers; the dispatch checked that
                every rank has the same ``H``), the handle belongs to another group size or
                another buffer's backend, or (``"nvlink"``) rows over the buffer's capacity.
                Every rank must pass ``x`` of the same dtype (not checked: that would cost a
                message).
            RuntimeError: ``"nvlink"``: an earlier kernel timed out waiting for a peer.

        Source: DeepEP ``Buffer.combine``; docs/design.md §4.
        """
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"handle must be a DispatchHandle, got {type(handle).__name__}")
        if handle.num_ranks != self.num_ranks or handle.rank != self.rank:
            raise ValueError(
                f"handle was made on rank {handle.rank} of {handle.num_ranks}, this buffer is "
                f"rank {self.rank} of {self.num_ranks}"
            )
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
        if handle.transport is not self._transport:
            raise ValueError("handle was made by another Buffer (different transport)")
        if not async_finish:
            return _CombineFn.apply(x, handle)
        # The handle's index tensors are read on the side stream too: kept from reuse until it
        # is done, even if the caller drops the handle (no autograd context holds it then).
        if handle.transport is not None:
            _nvl_index(handle, combine=True)  # cached on this stream, recorded on the side one
        return self._run_async(lambda: (_CombineFn.apply(x, handle),), [x, *_tensors(handle)])

    def _run_async(self, fn: Callable[[], tuple], inputs: list[torch.Tensor]) -> tuple:
        """``fn()`` on the side stream; its results plus an :class:`EventOverlap`."""
        device = inputs[0].device
        if device.type != "cuda":
            out = fn()
            return (*out, EventOverlap(None)) if len(out) > 1 else (out[0], EventOverlap(None))
        compute = torch.cuda.current_stream(device)
        if self._comm_stream is None:
            self._comm_stream = torch.cuda.Stream(device=device)
        comm = self._comm_stream
        comm.wait_stream(compute)
        with torch.cuda.stream(comm):
            out = fn()
            event = torch.cuda.Event()
            event.record(comm)
        for t in inputs:  # freed by the caller: not reused before the side stream is done
            if t.device.type == "cuda":
                t.record_stream(comm)
        for t in _tensors(out):  # allocated on the side stream, used on the current one
            if t.device.type == "cuda":
                t.record_stream(compute)
        return (*out, EventOverlap(event)) if len(out) > 1 else (out[0], EventOverlap(event))

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
