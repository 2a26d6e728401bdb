"""fp8_grouped_linear: the MoE experts' grouped FP8 linear with autograd (DeepSeek-V3 §3.3)."""

import dataclasses
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from ptxtrain.nn import Fp8Linear, Fp8LinearConfig
from ptxtrain.nn.fp8_grouped import fp8_grouped_linear
from ptxtrain.nn.fp8_linear import resolve_config
from ptxtrain.nn.functional import swiglu, swiglu_stacked
from ptxtrain.testing import assert_bitwise_equal, calc_diff, sqnr_db
from ptxtrain.testing.shapes import DSV3_DENSE_NK

# DeepGEMM's oracle for an FP8 GEMM against a high-precision matmul of the unquantized inputs
# (docs/design.md §2). Each of the three outputs (y, dx, dW) is one FP8 x FP8 GEMM of two 1x128 /
# 128x128 quantized operands, so all three see the same error statistic: measured 5.5e-4 to 6.8e-4
# over the cases below (Gaussian data), fp32 or bf16 alike. The same bar therefore holds for the
# gradients; a wrong scale or a row sent to the wrong expert gives calc_diff ~ 1e-1 or more.
CALC_DIFF_MAX = 1e-3
# torchao's bar as used for the dense Fp8Linear (tests/nn/test_fp8_linear.py): 28.6-29.6 dB
# measured for every output; 26 dB leaves 2-3 dB of seed-to-seed room.
SQNR_MIN_DB = 26.0

# (tokens_per_expert, K, N_out): awkward group sizes (0, 1, 127, 129 tokens), G = 1 and several,
# K and N_out with tails (not multiples of 128, incl. smaller than a block), aligned N_out (the
# stacked one-call weight quantization) and unaligned N_out (per-expert quantization).
CASES = [
    ([0, 1, 127, 129], 200, 130),
    ([300], 256, 384),
    ([129, 0, 0, 64, 200, 1], 384, 256),
    ([5, 40, 0], 13, 100),
    ([128, 256], 257, 128),
]
DTYPES = (torch.float32, torch.bfloat16)


def _triton_interpreted():
    """Whether the grouped GEMMs' Triton kernels run on CPU tensors here (TRITON_INTERPRET=1)."""
    try:
        from ptxtrain.gemm import grouped
    except ImportError:
        return False
    return grouped.is_interpreted()


def _inputs(counts, k, n_out, dtype, seed):
    """Fresh Gaussian x [N, K], weight [G, N_out, K] (std 1/√K) and dy [N, N_out]."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, k, generator=g).to(dtype)
    w = (torch.randn(len(counts), n_out, k, generator=g) / math.sqrt(max(k, 1))).to(dtype)
    dy = torch.randn(n, n_out, generator=g).to(dtype)
    return x, w, dy


def _grouped(x, w, counts, dy, **kwargs):
    """fp8_grouped_linear forward + backward; returns (y, dx, dW) detached."""
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    y = fp8_grouped_linear(x, w, counts, **kwargs)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


def _per_expert_fp32(x, w, counts, dy):
    """The unquantized computation in fp32: y, dx, dW of each expert's slice."""
    x, w, dy = x.float(), w.float(), dy.float()
    ys, dxs, dws, start = [], [], [], 0
    for e, c in enumerate(counts):
        xe, dye = x[start : start + c], dy[start : start + c]
        ys.append(xe @ w[e].t())
        dxs.append(dye @ w[e])
        dws.append(dye.t() @ xe)
        start += c
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def _per_expert_dense(x, w, counts, dy, config):
    """Each expert through the dense Fp8Linear (same recipe); returns (y, dx, dW)."""
    ys, dxs, dws, start = [], [], [], 0
    n_out, k = w.shape[1:]
    for e, c in enumerate(counts):
        lin = Fp8Linear(k, n_out, bias=False, device=x.device, dtype=w.dtype, config=config)
        with torch.no_grad():
            lin.weight.copy_(w[e])
        xe = x[start : start + c].detach().clone().requires_grad_()
        ye = lin(xe)
        ye.backward(dy[start : start + c])
        ys.append(ye.detach())
        dxs.append(xe.grad)
        dws.append(lin.weight.grad)
        start += c
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws)


def _check_accuracy(got, want, what):
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        assert a.shape == b.shape, f"{what} {name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        diff = calc_diff(a, b)
        assert diff < CALC_DIFF_MAX, f"{what} {name}: {diff=:.2e}"
        if b.numel():
            snr = sqnr_db(b, a.float())
            assert snr >= SQNR_MIN_DB, f"{what} {name}: sqnr {snr:.1f} dB"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-k{c[1]}-n{c[2]}")
