"""``ptxtrain bench dispatch``: expert-parallel dispatch / combine in µs and GB/s, per backend.

Run under torchrun, one GPU per rank (``torchrun --nproc-per-node 8 -m ptxtrain bench
dispatch``). DeepEP's benchmark setting (its README's) by default: 4096 tokens per rank, hidden
7168, 256 experts, top-8 uniform random routing, FP8 dispatch, BF16 combine.

Method (DeepEP's test_intranode, docs/design.md §4 and §6): for each backend (``all_to_all`` always,
``nvlink`` when every GPU of the group is peer-accessible, its default split kernel and, as
``nvlink:pipelined``, the pipelined kernel without the split), warm-ups, then ``repeats`` timed
calls, each queued behind a one-element ``all_reduce`` and a 200 µs GPU spin (while the host
queues the call) so that the GPUs start it together (the
ranks aligned on the GPU, as DeepEP's ``bench_kineto`` does, not by a host barrier: that adds the
launch latency and the ranks' host skew), timed with CUDA events around the call on the current
stream; the median is reported per rank, and the median under a host barrier + sync before each
call as ``us_host_sync`` (comparable with timings taken that way). Four
operations (:func:`time_buffer`):

- ``dispatch``: the whole ``Buffer.dispatch`` call (layout, the count exchange with its one host
  sync, one packed message of FP8 activations + FP32 scales + weights + ``topk_idx`` + token
  index);
- ``dispatch_payload``: the FP8 payload rows alone with a cached handle (what DeepEP times when
  it passes a handle);
- ``combine``: ``Buffer.combine`` of BF16 rows (a cached handle by nature);
- ``combine_payload``: the BF16 rows' move alone (no per-token sum).

With ``profile=True`` (``--profile``) each backend's full dispatch and combine calls also run
under ``torch.profiler`` (:func:`profile_buffer`): rank 0's top ops by host time and by device
time go into the record, to show where a full call spends the time its payload does not.

Bandwidth = logical bytes received / time, as DeepEP reports: ``N · H · 2`` BF16 bytes times
``(1 + 4/128) / 2`` for FP8 dispatch (the scales included), ``N · H · 2`` for combine, where
``N`` is the rows this rank receives in dispatch (= sends in combine). Rank 0 prints and writes
the table with every rank's numbers.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from ptxtrain._backend import sm_clock_khz
from ptxtrain.bench.timing import environment, event_us

__all__ = [
    "bench_dispatch",
    "format_table",
    "logical_bytes",
    "make_inputs",
    "nvl_bytes",
    "profile_buffer",
    "time_buffer",
]

_OPS = ("dispatch", "dispatch_payload", "combine", "combine_payload")


def logical_bytes(op: str, num_recv_tokens: int, hidden: int, fp8: bool = True) -> float:
    """DeepEP's logical bytes of one operation on one rank.

    ``op``: ``"dispatch"`` / ``"dispatch_payload"`` (FP8: ``N·H·(1 + 4/128)``, BF16 ``2·N·H``)
    or ``"combine"`` / ``"combine_payload"`` (BF16, ``2·N·H``). Raises ValueError for another
    ``op``.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {_OPS}, got {op!r}")
    bf16 = 2.0 * num_recv_tokens * hidden
    if op.startswith("dispatch") and fp8:
        return bf16 * (1 + 4 / 128) / 2
    return bf16


def _nvlink_possible() -> str | None:
    """None when the nvlink backend can run here, else why not."""
    n = torch.cuda.device_count()
    world = dist.get_world_size()
    if world > n:
        return f"{world} ranks on {n} visible GPUs (one node, one GPU per rank needed)"
    me = torch.cuda.current_device()
    for other in range(min(n, world)):
        if other != me and not torch.cuda.can_device_access_peer(me, other):
            return f"GPU {me} cannot access GPU {other} (no NVLink / P2P)"
    return None


def nvl_bytes(tokens: int, hidden: int, topk: int) -> int:
    """``num_nvl_bytes`` for the benchmark: every rank may receive all tokens of every rank, in
    the larger of a BF16 combine row and a packed BF16 dispatch row (x + fp32 weights + int64
    ``topk_idx`` + int64 token index)."""
    from ptxtrain.ep.buffer import Buffer

    world = dist.get_world_size()
    return Buffer.nvl_bytes_hint(tokens, 2 * hidden + 12 * topk + 8, world)


def _time(fn, repeats: int, warmup: int, spin_us: float = 200.0) -> list[float]:
    """µs per call, the ranks aligned on the GPU: before each call a one-element NCCL
    ``all_reduce``, which the current stream waits for, so every GPU starts the call when the
    slowest rank reaches it, then a ``spin_us`` (200 µs) GPU spin while the host queues the call
    (no host sync in the loop); CUDA events around the call. DeepEP times its kernels after a
    collective the same way (``bench_kineto``), so neither launch latency nor the ranks' host
    skew enter the time."""
    for _ in range(warmup):
        fn()
    dist.barrier()
    torch.cuda.synchronize()
    token = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    # ~200 µs (spin_us) of GPU spin after the all_reduce: the host queues the call meanwhile, so
    # its launch latency is not in the time (the ranks leave the all_reduce together and spin
    # alike)
    spin = int(spin_us * 1e-6 * sm_clock_khz() * 1e3)
    pairs = []
    for _ in range(repeats):
        dist.all_reduce(token)
        torch.cuda._sleep(spin)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in pairs]


