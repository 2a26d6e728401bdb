"""Reference FP8 GEMMs: accuracy against unquantized matmuls, scale indexing, layouts, errors."""

import pytest
import torch

from ptxtrain.gemm.ref import fp8_gemm_nt, fp8_gemm_nt_1d1d
from ptxtrain.quant.ref import FP8_DTYPE, per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff
from ptxtrain.testing.shapes import AWKWARD_M, AWKWARD_NK, dense_shapes_cpu
from tests.gemm._bounds import CALC_DIFF_MAX


def _inputs(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


SHAPES = [(m, n, k) for n, k in dense_shapes_cpu() for m in (1, 13, 64)] + [
    (m, n, k) for n, k in AWKWARD_NK for m in AWKWARD_M
]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_nt_accuracy(m, n, k, out_dtype):
    x, w = _inputs(m, n, k, seed=m * 31 + n * 7 + k)
    d = fp8_gemm_nt(per_token_cast_to_fp8(x), per_block_cast_to_fp8(w), out_dtype=out_dtype)
    assert d.shape == (m, n) and d.dtype == out_dtype
    ref = x.double() @ w.double().t()
    diff = calc_diff(d, ref)
    # K < 16 leaves too few products to average the quantization noise: bound it loosely there.
    limit = CALC_DIFF_MAX if k >= 16 else 4e-3
    assert diff < limit, f"{m=}, {n=}, {k=}, {diff=:.2e}"


@pytest.mark.parametrize("m,n,k", SHAPES[::3])
def test_fp8_gemm_nt_1d1d_accuracy_and_accumulate(m, n, k):
    a, b = _inputs(m, n, k, seed=m + n + k)
    qa, qb = per_token_cast_to_fp8(a), per_token_cast_to_fp8(b)
    d = fp8_gemm_nt_1d1d(qa, qb)
    assert d.shape == (m, n) and d.dtype == torch.float32
    diff = calc_diff(d, a.double() @ b.double().t())
    limit = CALC_DIFF_MAX if k >= 16 else 4e-3  # as above
    assert diff < limit, f"{m=}, {n=}, {k=}, {diff=:.2e}"
    c = torch.randn(m, n)
    out = c.clone()
    res = fp8_gemm_nt_1d1d(qa, qb, out=out, accumulate=True)
    assert res is out
    # Accumulation adds the same fp32 product: exact up to one fp32 rounding of the sum.
    torch.testing.assert_close(out, c + d, rtol=1e-6, atol=1e-6)
    # bf16 out is the fp32 result rounded once (same product, so bit for bit).
    d16 = fp8_gemm_nt_1d1d(qa, qb, out_dtype=torch.bfloat16)
    assert d16.dtype == torch.bfloat16
    assert torch.equal(d16, d.to(torch.bfloat16))


def test_block_scaled_sum_matches_dequantized_reference():
    # Independent formulation: D = Σ_kb sf_a[:, kb] sf_b[nb, kb] (A_kb · B_kbᵀ) in float64,
    # the sum a kernel with per-128-K promotion computes. Only fp32 rounding may differ.
    m, n, k = 37, 300, 520
    x, w = _inputs(m, n, k, seed=9)
    (qa, sa), (qb, sb) = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    want = torch.zeros(m, n, dtype=torch.float64)
    for kb in range(sa.shape[1]):
        ks = slice(kb * 128, (kb + 1) * 128)
        part = qa[:, ks].double() @ qb[:, ks].double().t()  # [M, N]
        sfb = sb[:, kb].double().repeat_interleave(128)[:n]  # [N]
        want += part * sa[:, kb].double()[:, None] * sfb[None, :]
    got = fp8_gemm_nt((qa, sa), (qb, sb), out_dtype=torch.float32)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)  # fp32 accumulation


def test_out_argument_and_k_zero():
    x, w = _inputs(5, 7, 0, seed=0)
    out = torch.full((5, 7), float("nan"), dtype=torch.bfloat16)
    res = fp8_gemm_nt(per_token_cast_to_fp8(x), per_block_cast_to_fp8(w), out=out)
    assert res is out and torch.all(out == 0)
    x, w = _inputs(5, 7, 300, seed=1)
    out32 = torch.empty(5, 7)
    fp8_gemm_nt(per_token_cast_to_fp8(x), per_block_cast_to_fp8(w), out=out32)
    assert calc_diff(out32, x @ w.t()) < CALC_DIFF_MAX


def test_bad_input():
    x, w = _inputs(4, 6, 256, seed=2)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    with pytest.raises(ValueError, match="must share K"):
        fp8_gemm_nt(qa, per_block_cast_to_fp8(torch.randn(6, 200)))
    with pytest.raises(ValueError, match=r"b sf must have shape \(1, 2\)"):
        fp8_gemm_nt(qa, per_token_cast_to_fp8(w))  # 1x128 scales where 128x128 are needed
    with pytest.raises(ValueError, match=r"a sf must have shape \(4, 2\)"):
        fp8_gemm_nt((qa[0], qa[1][:, :1]), qb)
    with pytest.raises(TypeError, match="a must be a pair"):
        fp8_gemm_nt(qa[0], qb)
    with pytest.raises(TypeError, match=r"a\[0\] \(fp8 data\) must have dtype float8_e4m3fn"):
        fp8_gemm_nt((x, qa[1]), qb)
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_gemm_nt(qa, qb, out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 6\)"):
        fp8_gemm_nt(qa, qb, out=torch.empty(6, 4))
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        fp8_gemm_nt_1d1d(qa, per_token_cast_to_fp8(w), accumulate=True)
    with pytest.raises(TypeError, match="out must have dtype float32"):
        fp8_gemm_nt_1d1d(qa, per_token_cast_to_fp8(w), out=torch.empty(4, 6, dtype=torch.float16))
    with pytest.raises(TypeError, match="accumulate=True needs a float32 out"):
        bf16_out = torch.empty(4, 6, dtype=torch.bfloat16)
        fp8_gemm_nt_1d1d(qa, per_token_cast_to_fp8(w), out=bf16_out, accumulate=True)
    with pytest.raises(TypeError, match=r"out_dtype must be torch\.float32 or torch\.bfloat16"):
        fp8_gemm_nt_1d1d(qa, per_token_cast_to_fp8(w), out_dtype=torch.float16)
    with pytest.raises(ValueError, match=r"b sf must have shape \(6, 2\)"):
        fp8_gemm_nt_1d1d(qa, qb)
    assert qa[0].dtype == FP8_DTYPE


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 128, 4096])
@pytest.mark.parametrize("n,k", [(2112, 7168), (576, 7168), (7168, 2048)])
def test_reference_on_cuda(m, n, k):
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g)
    d = fp8_gemm_nt(per_token_cast_to_fp8(x), per_block_cast_to_fp8(w))
    diff = calc_diff(d, x.double() @ w.double().t())
    assert diff < CALC_DIFF_MAX, f"{m=}, {n=}, {k=}, {diff=:.2e}"
