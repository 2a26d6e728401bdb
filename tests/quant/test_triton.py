"""Triton quantizers: bit-exact against the reference, on the GPU or in the patched interpreter.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (tests/quant/conftest.py) with the
interpreter's float casts routed through torch (``ptxtrain.testing.triton_interp``); every
comparison is bit for bit (``assert_bitwise_equal``) against ``ptxtrain.quant.ref`` on the same
device. The GPU-marked test repeats them at DeepSeek-V3 sizes; the compile-only test builds the
fused kernel for sm_90 without a GPU and reads its PTX.
"""

import dataclasses
import json
from fractions import Fraction

import pytest
import torch

pytest.importorskip("triton")

import ptxtrain.quant.triton as tq
from ptxtrain.quant import ref
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.testing.triton_interp import apply_interpreter_patch, patch_applied
from tests._sm90 import run_sm90_script
from tests.quant._cases import BAD_INPUTS

INTERPRETED = tq._kernels_interpreted()
HAS_GPU = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"

runnable = pytest.mark.skipif(
    not ((INTERPRETED and patch_applied()) or (HAS_GPU and not INTERPRETED)),
    reason=(
        "kernels can't run: no GPU, and either ptxtrain.quant.triton was imported before "
        "TRITON_INTERPRET=1 was set (set it in tests/conftest.py) or the interpreter patch is "
        "not applied (see test_interpreter_patch_*)"
    ),
)
interpreter_only = pytest.mark.skipif(not INTERPRETED, reason="kernels are compiled for the GPU")

# name → (outputs of the Triton function, outputs of the reference), all positional.
FUNCS = ("per_token_cast_to_fp8", "per_token_cast_to_fp8_t", "per_token_cast_to_fp8_both")
ALL_FUNCS = (*FUNCS, "per_block_cast_to_fp8", "per_block_cast_to_fp8_both")
OUT_NAMES = {
    "per_token_cast_to_fp8": ("x_fp8", "sf"),
    "per_token_cast_to_fp8_t": ("xt_fp8", "sf_t"),
    "per_token_cast_to_fp8_both": ("x_fp8", "sf", "xt_fp8", "sf_t"),
    "per_block_cast_to_fp8": ("w_fp8", "sf"),
    "per_block_cast_to_fp8_both": ("w_fp8", "sf", "wt_fp8", "sf_t"),
}


def _rand(m, k, dtype, seed, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed magnitudes per row and per column, so 1x128 and 128x1 tiles see different amax.
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    x = x * torch.exp(torch.randn(1, k, generator=g))
    return x.to(dtype).to(device)


def _canonical_nans(t):
    """Every NaN replaced by one bit pattern (fp8 0x7F, fp32 0x7FC00000), on the CPU."""
    t = t.detach().cpu()
    if t.dtype == torch.float8_e4m3fn:
        bits = t.view(torch.uint8).clone()
        bits[(bits & 0x7F) == 0x7F] = 0x7F
        return bits.view(torch.float8_e4m3fn)
    return torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)


def _assert_same(got, want, tag):
    """Bit-exact; on the GPU, NaNs compare by position only.

    IEEE 754 leaves the sign and payload of a NaN that an operation creates unspecified: the CPU
    (x86) makes inf/inf a negative NaN, the GPU a positive one, so the reference computed on the
    CPU and the kernel on the GPU may differ in NaN bits alone. Under the interpreter both are x86
    arithmetic and every bit must match.
    """
    if got.device.type != "cpu":
        got, want = _canonical_nans(got), _canonical_nans(want)
    assert_bitwise_equal(got, want, tag)


def _check_same(name, x, block=128, pow2=False, **kw):
    """The Triton function's outputs against the reference's, computed on the CPU."""
    got = getattr(tq, name)(x, block, pow2_scale=pow2, **kw)
    want = getattr(ref, name)(x.cpu(), block, pow2_scale=pow2)
    assert len(got) == len(want)
    tag = f"{name} shape={tuple(x.shape)} {x.dtype} {block=} {pow2=}"
    for out_name, g, w in zip(OUT_NAMES[name], got, want):
        assert g.device == x.device, f"{tag}: {out_name} on {g.device}"
        _assert_same(g, w, f"{tag}: {out_name}")
    return got


