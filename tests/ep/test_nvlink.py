"""The nvlink backend of ``ptxtrain.ep.Buffer``: its kernel's NVRTC build (CPU) and, on 2+ GPUs,
bit-exact agreement with the ``all_to_all`` backend (default and pipelined kernels, other knobs),
stale reads, one host sync per dispatch and none per combine, async mode, capacity, timeouts.

GPU tests (``multigpu``) spawn 2, 4 and 8 NCCL processes (as many GPUs as are visible), one GPU
each:

    python -m pytest tests/ep/test_nvlink.py -m multigpu
    # or, under torchrun (from the repository root):
    torchrun --nproc-per-node 2 -m tests.ep.test_nvlink

Inputs follow DeepEP's test method (its tests/test_intranode.py), reusing ``test_buffer``'s
rank-encoded scenarios (uneven and skewed loads, a rank with no tokens, a rank receiving
nothing, a rank sending nothing, several experts of a token on one rank).
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from ptxtrain.ep import Buffer, Config, EventOverlap
from ptxtrain.ep.nvlink import (
    DEFAULT_THREADS,
    DEFAULT_UNROLL,
    KERNEL_NAME,
    UNROLLS,
    check_send_sms,
    compile_kernel,
    kernel_source,
)
from ptxtrain.jit import nvrtc_available
from ptxtrain.quant.ref import per_token_cast_to_fp8
from tests._spawn import init_nccl, run_dist
from tests.ep.test_buffer import _check_exact, _expected, _scenario

NC_LOAD = "ld.global.nc.L1::no_allocate.L2::256B"

# --------------------------------------------------------------------------- CPU: NVRTC build


def test_kernel_source_is_the_packaged_cuh():
    """The kernel's source is the file in the CUDA include tree, which the wheel ships (the
    package-data globs of pyproject.toml match it), not a copy kept elsewhere."""
    import fnmatch
    import tomllib

    from ptxtrain.ep.nvlink import SOURCE_PATH
    from ptxtrain.jit import INCLUDE_DIR

    assert SOURCE_PATH.parent == INCLUDE_DIR / "ptxtrain" and SOURCE_PATH.suffix == ".cuh"
    assert kernel_source() == SOURCE_PATH.read_text(encoding="utf-8")
    assert "#include <ptxtrain/ptx.cuh>" in kernel_source()
    root = INCLUDE_DIR.parent
    pyproject = tomllib.loads((root.parent / "pyproject.toml").read_text(encoding="utf-8"))
    globs = pyproject["tool"]["setuptools"]["package-data"]["ptxtrain"]
    rel = SOURCE_PATH.relative_to(root).as_posix()
    assert any(fnmatch.fnmatch(rel, g) for g in globs), (rel, globs)


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-bindings) missing")
def test_kernel_compiles_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path))
    assert 'extern "C" __global__' in kernel_source() and KERNEL_NAME in kernel_source()
    builds = {a: compile_kernel(aggressive_ptx=a, keep_ptx=True) for a in (False, True)}
    for aggressive, k in builds.items():
        assert k.arch == "sm_90a" and k.cubin[:4] == b"\x7fELF", k.cubin[:4]
        assert k.symbol() == KERNEL_NAME  # extern "C": unmangled
        for instr in (
            "st.release.sys.global.s32",  # ready / freed flags
            "ld.relaxed.sys.global.s32",  # polling
            "fence.acq_rel.sys",  # acquire after polling, release before the flag store
            "st.global.L1::no_allocate.v4",  # row stores
            "%clock64",  # bounded waits
        ):
            assert instr in k.ptx, f"{instr} missing (aggressive={aggressive})"
        # The non-coherent path only behind the switch; otherwise coherent relaxed loads.
        assert (NC_LOAD in k.ptx) == aggressive
        assert ("ld.relaxed.gpu.global.v4" in k.ptx) == (not aggressive)
    assert builds[False].key != builds[True].key


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-bindings) missing")
def test_kernel_knobs_compile(tmp_path, monkeypatch):
    # Every knob combination the Buffer accepts builds (~0.1 s each).
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path))
    keys = set()
    for threads in (128, 256, 512, 1024):
        for unroll in UNROLLS:
            for pipeline in (False, True):
                k = compile_kernel(threads=threads, unroll=unroll, pipeline=pipeline, keep_ptx=True)
                assert f".maxntid {threads}" in k.ptx, (threads, unroll)
                assert k.symbol() == KERNEL_NAME
                keys.add(k.key)
    assert len(keys) == 4 * len(UNROLLS) * 2  # every knob reaches the build
    # The split variant (sender / receiver blocks, progress flags) and its rows per round.
    split = [compile_kernel(split=True, round_rows=r, keep_ptx=True) for r in (1, 2, 8)]
    for k in split:
        assert "st.release.sys.global.s64" in k.ptx and "ld.acquire.sys.global.s64" in k.ptx
    assert len({k.key for k in split} | keys) == len(keys) + 3
    # The fused combine (split receivers sum bf16 rows): builds, and only as a split variant.
    fused = compile_kernel(split=True, combine=True, threads=512, keep_ptx=True)
    assert "cvt.rn.bf16x2.f32" in fused.ptx and fused.key not in keys
    with pytest.raises(ValueError, match="split"):
        compile_kernel(combine=True)
    with pytest.raises(TypeError, match="pipeline"):
        compile_kernel(pipeline=1)
    with pytest.raises(TypeError, match="split"):
        compile_kernel(split=1)
    with pytest.raises(ValueError, match="round_rows"):
        compile_kernel(split=True, round_rows=0)
    with pytest.raises(ValueError, match="send_sms"):
        check_send_sms(24, 24)
    with pytest.raises(TypeError, match="send_sms"):
        check_send_sms(2.0, 24)
    assert check_send_sms(0, 24) == 0 and check_send_sms(23, 24) == 23
    assert check_send_sms(None, 24) == 12 and check_send_sms(None, 1) == 0  # the default
    # Buffer's defaults are the kernel's (one tuned value).
    assert (Config().nvl_threads, Config().nvl_unroll) == (DEFAULT_THREADS, DEFAULT_UNROLL)
    bad = [
        (500, 4, ValueError, "threads"),
        (2048, 4, ValueError, "threads"),
        (512.0, 4, TypeError, "threads"),
        (512, 3, ValueError, "unroll"),
        (512, 0, ValueError, "unroll"),
    ]
    for threads, unroll, exc, word in bad:
        with pytest.raises(exc, match=word):
            compile_kernel(threads=threads, unroll=unroll)


# --------------------------------------------------------------------------- GPU checks


def _cuda(t):
    return t.cuda() if isinstance(t, torch.Tensor) else tuple(a.cuda() for a in t)


def _cpu_parts(t):
    """A tensor or an (fp8, scales) pair as a tuple of CPU tensors."""
    return (t.detach().cpu(),) if isinstance(t, torch.Tensor) else tuple(a.cpu() for a in t)


def _same_outputs(name, got, want):
    """Dispatch outputs of two backends, exactly equal (bytes for FP8)."""
    for i, (g, w) in enumerate(zip(got[:3], want[:3])):
        for a, b in zip(_cpu_parts(g), _cpu_parts(w), strict=True):
            _check_exact(f"{name}[{i}]", a, b)
    assert got[3] == want[3], f"{name}: per-expert counts {got[3]} != {want[3]}"
    hg, hw = got[4], want[4]
    assert (hg.send_counts, hg.recv_counts) == (hw.send_counts, hw.recv_counts)
    for field in ("send_src_idx", "recv_src_rank", "recv_src_idx"):
        _check_exact(f"{name} handle.{field}", getattr(hg, field), getattr(hw, field))


def _compare(ref, buf, rank, world, seed, tokens, hidden, k, num_experts, *, fp8, **kw):
    """Dispatch, combine and their backward on ``buf`` vs ``ref``: bit-identical."""
    xs, idxs, ws = _scenario(world, seed, tokens, hidden, k, num_experts, **kw)
    idx, w = _cuda(idxs[rank]), _cuda(ws[rank])
    if fp8:
        q = [per_token_cast_to_fp8(x * 10) for x in xs]
        want = ref.dispatch(_cuda(q[rank]), topk_idx=idx, topk_weights=w, num_experts=num_experts)
        got = buf.dispatch(_cuda(q[rank]), topk_idx=idx, topk_weights=w, num_experts=num_experts)
        _same_outputs("fp8 dispatch", got, want)
        exp_q, *_ = _expected(rank, world, num_experts, [a for a, _ in q], idxs, ws)
        _check_exact("fp8 recv vs expected", got[0][0].cpu(), exp_q)
        return
    exp_x, *_ = _expected(rank, world, num_experts, xs, idxs, ws)
    outs, grads = [], []
    for b in (ref, buf):
        x = _cuda(xs[rank]).requires_grad_()
        wr = w.clone().requires_grad_()
        res = b.dispatch(x, topk_idx=idx, topk_weights=wr, num_experts=num_experts)
        _check_exact("fp32 recv vs expected", res[0].detach().cpu(), exp_x)
        g = torch.Generator(device="cuda").manual_seed(seed + rank)
        y_rows = res[0].bfloat16() * torch.rand(res[0].shape, generator=g, device="cuda")
        y_rows = y_rows.bfloat16()
        combined = b.combine(y_rows, res[4])[0]
        go = torch.randn(combined.shape, generator=g, device="cuda").bfloat16()
        ((combined.float() * go.float()).sum() + res[2].sum()).backward()
        outs.append((res, combined))
        grads.append((x.grad, wr.grad))
    (want, c_want), (got, c_got) = outs
    _same_outputs("dispatch", got, want)
    _check_exact("combine", c_got.detach().cpu(), c_want.detach().cpu())
    _check_exact("dx", grads[1][0].cpu(), grads[0][0].cpu())
    _check_exact("dw", grads[1][1].cpu(), grads[0][1].cpu())


def _check_scenarios(ref, buf, rank, world):
    e = 3 * world
    # Uneven loads, rank 1 has no tokens, the last rank receives nothing.
    _compare(ref, buf, rank, world, 1, [9, 0, 13, 5][:world], 16, 3, e, fp8=False,
             deaf_rank=world - 1)  # fmt: skip
    # Rank 0 sends nothing; top-3 of 3 local experts for token 0: one row per rank, not three.
    _compare(ref, buf, rank, world, 2, [6] * world, 16, 3, e, fp8=False, mute_rank=0)
    _compare(ref, buf, rank, world, 3, [10, 7, 4, 12][:world], 24, 4, e, fp8=False)
    # FP8 rows (H=200: 200 + 8 bytes, a partial 16-byte tail) and a DeepSeek-sized row.
    _compare(ref, buf, rank, world, 4, [6, 3, 8, 5][:world], 200, 2, e, fp8=True)
    _compare(ref, buf, rank, world, 5, [300, 700, 0, 64][:world], 7168, 8, 8 * world, fp8=True)
    _compare(ref, buf, rank, world, 6, [300, 700, 0, 64][:world], 2048, 8, 8 * world, fp8=False)


def _check_stale_reads(ref, buf, rank, world, iters=24):
    """Same buffers, new data (and every 3rd iteration a new layout) each time; every element
    of every output compared with the all_to_all backend each iteration."""
    hidden, tokens, e = 4096, 512, 8 * world
    g = torch.Generator(device="cuda").manual_seed(100 + rank)
    for it in range(iters):
        if it % 3 == 0:
            scores = torch.rand(tokens, e, generator=g, device="cuda")
            idx = scores.topk(4, dim=1).indices
            w = torch.rand(tokens, 4, generator=g, device="cuda")
        x = torch.randn(tokens, hidden, generator=g, device="cuda").bfloat16()
        x[:, 0], x[:, 1] = rank, it
        want = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e)
        got = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e)
        assert torch.equal(got[0], want[0]), f"iteration {it}: stale or wrong recv_x"
        assert torch.equal(got[2], want[2]), f"iteration {it}: stale or wrong weights"
        y = torch.randn(got[0].shape, generator=g, device="cuda").bfloat16()
        assert torch.equal(buf.combine(y, got[4])[0], ref.combine(y, want[4])[0]), f"iteration {it}"
        q = per_token_cast_to_fp8(x.float())
        fg, fw = (
            buf.dispatch(q, topk_idx=idx, topk_weights=w, num_experts=e),
            ref.dispatch(q, topk_idx=idx, topk_weights=w, num_experts=e),
        )
        assert torch.equal(fg[0][0].view(torch.uint8), fw[0][0].view(torch.uint8)), it
        assert torch.equal(fg[0][1], fw[0][1]), f"iteration {it}: fp8 scales"


def _check_epoch_restart(ref, rank, world):
    """The int32 sequence number restarts (flags zeroed on every rank) before it overflows: with
    the limit lowered to 5, the stale-read loop (at least 3 kernel launches per iteration: two
    dispatches and a combine) crosses many restarts, and every output must still match the
    all_to_all backend's."""
    for knobs in ({}, dict(nvl_pipeline=False, nvl_send_sms=0)):
        buf = Buffer(num_nvl_bytes=64 << 20, backend="nvlink", config=Config(24, **knobs))
        t = buf._transport
        t.epoch_limit = 5
        _check_stale_reads(ref, buf, rank, world, iters=12)
        assert t.epoch_restarts >= 6 and 1 <= t.epoch <= 5, (t.epoch_restarts, t.epoch)
        buf.check_errors()
        dist.barrier()


