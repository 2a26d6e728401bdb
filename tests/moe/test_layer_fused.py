"""The MoE layer on the Triton kernels (ptxtrain.moe.fused) vs the reference path, and the FP8
expert-parallel dispatch on gloo ranks vs the single-process layer.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` with the interpreter patch
(tests/conftest.py), exactly as in tests/moe/test_kernels.py, whose ``runnable`` marker and token
generator are reused here. The expert-parallel case runs on spawned gloo processes (no interpreter
patch there) and uses the reference kernels, the CPU default.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

pytest.importorskip("triton")

from ptxtrain.ep.buffer import Buffer
from ptxtrain.moe import MoE, fused
from ptxtrain.moe.ref import permute_ref, unpermute_ref
from ptxtrain.quant.ref import FP8_DTYPE
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.testing.triton_interp import patch_applied
from tests._host_reads import forward_backward_reads
from tests._spawn import run_gloo
from tests.moe.test_kernels import DEVICE, INTERPRETED, _tokens, runnable

DIM, INTER, E, K = 32, 24, 8, 3


def _pair(dtype, *, alpha=1e-2, **kw):
    """(ref-kernel layer, Triton-kernel layer) with equal weights: E = 8 in 4 groups, 2 kept,
    top-3, route_scale 2.5, random selection biases (so the bias path is exercised)."""
    torch.manual_seed(0)
    args = dict(n_shared_experts=1, n_groups=4, n_limited_groups=2, route_scale=2.5)
    args.update(kw)
    ref = MoE(DIM, INTER, E, K, seq_aux_loss_alpha=alpha, kernels="ref", **args)
    with torch.no_grad():
        ref.router.bias.copy_(torch.randn(E) * 0.1)
    ref = ref.to(dtype=dtype, device=DEVICE).train()
    tri = copy.deepcopy(ref)
    tri.kernels = "triton"
    return ref, tri


def _run(moe, x, g):
    """Forward + backward of ``<y, g> + aux``; returns y, aux, dx and every parameter's grad."""
    x = x.clone().requires_grad_(True)
    y, aux = moe(x, return_aux_loss=True)
    loss = (y.float() * g.float()).sum()
    if aux is not None:
        loss = loss + aux
    loss.backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return y, aux, x.grad, grads


# Tolerances of the gradients (the forward is bitwise, see below), relative to the tensor's
# largest magnitude. Only the router weight's gradient takes another path than the reference's
# autograd: _RouteFn's hand-written backward of the gate normalization groups the same fp32
# products differently (observed: 1 fp32 ulp, 1.2e-7 on values ~0.9). Everything downstream of
# the router (dx through the logits GEMM) inherits that. Expert and shared-expert gradients
# come out bitwise here (same ops, same order), but are allowed the same few-ulp budget so the
# test does not pin an accident of the CPU summation order. fp32: 1e-5 (~80 ulp of the max,
# still 1e4 below a wrong gate derivative, which is O(1) relative). bf16: the layer's backward
# rounds its [N, D] gradients to bf16 (2^-8 relative); one rounding step of the largest
# element: 1e-2.
GRAD_RTOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _close(name, got, want, rtol):
    assert got is not None and want is not None, f"{name}: a gradient is missing"
    assert got.shape == want.shape and got.dtype == want.dtype, name
    scale = max(float(want.float().abs().max()), 1e-30) if want.numel() else 1.0
    err = float((got.float() - want.float()).abs().max()) if want.numel() else 0.0
    assert err <= rtol * scale, f"{name}: max error {err:.3e} > {rtol:.0e} x {scale:.3e}"