def test_matches_unquantized_computation(case, dtype, ref_gemms):
    counts, k, n_out = case
    x, w, dy = _inputs(counts, k, n_out, dtype, seed=sum(counts) + k)
    y, dx, dw = _grouped(x, w, counts, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (dtype, dtype, dtype)
    _check_accuracy((y, dx, dw), _per_expert_fp32(x, w, counts, dy), f"{counts=} {k=} {n_out=}")
    for e, c in enumerate(counts):
        if c == 0:  # an expert without tokens gets a zero gradient, not None or garbage
            assert torch.count_nonzero(dw[e]) == 0, f"expert {e} (0 tokens) has nonzero dW"


@pytest.mark.parametrize(
    ("recipe", "dtype"),
    [
        ("deepseek", torch.float32),
        ("deepseek", torch.bfloat16),
        ("deepseek_pow2", torch.bfloat16),
        ("deepseek_wgrad_bf16", torch.bfloat16),
        ("bf16", torch.float32),
    ],
    ids=str,
)
def test_equals_per_expert_dense_fp8_linear_bitwise(recipe, dtype, ref_gemms):
    # On the reference path (both sides) the grouped GEMMs dequantize and multiply exactly as the
    # dense ones, the padded layout leaves every real row's (and every 128x1 token tile's)
    # quantization unchanged, and padding tokens add exact zeros: y and dx are identical, dW up
    # to the summation order of a longer (zero-padded) sum. (The Triton kernels are not bitwise
    # equal to the reference; see below.)
    counts = [0, 1, 127, 129, 128]
    x, w, dy = _inputs(counts, 200, 130, dtype, seed=7)
    got = _grouped(x, w, counts, dy, config=recipe)
    want = _per_expert_dense(x, w, counts, dy, recipe)
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        if name == "dW":
            # The grouped wgrad sums each expert's tokens padded with zero rows to a multiple
            # of 128, the dense one its count: the same products, but BLAS may block the longer
            # sum differently (it does on an AMD EPYC: 1-ulp fp32 differences), so dW is equal
            # up to fp32 summation order (about 2^-24 relative per add over <= 256 tokens).
            scale = b.abs().max().item()
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * scale, msg=f"{recipe} dW")
        else:
            assert_bitwise_equal(a, b, f"{recipe} {dtype} {name}")


# Grouped Triton vs reference GEMMs: identical FP8 operands, fp32 accumulation promoted every
# 128 of K on both sides, only the summation order differs; fp32 results differ in the last bits
# and a rare bf16 output flips one ulp, i.e. calc_diff ~ 1e-9 to 1e-8. 1e-6 allows that while
# staying ~700x below the FP8 error itself (~7e-4): a wrong scale, padding row or expert fails.
KERNEL_MATCH_MAX = 1e-6


@pytest.mark.skipif(not _triton_interpreted(), reason="Triton's CPU interpreter is off")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreted_triton_kernels_match_reference(dtype, monkeypatch):
    # Default dispatch on the CPU in this suite: the grouped GEMMs' Triton kernels, interpreted.
    counts, k, n_out = [129, 0, 1, 60], 136, 130
    x, w, dy = _inputs(counts, k, n_out, dtype, seed=21)
    kernels = _grouped(x, w, counts, dy)
    _check_accuracy(kernels, _per_expert_fp32(x, w, counts, dy), "interpreted")
    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "ref")
    reference = _grouped(x, w, counts, dy)
    for name, a, b in zip(("y", "dx", "dW"), kernels, reference):
        diff = calc_diff(a, b)
        assert diff < KERNEL_MATCH_MAX, f"interpreted vs ref {name}: {diff=:.2e}"
    assert torch.count_nonzero(kernels[2][1]) == 0  # expert 1 has no tokens


def test_mixed_dtypes_and_count_forms(ref_gemms):
    # bf16 activations with an fp32 weight (master-weight style): dW comes back in fp32; counts
    # given as an int64 tensor, an int32 tensor or a list are the same call.
    counts = [3, 0, 130]
    x, w, dy = _inputs(counts, 136, 96, torch.bfloat16, seed=3)
    w = w.float()
    results = [
        _grouped(x, w, tpe, dy)
        for tpe in (counts, torch.tensor(counts), torch.tensor(counts, dtype=torch.int32))
    ]
    assert results[0][2].dtype == torch.float32 and results[0][0].dtype == torch.bfloat16
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise_equal(a, b, "count form")
    _check_accuracy(results[0], _per_expert_fp32(x, w, counts, dy), "mixed dtypes")


def test_without_triton_falls_back_to_references(monkeypatch, ref_gemms):
    # Where Triton is not installed the function calls the grouped references directly; hide
    # ptxtrain.gemm.grouped (its import then raises ImportError) and expect the very same bits.
    import ptxtrain.gemm

    counts = [1, 0, 130]
    x, w, dy = _inputs(counts, 136, 130, torch.bfloat16, seed=4)
    want = _grouped(x, w, counts, dy)
    monkeypatch.delattr(ptxtrain.gemm, "grouped", raising=False)
    monkeypatch.setitem(sys.modules, "ptxtrain.gemm.grouped", None)
    got = _grouped(x, w, counts, dy)
    for name, a, b in zip(("y", "dx", "dW"), got, want):
        assert_bitwise_equal(a, b, f"no-Triton {name}")