def _check_async(ref, buf, rank, world):
    e, hidden = 8 * world, 2048
    g = torch.Generator(device="cuda").manual_seed(7 + rank)
    idx = torch.rand(1024, e, generator=g, device="cuda").topk(4, dim=1).indices
    w = torch.rand(1024, 4, generator=g, device="cuda")
    x = torch.randn(1024, hidden, generator=g, device="cuda").bfloat16()
    want = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e)
    a = torch.randn(4096, 4096, device="cuda", generator=g)
    *got, event = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=e, async_finish=True)
    assert isinstance(event, EventOverlap)
    c = a @ a  # compute on the current stream while the side stream communicates
    del x  # the side stream still reads it: record_stream keeps its memory reserved
    junk = torch.full((1024, hidden), 7.0, device="cuda").bfloat16()  # may reuse freed blocks
    event.current_stream_wait()
    _same_outputs("async dispatch", got, want)
    y = torch.randn(got[0].shape, generator=g, device="cuda").bfloat16()
    out, _, event = buf.combine(y, got[4], async_finish=True)
    c = c @ a
    event.current_stream_wait()
    assert torch.equal(out, ref.combine(y, want[4])[0]), "async combine"
    assert torch.isfinite(c).all() and junk.sum() > 0


def _check_capacity(rank, world):
    # Dispatch rows: 16 fp32 values (64 B) + top-2 weights, topk_idx and the token index
    # (12·2 + 8 B) = 96 B: 4 rows per peer fit.
    row = 16 * 4 + 12 * 2 + 8
    hint = Buffer.nvl_bytes_hint(4, row, world)
    small = Buffer(num_nvl_bytes=hint, backend="nvlink", config=Config(2))
    xs, idxs, ws = _scenario(world, 30, [12] * world, 16, 2, 3 * world)
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        small.dispatch(
            _cuda(xs[rank]),
            topk_idx=_cuda(idxs[rank]),
            topk_weights=_cuda(ws[rank]),
            num_experts=3 * world,
        )
    # Raised on every rank before any launch: the buffer is still usable.
    xs, idxs, ws = _scenario(world, 31, [3] * world, 16, 2, 3 * world)
    got = small.dispatch(
        _cuda(xs[rank]),
        topk_idx=_cuda(idxs[rank]),
        topk_weights=_cuda(ws[rank]),
        num_experts=3 * world,
    )
    exp_x, *_ = _expected(rank, world, 3 * world, xs, idxs, ws)
    _check_exact("after overflow", got[0].cpu(), exp_x)


