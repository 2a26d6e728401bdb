"""The NVLink intranode transport of :class:`ptxtrain.ep.buffer.Buffer` (``backend="nvlink"``).

Design note (DeepSeek-V3 report §3.2.2; docs/design.md §3-4; DeepEP's intranode kernels). The
kernel's CUDA C++ source is ``ptxtrain/include/ptxtrain/ep_nvlink.cuh`` (:data:`SOURCE_PATH`);
this module compiles it with NVRTC and launches it.

What moves where. The per-peer counts are exchanged by one small ``all_to_all_single`` in
``dispatch.py``; the NVLink kernel moves the *message rows*: for dispatch one packed row per
token and destination (activations or FP8 bytes + scales, gate weights, ``topk_idx``, source
token index: one launch per dispatch), for combine the rows to sum. A message is a ``[M, B]``
byte matrix (rows padded to a multiple of 16 bytes); one kernel
is a variable all-to-all ``out[k] = rows_of(src_k)[slot_k]`` driven by one row list and two
offset vectors, so dispatch and combine are the same kernel with the offsets swapped:

- send side: row ``i`` of the send list is input row ``send_row[i]``; the list is grouped by
  destination, so it goes to the rank ``d`` with ``send_off[d] <= i < send_off[d + 1]`` and lands
  in place ``i - send_off[d]`` among the rows from this rank;
- receive side: output row ``k`` is place ``k - recv_off[s]`` of the rows that rank ``s`` sent,
  for the ``s`` with ``recv_off[s] <= k < recv_off[s + 1]``.

The kernel finds ``d`` and ``s`` by a scan of the ``R + 1`` offsets, so the host builds no
per-row index vectors (each would cost kernel launches on a host-bound path).

For dispatch the send list is ``handle.send_src_idx`` (grouped by destination, ascending tokens)
and the receive list is the all_to_all receive order (by source rank, then source token), so the
output is that order *by construction* and bit-identical to the ``all_to_all`` backend. Combine
sends received row ``n`` back to ``recv_src_rank[n]`` and receives in the send order; the per-token
sum is then the same ``index_add_`` as in the ``all_to_all`` backend (bit-identical too).

Memory. Every rank allocates one PyTorch symmetric-memory buffer (``symm_mem.empty`` +
``rendezvous``; ``buffer_ptrs`` gives every peer's base address, mapped for this GPU):

    [ready: R·G int32][freed: R·G int32][progress: R·G int64][pad to 256 B][data: R regions]

with ``G = num_sms`` blocks. Region ``s`` of rank ``r``'s data holds the rows rank ``s`` sends
to ``r`` (``cap = num_nvl_bytes // (R · B)`` rows of ``B`` bytes each).

The kernel (one launch per message, ``G`` blocks of ``threads`` threads, 512 by default; every
rank launches it once per operation, in the same order, as with any collective):

1. Wait until every block of every peer has released ``freed[peer][b] ≥ epoch - 1`` in this
   rank's flags: the peer has finished reading the previous operation's rows out of *its*
   buffer, so overwriting them is safe (write-after-read across GPUs).
2. Each warp copies whole rows (16-byte ``ld_nc_v4`` loads, ``unroll`` (default 4) in flight
   per lane, then ``st_na_v4`` stores) from the local input straight into the destination
   rank's region over NVLink.
3. ``__syncthreads``, then per peer a ``fence.acq_rel.sys`` + ``st.release.sys`` of
   ``ready[this rank][b] = epoch`` into that peer's flags.
4. Wait for ``ready[src][b] ≥ epoch`` for every source rank and block (relaxed polling, then a
   ``fence.acq_rel.sys``: the acquire half), then copy the received rows out of the local buffer
   into the contiguous output in the receive order. These loads read data written by other GPUs
   during the kernel: with ``PTXTRAIN_AGGRESSIVE_PTX`` (``Buffer(..., aggressive_ptx=True)``)
   they are DeepEP's ``ld.global.nc.L1::no_allocate.L2::256B``, otherwise coherent
   ``ld.relaxed.gpu`` loads.
5. Release ``freed[this rank][b] = epoch`` into every peer's flags.

``epoch`` is a per-buffer counter incremented on every operation (the same on all ranks since
operations are collective), so flags only grow between resets, and a reset races with nothing: flags
start at 0 (zeroed, then a barrier, at construction), and before the int32 epoch would overflow
(``EPOCH_LIMIT``, about 2^31 operations) every rank synchronizes, meets the others at a barrier,
zeroes its flags, meets them again and counts from 1. Every wait is bounded by ``timeout_s`` of SM
clock cycles; on expiry the kernel records an error code in a device word and carries on (so it
never hangs); the host copies that word to pinned memory after each launch and raises at the next
operation (or at :meth:`NvlinkTransport.check_errors`, which synchronizes).

Capacity: ``handle.max_rows_per_pair`` (the largest count between any two ranks, known to every
rank after the count exchange) must fit ``cap`` for the payload's row size, checked identically
on all ranks before the launch, so an overflow raises everywhere instead of hanging.

Deadlock freedom: a block only waits for flags released by (a) blocks of the previous
operation, which have run to completion on every GPU, or (b) the send phase of this operation's
blocks, which waits for nothing but (a). Blocks that are not yet resident (SMs busy with compute
kernels) delay the others, never block them forever.

Pipelined variant (``pipeline=True``, compile-time; the default: in all six (threads, SMs)
configurations at EP4 on 4 x H200 it moves 1.02-1.10x the dispatch payload bytes and
1.01-1.09x the combine payload bytes of the barrier kernel). Phase 4
above waits for *all* ``R·G`` ready flags, so no block copies out before the slowest block of
any rank has sent. The variant removes that global barrier by making block ``b`` of every rank
the only writer of the slots that block ``b`` of the receiver reads:

2'. The send list is grouped by destination (``send_off[d]..send_off[d+1]``, places ``0, 1,
    ...``); for each destination, warp ``w`` of the grid (``w = b·warps + warp``) sends the
    places ``j ≡ w (mod G·warps)``. The rows for this rank itself do not go through the buffer:
    they are copied straight to their output rows (``recv_off[rank] + j``), one local copy
    instead of two. Warp ``w`` takes the destinations in the order ``rank + 1 + w, rank + 2 +
    w, ...`` (mod ``R``), so about ``1/R`` of the warps copy locally while the others push
    over NVLink, which 16 SMs of pushes already fill.
4'. The output is grouped by source (``recv_off[s]..recv_off[s+1]``, places ``0, 1, ...``);
    for each peer source ``s``, block ``b`` waits for ``ready[s][b] ≥ epoch`` only, then
    copies out places ``j ≡ w (mod G·warps)`` of ``s``, which are exactly the places block
    ``b`` of ``s`` wrote (same ``G`` and threads on every rank: the buffer is built
    collectively with the same knobs).

So a block copies out while other blocks (of every rank) are still sending, and polls ``R``
flags instead of ``R·G``. Visibility is the same release/acquire pair as above (the writer
block's ``__syncthreads`` + ``fence.acq_rel.sys`` + ``st.release.sys``; the reader's poll +
``fence.acq_rel.sys`` + ``__syncthreads``). Phase 1 still waits for all freed flags: the
previous operation may have had another row size, so its places map to other bytes. Deadlock
freedom is unchanged: a wait in 4' is for a flag released by the send phase of a block of this
operation (which waits only for (a)), and a wait in 1 is (a); no block waits for a block of its
own GPU that could be waiting for it. Both groupings are what ``dispatch.py`` builds (dispatch:
sends by destination, output by source; combine: the reverse) and are asserted by the gloo
emulation of the kernel's contract in the tests.

Split variant (``send_sms = S > 0``, compile-time ``split``). In the two variants above a block
sends all its rows before it copies any out, so the copy-out (a local copy as large as the rows
received from peers) runs after the NVLink transfer instead of under it, and 8 SMs of pushes already
fill the link. Here blocks ``[0, S)`` only send and blocks ``[S, G)`` only copy out:

- sender warp ``w`` (``S·warps`` of them) sends places ``j ≡ w (mod S·warps)`` of each peer, in
  turns (turn ``k``: to ``rank + 1 + k``, while receivers drain ``rank - 1 - k``: a matching,
  so no receiver waits on a source that is still busy with another peer; at EP4 a per-block
  stagger of the destinations is slower than the pipelined kernel) and in
  rounds of ``round_rows`` rows per warp; after each round the block syncs and one thread
  releases ``progress[rank][b] = epoch·2^32 + rounds done`` (int64, system scope) in the
  destination's flags;
- receiver warps copy this rank's own rows straight from the input first (no flags), then
  each peer's places ``j ≡ v (mod (G - S)·warps)``: place ``j`` was written by sender block
  ``(j mod S·warps) / warps`` of that peer in round ``(j / (S·warps)) / round_rows``, so the
  warp waits (every lane an acquiring poll) until that block's progress covers the round.

Fused combine (``NvlinkTransport.combine_sum``, compile-time ``combine``; bf16 rows, at most 8
ranks): a combine's received rows are only ever summed per token, so its receivers do not copy
them out. Receiver warp ``v`` takes tokens ``t ≡ v (mod (G - S)·warps)``; for each rank ``r``
with ``slot[t][r] = p ≥ 0`` it waits until every sender block of ``r`` has released the round
holding place ``p - recv_off[r]`` (the lanes poll the blocks' flags and take the minimum, kept
per warp), then adds the rows in ascending rank order in fp32 from 0 and rounds once to bf16,
the order of ``ptxtrain.ep.layout.combine_sum``, so the result is bit-identical to the
copy-then-sum path; this rank's own row is read from the input. Senders here send each round to
every peer (not one peer per turn), so all sources progress together and token order does not
wait on the last turn. The kernel runs 512 threads per block (the sums' registers, 8 loads in
flight per lane) and a third of the SMs send (the receivers do the heavier part). This halves
the receivers' memory traffic: read the rows once and write ``T·H``, instead of read, write, read
again, write ``T·H``.

Progress values grow with the epoch, so a flag left by the previous operation never satisfies a
wait of this one. Senders wait only for phase 1 (the previous operation), receivers only for
senders of this operation, so no wait is circular, and a receiver block that is resident before
the senders of its own GPU does not delay them: it waits for other GPUs' senders only.
"""

