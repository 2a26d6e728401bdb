"""The CUDA quant backend (ptxtrain.quant.cuda): compile-only, host emulation, validation, GPU.

- Compile-only: every instantiation of ``cast_transpose.cuh`` for sm_90a through NVRTC (no GPU
  needed), with its SASS read through ``cuobjdump`` where one is found: no local memory (spills),
  16-byte global loads, E4M3 packing.
- Host emulation: the same kernel source compiled as host C++ (``host_emulation.hpp``: each
  CTA's threads are OS threads, barriers give ``__syncthreads`` and the shuffles, every vector
  access is checked for alignment) and driven through the backend's own argument packing, bit
  for bit against ``ptxtrain.quant.ref``: indexing, swizzle, tails, scales and division of the
  real kernel code, without a GPU. Its one modelled instruction, the E4M3 conversion, is checked
  against torch's cast.
- GPU-marked: the real kernels against the reference at DeepSeek-V3 sizes and awkward shapes,
  and the backend choice.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest
import torch

from ptxtrain.jit import nvrtc_available
from ptxtrain.quant import ref
from ptxtrain.testing import assert_bitwise_equal
from tests.quant._cases import BAD_INPUTS

pytestmark = pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-bindings) missing")

cq = pytest.importorskip("ptxtrain.quant.cuda") if nvrtc_available() else None

FUNCS = (
    "per_token_cast_to_fp8",
    "per_token_cast_to_fp8_t",
    "per_token_cast_to_fp8_both",
    "per_block_cast_to_fp8",
    "per_block_cast_to_fp8_both",
)
TOKEN_FUNCS = FUNCS[:3]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _rand(m, k, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed magnitudes per row and per column, so 1x128 and 128x1 tiles see different amax.
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    x = x * torch.exp(torch.randn(1, k, generator=g))
    return x.to(dtype).to(device)


def _canonical_nans(t):
    """Every NaN replaced by one bit pattern (fp8 0x7F, fp32 the default NaN), on the CPU."""
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.float8_e4m3fn:
        bits = t.view(torch.uint8).clone()
        bits[(bits & 0x7F) == 0x7F] = 0x7F
        return bits.view(torch.float8_e4m3fn)
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def _check_same(fn_name, x, pow2=False, **kw):
    """Backend outputs vs the reference on the CPU. NaNs compare by position only: IEEE leaves
    the sign of a created NaN open (x86 makes inf/inf negative, the GPU positive), and the
    hardware E4M3 conversion gives 0x7F for any NaN where torch's keeps the sign."""
    got = getattr(cq, fn_name)(x, pow2_scale=pow2, **kw)
    want = getattr(ref, fn_name)(x.cpu(), pow2_scale=pow2)
    assert len(got) == len(want)
    tag = f"{fn_name} shape={tuple(x.shape)} {x.dtype} {pow2=} {kw}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.device == x.device, f"{tag}: output {i} on {g.device}"
        assert_bitwise_equal(_canonical_nans(g), _canonical_nans(w), f"{tag}: output {i}")
    return got


