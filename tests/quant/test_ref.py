"""Reference quantizers: scale semantics, tails, round-trip bounds, layouts, non-finite input."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ptxtrain.quant.ref import (
    AMAX_EPS,
    FP8_DTYPE,
    FP8_MAX,
    per_block_cast_back,
    per_block_cast_to_fp8,
    per_block_cast_to_fp8_both,
    per_token_cast_back,
    per_token_cast_to_fp8,
    per_token_cast_to_fp8_both,
    per_token_cast_to_fp8_t,
    to_mn_major,
)
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.testing.shapes import AWKWARD_M, AWKWARD_NK

HP = [torch.float32, torch.bfloat16, torch.float16]


def _rand(m, k, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Heavy-tailed mix of magnitudes so tiles see very different amax values.
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    return x.to(dtype)


def test_torch_fp8_cast_rounds_and_saturates():
    # The reference relies on torch's CPU cast being round-to-nearest-even and saturating
    # (docs/design.md §7), i.e. the GPU's cvt.rn.satfinite; a torch upgrade changing it fails here.
    x = torch.tensor([500.0, -1e9, float("inf"), 448.0, 17.0, 19.0, 0.0009765625 * 1.5])
    got = x.to(FP8_DTYPE).float()
    # 17 lies halfway between 16 and 18 (ties to even mantissa -> 16); 19 between 18 and 20 -> 20.
    want = torch.tensor([448.0, -448.0, 448.0, 448.0, 16.0, 20.0, 0.001953125])
    assert torch.equal(got, want), got


def _naive_scales(x, block, rows_are_tiles=True):
    """Per-tile sf by explicit loops (independent of the vectorised reference)."""
    m, k = x.shape
    out = torch.empty(m, math.ceil(k / block))
    for i in range(m):
        for j in range(out.shape[1]):
            amax = x[i, j * block : (j + 1) * block].float().abs().max().clamp(min=AMAX_EPS)
            out[i, j] = amax / FP8_MAX
    return out


@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("m", AWKWARD_M)
@pytest.mark.parametrize("k", [1, 100, 128, 257, 384])
def test_per_token_shapes_scales_and_bound(m, k, dtype):
    x = _rand(m, k, dtype, seed=m * 1000 + k)
    q, sf = per_token_cast_to_fp8(x)
    assert q.dtype == FP8_DTYPE and q.shape == (m, k) and q.is_contiguous()
    assert sf.dtype == torch.float32 and sf.shape == (m, math.ceil(k / 128)) and sf.is_contiguous()
    if m == 0:
        return
    # Scales: bit-identical to an explicit per-tile loop (same fp32 ops: amax, clamp, /448).
    assert_bitwise_equal(sf, _naive_scales(x, 128), "sf")
    # Every tile's largest element lands exactly on ±448 (the scale uses the full range).
    qf = q.float()
    tile_max = torch.nn.functional.pad(qf.abs(), (0, sf.shape[1] * 128 - k)).view(m, -1, 128)
    assert torch.all(tile_max.amax(-1) == FP8_MAX)
    # Round trip: e4m3 keeps 3 mantissa bits, so the relative error of a normal value is at most
    # 2^-4 (half an ulp); below 2^-6 (subnormals) the absolute error is at most 2^-10 * sf.
    deq = per_token_cast_back(q, sf)
    err = (deq - x.float()).abs()
    scale = sf.repeat_interleave(128, 1)[:, :k]
    bound = torch.maximum(x.float().abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert torch.all(err <= bound), f"{m=} {k=} worst excess {(err - bound).max()}"


@pytest.mark.parametrize("n,k", [*AWKWARD_NK, (256, 7168 // 16)])
@pytest.mark.parametrize("dtype", HP)
def test_per_block_shapes_and_bound(n, k, dtype):
    w = _rand(n, k, dtype, seed=n * 7 + k)
    q, sf = per_block_cast_to_fp8(w)
    assert q.shape == (n, k) and sf.shape == (math.ceil(n / 128), math.ceil(k / 128))
    # Scales from an explicit loop over blocks.
    for bi in range(sf.shape[0]):
        for bj in range(sf.shape[1]):
            blk = w[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128].float()
            want = blk.abs().max().clamp(min=AMAX_EPS) / FP8_MAX
            assert sf[bi, bj].item() == want.item(), (bi, bj)
    deq = per_block_cast_back(q, sf)
    scale = sf.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    bound = torch.maximum(w.float().abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert torch.all((deq - w.float()).abs() <= bound)


@pytest.mark.parametrize("m,k", [(1, 1), (13, 300), (300, 13), (256, 384), (0, 7)])
def test_transposed_and_both_layouts(m, k):
    x = _rand(m, k, torch.bfloat16, seed=m + k)
    xt, sft = per_token_cast_to_fp8_t(x)
    assert xt.shape == (k, m) and sft.shape == (k, math.ceil(m / 128))
    ref_q, ref_sf = per_token_cast_to_fp8(x.t().contiguous())
    assert_bitwise_equal(xt, ref_q, "xt_fp8")
    assert_bitwise_equal(sft, ref_sf, "sf_t")
    q, sf, xt2, sft2 = per_token_cast_to_fp8_both(x)
    assert_bitwise_equal(q, per_token_cast_to_fp8(x)[0], "x_fp8")
    assert_bitwise_equal(sf, per_token_cast_to_fp8(x)[1], "sf")
    assert_bitwise_equal(xt2, xt, "xt_fp8 (both)")
    assert_bitwise_equal(sft2, sft, "sf_t (both)")


def test_block_quantization_transposes_exactly():
    # Dgrad uses Wᵀ's 128x128 blocks = W's blocks transposed: same bytes, same scales.
    w = _rand(300, 200, torch.bfloat16, seed=3)
    q, sf = per_block_cast_to_fp8(w)
    qt, sft = per_block_cast_to_fp8(w.t().contiguous())
    assert_bitwise_equal(qt, q.t().contiguous(), "w_fp8ᵀ")
    assert_bitwise_equal(sft, sf.t().contiguous(), "sfᵀ")
    # ... which is what per_block_cast_to_fp8_both hands back, beside W's own.
    q2, sf2, qt2, sft2 = per_block_cast_to_fp8_both(w)
    pairs = ((q2, q, "w_fp8"), (sf2, sf, "sf"), (qt2, qt, "wt_fp8"), (sft2, sft, "sf_t"))
    for got, want, tag in pairs:
        assert_bitwise_equal(got, want, f"both: {tag}")


def test_non_contiguous_input_equals_contiguous():
    x = _rand(64, 512, torch.bfloat16, seed=11)[:, ::2]
    assert not x.is_contiguous()
    for a, b in zip(per_token_cast_to_fp8(x), per_token_cast_to_fp8(x.contiguous())):
        assert_bitwise_equal(a, b)


@pytest.mark.parametrize("fn", [per_token_cast_to_fp8, per_block_cast_to_fp8])
def test_pow2_scales(fn):
    x = _rand(200, 300, torch.float32, seed=5)
    _, sf_exact = fn(x)
    q, sf = fn(x, pow2_scale=True)
    mant, _ = torch.frexp(sf)
    assert torch.all(mant == 0.5), "every scale is a power of two"
    # Smallest power of two at or above amax/448.
    assert torch.all(sf >= sf_exact) and torch.all(sf < 2 * sf_exact)
    assert torch.all(q.float().abs() <= FP8_MAX)


def test_zero_tile_uses_amax_clamp_and_tiny_tiles_are_not_clamped():
    x = torch.zeros(3, 128)
    x[1] = 1e-7
    x[2, 5] = -3e-9
    q, sf = per_token_cast_to_fp8(x)
    # All-zero tile: the clamp keeps its scale positive, the bytes stay zero.
    assert sf[0, 0] == torch.tensor(AMAX_EPS) / FP8_MAX and not q[0].float().any()
    # Tiles far below 1 (output gradients) still stretch to ±448: the clamp is not reached.
    assert q[1].float().abs().max() == FP8_MAX and q[2].float().abs().max() == FP8_MAX


@pytest.mark.parametrize("shift", [-10, -30, -40])
@pytest.mark.parametrize("fn_name", ["row", "transposed"])
def test_quantization_is_scale_invariant_down_to_gradient_magnitudes(fn_name, shift):
    # Output gradients are a loss mean over every token of a step: tiles of ~1e-7 early in
    # training, ~1e-9 (2^-30) later. Scaling x by 2^shift must scale sf by exactly 2^shift and
    # leave the E4M3 bytes unchanged, i.e. tiny tiles keep all of E4M3's precision. (A clamp of
    # 1e-4 on the amax, DeepGEMM's test-helper value, fails this at 2^-30: the bytes drop into
    # E4M3's subnormals.)
    fns = {"row": per_token_cast_to_fp8, "transposed": per_token_cast_to_fp8_t}
    fn = fns[fn_name]
    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(-shift))
    x[::7] *= 50.0  # rows of larger gradients beside small ones, as real output gradients have
    q, sf = fn(x)
    q_small, sf_small = fn(x * 2.0**shift)
    assert_bitwise_equal(q_small.view(torch.uint8), q.view(torch.uint8), f"bytes at 2^{shift}")
    assert torch.equal(sf_small, sf * 2.0**shift)


def test_non_finite_values_surface_as_nan():
    x = _rand(3, 256, torch.float32, seed=1)
    x[0, 5] = float("nan")
    x[1, 200] = float("inf")
    x[2, 0] = -float("inf")
    q, sf = per_token_cast_to_fp8(x)
    deq = per_token_cast_back(q, sf)
    assert torch.isnan(deq[0, :128]).all() and torch.isfinite(deq[0, 128:]).all()
    assert torch.isnan(deq[1, 128:]).all() and torch.isfinite(deq[1, :128]).all()
    assert torch.isnan(deq[2, :128]).all() and torch.isfinite(deq[2, 128:]).all()


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 40),
    k=st.integers(1, 300),
    log_scale=st.floats(-20, 20),
    pow2=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_round_trip(m, k, log_scale, pow2, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 2.0**log_scale
    q, sf = per_token_cast_to_fp8(x, pow2_scale=pow2)
    assert q.shape == (m, k) and sf.shape == (m, math.ceil(k / 128))
    deq = per_token_cast_back(q, sf)
    scale = sf.repeat_interleave(128, 1)[:, :k]
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert torch.all((deq - x).abs() <= bound)
    assert torch.all(q.float().abs() <= FP8_MAX)


@pytest.mark.parametrize(
    "fn,arg,exc,match",
    [
        (
            per_token_cast_to_fp8,
            torch.ones(4, 4, dtype=torch.int32),
            TypeError,
            "x must have dtype",
        ),
        (per_token_cast_to_fp8, torch.ones(4), ValueError, "x must be 2-D"),
        (per_token_cast_to_fp8, torch.ones(2, 4, 4), ValueError, "x must be 2-D"),
        (per_token_cast_to_fp8, [[1.0]], TypeError, "x must be a torch.Tensor"),
        (per_token_cast_to_fp8_t, torch.ones(4, 4, dtype=torch.float64), TypeError, "float64"),
        (per_block_cast_to_fp8, torch.ones(4, 4).to(FP8_DTYPE), TypeError, "w must have dtype"),
        (per_block_cast_to_fp8, torch.ones(3), ValueError, "w must be 2-D"),
    ],
)
def test_bad_input(fn, arg, exc, match):
    with pytest.raises(exc, match=match):
        fn(arg)


def test_bad_block_and_scale_shapes():
    with pytest.raises(ValueError, match="block must be a positive int"):
        per_token_cast_to_fp8(torch.ones(2, 2), block=0)
    q, sf = per_token_cast_to_fp8(torch.randn(4, 300))
    with pytest.raises(ValueError, match=r"x_sf must have shape \(4, 3\)"):
        per_token_cast_back(q, sf[:, :2])
    with pytest.raises(TypeError, match="x_sf must have dtype float32"):
        per_token_cast_back(q, sf.double())
    wq, wsf = per_block_cast_to_fp8(torch.randn(300, 300))
    with pytest.raises(ValueError, match=r"w_sf must have shape \(3, 3\)"):
        per_block_cast_back(wq, wsf[:2])
    # A bad block of the dequantizers, and a scale tensor to_mn_major cannot lay out.
    with pytest.raises(ValueError, match="block must be a positive int, got 0"):
        per_token_cast_back(q, sf, 0)
    with pytest.raises(ValueError, match="block must be a positive int, got -128"):
        per_block_cast_back(wq, wsf, -128)
    with pytest.raises(ValueError, match=r"sf must be 2-D, got shape \(3,\)"):
        to_mn_major(torch.ones(3))
    with pytest.raises(TypeError, match="sf must have dtype float32"):
        to_mn_major(sf.double())


@pytest.mark.gpu
@pytest.mark.parametrize("m,k", [(4096, 7168), (4096, 2112), (13, 576), (1, 300)])
def test_reference_on_cuda_matches_cpu_bitwise(m, k):
    # The same reference ops on CUDA must produce the CPU's bits: CUDA's fp32 division is IEEE and
    # its e4m3 cast is RNE + saturating like torch's CPU cast (docs/design.md §7).
    x = _rand(m, k, torch.bfloat16, seed=m + k)
    for fn in (per_token_cast_to_fp8, per_token_cast_to_fp8_t, per_block_cast_to_fp8):
        for pow2 in (False, True):
            cpu = fn(x, pow2_scale=pow2)
            gpu = fn(x.cuda(), pow2_scale=pow2)
            for name, c, g in zip(("fp8", "sf"), cpu, gpu):
                assert_bitwise_equal(g.cpu(), c, f"{fn.__name__} {name} {m=} {k=} {pow2=}")
