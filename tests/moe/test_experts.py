"""Stacked-weight routed experts (``Experts``) vs a ModuleList of SwiGLU MLPs with equal weights."""

from __future__ import annotations

import importlib.util
import warnings

import pytest
import torch
from torch import nn

from ptxtrain.model import build_model, get_preset
from ptxtrain.model.deepseek import convert_model_to_fp8_training
from ptxtrain.moe.experts import Experts
from ptxtrain.moe.layer import MLP
from ptxtrain.nn import Fp8Linear
from ptxtrain.testing import sqnr_db


def _mlps_like(experts: Experts) -> nn.ModuleList:
    """One MLP per local expert holding copies of its stacked weights."""
    mlps = nn.ModuleList(
        MLP(experts.dim, experts.inter_dim) for _ in range(experts.num_local_experts)
    ).to(experts.w1.dtype)
    with torch.no_grad():
        for e, mlp in enumerate(mlps):
            mlp.w1.weight.copy_(experts.w1[e])
            mlp.w3.weight.copy_(experts.w3[e])
            mlp.w2.weight.copy_(experts.w2[e])
    return mlps


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_modulelist_of_mlps_bitwise(dtype):
    torch.manual_seed(3)
    experts = Experts(6, 40, 24).to(dtype)
    mlps = _mlps_like(experts)
    counts = torch.tensor([5, 0, 9, 1, 0, 7])  # experts 1 and 4 get no rows
    x = torch.randn(int(counts.sum()), 40, dtype=dtype, requires_grad=True)
    dy = torch.randn(x.shape[0], 40, dtype=dtype)
    y = experts(x, counts)
    # The counts as host ints (an EP dispatch's list): the same call without reading a tensor.
    assert torch.equal(experts(x, counts.tolist()), y)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = torch.cat([m(r) for m, r in zip(mlps, x2.split(counts.tolist()), strict=True)])
    # The same F.linear calls on the same values: bit-identical forward and backward.
    assert y.dtype == dtype and torch.equal(y, y2)
    (y * dy).sum().backward()
    (y2 * dy).sum().backward()
    assert torch.equal(x.grad, x2.grad)
    for name in ("w1", "w3", "w2"):
        got = getattr(experts, name).grad
        want = torch.stack([getattr(m, name).weight.grad for m in mlps])
        assert torch.equal(got, want), name
    # An expert that ran on 0 rows has a zero (not a missing) gradient.
    assert experts.w1.grad[1].abs().sum() == 0 and experts.w1.grad[0].abs().sum() > 0


def test_init_like_nn_linear_and_keep_experts():
    torch.manual_seed(0)
    experts = Experts(8, 64, 16)
    # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) per projection.
    for name, fan_in in (("w1", 64), ("w3", 64), ("w2", 16)):
        w = getattr(experts, name)
        bound = fan_in**-0.5
        assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound, name
        assert w.std() > 0.5 * bound / 3**0.5, name  # not degenerate (uniform std = b/sqrt(3))
    full = {n: p.detach().clone() for n, p in experts.named_parameters()}
    experts.keep_experts_(4, 2)
    experts.keep_experts_(1, 1)  # relative to what is held: global expert 5
    assert (experts.num_experts, experts.num_local_experts, experts.expert_offset) == (8, 1, 5)
    for n, p in experts.named_parameters():
        assert torch.equal(p, full[n][5:6]) and p.is_leaf and p.requires_grad, n
    assert "local=[5, 6)" in repr(experts)
    with pytest.raises(ValueError, match="range"):
        experts.keep_experts_(0, 2)


def test_bad_arguments():
    experts = Experts(4, 8, 4)
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        experts(x, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="sum to x's 6 rows"):
        experts(x, torch.tensor([1, 2, 3, 1]))
    with pytest.raises(ValueError, match=">= 0"):
        experts(x, torch.tensor([-1, 4, 2, 1]))
    with pytest.raises(TypeError, match="tokens_per_expert"):
        experts(x, torch.tensor([1.0, 2.0, 3.0, 0.0]))
    # Host counts: the same checks, and ints only.
    with pytest.raises(ValueError, match=r"tokens_per_expert must be \[4\].*got \(3,\)"):
        experts(x, [1, 2, 3])
    with pytest.raises(ValueError, match="sum to x's 6 rows"):
        experts(x, (1, 2, 3, 1))
    with pytest.raises(TypeError, match="sequence of ints"):
        experts(x, [1, 2, 3.0, 0])
    with pytest.raises(TypeError, match="sequence of ints"):
        experts(x, [True, 2, 3, 0])
    with pytest.raises(ValueError, match=r"x must be \[N, 8\]"):
        experts(torch.randn(6, 7), torch.tensor([1, 2, 3, 0]))
    with pytest.raises(TypeError, match="x"):
        experts(torch.ones(6, 8, dtype=torch.int64), torch.tensor([1, 2, 3, 0]))
    # A float x of another dtype than the weights: named, not torch's "m1 and m2" error.
    with pytest.raises(TypeError, match=r"x must have the experts' dtype torch\.float32"):
        experts(x.bfloat16(), torch.tensor([1, 2, 3, 0]))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts both operands: allowed
        assert experts(x.bfloat16(), torch.tensor([1, 2, 3, 0])).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="num_experts"):
        Experts(0, 8, 4)


