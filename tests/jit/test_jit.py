"""Tests of ptxtrain.jit: NVRTC compiles of every header for sm_90a (PTX and, where cuobjdump is
available, SASS), the disk cache (hits, key changes, atomic writes, corrupt entries, one compile
across processes), error reporting, and launching (GPU-marked; without a driver: clear errors)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest
import torch

from ptxtrain.jit import (
    BoundLaunch,
    CompiledKernel,
    JitCompileError,
    LoadedKernel,
    compile_cuda,
    driver_available,
    launch,
    load_kernel,
    make_tma_2d_desc,
    nvrtc_available,
    tma_2d_params,
)
from ptxtrain.jit import cache as jit_cache

pytestmark = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-bindings) missing")

_ENV = (
    "PTXTRAIN_JIT_CACHE_DIR",
    "PTXTRAIN_JIT_DEBUG",
    "PTXTRAIN_JIT_DUMP_PTX",
    "PTXTRAIN_JIT_DUMP_SASS",
    "PTXTRAIN_JIT_DISABLE_CACHE",
)

# A kernel touching every wrapper of every header (it is compiled, never run).
TOY_SOURCE = r"""
#include <ptxtrain/ptx.cuh>
#include <ptxtrain/mbarrier.cuh>
#include <ptxtrain/wgmma.cuh>
#include <ptxtrain/tma.cuh>
using namespace ptxtrain;

extern "C" __global__ void __launch_bounds__(128) toy(
    const int4* __restrict__ src, int4* dst, float* f, unsigned short* q, int* flag,
    const __grid_constant__ TmaDescriptor tmap) {
  __shared__ alignas(1024) unsigned char tile[64 * 32 + 128 * 32];
  __shared__ u64 bar;
  const int i = threadIdx.x;
  if (i == 0) { tma_prefetch_desc(&tmap); mbarrier_init(&bar, 1); fence_mbarrier_init(); }
  __syncthreads();
  if (i == 0) {
    mbarrier_arrive_expect_tx(&bar, 64 * 32);
    tma_load_2d(tile, &tmap, &bar, 0, blockIdx.x);
  }
  mbarrier_wait(&bar, 0);
  st_na_v4(dst + i, ld_nc_v4(src + i));
  q[i] = cvt_e4m3x2(f[i], ld_nc_f32(f + i + 128));
  float d[64];
  for (int j = 0; j < 64; ++j) d[j] = 0.f;
  const u64 da = make_smem_desc(tile, 16, 256, SmemSwizzle::kNone);
  const u64 db = make_smem_desc(tile + 64 * 32, 16, 256, SmemSwizzle::kNone);
  wgmma_fence();
  wgmma_m64n128k32_f32_e4m3(d, da, db, false);
  wgmma_commit_group();
  wgmma_wait_group<0>();
  float s = 0.f;
  for (int j = 0; j < 64; ++j) s += d[j];
  f[i] = s;
  fence_proxy_async_shared_cta();
  if (i == 0) {
    tma_store_2d(&tmap, tile, 0, blockIdx.x);
    tma_store_commit_group();
    tma_store_wait_read<0>();
    st_release_sys(flag, 1);
    while (ld_acquire_sys(flag + 1) == 0) {}
  }
}

