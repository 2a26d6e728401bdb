"""What bounds the NVLink all-to-all kernel: raw GPU-to-GPU copy rates and the kernel alone.

    python -m benchmarks.diag_nvlink [--rows 8192] [--row-bytes 7392] [--sms 8,16,24,32,132]
        [--json OUT.json]

One process drives GPUs 0 and 1 (peer access enabled both ways; with unified addressing a kernel
on one GPU can load and store the other's memory through its pointer), so both GPUs' launches
come from one host thread and a ``torch.cuda._sleep`` at the head of each stream lets the host
queue every launch of a timed run before either GPU starts: no launch gap and no skew between the
GPUs enter the numbers. Each timed run is ``--iters`` back-to-back copies of ``rows`` rows of
``row_bytes`` (dispatch's FP8 row: 7168 + 224 scale bytes = 7392; combine's BF16 row: 14336);
the median of ``--repeats`` runs is reported as GB/s per direction.

Copies (``where``: ``push`` = local source, peer destination; ``pull`` = peer source, local
destination; ``local`` = both on the launching GPU; ``uni`` = GPU 0 only, ``bi`` = both GPUs at
once, each to the other):

- ``ce``: the copy engines (``Tensor.copy_`` between the GPUs: cudaMemcpyPeerAsync), no SMs.
- ``warp``: one warp per row, ``unroll`` 16-byte loads in flight per lane then their stores
  (the ``copy_row`` of ``ptxtrain.moe.nvlink``), ``ld`` = ``nc`` (``ld.global.nc``) or
  ``relaxed`` (``ld.relaxed.gpu``, what the kernel uses without ``aggressive_ptx``).
- ``bulk``: one lane per warp moves rows with the TMA's 1D bulk copies (``cp.async.bulk``
  global -> shared on an mbarrier, shared -> global as a bulk group), ``stages`` rows in flight
  per warp.

Then ``ptxtrain.moe.nvlink``'s kernel itself between the two GPUs, as ``Buffer.dispatch`` runs it
at EP2 (every token to both ranks: half the rows to itself, half to the peer; GB/s = logical rows
received / time, as ``ptxtrain bench dispatch`` reports), for the given SM counts and knobs.
Every copy is checked against its source once (exact bytes) before it is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

_DIAG = r"""
#include <ptxtrain/ptx.cuh>
#include <ptxtrain/tma.cuh>
using namespace ptxtrain;
#ifndef DIAG_UNROLL
#define DIAG_UNROLL 4
#endif
#ifndef DIAG_LD
#define DIAG_LD 0
#endif
#ifndef DIAG_STAGES
#define DIAG_STAGES 2
#endif