@pytest.mark.parametrize(
    "counts",
    [
        [3, 0, 130, 128, 1],  # padding inside, an empty expert, one already aligned
        [128, 256, 0],  # every count aligned: the identity layout
        [0, 0],  # no tokens
        [],  # no experts
    ],
)
def test_layout_equals_reference(counts):
    """The device-built padded layout equals ptxtrain.moe.ref.grouped_layout_ref (exactly: int
    index vectors), on fresh random counts too."""
    from ptxtrain.moe.ref import grouped_layout_ref
    from ptxtrain.nn.fp8_grouped import HostLayout

    g = torch.Generator().manual_seed(len(counts))
    cases = [counts, torch.randint(0, 300, (16,), generator=g).tolist()]
    for c in cases:
        lay = HostLayout(c, 128, torch.device("cpu"))
        rows, m_idx = grouped_layout_ref(torch.tensor(c, dtype=torch.int64), 128)
        assert lay.n == sum(c) and lay.rows == m_idx.numel()
        assert lay.ks == [(v + 127) // 128 * 128 for v in c]
        assert_bitwise_equal(lay.m_indices, m_idx)
        if lay.identity:
            assert lay.padded_rows is None and torch.equal(rows, torch.arange(sum(c)))
        else:
            assert_bitwise_equal(lay.padded_rows, rows)


def test_no_tokens():
    counts = [0, 0, 0]
    x, w, dy = _inputs(counts, 200, 130, torch.bfloat16, seed=1)
    w = w + 1.0  # nonzero weights: a zero gradient must come from the empty slices
    y, dx, dw = _grouped(x, w, counts, dy)
    assert y.shape == (0, 130) and dx.shape == (0, 200)
    assert dw.shape == w.shape and torch.count_nonzero(dw) == 0


def test_no_grad_and_frozen_input(ref_gemms):
    counts = [1, 200]
    x, w, _ = _inputs(counts, 128, 128, torch.float32, seed=5)
    with torch.no_grad():
        y0 = fp8_grouped_linear(x, w.requires_grad_(), counts)
    assert not y0.requires_grad
    y = fp8_grouped_linear(x, w, counts)  # x needs no gradient: only dW is computed
    y.sum().backward()
    assert w.grad is not None and w.grad.shape == w.shape
    assert_bitwise_equal(y.detach(), y0, "y with and without grad")


def test_bf16_recipe_is_per_expert_linear():
    # With every GEMM configured off the function is a plain per-expert nn.Linear.
    counts = [2, 0, 9]
    x, w, dy = _inputs(counts, 40, 24, torch.float32, seed=9)
    y, dx, dw = _grouped(x, w, counts, dy, config="bf16")
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    yr = torch.cat([F.linear(s, wr[e]) for e, s in enumerate(xr.split(counts))])
    yr.backward(dy)
    for name, a, b in (("y", y, yr.detach()), ("dx", dx, xr.grad), ("dW", dw, wr.grad)):
        assert_bitwise_equal(a, b, name)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
        (dict(x=torch.ones(4, 8, dtype=torch.int32)), TypeError, "x must have dtype"),
        (dict(x=torch.ones(1, 4, 8)), ValueError, "x must be 2-D"),
        (dict(weight=torch.ones(3, 8)), ValueError, "weight must be 3-D"),
        (dict(weight=torch.ones(3, 6, 8, dtype=torch.float8_e4m3fn)), TypeError, "weight must"),
        (dict(weight=torch.ones(3, 6, 9)), ValueError, "must share K"),
        (dict(weight=torch.ones(0, 6, 8), tpe=[]), ValueError, "at least one expert"),
        (dict(weight=torch.ones(3, 6, 8, device="meta")), ValueError, "one device"),
        (dict(tpe=[1, 3]), ValueError, "one count per expert"),
        (dict(tpe=[5, -1, 0]), ValueError, "non-negative"),
        (dict(tpe=[1, 1, 1]), ValueError, "sum to N = 4"),
        (dict(tpe=torch.tensor([1.0, 3.0, 0.0])), TypeError, "tokens_per_expert must have dtype"),
        (dict(tpe=torch.tensor([[1, 3, 0]])), ValueError, "tokens_per_expert must be 1-D"),
        (dict(tpe=torch.tensor([1, 3, 0], device="meta")), ValueError, "CPU or on x's device"),
        (dict(tpe=[1, 3.0, 0]), TypeError, "must hold ints"),
        (dict(tpe=4), TypeError, "tokens_per_expert must be"),
        (dict(align=64), ValueError, "multiple of 128"),
        (dict(align=0), ValueError, "align must be a positive"),
        (dict(align="128"), TypeError, "align must be an int"),
        (dict(config=3), TypeError, "config must be"),
        (dict(config="fp4"), ValueError, "recipe name"),
    ],
)
def test_bad_inputs(kwargs, error, match):
    args = dict(x=torch.randn(4, 8), weight=torch.randn(3, 6, 8), tpe=[1, 3, 0])
    args.update(kwargs)
    extra = {k: v for k, v in args.items() if k not in ("x", "weight", "tpe")}
    with pytest.raises(error, match=match):
        fp8_grouped_linear(args["x"], args["weight"], args["tpe"], **extra)


