"""Backend selection for ptxtrain.gemm and ptxtrain.quant."""

import functools

import pytest
import torch

from ptxtrain import gemm, quant


def test_auto_on_cpu_is_reference(monkeypatch):
    monkeypatch.delenv("PTXTRAIN_GEMM_BACKEND", raising=False)
    monkeypatch.delenv("PTXTRAIN_QUANT_BACKEND", raising=False)
    assert gemm.select_backend("1d2d", 64, 256, 512, torch.device("cpu")) == "ref"
    assert quant.select_backend(torch.ones(2, 2)) == "ref"


def test_env_forces_backend(monkeypatch):
    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "Triton")
    assert gemm.select_backend("1d1d", 1, 1, 1, torch.device("cpu")) == "triton"
    monkeypatch.setenv("PTXTRAIN_QUANT_BACKEND", "ref")
    assert quant.select_backend(torch.ones(1)) == "ref"


def test_unknown_env_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "cutlass")
    x = torch.randn(4, 128)
    qa = quant.per_token_cast_to_fp8(x)
    qb = quant.per_block_cast_to_fp8(x)
    with pytest.raises(
        ValueError, match=r"PTXTRAIN_GEMM_BACKEND must be one of auto, ref.*'cutlass'"
    ):
        gemm.fp8_gemm_nt(qa, qb)
    monkeypatch.setenv("PTXTRAIN_QUANT_BACKEND", "cutlass")
    with pytest.raises(ValueError, match="PTXTRAIN_QUANT_BACKEND"):
        quant.per_token_cast_to_fp8(x)


def test_backends_listing():
    listing = gemm.backends()
    assert set(listing) == set(gemm.BACKENDS) and listing["ref"] == "available"
    assert set(quant.backends()) == set(quant.BACKENDS)


def test_backends_listing_says_what_cannot_run_here(monkeypatch):
    # "available" means the backend can run on this machine, not merely that it imports: with
    # no CUDA device the GPU-only backends say why not, and Triton follows the interpreter flag.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    g, q = gemm.backends(), quant.backends()
    for listing, name in ((g, "cublas"), (g, "ptx"), (q, "cuda")):
        # (or the import error, where the module's toolchain is missing)
        assert listing[name].startswith("unavailable: "), (name, listing)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert gemm.backends()["triton"].startswith("unavailable")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from ptxtrain import _backend

    want = "available" if _backend._triton_installed() else "unavailable"
    assert gemm.backends()["triton"].startswith(want) and quant.backends()["triton"].startswith(
        want
    )


def test_dispatch_validates_before_selecting(monkeypatch):
    monkeypatch.delenv("PTXTRAIN_GEMM_BACKEND", raising=False)
    with pytest.raises(TypeError, match="a must be a pair"):
        gemm.fp8_gemm_nt(torch.ones(2, 2), torch.ones(2, 2))
    with pytest.raises(TypeError, match=r"x must be a torch\.Tensor"):
        quant.per_token_cast_to_fp8([[1.0]])


def test_ptx_wins_rule():
    # Decode-sized 1D2D always; larger 1D2D / 1D1D where the PTX tiles fill their waves (the
    # rule gemm.ptx_wins documents, from timings on an H200).
    assert gemm.ptx_wins("1d2d", 64, 7168, 16384) and gemm.ptx_wins("1d2d", 128, 7168, 2048)
    assert gemm.ptx_wins("1d2d", 4096, 32768, 512) and gemm.ptx_wins("1d2d", 4096, 7168, 2048)
    # 544 tiles of 128x128 are 4.12 waves of 132 SMs: the split tail runs the last 16 as K-slices
    assert gemm.ptx_wins("1d2d", 4096, 2112, 7168)
    # 7168 x 2112 x 7168 (1D1D, no split tail): 952 tiles, 7.2 waves, 90% of the slots
    assert gemm.ptx_wins("1d1d", 7168, 2112, 7168)
    # 2048 x 1536 x 7168: 16 x 12 = 192 tiles of 128x128, under two waves: the other backends
    assert not gemm.ptx_wins("1d1d", 2048, 1536, 7168)
    assert gemm.ptx_wins("1d1d", 7168, 2112, 4096) and gemm.ptx_wins("1d1d", 512, 32768, 4096)
    # too few tiles for the large-M kernels: the other backends
    assert not gemm.ptx_wins("1d1d", 576, 256, 512) and not gemm.ptx_wins("1d2d", 4096, 576, 7168)
    assert not gemm.ptx_wins("m_grouped", 64, 7168, 2048)


