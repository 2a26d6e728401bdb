"""Gradient-accumulation fusion: the FP8 wgrad GEMMs write into the fused AdamW's FP32
``main_grad`` (``D =`` on the first micro-batch after ``zero_grad``, ``D +=`` after), so no
weight-dtype gradient, cast or hook pass is made. Checked on the CPU (the reference GEMMs, the
optimizer's torch path) against the GEMM outputs summed in FP32.
"""

from __future__ import annotations

import torch

from ptxtrain.gemm import ref as gemm_ref
from ptxtrain.moe import Experts
from ptxtrain.moe.grouped_layout import build_grouped_layout, scatter_to_layout
from ptxtrain.nn import Fp8Linear
from ptxtrain.optim import AdamW, GradInBuffer, grad_ready
from ptxtrain.quant.ref import per_token_cast_to_fp8_t


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _wgrad(dy, x):
    """The FP8 1D1D wgrad GEMM's FP32 result for ``dW = dyᵀ x`` (128x1 tiles along tokens)."""
    return gemm_ref.fp8_gemm_nt_1d1d(per_token_cast_to_fp8_t(dy), per_token_cast_to_fp8_t(x))


def test_fp8_linear_writes_then_adds_into_main_grad():
    lin = Fp8Linear(256, 384, bias=False, dtype=torch.bfloat16)
    opt = AdamW(lin.parameters(), fused=True)
    w = lin.weight
    assert w.main_grad.shape == w.shape and not grad_ready(w)
    w.main_grad.fill_(1e9)  # stale values a first micro-batch must overwrite, not add to
    xs = [torch.randn(200, 256, generator=_gen(i)).bfloat16().requires_grad_() for i in (1, 2)]
    gs = [torch.randn(200, 384, generator=_gen(i)).bfloat16() for i in (3, 4)]
    want = torch.zeros(384, 256)
    for x, g in zip(xs, gs, strict=True):
        lin(x).backward(g)
        want += _wgrad(g, x.detach())
        assert isinstance(w.grad, GradInBuffer) and grad_ready(w)
    # The GEMM adds in FP32 (the reference: dequantize, FP32 matmul, add): the same two terms
    # summed in the same order, so the buffer holds exactly their sum.
    assert torch.equal(w.main_grad, want)
    assert torch.equal(opt.grad_for(w), want)
    opt.step()
    opt.zero_grad()
    assert not grad_ready(w)
    lin(xs[0]).backward(gs[0])
    assert torch.equal(w.main_grad, _wgrad(gs[0], xs[0].detach()))  # overwritten after zero_grad


def test_fp8_experts_write_into_main_grad():
    torch.manual_seed(0)
    t, k, e, d, inter = 40, 2, 4, 256, 128
    experts = Experts(e, d, inter).bfloat16()
    experts.fp8 = True
    plain = Experts(e, d, inter).bfloat16()
    plain.load_state_dict(experts.state_dict())
    plain.fp8 = True
    opt = AdamW(experts.parameters(), fused=True)  # plain keeps autograd's .grad
    idx = torch.rand(t, e, generator=_gen(5)).topk(k, dim=1).indices
    lay = build_grouped_layout(idx, e, 128)
    x = torch.randn(t, d, generator=_gen(6)).bfloat16()
    g = torch.randn(lay.rows, d, generator=_gen(7)).bfloat16()
    for mod in (experts, plain):
        mod.forward_layout(scatter_to_layout(x, lay), lay).backward(g)
    for name in ("w1", "w2", "w3"):
        fused_w, plain_w = getattr(experts, name), getattr(plain, name)
        assert isinstance(fused_w.grad, GradInBuffer) and grad_ready(fused_w)
        # autograd's gradient is the same FP32 GEMM result rounded to the weight's BF16
        assert torch.equal(fused_w.main_grad.bfloat16(), plain_w.grad), name
    opt.zero_grad()
