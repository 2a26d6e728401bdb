"""Which 128x128 scale layouts does torch._scaled_mm blockwise get right? (K-block padding)."""

import torch

from ptxtrain.quant.ref import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff

for m, n, k in [
    (64, 2112, 7168),
    (128, 576, 7168),
    (64, 384, 512),
    (64, 128, 768),
    (64, 208, 512),
    (64, 768, 128),
    (256, 2304, 256),
    (4096, 7168, 2048),
]:
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(n, k, device="cuda")
    (qa, sa), (qb, sb) = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    want = x.double() @ w.double().t()
    sa_mn = sa.t().contiguous().t()
    nb, kb = sb.shape
    kb4 = (kb + 3) // 4 * 4
    pad = torch.zeros(nb, kb4, device="cuda")
    pad[:, :kb] = sb
    out = {}
    for name, s_b in (("plain", sb.t()), ("pad_view", pad[:, :kb].t())):
        try:
            d = torch._scaled_mm(qa, qb.t(), sa_mn, s_b, out_dtype=torch.bfloat16)
            out[name] = f"{calc_diff(d, want):.2e}"
        except RuntimeError as e:
            out[name] = "ERR " + str(e).splitlines()[0][:80]
    print(m, n, k, out, flush=True)