def test_ptx_takes_large_shapes_cublas_cannot_run(monkeypatch):
    # A Hopper device faked on CPU: cuBLAS refuses the shape (K % 512 != 0), PTX and Triton run.
    from ptxtrain import _backend
    from ptxtrain.gemm import cublas, ptx

    monkeypatch.delenv("PTXTRAIN_GEMM_BACKEND", raising=False)
    monkeypatch.setattr(cublas, "supports", lambda m, n, k, device=None: k % 512 == 0)
    monkeypatch.setattr(ptx, "supports", lambda m, n, k, device=None: k % 16 == 0)
    monkeypatch.setattr(_backend, "triton_usable", lambda device: True)
    # select_backend caches its CUDA choices: none made with the real functions may answer here,
    # and none made with these fakes may outlive the test.
    gemm._auto_cuda.cache_clear()
    monkeypatch.setattr(gemm, "_auto_cuda", functools.lru_cache(gemm._auto_cuda.__wrapped__))
    dev = torch.device("cuda")
    # the dgrad of the 2112-wide projection and a wgrad over 2112 tokens: PTX, not Triton
    assert gemm.select_backend("1d2d", 4096, 7168, 2112, dev) == "ptx"
    assert gemm.select_backend("1d1d", 7168, 2112, 2112, dev) == "ptx"
    # decode-sized 1D2D and shapes whose tiles fill the waves: PTX; the rest that cuBLAS runs
    # stays on cuBLAS
    assert gemm.select_backend("1d2d", 64, 7168, 2112, dev) == "ptx"
    assert gemm.select_backend("1d2d", 4096, 7168, 2048, dev) == "ptx"
    assert gemm.select_backend("1d1d", 7168, 2112, 4096, dev) == "ptx"
    assert gemm.select_backend("1d2d", 4096, 2112, 7168, dev) == "ptx"  # split tail
    assert gemm.select_backend("1d1d", 2048, 1536, 7168, dev) == "cublas"  # under two waves
    # a K the PTX kernels cannot take either (K % 16 != 0) falls to Triton, and so does a shape
    # with too few 128x128 tiles for the PTX kernels' large-M tiles (32 x 5 < 264)
    assert gemm.select_backend("1d2d", 4096, 7168, 2100, dev) == "triton"
    assert gemm.select_backend("1d2d", 4096, 576, 2112, dev) == "triton"


@pytest.mark.gpu
def test_auto_on_hopper_uses_fast_backends(monkeypatch):
    monkeypatch.delenv("PTXTRAIN_GEMM_BACKEND", raising=False)
    monkeypatch.delenv("PTXTRAIN_QUANT_BACKEND", raising=False)
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability() == (9, 0):
        assert gemm.select_backend("1d2d", 4096, 2112, 7168, dev) == "ptx"  # split tail
        # The PTX kernels where they measured fastest (see gemm.ptx_wins).
        assert gemm.select_backend("1d2d", 4096, 7168, 2048, dev) == "ptx"
        assert gemm.select_backend("1d1d", 7168, 2048, 4096, dev) == "ptx"
        assert gemm.select_backend("1d2d", 128, 7168, 2048, dev) == "ptx"
        assert gemm.select_backend("1d2d", 64, 7168, 16384, dev) == "ptx"
    assert gemm.select_backend("1d2d", 13, 200, 300, dev) == "triton"  # N, K not % 16: no cuBLAS
    # M % 4 != 0 (no cuBLAS), decode-sized: the PTX kernel (TMA zero-fills the tail rows)
    want = "ptx" if torch.cuda.get_device_capability() == (9, 0) else "triton"
    assert gemm.select_backend("1d2d", 13, 256, 512, dev) == want
    assert quant.select_backend(torch.ones(1, device=dev)) == "triton"
