"""``sf_layout`` of the dispatching 1x128 / 128x1 quantizers: ``"mn_major"`` gives the same
values as ``"row"`` in strides (1, 4·⌈R/4⌉) on every backend (the reference re-lays out)."""

from __future__ import annotations

import pytest
import torch

from ptxtrain import quant

SHAPES = [(1, 128), (13, 300), (130, 256), (256, 1)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "fn", ["per_token_cast_to_fp8", "per_token_cast_to_fp8_t", "per_token_cast_to_fp8_both"]
)
def test_mn_major_equals_row_in_padded_column_layout(fn, shape, monkeypatch):
    monkeypatch.setenv("PTXTRAIN_QUANT_BACKEND", "ref")
    x = torch.randn(*shape, dtype=torch.bfloat16) * 3
    row = getattr(quant, fn)(x)
    mn = getattr(quant, fn)(x, sf_layout="mn_major")
    assert len(row) == len(mn)
    for r, t in zip(row, mn):
        assert torch.equal(
            r.view(torch.uint8) if r.dtype == quant.FP8_DTYPE else r,
            t.view(torch.uint8) if t.dtype == quant.FP8_DTYPE else t,
        )
        if t.dtype == torch.float32:
            rows = t.shape[0]
            assert t.stride() == (1, -(-rows // 4) * 4), (fn, shape, t.stride())


def test_to_mn_major_keeps_a_laid_out_tensor_and_copies_others():
    sf = torch.rand(13, 3) + 0.5
    mn = quant.to_mn_major(sf)
    assert mn.stride() == (1, 16) and torch.equal(mn, sf)
    assert quant.to_mn_major(mn) is mn


def test_unknown_sf_layout_is_a_clear_error():
    with pytest.raises(ValueError, match="sf_layout"):
        quant.per_token_cast_to_fp8(torch.randn(4, 128), sf_layout="col")
