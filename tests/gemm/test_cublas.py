"""The cuBLAS blockwise backend (``torch._scaled_mm``): its guards here, its numbers on a GPU."""

import pytest
import torch

from ptxtrain.gemm import cublas
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff
from ptxtrain.testing.shapes import DSV3_DENSE_NK, DSV3_WGRAD_MN
from tests.gemm._bounds import CALC_DIFF_MAX


def test_supports_nothing_without_cuda_hopper():
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("this machine has a Hopper GPU")
    assert not cublas.supports(4096, 7168, 2048)


def test_cpu_tensors_are_refused_with_a_clear_error():
    x, w = torch.randn(8, 512), torch.randn(256, 512)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    with pytest.raises(ValueError, match="the cublas backend needs CUDA tensors"):
        cublas.fp8_gemm_nt(qa, qb)
    with pytest.raises(ValueError, match="the cublas backend needs CUDA tensors"):
        cublas.fp8_gemm_nt_1d1d(qa, per_token_cast_to_fp8(w))


def test_empty_k_or_n_never_reaches_cublas(monkeypatch):
    # K = 0 satisfies K % 512 == 0: without its own guard ``auto`` would route such a GEMM to
    # cuBLAS (M > 128 or 1D1D) and call _scaled_mm on empty operands. The contract is D = 0.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cublas, "_capability", lambda index: (9, 0))
    cuda0 = torch.device("cuda", 0)
    assert cublas.supports(256, 256, 512, device=cuda0)  # the stub passes a real shape
    assert not cublas.supports(256, 256, 0, device=cuda0)
    assert not cublas.supports(256, 0, 512, device=cuda0)
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: pytest.fail("_scaled_mm called"))
    qa = per_token_cast_to_fp8(torch.randn(8, 0))
    qb = per_block_cast_to_fp8(torch.randn(16, 0))
    d = cublas.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    assert d.shape == (8, 16) and bool((d == 0).all())
    out = torch.randn(8, 16)
    before = out.clone()
    assert cublas.fp8_gemm_nt_1d1d(qa, per_token_cast_to_fp8(torch.randn(16, 0)), out=out,
                                   accumulate=True) is out  # fmt: skip
    assert torch.equal(out, before)  # adding an empty sum changes nothing
    qb0 = per_block_cast_to_fp8(torch.randn(0, 512))
    assert cublas.fp8_gemm_nt(per_token_cast_to_fp8(torch.randn(8, 512)), qb0).shape == (8, 0)


def _gpu_inputs(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (
        torch.randn(m, k, device="cuda", generator=g),
        torch.randn(n, k, device="cuda", generator=g),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", DSV3_DENSE_NK)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_1d2d_dsv3(n, k, out_dtype):
    x, w = _gpu_inputs(256, n, k, seed=n + k)
    d = cublas.fp8_gemm_nt(per_token_cast_to_fp8(x), per_block_cast_to_fp8(w), out_dtype=out_dtype)
    assert d.dtype == out_dtype
    assert calc_diff(d, x.double() @ w.double().t()) < CALC_DIFF_MAX


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", DSV3_WGRAD_MN)
def test_gpu_1d1d_wgrad_fp32_bf16_and_accumulate(m, n):
    a, b = _gpu_inputs(m, n, 4096, seed=m + n)
    qa, qb = per_token_cast_to_fp8(a), per_token_cast_to_fp8(b)
    want = a.double() @ b.double().t()
    d = cublas.fp8_gemm_nt_1d1d(qa, qb)
    assert d.dtype == torch.float32 and calc_diff(d, want) < CALC_DIFF_MAX
    d16 = cublas.fp8_gemm_nt_1d1d(qa, qb, out_dtype=torch.bfloat16)
    assert d16.dtype == torch.bfloat16 and calc_diff(d16, want) < CALC_DIFF_MAX
    # One bf16 rounding of (nearly) the same fp32 sum: within 2^-7 relative (bf16's 8 bits),
    # plus a small absolute slack for cuBLAS choosing a different kernel per output dtype.
    torch.testing.assert_close(d16.float(), d, rtol=2**-7, atol=1e-2)
    out = torch.randn(m, n, device="cuda")
    c = out.clone()
    cublas.fp8_gemm_nt_1d1d(qa, qb, out=out, accumulate=True)
    torch.testing.assert_close(out, c + d, rtol=1e-5, atol=1e-4)  # one fp32 add of the product


def test_1d1d_scale_layouts_take_either_sf_b_layout():
    # Each probed layout gets B's scales in whichever layout the caller quantized them and passes
    # cuBLAS the same tensor (values and strides) as from row-major scales; the layout it reads
    # uncopied is the one sf_b_layout_1d1d names for it.
    g = torch.Generator().manual_seed(4)
    y = torch.randn(96, 640, generator=g)
    (_, sb_row), (_, sb_mn) = (per_token_cast_to_fp8(y, sf_layout=s) for s in ("row", "mn_major"))
    sa = per_token_cast_to_fp8(torch.randn(64, 640, generator=g), sf_layout="mn_major")[1]
    for name, layout in cublas._1D1D_LAYOUTS.items():
        want_a, want_b = layout(sa, sb_row)
        for sb in (sb_row, sb_mn):
            got_a, got_b = layout(sa, sb)
            assert torch.equal(got_b, want_b) and got_b.stride() == want_b.stride(), name
            assert got_a.stride() == want_a.stride()
        own = sb_row if cublas._1D1D_SF_B_LAYOUT[name] == "row" else sb_mn
        assert layout(sa, own)[1].data_ptr() == own.data_ptr(), f"{name}: copied its own layout"
