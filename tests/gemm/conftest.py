"""Triton GEMMs without a GPU: run them in Triton's CPU interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton.jit`` decorates the kernels, i.e. before
``ptxtrain.gemm.triton`` is first imported; pytest loads this file before the test modules of this
folder. (If a module collected earlier already imported the kernels compiled, the Triton tests
skip themselves and say so.)

The interpreter's ``tl.dot`` on float8e4nv operands is exact by itself (it decodes e4m3 to fp16
bit by bit and multiplies in fp32; ``test_interpreter_decodes_every_e4m3_code`` checks it), so the
GEMM tests need no patch. Where ``ptxtrain.testing.triton_interp`` is present it is applied as in
tests/quant, so that the fp32 → bf16 output cast rounds to nearest even like the GPU instead of
truncating; the bf16 tolerances hold either way.
"""

import contextlib
import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None:
    with contextlib.suppress(ImportError, RuntimeError):
        from ptxtrain.testing.triton_interp import apply_interpreter_patch

        apply_interpreter_patch()
