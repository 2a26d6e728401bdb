"""The fused training ops (SwiGLU, RMSNorm, MLA q/k with RoPE): Triton kernels (the interpreter on
the CPU, CUDA with the ``gpu`` marker) against their torch references, the references against
float64 gradcheck, the model wired to them, and the argument errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ptxtrain.model import build_model, get_preset
from ptxtrain.model.deepseek import MLA, RMSNorm, rope_freqs
from ptxtrain.moe.layer import MLP
from ptxtrain.nn import functional as fn
from ptxtrain.testing import assert_bitwise_equal

MEDIUM = get_preset("medium")
# B, T on the CPU (the interpreter runs one program after the other); the GPU tests run 16,384
TOKENS_CPU = (2, 32)

# One ulp of a value v of the output dtype is at most rel·|v| (rel = 2^-(mantissa bits)). The
# kernels and the references compute the same fp32 value up to a few fp32 ulps (another exp or
# reduction order), so a rounded output sits on the same grid point or, when that fp32 value lies
# at a rounding boundary, on the neighbour: at most one ulp of the output dtype apart.
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}
# fp32 outputs: 8 fp32 ulps (2^-20 relative): numpy's exp (interpreter) or ex2.approx (GPU) vs
# torch's, 1-2 ulps each, through a quotient and a product; sums of up to 7168 squares in
# another order change rstd by a few ulps.
FP32_REL = 2.0**-20


def _rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float32) * scale).to(dtype)


def _leaf(*shape, dtype, seed, device="cpu", scale=1.0):
    return _rand(*shape, dtype=dtype, seed=seed, scale=scale).to(device).requires_grad_()


def _assert_within(got, want, rel, floor=0.0, what=""):
    """``|got - want| <= rel·|want| + floor`` elementwise (float64 comparison)."""
    assert got.shape == want.shape and got.dtype == want.dtype, what
    got, want = got.detach(), want.detach()
    err = (got.double() - want.double()).abs()
    bound = rel * want.double().abs() + floor
    bad = err > bound
    worst = float((err - bound).max()) if err.numel() else 0.0
    assert not bool(bad.any()), f"{what}: {int(bad.sum())} of {err.numel()} off, worst {worst:.3e}"


def _rel(dtype):
    return ULP.get(dtype, FP32_REL)


# ------------------------------------------------------------------------------------ SwiGLU
def _swiglu_case(shape, dtype, device, seed):
    a = _leaf(*shape, dtype=dtype, seed=seed, device=device, scale=3.0)
    b = _leaf(*shape, dtype=dtype, seed=seed + 1, device=device)
    g = _rand(*shape, dtype=dtype, seed=seed + 2).to(device)
    out = {}
    for name, run in (("triton", fn.swiglu), ("ref", lambda x, y, kernels: fn.swiglu_ref(x, y))):
        y = run(a, b, kernels=name)
        out[name] = (y, *torch.autograd.grad(y, (a, b), g))
    return a.detach().float(), b.detach().float(), g.float(), out


def _check_swiglu(shape, dtype, device="cpu", seed=0, fp32_rel=FP32_REL):
    a, b, g, out = _swiglu_case(shape, dtype, device, seed)
    (y, da, db), (y_r, da_r, db_r) = out["triton"], out["ref"]
    rel = fp32_rel if dtype == torch.float32 else _rel(dtype)
    _assert_within(y, y_r, rel, what="silu(a)·b")
    _assert_within(db, db_r, rel, what="db")
    # da = g·b·σ(a)·(1 + a(1 - σ(a))): the bracket cancels near a ≈ -1.28, so its fp32 error is
    # an ulp of its terms (1 and |a|), not of the result: the floor is that error times g·b·σ.
    floor = 4 * fp32_rel * (g * b).abs() * (1 + a.abs()) * torch.sigmoid(a)
    _assert_within(da, da_r, rel, floor.to(device), what="da")
    return y, y_r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(*TOKENS_CPU, MEDIUM.moe_inter_dim), (3, 5, 77)])
def test_swiglu_kernel_matches_reference(shape, dtype):
    y, y_r = _check_swiglu(shape, dtype, seed=len(shape))
    if dtype == torch.bfloat16:
        # the bf16 grid is coarse: nearly every element is bitwise the reference
        assert (y != y_r).float().mean() < 0.01


def test_swiglu_kernel_dense_width():
    _check_swiglu((24, MEDIUM.dense_inter_dim), torch.bfloat16, seed=5)


def test_swiglu_reference_is_fp32_math_with_one_rounding():
    a, b = _rand(64, 96, dtype=torch.bfloat16, seed=1), _rand(64, 96, dtype=torch.bfloat16, seed=2)
    want = (torch.nn.functional.silu(a.float()) * b.float()).to(torch.bfloat16)
    assert_bitwise_equal(fn.swiglu(a, b), want, name="swiglu auto on CPU")
    x32 = _rand(64, 96, seed=3)
    assert_bitwise_equal(fn.swiglu(x32, x32), torch.nn.functional.silu(x32) * x32, name="fp32")


def test_swiglu_reference_gradcheck_float64():
    a = _leaf(3, 7, dtype=torch.float64, seed=4, scale=2.0)
    b = _leaf(3, 7, dtype=torch.float64, seed=5)
    assert torch.autograd.gradcheck(fn.swiglu, (a, b))


def test_swiglu_errors():
    a = torch.randn(4, 8)
    with pytest.raises(TypeError, match="b must have a's dtype"):
        fn.swiglu(a, a.double())
    with pytest.raises(ValueError, match="b must have a's shape"):
        fn.swiglu(a, a[:, :4])
    with pytest.raises(TypeError, match="a must"):
        fn.swiglu(torch.ones(4, 8, dtype=torch.int32), a)
    with pytest.raises(TypeError, match="b must"):
        fn.swiglu(a, [1.0])
    with pytest.raises(ValueError, match="kernels must be one of"):
        fn.swiglu(a, a, kernels="fast")
    with pytest.raises(TypeError, match="float32 / bfloat16 / float16"):
        fn.swiglu(a.double(), a.double(), kernels="triton")


def _swiglu_stacked_pair(shape, dtype, kernels, device="cpu", seed=0):
    """swiglu_stacked(h) and swiglu on h's two halves (one kernel choice): (y, dh) of each."""
    h = _leaf(*shape, dtype=dtype, seed=seed, device=device, scale=3.0)
    half = shape[-1] // 2
    g = _rand(*shape[:-1], half, dtype=dtype, seed=seed + 1).to(device)
    y = fn.swiglu_stacked(h, kernels=kernels)
    y2 = fn.swiglu(h[..., :half], h[..., half:], kernels=kernels)
    return (y, *torch.autograd.grad(y, h, g)), (y2, *torch.autograd.grad(y2, h, g))