template <int kRegs>
__global__ void __launch_bounds__(384, 1) regs_kernel(int* out) {
  if (threadIdx.x < 128) { setmaxnreg_dec<40>(); } else { setmaxnreg_inc<kRegs>(); }
  out[threadIdx.x] = threadIdx.x;
}
"""

# Instructions every build of TOY_SOURCE must contain (PTX spelling).
PTX_ALWAYS = (
    "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3",
    "wgmma.fence.sync.aligned",
    "wgmma.commit_group.sync.aligned",
    "wgmma.wait_group.sync.aligned",
    "mbarrier.init.shared::cta.b64",
    "mbarrier.arrive.expect_tx.shared::cta.b64",
    "mbarrier.try_wait.parity.shared::cta.b64",
    "fence.mbarrier_init.release.cluster",
    "cvt.rn.satfinite.e4m3x2.f32",
    "fence.proxy.async.shared::cta",
    "setmaxnreg.inc.sync.aligned.u32",
    "setmaxnreg.dec.sync.aligned.u32",
    "st.global.L1::no_allocate.v4",
    "st.release.sys.global",
    "ld.acquire.sys.global",
    "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes",
    "cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group",
    "prefetch.tensormap",
)
NC_LOAD = "ld.global.nc.L1::no_allocate.L2::256B"
TOY_EXPRS = ("toy", "regs_kernel<232>")


@pytest.fixture(autouse=True)
def _isolated_jit_env(tmp_path, monkeypatch):
    """Each test gets its own cache directory and no JIT env flags from the caller."""
    for var in _ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path / "jit-cache"))


@pytest.fixture(scope="module")
def toy_builds(tmp_path_factory) -> dict[bool, CompiledKernel]:
    """TOY_SOURCE compiled once per module, default and with PTXTRAIN_AGGRESSIVE_PTX."""
    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path_factory.mktemp("toy-cache")))
        return {
            aggressive: compile_cuda(
                TOY_SOURCE,
                name="toy",
                flags=("-DPTXTRAIN_AGGRESSIVE_PTX",) if aggressive else (),
                name_expressions=TOY_EXPRS,
                keep_ptx=True,
            )
            for aggressive in (False, True)
        }


def _fresh_source(tag: str = "") -> str:
    """A tiny distinct kernel per call, so cache tests never share keys."""
    return (
        f"// {tag} {uuid.uuid4().hex}\n"
        '#include <ptxtrain/ptx.cuh>\nextern "C" __global__ void add1(float* x) {\n'
        "  x[threadIdx.x] = ptxtrain::ld_nc_f32(x + threadIdx.x) + 1.f;\n}\n"
    )


def _fresh_memory() -> None:
    """Forget in-memory entries, as a new process would."""
    jit_cache._cache_for.cache_clear()


# ---- headers -> PTX / SASS -----------------------------------------------------------------------


@pytest.mark.parametrize("aggressive", [False, True])
def test_toy_ptx_has_every_instruction(toy_builds, aggressive):
    ptx = toy_builds[aggressive].ptx
    assert ptx is not None and ".target sm_90a" in ptx
    missing = [ins for ins in PTX_ALWAYS if ins not in ptx]
    assert not missing, f"{aggressive=}: instructions missing from the PTX: {missing}"
    # The non-coherent load appears only behind the switch; the default is a coherent relaxed load.
    assert (NC_LOAD in ptx) == aggressive, f"{aggressive=}"
    assert ("ld.relaxed.gpu.global" in ptx) == (not aggressive), f"{aggressive=}"


def test_toy_cubin_and_symbols(toy_builds):
    build = toy_builds[False]
    assert build.cubin.startswith(b"\x7fELF")
    assert build.symbol() == "toy" == build.symbol("toy")  # extern "C": unmangled
    mangled = build.symbol("regs_kernel<232>")
    assert mangled.startswith("_Z") and "regs_kernel" in mangled
    with pytest.raises(ValueError, match="regs_kernel<8>"):
        build.symbol("regs_kernel<8>")


@pytest.mark.skipif(jit_cache.find_cuobjdump() is None, reason="no cuobjdump (Triton wheel) here")
@pytest.mark.parametrize("aggressive", [False, True])
def test_toy_sass(toy_builds, tmp_path, aggressive):
    cubin = tmp_path / "toy.cubin"
    cubin.write_bytes(toy_builds[aggressive].cubin)
    res = subprocess.run(
        [jit_cache.find_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    sass = res.stdout
    for op in ("QGMMA.64x128x32.F32.E4M3.E4M3", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "UTMALDG.2D"):
        assert op in sass, f"{aggressive=}: {op} missing from SASS"
    assert "F2FP.SATFINITE.E4M3.F32.PACK" in sass
    assert "USETMAXREG" in sass
    assert "STG.E.NA.128" in sass
    nc = re.findall(r"LDG\.E\.NA\.LTC256B[.\w]*\.CONSTANT", sass)
    assert bool(nc) == aggressive, f"{aggressive=}: {nc}"


# ---- cache -------------------------------------------------------------------------------------


def test_cache_memory_then_disk_hit():
    src = _fresh_source()
    first = compile_cuda(src, name="add1")
    second = compile_cuda(src, name="add1")
    _fresh_memory()
    third = compile_cuda(src, name="add1")
    assert (first.how, second.how, third.how) == ("compiled", "memory", "disk")
    assert first.key == second.key == third.key
    assert first.cubin == third.cubin
    assert first.cache_path is not None and (first.cache_path / "kernel.cubin").is_file()
    assert first.ptx is None  # not kept unless asked for


def test_cache_key_changes_with_flags_and_arch():
    src = _fresh_source()
    base = compile_cuda(src, name="add1")
    flagged = compile_cuda(src, name="add1", flags=("-DPTXTRAIN_AGGRESSIVE_PTX",), keep_ptx=True)
    other_arch = compile_cuda(src, name="add1", arch="sm_90")
    assert len({base.key, flagged.key, other_arch.key}) == 3
    assert flagged.how == other_arch.how == "compiled"
    assert NC_LOAD in flagged.ptx


def test_cache_key_changes_when_a_header_changes(tmp_path, monkeypatch):
    # Extra include directories: editing a header there recompiles.
    inc = tmp_path / "inc"
    inc.mkdir()
    (inc / "extra.cuh").write_text("#define EXTRA_VALUE 1.0f\n")
    src = _fresh_source() + '#include "extra.cuh"\n'
    before = compile_cuda(src, name="add1", include_dirs=[inc])
    (inc / "extra.cuh").write_text("#define EXTRA_VALUE 2.0f\n")
    after = compile_cuda(src, name="add1", include_dirs=[inc])
    assert before.key != after.key and after.how == "compiled"
    # ptxtrain/include itself: a one-byte edit of a copy changes the header hash.
    copy = tmp_path / "include"
    shutil.copytree(jit_cache.INCLUDE_DIR, copy)
    monkeypatch.setattr(jit_cache, "INCLUDE_DIR", copy)
    h0 = jit_cache.hash_headers()
    with open(copy / "ptxtrain" / "ptx.cuh", "a") as f:
        f.write("\n")
    assert jit_cache.hash_headers() != h0


def test_atomic_write_keeps_old_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "d" / "blob.bin"
    old = os.urandom(1000)
    jit_cache.atomic_write_bytes(target, old)
    assert target.read_bytes() == old

    def boom(fd):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(jit_cache.os, "fsync", boom)
    with pytest.raises(OSError, match="simulated"):
        jit_cache.atomic_write_bytes(target, os.urandom(1000))
    assert target.read_bytes() == old  # the reader still sees the complete old file
    assert sorted(p.name for p in target.parent.iterdir()) == ["blob.bin"]  # no temp left


@pytest.mark.parametrize("damage", ["truncate", "garbage", "checksum", "meta", "ptx"])
def test_corrupt_entry_is_rebuilt(damage):
    src = _fresh_source(damage)
    good = compile_cuda(src, name="add1", keep_ptx=True)
    entry = good.cache_path
    cubin = entry / "kernel.cubin"
    if damage == "truncate":
        cubin.write_bytes(good.cubin[: len(good.cubin) // 2])
    elif damage == "garbage":
        cubin.write_bytes(os.urandom(len(good.cubin)))
    elif damage == "checksum":
        meta = json.loads((entry / "meta.json").read_text())
        meta["cubin_sha256"] = hashlib.sha256(b"something else").hexdigest()
        (entry / "meta.json").write_text(json.dumps(meta))
    elif damage == "meta":
        (entry / "meta.json").write_text("{not json")
    else:  # a truncated PTX (what keep_ptx hands out) with an intact cubin
        (entry / "kernel.ptx").write_text(good.ptx[: len(good.ptx) // 2])
    _fresh_memory()
    rebuilt = compile_cuda(src, name="add1", keep_ptx=True)
    assert rebuilt.how == "compiled", damage
    assert rebuilt.cubin == good.cubin and rebuilt.ptx == good.ptx
    assert cubin.read_bytes() == good.cubin  # the entry on disk is repaired
    assert (entry / "kernel.ptx").read_text() == good.ptx
    _fresh_memory()
    assert compile_cuda(src, name="add1").how == "disk"


def test_disable_cache_and_dump_env(monkeypatch, tmp_path):
    src = _fresh_source()
    monkeypatch.setenv("PTXTRAIN_JIT_DISABLE_CACHE", "1")
    a = compile_cuda(src, name="add1")
    b = compile_cuda(src, name="add1")
    assert a.how == b.how == "compiled" and a.cache_path is None
    assert not (tmp_path / "jit-cache").exists()
    monkeypatch.delenv("PTXTRAIN_JIT_DISABLE_CACHE")
    monkeypatch.setenv("PTXTRAIN_JIT_DUMP_PTX", "1")
    monkeypatch.setenv("PTXTRAIN_JIT_DUMP_SASS", "1")
    c = compile_cuda(src, name="add1")
    assert c.ptx is not None and (c.cache_path / "kernel.ptx").read_text() == c.ptx
    if jit_cache.find_cuobjdump() is not None:
        assert "LDG" in (c.cache_path / "kernel.sass").read_text()


def _compile_in_child(src: str, log_path: str, barrier, results) -> None:
    with open(log_path, "w") as log:
        sys.stderr = log  # debug events of this process
        _fresh_memory()
        barrier.wait()
        built = compile_cuda(src, name="add1")
        results.put((built.how, hashlib.sha256(built.cubin).hexdigest()))
        log.flush()
        sys.stderr = sys.__stderr__


def test_four_processes_compile_once(tmp_path, monkeypatch):
    monkeypatch.setenv("PTXTRAIN_JIT_DEBUG", "1")
    src = _fresh_source("mp")
    ctx = mp.get_context("fork")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    logs = [tmp_path / f"child{i}.log" for i in range(4)]
    procs = [
        ctx.Process(target=_compile_in_child, args=(src, str(log), barrier, results))
        for log in logs
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    outcomes = [results.get(timeout=5) for _ in procs]
    assert sorted(how for how, _ in outcomes) == ["compiled", "disk", "disk", "disk"]
    assert len({digest for _, digest in outcomes}) == 1
    text = "".join(log.read_text() for log in logs)
    assert len(re.findall(r"\] compile key=", text)) == 1, text
    assert len(re.findall(r"\] disk hit", text)) == 3, text


# ---- errors --------------------------------------------------------------------------------------


def test_compile_error_names_kernel_and_has_log():
    src = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_thing_42; }\n'
    with pytest.raises(JitCompileError) as info:
        compile_cuda(src, name="broken")
    err = info.value
    assert err.name == "broken" and "'broken'" in str(err)
    assert "undefined_thing_42" in err.log and "undefined_thing_42" in str(err)
    assert "-arch=sm_90a" in str(err)
    # The generated source is saved for inspection and its path is in the message.
    assert err.source_path is not None and f"generated source: {err.source_path}" in str(err)
    saved = err.source_path.read_text()
    assert saved.endswith(src) and "// nvrtc option: -arch=sm_90a" in saved
    assert "// name expression: broken" in saved


def test_compile_error_source_path_without_the_cache(monkeypatch, tmp_path):
    # PTXTRAIN_JIT_DISABLE_CACHE writes nothing to the cache: the source goes to the temp dir.
    monkeypatch.setenv("PTXTRAIN_JIT_DISABLE_CACHE", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    src = 'extern "C" __global__ void broken2(float* x) { x[0] = undefined_thing_43; }\n'
    with pytest.raises(JitCompileError) as info:
        compile_cuda(src, name="broken2")
    path = info.value.source_path
    assert path is not None and path.parent == tmp_path / "ptxtrain-jit-failed"
    assert path.read_text().endswith(src)


def test_ptxas_error_is_reported():
    src = 'extern "C" __global__ void badasm() { asm volatile("not.an.instruction;"); }\n'
    with pytest.raises(JitCompileError, match="badasm") as info:
        compile_cuda(src, name="badasm")
    assert "not.an.instruction" in info.value.log or "ptxas" in info.value.log


def test_missing_kernel_symbol_fails_at_compile_time():
    src = 'extern "C" __global__ void present(float* x) { x[0] = 1.f; }\n'
    with pytest.raises(JitCompileError, match="absent"):
        compile_cuda(src, name="absent")


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"name": "9bad"}, ValueError, "name"),
        ({"name": "k", "arch": "sm90"}, ValueError, "arch"),
        ({"name": "k", "flags": "-O3"}, TypeError, "flags"),
        ({"name": "k", "name_expressions": [1]}, TypeError, "name_expressions"),
        ({"name": "k", "include_dirs": ["/nonexistent/dir/xyz"]}, ValueError, "include_dirs"),
    ],
)
def test_compile_cuda_validates_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        compile_cuda(_fresh_source(), **kwargs)


# ---- launch without a driver / TMA parameter rules ----------------------------------------------


@pytest.mark.skipif(driver_available(), reason="a CUDA driver is present")
def test_launch_without_driver_raises_clearly(toy_builds):
    with pytest.raises(RuntimeError, match="CUDA driver"):
        load_kernel(toy_builds[False])
    fake = LoadedKernel(function=None, module=None, symbol="toy", device=0)
    with pytest.raises(RuntimeError, match="CUDA driver"):
        launch(fake, 1, 128, [ctypes.c_int32(3)])
    with pytest.raises(ValueError, match="CUDA tensor"):
        make_tma_2d_desc(torch.zeros(64, 64, dtype=torch.uint8), 64, 64)


def test_launch_validates_before_touching_the_driver():
    fake = LoadedKernel(function=None, module=None, symbol="toy", device=0)
    with pytest.raises(ValueError, match="grid"):
        launch(fake, (0, 1), 128, [])
    with pytest.raises(ValueError, match="cluster"):
        launch(fake, (3, 1), 128, [], cluster=(2, 1, 1))
    with pytest.raises(ValueError, match="CUDA tensor"):
        launch(fake, 1, 128, [torch.randn(4)])
    with pytest.raises(TypeError, match="args"):
        launch(fake, 1, 128, [object()])


def test_tma_2d_params_rules():
    p = tma_2d_params((512, 384), (384, 1), 1, 64, 128, swizzle="128B")
    assert p.global_dim == (384, 512) and p.global_strides == (384,) and p.box_dim == (128, 64)
    with pytest.raises(ValueError, match="strides"):
        tma_2d_params((512, 384), (1, 512), 1, 64, 128)  # column-major
    with pytest.raises(ValueError, match="16 bytes"):
        tma_2d_params((512, 100), (100, 1), 1, 64, 64)  # 100-B rows
    with pytest.raises(ValueError, match="box_rows"):
        tma_2d_params((512, 384), (384, 1), 1, 512, 64)
    with pytest.raises(ValueError, match="box_cols"):
        tma_2d_params((512, 384), (384, 1), 2, 64, 128, swizzle="128B")  # 256 B > 128 B span


# ---- GPU: launching (run by the lead on a GPU machine) ----------------------------------------

VEC_SOURCE = r"""
#include <ptxtrain/ptx.cuh>
#include <ptxtrain/mbarrier.cuh>
using namespace ptxtrain;

