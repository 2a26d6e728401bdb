"""Comparisons of two run folders' checkpoints (tensors under their layout-independent names)."""

from __future__ import annotations

from pathlib import Path

from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.train import read_checkpoint_meta, read_checkpoint_state


def assert_same_checkpoint(a: str | Path, b: str | Path) -> None:
    """The checkpoints of run folders ``a`` and ``b`` hold the same tensors bit for bit, the same
    step and the same optimizer parameter groups, whatever layouts wrote them."""
    sa, sb = read_checkpoint_state(a), read_checkpoint_state(b)
    assert sa.keys() == sb.keys()
    for k, v in sa.items():
        assert_bitwise_equal(sb[k], v, name=k)
    ma, mb = (
        read_checkpoint_meta(a, verify_files=False),
        read_checkpoint_meta(b, verify_files=False),
    )
    assert ma["step"] == mb["step"] and ma["optimizer"] == mb["optimizer"]


def assert_checkpoints_close(a: str | Path, b: str | Path, rel: float) -> None:
    """The checkpoints of ``a`` and ``b`` hold the same keys with the same shapes and dtypes, and
    every floating tensor of ``a`` lies within relative L2 distance ``rel`` of ``b``'s."""
    sa, sb = read_checkpoint_state(a), read_checkpoint_state(b)
    assert sa.keys() == sb.keys()
    for k, v in sb.items():
        assert sa[k].shape == v.shape and sa[k].dtype == v.dtype, k
        if v.is_floating_point() and v.dim() > 0:
            diff = float((sa[k].double() - v.double()).norm() / v.double().norm().clamp_min(1e-30))
            assert diff < rel, f"{k}: relative difference {diff:.2e}"
    ma, mb = (
        read_checkpoint_meta(a, verify_files=False),
        read_checkpoint_meta(b, verify_files=False),
    )
    assert ma["optimizer"] == mb["optimizer"]
