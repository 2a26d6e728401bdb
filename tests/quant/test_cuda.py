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

import concurrent.futures
import ctypes
import itertools
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


def _compile_and_check_resources(dtype, variant, tmp_path, monkeypatch, full=False):
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path / "jit"))
    monkeypatch.delenv("PTXTRAIN_JIT_DISABLE_CACHE", raising=False)
    compiled = cq.compile_module.__wrapped__(dtype, variant=variant, full=full)  # not memoized
    assert compiled.how == "compiled" and compiled.arch == "sm_90a"
    kind = cq._IN_KIND[dtype]
    want = {
        cq._expression(kind, b, r, c, p, variant, full)
        for b, r, c in cq._MODES
        for p in (False, True)
    }
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
    # __launch_bounds__(threads, ctas): the registers fit `ctas` CTAs per SM (allocated in 8s).
    reg_cap = min(255, 65536 // (variant.threads * variant.ctas_per_sm(dtype)) // 8 * 8)
    for sym, regs, stack, local in funcs:
        assert stack == "0" and local == "0", f"{sym}: stack {stack}, local {local} (spills)"
        assert int(regs) <= reg_cap, f"{sym}: {regs} registers > {reg_cap}"
    return tool, cubin


def _variant_compile_cases():
    """(variant, dtype) pairs besides the default, one per distinct compiled module (the grid
    fields do not change the code): bf16 of each, and fp32 of the pipelined one (fp32 has the
    most registers). NVRTC takes 2-7 s a module, so the other dtypes are left out here."""
    if cq is None:
        return []
    seen = {cq._expression(1, True, True, True, True, cq.DEFAULT_VARIANT)}
    cases = []
    for name, v in cq.VARIANTS.items():
        expr = cq._expression(1, True, True, True, True, v)
        if expr in seen:
            continue
        seen.add(expr)
        cases.append(pytest.param(name, "bf16", id=f"{name}-bf16"))
        if v.pipe and v.threads == 256:
            cases.append(pytest.param(name, "fp32", id=f"{name}-fp32"))
    return cases


@pytest.mark.parametrize("name,dtype_name", _variant_compile_cases())
def test_other_variants_compile_without_spills(name, dtype_name, tmp_path, monkeypatch):
    _compile_and_check_resources(DTYPES[dtype_name], cq.VARIANTS[name], tmp_path, monkeypatch)


@pytest.mark.parametrize("name", sorted(set(cq.SELECT.values())) if cq is not None else [])
def test_full_tile_modules_compile_without_spills(name, tmp_path, monkeypatch):
    # The FULL instantiations (no bounds checks) of the variants the quantizers run, bf16.
    _compile_and_check_resources(torch.bfloat16, cq.VARIANTS[name], tmp_path, monkeypatch, True)


def test_a_launch_compiles_its_own_instantiation_only(tmp_path, monkeypatch):
    # compile_module(mode=...) is what a launch compiles (one expression: ~6x less NVRTC time
    # than the ten of a whole module), under a name of its own, the same kernel expression.
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path / "jit"))
    v = cq.VARIANTS[cq.SELECT["per_token_cast_to_fp8_both"]]
    mode = (*cq.OP_MODES["per_token_cast_to_fp8_both"], False)
    one = cq.compile_module.__wrapped__(torch.bfloat16, variant=v, full=True, mode=mode)
    assert list(one.symbols) == [cq._expression(cq._IN_KIND[torch.bfloat16], *mode, v, True)]
    assert one.name == "ptxtrain_quant_cast_fp8_0110_full"
    assert set(cq.OP_MODES.values()) == set(cq._MODES)  # every kernel mode has its op
    for bad in [(False, True, True), (True, False, False, False), (0, 1, 1, 0), [0, 1, 1, 0]]:
        with pytest.raises(ValueError, match="mode must be"):
            cq.compile_module.__wrapped__(torch.bfloat16, mode=bad)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_every_variant_compiles_for_sm90a_without_spills(dtype_name, tmp_path, monkeypatch):
    dtype = DTYPES[dtype_name]
    tool, cubin = _compile_and_check_resources(dtype, cq.DEFAULT_VARIANT, tmp_path, monkeypatch)
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