from __future__ import annotations

import warnings
from functools import cache

import torch
import torch.distributed as dist

from ptxtrain._backend import sm_clock_khz
from ptxtrain._checks import ceil_div
from ptxtrain.jit.cache import INCLUDE_DIR

__all__ = [
    "DEFAULT_PIPELINE",
    "DEFAULT_ROUND_ROWS",
    "DEFAULT_SEND_SMS",
    "DEFAULT_THREADS",
    "DEFAULT_UNROLL",
    "KERNEL_NAME",
    "SOURCE_PATH",
    "UNROLLS",
    "NvlinkTransport",
    "check_knobs",
    "check_round_rows",
    "check_send_sms",
    "compile_kernel",
    "flag_bytes",
    "kernel_source",
]

KERNEL_NAME = "nvl_all_to_all_v"
# threads per block: 1024 moves 1.5x (dispatch) / 1.3x (combine) the payload bytes of 512 at 24
# SMs on 2 x H200
DEFAULT_THREADS = 1024
DEFAULT_UNROLL = 4  # 16-byte loads in flight per lane
DEFAULT_PIPELINE = True  # per-block flags (see the design note)
# None: the split variant with half the SMs sending (EP2, 24 SMs: 1.24x the dispatch payload
# rate of the pipelined kernel, 1.28x the combine's); 0: no split
DEFAULT_SEND_SMS = None
DEFAULT_ROUND_ROWS = 2
UNROLLS = (1, 2, 4, 8)
_FLAG_ALIGN = 256
# the kernel's parameters for ptxtrain.jit.BoundLaunch (p pointer, i int32, q int64)
_SIGNATURE = "ppipipppiiiqqiqpipi"
# The epoch after which the flags are zeroed and the count restarts (an int32 kernel argument).
EPOCH_LIMIT = 2**31 - 2
MAX_RANKS = 8  # the fused combine's limit (PTXTRAIN_NVL_MAX_RANKS): the GPUs of one node
# Error codes written by the kernel (the host message names them).
_ERRORS = {1: "waiting for peers to free their buffers", 2: "waiting for peers' rows"}