// c = a + b, with `a` read through ld_nc and every block doing one mbarrier round trip.
extern "C" __global__ void vec_add(const float* a, const float* b, float* c, int* phases, int n) {
  __shared__ u64 bar;
  if (threadIdx.x == 0) { mbarrier_init(&bar, blockDim.x); fence_mbarrier_init(); }
  __syncthreads();
  mbarrier_arrive(&bar);
  mbarrier_wait(&bar, 0);
  if (threadIdx.x == 0) atomicAdd(phases, 1);
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = ld_nc_f32(a + i) + b[i];
}

// out[i] = two E4M3 bytes of (x[2i], x[2i+1]).
extern "C" __global__ void pack_e4m3(const float* x, unsigned short* out, int n_pairs) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_pairs) out[i] = cvt_e4m3x2(x[2 * i], x[2 * i + 1]);
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("aggressive", [False, True])
@pytest.mark.parametrize(("smem_bytes", "cluster"), [(0, None), (100 * 1024, (2, 1, 1))])
def test_gpu_vec_add_launch(aggressive, smem_bytes, cluster):
    flags = ("-DPTXTRAIN_AGGRESSIVE_PTX",) if aggressive else ()
    kernel = load_kernel(compile_cuda(VEC_SOURCE, name="vec_add", flags=flags))
    n, block = 1000, 128
    grid = 8  # ceil(1000 / 128), even so that a 2-CTA cluster divides it
    a, b = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    c = torch.full((n,), float("nan"), device="cuda")
    phases = torch.zeros(1, dtype=torch.int32, device="cuda")
    launch(kernel, grid, block, [a, b, c, phases, n], smem_bytes=smem_bytes, cluster=cluster)
    torch.cuda.synchronize()
    # Exact: one float add per element on both sides.
    torch.testing.assert_close(c, a + b, rtol=0, atol=0)
    assert phases.item() == grid, f"{phases.item()=} mbarrier round trips, expected {grid}"


