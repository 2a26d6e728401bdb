"""``ptxtrain bench optim``'s bookkeeping (CPU): the shape mixes and the table."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from ptxtrain.bench import optim as bo
from ptxtrain.testing.shapes import DSV3_DENSE_NK


def _numel(shapes) -> int:
    return sum(torch.Size(s).numel() for s in shapes)


@pytest.mark.parametrize("mix", bo.MIXES)
def test_shape_mix_repeats_the_unit_up_to_numel(mix):
    unit = bo.unit_shapes(mix)
    numel = 2 * _numel(unit) + 12345
    shapes = bo.shape_mix(numel, mix)
    assert _numel(shapes) == numel
    assert shapes[: 2 * len(unit)] == unit + unit
    assert len(shapes[-1]) == 1  # the remainder, 1-D
    assert bo.shape_mix(7, mix) == [(7,)]  # smaller than any shape but the smallest


def test_unit_shapes_and_bad_arguments():
    small = bo.unit_shapes("small")
    assert len(small) == 211 and _numel(small) == 94_231_168  # the small preset's parameters
    assert bo.unit_shapes("dsv3")[: len(DSV3_DENSE_NK)] == list(DSV3_DENSE_NK)
    with pytest.raises(ValueError, match="mix"):
        bo.unit_shapes("medium")
    with pytest.raises(ValueError, match="numel"):
        bo.shape_mix(0)


def test_table_rows_and_sweep():
    def row(bytes_per_param, us, frac, vs):
        return {"bytes_per_param": bytes_per_param, "us": us, "host_us": 50.0, "gbs": 1.0,
                "frac_copy": frac, "speedup_vs_torch_fused": vs}  # fmt: skip

    result = {
        "numel": 1000, "n_tensors": 3, "mix": "dsv3", "copy": {"gbs": 4000.0},
        "rows": {"ptxtrain_fused": row(22, 5500.0, 0.91, 1.62),
                 "torch_fused": row(28, 8900.0, 0.79, 1.0)},
        "sweep": [{"block": 1024, "num_warps": 4, "us": 5600.0, "gbs": 3900.0,
                   "frac_copy": 0.97}],
    }  # fmt: skip
    lines = bo.format_table(result).splitlines()
    assert lines[0] == "1,000 parameters in 3 tensors (dsv3 mix); copy 4000 GB/s"
    assert lines[2].split() == ["ptxtrain_fused", "22", "5.500", "0.050", "1", "0.91", "1.62"]
    assert lines[3].split()[0] == "torch_fused"
    assert "block  1024 x 4 warps" in lines[4] and "0.97 of copy" in lines[4]


class _CallTwice:
    """Stands in for GpuTimer on the CPU: runs setup and fn twice, reports 100 µs."""

    calls: ClassVar[list[bool]] = []

    def __init__(self, repeats: int, warmup: int) -> None:
        self.last_host_us = 10.0

    def __call__(self, fn, setup=None) -> float:
        for _ in range(2):
            if setup is not None:
                setup()
            fn()
            _CallTwice.calls.append(setup is not None)
        return 100.0


def test_bench_runs_every_row_on_the_cpu(monkeypatch):
    monkeypatch.setattr(bo, "_DEVICE", "cpu")
    monkeypatch.setattr(bo, "_COPY_BYTES", 1 << 12)
    monkeypatch.setattr(bo, "GpuTimer", _CallTwice)
    _CallTwice.calls = []
    record = bo.bench_optim(300_000, "small", sweep=True)
    assert list(record["rows"]) == [
        "ptxtrain_fused", "ptxtrain_fused+clip", "ptxtrain_foreach", "torch_fused",
        "torch_fused+clip",
    ]  # fmt: skip
    assert [r["bytes_per_param"] for r in record["rows"].values()] == [22, 26, 22, 28, 32]
    fused = record["rows"]["ptxtrain_fused"]
    assert fused["gbs"] == pytest.approx(22 * 300_000 / 100e-6 / 1e9, rel=1e-12)  # float math
    assert fused["frac_copy"] == fused["gbs"] / record["copy"]["gbs"]
    assert record["rows"]["torch_fused"]["speedup_vs_torch_fused"] == 1.0
    assert [(r["block"], r["num_warps"]) for r in record["sweep"]] == list(bo.SWEEP)
    assert record["n_tensors"] == len(bo.shape_mix(300_000, "small"))
    assert sum(_CallTwice.calls) == 2  # only the ptxtrain clip needs the untimed setup
    assert "command" in record["env"] and record["bench"] == "optim"