def _emu_key(variant) -> tuple:
    """The knobs the host emulation is built with (launch bounds do not exist on the host)."""
    return (
        variant.threads,
        variant.tiles_per_cta != 1,
        variant.pipe,
        variant.mul_pow2,
        variant.byte_t,
        variant.amax16,
        variant.fast_sf,
        variant.pair,
        variant.async_copy,
    )


@pytest.fixture(scope="module")
def emu_build(tmp_path_factory):
    """variant -> the host emulation library built for its knobs (one g++ build per knob set)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++: the host emulation of the kernels can't be built")
    libs = {}

    def build(variant):
        key = _emu_key(variant)
        if key not in libs:
            out = tmp_path_factory.mktemp("quant-emu") / "emu.so"
            src = cq.KERNEL_DIR / "host_emulation.cpp"
            cmd = [gxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared"]
            cmd += [f"-I{cq.KERNEL_DIR}", str(src), "-o", str(out)]
            names = ("THREADS", "LOOP", "PIPE", "MUL_POW2", "BYTE_T", "AMAX16", "FAST_SF")
            names += ("PAIR", "ASYNC")
            cmd += [f"-DPTXTRAIN_QUANT_EMU_{n}={int(v)}" for n, v in zip(names, key)]
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr[-3000:]
            lib = ctypes.CDLL(str(out))
            lib.emu_cast_fp8.restype = ctypes.c_int
            libs[key] = lib
        return libs[key]

    return build


@pytest.fixture(scope="module")
def emu_lib(emu_build):
    return emu_build(cq.DEFAULT_VARIANT)


@pytest.fixture
def emulated(emu_build, monkeypatch):
    """The cuda backend with its launch replaced by the host emulation (CPU tensors)."""
    calls = []

    def launch(x, mode, variant, grid, smem, args):
        calls.append((mode, variant, grid, smem))
        assert smem <= 227 * 1024, smem  # sm_90's opt-in limit per CTA
        m, k, ldx, s0, s1, t0, t1, k_tiles, flags = args[5:]
        tiles = -(-m // 128) * k_tiles
        assert k_tiles == -(-k // 128) and 1 <= grid <= tiles
        if variant.tiles_per_cta > 0:
            assert grid == -(-tiles // variant.tiles_per_cta)
        else:
            assert grid == min(tiles, 2 * variant.ctas_per_sm(x.dtype))  # _sm_count below
        tensors = [t for t in args[:5]]
        ptrs = [ctypes.c_void_p(t.data_ptr()) for t in tensors]
        spans = (ctypes.c_int64 * 5)(*[_span_bytes(t) for t in tensors])
        ints = [ctypes.c_int64(v) for v in (m, k, ldx, s0, s1, t0, t1)]
        rc = emu_build(variant).emu_cast_fp8(
            cq._IN_KIND[x.dtype],
            cq._MODES.index(tuple(mode[:3])),
            int(mode[3]),
            int(mode[4]),
            *ptrs,
            *ints,
            ctypes.c_int(flags),
            ctypes.c_int64(grid),
            spans,
        )
        assert rc == 0, f"emulated kernel failed ({rc}): see the 'host emulation:' line on stderr"

    monkeypatch.setattr(cq, "_launch", launch)
    monkeypatch.setattr(cq, "_require_cuda", lambda name, x: None)
    monkeypatch.setattr(cq, "_sm_count", lambda index: 2)  # persistent grids of a 2-SM "GPU"
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


def test_fast_scale_division_is_exact_over_the_whole_amax_range(emu_lib):
    # The FAST_SF knob's amax / 448 (multiply + one FMA correction) against IEEE division for
    # every finite fp32 from the amax clamp up (1.41e9 values, ~4 s): a proof by exhaustion.
    eps_bits = int(torch.tensor(ref.AMAX_EPS, dtype=torch.float32).view(torch.int32))
    emu_lib.emu_check_fast_sf.restype = ctypes.c_longlong
    bad = emu_lib.emu_check_fast_sf(ctypes.c_uint(eps_bits), ctypes.c_uint(0x7F800000))
    assert bad == 0, f"{bad} amax values where the fast scale differs from div.rn (see stderr)"


@pytest.mark.parametrize("in_kind, finite_end", [(1, 0x7F80), (2, 0x7C00)], ids=["bf16", "fp16"])
def test_one_correction_quotient_is_exact_for_16_bit_inputs(emu_lib, in_kind, finite_end):
    # 16-bit inputs quantize with one residual correction of x * rcp(sf) instead of two
    # (quotient<true> in cast_transpose.cuh). Proof by exhaustion: every positive finite 16-bit
    # amax and every positive 16-bit x <= amax gives the same E4M3 byte as the correctly
    # rounded quotient (~5e8 pairs per dtype; the amax range split over threads, ctypes
    # releases the GIL). The pair count is checked so that a shortened loop cannot pass.
    emu_lib.emu_check_one_step.restype = ctypes.c_longlong
    # Equal work per chunk: amax bits ha carries ha values of x, so cut at sqrt spacing.
    chunks = 8
    cuts = [1] + [int(finite_end * ((i / chunks) ** 0.5)) for i in range(1, chunks)] + [finite_end]

    def run(lo_hi):
        pairs = ctypes.c_longlong(0)
        bad = emu_lib.emu_check_one_step(in_kind, lo_hi[0], lo_hi[1], ctypes.byref(pairs))
        return bad, pairs.value

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(run, itertools.pairwise(cuts)))
    bad = sum(b for b, _ in results)
    pairs = sum(n for _, n in results)
    assert pairs == (finite_end - 1) * finite_end // 2  # sum over ha of its ha values of x
    assert bad == 0, f"{bad} (x, amax) pairs where one correction changes the E4M3 byte"


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("m,k", [(1, 1), (13, 100), (129, 300), (256, 136)])
def test_emulated_bit_exact_vs_reference(emulated, m, k, dtype_name):
    x = _rand(m, k, DTYPES[dtype_name], seed=m * 1000 + k)
    for name in FUNCS:
        for pow2 in (False, True):
            got = _check_same(name, x, pow2=pow2)
            assert all(t.is_contiguous() for t in got), name
    assert emulated, "the emulated launch never ran"


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_emulated_gradient_magnitudes_bit_exact(emulated, dtype_name):
    # Output-gradient tiles (a loss mean over a step's tokens: amax ~1e-9 = 2^-30 late in
    # training) sit far below 1 but above the amax clamp: every scale and byte as the reference.
    # (fp16 cannot hold them.)
    x = _rand(129, 300, DTYPES[dtype_name], seed=30) * 2.0**-30
    for name in FUNCS:
        for pow2 in (False, True):
            _check_same(name, x, pow2=pow2)
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


@pytest.mark.parametrize(
    "name", [n for n in cq.VARIANTS if n != "default"] if cq is not None else []
)
def test_emulated_variants_bit_exact(emulated, name, monkeypatch):
    # Every variant through the public functions (SELECT pointed at it): multi-tile CTAs walk
    # tails on both axes (129x300: 6 tiles; 300x260: 9), power-of-two scales take the
    # one-multiply path where the variant has it, and a NaN / inf / zero tile ride along. bf16
    # runs every quantizer; fp32 and fp16 (its own amax widening) the two fused ones (they hold
    # every code path: row, column, block), to keep the emulation time down.
    monkeypatch.setattr(cq, "SELECT", {f: name for f in FUNCS})
    variant = cq.VARIANTS[name]
    cases = (("bf16", (129, 300)), ("fp32", (300, 260)), ("fp16", (140, 136)), ("bf16", (256, 256)))
    for dtype_name, (m, k) in cases:  # the last: whole tiles, the FULL kernel
        x = _rand(m, k, DTYPES[dtype_name], seed=m + k)
        x[5, 7] = float("nan")
        x[130 % m, 200 % k] = float("inf")
        x[:, :128] = 0.0 if dtype_name == "fp32" else x[:, :128]
        for fn in FUNCS if dtype_name == "bf16" else FUNCS[2::2]:
            for pow2 in (False, True):
                _check_same(fn, x, pow2=pow2)
    assert emulated and all(v == variant for _, v, _, _ in emulated)


@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_emulated_full_tiles_take_the_unchecked_kernel(emulated, dtype_name):
    # M and K multiples of 128 with 16-byte aligned rows: every quantizer runs the FULL
    # instantiation (bounds checks compiled out), bit-exact with the reference, NaN / inf / a
    # zero tile included. The emulation checks every access against the tensors' extents and
    # alignment, so an unchecked access out of range fails here.
    dtype = DTYPES[dtype_name]
    x = _rand(256, 384, dtype, seed=21)
    x[3, 5] = float("nan")
    x[200, 300] = float("inf")
    x[128:, :128] = 0.0
    for name in FUNCS:
        for pow2 in (False, True):
            _check_same(name, x, pow2=pow2)
    assert emulated and all(mode[4] for mode, *_ in emulated)
    # The same shape as an unaligned view (data pointer off by one element), or with one row
    # more: the checked kernel.
    emulated.clear()
    for y in (_rand(256, 385, dtype, seed=22)[:, 1:], _rand(257, 384, dtype, seed=23)):
        _check_same("per_token_cast_to_fp8_both", y)
        _check_same("per_block_cast_to_fp8_both", y)
    assert emulated and not any(mode[4] for mode, *_ in emulated)


@pytest.mark.parametrize("name", ["async_pair", "async_pair_occ2"])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_emulated_async_copies_over_several_tiles_per_cta(emulated, name, dtype_name, monkeypatch):
    # The ASYNC knob's double buffering: a persistent grid of fewer CTAs than tiles (2 "SMs",
    # 20 whole tiles), so each CTA copies its next tile into the other buffer while it
    # quantizes this one and comes back to the first buffer on its third tile; bit-exact with
    # the reference, NaN / inf / a zero tile riding along, power-of-two scales too.
    monkeypatch.setattr(cq, "SELECT", {f: name for f in FUNCS})
    variant = cq.VARIANTS[name]
    x = _rand(512, 640, DTYPES[dtype_name], seed=31)
    x[3, 5] = float("nan")
    x[400, 600] = float("inf")
    x[128:256, 256:384] = 0.0
    for fn in ("per_token_cast_to_fp8_t", "per_token_cast_to_fp8_both"):
        for pow2 in (False, True):
            _check_same(fn, x, pow2=pow2)
    assert emulated
    for mode, v, grid, smem in emulated:
        assert v == variant and mode[4], "the FULL kernel (whole, aligned tiles)"
        assert grid * 3 <= 20, "several tiles per CTA"
        assert smem == 2 * 128 * 128 * x.element_size() + 4 * v.threads // 32, "two buffers"


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
    # Listed, and said to be unusable on a machine without a CUDA device (with the reason).
    assert "cuda" in quant.BACKENDS
    if not torch.cuda.is_available():
        assert quant.backends()["cuda"] == "unavailable: no CUDA device"
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
@pytest.mark.parametrize("name", ["async_pair", "async_pair_occ2"])
@pytest.mark.parametrize("m,k", [(4096, 7168), (1024, 4096), (129, 300), (256, 384)])
def test_gpu_async_copy_variants(name, m, k, monkeypatch):
    # The cp.async double-buffered variants on the hardware (the emulation's copies complete at
    # once; here the next tile's copies are in flight while this one is quantized): bit-exact
    # with the reference at the DeepSeek-V3 shapes, a tail shape and a few-tile one.
    monkeypatch.setattr(cq, "SELECT", {f: name for f in FUNCS})
    x = _rand(m, k, torch.bfloat16, seed=m + 3 * k, device="cuda")
    x[7, 3] = float("nan")
    x[m - 1, k - 2] = float("-inf")
    for fn in ("per_token_cast_to_fp8_t", "per_token_cast_to_fp8_both"):
        for pow2 in (False, True):
            _check_same(fn, x, pow2=pow2)


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