@pytest.mark.gpu
def test_gpu_cvt_e4m3x2_matches_torch():
    kernel = load_kernel(compile_cuda(VEC_SOURCE, name="pack_e4m3"))
    n_pairs = 4096
    x = torch.randn(2 * n_pairs, device="cuda") * 300
    x[:8] = torch.tensor([500.0, -1e6, float("inf"), float("-inf"), 0.0, -0.0, 1e-9, 448.0])
    out = torch.empty(n_pairs, dtype=torch.int16, device="cuda")
    launch(kernel, (n_pairs + 255) // 256, 256, [x, out, n_pairs])
    torch.cuda.synchronize()
    # Reference: torch's cast (round to nearest even) after clamping to ±448. torch itself does
    # not saturate (it gives NaN past 464, measured on the H200: 500 → 0x7F), while .satfinite
    # clamps finite and infinite overflow to ±448 (PTX ISA, cvt: "satfinite"); no NaN is fed.
    ref = x.cpu().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).view(-1, 2)
    got = out.cpu().view(torch.uint8).view(-1, 2)  # little endian: byte 0 is bits 0..7
    assert torch.equal(got[:4], torch.tensor([[0x7E, 0xFE], [0x7E, 0xFE], [0, 0x80], [0, 0x7E]],
                                             dtype=torch.uint8))  # fmt: skip
    assert torch.equal(got, ref)  # bit-exact everywhere


