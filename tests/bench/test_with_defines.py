"""``benchmarks/with_defines.py``: a ``ptxtrain`` command run with header switches of the PTX GEMM
set for the whole process."""

from __future__ import annotations

import pytest
import torch

from benchmarks import with_defines
from ptxtrain.gemm import ptx


def _source_defines() -> str:
    """What a PTX GEMM's translation unit holds before the header: the switches in force."""
    cfg = ptx.select_config("1d2d", 256, 512, 1024, 132)
    src, _ = ptx.kernel_source("1d2d", cfg, 512, 1024, torch.bfloat16, False)
    return src.split("#include <ptxtrain/fp8_gemm.cuh>")[0]


def test_switches_reach_the_gemm_source_and_the_command_runs(monkeypatch, capsys):
    seen = {}

    def fake_cli(argv):
        seen["argv"] = list(argv)
        seen["defines"] = _source_defines()
        return 0

    monkeypatch.setattr(with_defines, "cli_main", fake_cli)
    try:
        rc = with_defines.main(
            ["#PTXTRAIN_GEMM_EARLY_SB_GROUPS=6", "#PTXTRAIN_GEMM_CHUNK=16", "--", "bench", "linear"]
        )
    finally:
        ptx.set_source_defines("")
    assert rc == 0
    assert seen["argv"] == ["bench", "linear"]
    assert "#define PTXTRAIN_GEMM_EARLY_SB_GROUPS 6\n" in seen["defines"]
    assert "#define PTXTRAIN_GEMM_CHUNK 16\n" in seen["defines"]
    assert _source_defines() == ""


def test_needs_the_separator_and_well_formed_switches():
    with pytest.raises(SystemExit, match="usage"):
        with_defines.main(["#PTXTRAIN_GEMM_CHUNK=16", "bench", "linear"])
    with pytest.raises(ValueError, match="MACRO=VALUE"):
        with_defines.main(["#PTXTRAIN_GEMM_CHUNK", "--", "bench", "linear"])