def _time_host_sync(fn, repeats: int, warmup: int) -> list[float]:
    """µs per call, each call after a host barrier + device sync: the time also holds the
    launch latency and the ranks' skew after the barrier."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        times.append(event_us(fn))
    return times


def make_inputs(tokens: int, hidden: int, experts: int, topk: int, seed: int) -> dict:
    """This rank's benchmark inputs on the current CUDA device: uniform random top-k routing,
    BF16 activations and their FP8 cast (``x_fp8 = (fp8 [T, H], sf [T, ⌈H/128⌉])``), weights."""
    from ptxtrain.quant.ref import per_token_cast_to_fp8

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=dev).manual_seed(seed + rank)
    scores = torch.rand(tokens, experts, generator=g, device=dev)
    topk_idx = scores.topk(topk, dim=1).indices  # uniform random top-k
    topk_w = torch.rand(tokens, topk, generator=g, device=dev)
    x = torch.randn(tokens, hidden, generator=g, device=dev).bfloat16()
    return dict(
        x_fp8=per_token_cast_to_fp8(x.float()),
        topk_idx=topk_idx,
        topk_w=topk_w,
        experts=experts,
        hidden=hidden,
        generator=g,
    )


def _dispatch_kwargs(inputs: dict) -> dict:
    """The keyword arguments of ``Buffer.dispatch`` for the inputs of :func:`make_inputs`."""
    return dict(
        topk_idx=inputs["topk_idx"], topk_weights=inputs["topk_w"], num_experts=inputs["experts"]
    )


def time_buffer(buf, inputs: dict, repeats: int, warmup: int) -> list[dict]:
    """Times the four operations of ``_OPS`` on ``buf``; one row per op with every rank's median
    µs and GB/s (collective: every rank calls it with its own inputs)."""
    from ptxtrain.ep.buffer import dispatch_rows, move_rows

    world = dist.get_world_size()
    x_fp8, topk_idx = inputs["x_fp8"], inputs["topk_idx"]
    hidden = inputs["hidden"]
    kw = _dispatch_kwargs(inputs)
    handle = buf.dispatch(x_fp8, **kw)[4]
    n_recv = handle.num_recv_tokens
    dev = topk_idx.device
    y = torch.randn(n_recv, hidden, generator=inputs["generator"], device=dev).bfloat16()
    packed = torch.cat(
        [x_fp8[0].view(torch.uint8), x_fp8[1].view(torch.uint8)], dim=1
    )  # the FP8 rows + scales alone (the full call also packs weights, topk_idx, token index)
    fns = {
        "dispatch": lambda: buf.dispatch(x_fp8, **kw),
        "dispatch_payload": lambda: dispatch_rows(packed, handle),
        "combine": lambda: buf.combine(y, handle)[0],
        "combine_payload": lambda: move_rows([y], handle, combine=True),
    }
    rows = []
    for op, fn in fns.items():
        us = statistics.median(_time(fn, repeats, warmup))
        us_host = statistics.median(_time_host_sync(fn, repeats, 0))
        gbs = logical_bytes(op, n_recv, hidden) / (us * 1e-6) / 1e9
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (us, gbs, n_recv, us_host))
        rows.append(
            {
                "op": op,
                "us": [p[0] for p in per_rank],
                "gbs": [p[1] for p in per_rank],
                "recv_tokens": [p[2] for p in per_rank],
                "us_max": max(p[0] for p in per_rank),
                "gbs_mean": statistics.fmean(p[1] for p in per_rank),
                "us_host_sync": [p[3] for p in per_rank],
            }
        )
    return rows


def profile_buffer(buf, inputs: dict, calls: int = 5, rows: int = 25) -> dict[str, str]:
    """``calls`` full ``dispatch`` and ``combine`` calls of ``buf`` under ``torch.profiler``
    (CPU activity, plus CUDA on a CUDA device), after one warm-up call of each.

    A collective: every rank calls it with its own inputs (:func:`make_inputs`, or on CPU any
    dict with the same keys). Returns this rank's tables, ``{"dispatch_by_host", "dispatch_by_
    device", "combine_by_host", "combine_by_device"}`` (``key_averages`` sorted by self CPU time
    and by device time, ``rows`` rows each; the device tables are empty on CPU).
    """
    from torch.profiler import ProfilerActivity, profile

    x_fp8, topk_idx = inputs["x_fp8"], inputs["topk_idx"]
    kw = _dispatch_kwargs(inputs)
    cuda = topk_idx.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    handle = buf.dispatch(x_fp8, **kw)[4]
    y = torch.ones(handle.num_recv_tokens, inputs["hidden"], device=topk_idx.device)
    y = y.to(torch.bfloat16)
    ops = {
        "dispatch": lambda: buf.dispatch(x_fp8, **kw),
        "combine": lambda: buf.combine(y, handle)[0],
    }
    tables: dict[str, str] = {}
    for op, fn in ops.items():
        fn()
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=activities) as prof:
            for _ in range(calls):
                fn()
            if cuda:
                torch.cuda.synchronize()
        ka = prof.key_averages()
        tables[f"{op}_by_host"] = ka.table(
            sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60
        )
        tables[f"{op}_by_device"] = (
            ka.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)
            if cuda
            else ""
        )
    return tables


def bench_dispatch(
    *,
    tokens: int = 4096,
    hidden: int = 7168,
    experts: int = 256,
    topk: int = 8,
    num_sms: int = 24,
    repeats: int = 20,
    warmup: int = 5,
    seed: int = 0,
    profile: bool = False,
) -> dict:
    """Time dispatch / combine of every available backend; return rank 0's results record.

    ``profile``: also :func:`profile_buffer` each backend (record key ``"profile"``: backend →
    rank 0's tables).

    Needs an initialized NCCL process group, one CUDA device per rank (the current device).
    ``experts`` must be a multiple of the world size and ``topk <= experts``.

    Returns:
        On every rank: ``{"bench": "dispatch", "env", "settings", "rows", "skipped",
        "method"}``; ``rows`` has one entry per (backend, op) with the median µs and GB/s of
        every rank, their mean/max and the rows received.

    Raises:
        ValueError: bad sizes; RuntimeError: no process group / CUDA.
    """
    from ptxtrain.ep import Buffer, Config

    if not dist.is_initialized() or not torch.cuda.is_available():
        raise RuntimeError("bench dispatch needs CUDA and torch.distributed (run it with torchrun)")
    world = dist.get_world_size()
    if experts % world or topk > experts:
        raise ValueError(
            f"experts must be a multiple of the {world} ranks and >= topk, got experts="
            f"{experts}, topk={topk}"
        )
    inputs = make_inputs(tokens, hidden, experts, topk, seed)

    backends = {"all_to_all": {}}
    skipped = {}
    why = _nvlink_possible()
    if why is None:
        nvl_bytes_ = nvl_bytes(tokens, hidden, topk)
        # the default kernel: the split variant
        backends["nvlink"] = dict(num_nvl_bytes=nvl_bytes_, config=Config(num_sms))
        # the pipelined variant without the sender / receiver split, for comparison
        pipelined = Config(num_sms, nvl_send_sms=0)
        backends["nvlink:pipelined"] = dict(num_nvl_bytes=nvl_bytes_, config=pipelined)
    else:
        skipped["nvlink"] = why
    rows = []
    profiles = {}
    for name, kw in backends.items():
        buf = Buffer(backend=name.split(":")[0], **kw)
        for row in time_buffer(buf, inputs, repeats, warmup):
            num_sms = kw["config"].num_sms if "config" in kw else None
            rows.append({"backend": name, "num_sms": num_sms, **row})
        if profile:
            profiles[name] = profile_buffer(buf, inputs)
        if name.startswith("nvlink"):
            buf.check_errors()
        torch.cuda.synchronize()
        dist.barrier()
        del buf
    return {
        "bench": "dispatch",
        "env": environment(),
        "settings": {
            "world_size": world,
            "tokens_per_rank": tokens,
            "hidden": hidden,
            "experts": experts,
            "topk": topk,
            "num_sms": num_sms,
            "repeats": repeats,
            "routing": "uniform random top-k",
            "dispatch": "fp8 (e4m3 + fp32 scale per 128)",
            "combine": "bf16",
        },
        "rows": rows,
        "skipped": skipped,
        **({"profile": profiles} if profile else {}),
        "method": "per rank: a one-element all_reduce + 200 us GPU spin before each call (the "
        "GPUs start it together, the host has queued it), CUDA events around the call, median; "
        "us_host_sync: host barrier + sync before each call instead; GB/s = "
        "logical bytes received / time (DeepEP: FP8 factor (1+4/128)/2 on BF16 bytes)",
    }


def format_table(result: dict) -> str:
    """Render a dispatch results record: one line per (backend, op)."""
    s = result["settings"]
    lines = [
        f"EP{s['world_size']}: {s['tokens_per_rank']} tokens/rank, hidden {s['hidden']}, "
        f"{s['experts']} experts, top-{s['topk']}, FP8 dispatch / BF16 combine",
        f"{'backend':>16} {'op':>16} {'SMs':>4} {'µs (max rank)':>14} {'GB/s (mean)':>12} "
        f"{'GB/s min':>9} {'GB/s max':>9} {'µs host-sync':>13}",
    ]
    for r in result["rows"]:
        sms = "-" if r["num_sms"] is None else str(r["num_sms"])
        lines.append(
            f"{r['backend']:>16} {r['op']:>16} {sms:>4} {r['us_max']:14.1f} "
            f"{r['gbs_mean']:12.1f} {min(r['gbs']):9.1f} {max(r['gbs']):9.1f} "
            f"{max(r.get('us_host_sync') or [float('nan')]):13.1f}"
        )
    for name, why in result.get("skipped", {}).items():
        lines.append(f"{name}: skipped ({why})")
    return "\n".join(lines)
