"""The oracles themselves: calc_diff, sqnr_db, assert_bitwise_equal."""

import math

import pytest
import torch

from ptxtrain.testing import assert_bitwise_equal, calc_diff, sqnr_db
from ptxtrain.testing.shapes import DSV3_DENSE_NK, dense_shapes_cpu, scaled_down


def test_calc_diff_values():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    assert calc_diff(x, x) == pytest.approx(0.0, abs=1e-15)
    assert calc_diff(x, -x) == pytest.approx(2.0)
    # Small relative noise e: calc_diff ≈ ‖e‖² / (2‖x‖²) to first order.
    e = 1e-2 * torch.randn(1000, generator=torch.Generator().manual_seed(1))
    expect = float((e.double() ** 2).sum() / (2 * (x.double() ** 2).sum()))
    assert calc_diff(x + e, x) == pytest.approx(expect, rel=0.05)
    assert math.isnan(calc_diff(torch.tensor([float("nan"), 1.0]), torch.ones(2)))
    assert calc_diff(torch.empty(0, 3), torch.empty(0, 3)) == 0.0
    with pytest.raises(ValueError, match="equal shapes"):
        calc_diff(torch.ones(2), torch.ones(3))


def test_sqnr_db_values():
    x = torch.randn(4096, generator=torch.Generator().manual_seed(2))
    assert sqnr_db(x, x) == math.inf
    assert sqnr_db(x, x * 1.01) == pytest.approx(
        40.0, abs=1e-4
    )  # noise = 1% of the signal (fp32 x)
    with pytest.raises(ValueError, match="equal shapes"):
        sqnr_db(torch.ones(2), torch.ones(2, 1))


def test_assert_bitwise_equal_reports_first_difference():
    a = torch.randn(3, 4, generator=torch.Generator().manual_seed(3)).to(torch.float8_e4m3fn)
    assert_bitwise_equal(a, a.clone())
    b = a.clone().view(torch.uint8)
    b[1, 2] ^= 1
    with pytest.raises(AssertionError, match=r"1 of 12 elements differ; first at \(1, 2\)"):
        assert_bitwise_equal(a, b.view(torch.float8_e4m3fn), "w")
    nan = torch.tensor([float("nan")])
    assert_bitwise_equal(nan, nan.clone())  # same NaN bits compare equal
    with pytest.raises(AssertionError, match="dtype"):
        assert_bitwise_equal(torch.ones(2), torch.ones(2, dtype=torch.float64))


def test_scaled_down_keeps_tails():
    for n, k in DSV3_DENSE_NK:
        assert scaled_down(n) % 128 == n % 128 and scaled_down(k) % 128 == k % 128
    assert all(n >= 1 and k >= 1 for n, k in dense_shapes_cpu())
    assert scaled_down(576) == 192  # 4 blocks + a 64-wide tail → 1 block + the same tail