def test_model_fp8_conversion_switches_the_experts():
    cfg = type(get_preset("tiny")).from_dict({**get_preset("tiny").to_dict(), "mtp_depth": 0})
    model = build_model(cfg, dtype=torch.bfloat16, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_model_to_fp8_training(model)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert len(experts) == cfg.n_moe_layers
    have_grouped = importlib.util.find_spec("ptxtrain.nn.fp8_grouped") is not None
    assert all(m.fp8 == have_grouped for m in experts)
    assert all(m.fp8_config.recipe_name == "deepseek" for m in experts if m.fp8)
    assert any("fp8_grouped" in str(w.message) for w in caught) != have_grouped
    assert isinstance(model.layers[1].ffn.shared_experts.w1, Fp8Linear)
    assert not isinstance(model.head, Fp8Linear)
    # The "bf16" recipe runs no GEMM in FP8: nothing changes.
    plain = build_model(cfg, dtype=torch.bfloat16, seed=0)
    convert_model_to_fp8_training(plain, "bf16")
    assert not any(isinstance(m, Fp8Linear) for m in plain.modules())
    assert not any(m.fp8 for m in plain.modules() if isinstance(m, Experts))


def test_fp8_path_against_the_reference():
    # Skipped only while ptxtrain/nn/fp8_grouped.py (written in parallel) is absent.
    pytest.importorskip("ptxtrain.nn.fp8_grouped")
    torch.manual_seed(1)
    experts = Experts(4, 256, 128).to(torch.bfloat16)
    ref = Experts(4, 256, 128)
    with torch.no_grad():
        for n, p in ref.named_parameters():
            p.copy_(getattr(experts, n).float())
    experts.fp8 = True
    counts = torch.tensor([130, 0, 64, 62])
    x = torch.randn(256, 256)
    dy = torch.randn(256, 256)
    xa = x.bfloat16().requires_grad_(True)
    y = experts(xa, counts)
    (y.float() * dy).sum().backward()
    xb = x.clone().requires_grad_(True)
    y_ref = ref(xb, counts)
    (y_ref * dy).sum().backward()
    # FP8 E4M3 with 1x128 / 128x128 scales through three chained GEMMs: like the Fp8Linear
    # tests, judged by SQNR; 20 dB is far above what a wrong expert slice or a missing scale
    # gives (≈ 0 dB) and below the ~25-30 dB the recipe reaches on Gaussian data.
    for name, a, b in (
        ("y", y_ref, y),
        ("dx", xb.grad, xa.grad),
        ("dw1", ref.w1.grad, experts.w1.grad),
        ("dw2", ref.w2.grad, experts.w2.grad),
    ):
        s = sqnr_db(a.detach(), b.detach().float())
        assert s >= 20, f"{name}: {s=:.1f} dB"


def test_fp8_weight_cache_sees_fused_optimizer_steps_with_the_hooks():
    # torch's fused optimizers update the stacked weights in place without bumping their version
    # counter: with register_fp8_cache_hooks the cached 128x128 quantization is still dropped.
    pytest.importorskip("ptxtrain.nn.fp8_grouped")
    import dataclasses

    from ptxtrain.nn import Fp8LinearConfig, register_fp8_cache_hooks

    torch.manual_seed(2)
    experts = Experts(2, 128, 128)
    experts.fp8 = True
    counts = torch.tensor([70, 58])
    x = torch.randn(128, 128)
    opt = torch.optim.AdamW(experts.parameters(), lr=0.1, fused=True)
    register_fp8_cache_hooks(opt)
    experts(x, counts).square().sum().backward()
    version, before = experts.w1._version, experts.w1.detach().clone()
    opt.step()
    assert not torch.equal(experts.w1.detach(), before)  # the step changed the weights ...
    assert experts.w1._version > version  # ... and the hook told the version counter
    got = experts(x, counts)
    experts.fp8_config = dataclasses.replace(
        Fp8LinearConfig.from_recipe_name("deepseek"), cache_weight_fp8=False
    )
    want = experts(x, counts)  # quantized afresh from the stepped weights
    assert torch.equal(got, want)