@runnable
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "alpha"), [((2, 7, DIM), 1e-2), ((1, 1, DIM), 0.0), ((0, DIM), 1e-2)]
)
def test_layer_triton_matches_reference(dtype, shape, alpha):
    ref, tri = _pair(dtype, alpha=alpha)
    n = shape[0] * shape[1] if len(shape) == 3 else shape[0]
    x = _tokens(n, DIM, torch.float32, 5).view(shape).to(dtype=dtype, device=DEVICE)
    g = _tokens(n, DIM, torch.float32, 6).view(shape).to(dtype=dtype, device=DEVICE)
    y_r, aux_r, dx_r, p_r = _run(ref, x, g)
    y_t, aux_t, dx_t, p_t = _run(tri, x, g)
    where = f"{dtype=}, {shape=}"
    rtol = GRAD_RTOL[dtype]
    # Forward: bitwise on the CPU. The logits GEMM is the same torch op, fused_route and
    # unpermute_weighted are bitwise twins of route_from_logits_ref / unpermute_ref on the CPU,
    # and the permutation gather is the reference's own. On a GPU the reference's index_add adds
    # the k = 3 slots with atomics in a varying order: a few ulps, within the gradient budget.
    if INTERPRETED:
        assert_bitwise_equal(y_t, y_r, name=f"y ({where})")
    else:
        _close(f"y ({where})", y_t, y_r, rtol)
    assert torch.equal(tri.router.expert_counts, ref.router.expert_counts), where
    assert (aux_t is None) == (aux_r is None), where
    if aux_r is not None:
        assert_bitwise_equal(aux_t.detach(), aux_r.detach(), name=f"aux ({where})")
    _close(f"dx ({where})", dx_t, dx_r, rtol)
    for name, want in p_r.items():
        _close(f"{name} ({where})", p_t[name], want, rtol)
    if n > 0:  # the gates carry a gradient to the router weight, as in the reference
        assert float(p_t["router.weight"].abs().max()) > 0, where


@runnable
@pytest.mark.parametrize(("n_tokens", "k"), [(13, 4), (1, 2), (0, 3)])
def test_fused_permutation_functions_match_reference_autograd(n_tokens, k):
    # Duplicate experts within a row (each slot is its own row) and an idle expert.
    gen = torch.Generator().manual_seed(n_tokens + k)
    n_experts, dim = 5, 40
    idx = torch.randint(0, n_experts - 1, (n_tokens, k), generator=gen)  # expert 4 idle
    if n_tokens > 0:
        idx[0, 1] = idx[0, 0]
    x = _tokens(n_tokens, dim, torch.float32, 7)
    w = torch.rand(n_tokens, k, generator=gen)
    g = torch.randn(n_tokens, dim, generator=gen)
    mix = torch.randn(n_tokens * k, dim, generator=gen)  # a stand-in expert: y = x_perm ⊙ mix

    def run(permute, unpermute):
        xx = x.clone().to(DEVICE).requires_grad_(True)
        ww = w.clone().to(DEVICE).requires_grad_(True)
        x_perm, slots, counts = permute(xx, idx.to(DEVICE), n_experts)
        out = unpermute(x_perm * mix.to(DEVICE), slots, ww)
        (out * g.to(DEVICE)).sum().backward()
        return out, slots, counts, xx.grad, ww.grad

    got = run(fused.permute_fused, fused.unpermute_fused)
    want = run(permute_ref, unpermute_ref)
    names = ("out", "sorted_slots", "tokens_per_expert", "dx", "dw")
    # Bitwise on the CPU, fp32: the forward kernels are the references' twins; the backward
    # gather-sum adds a token's k rows in ascending row order in fp32 (as CPU index_add does),
    # and the weight gradient's row dot products are the reference graph's own ops. On a GPU
    # the reference's index_add uses atomics (varying order): the fp32 budget of GRAD_RTOL.
    for name, a, b in zip(names, got, want, strict=True):
        if INTERPRETED or not a.is_floating_point():
            assert_bitwise_equal(a.cpu(), b.cpu(), name=f"{name} ({n_tokens=}, {k=})")
        else:
            _close(f"{name} ({n_tokens=}, {k=})", a, b, GRAD_RTOL[torch.float32])


