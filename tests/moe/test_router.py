"""Router and routing reference vs brute-force loops (DeepSeek-V3 report §2.1.2, eqs. 12-20)."""

from __future__ import annotations

import math

import pytest
import torch

from ptxtrain.moe import Router
from ptxtrain.moe.ref import route_ref, seq_balance_loss_ref

# (E, k, G, M, route_scale): plain top-k, V3-like groups, one expert per group, 3 per group.
ROUTING_CASES = [
    (8, 2, 1, 1, 1.0),
    (16, 4, 4, 2, 2.5),
    (8, 2, 8, 3, 1.0),
    (12, 3, 4, 3, 1.7),
]


def brute_force_route(x, weight, bias, k, n_groups, n_limited, route_scale):
    """One token at a time in float64 with Python sorting: the rule as the report states it."""
    s_all = torch.sigmoid(x.double() @ weight.double().t())  # [T, E]
    n_experts = weight.shape[0]
    per_group = n_experts // n_groups
    idx_rows, w_rows = [], []
    for s in s_all.tolist():
        c = [s_i + float(b_i) for s_i, b_i in zip(s, bias.tolist())]
        group_score = []
        for g in range(n_groups):
            members = sorted(c[g * per_group : (g + 1) * per_group], reverse=True)
            group_score.append(sum(members[:2]))
        groups = sorted(range(n_groups), key=lambda g: -group_score[g])[:n_limited]
        candidates = [e for e in range(n_experts) if e // per_group in groups]
        picks = sorted(candidates, key=lambda e: -c[e])[:k]
        total = sum(s[e] for e in picks)
        idx_rows.append(picks)
        w_rows.append([s[e] / total * route_scale for e in picks])
    return torch.tensor(idx_rows, dtype=torch.int64), torch.tensor(w_rows, dtype=torch.float64)


def _inputs(n_tokens, dim, n_experts, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, dim, generator=g)
    weight = torch.randn(n_experts, dim, generator=g) * dim**-0.5
    bias = torch.randn(n_experts, generator=g) * 0.1
    return x, weight, bias


@pytest.mark.parametrize(("n_experts", "k", "n_groups", "n_limited", "scale"), ROUTING_CASES)
def test_route_ref_matches_brute_force(n_experts, k, n_groups, n_limited, scale):
    x, weight, bias = _inputs(96, 32, n_experts, seed=n_experts + k)
    idx, w, scores = route_ref(
        x, weight, bias, top_k=k, n_groups=n_groups, n_limited_groups=n_limited, route_scale=scale
    )
    idx_bf, w_bf = brute_force_route(x, weight, bias, k, n_groups, n_limited, scale)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and scores.dtype == torch.float32
    # Random continuous inputs make ties (where fp32 and fp64 might order differently) vanishingly
    # unlikely, so the expert ids, in descending s + b order, must match exactly.
    assert torch.equal(idx, idx_bf), f"{n_experts=} {k=} {n_groups=} {n_limited=}"
    # fp32 sigmoid + normalization vs float64: a few ulp of fp32 relative to route_scale.
    torch.testing.assert_close(w.double(), w_bf, rtol=1e-6, atol=1e-6)
    # Gates of every token sum to route_scale (same fp32 rounding budget).
    torch.testing.assert_close(w.sum(-1), torch.full((96,), scale), rtol=1e-6, atol=1e-6)


def test_group_limit_respected_and_binding():
    n_experts, k, n_groups, n_limited = 16, 4, 4, 2
    x, weight, _ = _inputs(512, 32, n_experts, seed=1)
    bias = torch.zeros(n_experts)
    idx, _, _ = route_ref(
        x, weight, bias, top_k=k, n_groups=n_groups, n_limited_groups=n_limited, route_scale=1.0
    )
    groups_used = [len(set((row // (n_experts // n_groups)).tolist())) for row in idx]
    assert max(groups_used) <= n_limited
    # Without the limit some tokens do reach more groups, so the check above can fail.
    idx_free, _, _ = route_ref(
        x, weight, bias, top_k=k, n_groups=n_groups, n_limited_groups=n_groups, route_scale=1.0
    )
    free_used = [len(set((row // (n_experts // n_groups)).tolist())) for row in idx_free]
    assert max(free_used) > n_limited


def test_bias_steers_selection_not_gate_values():
    n_experts, k = 8, 2
    x, weight, _ = _inputs(64, 16, n_experts, seed=2)
    kw = dict(top_k=k, n_groups=4, n_limited_groups=2, route_scale=2.0)
    idx0, w0, s = route_ref(x, weight, torch.zeros(n_experts), **kw)
    # A constant bias shifts every s + b equally: same selection, same gates, bit for bit.
    idx_c, w_c, _ = route_ref(x, weight, torch.full((n_experts,), 0.37), **kw)
    assert torch.equal(idx_c, idx0) and torch.equal(w_c, w0)
    # A large bias on expert 5 forces it into every token's choice ...
    bias = torch.zeros(n_experts)
    bias[5] = 10.0
    idx_b, w_b, _ = route_ref(x, weight, bias, **kw)
    assert bool((idx_b == 5).any(-1).all())
    assert not bool((idx0 == 5).any(-1).all())  # ... which it was not before
    # ... while the gates remain the unbiased affinities s of the chosen experts, normalized.
    picked = s.gather(1, idx_b)
    torch.testing.assert_close(w_b, picked / picked.sum(-1, keepdim=True) * 2.0)


def test_route_ref_gradients_reach_input_and_weight():
    x, weight, bias = _inputs(32, 16, 8, seed=3)
    x.requires_grad_(True)
    weight.requires_grad_(True)
    _, w, _ = route_ref(x, weight, bias, top_k=2, n_groups=1, n_limited_groups=1, route_scale=1.0)
    coeff = torch.randn(w.shape, generator=torch.Generator().manual_seed(4))
    (w * coeff).sum().backward()  # plain w.sum() is constant (gates sum to route_scale)
    assert x.grad is not None and bool(x.grad.abs().sum() > 0)
    assert weight.grad is not None and bool(weight.grad.abs().sum() > 0)


def test_route_ref_float64_stays_float64():
    x, weight, bias = _inputs(8, 16, 8, seed=5)
    _, w, s = route_ref(
        x.double(), weight.double(), bias, top_k=2, n_groups=1, n_limited_groups=1, route_scale=1.0
    )
    assert w.dtype == torch.float64 and s.dtype == torch.float64


def test_route_ref_rejects_bad_shapes():
    x, weight, bias = _inputs(8, 16, 8, seed=6)
    with pytest.raises(ValueError, match="disagree"):
        route_ref(x[:, :5], weight, bias, top_k=2, n_groups=1, n_limited_groups=1, route_scale=1)
    with pytest.raises(ValueError, match="n_groups"):
        route_ref(x, weight, bias, top_k=2, n_groups=3, n_limited_groups=1, route_scale=1)
    with pytest.raises(ValueError, match="top_k"):
        route_ref(x, weight, bias, top_k=5, n_groups=4, n_limited_groups=2, route_scale=1)


# ---------------------------------------------------------------------------- balance loss
def brute_force_seq_loss(scores, idx, seq_len, alpha):
    """Eqs. 17-20 with explicit loops over sequences, experts and tokens."""
    n_tokens, n_experts = scores.shape
    k = idx.shape[1]
    losses = []
    for b in range(n_tokens // seq_len):
        rows = range(b * seq_len, (b + 1) * seq_len)
        total = 0.0
        for i in range(n_experts):
            hits = sum(1 for t in rows if i in idx[t].tolist())
            f_i = n_experts / (k * seq_len) * hits
            p_i = sum(float(scores[t, i] / scores[t].sum()) for t in rows) / seq_len
            total += f_i * p_i
        losses.append(alpha * total)
    return sum(losses) / len(losses)


def test_seq_balance_loss_matches_brute_force():
    x, weight, bias = _inputs(3 * 20, 16, 8, seed=7)
    idx, _, scores = route_ref(
        x, weight, bias, top_k=2, n_groups=4, n_limited_groups=2, route_scale=1.0
    )
    got = seq_balance_loss_ref(scores, idx, seq_len=20, alpha=0.01)
    want = brute_force_seq_loss(scores.double(), idx, 20, 0.01)
    # fp32 sums of ~100 terms of size ~1e-3 vs a float64 loop.
    assert math.isclose(float(got), want, rel_tol=1e-5), (float(got), want)
    with pytest.raises(ValueError, match="seq_len"):
        seq_balance_loss_ref(scores, idx, seq_len=7, alpha=0.01)


# ---------------------------------------------------------------------------- the module
def _router(**kw):
    torch.manual_seed(0)
    args = dict(n_groups=4, n_limited_groups=2, route_scale=1.5, bias_update_speed=1e-3)
    args.update(kw)
    return Router(16, 8, 2, **args)


def test_router_uses_route_ref_and_counts_in_training_only():
    router = _router()
    x = torch.randn(40, 16)
    idx, w = router(x)
    idx_ref, w_ref, _ = route_ref(
        x, router.weight, router.bias, top_k=2, n_groups=4, n_limited_groups=2, route_scale=1.5
    )
    assert torch.equal(idx, idx_ref) and torch.equal(w, w_ref)
    assert torch.equal(router.expert_counts, torch.bincount(idx.flatten(), minlength=8))
    router.eval()
    router(x)
    assert int(router.expert_counts.sum()) == 40 * 2  # eval forward did not count


def test_update_bias_direction_magnitude_and_reset():
    gamma = 1e-3
    router = _router(bias_update_speed=gamma)
    counts = torch.tensor([10, 30, 20, 20, 5, 35, 20, 20])  # mean 20
    router.expert_counts.copy_(counts)
    stats = router.update_bias()
    want = torch.tensor([1, -1, 0, 0, 1, -1, 0, 0], dtype=torch.float32) * gamma
    assert torch.equal(router.bias, want)  # 0 ± γ is exact in fp32
    assert int(router.expert_counts.sum()) == 0
    assert stats["tokens"] == 160
    assert math.isclose(stats["max_load_ratio"], 35 / 20)
    assert math.isclose(stats["min_load_ratio"], 5 / 20)
    c = counts.double()
    assert math.isclose(stats["cv"], float(c.std(unbiased=False) / c.mean()))
    # A second step accumulates; no counted tokens means no change and NaN ratios.
    router.expert_counts.copy_(counts)
    router.update_bias()
    assert torch.equal(router.bias, 2 * want)
    stats = router.update_bias()
    assert torch.equal(router.bias, 2 * want) and math.isnan(stats["max_load_ratio"])


def test_bias_stays_fp32_and_exact_through_module_casts():
    router = _router()
    with torch.no_grad():
        router.bias.copy_(torch.randn(8) * 0.01 + 1.0)  # values bf16 cannot hold
    before = router.bias.clone()
    for cast in (torch.bfloat16, torch.float16, torch.float64):
        router.to(cast)
        assert router.weight.dtype == cast
        assert router.bias.dtype == torch.float32 and torch.equal(router.bias, before)
    assert router.expert_counts.dtype == torch.int64
    # Updates near 1 survive: a γ = 1e-3 step would vanish in bf16 (spacing 2^-7 at 1).
    router.expert_counts.copy_(torch.tensor([0, 2, 2, 2, 2, 2, 2, 2]))
    router.update_bias()
    assert router.bias[0] - before[0] == pytest.approx(1e-3, rel=1e-3)  # fp32 ulp at 1 is 1.2e-7
    state = router.state_dict()
    assert "bias" in state and "expert_counts" not in state


def test_router_aux_loss_and_validation():
    router = _router(seq_aux_loss_alpha=0.01)
    x = torch.randn(2 * 12, 16, requires_grad=True)
    idx, _, aux = router(x, seq_len=12, return_aux_loss=True)
    _, _, scores = route_ref(
        x, router.weight, router.bias, top_k=2, n_groups=4, n_limited_groups=2, route_scale=1.5
    )
    torch.testing.assert_close(aux, seq_balance_loss_ref(scores, idx, 12, 0.01))
    aux.backward()
    assert bool(router.weight.grad.abs().sum() > 0)
    router.eval()
    assert router(x, seq_len=12, return_aux_loss=True)[2] is None
    assert _router()(x, return_aux_loss=True)[2] is None  # alpha = 0 disables it
    with pytest.raises(ValueError, match="seq_len"):
        router.train()(x, seq_len=5, return_aux_loss=True)
    with pytest.raises(ValueError, match="x"):
        router(x[None])
    with pytest.raises(ValueError, match="x"):
        router(x[:, :3])
    with pytest.raises(TypeError, match="x"):
        router(torch.ones(4, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match="top_k"):
        Router(16, 8, 5, n_groups=4, n_limited_groups=2)
