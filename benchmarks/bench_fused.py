"""The fused training ops of :mod:`ptxtrain.nn.functional` against the unfused torch code, on a GPU.

    python -m benchmarks.bench_fused [--tokens 16384] [--dtype bfloat16] [--json OUT.json]

Per op at the ``medium`` preset's shapes (dim 2048, 16 heads, nope 128, rope 64, v 128, q_lora
1536, kv_lora 512, moe_inter 1408, dense_inter 10944): forward and forward + backward device time
of the Triton path (``kernels="triton"``) and of the torch reference (``kernels="ref"``: the
model's previous code), and the reference / fused ratio. Each result is checked against the
reference first (within two ulps of the output dtype, or 2^-17 for float32, relative to the
largest element). Timing:
``ptxtrain.bench.timing.GpuTimer`` (CUDA events, L2 flushed, launch hidden, median).
"""

from __future__ import annotations

import argparse
import json

import torch

from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.model import get_preset
from ptxtrain.model.deepseek import rope_freqs
from ptxtrain.nn import functional as fn


def _cases(tokens: int, dtype: torch.dtype) -> dict:
    """name -> (op(kernels) -> outputs, inputs that want gradients)."""
    c = get_preset("medium")
    dev = "cuda"

    def leaf(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype).requires_grad_()

    seq = 4096
    b = tokens // seq
    norm_x, norm_w = leaf(tokens, c.dim), torch.ones(c.dim, device=dev, requires_grad=True)
    lora_x = leaf(tokens, c.q_lora_rank)
    lora_w = torch.ones(c.q_lora_rank, device=dev, requires_grad=True)
    a_moe, b_moe = (
        leaf(tokens * c.n_activated_experts, c.moe_inter_dim),
        leaf(tokens * c.n_activated_experts, c.moe_inter_dim),
    )
    a_dense, b_dense = leaf(tokens, c.dense_inter_dim), leaf(tokens, c.dense_inter_dim)
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    q = leaf(b, seq, c.n_heads, qk)
    kv = leaf(b, seq, c.n_heads, c.qk_nope_head_dim + c.v_head_dim)
    kv_a = leaf(b, seq, c.kv_lora_rank + c.qk_rope_head_dim)
    freqs = rope_freqs(seq, c.qk_rope_head_dim, c.rope_theta, torch.device(dev))
    k_pe = kv_a[..., c.kv_lora_rank :]
    return {
        f"rms_norm D={c.dim}": (
            lambda k: (fn.rms_norm(norm_x, norm_w, kernels=k),),
            (norm_x, norm_w),
        ),
        f"rms_norm D={c.q_lora_rank}": (
            lambda k: (fn.rms_norm(lora_x, lora_w, kernels=k),),
            (lora_x, lora_w),
        ),
        f"swiglu routed [{tokens}x{c.n_activated_experts}, {c.moe_inter_dim}]": (
            lambda k: (fn.swiglu(a_moe, b_moe, kernels=k),),
            (a_moe, b_moe),
        ),
        f"swiglu dense [{tokens}, {c.dense_inter_dim}]": (
            lambda k: (fn.swiglu(a_dense, b_dense, kernels=k),),
            (a_dense, b_dense),
        ),
        "mla_qk": (lambda k: fn.mla_qk(q, kv, k_pe, freqs, kernels=k), (q, kv, kv_a)),
    }


def _fwd_bwd(op, leaves, kernels, grads):
    outs = op(kernels)
    return torch.autograd.grad(outs, leaves, grads)


def _check(name, op, leaves, grads) -> None:
    got = [*op("triton"), *_fwd_bwd(op, leaves, "triton", grads)]
    want = [*op("ref"), *_fwd_bwd(op, leaves, "ref", grads)]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        # fp32: Triton's exp (ex2.approx) is ~10 ulps off torch's for |a| <= 15
        bound = 2 * max(torch.finfo(w.dtype).eps, 2.0**-18) * float(w.abs().max())
        err = float((g.float() - w.float()).abs().max())
        assert err <= bound, f"{name} output {i}: max error {err:.3e} > {bound:.3e}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384, help="tokens (a multiple of 4096)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--json", help="write the rows and the environment to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_fused needs a CUDA GPU")
    if args.tokens % 4096:
        raise SystemExit(f"--tokens must be a multiple of 4096, got {args.tokens}")
    timer = GpuTimer()
    rows = []
    print(f"{'op':<40} {'pass':<8} {'fused ms':>9} {'torch ms':>9} {'ratio':>6}")
    for name, (op, leaves) in _cases(args.tokens, getattr(torch, args.dtype)).items():
        with torch.no_grad():
            grads = [torch.randn_like(o) for o in op("ref")]
        _check(name, op, leaves, grads)
        phases = {
            "fwd": lambda k, op=op: op(k),
            "fwd+bwd": lambda k, op=op, leaves=leaves, grads=grads: _fwd_bwd(op, leaves, k, grads),
        }
        for phase, run in phases.items():
            fused, ref = (timer(lambda k=k, run=run: run(k)) / 1e3 for k in ("triton", "ref"))
            rows.append(dict(op=name, phase=phase, fused_ms=fused, ref_ms=ref, ratio=ref / fused))
            print(f"{name:<40} {phase:<8} {fused:9.3f} {ref:9.3f} {ref / fused:6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(environment=environment(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
