"""The benchmark harness's bookkeeping on CPU (no timing): which operands each backend gets, the
summary's geometric means, and the Linear bench's two FP8 timings (weight quantization cached or
redone in every call)."""

from __future__ import annotations

import math

import pytest
import torch

from ptxtrain.bench import gemm as bench_gemm
from ptxtrain.bench import linear as bench_linear


class _FakeTimer:
    """Times nothing: each call runs ``fn`` once and reports a fixed number of µs per name."""

    def __init__(self, us):
        self.us, self.last_host_us, self.calls = us, 1.0, 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return self.us


def test_time_backends_gives_each_backend_its_operands():
    seen = {}

    def backend(name):
        def run(a, b):
            seen.setdefault(name, set()).add(b)
            return torch.ones(2, 2)

        return run

    row = {"m": 2, "n": 2, "k": 128, "us": {}, "tflops": {}, "calc_diff": {}}
    backends = {"cublas": backend("cublas"), "ptx": backend("ptx")}
    bench_gemm._time_backends(
        row, backends, "qa", "qb", torch.ones(2, 2), _FakeTimer(4.0), {"cublas": "qb_row"}
    )
    # cuBLAS checked and timed on its own B only; the others on the shared one.
    assert seen == {"cublas": {"qb_row"}, "ptx": {"qb"}}
    assert row["us"] == {"cublas": 4.0, "ptx": 4.0}
    assert row["tflops"]["ptx"] == pytest.approx(2 * 2 * 2 * 128 / 4e-6 / 1e12)


def test_triton_kernel_is_named_per_row_and_in_the_table():
    """With a ``triton`` backend each row says which kernel its default runs (without a GPU:
    the plain Triton kernel, chosen as for an H200), and the table prints it."""
    row = {"m": 4096, "n": 7168, "k": 2048, "us": {}, "tflops": {}, "calc_diff": {}}
    backends = {"cublas": lambda a, b: torch.ones(2, 2), "triton": lambda a, b: torch.ones(2, 2)}
    bench_gemm._time_backends(row, backends, "qa", "qb", torch.ones(2, 2), _FakeTimer(4.0))
    assert row["triton_kernel"] == "triton 64x128 s3 tma"
    text = bench_gemm.format_table({"rows": [row], "summary": {}})
    assert text.splitlines()[0].endswith("triton kernel")
    assert text.splitlines()[1].endswith("triton 64x128 s3 tma")


def test_summary_geomeans_per_m_and_over_all_rows():
    rows = [
        {"m": 7168, "us": {"cublas": 10.0, "ptx": 5.0, "bf16": 20.0}},
        {"m": 7168, "us": {"cublas": 10.0, "ptx": 20.0, "bf16": 20.0}},
        {"m": 512, "us": {"cublas": 9.0, "ptx": 3.0, "bf16": 9.0}},
        {"m": 512, "us": {"cublas": 9.0, "ptx": None, "bf16": 9.0}},  # a failed backend: left out
    ]
    s = bench_gemm._summary(rows, ["cublas", "ptx"])
    assert s["geomean_ptx_over_cublas_m7168"] == pytest.approx(1.0)  # 2x and 0.5x
    assert s["geomean_ptx_over_cublas_m512"] == pytest.approx(3.0)
    assert s["geomean_ptx_over_cublas_all"] == pytest.approx(math.exp(math.log(3.0) / 3))
    assert s["geomean_cublas_over_bf16_m7168"] == pytest.approx(2.0)
    assert "geomean_cublas_over_cublas_all" not in s


@pytest.mark.parametrize("requant_w", [False, True])
def test_linear_bench_times_the_weight_quantization_only_when_asked(monkeypatch, requant_w):
    from ptxtrain import quant
    from ptxtrain.nn import Fp8Linear

    calls = {"w": 0}
    real = quant.per_block_cast_to_fp8_both

    def counting(*args, **kwargs):
        calls["w"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(quant, "per_block_cast_to_fp8_both", counting)
    torch.manual_seed(0)
    layer = Fp8Linear(256, 128, bias=False)
    x = torch.randn(16, 256, requires_grad=True)
    dy = torch.randn(16, 128)
    run = bench_linear.fwd_bwd_call(layer, x, dy, requant_w=requant_w)
    for _ in range(3):
        run()
    assert x.grad is not None and layer.weight.grad is not None
    # Cached: quantized by the first call only; requant_w: by every call.
    assert calls["w"] == (3 if requant_w else 1)