# The kernel's CUDA C++ source, in the package's CUDA tree beside the PTX helpers it includes
# (shipped as package data with them).
SOURCE_PATH = INCLUDE_DIR / "ptxtrain" / "ep_nvlink.cuh"


@cache
def kernel_source() -> str:
    """The CUDA C++ source of the NVLink all-to-all-v kernel (``extern "C"`` ``KERNEL_NAME``), read
    once from ``SOURCE_PATH`` (``ptxtrain/include/ptxtrain/ep_nvlink.cuh``)."""
    return SOURCE_PATH.read_text(encoding="utf-8")


def check_knobs(threads: object, unroll: object, prefix: str = "") -> tuple[int, int]:
    """Validates the kernel's tuning knobs; returns ``(threads, unroll)``.

    Raises TypeError (not ints) or ValueError (``threads`` not a multiple of 32 in
    ``[32, 1024]``; ``unroll`` not in ``UNROLLS``), the message naming the argument
    (``prefix + "threads"``, e.g. ``nvl_threads`` for :class:`ptxtrain.ep.Config`).
    """
    from ptxtrain._checks import check_positive_int

    check_positive_int(f"{prefix}threads", threads)
    check_positive_int(f"{prefix}unroll", unroll)
    if threads % 32 or threads > 1024:
        raise ValueError(f"{prefix}threads must be a multiple of 32 in [32, 1024], got {threads}")
    if unroll not in UNROLLS:
        raise ValueError(f"{prefix}unroll must be one of {UNROLLS}, got {unroll}")
    return threads, unroll