# ----------------------------------------------------------------------------------------------
# GPU (Triton grouped GEMMs): DeepSeek-V3 expert shapes, 8 experts, a few thousand tokens.
# ----------------------------------------------------------------------------------------------

# The MoE expert projections of DeepSeek-V3: gate+up (N_out 4096 = 2 x 2048, K 7168) and down
# (N_out 7168, K 2048), taken from the shared shape list.
DSV3_EXPERT_NK = [nk for nk in DSV3_DENSE_NK if nk in ((4096, 7168), (7168, 2048))]
# 8 experts, 3 000 tokens, awkward slices (0, 1, 127, 129) among them.
GPU_COUNTS = [0, 1, 127, 129, 640, 1024, 311, 768]
# The grouped kernels and the dense Triton / cuBLAS ones read identical FP8 operands and differ
# only in summation order: the bound of KERNEL_MATCH_MAX applies.


@pytest.mark.gpu
@pytest.mark.parametrize("nk", DSV3_EXPERT_NK, ids=lambda nk: f"n{nk[0]}-k{nk[1]}")
def test_gpu_dsv3_expert_shapes(nk):
    n_out, k = nk
    x, w, dy = _inputs(GPU_COUNTS, k, n_out, torch.bfloat16, seed=n_out + k)
    x, w, dy = x.cuda(), w.cuda(), dy.cuda()
    for tpe in (GPU_COUNTS, torch.tensor(GPU_COUNTS, device="cuda")):
        got = _grouped(x, w, tpe, dy)
        _check_accuracy(got, _per_expert_fp32(x, w, GPU_COUNTS, dy), f"cuda {n_out=} {k=}")
    dense = _per_expert_dense(x, w, GPU_COUNTS, dy, "deepseek")
    for name, a, b in zip(("y", "dx", "dW"), got, dense):
        diff = calc_diff(a, b)
        assert diff < KERNEL_MATCH_MAX, f"cuda {n_out=} {k=} {name} vs dense: {diff=:.2e}"
    assert torch.count_nonzero(got[2][0]) == 0  # expert 0 has no tokens


