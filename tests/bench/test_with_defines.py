"""``benchmarks/with_defines.py``: a ``ptxtrain`` command run with header switches of the PTX GEMM
set for the whole process."""

from __future__ import annotations

import pytest

from benchmarks import with_defines
from ptxtrain.gemm import ptx


def test_switches_reach_the_gemm_source_and_the_command_runs(monkeypatch, capsys):
    seen = {}

    def fake_cli(argv):
        seen["argv"] = list(argv)
        seen["defines"] = ptx._SOURCE_DEFINES
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
    assert ptx._SOURCE_DEFINES == ""


def test_needs_the_separator_and_well_formed_switches():
    with pytest.raises(SystemExit, match="usage"):
        with_defines.main(["#PTXTRAIN_GEMM_CHUNK=16", "bench", "linear"])
    with pytest.raises(ValueError, match="MACRO=VALUE"):
        with_defines.main(["#PTXTRAIN_GEMM_CHUNK", "--", "bench", "linear"])
