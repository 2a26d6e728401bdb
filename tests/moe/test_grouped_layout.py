"""The sync-free expert layout (ptxtrain.moe.grouped_layout) against the permutation references.

The layout must hold exactly the rows of :func:`ptxtrain.moe.ref.grouped_layout_ref` (each expert's
slice at its padded start) inside a buffer sized on the host; scatter / combine must give the
values of ``permute_ref`` / ``unpermute_ref`` bit for bit, on the torch twins and on the Triton
kernels (the CPU interpreter without a GPU), forward and backward.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ptxtrain.moe import Experts
from ptxtrain.moe.grouped_layout import (
    build_grouped_layout,
    combine_from_layout,
    layout_rows,
    scatter_to_layout,
    torch_layout_combine,
    torch_layout_gather,
)
from ptxtrain.moe.ref import grouped_layout_ref, permute_ref, unpermute_ref
from tests.moe.test_kernels import DEVICE, runnable

# (T, k, E): one token, an expert-heavy routing, empty experts, top-1, a larger k.
CASES = [(1, 1, 4), (5, 2, 8), (37, 3, 8), (64, 6, 16), (3, 4, 64)]


def _routing(t, k, e, seed, *, skew=True, device=DEVICE):
    """Top-k ids without repeats per token; ``skew`` leaves some experts empty."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=g)
    if skew:
        scores[:, e // 2 :] *= 0.1  # the upper half rarely chosen
    return scores.topk(k, dim=1).indices.to(device)


def _tokens(t, d, seed, dtype=torch.bfloat16, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, d, generator=g) * torch.rand(t, 1, generator=g) * 4).to(device, dtype)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 600), min_size=1, max_size=40),
    align=st.sampled_from([1, 16, 128]),
)
def test_layout_rows_bounds_every_routing(counts, align):
    padded = sum(-(-c // align) * align for c in counts)
    rows = layout_rows(sum(counts), len(counts), align)
    assert padded <= rows and rows % align == 0
    assert rows < sum(counts) + len(counts) * align + align  # and not much more


@pytest.mark.parametrize("t,k,e", CASES)
@pytest.mark.parametrize("align", [1, 128])
def test_layout_matches_reference(t, k, e, align):
    idx = _routing(t, k, e, seed=t + k + e)
    lay = build_grouped_layout(idx, e, align)
    _, sorted_slots, counts = permute_ref(torch.zeros(t, 1, device=DEVICE), idx, e)
    padded_rows, m_indices = grouped_layout_ref(counts, align)
    used = m_indices.numel()
    assert lay.rows == layout_rows(t * k, e, align) >= used
    assert torch.equal(lay.m_indices[:used], m_indices)
    assert bool((lay.m_indices[used:] == -1).all())
    assert torch.equal(lay.slot_rows.reshape(-1)[sorted_slots], padded_rows)
    assert torch.equal(lay.counts, counts)
    sizes = (counts + align - 1) // align * align
    assert torch.equal(lay.sizes, sizes.int()) and torch.equal(lay.ends, sizes.cumsum(0).int())
    real = lay.row_slots >= 0  # row_slots inverts slot_rows
    assert int(real.sum()) == t * k
    assert torch.equal(lay.slot_rows.reshape(-1)[lay.row_slots[real]], real.nonzero().flatten())


def test_layout_empty_and_bad_input():
    lay = build_grouped_layout(torch.empty(0, 2, dtype=torch.int64), 4, 128)
    assert lay.rows == 0 and lay.slot_rows.shape == (0, 2)
    with pytest.raises(TypeError, match="topk_idx"):
        build_grouped_layout(torch.zeros(3, 2, dtype=torch.int32), 4, 128)
    with pytest.raises(ValueError, match="align"):
        build_grouped_layout(torch.zeros(3, 2, dtype=torch.int64), 4, 0)
    lay = build_grouped_layout(torch.zeros(3, 2, dtype=torch.int64), 4, 1)
    with pytest.raises(ValueError, match=r"x must be a float \[T = 3, D\]"):
        scatter_to_layout(torch.zeros(4, 8), lay)
    with pytest.raises(TypeError, match="layout must be a GroupedLayout"):
        scatter_to_layout(torch.zeros(3, 8), object())
    with pytest.raises(ValueError, match=r"weights must be \[T, k\] = \[3, 2\]"):
        combine_from_layout(torch.zeros(lay.rows, 8), torch.zeros(3, 3), lay)
    with pytest.raises(ValueError, match=r"y_pad must be a float \[R = 6, D\]"):
        combine_from_layout(torch.zeros(5, 8), torch.zeros(3, 2), lay)


def _old_path(x, idx, w, e):
    """The unpadded permutation references with autograd: permute, identity experts, combine."""
    x_perm, slots, _ = permute_ref(x, idx, e)
    return unpermute_ref(x_perm * 1.0, slots, w)


@pytest.mark.parametrize("t,k,e", CASES)
@pytest.mark.parametrize("align", [1, 128])
def test_twins_equal_the_references(t, k, e, align):
    # Forward bitwise; gradients bitwise too (same fp32 products, same sum order), the gate
    # weights' dot products included (the twin reduces each row as the reference does). On the
    # CPU: the references' index_add adds with atomics in a varying order on CUDA.
    d = 40
    idx = _routing(t, k, e, seed=3 * t + k, device="cpu")
    x = _tokens(t, d, seed=t, device="cpu").requires_grad_(True)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    lay = build_grouped_layout(idx, e, align)
    x_pad = scatter_to_layout(x, lay)
    pad = lay.row_slots < 0
    assert bool((x_pad[pad] == 0).all()), "padding rows must be zero"
    assert torch.equal(x_pad[lay.slot_rows.reshape(-1)], x.repeat_interleave(k, 0))
    y = combine_from_layout(x_pad * 1.0, w, lay)
    g = _tokens(t, d, seed=t + 9, device="cpu")
    (y.float() * g.float()).sum().backward()
    xr, wr = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    yr = _old_path(xr, idx, wr, e)
    (yr.float() * g.float()).sum().backward()
    assert torch.equal(y, yr)
    assert torch.equal(x.grad, xr.grad)
    assert torch.equal(w.grad, wr.grad)


@runnable
@pytest.mark.parametrize("t,k,e", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernels_equal_the_twins(t, k, e, dtype):
    d = 200  # a D tail past the kernels' column blocks
    idx = _routing(t, k, e, seed=t * k)
    lay = build_grouped_layout(idx, e, 128)
    from ptxtrain.moe.triton import layout_combine, layout_gather

    x = _tokens(t, d, seed=11, dtype=dtype)
    w = torch.rand(t, k, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    y_pad = _tokens(lay.rows, d, seed=12, dtype=dtype)
    for weights, dot in ((None, None), (w, y_pad)):
        got, got_dots = layout_gather(x, lay.row_slots, k, weights, dot)
        want, want_dots = torch_layout_gather(x, lay, weights, dot)
        assert torch.equal(got, want), f"{t=}, {k=}, {e=}, weights={weights is not None}"
        if dot is not None:
            # fp32 dot products over D = 200 summed in another order: a few ulps of the sum of
            # |products| (bounded here by 2^-20 of it)
            scale = (x.float().abs().repeat_interleave(k, 0).sum(1).max() * 4).item() + 1e-30
            torch.testing.assert_close(got_dots, want_dots, rtol=0, atol=scale * 2**-20)
    for weights in (None, w):
        got = layout_combine(y_pad, lay.slot_rows, weights)
        assert torch.equal(got, torch_layout_combine(y_pad, lay, weights))


@pytest.mark.parametrize("fp8", [False, True])
def test_experts_on_the_layout_equal_the_unpadded_experts(fp8):
    # Experts.forward_layout (no host sync on CUDA) against Experts.forward on the unpadded
    # permutation: the same rows through the same GEMMs (the FP8 path quantizes the same padded
    # layout either way), so the real rows agree bit for bit and padding rows are zero.
    torch.manual_seed(0)
    t, k, e, d, inter = 50, 3, 8, 256, 128
    experts = Experts(e, d, inter).to(DEVICE)
    experts.fp8 = fp8
    idx = _routing(t, k, e, seed=4)
    x = _tokens(t, d, seed=4, dtype=torch.float32)
    lay = build_grouped_layout(idx, e, 128 if fp8 else 1)
    y_pad = experts.forward_layout(scatter_to_layout(x, lay), lay)
    x_perm, slots, counts = permute_ref(x, idx, e)
    y = experts(x_perm, counts)
    rows = lay.slot_rows.reshape(-1)[slots]
    if DEVICE == "cpu":
        assert torch.equal(y_pad[rows], y)
    else:  # GPU GEMMs of another M may pick other tiles / split-K: the sums' order may change
        torch.testing.assert_close(y_pad[rows], y, rtol=1e-5, atol=1e-5)
    assert bool((y_pad[lay.row_slots < 0] == 0).all())
    with pytest.raises(ValueError, match="x_pad must be a float"):
        experts.forward_layout(x, lay)
