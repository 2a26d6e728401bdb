"""BoundLaunch: the parameter block layout (CPU), the launch structs against cuda.h (CPU, with a
C compiler), and launches on a GPU against the plain ``launch`` path."""

from __future__ import annotations

import ctypes
import importlib
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from ptxtrain.jit import BoundLaunch, compile_cuda, load_kernel, param_layout

# The module (the package's ``launch`` attribute is the function of the same name).
jit_launch = importlib.import_module("ptxtrain.jit.launch")


def test_param_layout_aligns_every_parameter():
    fmt, offsets, nbytes = param_layout("ipTqfi")
    # int32 at 0, pointer aligned to 8, TensorMap aligned to 64, int64 after it, then two 4-byte.
    assert offsets == [0, 8, 64, 192, 200, 204]
    assert nbytes == 208
    packed = struct.pack(fmt, 7, 0xDEAD_BEEF_0000, b"\x01" * 128, -3, 1.5, 9)
    assert len(packed) == nbytes
    assert struct.unpack_from("<i", packed, 0)[0] == 7
    assert struct.unpack_from("<Q", packed, 8)[0] == 0xDEAD_BEEF_0000
    assert packed[64:192] == b"\x01" * 128
    assert struct.unpack_from("<q", packed, 192)[0] == -3
    assert struct.unpack_from("<f", packed, 200)[0] == 1.5
    assert struct.unpack_from("<i", packed, 204)[0] == 9


@pytest.mark.parametrize(("sig", "exc"), [("pz", ValueError), (3, TypeError)])
def test_param_layout_rejects_unknown_signatures(sig, exc):
    with pytest.raises(exc, match="signature"):
        param_layout(sig)


def _cuda_h() -> Path | None:
    try:
        import triton
    except ImportError:
        return None
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "include" / "cuda.h"
    return path if path.exists() else None


@pytest.mark.skipif(shutil.which("cc") is None or _cuda_h() is None, reason="no C compiler/cuda.h")
def test_launch_structs_match_cuda_h(tmp_path):
    """The ctypes CUlaunchConfig / CUlaunchAttribute match the C definitions byte for byte."""
    src = tmp_path / "layout.c"
    src.write_text(
        "#include <stdio.h>\n#include <stddef.h>\n#include <cuda.h>\n"
        "int main(void) {\n"
        ' printf("%zu %zu %zu %zu %zu %zu %zu\\n", sizeof(CUlaunchConfig),'
        " offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),"
        " offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),"
        " sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value));\n"
        ' printf("%d\\n", (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);\n'
        " return 0;\n}\n"
    )
    exe = tmp_path / "layout"
    subprocess.run(
        ["cc", f"-I{_cuda_h().parent}", str(src), "-o", str(exe)], check=True, capture_output=True
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    sizes, cluster_id = out.splitlines()
    cfg, attr = jit_launch._LaunchConfig, jit_launch._LaunchAttribute
    got = [
        ctypes.sizeof(cfg),
        cfg.sharedMemBytes.offset,
        cfg.hStream.offset,
        cfg.attrs.offset,
        cfg.numAttrs.offset,
        ctypes.sizeof(attr),
        attr.value.offset,
    ]
    assert got == [int(v) for v in sizes.split()]
    assert int(cluster_id) == 4  # the id the driver's enum gives (read from cuda-bindings on GPU)


VEC_SOURCE = r"""
extern "C" __global__ void axpb(const float* x, float* y, long long n, int a, float b) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + b;
}
"""


@pytest.mark.gpu
@pytest.mark.parametrize("cluster", [None, (2, 1, 1)])
def test_gpu_bound_launch_matches_plain_launch(cluster):
    kernel = load_kernel(compile_cuda(VEC_SOURCE, name="axpb"))
    bound = BoundLaunch(kernel, "ppqif", 128, cluster=cluster)
    n = 1000
    x = torch.randn(n, device="cuda")
    y1 = torch.full((n,), float("nan"), device="cuda")
    y2 = torch.full((n,), float("nan"), device="cuda")
    bound(8, x.data_ptr(), y1.data_ptr(), n, 3, 0.5)
    jit_launch.launch(kernel, 8, 128, [x, y2, ctypes.c_int64(n), 3, 0.5], cluster=cluster)
    torch.cuda.synchronize()
    # Exact: the same kernel on the same inputs; and one fma-free multiply-add per element.
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    torch.testing.assert_close(y1, 3 * x + 0.5, rtol=0, atol=0)
    # A second call reuses the thread's parameter block with new values.
    bound((8, 1, 1), x.data_ptr(), y1.data_ptr(), n, -1, 2.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(y1, -x + 2.0, rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_bound_launch_rejects_bad_values():
    kernel = load_kernel(compile_cuda(VEC_SOURCE, name="axpb"))
    bound = BoundLaunch(kernel, "ppqif", 128)
    x = torch.randn(4, device="cuda")
    with pytest.raises(TypeError, match="expected 5 values"):
        bound(1, x.data_ptr(), x.data_ptr(), 4, 1)
    with pytest.raises(ValueError, match="value 3"):
        bound(1, x.data_ptr(), x.data_ptr(), 4, 2**40, 1.0)
    with pytest.raises(ValueError, match="not divisible by cluster"):
        BoundLaunch(kernel, "ppqif", 128, cluster=(2, 1, 1))(3, 0, 0, 0, 0, 0.0)
    with pytest.raises(TypeError, match="LoadedKernel"):
        BoundLaunch("kernel", "p", 32)