@pytest.mark.parametrize("kernels", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize(
    "shape", [(37, 2 * MEDIUM.moe_inter_dim), (3, 5, 154), (9, 6), (2, 600)], ids=str
)
def test_swiglu_stacked_equals_swiglu_on_the_halves_bitwise(shape, dtype, kernels):
    # The stacked kernels share the two-input kernels' math (and the reference is swiglu_ref
    # on the halves), so output and the [da | db] gradient are the same bits; the shapes take
    # the medium experts' I = 1408 (6 column tiles, the last one part-masked), a 3-D input, an
    # I below one tile, and rows that end inside a row tile.
    # dh compares through `+ 0.0`: the halves' gradient sums two zero-padded slices, which
    # turns a -0.0 into +0.0 (see the GPU test below).
    (y, dh), (y2, dh2) = _swiglu_stacked_pair(shape, dtype, kernels, seed=len(shape))
    assert y.shape == (*shape[:-1], shape[-1] // 2) and dh.shape == shape
    assert_bitwise_equal(y, y2, name="y")
    assert_bitwise_equal(dh + 0.0, dh2 + 0.0, name="dh")


# ----------------------------------------------------------- stacked SwiGLU, input kept in FP8
def _fp8_saved_case(rows, inter, dtype, seed):
    """h [rows, 2I] (leaf, spread over ±9 so tiles have distinct scales) and g [rows, I]."""
    h = _leaf(rows, 2 * inter, dtype=dtype, seed=seed, scale=3.0)
    with torch.no_grad():
        h.mul_(torch.linspace(0.1, 3.0, rows, dtype=dtype).unsqueeze(1))
    return h, _rand(rows, inter, dtype=dtype, seed=seed + 1)


def _check_fp8_saved_kernels(h, g, pow2, quantize):
    """The _q kernels on h [rows, 2I] and g [rows, I] against their definitions, bit for bit:
    the output is the unquantized kernel's, the saved pair is ``quantize``'s (a 1x128
    quantizer bit-exact with the reference), and the gradient is the unquantized backward
    kernel at the dequantized input, cast once. Returns (y, dh)."""
    from ptxtrain.nn import triton_ops
    from ptxtrain.quant import ref as qref

    y, q, sf = triton_ops.swiglu_stacked_fwd_q(h, pow2)
    assert_bitwise_equal(y, triton_ops.swiglu_stacked_fwd(h), name="y")
    q_ref, sf_ref = quantize(h, pow2_scale=pow2)
    assert_bitwise_equal(q, q_ref, name="h_fp8")
    assert_bitwise_equal(sf, sf_ref, name="sf")
    dh = triton_ops.swiglu_stacked_bwd_q(g, q, sf, h.dtype)
    want = triton_ops.swiglu_stacked_bwd(g, qref.per_token_cast_back(q, sf)).to(h.dtype)
    assert_bitwise_equal(dh, want, name="dh")
    return y, dh


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(37, MEDIUM.moe_inter_dim), (70, 128), (0, 256)])
def test_swiglu_stacked_fp8_saved_kernels_bitwise(rows, inter, dtype, pow2):
    # The _q kernels against their definitions, bit for bit: the output is the unquantized
    # kernel's, the saved pair is per_token_cast_to_fp8's (the reference quantizer), and the
    # gradient is the unquantized backward kernel at the dequantized input, cast once; the
    # autograd function returns exactly that gradient. Rows end inside a 32-row program (37,
    # 70) or are none at all; I = 1408 is the medium experts' (11 tiles per half).
    from ptxtrain.quant import ref as qref

    h, g = _fp8_saved_case(rows, inter, dtype, seed=rows + inter)
    y, dh = _check_fp8_saved_kernels(h.detach(), g, pow2, qref.per_token_cast_to_fp8)
    y2 = fn.swiglu_stacked(h, kernels="triton", save_input_fp8=True, pow2_scale=pow2)
    assert_bitwise_equal(y2, y, name="y (autograd)")
    (dh2,) = torch.autograd.grad(y2, h, g)
    assert_bitwise_equal(dh2, dh, name="dh (autograd)")


