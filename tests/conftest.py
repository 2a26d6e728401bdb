"""Test configuration.

- Without a GPU, Triton kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``), with
  ``ptxtrain.testing.triton_interp``'s patch making its float casts, FMA and dot exact. The
  variable must be set before ``triton.jit`` decorates any kernel, i.e. before any ptxtrain Triton
  module is imported, which is why it is set here, at the top of the top-level conftest.
- Tests marked ``gpu`` / ``multigpu`` are skipped where no (or only one) CUDA device is present.
"""

import contextlib
import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    from ptxtrain.testing.triton_interp import apply_interpreter_patch

    # Another Triton version raises: tests/quant/test_triton.py's patch test then fails, saying why.
    with contextlib.suppress(RuntimeError):
        apply_interpreter_patch()


def pytest_collection_modifyitems(config, items):
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs 2+ CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and n_gpus == 0:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n_gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def ref_gemms(monkeypatch):
    """Run every GEMM (grouped and dense) on the pure-PyTorch reference. Without it, CPU tests
    run the grouped GEMMs' Triton kernels under Triton's interpreter (TRITON_INTERPRET=1 above),
    which is slow; tests/nn/test_fp8_grouped.py tests those kernels on their own."""
    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "ref")