@pytest.mark.gpu
def test_gpu_matches_cpu_reference():
    # The Triton grouped GEMMs against the CPU reference path on the same inputs: both compute
    # the same FP8 products with fp32 accumulation (promotion every 128 of K), differing only in
    # summation order, so the bound is the one of the dense comparison above.
    counts = [0, 1, 127, 129, 300]
    x, w, dy = _inputs(counts, 7168 // 16 + 5, 4096 // 16 + 3, torch.bfloat16, seed=11)
    cpu = _grouped(x, w, counts, dy)
    gpu = _grouped(x.cuda(), w.cuda(), counts, dy.cuda())
    for name, a, b in zip(("y", "dx", "dW"), gpu, cpu):
        diff = calc_diff(a.cpu(), b)
        assert diff < KERNEL_MATCH_MAX, f"cuda vs cpu {name}: {diff=:.2e}"


# ---------------------------------------------------------------------------------------------
# Experts' FP8 path: one layout per layer, x quantized once for w1/w3, cached weight quantization


def _experts(e, d, i, dtype, seed):
    from ptxtrain.moe.experts import Experts

    torch.manual_seed(seed)
    ex = Experts(e, d, i).to(dtype)
    ex.fp8 = True
    return ex


def _experts_reference(ex, x, counts, dy):
    """The experts' FP8 path as public calls on copies of ex's weights: (y, dx, dw1/3/2).

    I a multiple of 128: ``fp8_grouped_linear(x, cat([w1, w3], 1))`` -> ``swiglu_stacked``
    (input kept in FP8 as the config says) -> ``fp8_grouped_linear(h, w2)`` (the cat's gradient
    split back to w1 / w3 by autograd); otherwise the three calls ``w1``, ``w3``, ``w2``.
    """
    x = x.detach().clone().requires_grad_()
    ws = [getattr(ex, n).detach().clone().requires_grad_() for n in ("w1", "w3", "w2")]
    cfg, inter = ex.fp8_config, ws[0].shape[1]
    if inter % 128 == 0:
        h13 = fp8_grouped_linear(x, torch.cat(ws[:2], dim=1), counts, config=cfg)
        rc = resolve_config(cfg)
        fp8_saved = rc.save_swiglu_input_fp8 and rc.any_fp8
        h = swiglu_stacked(h13, save_input_fp8=fp8_saved, pow2_scale=rc.pow2_scale)
    else:
        h = fp8_grouped_linear(x, ws[0], counts, config=cfg)
        h = swiglu(h, fp8_grouped_linear(x, ws[1], counts, config=cfg))  # the experts' gate
    y = fp8_grouped_linear(h, ws[2], counts, config=cfg)
    y.backward(dy)
    return [y.detach(), x.grad] + [w.grad for w in ws]


def _experts_run(ex, x, counts, dy):
    for p in ex.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    y = ex(x, torch.tensor(counts))
    y.backward(dy)
    return [y.detach(), x.grad, ex.w1.grad, ex.w3.grad, ex.w2.grad]


EXPERT_OUTPUTS = ("y", "dx", "dw1", "dw3", "dw2")


@pytest.mark.parametrize("recipe", ["deepseek", "deepseek_pow2", "deepseek_wgrad_bf16"])
@pytest.mark.parametrize(
    "dtype,inter", [(torch.float32, 128), (torch.bfloat16, 256), (torch.bfloat16, 100)], ids=str
)
def test_experts_fp8_path_equals_its_public_composition_bitwise(recipe, dtype, inter, ref_gemms):
    # I = 128 / 256: the stacked gate/up GEMM, its one Dgrad (K = 2I) and two Wgrads on the row
    # halves of d[h1 | h3]'s quantization, against one fp8_grouped_linear on cat([w1, w3]):
    # the same FP8 operands and the same fp32 sums (each dW row of the k-grouped reference is
    # its own dot products, so two GEMMs of I rows give the rows of one of 2I). I = 100: the
    # three separate calls (shared layout, shared x quantization, cached per-expert weight
    # blocks, strided Wᵀ views). Either way no bit changes, also from the cached weights.
    ex = _experts(4, 256, inter, dtype, 31)
    ex.fp8_config = recipe
    counts = [130, 0, 1, 125]
    g = torch.Generator().manual_seed(32)
    x = torch.randn(256, 256, generator=g).to(dtype)
    dy = torch.randn(256, 256, generator=g).to(dtype)
    want = _experts_reference(ex, x, counts, dy)
    for _ in range(2):  # the second run reads the cached weight quantization
        got = _experts_run(ex, x, counts, dy)
        for name, a, b in zip(EXPERT_OUTPUTS, got, want, strict=True):
            assert_bitwise_equal(a, b, name)


# The experts' outputs against the unquantized FP32 computation: each goes through two chained
# FP8 GEMM stages (x -> h13 -> h -> y forward; dy -> dh -> d13 -> dx backward; the weight
# gradients pair a gradient of one stage with an activation of the other), with bf16 roundings
# of h13 / h and SwiGLU's product of two quantized terms between them. One FP8 GEMM gives
# calc_diff 5.5e-4 to 6.8e-4 (CALC_DIFF_MAX above); the chains measured 1.9e-3 to 2.0e-3 at the
# medium shapes on Gaussian data (y, dx, dw1, dw3, dw2 alike). 4e-3 leaves 2x; a wrong half of
# d[h1 | h3] sent to a weight, a transposed part or a wrong expert slice gives 0.3 or more.
EXPERTS_CALC_DIFF_MAX = 4e-3


def _experts_fp32(ex, x, counts, dy):
    """The experts' reference path (per-expert F.linear) in FP32 on ex's weights."""
    from ptxtrain.moe.experts import Experts

    with torch.device(ex.w1.device):
        ref = Experts(ex.num_local_experts, ex.dim, ex.inter_dim)
    ref.load_state_dict({k: v.float() for k, v in ex.state_dict().items()})
    return _experts_run(ref, x.float(), counts, dy.float())


def test_experts_medium_shapes_stacked_gate_up(ref_gemms):
    # The medium preset's expert shapes (I = 1408 = 11 x 128, D = 2048); 4 experts of uneven
    # counts (0 rows, 1 row, 129, 300: padding inside, an empty expert) keep the CPU time low.
    ex = _experts(4, 2048, 1408, torch.bfloat16, 41)
    counts = [129, 0, 1, 300]
    g = torch.Generator().manual_seed(42)
    x = torch.randn(sum(counts), 2048, generator=g).bfloat16()
    dy = torch.randn(sum(counts), 2048, generator=g).bfloat16()
    got = _experts_run(ex, x, counts, dy)
    for name, a, b in zip(EXPERT_OUTPUTS, got, _experts_reference(ex, x, counts, dy), strict=True):
        assert_bitwise_equal(a, b, f"medium {name}")
    for name, a, b in zip(EXPERT_OUTPUTS, got, _experts_fp32(ex, x, counts, dy), strict=True):
        diff = calc_diff(a.float(), b)
        assert diff < EXPERTS_CALC_DIFF_MAX, f"medium {name}: {diff=:.2e}"
    # Expert 1 has no rows: zero (not missing) gradients for both halves of the stack.
    assert all(torch.count_nonzero(w[1]) == 0 for w in got[2:])


@pytest.mark.skipif(not _triton_interpreted(), reason="Triton's CPU interpreter is off")
def test_experts_stacked_interpreted_triton_equals_composition():
    # The grouped GEMMs' Triton kernels (interpreted): the stacked path against the public
    # composition on the same kernels. The Wgrad tiles of two I-row GEMMs are those of one
    # 2I-row GEMM (the tile config follows N and K here, not the rows), so no bit moves.
    ex = _experts(3, 128, 128, torch.bfloat16, 43)
    counts = [129, 0, 60]
    g = torch.Generator().manual_seed(44)
    x = torch.randn(189, 128, generator=g).bfloat16()
    dy = torch.randn(189, 128, generator=g).bfloat16()
    got = _experts_run(ex, x, counts, dy)
    for name, a, b in zip(EXPERT_OUTPUTS, got, _experts_reference(ex, x, counts, dy), strict=True):
        assert_bitwise_equal(a, b, f"interpreted {name}")


def _stacked_call(x, parts, counts, dy, config, frozen=()):
    """fp8_grouped_apply with the weight parts stacked along N: (y, dx, d part_i ...)."""
    from ptxtrain.nn.fp8_grouped import HostLayout, fp8_grouped_apply

    x = x.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_(i not in frozen) for i, w in enumerate(parts)]
    layout = HostLayout(counts, 128, x.device)
    y = fp8_grouped_apply(x, tuple(ws), layout, counts, config)
    y.backward(dy)
    return [y.detach(), x.grad] + [w.grad for w in ws]


