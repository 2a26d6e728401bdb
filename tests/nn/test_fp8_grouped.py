"""fp8_grouped_linear: the MoE experts' grouped FP8 linear with autograd (DeepSeek-V3 §3.3)."""

import dataclasses
import math
import sys

import pytest
import torch
import torch.nn.functional as F

from ptxtrain.nn import Fp8Linear, Fp8LinearConfig
from ptxtrain.nn.fp8_grouped import fp8_grouped_linear
from ptxtrain.nn.functional import swiglu
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


@pytest.fixture
def ref_gemms(monkeypatch):
    """Run every GEMM (grouped and dense) on the pure-PyTorch reference. Without it, CPU tests
    run the grouped GEMMs' Triton kernels under Triton's interpreter (tests/conftest.py sets
    TRITON_INTERPRET=1), which is slow; they get their own test below."""
    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "ref")


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


def _experts_by_calls(ex, x, counts, dy):
    """The three public fp8_grouped_linear calls on copies of ex's weights: (y, dx, dw1/3/2)."""
    x = x.detach().clone().requires_grad_()
    ws = [getattr(ex, n).detach().clone().requires_grad_() for n in ("w1", "w3", "w2")]
    cfg = ex.fp8_config
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


@pytest.mark.parametrize("recipe", ["deepseek", "deepseek_pow2", "deepseek_wgrad_bf16"])
@pytest.mark.parametrize("dtype,inter", [(torch.float32, 128), (torch.bfloat16, 100)], ids=str)
def test_experts_fp8_path_equals_public_calls_bitwise(recipe, dtype, inter, ref_gemms):
    # The shared layout, the shared x quantization, the cached weight blocks (stacked path at
    # I = 128, per-expert path at I = 100) and the strided Wᵀ views change no bit.
    ex = _experts(4, 256, inter, dtype, 31)
    ex.fp8_config = recipe
    counts = [130, 0, 1, 125]
    g = torch.Generator().manual_seed(32)
    x = torch.randn(256, 256, generator=g).to(dtype)
    dy = torch.randn(256, 256, generator=g).to(dtype)
    want = _experts_by_calls(ex, x, counts, dy)
    for _ in range(2):  # the second run reads the cached weight quantization
        got = _experts_run(ex, x, counts, dy)
        for name, a, b in zip(("y", "dx", "dw1", "dw3", "dw2"), got, want):
            assert_bitwise_equal(a, b, name)


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
    assert len(w_calls) == 3, "each of w1, w3, w2 quantized once for the three micro-batches"
    # Per forward: x once (shared by w1 and w3) and h once; per backward: dy of each projection.
    assert len(x_calls) == 3 * (2 + 3)

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
    # The optimizer's in-place update must invalidate the cache (3 new quantizations).
    assert same_as_uncached(xs[0], 3)
    assert not torch.equal(ex(xs[0], counts), y0)
    assert same_as_uncached(xs[0], 0)  # and the new quantization is kept again
    # load_state_dict copies in place: invalidated too.
    fresh = _experts(4, 256, 128, torch.bfloat16, 35)
    ex.load_state_dict(fresh.state_dict())
    assert same_as_uncached(xs[1], 3)
    # New storage (assigning .data, or keep_experts_ for expert parallelism): invalidated.
    with torch.no_grad():
        ex.w2.data = torch.randn_like(ex.w2) / 16
    assert same_as_uncached(xs[2], 1)
    ex.keep_experts_(1, 2)
    uncached.keep_experts_(1, 2)
    x = xs[2][: int(counts[1:3].sum())]
    with torch.no_grad():
        for n_, p in uncached.named_parameters():
            p.copy_(getattr(ex, n_))
    n = len(w_calls)
    y = ex(x, counts[1:3])
    assert len(w_calls) == n + 3
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