def _check_host_syncs(buf, rank, world):
    """One dispatch = ONE host sync (the copy of the exchanged counts); combine = none."""
    e = 8 * world
    g = torch.Generator(device="cuda").manual_seed(40 + rank)
    idx = torch.rand(256, e, generator=g, device="cuda").topk(4, dim=1).indices
    w = torch.rand(256, 4, generator=g, device="cuda")
    x = torch.randn(256, 512, generator=g, device="cuda").bfloat16()
    q = per_token_cast_to_fp8(x.float())
    buf.dispatch(q, topk_idx=idx, topk_weights=w, num_experts=e)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = buf.dispatch(q, topk_idx=idx, topk_weights=w, num_experts=e)
            n_dispatch = len(caught)
            buf.combine(res[0][0].float().bfloat16(), res[4])[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = ["synchroniz" in str(c.message) for c in caught]  # other warnings do not count
    assert (sum(syncs[:n_dispatch]), sum(syncs[n_dispatch:])) == (1, 0), [
        str(c.message)[:200] for c in caught
    ]


def _check_timeout(rank, world, pipeline, send_sms=0):
    buf = Buffer(
        num_nvl_bytes=1 << 16,
        backend="nvlink",
        config=Config(2, nvl_pipeline=pipeline, nvl_send_sms=send_sms),
        timeout_s=0.5,
    )
    if rank == 0:  # the peers never take part: the kernel must give up, and the host raise
        t = buf._transport
        rows = torch.zeros(0, 16, dtype=torch.uint8, device="cuda")
        i64 = torch.zeros(0, dtype=torch.int64, device="cuda")
        off = torch.zeros(world + 1, dtype=torch.int64, device="cuda")
        t.exchange(rows, i64, off, off, 0)
        if send_sms:  # no rows: nothing to wait for until the next operation's freed flags
            t.check_errors()
            t.exchange(rows, i64, off, off, 0)
        with pytest.raises(RuntimeError, match="timed out"):
            buf.check_errors()
    dist.barrier()


def _check_timeout_with_rows(rank, world):
    """Rank 0 alone exchanges real rows with rank 1 (split variant, 24 SMs, 4096 rows each
    way): its receivers wait for rows that never come. The launch must give up after about one
    timeout (a timed-out wait makes the later waits of the launch give up), not one per row."""
    buf = Buffer(num_nvl_bytes=64 << 20, backend="nvlink", config=Config(24), timeout_s=0.5)
    if rank == 0:
        t = buf._transport
        n = 4096
        rows = torch.randint(0, 255, (n, 1024), dtype=torch.uint8, device="cuda")
        send_row = torch.arange(n, device="cuda")
        off = torch.tensor([0, 0] + [n] * (world - 1), dtype=torch.int64, device="cuda")
        start = time.perf_counter()
        t.exchange(rows, send_row, off, off, n)
        with pytest.raises(RuntimeError, match="timed out"):
            buf.check_errors()
        # 4096 rows over 384 receiver warps: ~11 waits per warp, ~5.5 s if each waited
        assert time.perf_counter() - start < 4.0
    dist.barrier()


def _check_other_num_experts(ref, buf, rank: int, world: int) -> None:
    """One rank passing another num_experts: its count rows have other columns but the same
    (padded) size, so on NCCL, which does not check message sizes, every rank raises from the
    signature check; the group stays in step (a dispatch after it moves the right rows)."""
    g = torch.Generator().manual_seed(70 + rank)
    n_exp = 2 * world
    x = torch.randn(6, 16, generator=g).cuda()
    idx = torch.stack([torch.randperm(n_exp, generator=g)[:2] for _ in range(6)]).cuda()
    w = torch.rand(6, 2, generator=g).cuda()
    for b in (ref, buf):
        with pytest.raises(ValueError, match="num_experts"):
            b.dispatch(
                x,
                topk_idx=idx,
                topk_weights=w,
                num_experts=4 * n_exp if rank == world - 1 else n_exp,
            )
        recv_ref = ref.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=n_exp)[0]
        recv = b.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=n_exp)[0]
        assert torch.equal(recv, recv_ref)
    dist.barrier()