def check_round_rows(round_rows: object, name: str = "round_rows") -> int:
    """Validates the split variant's rows per sender warp between two progress releases: an
    int in ``[1, 64]``; raises ValueError naming ``name`` otherwise."""
    if isinstance(round_rows, bool) or not isinstance(round_rows, int) or not 1 <= round_rows <= 64:
        raise ValueError(f"{name} must be an int in [1, 64], got {round_rows!r}")
    return round_rows


def compile_kernel(
    aggressive_ptx: bool = False,
    arch: str = "sm_90a",
    keep_ptx: bool = False,
    *,
    threads: int = DEFAULT_THREADS,
    unroll: int = DEFAULT_UNROLL,
    pipeline: bool = DEFAULT_PIPELINE,
    split: bool = False,
    round_rows: int = DEFAULT_ROUND_ROWS,
    combine: bool = False,
):
    """Compiles the kernel through :func:`ptxtrain.jit.compile_cuda` (NVRTC; no GPU needed).

    ``aggressive_ptx`` adds ``-DPTXTRAIN_AGGRESSIVE_PTX`` (the ``ld.global.nc`` loads);
    ``keep_ptx`` keeps the PTX text on the result. Tuning knobs (compile-time):
    ``threads`` per block (the launch must use the same; a multiple of 32, at most 1024) and
    ``unroll``, 16-byte loads in flight per lane in a row copy (one of ``UNROLLS``);
    ``pipeline`` (bool) selects the per-block flags of the design note; ``split`` (bool) the
    sender / receiver blocks with progress flags (the launch passes the sender block count),
    ``round_rows`` (1 to 64) its rows per sender warp between two progress releases;
    ``combine`` (bool, needs ``split``) the fused combine (receivers sum each token's bf16 rows
    into ``out [T, hidden]``, see the design note). Returns a
    :class:`ptxtrain.jit.CompiledKernel`; raises TypeError / ValueError for bad knobs and
    :class:`ptxtrain.jit.JitCompileError` / RuntimeError as ``compile_cuda`` does.
    """
    from ptxtrain.jit import compile_cuda

    threads, unroll = check_knobs(threads, unroll)
    for name, value in (("pipeline", pipeline), ("split", split), ("combine", combine)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")
    check_round_rows(round_rows)
    if combine and not split:
        raise ValueError("combine=True needs split=True (the fused combine is a split variant)")
    mode = 2 if split else int(pipeline)
    flags = ("-DPTXTRAIN_AGGRESSIVE_PTX",) if aggressive_ptx else ()
    flags += (f"-DPTXTRAIN_NVL_THREADS={threads}", f"-DPTXTRAIN_NVL_UNROLL={unroll}")
    flags += (f"-DPTXTRAIN_NVL_PIPELINE={mode}", f"-DPTXTRAIN_NVL_ROUND_ROWS={round_rows}")
    flags += (f"-DPTXTRAIN_NVL_COMBINE={int(combine)}",)
    return compile_cuda(
        kernel_source(), name=KERNEL_NAME, arch=arch, flags=flags, keep_ptx=keep_ptx
    )


def flag_bytes(num_ranks: int, num_sms: int) -> int:
    """Bytes of the flag area at the head of each rank's buffer, padded to 256: ready and freed
    flags (``R·G`` int32 each), then the split variant's progress flags (``R·G`` int64)."""
    return ceil_div(16 * num_ranks * num_sms, _FLAG_ALIGN) * _FLAG_ALIGN


def _check_indices(device: torch.device, **tensors) -> None:
    """Each ``name=(tensor, shape or None)``: a contiguous int64 tensor on ``device`` (the kernel
    gets raw pointers), of that shape; raises ValueError naming the argument otherwise."""
    for name, (t, shape) in tensors.items():
        if t.dtype != torch.int64 or not t.is_contiguous() or t.device != device:
            raise ValueError(
                f"{name}: expected a contiguous int64 tensor on {device}, got {t.dtype} on "
                f"{t.device}"
            )
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def check_send_sms(send_sms: object, num_sms: int, name: str = "send_sms") -> int:
    """Validates the split variant's sender SMs: 0 (no split) or in ``[1, num_sms - 1]``;
    ``None`` is the default, ``num_sms // 2`` (0 for a single SM). Returns the count; the
    errors name ``name``."""
    if send_sms is None:
        return num_sms // 2
    if isinstance(send_sms, bool) or not isinstance(send_sms, int):
        raise TypeError(f"{name} must be an int, got {send_sms!r}")
    if send_sms and not 0 < send_sms < num_sms:
        raise ValueError(
            f"{name} must be 0 (no split) or in [1, num_sms - 1 = {num_sms - 1}], got {send_sms}"
        )
    return send_sms


def _group_name(group: dist.ProcessGroup | None) -> str:
    pg = group if group is not None else dist.group.WORLD
    return pg.group_name


class NvlinkTransport:
    """Peer buffers + the JIT kernel moving payload rows between the GPUs of one node.

    Args:
        group: the process group (``None``: the default group); NCCL, one GPU per rank, all
            GPUs of the group peer-accessible (NVLink).
        num_sms: ``G``, thread blocks of the kernel (one per SM).
        num_nvl_bytes: bytes of the data region of each rank's symmetric buffer.
        aggressive_ptx: compile with ``PTXTRAIN_AGGRESSIVE_PTX`` (``ld.global.nc`` loads).
        threads / unroll / pipeline / round_rows: the kernel's tuning knobs
            (:func:`compile_kernel`).
        send_sms: the sender blocks of the split variant (the other ``num_sms - send_sms``
            blocks receive); ``None`` (default): ``num_sms // 2``, or no split with
            ``pipeline=False``; 0: no split (then ``pipeline`` picks the variant).
        timeout_s: bound on every flag wait (SM clock cycles at the device's clock rate).

    Collective: every rank must construct it with the same arguments.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        num_sms: int,
        num_nvl_bytes: int,
        *,
        aggressive_ptx: bool = False,
        timeout_s: float = 30.0,
        threads: int = DEFAULT_THREADS,
        unroll: int = DEFAULT_UNROLL,
        pipeline: bool = DEFAULT_PIPELINE,
        send_sms: int | None = DEFAULT_SEND_SMS,
        round_rows: int = DEFAULT_ROUND_ROWS,
    ) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        from ptxtrain.jit import BoundLaunch, load_kernel

        self.threads, self.unroll = check_knobs(threads, unroll)
        if send_sms is None and pipeline is False:
            send_sms = 0  # asked for the barrier kernel: no split by default
        self.send_sms = check_send_sms(send_sms, num_sms)
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.num_sms = num_sms
        self.num_nvl_bytes = num_nvl_bytes
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.data_offset = flag_bytes(self.num_ranks, num_sms)
        name = _group_name(group)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed up to torch 2.7, deprecated later
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(name)
        self.buffer = symm_mem.empty(
            self.data_offset + num_nvl_bytes, dtype=torch.uint8, device=self.device
        )
        self.symm = symm_mem.rendezvous(self.buffer, name)
        self.buffer[: self.data_offset].zero_()  # flags start at 0; epoch starts at 1
        # buffer_ptrs are the peers' mappings of the symmetric allocation; the tensor may start
        # at an offset into it (torch's symmetric-memory pool), the same offset on every rank.
        ptrs = [int(p) for p in self.symm.buffer_ptrs]
        offset = self.buffer.data_ptr() - ptrs[self.rank]
        # Checked, not assumed: a different offset on a peer would make every write to it land
        # elsewhere in its buffer (all ranks see the same gathered list, so all raise).
        offsets = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in ptrs]
        dist.all_gather(offsets, torch.tensor([offset], device=self.device), group=group)
        if any(int(o) != offset for o in offsets):
            raise RuntimeError(
                f"the symmetric-memory buffer starts at different offsets into the ranks' "
                f"allocations ({[int(o) for o in offsets]}); the nvlink backend needs them equal"
            )
        self.peer_bases = torch.tensor(
            [p + offset for p in ptrs], dtype=torch.int64, device=self.device
        )
        torch.cuda.synchronize(self.device)
        dist.barrier(group=group)
        self.epoch = 0
        # The kernels compare flags with the int32 epoch (``>=``): before it would overflow, every
        # rank zeroes its flags and counts again from 1 (_restart_epochs). All ranks run the same
        # operations, so they restart at the same one. An attribute, so tests can lower it.
        self.epoch_limit = EPOCH_LIMIT
        self.epoch_restarts = 0
        self.error = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._error_host = torch.zeros(1, dtype=torch.int32).pin_memory()
        self._error_event: torch.cuda.Event | None = None
        self.timeout_cycles = int(timeout_s * sm_clock_khz(self.device) * 1e3)
        self.kernel = load_kernel(
            compile_kernel(
                aggressive_ptx,
                threads=self.threads,
                unroll=self.unroll,
                pipeline=pipeline,
                split=self.send_sms > 0,
                round_rows=round_rows,
            )
        )
        self._launch = BoundLaunch(self.kernel, _SIGNATURE, self.threads)
        self._knobs = dict(aggressive_ptx=aggressive_ptx, round_rows=round_rows)
        self._combine_launch = None  # the fused combine's kernel, built at its first use
        self._combine_threads = min(self.threads, 512)  # (the sums' registers, see the note)

    def can_combine_sum(self, x: torch.Tensor) -> bool:
        """Whether :meth:`combine_sum` takes ``x``: the split variant, ``x`` a contiguous
        ``[N, H]`` bfloat16 CUDA tensor on this GPU with ``H`` a multiple of 8 (16-byte rows), at
        most ``MAX_RANKS`` ranks. Every rank must reach the same answer for one combine (the
        fused and the copy-out kernels speak different protocols): it depends only on the
        buffer's knobs and on the dtype, width and layout every rank's ``x`` shares."""
        return (
            self.send_sms > 0
            and self.num_ranks <= MAX_RANKS
            and x.dtype == torch.bfloat16
            and x.dim() == 2
            and x.shape[1] % 8 == 0
            and x.is_contiguous()
            and x.device == self.device
        )

    def combine_sum(
        self,
        x: torch.Tensor,
        send_row: torch.Tensor,
        send_off: torch.Tensor,
        recv_off: torch.Tensor,
        slot: torch.Tensor,
        num_tokens: int,
    ) -> torch.Tensor:
        """The fused combine: ``x``'s rows go back to their tokens' ranks and each rank sums, per
        token, the rows it gets back, in one kernel (no copy-out of the received rows).

        Args:
            x: ``[N, H]`` bfloat16 (see :meth:`can_combine_sum`), rows in dispatch's receive
                order.
            send_row: ``[N]`` int64, ``arange(N)`` (the send list is ``x``'s rows in order).
            send_off / recv_off: ``[R + 1]`` int64 offsets: of ``x``'s rows by destination, and
                of dispatch's send order by destination (the places the rows come back to).
            slot: ``[T, R]`` int64, token ``t``'s place in dispatch's send order for rank ``r``
                or ``-1`` (``ptxtrain.ep.layout.send_layout``).
            num_tokens: ``T``.

        Returns:
            ``[T, H]`` bfloat16: ``Σ_r x_r[t]`` in fp32 over the ranks in ascending order,
            rounded once (bit-identical to :func:`ptxtrain.ep.layout.combine_sum`); zeros for
            a token sent nowhere. Launched on the current stream; the caller checks capacity.

        Raises:
            ValueError: ``x`` not accepted by :meth:`can_combine_sum`, index tensors that are
                not contiguous int64 on ``x``'s device or have the wrong shapes.
        """
        from ptxtrain.jit import BoundLaunch, load_kernel

        self.check_errors(synchronize=False)
        if not self.can_combine_sum(x):
            raise ValueError(
                f"x: the fused combine takes a contiguous [N, H] bfloat16 tensor on "
                f"{self.device} with H a multiple of 8 (split variant, <= {MAX_RANKS} ranks), "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
        r, n = self.num_ranks, x.shape[0]
        _check_indices(
            x.device,
            send_row=(send_row, (n,)),
            send_off=(send_off, (r + 1,)),
            recv_off=(recv_off, (r + 1,)),
            slot=(slot, (num_tokens, r)),
        )
        if x.data_ptr() % 16:  # the kernel loads 16-byte words (the decision stays the same)
            x = x.clone()
        if self._combine_launch is None:
            # at most 512 threads: the sum's registers (1024 threads would leave 64 and spill)
            kernel = load_kernel(
                compile_kernel(
                    self._knobs["aggressive_ptx"],
                    threads=self._combine_threads,
                    unroll=8,  # 8 loads in flight per lane and rank: 123 registers, no spill
                    split=True,
                    round_rows=self._knobs["round_rows"],
                    combine=True,
                )
            )
            self._combine_launch = BoundLaunch(kernel, _SIGNATURE, self._combine_threads)
        hidden = x.shape[1]
        out = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=x.device)
        senders = max(1, self.num_sms // 3)  # 8 of 24 SMs fill the link
        self._run(self._combine_launch, x, send_row, out, num_tokens, send_off, recv_off,
                  hidden // 8, senders, slot.data_ptr(), hidden)  # fmt: skip
        return out

    def capacity_rows(self, row_bytes: int) -> int:
        """Rows of ``row_bytes`` (padded to 16) one rank may send to another per operation."""
        return self.num_nvl_bytes // (self.num_ranks * max(16, ceil_div(row_bytes, 16) * 16))

    def check_errors(self, synchronize: bool = True) -> None:
        """Raises RuntimeError if a kernel timed out waiting for a peer.

        With ``synchronize`` the last launch is waited for; otherwise it is checked only if done.
        """
        if self._error_event is None:
            return
        if synchronize:
            self._error_event.synchronize()
        elif not self._error_event.query():
            return
        code = int(self._error_host.item())
        if code:
            raise RuntimeError(
                f"nvlink dispatch/combine kernel on rank {self.rank} timed out "
                f"{_ERRORS.get(code, f'(code {code})')}: a peer did not take part in the same "
                "operation (every rank must call dispatch/combine in the same order) or a peer "
                "failed; the buffer is unusable, create a new one"
            )

    def exchange(
        self,
        rows: torch.Tensor,
        send_row: torch.Tensor,
        send_off: torch.Tensor,
        recv_off: torch.Tensor,
        num_recv: int,
    ) -> torch.Tensor:
        """One variable all-to-all of byte rows on NVLink. The send list is grouped by
        destination: send rows ``send_off[d]..send_off[d+1]`` go to rank ``d`` at places ``0,
        1, ...`` there; the output is grouped by source: output rows ``recv_off[s]..
        recv_off[s+1]`` are the rows rank ``s`` sent here, in its place order.

        Args:
            rows: ``[M, B]`` uint8 CUDA, contiguous, ``B`` a multiple of 16.
            send_row: ``[S]`` int64 rows of ``rows`` to send, grouped by destination.
            send_off / recv_off: ``[R + 1]`` int64 CUDA offsets of the two groupings
                (``send_off[R] = S``, ``recv_off[R] = num_recv``).
            num_recv: output rows (the host knows it from the count exchange).

        Returns:
            ``[num_recv, B]`` uint8. Launched on the current stream; the caller checks capacity.
        """
        self.check_errors(synchronize=False)
        stride = rows.shape[1]
        # the launch passes raw pointers: check what the kernel assumes about the layout
        if rows.dtype != torch.uint8 or not rows.is_contiguous() or stride % 16:
            raise ValueError(
                f"rows: expected a contiguous uint8 [M, B] tensor with B a multiple of 16, got "
                f"{rows.dtype} {tuple(rows.shape)} (contiguous={rows.is_contiguous()})"
            )
        _check_indices(
            rows.device,
            send_row=(send_row, None),
            send_off=(send_off, (self.num_ranks + 1,)),
            recv_off=(recv_off, (self.num_ranks + 1,)),
        )
        out = torch.empty(num_recv, stride, dtype=torch.uint8, device=rows.device)
        self._run(self._launch, rows, send_row, out, num_recv, send_off, recv_off, stride // 16,
                  self.send_sms)  # fmt: skip
        return out

    def _restart_epochs(self) -> None:
        """Zero this rank's flags and restart the sequence numbers at 1, on every rank together.

        The first barrier waits until no launch of any rank is running (each rank synchronizes
        its device first), so no peer still writes into these flags; the second, until every
        rank has zeroed its own, so no rank's next launch reads a peer's stale flag."""
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.buffer[: self.data_offset].zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self.epoch = 0
        self.epoch_restarts += 1

    def _run(self, launch, src, send_row, out, num_out, send_off, recv_off, stride16, senders,
             slot_ptr=0, hidden=0) -> None:  # fmt: skip
        """One launch of the kernel (``launch``: a BoundLaunch of ``_SIGNATURE``, a few µs of
        host time against ~70 µs for the generic launch; the GPU waits for it, as dispatch's
        payload goes right after the count exchange's sync) as the next operation, then the
        copy of its error word to the host.

        Raises RuntimeError while the stream is being captured into a CUDA graph: the operation's
        sequence number (``epoch``) is a launch parameter, which a replay would repeat, so the
        flag waits of a replay would pass on the previous replay's flags."""
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the nvlink dispatch/combine kernel cannot be captured into a CUDA graph (each "
                "operation has its own sequence number); use backend='all_to_all' under capture"
            )
        if self.epoch >= self.epoch_limit:
            self._restart_epochs()
        epoch = self.epoch + 1  # (counted once launched: a failed launch leaves it unchanged)
        launch(
            self.num_sms,
            src.data_ptr(),
            send_row.data_ptr(),
            int(send_row.shape[0]),
            out.data_ptr(),
            int(num_out),
            send_off.data_ptr(),
            recv_off.data_ptr(),
            self.peer_bases.data_ptr(),
            self.rank,
            self.num_ranks,
            stride16,
            self.capacity_rows(stride16 * 16),
            self.data_offset,
            epoch,
            self.timeout_cycles,
            self.error.data_ptr(),
            senders,
            slot_ptr,
            hidden,
        )
        self.epoch = epoch
        self._error_host.copy_(self.error, non_blocking=True)
        self._error_event = torch.cuda.Event()
        self._error_event.record()