def _cat_call(x, parts, counts, dy, config):
    """fp8_grouped_linear on torch.cat(parts, 1), the cat's gradient split back by autograd."""
    x = x.detach().clone().requires_grad_()
    ws = [w.detach().clone().requires_grad_() for w in parts]
    y = fp8_grouped_linear(x, torch.cat(ws, dim=1), counts, config=config)
    y.backward(dy)
    return [y.detach(), x.grad] + [w.grad for w in ws]


_NO_FP8_DGRAD = dataclasses.replace(Fp8LinearConfig.from_recipe_name("deepseek"), dgrad=False)


@pytest.mark.parametrize(
    "config", ["deepseek", "deepseek_pow2", "deepseek_wgrad_bf16", _NO_FP8_DGRAD, "bf16"],
    ids=["deepseek", "pow2", "wgrad_bf16", "dgrad_off", "bf16"],
)  # fmt: skip
@pytest.mark.parametrize(
    "sizes", [(128, 128), (256, 128, 384), (100, 130), (1, 64)], ids=lambda s: "-".join(map(str, s))
)
def test_stacked_parts_equal_concatenated_weight_bitwise(sizes, config, ref_gemms):
    # The generalized Function: parts stacked along N (any N_i: blocks that straddle two parts
    # are those of the concatenated weight) give the bits of one call on torch.cat(parts, 1),
    # every GEMM in FP8 or in high precision as the config says.
    counts, k = [3, 0, 130, 128], 200
    g = torch.Generator().manual_seed(sum(sizes))
    x = torch.randn(sum(counts), k, generator=g).bfloat16()
    parts = [(torch.randn(4, n, k, generator=g) / math.sqrt(k)).bfloat16() for n in sizes]
    dy = torch.randn(sum(counts), sum(sizes), generator=g).bfloat16()
    got = _stacked_call(x, parts, counts, dy, resolve_config(config))
    want = _cat_call(x, parts, counts, dy, config)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert_bitwise_equal(a, b, f"output {i}")


def test_stacked_parts_frozen_part_and_fp32_part(ref_gemms):
    # A frozen part gets no gradient (its rows of dy are still in the Dgrad sum); parts of
    # different dtypes keep theirs (the stack is the promoted one, as torch.cat's).
    counts, k = [200, 1], 128
    g = torch.Generator().manual_seed(5)
    x = torch.randn(201, k, generator=g).bfloat16()
    parts = [torch.randn(2, 128, k, generator=g).bfloat16(), torch.randn(2, 256, k, generator=g)]
    dy = torch.randn(201, 384, generator=g).bfloat16()
    cfg = resolve_config("deepseek")
    got = _stacked_call(x, parts, counts, dy, cfg, frozen=(0,))
    want = _cat_call(x, parts, counts, dy, cfg)
    assert got[2] is None and got[3].dtype == torch.float32
    for i in (0, 1, 3):
        assert_bitwise_equal(got[i], want[i], f"output {i}")


@pytest.mark.parametrize("g_,inter,d", [(2, 1408, 2048), (3, 256, 384)])
def test_stacked_weight_quantization_is_each_parts_own(g_, inter, d):
    # I a multiple of 128: every 128x128 block of [W1[e]; W3[e]] lies in W1[e] or in W3[e], so
    # the stacked quantization (what the experts cache) holds W1's and W3's own bytes and
    # scales, and its Wᵀ [G, D, 2I] is [W1ᵀ | W3ᵀ].
    from ptxtrain.nn.fp8_grouped import quantize_grouped_weight, stack_weights

    gen = torch.Generator().manual_seed(inter + d)
    w1, w3 = (torch.randn(g_, inter, d, generator=gen).bfloat16() for _ in range(2))
    stacked = quantize_grouped_weight(stack_weights((w1, w3)), True, True, pow2=False)
    assert stacked[2].shape == (g_, d, 2 * inter) and stacked[2].is_contiguous()
    nb = inter // 128
    for half, w in enumerate((w1, w3)):
        own = quantize_grouped_weight(w, True, True, pow2=False)
        rows, blocks = slice(half * inter, (half + 1) * inter), slice(half * nb, (half + 1) * nb)
        assert_bitwise_equal(stacked[0][:, rows], own[0], "w_fp8")
        assert_bitwise_equal(stacked[1][:, blocks], own[1], "sf")
        assert_bitwise_equal(stacked[2][:, :, rows], own[2], "wt_fp8")
        assert_bitwise_equal(stacked[3][:, :, blocks], own[3], "sf_t")