TMA_SOURCE = r"""
#include <ptxtrain/tma.cuh>
using namespace ptxtrain;

// Copies one 64x64-byte box per block: TMA load (mbarrier completion) into shared memory, then
// back out both with plain stores (to `out`) and with a TMA store (through `dst_map`).
extern "C" __global__ void tma_copy(const __grid_constant__ TmaDescriptor src_map,
                                    const __grid_constant__ TmaDescriptor dst_map,
                                    unsigned char* out, int cols) {
  __shared__ alignas(128) unsigned char tile[64 * 64];
  __shared__ u64 bar;
  const int c0 = blockIdx.x * 64, r0 = blockIdx.y * 64;
  if (threadIdx.x == 0) { mbarrier_init(&bar, 1); fence_mbarrier_init(); }
  __syncthreads();
  if (threadIdx.x == 0) {
    mbarrier_arrive_expect_tx(&bar, sizeof(tile));
    tma_load_2d(tile, &src_map, &bar, c0, r0);
  }
  mbarrier_wait(&bar, 0);
  for (int i = threadIdx.x; i < 64 * 64; i += blockDim.x)
    out[(r0 + i / 64) * cols + c0 + i % 64] = tile[i];
  fence_proxy_async_shared_cta();
  __syncthreads();
  if (threadIdx.x == 0) {
    tma_store_2d(&dst_map, tile, c0, r0);
    tma_store_commit_group();
    tma_store_wait_read<0>();
  }
}
"""