@pytest.mark.parametrize("kernels", ["triton", "ref"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_stacked_fp8_saved_gradient(kernels, dtype):
    # Against the input kept as is: the forward is unchanged (bitwise) and the gradient carries
    # the 1x128 e4m3 quantization of h (3 mantissa bits: about 30 dB SQNR); 25 dB leaves margin
    # while a wrong scale or half gives below 10. The Triton and reference paths differ only in
    # exp (1-2 fp32 ulps) and da's cancellation near a = -1.28: one ulp of the dtype plus a
    # floor of 4 fp32 ulps of the largest gradient.
    from ptxtrain.testing import sqnr_db

    h, g = _fp8_saved_case(64, 256, dtype, seed=9)
    y = fn.swiglu_stacked(h, kernels=kernels, save_input_fp8=True)
    y_full = fn.swiglu_stacked(h, kernels=kernels)
    assert_bitwise_equal(y, y_full, name="y")
    (dh,) = torch.autograd.grad(y, h, g)
    (dh_full,) = torch.autograd.grad(y_full, h, g)
    assert sqnr_db(dh.float(), dh_full.float()) > 25
    if kernels == "triton":
        y_r = fn.swiglu_stacked(h, kernels="ref", save_input_fp8=True)
        (dh_r,) = torch.autograd.grad(y_r, h, g)
        floor = 4 * FP32_REL * float(dh_r.abs().max())
        _assert_within(dh, dh_r, _rel(dtype), floor, what="triton vs reference dh")


@pytest.mark.parametrize("kernels", ["triton", "ref"])
def test_swiglu_stacked_fp8_saved_keeps_no_16_bit_copy(kernels):
    # What backward holds: the e4m3 tiles and their fp32 scales, not h (about half the bytes).
    h, _ = _fp8_saved_case(64, 256, torch.bfloat16, seed=3)
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn.swiglu_stacked(h, kernels=kernels, save_input_fp8=True)
    assert sorted(saved, key=str) == [(torch.float32, 64 * 4), (torch.float8_e4m3fn, h.numel())]


def test_swiglu_stacked_fp8_saved_errors():
    with pytest.raises(ValueError, match="I a multiple of 128"):
        fn.swiglu_stacked(torch.randn(4, 200), save_input_fp8=True)
    with pytest.raises(ValueError, match="I a multiple of 128"):
        fn.swiglu_stacked(torch.randn(4, 256, dtype=torch.float64), save_input_fp8=True)
    with pytest.raises(TypeError, match="save_input_fp8 must be a bool"):
        fn.swiglu_stacked(torch.randn(4, 256), save_input_fp8=1)
    with pytest.raises(TypeError, match="pow2_scale must be a bool"):
        fn.swiglu_stacked(torch.randn(4, 256), save_input_fp8=True, pow2_scale=None)


@pytest.mark.parametrize("kernels", ["triton", "ref"])
@pytest.mark.parametrize("fp8_saved", [False, True])
def test_swiglu_stacked_with_no_rows(kernels, fp8_saved):
    # An expert-parallel rank whose experts received no tokens runs the experts on [0, 2I]
    # rows: forward gives [0, I], backward a [0, 2I] gradient, on both paths.
    h = torch.randn(0, 2 * MEDIUM.moe_inter_dim, dtype=torch.bfloat16, requires_grad=True)
    y = fn.swiglu_stacked(h, kernels=kernels, save_input_fp8=fp8_saved)
    assert y.shape == (0, MEDIUM.moe_inter_dim)
    (dh,) = torch.autograd.grad(y, h, torch.empty_like(y))
    assert dh.shape == h.shape and dh.dtype == h.dtype


def test_swiglu_stacked_reference_gradcheck_float64_and_errors():
    h = _leaf(3, 8, dtype=torch.float64, seed=6, scale=2.0)
    assert torch.autograd.gradcheck(fn.swiglu_stacked, (h,))
    with pytest.raises(ValueError, match="even last dim"):
        fn.swiglu_stacked(torch.randn(4, 7))
    with pytest.raises(ValueError, match="even last dim"):
        fn.swiglu_stacked(torch.randn(4, 0))
    with pytest.raises(ValueError, match="even last dim"):
        fn.swiglu_stacked(torch.tensor(1.0))
    with pytest.raises(TypeError, match="h must"):
        fn.swiglu_stacked(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="kernels must be one of"):
        fn.swiglu_stacked(torch.randn(4, 8), kernels="fast")


def test_auto_runs_the_reference_on_cpu():
    x = torch.randn(2, 3)
    assert not fn.use_triton_kernels("auto", x)  # even under TRITON_INTERPRET=1
    assert not fn.use_triton_kernels("ref", x)
    assert fn.use_triton_kernels("triton", x)  # the interpreter (tests/conftest.py)


# ------------------------------------------------------------------------------------ RMSNorm
def _rms_case(rows_shape, d, dtype, w_dtype, device="cpu", seed=0):
    x = _leaf(*rows_shape, d, dtype=dtype, seed=seed, device=device, scale=2.0)
    w = (1 + 0.2 * _rand(d, seed=seed + 1)).to(w_dtype).to(device).requires_grad_()
    g = _rand(*rows_shape, d, dtype=dtype, seed=seed + 2).to(device)
    out = {}
    for kernels in ("triton", "ref"):
        y = fn.rms_norm(x, w, 1e-6, kernels=kernels)
        out[kernels] = (y, *torch.autograd.grad(y, (x, w), g))
    return out


def _check_rms(rows_shape, d, dtype, w_dtype=torch.float32, device="cpu", seed=0):
    out = _rms_case(rows_shape, d, dtype, w_dtype, device, seed)
    (y, dx, dw), (y_r, dx_r, dw_r) = out["triton"], out["ref"]
    _assert_within(y, y_r, _rel(dtype), what=f"y D={d}")
    # The gradients are fp32 sums (over D for dx's mean(g·w·x̂), over the rows for dweight) in
    # other orders than torch's graph: their error is relative to the summands, which can cancel
    # to ~0 in single elements, hence a floor of 1e-5 of the largest gradient element.
    _assert_within(dx, dx_r, max(_rel(dtype), 1e-5), 1e-5 * float(dx_r.abs().max()), what="dx")
    _assert_within(dw, dw_r, max(_rel(w_dtype), 1e-5), 1e-5 * float(dw_r.abs().max()), what="dw")


@pytest.mark.parametrize("d", [512, 1536, 2048, 7168])
def test_rms_norm_kernel_model_widths(d):
    dtype = torch.bfloat16 if d != 1536 else torch.float32
    _check_rms(TOKENS_CPU if d < 7168 else (64,), d, dtype, seed=d)


@pytest.mark.parametrize(
    "rows_shape, d, dtype, w_dtype",
    [
        ((37,), 100, torch.float32, torch.float32),
        ((3, 11), 1000, torch.bfloat16, torch.bfloat16),
        ((5,), 1000, torch.float16, torch.float32),
        ((43,), 24, torch.bfloat16, torch.float32),
        ((2,), 3, torch.float32, torch.float32),
    ],
)
def test_rms_norm_kernel_awkward_shapes(rows_shape, d, dtype, w_dtype, monkeypatch):
    # 8 backward programs: several rows each, the last one short (43 = 7·6 + 1 rows)
    monkeypatch.setattr(fn._ops(), "_NORM_BWD_PROGRAMS", 8)
    _check_rms(rows_shape, d, dtype, w_dtype, seed=d + len(rows_shape))


def test_rms_norm_kernel_empty_and_strided_input():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    y = fn.rms_norm(x, w, kernels="triton")
    y.sum().backward()
    assert y.shape == (0, 16) and torch.equal(w.grad, torch.zeros(16))
    base = _rand(6, 40, seed=9)
    view = base[:, 8:28]  # row stride 40: read in place
    assert_bitwise_equal(
        fn.rms_norm(view, torch.ones(20), kernels="triton"),
        fn.rms_norm(view.contiguous(), torch.ones(20), kernels="triton"),
        name="strided rows",
    )


def test_rms_norm_module_is_the_previous_formula_on_cpu():
    norm = RMSNorm(48)
    with torch.no_grad():
        norm.weight.mul_(1 + 0.1 * _rand(48, seed=2))
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        x = _rand(4, 48, dtype=dtype, seed=3)
        acc = torch.promote_types(dtype, torch.float32)
        want = torch.nn.functional.rms_norm(x.to(acc), (48,), norm.weight.to(acc), 1e-6)
        assert_bitwise_equal(norm(x), want.to(dtype), name=f"RMSNorm {dtype}")


def test_rms_norm_reference_gradcheck_float64():
    x = _leaf(3, 9, dtype=torch.float64, seed=1)
    w = _leaf(9, dtype=torch.float64, seed=2)
    assert torch.autograd.gradcheck(lambda a, b: fn.rms_norm(a, b, 1e-6), (x, w))


def test_rms_norm_errors():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight must be"):
        fn.rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="x must"):
        fn.rms_norm(x.long(), torch.ones(8))
    with pytest.raises(TypeError, match="eps must be a float"):
        fn.rms_norm(x, torch.ones(8), "1e-6")
    with pytest.raises(ValueError, match="eps must be >= 0"):
        fn.rms_norm(x, torch.ones(8), -1.0)
    with pytest.raises(ValueError, match=r"x.shape\[-1\] <= 16384"):
        fn.rms_norm(torch.randn(1, 16385), torch.ones(16385), kernels="triton")


# ------------------------------------------------------------------------------------ MLA q/k
@dataclasses.dataclass
class _MLAShape:
    b: int
    t: int
    h: int
    nope: int
    rope: int
    v: int
    lora: int = 8  # k_pe is a slice of a [B, T, lora + rope] tensor, as in MLA


def _mla_case(s: _MLAShape, dtype, device="cpu", seed=0):
    q = _leaf(s.b, s.t, s.h, s.nope + s.rope, dtype=dtype, seed=seed, device=device)
    kv = _leaf(s.b, s.t, s.h, s.nope + s.v, dtype=dtype, seed=seed + 1, device=device)
    kv_a = _leaf(s.b, s.t, s.lora + s.rope, dtype=dtype, seed=seed + 2, device=device)
    freqs = rope_freqs(s.t, s.rope, 10000.0, torch.device(device))
    # gradients as SDPA hands them back: [B, H, T, ·] contiguous, seen through a transpose
    grads = [
        _rand(s.b, s.h, s.t, n, dtype=dtype, seed=seed + 3 + i).to(device).transpose(1, 2)
        for i, n in enumerate((s.nope + s.rope, s.nope + s.rope, s.v))
    ]
    return (q, kv, kv_a, freqs), grads


def _run_mla(inputs, grads, kernels, upcast=False):
    q, kv, kv_a, freqs = inputs
    rope = freqs.shape[-1] * 2
    if upcast:  # the reference's math on fp32 copies of the inputs and gradients
        q, kv, kv_a = (z.float() for z in (q, kv, kv_a))
        grads = [g.float() for g in grads]
    outs = fn.mla_qk(q, kv, kv_a[..., -rope:], freqs, kernels=kernels)
    leaves = inputs[:3]
    return outs, torch.autograd.grad(outs, leaves, grads)


MLA_SHAPES = {
    "medium": _MLAShape(1, 16, MEDIUM.n_heads, 128, 64, 128),
    "awkward": _MLAShape(2, 5, 20, 100, 6, 36),  # two head blocks, non-power-of-two widths
    "no-nope": _MLAShape(1, 3, 3, 0, 8, 5),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", list(MLA_SHAPES))
def test_mla_qk_kernel_matches_reference(shape, dtype):
    inputs, grads = _mla_case(MLA_SHAPES[shape], dtype, seed=len(shape))
    (q, k, v), (dq, dkv, dkv_a) = _run_mla(inputs, grads, "triton")
    (q_r, k_r, v_r), (dq_r, dkv_r, _) = _run_mla(inputs, grads, "ref")
    # Same products, same order, one rounding each (fp contraction off), and copies: bitwise on
    # the CPU where torch's complex64 multiply is vectorized (rope/2 a multiple of 8: each
    # product rounded before the add). Its scalar loop (other widths) is compiled with FMA
    # contraction: a rotated element then differs by an ulp of its larger product.
    pairs = ((q, q_r, "q"), (k, k_r, "k"), (dq, dq_r, "dq"), (dkv, dkv_r, "dkv"))
    for got, want, name in pairs:
        if MLA_SHAPES[shape].rope % 16 == 0:
            assert_bitwise_equal(got, want, name=f"{shape} {name}")
        else:
            floor = FP32_REL * float(want.detach().abs().max())
            _assert_within(got, want, _rel(dtype), floor, what=f"{shape} {name}")
    assert v.data_ptr() == v_r.data_ptr() and v.stride() == v_r.stride()  # v: a view of kv
    rope = inputs[3].shape[-1] * 2
    lora = dkv_a.shape[-1] - rope
    assert_bitwise_equal(dkv_a[..., :lora], torch.zeros_like(dkv_a[..., :lora]), name="lora")
    # dk_pe: the kernel sums the heads in fp32 and rotates once; the bf16 reference rounds the
    # head sum to bf16 before rotating. Against the reference's math in fp32 (one rounding at
    # the end), only the fp32 sum order differs: one output ulp, or 8 fp32 ulps.
    _, (_, _, dkv_a_32) = _run_mla(inputs, grads, "ref", upcast=True)
    want = dkv_a_32[..., lora:].to(dtype)
    floor = 1e-6 * float(want.abs().max())  # a head sum can cancel to ~0
    _assert_within(dkv_a[..., lora:], want, _rel(dtype), floor, what="dk_pe")


def test_mla_qk_reference_gradcheck_float64():
    s = _MLAShape(1, 3, 2, 4, 4, 3)
    (q, kv, kv_a, freqs), _ = _mla_case(s, torch.float64, seed=7)

    def run(q, kv, kv_a):
        return fn.mla_qk(q, kv, kv_a[..., -s.rope :], freqs)

    assert torch.autograd.gradcheck(run, (q, kv, kv_a))


def test_mla_qk_errors():
    s = _MLAShape(1, 4, 2, 8, 4, 6)
    (q, kv, kv_a, freqs), _ = _mla_case(s, torch.float32)
    k_pe = kv_a[..., -4:]
    with pytest.raises(TypeError, match="kv must have q's dtype"):
        fn.mla_qk(q, kv.double(), k_pe, freqs)
    with pytest.raises(TypeError, match="freqs must"):
        fn.mla_qk(q, kv, k_pe, torch.view_as_real(freqs))
    with pytest.raises(ValueError, match="k_pe must be"):
        fn.mla_qk(q, kv, kv_a[..., -3:], freqs)
    with pytest.raises(ValueError, match="kv must be"):
        fn.mla_qk(q, kv[:, :, :1], k_pe, freqs)
    with pytest.raises(ValueError, match="freqs must be"):
        fn.mla_qk(q, kv, k_pe, freqs[:3])
    with pytest.raises(ValueError, match="q must"):
        fn.mla_qk(q[0], kv, k_pe, freqs)


# ------------------------------------------------------------------------------------ the model
def _set_kernels(model, kernels):
    for m in model.modules():
        if isinstance(m, (RMSNorm, MLA, MLP)):
            m.kernels = kernels


def test_model_with_kernels_matches_reference_paths():
    cfg = dataclasses.replace(get_preset("tiny"), n_layers=2, mtp_depth=0)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    results = {}
    for kernels in ("ref", "triton"):
        model = build_model(cfg, dtype=torch.float32, seed=1)
        model.set_recompute("selective")
        _set_kernels(model, kernels)
        out = model(ids, labels=ids.roll(-1, 1))
        out.loss.backward()
        results[kernels] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    (loss, grads), (loss_r, grads_r) = results["triton"], results["ref"]
    # fp32 model: the ops agree to a few fp32 ulps (above); through two layers, the loss and
    # gradients agree to ~1e-6 relative (a wrong kernel moves them by >1e-2).
    torch.testing.assert_close(loss, loss_r, rtol=1e-6, atol=0)
    for name, g in grads_r.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()))