def test_experts_awkward_inter_dim_keeps_separate_calls(monkeypatch, ref_gemms):
    # I = 100: stacked 128x128 blocks would straddle W1 and W3, so the experts quantize w1 and
    # w3 on their own (two weight quantizations of [E, 100, D], none of a [E, 200, D] stack)
    # and run them as two GEMMs; its bits are those of the three calls (test above).
    import ptxtrain.nn.fp8_grouped as fg

    shapes = []
    real = fg.quantize_grouped_weight
    monkeypatch.setattr(
        fg, "quantize_grouped_weight", lambda w, *a: shapes.append(tuple(w.shape)) or real(w, *a)
    )
    ex = _experts(3, 256, 100, torch.bfloat16, 45)
    ex(torch.randn(140, 256).bfloat16().requires_grad_(), torch.tensor([40, 0, 100])).sum()
    assert sorted(shapes) == [(3, 100, 256), (3, 100, 256), (3, 256, 100)]
    shapes.clear()
    ex = _experts(3, 256, 128, torch.bfloat16, 46)
    ex(torch.randn(140, 256).bfloat16().requires_grad_(), torch.tensor([40, 0, 100])).sum()
    assert sorted(shapes) == [(3, 256, 128), (3, 256, 256)]  # the [W1; W3] stack, w2


