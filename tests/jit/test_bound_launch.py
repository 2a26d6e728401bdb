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
    # Exact: the same kernel on the same inputs. The kernel's a*x+b contracts to one FMA (one
    # rounding), which FP64 reproduces exactly here (3x + 0.5 fits 53 bits) before one rounding.
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)
    torch.testing.assert_close(y1, (3 * x.double() + 0.5).float(), rtol=0, atol=0)
    # A second call reuses the thread's parameter block with new values.
    bound((8, 1, 1), x.data_ptr(), y1.data_ptr(), n, -1, 2.0)
    torch.cuda.synchronize()
    torch.testing.assert_close(y1, (-x.double() + 2.0).float(), rtol=0, atol=0)


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


class _FakeTensor:
    is_cuda = True

    def __init__(self, ptr, shape=(64, 256)):
        self.ptr, self.dtype, self.shape = ptr, torch.float8_e4m3fn, torch.Size(shape)

    def data_ptr(self):
        return self.ptr

    def stride(self):
        return (self.shape[1], 1)


def _fake_encoder(extra):
    calls = []

    def encode(tensor, box_rows, box_cols, swizzle="none"):
        calls.append(tensor.ptr)
        body = bytes([box_rows, box_cols, tensor.shape[0] % 256]) + bytes(117)
        return tensor.ptr.to_bytes(8, "little") + body[:119] + bytes([extra(tensor.ptr)])

    return encode, calls


@pytest.mark.parametrize("address_only", [True, False])
def test_tma_bytes_patch_the_address_only_after_checking_where_it_sits(address_only, monkeypatch):
    extra = (lambda ptr: 0) if address_only else (lambda ptr: (ptr >> 8) % 7)
    encode, calls = _fake_encoder(extra)
    monkeypatch.setattr(jit_launch, "_encode_2d", encode)
    monkeypatch.setattr(jit_launch, "_encoded_bytes", {})
    monkeypatch.setattr(jit_launch, "_geometry", {})
    ptrs = [0x7F00_0000_0000 + 0x1000 * i for i in range(6)]
    for ptr in ptrs:
        got = jit_launch.tma_2d_bytes(_FakeTensor(ptr), 64, 128, "128B")
        assert got == encode(_FakeTensor(ptr), 64, 128)  # (also counts one call)
    assert jit_launch.tma_2d_bytes(_FakeTensor(ptrs[0]), 64, 128, "128B")  # a plain cache hit
    encoded = len(calls) - len(ptrs)  # the test's own encode() calls are one per address
    if address_only:
        # The first address is the template, the next two confirm the field; then patched.
        assert encoded == 3, calls
    else:
        # A byte besides the address follows it: the geometry is never patched.
        assert encoded == len(ptrs), calls
    # Another geometry starts over (its own template).
    before = len(calls)
    jit_launch.tma_2d_bytes(_FakeTensor(ptrs[-1] + 0x1000, shape=(32, 256)), 64, 128, "128B")
    assert len(calls) == before + 1


@pytest.mark.gpu
def test_gpu_patched_tma_bytes_equal_fresh_encodings():
    base = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
    views = [base[i * 65536 : i * 65536 + 64 * 512].view(64, 512) for i in range(8)]
    for v in views:
        got = jit_launch.tma_2d_bytes(v, 64, 128, "128B")
        assert got == jit_launch._encode_2d(v, 64, 128, "128B")  # a fresh driver encoding


@pytest.mark.parametrize(
    "pdl,pdl_quant,gemm,quant",
    [
        (None, None, True, False),  # the defaults: the GEMMs programmatic, the quantizers not
        ("0", None, False, False),
        ("off", "1", False, False),  # the quantizers' switch needs the GEMMs' one
        ("1", "1", True, True),
        (None, "yes", True, True),
        ("", "0", True, False),
    ],
)
def test_programmatic_launch_switches(monkeypatch, pdl, pdl_quant, gemm, quant):
    for name, value in (("PTXTRAIN_PDL", pdl), ("PTXTRAIN_PDL_QUANT", pdl_quant)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert jit_launch.programmatic_launch_enabled() is gemm
    assert jit_launch.programmatic_launch_enabled(quant=True) is quant