@runnable
@pytest.mark.parametrize(("n_tokens", "k"), [(13, 4), (9, 2), (0, 3)])
def test_valid_rows_only_equal_the_full_permutation(n_tokens, k):
    # An EP rank's slots of other ranks' experts go to the last ("spill") expert: with
    # num_valid the permutation copies only the rows before them and the combine skips their
    # slots. Against the full permutation whose spill rows are zero, fused and reference:
    # the same values (bitwise; zeros compared by value), the same gradients, 0 for the spill
    # slots' weights. Token 0 sends every slot to the spill expert (it gets back zeros).
    gen = torch.Generator().manual_seed(n_tokens * 7 + k)
    n_experts, dim = 5, 40  # expert 4 is the spill
    idx = torch.randint(0, n_experts, (n_tokens, k), generator=gen)
    if n_tokens > 0:
        idx[0] = n_experts - 1
    n_valid = int((idx < n_experts - 1).sum())
    x = _tokens(n_tokens, dim, torch.float32, 8)
    w = torch.rand(n_tokens, k, generator=gen) * (idx < n_experts - 1)  # 0 on spill slots
    g = torch.randn(n_tokens, dim, generator=gen)
    mix = torch.randn(n_tokens * k, dim, generator=gen)

    def run(permute, unpermute, valid):
        xx = x.clone().to(DEVICE).requires_grad_(True)
        ww = w.clone().to(DEVICE).requires_grad_(True)
        if valid:
            x_v, slots, _ = permute(xx, idx.to(DEVICE), n_experts, num_valid=n_valid)
            out = unpermute(x_v * mix[:n_valid].to(DEVICE), slots, ww, num_valid=n_valid)
        else:
            x_perm, slots, _ = permute(xx, idx.to(DEVICE), n_experts)
            keep = (torch.arange(n_tokens * k) < n_valid).unsqueeze(1).to(DEVICE)
            out = unpermute(x_perm * mix.to(DEVICE) * keep, slots, ww)
        (out * g.to(DEVICE)).sum().backward()
        return [t.detach().cpu() + 0.0 for t in (out, xx.grad, ww.grad)]

    want = run(permute_ref, unpermute_ref, valid=False)
    for name, fns in (("reference", (permute_ref, unpermute_ref)),
                      ("fused", (fused.permute_fused, fused.unpermute_fused))):  # fmt: skip
        got = run(*fns, valid=True)
        for what, a, b in zip(("out", "dx", "dw"), got, want, strict=True):
            if INTERPRETED or name == "reference":
                assert_bitwise_equal(a, b, name=f"{name} {what} ({n_tokens=}, {k=})")
            else:  # the GPU reference's index_add sums in a varying order
                _close(f"{name} {what}", a, b, GRAD_RTOL[torch.float32])
        if n_tokens:
            assert not got[0][0].any() and not got[2][0].any()  # all-spill token: 0, dw 0


def test_num_valid_errors():
    x, idx = torch.randn(4, 8), torch.tensor([[0, 1], [1, 2], [2, 0], [1, 1]])
    with pytest.raises(ValueError, match=r"num_valid must be in \[0, T·k = 8\], got 9"):
        permute_ref(x, idx, 3, num_valid=9)
    with pytest.raises(TypeError, match="num_valid must be an int"):
        permute_ref(x, idx, 3, num_valid=2.0)
    _, slots, _ = permute_ref(x, idx, 3)
    w = torch.rand(4, 2)
    with pytest.raises(ValueError, match=r"y_permuted must be \[T·k or num_valid, D\] = \[5, D\]"):
        unpermute_ref(torch.randn(6, 8), slots, w, num_valid=5)


def test_kernel_choice():
    x = torch.randn(4, DIM)
    assert not fused.use_triton_kernels("auto", x)  # CPU: the reference, whatever TRITON_INTERPRET
    assert not fused.use_triton_kernels("ref", x)
    assert fused.use_triton_kernels("triton", x)
    with pytest.raises(TypeError, match="float64"):
        fused.use_triton_kernels("triton", x.double())
    with pytest.raises(ValueError, match="kernels"):
        fused.use_triton_kernels("fast", x)
    moe = MoE(DIM, INTER, E, K)
    assert moe.kernels == "auto" and moe.fp8_dispatch
    with pytest.raises(ValueError, match="kernels must be one of"):
        moe.kernels = "cuda"
    with pytest.raises(ValueError, match="kernels must be one of"):
        MoE(DIM, INTER, E, K, kernels="fused")


