"""ptxtrain.gemm's dispatcher takes DeepGEMM's argument order: ``fp8_gemm_nt(a, b, d, c=None)``."""

import pytest
import torch

from ptxtrain.gemm import fp8_gemm_nt, fp8_gemm_nt_1d1d
from ptxtrain.quant.ref import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff
from tests.gemm._bounds import CALC_DIFF_MAX


def _problem(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    return x, w, torch.randn(m, n, generator=g)


@pytest.mark.parametrize("m,n,k", [(256, 576, 2048), (13, 300, 100)])
def test_1d2d_writes_d_and_adds_c(m, n, k):
    x, w, c = _problem(m, n, k, seed=m + n)
    a, b = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    assert fp8_gemm_nt(a, b, d) is d  # DeepGEMM's positional output, returned
    want = x.double() @ w.double().t()
    assert calc_diff(d.double(), want) < CALC_DIFF_MAX
    d32 = torch.empty(m, n)
    assert fp8_gemm_nt(a, b, d32, c) is d32  # D = C + A·Bᵀ
    # The product's own error (< CALC_DIFF_MAX) over the larger D: adding C cannot raise it.
    assert calc_diff(d32.double(), want + c.double()) < CALC_DIFF_MAX
    acc = c.clone()
    fp8_gemm_nt(a, b, acc, acc)  # c is d: accumulate in place
    torch.testing.assert_close(acc, d32, rtol=0, atol=0)  # the same sum, the same order


@pytest.mark.parametrize("m,n,k", [(576, 2048, 512), (100, 13, 130)])
def test_1d1d_accumulates_through_c(m, n, k):
    x, w, c = _problem(m, n, k, seed=m * n)
    a, b = per_token_cast_to_fp8(x), per_token_cast_to_fp8(w)
    plain = fp8_gemm_nt_1d1d(a, b)
    d = c.clone()
    assert fp8_gemm_nt_1d1d(a, b, d, d) is d
    other = torch.empty(m, n)
    fp8_gemm_nt_1d1d(a, b, other, c)  # c copied into d, then added into
    torch.testing.assert_close(other, d, rtol=0, atol=0)
    # fp32 rounding of one addition per element: |c + p| ulp-sized differences only.
    torch.testing.assert_close(d, c + plain, rtol=1e-6, atol=1e-5)


def test_bad_outputs_are_named():
    x, w, c = _problem(128, 128, 128, seed=1)
    a, b = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    d = torch.empty(128, 128)
    with pytest.raises(TypeError, match=r"d .* or as out="):
        fp8_gemm_nt(a, b, d, out=d)
    with pytest.raises(ValueError, match="c must be a float32"):
        fp8_gemm_nt(a, b, d, c.bfloat16())
    with pytest.raises(ValueError, match="d must be a float32"):
        fp8_gemm_nt(a, b, None, c)
    with pytest.raises(ValueError, match="d must be a float32"):
        fp8_gemm_nt(a, b, torch.empty(128, 128, dtype=torch.bfloat16), c)


def test_grouped_gemms_are_exported_from_ptxtrain_gemm():
    import ptxtrain.gemm as g
    from ptxtrain.gemm import grouped

    for name in g.GROUPED:
        assert name in g.__all__
        assert getattr(g, name) is getattr(grouped, name)
    with pytest.raises(AttributeError, match="no_such_gemm"):
        g.no_such_gemm  # noqa: B018