# ---------------------------------------------------------------------------------------------
# The interpreter patch
# ---------------------------------------------------------------------------------------------


@interpreter_only
def test_interpreter_patch_applied_and_casts_like_torch():
    import triton
    import triton.language as tl

    assert patch_applied()

    @triton.jit
    def cast_kernel(x_ptr, f8_ptr, bf_ptr, back_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        tl.store(f8_ptr + offs, x.to(tl.float8e4nv), mask=mask)
        bf = x.to(tl.bfloat16)
        tl.store(bf_ptr + offs, bf, mask=mask)
        tl.store(back_ptr + offs, bf.to(tl.float32), mask=mask)

    # 500 saturates to 448 (the unpatched interpreter gives 256); 17 and 19 lie halfway between
    # e4m3 neighbours (ties to even: 16 and 20); 1 + 2^-8 and 1 + 3·2^-8 lie halfway between
    # bf16 neighbours (1 and 1 + 2^-6); 2^-10 is a halfway e4m3 subnormal; NaN and ±inf.
    vals = [500.0, -600.0, 17.0, 19.0, 1 + 2**-8, 1 + 3 * 2**-8, 2**-10, 1e-30]
    vals += [float("nan"), float("inf"), -float("inf"), -0.0]
    x = torch.tensor(vals, dtype=torch.float32)
    x = torch.cat([x, torch.randn(100, generator=torch.Generator().manual_seed(1)) * 300])
    f8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    bf = torch.empty(x.shape, dtype=torch.bfloat16)
    back = torch.empty(x.shape, dtype=torch.float32)
    cast_kernel[(1,)](x, f8, bf, back, x.numel(), BLOCK=128)
    assert_bitwise_equal(f8, x.to(torch.float8_e4m3fn), "fp32 -> e4m3")
    assert_bitwise_equal(bf, x.to(torch.bfloat16), "fp32 -> bf16")
    assert_bitwise_equal(back, x.to(torch.bfloat16).float(), "bf16 -> fp32")


@interpreter_only
def test_interpreter_patch_dot_on_bf16_uses_values():
    import triton
    import triton.language as tl

    @triton.jit
    def dot_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        a = tl.load(a_ptr + i[:, None] * N + i[None, :])
        b = tl.load(b_ptr + i[:, None] * N + i[None, :])
        tl.store(c_ptr + i[:, None] * N + i[None, :], tl.dot(a, b))

    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    c = torch.empty(16, 16)
    dot_kernel[(1,)](a, b, c, N=16)
    # bf16 products are exact in fp32; only the order of the 16-term fp32 sums may differ, which
    # moves a result by a few ulps of the largest partial sum (|partial| < ~20 here) -> 1e-5 abs.
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=0, atol=1e-5)


