"""Permutation references and the MoE layer vs naive per-token loops (DeepSeek-V3 report eq. 12),
and the expert-parallel layer on gloo ranks vs the single-process layer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ptxtrain.moe import MoE
from ptxtrain.moe.ref import permute_ref, unpermute_ref
from tests._host_reads import forward_backward_reads
from tests._spawn import run_gloo


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
    # Slots outside [0, T·k) raised torch's own IndexError from index_select; they now raise
    # a ValueError naming the argument and the range.
    for bad in (-1, 8):
        slots = torch.arange(8)
        slots[3] = bad
        with pytest.raises(ValueError, match=r"sorted_slots must hold slots in \[0, T·k = 8\)"):
            unpermute_ref(torch.randn(8, 8), slots, torch.rand(4, 2))
    with pytest.raises(TypeError, match="sorted_slots must be int64"):
        unpermute_ref(torch.randn(8, 8), torch.arange(8).int(), torch.rand(4, 2))
    # Ids outside [0, E) sorted before expert 0 (-1) or after the last expert uncounted, so
    # every expert's slice was shifted without an error. Checked before any kernel runs.
    from ptxtrain.moe.fused import permute_fused

    good = torch.tensor([[1, 0], [2, 3], [0, 2], [3, 1]])
    for fn in (permute_ref, permute_fused):
        for bad in (-1, 4):
            idx_bad = good.clone()
            idx_bad[2, 1] = bad
            with pytest.raises(ValueError, match=rf"topk_idx.*\[{min(bad, 0)}, {max(bad, 3)}\]"):
                fn(x, idx_bad, 4)


def _moe(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    args = dict(n_shared_experts=2, n_groups=4, n_limited_groups=2, route_scale=2.5)
    args.update(kw)
    moe = MoE(32, 24, 8, 3, **args).to(dtype)
    return moe


def _expert(moe, e, x):
    """Routed expert ``e`` of ``moe`` on ``x``, from its stacked weights (as a plain MLP)."""
    ex = moe.experts
    return F.linear(F.silu(F.linear(x, ex.w1[e])) * F.linear(x, ex.w3[e]), ex.w2[e])


def test_moe_forward_matches_per_token_loop():
    moe = _moe().eval()
    x = torch.randn(3, 10, 32)
    y = moe(x)
    idx, w = moe.router(x.reshape(-1, 32))
    want = []
    for t, x_t in enumerate(x.reshape(-1, 32)):
        y_t = moe.shared_experts(x_t)
        for j in range(3):
            y_t = y_t + w[t, j] * _expert(moe, int(idx[t, j]), x_t)
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
    assert bool(moe.experts.w1.grad[0].abs().sum() > 0)
    assert bool(moe.experts.w1.grad[5].abs().sum() == 0)  # ran on 0 rows
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


# ---------------------------------------------------------------------------- expert parallelism
def _ep_case(world: int):
    """The float64 layer, the ranks' inputs and cotangents (every rank builds all of them)."""
    moe = _moe(torch.float64, seq_aux_loss_alpha=1e-2).train()  # E = 8, k = 3, 2 of 4 groups
    with torch.no_grad():
        # Uneven loads: expert 0 favoured, group 3 (experts 6 and 7, all of rank 3's share with
        # 4 ranks) never chosen, so some experts and, with 4 ranks, a whole rank receive nothing.
        moe.router.bias[0] = 0.3
        moe.router.bias[6:] = -10.0
    xs, gs = [], []
    for r in range(world):
        gen = torch.Generator().manual_seed(100 + r)
        b = 1 + r % 2  # uneven token counts per rank
        xs.append(torch.randn(b, 5, 32, generator=gen, dtype=torch.float64) + 0.1 * r)
        gs.append(torch.randn(b, 5, 32, generator=gen, dtype=torch.float64))
    return moe, xs, gs


