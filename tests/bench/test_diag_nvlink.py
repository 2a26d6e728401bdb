"""``benchmarks/diag_nvlink.py`` (a GPU script: two GPUs, one process): its copy kernels build
for sm_90a with every knob the script times, and it refuses to run without two GPUs."""

from __future__ import annotations

import pytest
import torch

from ptxtrain.jit import nvrtc_available


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (cuda-bindings) missing")
def test_diag_kernels_build_with_every_knob(tmp_path, monkeypatch):
    from benchmarks.diag_nvlink import _DIAG
    from ptxtrain.jit import compile_cuda

    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path))
    keys = set()
    for unroll, ld, stages in ((4, 0, 2), (8, 0, 2), (4, 1, 2), (4, 0, 3)):
        flags = (f"-DDIAG_UNROLL={unroll}", f"-DDIAG_LD={ld}", f"-DDIAG_STAGES={stages}")
        k = compile_cuda(_DIAG, name="diag_warp", flags=flags, keep_ptx=True)
        # the TMA bulk copies, the non-coherent or relaxed loads as the knob says
        assert "cp.async.bulk.global.shared::cta.bulk_group" in k.ptx
        assert ("ld.relaxed.gpu.global.v4" in k.ptx) == (ld == 1)
        keys.add(k.key)
    assert len(keys) == 4  # every knob reaches the build


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the refusal without 2 GPUs")
def test_diag_needs_two_gpus(capsys):
    from benchmarks.diag_nvlink import main

    assert main(["--skip-copies"]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().err
