"""Diagnose FP8 Linear on GPU: every backend combination over MoE-like shapes; report NaN/diff."""

import itertools
import os

import torch

from ptxtrain.nn import Fp8Linear
from ptxtrain.testing import calc_diff

SHAPES = [
    (m, n, k)
    for m in (0, 1, 3, 13, 64, 517, 2048)
    for n, k in ((128, 768), (768, 128), (384, 768), (2304, 256), (256, 768))
]
bad = []
for qb, gb in itertools.product(("ref", "triton"), ("ref", "auto", "triton")):
    os.environ["PTXTRAIN_QUANT_BACKEND"] = qb
    os.environ["PTXTRAIN_GEMM_BACKEND"] = gb
    worst = 0.0
    for m, n, k in SHAPES:
        torch.manual_seed(m + n + k)
        lin = Fp8Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        y = lin(x)
        y.backward(dy)
        w = lin.weight.detach().float()
        ry, rdx, rdw = (
            x.detach().float() @ w.t(),
            dy.float() @ w,
            dy.float().t() @ x.detach().float(),
        )
        for name, got, ref in (("y", y, ry), ("dx", x.grad, rdx), ("dw", lin.weight.grad, rdw)):
            finite = bool(torch.isfinite(got).all())
            d = calc_diff(got.float(), ref) if m else 0.0
            worst = max(worst, d if finite else 9.0)
            if not finite or d > 2e-3:
                bad.append((qb, gb, m, n, k, name, finite, d))
    print(f"quant={qb:6} gemm={gb:6} worst calc_diff {worst:.2e}", flush=True)
for b in bad[:40]:
    print("BAD", b)
print("n_bad", len(bad))