def _ep_worker(rank: int, world: int) -> None:
    ref, xs, gs = _ep_case(world)
    ep = copy.deepcopy(ref)
    ep.enable_expert_parallel()
    per = 8 // world
    assert ep.ep_size == world and ep.experts.num_local_experts == per
    assert ep.experts.expert_offset == rank * per

    # Each rank: its own tokens; loss weights the (per-sequence mean) balance loss by its
    # sequence count so that the ranks' losses sum to the single-process loss below.
    x = xs[rank].clone().requires_grad_(True)
    (y, _), n_fwd, n_bwd, reads = forward_backward_reads(
        lambda: ep(x, return_aux_loss=True),
        lambda out: (out[0] * gs[rank]).sum().add(out[1] * x.shape[0]).backward(),
    )
    # On a GPU each read of a tensor's value on the host is a sync: the forward's only one is
    # the dispatch's (the split sizes and the rows per expert), and backward has none.
    assert (n_fwd, n_bwd) == (1, 0), reads

    x_all = torch.cat(xs).requires_grad_(True)
    y_all, aux_all = ref(x_all, return_aux_loss=True)
    (y_all * torch.cat(gs)).sum().add(aux_all * x_all.shape[0]).backward()

    # float64 throughout; the only differences are summation orders (per-rank partial sums of
    # the k expert outputs, then the combine): a few ulps of O(1) values.
    tol = dict(rtol=1e-12, atol=1e-12)
    lo = sum(t.shape[0] for t in xs[:rank])
    mine = slice(lo, lo + x.shape[0])
    torch.testing.assert_close(y, y_all[mine], **tol, msg=lambda m: f"{rank=} y: {m}")
    torch.testing.assert_close(x.grad, x_all.grad[mine], **tol, msg=lambda m: f"{rank=} dx: {m}")
    experts = {"experts.w1", "experts.w3", "experts.w2"}
    ref_params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        want = ref_params[name].grad
        if name in experts:  # this rank's slice of the experts, fed by every rank's tokens
            want = want[rank * per : (rank + 1) * per]
            got = p.grad
        else:  # replicated: each rank holds its own tokens' share; the shares sum to the whole
            got = p.grad.clone()
            dist.all_reduce(got)
        torch.testing.assert_close(got, want, **tol, msg=lambda m, n=name: f"{rank=} {n}: {m}")
    assert torch.equal(ref.experts.w1.grad[6:].abs().sum(), torch.zeros((), dtype=torch.float64))

    # The bias update from the global load: identical on every rank and to the reference.
    ep.sync_expert_counts()
    assert torch.equal(ep.router.expert_counts, ref.router.expert_counts), rank
    assert ref.router.expert_counts[6:].sum() == 0 and ref.router.expert_counts[0] > 0
    ep.router.update_bias()
    ref.router.update_bias()
    assert torch.equal(ep.router.bias, ref.router.bias), rank

    # A second, eval-mode forward (no counting) still matches: the handle is per call.
    with torch.no_grad():
        ep.eval(), ref.eval()
        torch.testing.assert_close(ep(xs[rank]), ref(torch.cat(xs))[mine], **tol)

    # Errors, raised before any communication: E not divisible, enabling twice.
    with pytest.raises(ValueError, match=r"n_routed_experts=\d+ must be divisible"):
        MoE(32, 16, 6 if world == 4 else 3, 1, n_shared_experts=0).enable_expert_parallel()
    with pytest.raises(ValueError, match="already enabled"):
        ep.enable_expert_parallel()


# With 4 ranks a whole rank (experts 6 and 7) receives no token.
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_layer_matches_single_process(world):
    run_gloo(_ep_worker, world, timeout=90)


def test_expert_parallel_needs_a_process_group():
    moe = _moe()
    with pytest.raises(ValueError, match="init_process_group"):
        moe.enable_expert_parallel()
    assert moe.ep_size == 1 and moe.experts.num_local_experts == 8
    moe.sync_expert_counts()  # a no-op without expert parallelism


@pytest.mark.parametrize("shape", [(0,), (1, 1), (13, 8), (300, 6)])
def test_count_per_expert_is_bincount_without_a_sync(shape):
    from ptxtrain.moe.ref import count_per_expert

    g = torch.Generator().manual_seed(sum(shape) + 1)
    n_experts = 37
    ids = torch.randint(0, n_experts, shape, generator=g)
    want = torch.bincount(ids.reshape(-1), minlength=n_experts)
    assert torch.equal(count_per_expert(ids, n_experts), want)
    # Out-of-range ids are not counted (bincount would grow its output or raise).
    if ids.numel() > 2:
        bad = ids.clone().reshape(-1)
        bad[0], bad[1] = -1, n_experts + 3
        got = count_per_expert(bad, n_experts)
        assert got.shape == (n_experts,) and int(got.sum()) == bad.numel() - 2