# ---------------------------------------------------------------------------- FP8 dispatch
FP8_DIM, FP8_INTER = 256, 128  # two 1x128 tiles per token row


def _fp8_case(world):
    """The float32 FP8-expert layer, the ranks' inputs and cotangents."""
    torch.manual_seed(3)
    moe = MoE(FP8_DIM, FP8_INTER, E, K, n_shared_experts=1, n_groups=4, n_limited_groups=2)
    moe.experts.fp8 = True  # what convert_model_to_fp8_training sets (deepseek recipe)
    moe.train()
    xs, gs = [], []
    for r in range(world):
        b = 5 + 3 * r  # uneven token counts per rank
        xs.append(_tokens(b, FP8_DIM, torch.float32, 40 + r))
        gs.append(_tokens(b, FP8_DIM, torch.float32, 50 + r))
    return moe, xs, gs


def _fp8_dispatch_worker(rank: int, world: int, with_triton: bool) -> None:
    import os

    from ptxtrain.testing.numeric import sqnr_db

    # This spawned process inherits TRITON_INTERPRET=1 but not the conftest's interpreter patch:
    # run the grouped FP8 GEMMs on their (same-semantics, much faster) references.
    os.environ["PTXTRAIN_GEMM_BACKEND"] = "ref"
    if with_triton:  # the routing / permutation kernels: interpreted, with the patch
        from ptxtrain.testing.triton_interp import apply_interpreter_patch

        apply_interpreter_patch()
    ref, xs, gs = _fp8_case(world)
    ep = copy.deepcopy(ref)
    ep.enable_expert_parallel()
    hp = copy.deepcopy(ep)
    hp.fp8_dispatch = False  # same EP layer, activation-dtype dispatch
    layers = {"fp8": ep, "hp": hp}
    if with_triton:  # the FP8-dispatch EP layer on the Triton routing / permutation kernels
        layers["fp8 triton"] = copy.deepcopy(ep)
        layers["fp8 triton"].kernels = "triton"

    seen = []
    orig = Buffer.dispatch

    def spy(self, x, *args, **kw):
        seen.append(tuple(t.dtype for t in x) if isinstance(x, tuple) else (x.dtype,))
        return orig(self, x, *args, **kw)

    Buffer.dispatch = spy
    try:
        outs = {}
        for name, layer in layers.items():
            x = xs[rank].clone().requires_grad_(True)
            y, n_fwd, n_bwd, reads = forward_backward_reads(
                functools.partial(layer, x), lambda out: (out * gs[rank]).sum().backward()
            )
            # One host read (a sync on a GPU) per layer: the dispatch's split sizes and rows
            # per expert; the FP8 experts, the permutation and backward read nothing.
            assert (n_fwd, n_bwd) == (1, 0), (name, reads)
            outs[name] = (y.detach(), x.grad)
    finally:
        Buffer.dispatch = orig
    # The FP8 layer sent (e4m3, fp32 scales); the other one the activations.
    fp8_sent, hp_sent = (FP8_DTYPE, torch.float32), (torch.float32,)
    assert seen == [fp8_sent, hp_sent] + [fp8_sent] * with_triton, seen
    if with_triton:
        # Same ops but the kernels (bitwise twins on the CPU) and the backward of fused.py.
        y_tri, dx_tri = outs["fp8 triton"]
        assert_bitwise_equal(y_tri, outs["fp8"][0], name=f"EP triton y ({rank=})")
        _close(f"EP triton dx ({rank=})", dx_tri, outs["fp8"][1], GRAD_RTOL[torch.float32])
        for name, p in layers["fp8 triton"].named_parameters():
            want = dict(ep.named_parameters())[name].grad
            _close(f"EP triton {name} ({rank=})", p.grad, want, GRAD_RTOL[torch.float32])

    x_all = torch.cat(xs).requires_grad_(True)
    y_all = ref(x_all)
    (y_all * torch.cat(gs)).sum().backward()
    lo = sum(t.shape[0] for t in xs[:rank])
    mine = slice(lo, lo + xs[rank].shape[0])

    # Bars, as SQNR (ptxtrain.testing.numeric.sqnr_db); the FP8 recipe itself sits ~30 dB from
    # the fp32 layer, so ~30 dB is what one extra, independent FP8 rounding of an operand costs.
    # - FP8 vs activation-dtype dispatch of the same EP layer, y and dx, 100 dB: the experts
    #   re-quantize the dequantized rows 1x128 on the same tiles. Those rows sit on the e4m3 grid
    #   up to the fp32 rounding of the dequantization (2^-24 relative, far inside half an e4m3
    #   step), so the same e4m3 values come back, with scales at most an ulp (~2^-23, 138 dB)
    #   apart. Observed: identical. Dequantizing with wrong scales or tiles would give ≤ 30 dB.
    # - Either EP layer vs the single process, y and dx, 80 dB: fp32 summation order (partial
    #   sums per rank, then the combine) moves the expert intermediates by ulps, which can flip
    #   an e4m3 rounding of an element inside the FP8 GEMMs (observed 128 dB); 80 dB still fails
    #   on a missing or double-counted row or a wrong gate (< 20 dB).
    # - experts' w1 / w3 gradients, 24 dB: Wgrad quantizes its input 128x1 along the tokens; with
    #   FP8 dispatch that input was already rounded 1x128 on the sender, so it carries two
    #   independent FP8 roundings instead of one (report §3.5 describes the same
    #   dequantize-transpose-requantize step): observed 30 dB. 24 dB still fails a wrong expert
    #   slice or a missing scale (≈ 0 dB).
    # - w2's gradient, 80 dB: its operands (h, dy) are the single process's up to fp32 order
    #   (observed 138 dB).
    y_hp, dx_hp = outs["hp"]
    y_fp8, dx_fp8 = outs["fp8"]
    bars = {
        "y vs activation-dtype dispatch": (y_hp, y_fp8, 100),
        "dx vs activation-dtype dispatch": (dx_hp, dx_fp8, 100),
        "y": (y_all[mine].detach(), y_fp8, 80),
        "dx": (x_all.grad[mine], dx_fp8, 80),
        "y (activation-dtype dispatch)": (y_all[mine].detach(), y_hp, 80),
        "dx (activation-dtype dispatch)": (x_all.grad[mine], dx_hp, 80),
    }
    per = E // world
    for name, bar in (("w1", 24), ("w3", 24), ("w2", 80)):
        want = getattr(ref.experts, name).grad[rank * per : (rank + 1) * per]
        bars[f"experts.{name}.grad"] = (want, getattr(ep.experts, name).grad, bar)
    for name, (want, got, bar) in bars.items():
        assert got is not None and torch.isfinite(got).all(), f"{rank=} {name}: not finite"
        s = sqnr_db(want, got)
        assert s >= bar, f"{rank=} {name}: SQNR {s:.1f} dB < {bar} dB"
    # The replicated parameters (router, shared experts) see the unquantized local tokens:
    # their gradients summed over ranks are the single process's up to fp32 order.
    for name, p in ep.named_parameters():
        if name.startswith("experts."):
            continue
        got = p.grad.clone()
        torch.distributed.all_reduce(got)
        want = dict(ref.named_parameters())[name].grad
        s = sqnr_db(want, got)
        assert s >= 80, f"{rank=} {name}: SQNR {s:.1f} dB"  # the 80 dB bar of dx


def test_fp8_dispatch_expert_parallel_matches_single_process():
    run_gloo(_fp8_dispatch_worker, 2, INTERPRETED and patch_applied(), timeout=90)