# ------------------------------------------------------------------------------------ GPU
GPU_TOKENS = (4, 4096)  # 16,384 tokens


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_cuda_matches_reference(dtype):
    # Triton's fp32 exp is ex2.approx of a·log2(e): relative error about |a|·2^-24 + 2^-22, up
    # to ~10 fp32 ulps for |a| <= 15 (a ~ 3·randn), hence 32 ulps here (torch's expf: ~1 ulp).
    for inter in (MEDIUM.moe_inter_dim, MEDIUM.dense_inter_dim, 1000):
        _check_swiglu((*GPU_TOKENS, inter), dtype, device="cuda", seed=inter, fp32_rel=2.0**-18)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_stacked_cuda_equals_swiglu_on_the_halves(dtype):
    # The same elementwise math compiled into both kernels, contraction off: the same bits on
    # the GPU too, at the medium experts' rows (16,384 tokens) and I = 1408, and an awkward I.
    # The halves' gradient is autograd's sum of two zero-padded slices, so a -0.0 of da / db
    # arrives there as +0.0: both sides go through `+ 0.0`, which maps -0.0 to +0.0 and leaves
    # every other value's bits alone.
    for inter in (MEDIUM.moe_inter_dim, 1000):
        shape = (GPU_TOKENS[0] * GPU_TOKENS[1], 2 * inter)
        (y, dh), (y2, dh2) = _swiglu_stacked_pair(shape, dtype, "triton", "cuda", seed=inter)
        assert_bitwise_equal(y, y2, name=f"y I={inter}")
        assert_bitwise_equal(dh + 0.0, dh2 + 0.0, name=f"dh I={inter}")


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [False, True])
def test_swiglu_stacked_fp8_saved_cuda_bitwise(pow2):
    # The _q kernels on the GPU at the medium experts' rows (16,384 tokens x 6) and I = 1408:
    # the output is the unquantized kernel's, the saved pair is the CUDA quantizer's (bit-exact
    # with the reference by its own tests), and the gradient is the unquantized backward kernel
    # at the dequantized input: the same bits (contraction off in both kernels).
    from ptxtrain import quant

    rows, inter = GPU_TOKENS[0] * GPU_TOKENS[1] * 6, MEDIUM.moe_inter_dim
    h, g = _fp8_saved_case(rows, inter, torch.bfloat16, seed=11)
    _check_fp8_saved_kernels(h.detach().cuda(), g.cuda(), pow2, quant.per_token_cast_to_fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, 1536, 2048, 7168, 100, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_cuda_matches_reference(d, dtype):
    _check_rms(GPU_TOKENS, d, dtype, device="cuda", seed=d)
    _check_rms(GPU_TOKENS, d, dtype, torch.bfloat16, device="cuda", seed=d + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["medium", "awkward"])
def test_mla_qk_cuda_matches_reference(shape, dtype):
    s = dataclasses.replace(MLA_SHAPES[shape], b=GPU_TOKENS[0], t=GPU_TOKENS[1] // 8)
    inputs, grads = _mla_case(s, dtype, device="cuda", seed=3)
    outs, grads_k = _run_mla(inputs, grads, "triton")
    outs_r, grads_r = _run_mla(inputs, grads, "ref")
    # CUDA's complex multiply may contract a product into an FMA: one output ulp, or 8 fp32
    # ulps; dk_pe as on the CPU (the reference's extra bf16 rounding of the head sum).
    for got, want in zip(outs[:2] + grads_k, outs_r[:2] + grads_r, strict=True):
        floor = 2 * _rel(dtype) * float(want.abs().max())
        _assert_within(got, want, 2 * _rel(dtype), floor, what=shape)


@pytest.mark.gpu
def test_fused_ops_capture_in_a_cuda_graph():
    # The leaves live on the capturing stream from their creation, as the training step's side
    # stream does: autograd runs a leaf's gradient on the stream the leaf was made on, and the
    # legacy default stream may not wait on a capturing stream.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        s = _MLAShape(2, 256, 16, 128, 64, 128)
        inputs, grads = _mla_case(s, torch.bfloat16, device="cuda", seed=1)
        x = _leaf(512, 2048, dtype=torch.bfloat16, seed=2, device="cuda")
        w = torch.ones(2048, device="cuda", requires_grad=True)
        a = _leaf(512, 1408, dtype=torch.bfloat16, seed=3, device="cuda")

    def step():
        outs, g_mla = _run_mla(inputs, grads, "triton")
        y = fn.rms_norm(x, w, kernels="triton")
        h = fn.swiglu(a, a, kernels="triton")
        return [*outs[:2], *g_mla, y, *torch.autograd.grad((y.sum() + h.sum()), (x, w, a))]

    with torch.cuda.stream(stream):
        eager = step()  # also the warm-up outside the capture (Triton compiles here)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(captured, eager, strict=True)):
        assert_bitwise_equal(got, want, name=f"graph output {i}")
