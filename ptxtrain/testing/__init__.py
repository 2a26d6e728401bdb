"""Numerical oracles and shape grids shared by tests and benchmarks (never copied into either)."""

from ptxtrain.testing.numeric import assert_bitwise_equal, calc_diff, sqnr_db

__all__ = ["assert_bitwise_equal", "calc_diff", "sqnr_db"]
