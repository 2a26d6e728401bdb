"""Permutation references and the MoE layer vs naive per-token loops (DeepSeek-V3 report eq. 12)."""

from __future__ import annotations

import pytest
import torch

from ptxtrain.moe import MoE
from ptxtrain.moe.ref import permute_ref, unpermute_ref


def _topk_idx(n_tokens, k, n_experts, gen, skip=()):
    """Random distinct experts per token, never using the experts in ``skip``."""
    allowed = torch.tensor([e for e in range(n_experts) if e not in skip])
    rows = [allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(n_tokens)]
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)


@pytest.mark.parametrize(("n_tokens", "k", "n_experts"), [(37, 3, 8), (1, 2, 4), (0, 2, 4)])
def test_permute_matches_naive_loop(n_tokens, k, n_experts):
    gen = torch.Generator().manual_seed(n_tokens)
    x = torch.randn(n_tokens, 24, generator=gen)
    idx = _topk_idx(n_tokens, k, n_experts, gen, skip=(1,))  # expert 1 gets nothing
    x_perm, sorted_slots, tpe = permute_ref(x, idx, n_experts)
    want_slots = [
        t * k + j
        for e in range(n_experts)
        for t in range(n_tokens)
        for j in range(k)
        if idx[t, j] == e
    ]
    assert sorted_slots.tolist() == want_slots, f"{n_tokens=} {k=} {n_experts=}"
    want_rows = [x[s // k] for s in want_slots]
    assert torch.equal(x_perm, torch.stack(want_rows) if want_rows else x[:0])  # exact copies
    want_counts = [int((idx == e).sum()) for e in range(n_experts)]
    assert tpe.tolist() == want_counts and tpe[1] == 0


def test_unpermute_matches_naive_loop_and_round_trips():
    gen = torch.Generator().manual_seed(11)
    n_tokens, k, n_experts, dim = 29, 4, 8, 16
    x = torch.randn(n_tokens, dim, generator=gen)
    idx = _topk_idx(n_tokens, k, n_experts, gen)
    w = torch.rand(n_tokens, k, generator=gen)
    x_perm, sorted_slots, _ = permute_ref(x, idx, n_experts)
    y_perm = torch.randn(n_tokens * k, dim, generator=gen)  # stand-in expert outputs
    y = unpermute_ref(y_perm, sorted_slots, w)
    row_of = {int(s): r for r, s in enumerate(sorted_slots)}
    want = torch.stack(
        [
            sum(w[t, j].double() * y_perm[row_of[t * k + j]].double() for j in range(k))
            for t in range(n_tokens)
        ]
    )
    # fp32 accumulation of 4 terms vs float64.
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    # Identity experts with gates summing to 1 give the input back (same fp32 budget).
    w_norm = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(unpermute_ref(x_perm, sorted_slots, w_norm), x, rtol=1e-6, atol=1e-6)
    # bf16 in, bf16 out; the sum itself is fp32 (one bf16 rounding at the end).
    y_bf16 = unpermute_ref(y_perm.bfloat16(), sorted_slots, w)
    assert y_bf16.dtype == torch.bfloat16
    want_bf16 = unpermute_ref(y_perm.bfloat16().float(), sorted_slots, w).bfloat16()
    assert torch.equal(y_bf16, want_bf16)


def test_permute_unpermute_reject_bad_arguments():
    x = torch.randn(4, 8)
    idx = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="topk_idx"):
        permute_ref(x, idx[:3], 4)
    with pytest.raises(TypeError, match="topk_idx"):
        permute_ref(x, idx.int(), 4)
    with pytest.raises(ValueError, match="y_permuted"):
        unpermute_ref(torch.randn(7, 8), torch.arange(8), torch.rand(4, 2))


def _moe(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    args = dict(n_shared_experts=2, n_groups=4, n_limited_groups=2, route_scale=2.5)
    args.update(kw)
    moe = MoE(32, 24, 8, 3, **args).to(dtype)
    return moe


def test_moe_forward_matches_per_token_loop():
    moe = _moe().eval()
    x = torch.randn(3, 10, 32)
    y = moe(x)
    idx, w = moe.router(x.reshape(-1, 32))
    want = []
    for t, x_t in enumerate(x.reshape(-1, 32)):
        y_t = moe.shared_experts(x_t)
        for j in range(3):
            y_t = y_t + w[t, j] * moe.experts[int(idx[t, j])](x_t)
        want.append(y_t)
    # fp32 with a different summation order (fp32 index_add vs the loop's sequential sum) and
    # batched vs single-row matmuls: differences of a few fp32 ulp of O(1) values.
    torch.testing.assert_close(y, torch.stack(want).view_as(x), rtol=1e-5, atol=1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype


def test_moe_backward_gives_every_expert_a_gradient():
    moe = _moe(n_groups=1, n_limited_groups=1).train()
    with torch.no_grad():
        moe.router.bias[:] = torch.tensor([5.0, 5.0, 5.0, 0, 0, 0, 0, 0])  # experts 3-7 idle
    x = torch.randn(2, 8, 32, requires_grad=True)
    y = moe(x)
    assert set(torch.nonzero(moe.router.expert_counts).flatten().tolist()) == {0, 1, 2}
    (y * torch.randn_like(y)).sum().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name
    assert bool(moe.experts[0].w1.weight.grad.abs().sum() > 0)
    assert bool(moe.experts[5].w1.weight.grad.abs().sum() == 0)  # ran on 0 rows
    assert bool(moe.router.weight.grad.abs().sum() > 0)  # through the gate values
    assert bool(x.grad.abs().sum() > 0)


def test_moe_aux_loss_bf16_and_flat_input():
    moe = _moe(dtype=torch.bfloat16, seq_aux_loss_alpha=1e-2).train()
    assert moe.router.bias.dtype == torch.float32
    x = torch.randn(2, 6, 32, dtype=torch.bfloat16)
    y, aux = moe(x, return_aux_loss=True)
    assert y.dtype == torch.bfloat16 and aux is not None and aux.dtype == torch.float32
    assert float(aux.detach()) > 0
    y_flat = moe.eval()(x.reshape(-1, 32))  # [N, D] input: one sequence, same per-token maths
    assert y_flat.shape == (12, 32)
    with pytest.raises(ValueError, match="x"):
        moe(torch.randn(12, 31))
    with pytest.raises(ValueError, match="x"):
        moe(torch.randn(32))