def _count_calls(monkeypatch, name):
    import ptxtrain.quant

    calls = []
    real = getattr(ptxtrain.quant, name)
    monkeypatch.setattr(ptxtrain.quant, name, lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_experts_quantize_x_once_and_weights_once_per_change(monkeypatch, ref_gemms):
    from ptxtrain.optim import AdamW

    w_calls = _count_calls(monkeypatch, "per_block_cast_to_fp8_both")
    x_calls = _count_calls(monkeypatch, "per_token_cast_to_fp8_both")
    ex = _experts(4, 256, 128, torch.bfloat16, 33)
    uncached = _experts(4, 256, 128, torch.bfloat16, 33)
    uncached.fp8_config = dataclasses.replace(
        Fp8LinearConfig.from_recipe_name("deepseek"), cache_weight_fp8=False
    )
    counts = torch.tensor([100, 28, 0, 128])
    g = torch.Generator().manual_seed(34)
    xs = [torch.randn(256, 256, generator=g).bfloat16() for _ in range(3)]
    for x in xs:  # three micro-batches of one step
        ex(x.requires_grad_(), counts).float().square().mean().backward()
    assert len(w_calls) == 2, "the [w1; w3] stack and w2 quantized once for the micro-batches"
    # Per forward: x once (the stacked GEMM) and h once; per backward: dy of w2 and d[h1 | h3].
    assert len(x_calls) == 3 * (2 + 2)

    def same_as_uncached(x, new_quantizations):
        # ex's own weight quantizations in this forward, then its output vs quantizing afresh.
        n = len(w_calls)
        y = ex(x, counts)
        assert len(w_calls) == n + new_quantizations
        with torch.no_grad():
            for name, p in uncached.named_parameters():
                p.copy_(getattr(ex, name))
        return torch.equal(y, uncached(x, counts))

    y0 = ex(xs[0], counts)
    opt = AdamW(ex.parameters(), lr=1e-2)
    opt.step()  # in-place update: the version counters move
    # The optimizer's in-place update must invalidate the cache (2 new quantizations).
    assert same_as_uncached(xs[0], 2)
    assert not torch.equal(ex(xs[0], counts), y0)
    assert same_as_uncached(xs[0], 0)  # and the new quantization is kept again
    # A change of w3 alone requantizes the stack (its key holds both versions), not w2.
    with torch.no_grad():
        ex.w3.mul_(0.5)
    assert same_as_uncached(xs[0], 1)
    # load_state_dict copies in place: invalidated too.
    fresh = _experts(4, 256, 128, torch.bfloat16, 35)
    ex.load_state_dict(fresh.state_dict())
    assert same_as_uncached(xs[1], 2)
    # New storage (assigning .data, or keep_experts_ for expert parallelism): invalidated.
    with torch.no_grad():
        ex.w2.data = torch.randn_like(ex.w2) / 16
    assert same_as_uncached(xs[2], 1)
    with torch.no_grad():
        ex.w1.data = torch.randn_like(ex.w1) / 16
    assert same_as_uncached(xs[2], 1)
    ex.keep_experts_(1, 2)
    uncached.keep_experts_(1, 2)
    x = xs[2][: int(counts[1:3].sum())]
    with torch.no_grad():
        for n_, p in uncached.named_parameters():
            p.copy_(getattr(ex, n_))
    n = len(w_calls)
    y = ex(x, counts[1:3])
    assert len(w_calls) == n + 2
    assert torch.equal(y, uncached(x, counts[1:3]))


@pytest.mark.parametrize("n_out,k", [(256, 384), (128, 200), (384, 136)])
def test_grouped_weight_transpose_equals_each_experts_own(n_out, k):
    # The stacked quantization of [G, N_out, K] (one pass, Wᵀ regrouped to [G, K, N_out] by
    # 8-byte words) gives each expert exactly the bytes and scales of quantizing that expert
    # alone: the same tiles, so the same amax and scale.
    from ptxtrain.nn.fp8_grouped import quantize_grouped_weight
    from ptxtrain.quant import per_block_cast_to_fp8_both

    g = torch.Generator().manual_seed(n_out + k)
    weight = torch.randn(3, n_out, k, generator=g, dtype=torch.float32).to(torch.bfloat16)
    w, sf, wt, sf_t = quantize_grouped_weight(weight, need_w=True, need_wt=True, pow2=False)
    assert wt.shape == (3, k, n_out) and wt.is_contiguous() and sf_t.is_contiguous()
    for e in range(3):
        want = per_block_cast_to_fp8_both(weight[e])
        for got, ref in zip((w[e], sf[e], wt[e], sf_t[e]), want, strict=True):
            assert_bitwise_equal(got, ref)


def _check_experts_with_no_rows(inter, device):
    ex = _experts(4, 256, inter, torch.bfloat16, 53).to(device)
    x = torch.empty(0, 256, dtype=torch.bfloat16, device=device)
    y, dx, *dws = _experts_run(ex, x, [0, 0, 0, 0], torch.empty_like(x))
    assert y.shape == (0, 256) and dx.shape == (0, 256)
    for name, dw in zip(EXPERT_OUTPUTS[2:], dws, strict=True):
        assert dw is not None and torch.count_nonzero(dw) == 0, name


@pytest.mark.parametrize("inter", [128, 100])
def test_experts_with_no_rows_at_all(inter, ref_gemms):
    # An expert-parallel rank whose experts received no tokens (the routing at init can send
    # every token to the other rank's experts) runs its experts on 0 rows: y and dx are [0, D]
    # and every weight gets a zero gradient (stacked gate/up at I = 128, three GEMMs at 100).
    _check_experts_with_no_rows(inter, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("inter", [1408, 100])
def test_gpu_experts_with_no_rows_at_all(inter):
    # As above through the GPU kernels, at the medium experts' I = 1408.
    _check_experts_with_no_rows(inter, "cuda")


@pytest.mark.gpu
def test_gpu_experts_medium_shapes_stacked_gate_up(monkeypatch):
    # The medium preset's routed experts (64 experts, D = 2048, I = 1408) on one micro-batch's
    # rows (16,384 tokens x 6), uneven counts with empty experts, through the grouped GPU
    # kernels (the PTX ones on an H200: Fprop N = 2816, Dgrad K = 2816, Wgrads on the row
    # halves of d[h1 | h3]), against the same FP8 recipe on the reference GEMMs (same
    # quantizer) and against the unquantized FP32 computation. Kernel and reference read the
    # same FP8 operands and differ in summation order (and a rare bf16 flip of h13 that moves
    # one quantization tile): calc_diff ~1e-7 expected, 1e-3 allowed, while a wrong scale, half
    # of d[h1 | h3] or expert slice gives 1e-2 or more.
    from ptxtrain.model import get_preset

    preset = get_preset("medium")
    e, d, inter = preset.n_routed_experts, preset.dim, preset.moe_inter_dim
    gen = torch.Generator().manual_seed(51)
    counts = torch.randint(0, 2 * 16384 * preset.n_activated_experts // e, (e,), generator=gen)
    counts[[3, 4]] = 0
    counts[[1, 5]] = torch.tensor([1, 129])
    counts = counts.tolist()
    ex = _experts(e, d, inter, torch.bfloat16, 52).cuda()
    x = torch.randn(sum(counts), d, generator=gen).bfloat16().cuda()
    dy = torch.randn(sum(counts), d, generator=gen).bfloat16().cuda()
    got = _experts_run(ex, x, counts, dy)
    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "ref")
    ex.__dict__.pop("_fp8_weight_cache", None)
    want = _experts_run(ex, x, counts, dy)
    fp32 = _experts_fp32(ex, x, counts, dy)
    for name, a, b, c in zip(EXPERT_OUTPUTS, got, want, fp32, strict=True):
        diff = calc_diff(a.float(), b.float())
        assert diff < CALC_DIFF_MAX, f"cuda vs reference GEMMs {name}: {diff=:.2e}"
        diff = calc_diff(a.float(), c)
        assert diff < EXPERTS_CALC_DIFF_MAX, f"cuda vs fp32 {name}: {diff=:.2e}"
    assert all(torch.count_nonzero(w[3]) == 0 for w in got[2:])  # expert 3 has no rows