__device__ __forceinline__ int4 diag_ld(const int4* p) {
  int4 v;
#if DIAG_LD == 0
  asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
  asm volatile("ld.relaxed.gpu.global.v4.s32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
#endif
  return v;
}

extern "C" __global__ void __launch_bounds__(1024, 1) diag_warp(int4* dst, const int4* src,
                                                                int rows, int stride16) {
  const int lane = threadIdx.x & 31;
  const long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const long long step = (long long)gridDim.x * (blockDim.x >> 5);
  for (long long r = w; r < rows; r += step) {
    const int4* s = src + r * stride16;
    int4* d = dst + r * stride16;
    int j = lane;
    for (; j + 32 * (DIAG_UNROLL - 1) < stride16; j += 32 * DIAG_UNROLL) {
      int4 v[DIAG_UNROLL];
#pragma unroll
      for (int u = 0; u < DIAG_UNROLL; ++u) v[u] = diag_ld(s + j + 32 * u);
#pragma unroll
      for (int u = 0; u < DIAG_UNROLL; ++u) st_na_v4(d + j + 32 * u, v[u]);
    }
    for (; j < stride16; j += 32) st_na_v4(d + j, diag_ld(s + j));
  }
}

// One lane per warp: DIAG_STAGES shared-memory slots of one row each, loads issued
// DIAG_STAGES - 1 rows ahead of the store.
extern "C" __global__ void __launch_bounds__(1024, 1) diag_bulk(char* dst, const char* src,
                                                                int rows, int row_bytes) {
  extern __shared__ __align__(128) char smem[];
  const int warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int slot = (row_bytes + 127) / 128 * 128;
  char* stage = smem + (long long)warp * DIAG_STAGES * slot;
  u64* bars = reinterpret_cast<u64*>(smem + (long long)nwarps * DIAG_STAGES * slot) +
              warp * DIAG_STAGES;
  if ((threadIdx.x & 31) != 0) return;
  for (int s = 0; s < DIAG_STAGES; ++s) mbarrier_init(bars + s, 1);
  fence_mbarrier_init();
  const long long w = (long long)blockIdx.x * nwarps + warp;
  const long long step = (long long)gridDim.x * nwarps;
  const long long n = w < rows ? (rows - 1 - w) / step + 1 : 0;  // rows of this warp
  for (long long i = 0; i < n && i < DIAG_STAGES - 1; ++i) {
    mbarrier_arrive_expect_tx(bars + i, row_bytes);
    bulk_load_1d(stage + i * slot, src + (w + i * step) * row_bytes, row_bytes, bars + i);
  }
  for (long long i = 0; i < n; ++i) {
    const int s = i % DIAG_STAGES;
    mbarrier_wait(bars + s, (i / DIAG_STAGES) & 1);
    bulk_store_1d(dst + (w + i * step) * row_bytes, stage + s * slot, row_bytes);
    tma_store_commit_group();
    const long long next = i + DIAG_STAGES - 1;
    if (next < n) {
      tma_store_wait_read<1>();  // store i - 1 (the slot's last) has read it; i may still run
      const int t = next % DIAG_STAGES;
      mbarrier_arrive_expect_tx(bars + t, row_bytes);
      bulk_load_1d(stage + t * slot, src + (w + next * step) * row_bytes, row_bytes, bars + t);
    }
  }
  tma_store_wait<0>();
}
"""


def _enable_peer_access(a: int, b: int) -> None:
    from cuda.bindings import runtime as rt

    for me, peer in ((a, b), (b, a)):
        rt.cudaSetDevice(me)
        err = rt.cudaDeviceEnablePeerAccess(peer, 0)[0]
        if err not in (
            rt.cudaError_t.cudaSuccess,
            rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled,
        ):
            raise RuntimeError(f"cudaDeviceEnablePeerAccess({me} -> {peer}): {err}")
    torch.cuda.set_device(a)


_KERNELS: dict = {}


def _bound(kind: str, dev: int, unroll: int = 4, ld: str = "nc", stages: int = 2, block=1024):
    from ptxtrain.jit import BoundLaunch, compile_cuda, load_kernel

    key = (kind, dev, unroll, ld, stages, block)
    if key not in _KERNELS:
        flags = (
            f"-DDIAG_UNROLL={unroll}",
            f"-DDIAG_LD={0 if ld == 'nc' else 1}",
            f"-DDIAG_STAGES={stages}",
        )
        name = f"diag_{kind}"
        with torch.cuda.device(dev):
            k = load_kernel(compile_cuda(_DIAG, name=name, flags=flags))
            smem = 0
            if kind == "bulk":
                slot = -(-block[1] // 128) * 128
                smem = (block[0] // 32) * stages * (slot + 8)
            _KERNELS[key] = (BoundLaunch(k, "ppii", block[0], smem_bytes=smem), smem)
    return _KERNELS[key][0]


def _timed(launchers: list, iters: int, repeats: int) -> float:
    """Median ms of ``iters`` back-to-back calls of each ``(device, fn)``, all devices at once
    (each stream starts with a sleep so the host queues everything first)."""
    devs = [d for d, _ in launchers]
    times = []
    for rep in range(repeats + 1):
        for d in devs:
            torch.cuda.synchronize(d)
        starts, ends = [], []
        for d, _ in launchers:
            with torch.cuda.device(d):
                torch.cuda._sleep(int(1e7))  # ~5 ms head start for the host
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                starts.append(e)
        for _ in range(iters):
            for d, fn in launchers:
                with torch.cuda.device(d):
                    fn()
        for d, _ in launchers:
            with torch.cuda.device(d):
                e = torch.cuda.Event(enable_timing=True)
                e.record()
                ends.append(e)
        for d in devs:
            torch.cuda.synchronize(d)
        if rep:  # the first run warms up
            times.append(max(s.elapsed_time(e) for s, e in zip(starts, ends)))
    return statistics.median(times)


def _copies(rows: int, row_bytes: int, sms: list[int], iters: int, repeats: int) -> list[dict]:
    n = rows * row_bytes
    buf = {
        d: (
            torch.randint(0, 255, (n,), dtype=torch.uint8, device=f"cuda:{d}"),
            torch.empty(n, dtype=torch.uint8, device=f"cuda:{d}"),
        )
        for d in (0, 1)
    }
    out = []

    def pairs(where: str, d: int):  # (dst, src) of a copy launched on GPU d
        p = 1 - d
        return {
            "push": (buf[p][1], buf[d][0]),
            "pull": (buf[d][1], buf[p][0]),
            "local": (buf[d][1], buf[d][0]),
        }[where]

    def record(kind, where, direction, knobs, ms):
        gbs = n * iters / (ms * 1e-3) / 1e9
        row = dict(kind=kind, where=where, dir=direction, **knobs, ms=ms, gbs=gbs)
        out.append(row)
        print(
            f"{kind:5} {where:5} {direction:3} {json.dumps(knobs):48} {gbs:8.1f} GB/s", flush=True
        )

    for direction in ("uni", "bi"):
        devs = (0,) if direction == "uni" else (0, 1)
        fns = []
        for d in devs:
            dst, src = pairs("push", d)
            fns.append((d, lambda dst=dst, src=src: dst.copy_(src, non_blocking=True)))
        record("ce", "push", direction, {}, _timed(fns, iters, repeats))

    configs = [("warp", dict(unroll=4, ld="nc", block=1024))]
    configs += [("warp", dict(unroll=8, ld="nc", block=1024))]
    configs += [("warp", dict(unroll=4, ld="relaxed", block=1024))]
    configs += [("warp", dict(unroll=4, ld="nc", block=512))]
    configs += [("bulk", dict(stages=2, block=256)), ("bulk", dict(stages=3, block=256))]
    configs += [("bulk", dict(stages=2, block=512))]
    checked = set()
    for kind, knobs in configs:
        for where in ("push", "pull", "local"):
            for direction in ("uni", "bi"):
                if where == "local" and direction == "bi":
                    continue
                for g in sms:
                    devs = (0,) if direction == "uni" else (0, 1)
                    fns = []
                    for d in devs:
                        dst, src = pairs(where, d)
                        block = (knobs["block"], row_bytes)
                        slot = -(-row_bytes // 128) * 128
                        if (
                            kind == "bulk"
                            and (block[0] // 32) * knobs["stages"] * (slot + 8) > 227 * 1024
                        ):
                            continue
                        bl = _bound(
                            kind,
                            d,
                            knobs.get("unroll", 4),
                            knobs.get("ld", "nc"),
                            knobs.get("stages", 2),
                            block,
                        )
                        arg = row_bytes // 16 if kind == "warp" else row_bytes
                        fns.append(
                            (
                                d,
                                lambda bl=bl, dst=dst, src=src, g=g, arg=arg: bl(
                                    g, dst.data_ptr(), src.data_ptr(), rows, arg
                                ),
                            )
                        )
                    if len(fns) != len(devs):
                        continue
                    ck = (kind, json.dumps(knobs), where)
                    if ck not in checked:
                        for d, _ in fns:
                            pairs(where, d)[0].zero_()
                        for d, fn in fns:
                            with torch.cuda.device(d):
                                fn()
                        for d, _ in fns:
                            torch.cuda.synchronize(d)
                            dst, src = pairs(where, d)
                            if not torch.equal(dst.cpu(), src.cpu()):
                                raise RuntimeError(f"{kind} {knobs} {where}: copy is wrong")
                        checked.add(ck)
                    record(kind, where, direction, dict(knobs, sms=g), _timed(fns, iters, repeats))
    return out


def _exchange(
    rows: int,
    row_bytes: int,
    sms: list[int],
    iters: int,
    repeats: int,
    before: str | None,
    split: list[int],
    round_rows: list[int],
) -> list[dict]:
    """The nvlink kernel at EP2 between GPUs 0 and 1, every row to both ranks; with ``before``
    (a path to an earlier ``ptxtrain/moe/nvlink.py``) its kernel too, as ``version="before"``."""
    import importlib.util

    from ptxtrain.jit import BoundLaunch, load_kernel
    from ptxtrain.moe import nvlink

    modules = {"now": nvlink}
    if before:
        spec = importlib.util.spec_from_file_location("nvlink_before", before)
        modules["before"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["before"])
    out = []
    stride = -(-row_bytes // 16) * 16
    tokens = rows // 2
    base = dict(threads=1024, unroll=4, pipeline=True, aggressive=False, send=0)
    knob_sets = [dict(base, version=v) for v in modules]
    knob_sets += [dict(base, version="now", pipeline=False)]
    for send in split:
        for rr in round_rows:
            knob_sets += [dict(base, version="now", send=send, round_rows=rr)]
    src = {
        d: torch.randint(0, 255, (tokens, stride), dtype=torch.uint8, device=f"cuda:{d}")
        for d in (0, 1)
    }
    for knobs in knob_sets:
        mod = modules[knobs["version"]]
        new = hasattr(mod, "flag_bytes")  # the split variant's signature and flag area
        signature = getattr(mod, "_SIGNATURE", "ppipipppiiiqqiqp")
        n_extra = len(signature) - len("ppipipppiiiqqiqp")  # send_blocks[, slot, hidden]
        for g in sms:
            if knobs["send"] >= g:
                continue
            data_offset = mod.flag_bytes(2, g) if new else -(-4 * (2 * 2 * g) // 256) * 256
            cap = tokens
            bufs = {
                d: torch.zeros(
                    data_offset + 2 * cap * stride, dtype=torch.uint8, device=f"cuda:{d}"
                )
                for d in (0, 1)
            }
            bases = [bufs[0].data_ptr(), bufs[1].data_ptr()]
            state = {"epoch": 0}
            per_dev = {}
            for d in (0, 1):
                with torch.cuda.device(d):
                    extra = {}
                    if knobs["send"]:
                        extra = dict(split=True, round_rows=knobs["round_rows"])
                    k = load_kernel(
                        mod.compile_kernel(
                            knobs["aggressive"],
                            threads=knobs["threads"],
                            unroll=knobs["unroll"],
                            pipeline=knobs["pipeline"],
                            **extra,
                        )
                    )
                    dev = f"cuda:{d}"
                    per_dev[d] = dict(
                        bound=BoundLaunch(k, signature, knobs["threads"]),
                        send_row=torch.cat([torch.arange(tokens), torch.arange(tokens)]).to(dev),
                        off=torch.tensor([0, tokens, 2 * tokens], dtype=torch.int64, device=dev),
                        bases=torch.tensor(bases, dtype=torch.int64, device=dev),
                        out=torch.empty(2 * tokens, stride, dtype=torch.uint8, device=dev),
                        err=torch.zeros(1, dtype=torch.int32, device=dev),
                    )

            def step(
                d,
                g=g,
                per_dev=per_dev,
                state=state,
                data_offset=data_offset,
                cap=cap,
                send=knobs["send"],
                n_extra=n_extra,
            ):
                p = per_dev[d]
                if d == 0:
                    state["epoch"] += 1
                p["bound"](
                    g,
                    src[d].data_ptr(),
                    p["send_row"].data_ptr(),
                    2 * tokens,
                    p["out"].data_ptr(),
                    2 * tokens,
                    p["off"].data_ptr(),
                    p["off"].data_ptr(),
                    p["bases"].data_ptr(),
                    d,
                    2,
                    stride // 16,
                    cap,
                    data_offset,
                    state["epoch"],
                    int(2e10),
                    p["err"].data_ptr(),
                    *((send, 0, 0)[:n_extra]),
                )

            fns = [(0, lambda step=step: step(0)), (1, lambda step=step: step(1))]
            for d, fn in fns:
                with torch.cuda.device(d):
                    fn()
            for d in (0, 1):
                torch.cuda.synchronize(d)
                o = per_dev[d]["out"]
                # grouped by source rank: rank 0's rows, then rank 1's, on both GPUs
                if not (
                    torch.equal(o[:tokens].cpu(), src[0].cpu())
                    and torch.equal(o[tokens:].cpu(), src[1].cpu())
                ):
                    raise RuntimeError(f"exchange {knobs} sms={g}: wrong rows on GPU {d}")
                if int(per_dev[d]["err"].item()):
                    raise RuntimeError(f"exchange {knobs} sms={g}: kernel error")
            ms = _timed(fns, iters, repeats)
            recv = 2 * tokens * row_bytes  # logical bytes received per rank per call
            gbs = recv * iters / (ms * 1e-3) / 1e9
            us = ms * 1e3 / iters
            out.append(dict(kind="exchange", **knobs, sms=g, us=us, gbs=gbs))
            print(
                f"exchange {json.dumps(knobs):95} sms={g:3} {us:8.1f} us {gbs:8.1f} GB/s",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--row-bytes", type=int, default=7392)
    ap.add_argument("--sms", default="8,16,24,32,132")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-copies", action="store_true")
    ap.add_argument("--split", default="4,8,12", help="sender SMs of the split variant to time")
    ap.add_argument("--round-rows", default="1,2,4", help="the split variant's rows per round")
    ap.add_argument("--before", default=None, help="an earlier ptxtrain/moe/nvlink.py to compare")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs", file=sys.stderr)
        return 2
    if args.row_bytes % 16:
        raise ValueError(f"--row-bytes must be a multiple of 16, got {args.row_bytes}")
    _enable_peer_access(0, 1)
    sms = [int(s) for s in args.sms.split(",")]
    from ptxtrain.bench.timing import environment

    rows = (
        []
        if args.skip_copies
        else _copies(args.rows, args.row_bytes, sms, args.iters, args.repeats)
    )
    split = [int(v) for v in args.split.split(",") if v]
    round_rows = [int(v) for v in args.round_rows.split(",") if v]
    rows += _exchange(
        args.rows, args.row_bytes, sms, args.iters, args.repeats, args.before, split, round_rows
    )
    record = dict(
        bench="diag_nvlink",
        env=environment(),
        rows_per_copy=args.rows,
        row_bytes=args.row_bytes,
        iters=args.iters,
        repeats=args.repeats,
        rows=rows,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