@pytest.mark.gpu
def test_gpu_tma_load_store_round_trip():
    kernel = load_kernel(compile_cuda(TMA_SOURCE, name="tma_copy"))
    rows, cols = 256, 192
    src = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    out = torch.zeros_like(src)
    src_map, dst_map = make_tma_2d_desc(src, 64, 64), make_tma_2d_desc(dst, 64, 64)
    launch(kernel, (cols // 64, rows // 64), 128, [src_map, dst_map, out, cols])
    torch.cuda.synchronize()
    assert torch.equal(out, src), "TMA load (or mbarrier completion) lost bytes"
    assert torch.equal(dst, src), "TMA store lost bytes"


@pytest.mark.parametrize(
    ("source", "name"),
    [(VEC_SOURCE, "vec_add"), (VEC_SOURCE, "pack_e4m3"), (TMA_SOURCE, "tma_copy")],
)
def test_gpu_test_kernels_compile(source, name):
    """The GPU tests' kernels compile here, so a GPU run fails only on what needs a GPU."""
    built = compile_cuda(source, name=name, flags=("-DPTXTRAIN_AGGRESSIVE_PTX",))
    assert built.cubin.startswith(b"\x7fELF") and built.symbol() == name


PDL_SOURCE = r"""
#include <ptxtrain/ptx.cuh>
using namespace ptxtrain;

// A slow producer: every thread spins ~20 us, then writes its element.
extern "C" __global__ void slow_fill(float* out, float value, long long spin_cycles) {
  grid_dependency_launch();
  grid_dependency_wait();
  const long long t0 = clock64();
  while (clock64() - t0 < spin_cycles) {
  }
  out[blockIdx.x * blockDim.x + threadIdx.x] = value + blockIdx.x;
}

// A consumer launched programmatically right after it: reads `in` after the wait.
extern "C" __global__ void copy_after_wait(const float* in, float* out) {
  grid_dependency_launch();
  grid_dependency_wait();
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = in[i];
}
"""


@pytest.mark.gpu
def test_gpu_programmatic_launch_waits_for_the_previous_kernel():
    # Programmatic dependent launch (BoundLaunch(programmatic=True)): the consumer may start
    # while the slow producer still spins, and must still read every value the producer wrote
    # (griddepcontrol.wait); repeated with fresh values so a stale read cannot pass by luck.
    fill = load_kernel(compile_cuda(PDL_SOURCE, name="slow_fill"))
    copy = load_kernel(compile_cuda(PDL_SOURCE, name="copy_after_wait"))
    producer = BoundLaunch(fill, "pfq", 128, programmatic=True)
    consumer = BoundLaunch(copy, "pp", 128, programmatic=True)
    blocks = 264  # two per SM on a 132-SM GPU
    buf = torch.zeros(blocks * 128, device="cuda")
    out = torch.zeros_like(buf)
    for rep in range(5):
        producer(blocks, buf.data_ptr(), float(1000 * (rep + 1)), 40_000)
        consumer(blocks, buf.data_ptr(), out.data_ptr())
        torch.cuda.synchronize()
        want = 1000.0 * (rep + 1) + torch.arange(blocks, device="cuda").repeat_interleave(128)
        torch.testing.assert_close(out, want.float(), rtol=0, atol=0)
    with pytest.raises(TypeError, match="programmatic"):
        BoundLaunch(copy, "pp", 128, programmatic=1)