def _gpu_worker(rank: int, world: int) -> None:
    ref = Buffer(backend="all_to_all")
    with pytest.raises(ValueError, match="num_sms"):
        Buffer(backend="nvlink", config=Config(10_000))
    # Default knobs (the split variant, 12 + 12 SMs; at 1 SM the pipelined kernel), the
    # pipelined and barrier kernels, and other knobs (1 SM: one block per rank).
    configs = [(1, False, {}), (24, False, {}), (24, True, {})]
    configs += [(24, False, dict(nvl_send_sms=0)), (24, True, dict(nvl_send_sms=0))]
    no_pipe = dict(nvl_pipeline=False, nvl_send_sms=0)
    configs += [(1, False, no_pipe), (24, False, no_pipe)]
    configs += [(16, False, dict(nvl_threads=256, nvl_unroll=8))]
    # The split variant with 1 sender + 1 receiver block, and 8 senders + 16 receivers.
    configs += [(2, False, dict(nvl_send_sms=1)), (24, False, dict(nvl_send_sms=8))]
    for num_sms, aggressive, knobs in configs:
        buf = Buffer(
            num_nvl_bytes=64 << 20,
            backend="nvlink",
            config=Config(num_sms, **knobs),
            aggressive_ptx=aggressive,
        )
        _check_scenarios(ref, buf, rank, world)
        _check_stale_reads(ref, buf, rank, world)
        _check_host_syncs(buf, rank, world)
        buf.check_errors()  # waits for the last kernel
        dist.barrier()  # no rank frees a buffer a peer still writes to
    _check_epoch_restart(ref, rank, world)
    _check_other_num_experts(ref, buf, rank, world)
    _check_async(ref, buf, rank, world)
    _check_async(ref, ref, rank, world)  # async all_to_all on NCCL too
    _check_capacity(rank, world)
    buf.check_errors()
    _check_timeout(rank, world, pipeline=False)
    _check_timeout(rank, world, pipeline=True)
    _check_timeout(rank, world, pipeline=True, send_sms=1)
    _check_timeout_with_rows(rank, world)
    dist.barrier()


# --------------------------------------------------------------------------- NCCL processes


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_nvlink_matches_all_to_all(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    run_dist(_gpu_worker, world, timeout=600.0, backend="nccl")


if __name__ == "__main__":  # torchrun --nproc-per-node N -m tests.ep.test_nvlink
    init_nccl(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    try:
        _gpu_worker(dist.get_rank(), dist.get_world_size())
        print(f"rank {dist.get_rank()}: nvlink backend OK")
    finally:
        dist.destroy_process_group()