@interpreter_only
def test_interpreter_patch_fma_rounds_once():
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(a_ptr, b_ptr, c_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        a, b, c = tl.load(a_ptr + i), tl.load(b_ptr + i), tl.load(c_ptr + i)
        tl.store(out_ptr + i, tl.fma(a, b, c))

    # a·b = 1 + 2^-11 + 2^-24·j needs 25 bits: a second rounding (a·b, then + c) can land on the
    # wrong side of a float32 midpoint, which an exact residual -(a·b - c) exposes.
    g = torch.Generator().manual_seed(4)
    a = torch.full((64,), 1 + 2**-12)
    b = 1 + 2**-12 + torch.randint(0, 2**11, (64,), generator=g) * 2.0**-23
    c = torch.randint(-4, 4, (64,), generator=g) * 2.0**-24 - (a * b)  # a·b rounded, negated
    c[:4] = torch.tensor([-0.0, 0.0, 1.0, -(2.0**-30)])
    out = torch.empty(64)
    fma_kernel[(1,)](a, b, c, out, BLOCK=64)
    want = torch.tensor(
        [
            float(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
            for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())
        ]
    )  # exact in float64 here (few bits), then one rounding to float32
    assert_bitwise_equal(out, want.float(), "fma")


def test_interpreter_patch_is_idempotent_and_pins_triton(monkeypatch):
    import triton
    from triton.runtime import interpreter

    if not triton.__version__.startswith("3.6."):
        with pytest.raises(RuntimeError, match=r"written for Triton 3\.6"):
            apply_interpreter_patch()
        return
    names = ("cast_impl", "create_fp_to_fp", "create_dot", "create_fma")
    apply_interpreter_patch()
    first = [getattr(interpreter.InterpreterBuilder, n) for n in names]
    apply_interpreter_patch()
    assert first == [getattr(interpreter.InterpreterBuilder, n) for n in names]
    assert patch_applied()
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    with pytest.raises(RuntimeError, match=r"written for Triton 3\.6\.x, found 3\.7\.0"):
        apply_interpreter_patch()


# ---------------------------------------------------------------------------------------------
# Bit-exact against the reference
# ---------------------------------------------------------------------------------------------


@runnable
@pytest.mark.parametrize("pow2", [False, True], ids=["sf", "pow2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("k", [100, 128, 300])
@pytest.mark.parametrize("m", [0, 1, 13, 129, 256])
@pytest.mark.parametrize("name", ALL_FUNCS)
def test_bit_exact_vs_reference(name, m, k, dtype, pow2):
    x = _rand(m, k, dtype, seed=m * 1000 + k)
    got = _check_same(name, x, pow2=pow2)
    for out_name, t in zip(OUT_NAMES[name], got):
        assert t.is_contiguous(), f"{name} {out_name} strides {t.stride()}"


@runnable
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gradient_magnitudes_bit_exact(dtype):
    # Output-gradient tiles (a loss mean over a step's tokens: amax ~1e-9 = 2^-30 late in
    # training) sit far below 1 but above the amax clamp: every scale and byte as the reference.
    x = _rand(129, 300, dtype, seed=30) * 2.0**-30
    for name in ALL_FUNCS:
        for pow2 in (False, True):
            _check_same(name, x, pow2=pow2)


@runnable
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_values(dtype):
    # Zero tiles (amax clamped to 1e-4), tiny tiles (subnormal e4m3 outputs), values that land
    # halfway between e4m3 neighbours after scaling, and a huge-magnitude row.
    m, k = 130, 260
    x = _rand(m, k, torch.float32, seed=7)
    x[:, :128] = 0.0  # every 1x128 tile of columns 0..127 is zero
    x[0:128, 128:256] *= 1e-9  # 128x128 block of tiny values (amax far below 1e-4)
    x[5, 256:] = torch.tensor([448.0, 17.0, 19.0, -9.0])  # sf == 1: halfway cases stay halfway
    x[6, 256:] = torch.tensor([0.0, -0.0, 1e-40, -1e-40])  # signed zeros, subnormal inputs
    x[129] *= 1e3 if dtype == torch.float16 else 1e30
    x = x.to(dtype).to(DEVICE)
    for name in ALL_FUNCS:
        for pow2 in (False, True):
            _check_same(name, x, pow2=pow2)


@runnable
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy: inf/inf
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_nan_and_inf_give_the_reference_bits(dtype):
    x = _rand(129, 300, torch.float32, seed=3)
    x[3, 5] = float("nan")
    x[7, 200] = float("inf")
    x[100, 250] = -float("inf")
    x[128, 299] = float("nan")  # in the tail tile of both axes
    x[64, 140] = -float("nan")
    x = x.to(dtype).to(DEVICE)
    for name in ALL_FUNCS:
        for pow2 in (False, True):
            got = _check_same(name, x, pow2=pow2)
            assert torch.isnan(got[1]).any(), f"{name}: a NaN tile must have a NaN scale"


@runnable
@pytest.mark.parametrize("m", [1, 13, 129])
def test_mn_major_scales(m):
    k = 300
    x = _rand(m, k, torch.bfloat16, seed=m)
    for name in FUNCS:
        got = getattr(tq, name)(x, pow2_scale=False, sf_layout="mn_major")
        want = getattr(ref, name)(x.cpu())
        for out_name, g, w in zip(OUT_NAMES[name], got, want):
            tag = f"{name} {m=} {out_name}"
            _assert_same(g.contiguous(), w, tag)  # same values
            if out_name.startswith("sf"):
                rows = g.shape[0]
                assert g.stride() == (1, -(-rows // 4) * 4), f"{tag}: strides {g.stride()}"
            else:
                assert g.is_contiguous(), tag


@runnable
def test_strided_inputs():
    base = _rand(140, 400, torch.bfloat16, seed=11)
    row_slice = base[3:132, 17:317]  # stride(-1) == 1, row stride 400, odd offset
    transposed = _rand(300, 129, torch.bfloat16, seed=12).t()  # stride(-1) != 1: copied
    for x in (row_slice, transposed):
        for name in ALL_FUNCS:
            _check_same(name, x)


@runnable
@pytest.mark.parametrize("block", [32, 64])
def test_other_block_sizes(block):
    x = _rand(129, 300, torch.float32, seed=block)
    for name in ALL_FUNCS:
        _check_same(name, x, block=block, pow2=block == 64)


@runnable
@pytest.mark.parametrize("name", FUNCS)
def test_gpu_tile_configs(name, monkeypatch):
    # The GPU's tiles (narrow 128x1 tiles, the two-pass fused walk) checked here too, whatever
    # device runs the tests (the interpreter otherwise uses whole 128x128 tiles).
    gpu_config = tq._config_1x
    monkeypatch.setattr(
        tq,
        "_config_1x",
        lambda m, block, *, row, col, interpreted=False: gpu_config(m, block, row=row, col=col),
    )
    for m, k, dtype, pow2 in [(129, 300, torch.bfloat16, False), (256, 200, torch.float32, True)]:
        _check_same(name, _rand(m, k, dtype, seed=m + k), pow2=pow2)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_FUNCS)
@pytest.mark.parametrize("bad, block, exc", BAD_INPUTS)
def test_errors_match_reference(name, bad, block, exc):
    with pytest.raises(exc) as want:
        getattr(ref, name)(bad, block)
    with pytest.raises(exc) as got:
        getattr(tq, name)(bad, block)
    assert str(got.value) == str(want.value)


@pytest.mark.parametrize("name", ALL_FUNCS)
def test_errors_of_the_triton_backend(name, monkeypatch):
    x = torch.zeros(4, 4, device=DEVICE)
    for block in (100, 8, 256):
        with pytest.raises(ValueError, match=f"power of two between 16 and 128.*got {block}"):
            getattr(tq, name)(x, block)
    if not name.startswith("per_block"):
        with pytest.raises(ValueError, match="sf_layout must be one of"):
            getattr(tq, name)(x, sf_layout="col_major")
    monkeypatch.setattr(tq, "_kernels_interpreted", lambda: False)
    with pytest.raises(ValueError, match=r"must be a CUDA tensor.*TRITON_INTERPRET=1"):
        getattr(tq, name)(x.cpu())


# ---------------------------------------------------------------------------------------------
# GPU: DeepSeek-V3 sizes (runs where a CUDA device is present)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1: kernels are not compiled")
@pytest.mark.parametrize("m,k", [(4096, 7168), (4096, 2112), (4001, 576)])
def test_gpu_dsv3_shapes(m, k):
    x = _rand(m, k, torch.bfloat16, seed=m + k, device="cuda")
    x[17, 5] = float("nan")
    x[4000, k - 1] = float("inf")
    for name in ALL_FUNCS:
        for pow2 in (False, True):
            _check_same(name, x, pow2=pow2)
    x32 = _rand(m, k, torch.float32, seed=m - k, device="cuda")
    _check_same("per_token_cast_to_fp8_both", x32)


@pytest.mark.gpu
@pytest.mark.skipif(INTERPRETED, reason="TRITON_INTERPRET=1: kernels are not compiled")
@pytest.mark.parametrize("m", [4096, 4000])
def test_gpu_mn_major_scales_feed_scaled_mm(m):
    # The MN-major scales are a layout torch._scaled_mm takes for a 1x128 LHS (docs/design.md §2):
    # the product equals, bit for bit, the one with the reference scales made MN-major by a copy.
    # (torch 2.11's blockwise _scaled_mm rejects M % 4 != 0 in any scale layout: M = 4000.)
    k = 7168
    x = _rand(m, k, torch.bfloat16, seed=m, device="cuda")
    w_fp8, w_sf = tq.per_block_cast_to_fp8(_rand(512, k, torch.bfloat16, seed=1, device="cuda"))
    x_fp8, x_sf = tq.per_token_cast_to_fp8(x, sf_layout="mn_major")
    x_fp8_ref, x_sf_ref = (t.cuda() for t in ref.per_token_cast_to_fp8(x.cpu()))
    out = torch._scaled_mm(x_fp8, w_fp8.t(), x_sf, w_sf.t(), out_dtype=torch.bfloat16)
    out_ref = torch._scaled_mm(
        x_fp8_ref, w_fp8.t(), x_sf_ref.t().contiguous().t(), w_sf.t(), out_dtype=torch.bfloat16
    )
    assert_bitwise_equal(out, out_ref, f"_scaled_mm with mn_major scales {m=} {k=}")


# ---------------------------------------------------------------------------------------------
# Compile-only: the fused kernel's PTX for sm_90, no GPU needed
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
import ptxtrain.quant.triton as tq

kernel = tq._quant_1x_kernel
ptrs = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "qt_ptr": "*fp8e4nv",
        "sf_ptr": "*fp32", "sft_ptr": "*fp32"}
result = {}
for label, cfg in json.loads(sys.argv[1]).items():
    consts = dict(BLOCK_M=cfg["block_m"], BLOCK_K=cfg["block_k"], SUB_K=cfg["sub_k"],
                  ROW=cfg["row"], COL=cfg["col"], POW2=False)
    sig = {n: ptrs.get(n, "i32") for n in kernel.arg_names if n not in consts}
    sig.update({n: "constexpr" for n in consts})
    # What the launcher infers for aligned DeepSeek-V3 shapes: 16-byte aligned pointers and
    # sizes / row strides divisible by 16.
    aligned = set(ptrs) | {"M", "K", "stride_xm", "stride_qm", "stride_qt_k"}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=target,
                              options={"num_warps": cfg["num_warps"]})
    ptx = compiled.asm["ptx"]
    result[label] = {
        "cvt_e4m3x2": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
        "div_rn": ptx.count("div.rn.f32"),
        "fma_rn": ptx.count("fma.rn.f32"),
        "div_approx": len(re.findall(r"div\\.(full|approx)\\.f32", ptx)),
        "ld_global": re.findall(r"ld\\.global[.\\w]*", ptx),
        "st_global": re.findall(r"st\\.global[.\\w]*", ptx),
    }
emit(result)
"""


def test_compile_fused_kernel_for_sm90_ptx(tmp_path):
    configs = {}
    for label, row, col in (("both", True, True), ("row", True, False), ("col", False, True)):
        cfg = tq._config_1x(4096, 128, row=row, col=col)
        configs[label] = {**dataclasses.asdict(cfg), "row": row, "col": col}
    result = run_sm90_script(_COMPILE_SCRIPT, tmp_path, json.dumps(configs))
    for label, r in result.items():
        tag = f"{label}: {r}"
        # fp32 -> e4m3 through the saturating RNE pair conversion (what torch's cast does).
        assert r["cvt_e4m3x2"] > 0, tag
        # IEEE division: div.rn for the scales and reciprocals (and the non-finite path), the
        # FMA-corrected quotient elsewhere; never the approximate div.full / div.approx.
        assert r["div_rn"] > 0 and r["fma_rn"] > 0 and r["div_approx"] == 0, tag
        # Every global load is 128-bit: the bf16 tile arrives in 16-byte vectors only.
        assert r["ld_global"] and all(".v4." in op for op in r["ld_global"]), tag
        # The fp8 tiles (x_fp8 and the transposed xt_fp8) leave in 16-byte vectors; the only
        # other stores are the fp32 scales, one 32-bit store each.
        stores = r["st_global"]
        assert any(".v4." in op for op in stores), tag
        assert all(".v4." in op or op == "st.global.b32" for op in stores), tag
