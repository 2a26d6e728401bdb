"""``ptxtrain bench quant``'s bookkeeping (CPU): byte counts per op and the table with the
MN-major rows, which the reference backend does not time."""

from __future__ import annotations

import pytest

from ptxtrain.bench import quant as bq


def test_mn_major_rows_count_the_same_bytes():
    for op in ("per_token", "per_token_t", "both"):
        assert bq.logical_bytes(f"{op}:mn", 4096, 7168) == bq.logical_bytes(op, 4096, 7168)
    # bf16 read + fp8 write + one fp32 scale per 128 columns of each of the 4096 rows
    want = 2 * 4096 * 7168 + 4096 * 7168 + 4 * 4096 * 56
    assert bq.logical_bytes("per_token", 4096, 7168) == want


def test_unknown_op_names_itself():
    for bad in ("per_tensor", "per_block:mn", "per_token:"):
        with pytest.raises(ValueError, match="op must be one of"):
            bq.logical_bytes(bad, 4096, 7168)


def test_table_leaves_untimed_backends_blank():
    def row(op, names):
        return {
            "m": 4096, "k": 7168, "op": op, "copy_gbs": 4000.0,
            "us": {n: 20.0 + i for i, n in enumerate(names)},
            "gbs": {n: 3000.0 - 100 * i for i, n in enumerate(names)},
            "bit_exact": {n: True for n in names},
        }  # fmt: skip

    text = bq.format_table({"rows": [row("both", ["ref", "cuda"]), row("both:mn", ["cuda"])]})
    lines = text.splitlines()
    assert "ref µs" in lines[0] and "cuda µs" in lines[0]
    assert lines[2].split()[2] == "both:mn"
    # the ref cells of the MN-major row are dashes, the cuda cells its own numbers (0.75 of copy)
    assert lines[2].split()[4:8] == ["-", "-", "-", "-"]
    assert lines[2].split()[8:12] == ["20.0", "3000", "0.75", "yes"]