# ---------------------------------------------------------------------------------------------
# Compile-only (NVRTC, sm_90a)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_every_variant_compiles_for_sm90a_without_spills(dtype_name, tmp_path, monkeypatch):
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("PTXTRAIN_JIT_DISABLE_CACHE", raising=False)
    dtype = DTYPES[dtype_name]
    compiled = cq.compile_module.__wrapped__(dtype)  # a fresh compile, not the memoized one
    assert compiled.how == "compiled" and compiled.arch == "sm_90a"
    kind = cq._IN_KIND[dtype]
    want = {cq._expression(kind, b, r, c, p) for b, r, c in cq._MODES for p in (False, True)}
    assert set(compiled.symbols) == want
    assert len(set(compiled.symbols.values())) == 10, compiled.symbols

    from ptxtrain.jit.cache import find_cuobjdump

    tool = find_cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (PATH or the Triton wheel): SASS not checked")
    cubin = tmp_path / "quant.cubin"
    cubin.write_bytes(compiled.cubin)
    usage = subprocess.run(
        [tool, "-res-usage", str(cubin)], capture_output=True, text=True, timeout=120
    ).stdout
    funcs = re.findall(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", usage)
    assert {f for f, *_ in funcs} == set(compiled.symbols.values()), usage
    for sym, regs, stack, local in funcs:
        assert stack == "0" and local == "0", f"{sym}: stack {stack}, local {local} (spills)"
        # __launch_bounds__: 3 CTAs/SM of 256 threads for 16-bit input (<= 80 registers), 2 for
        # fp32 (<= 128), so at least two tiles per SM are in flight.
        assert int(regs) <= (128 if dtype == torch.float32 else 80), f"{sym}: {regs} registers"
    sass = subprocess.run(
        [tool, "-sass", str(cubin)], capture_output=True, text=True, timeout=120
    ).stdout
    assert "LDL" not in sass and "STL" not in sass
    assert "LDG.E.NA.128.CONSTANT" in sass  # ld.global.nc.L1::no_allocate.v4
    assert "STG.E.128" in sass  # the transposed rows, 16 bytes per thread
    assert "STS.128" in sass  # the tile staged in shared memory
    assert "F2FP.SATFINITE.E4M3.F32.PACK_AB" in sass


# ---------------------------------------------------------------------------------------------
# Host emulation of the real kernel source
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++: the host emulation of the kernels can't be built")
    out = tmp_path_factory.mktemp("quant-emu") / "emu.so"
    src = cq.KERNEL_DIR / "host_emulation.cpp"
    cmd = [gxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared"]
    cmd += [f"-I{cq.KERNEL_DIR}", str(src), "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lib = ctypes.CDLL(str(out))
    lib.emu_cast_fp8.restype = ctypes.c_int
    return lib


@pytest.fixture
def emulated(emu_lib, monkeypatch):
    """The cuda backend with its launch replaced by the host emulation (CPU tensors)."""
    calls = []

    def launch(x, variant, tiles, smem, args):
        calls.append((variant, tiles, smem))
        assert smem <= 227 * 1024, smem  # sm_90's opt-in limit per CTA
        mode = cq._MODES.index(tuple(variant[:3]))
        m, k, ldx, s0, s1, t0, t1, k_tiles, flags = args[5:]
        assert tiles == -(-m // 128) * k_tiles and k_tiles == -(-k // 128)
        tensors = [t for t in args[:5]]
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
        spans = (ctypes.c_int64 * 5)(*[_span_bytes(t) for t in tensors])
        ints = [ctypes.c_int64(v) for v in (m, k, ldx, s0, s1, t0, t1)]
        rc = emu_lib.emu_cast_fp8(
            cq._IN_KIND[x.dtype], mode, int(variant[3]), *ptrs, *ints, ctypes.c_int(flags), spans
        )
        assert rc == 0, f"emulated kernel failed ({rc}): see the 'host emulation:' line on stderr"

    monkeypatch.setattr(cq, "_launch", launch)
    monkeypatch.setattr(cq, "_require_cuda", lambda name, x: None)
    return calls


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from ``t.data_ptr()`` to the end of its last element (0 when empty)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()


def test_emulated_e4m3_conversion_matches_torch(emu_lib):
    # Halfway cases (17, 19: ties to even), the saturation edge (448 < |x|: 448 on the hardware's
    # satfinite; torch gives NaN from 464 on, which the quantizers never reach since |x/sf| <=
    # 448·(1 + 2^-23)), e4m3 subnormals (2^-9 steps, 2^-10 halfway), signed zeros, and a random
    # spread over the whole finite e4m3 range.
    g = torch.Generator().manual_seed(5)
    vals = [17.0, 19.0, -17.0, 448.0, 449.0, 463.9, 2**-10, 3 * 2**-10, 2**-7 * 1.0625, 1e-30]
    vals += [0.0, -0.0, 240.0, 248.0, -232.0, 0.015625 * (1 - 2**-5)]
    x = torch.cat(
        [
            torch.tensor(vals),
            torch.randn(20000, generator=g) * 60,
            torch.rand(5000, generator=g) * 2**-6,
        ]
    )
    out = torch.empty(x.numel(), dtype=torch.uint8)
    emu_lib.emu_e4m3(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()), x.numel())
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert_bitwise_equal(out, want, "emulated cvt.rn.satfinite.e4m3x2.f32")
    special = torch.tensor([float("inf"), -float("inf"), 1e30, float("nan")])
    out = torch.empty(4, dtype=torch.uint8)
    emu_lib.emu_e4m3(ctypes.c_void_p(special.data_ptr()), ctypes.c_void_p(out.data_ptr()), 4)
    assert out.tolist() == [0x7E, 0xFE, 0x7E, 0x7F]  # satfinite; canonical NaN


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("m,k", [(1, 1), (13, 100), (129, 300), (256, 136)])
def test_emulated_bit_exact_vs_reference(emulated, m, k, dtype_name):
    x = _rand(m, k, DTYPES[dtype_name], seed=m * 1000 + k)
    for name in FUNCS:
        for pow2 in (False, True):
            got = _check_same(name, x, pow2=pow2)
            assert all(t.is_contiguous() for t in got), name
    assert emulated, "the emulated launch never ran"


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_emulated_special_values(emulated, dtype_name):
    # Zero tiles (amax clamped to 1e-4), a 128x128 block of tiny values, values halfway between
    # e4m3 neighbours after scaling, signed zeros and fp32-subnormal inputs, a row of equal
    # values, a huge-magnitude row, and NaN / ±inf (also in the tail tiles of both axes).
    dtype = DTYPES[dtype_name]
    m, k = 130, 260
    x = _rand(m, k, torch.float32, seed=7)
    x[:, :128] = 0.0
    x[0:128, 128:256] *= 1e-9
    x[5, 256:] = torch.tensor([448.0, 17.0, 19.0, -9.0])
    x[6, 256:] = torch.tensor([0.0, -0.0, 1e-40, -1e-40])
    x[60, :] = 3.0
    x[129] *= 1e3 if dtype == torch.float16 else 1e30
    y = _rand(129, 300, torch.float32, seed=3)
    y[3, 5] = float("nan")
    y[7, 200] = float("inf")
    y[100, 250] = -float("inf")
    y[128, 299] = float("nan")
    y[64, 140] = -float("nan")
    for t in (x.to(dtype), y.to(dtype)):
        for name in FUNCS:
            _check_same(name, t)
        for name in ("per_token_cast_to_fp8_both", "per_block_cast_to_fp8_both"):
            _check_same(name, t, pow2=True)


def test_emulated_strided_and_unaligned_inputs(emulated):
    base = _rand(140, 400, torch.bfloat16, seed=11)
    cases = (
        base[3:132, 17:317],  # row stride 400, data pointer 2-byte aligned: element-wise loads
        base[:, 8:264],  # 16-byte aligned rows and pointer: vector loads, K % 128 == 0
        _rand(300, 129, torch.bfloat16, seed=12).t(),  # stride(-1) != 1: copied first
        _rand(160, 200, torch.float32, seed=13)[:, 4:],  # fp32, 16-byte aligned, K = 196
    )
    for x in cases:
        for name in ("per_token_cast_to_fp8_both", "per_block_cast_to_fp8_both"):
            _check_same(name, x)


@pytest.mark.parametrize("m", [13, 144])
def test_emulated_mn_major_scales(emulated, m):
    x = _rand(m, 300, torch.bfloat16, seed=m)
    for name in TOKEN_FUNCS:
        got = getattr(cq, name)(x, sf_layout="mn_major")
        want = getattr(ref, name)(x)
        for g, w in zip(got, want):
            assert_bitwise_equal(g.contiguous(), w, f"{name} {m=}")
            if g.dtype == torch.float32:
                rows = g.shape[0]
                assert g.stride() == (1, -(-rows // 4) * 4), f"{name}: strides {g.stride()}"


def test_emulated_empty_inputs_launch_nothing(emulated):
    for shape in ((0, 300), (5, 0), (0, 0)):
        x = torch.randn(shape)
        for name in FUNCS:
            _check_same(name, x)
    assert emulated == []


# ---------------------------------------------------------------------------------------------
# Validation (CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", FUNCS)
@pytest.mark.parametrize("bad, block, exc", BAD_INPUTS)
def test_errors_match_reference(name, bad, block, exc):
    with pytest.raises(exc) as want:
        getattr(ref, name)(bad, block)
    with pytest.raises(exc) as got:
        getattr(cq, name)(bad, block)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("name", FUNCS)
def test_cpu_tensor_and_bad_layout_are_clear_errors(name, monkeypatch):
    with pytest.raises(ValueError, match=r"[xw] must be a CUDA tensor for the cuda quant backend"):
        getattr(cq, name)(torch.randn(4, 4))
    if name in TOKEN_FUNCS:
        monkeypatch.setattr(cq, "_require_cuda", lambda n, x: None)
        with pytest.raises(ValueError, match="sf_layout must be one of"):
            getattr(cq, name)(torch.randn(4, 4), sf_layout="col_major")


def test_cuda_backend_not_auto_on_cpu_and_listed(monkeypatch):
    from ptxtrain import quant

    monkeypatch.delenv("PTXTRAIN_QUANT_BACKEND", raising=False)
    assert "cuda" in quant.BACKENDS and quant.backends()["cuda"] == "available"
    assert cq.usable(torch.device("cpu")) is False
    for name in FUNCS:
        assert quant.select_backend(torch.ones(2, 2), name) == "ref"
    monkeypatch.setenv("PTXTRAIN_QUANT_BACKEND", "cuda")
    assert quant.select_backend(torch.ones(2, 2), "per_token_cast_to_fp8_t") == "cuda"
    with pytest.raises(ValueError, match="must be a CUDA tensor for the cuda quant backend"):
        quant.per_token_cast_to_fp8_both(torch.ones(2, 2))


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

gpu_sm90 = pytest.mark.skipif(
    not (torch.cuda.is_available() and cq is not None and cq.usable(torch.device("cuda"))),
    reason="needs an sm_90 GPU with the CUDA driver",
)


@pytest.mark.gpu
@gpu_sm90
@pytest.mark.parametrize("m,k", [(4096, 7168), (7168, 2048), (4096, 2112), (2112, 7168)])
def test_gpu_dsv3_shapes(m, k):
    x = _rand(m, k, torch.bfloat16, seed=m + k, device="cuda")
    x[17, 5] = float("nan")
    x[m - 1, k - 1] = float("inf")
    x[200, :] = 0.5  # a row of equal values
    for name in FUNCS:
        for pow2 in (False, True):
            _check_same(name, x, pow2=pow2)
    x32 = _rand(m, k, torch.float32, seed=m - k, device="cuda")
    for name in ("per_token_cast_to_fp8_both", "per_block_cast_to_fp8_both"):
        _check_same(name, x32)


@pytest.mark.gpu
@gpu_sm90
@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("m", [0, 1, 13, 127, 129, 256])
@pytest.mark.parametrize("k", [1, 100, 300, 384])
def test_gpu_awkward_shapes(m, k, dtype_name):
    x = _rand(m, k, DTYPES[dtype_name], seed=m * 7 + k, device="cuda")
    if m > 3 and k > 3:
        x[1] *= 1e-9  # tiny
        x[2] = -2.5  # all equal
        x[3] *= 1e3 if dtype_name == "fp16" else 1e30  # large magnitude
    for name in FUNCS:
        for pow2 in (False, True):
            _check_same(name, x, pow2=pow2)


@pytest.mark.gpu
@gpu_sm90
def test_gpu_strided_layouts_and_other_blocks():
    base = _rand(300, 700, torch.bfloat16, seed=1, device="cuda")
    for x in (base[3:290, 5:600], base[:256, 64:576], base[:200, :130].t()):
        for name in FUNCS:
            _check_same(name, x)
    for name in TOKEN_FUNCS:
        got = getattr(cq, name)(base, sf_layout="mn_major")
        want = getattr(ref, name)(base.cpu())
        for g, w in zip(got, want):
            assert_bitwise_equal(g.cpu().contiguous(), w, f"{name} mn_major")
    x = _rand(129, 300, torch.float32, seed=2, device="cuda")
    for name in FUNCS:  # block 64 goes to the Triton backend (or the reference)
        got = getattr(cq, name)(x, 64)
        for g, w in zip(got, getattr(ref, name)(x.cpu(), 64)):
            assert_bitwise_equal(g.cpu(), w, f"{name} block=64")


@pytest.mark.gpu
@gpu_sm90
def test_gpu_backend_selection(monkeypatch):
    from ptxtrain import quant

    monkeypatch.delenv("PTXTRAIN_QUANT_BACKEND", raising=False)
    x = _rand(256, 384, torch.bfloat16, seed=4, device="cuda")
    for name in FUNCS:
        want = "cuda" if name in cq.AUTO_OPS else ("triton" if _triton() else "ref")
        assert quant.select_backend(x, name) == want, name
    for forced in ("ref", "triton", "cuda"):
        if forced == "triton" and not _triton():
            continue
        monkeypatch.setenv("PTXTRAIN_QUANT_BACKEND", forced)
        assert quant.select_backend(x, "per_token_cast_to_fp8_t") == forced
        out = quant.per_token_cast_to_fp8_both(x)
        for g, w in zip(out, ref.per_token_cast_to_fp8_both(x.cpu())):
            assert_bitwise_equal(g.cpu(), w, f"forced {forced}")


def _triton() -> bool:
    import importlib.util

    return (
        importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") != "1"
    )
