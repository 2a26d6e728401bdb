"""ptxtrain.ep.layout: the Triton kernels against their torch twins, bit for bit.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it and applies
the exact-cast patch). Integer outputs (layout) and byte copies (packing) must be identical; the
combine sum adds in the same order as ``index_add`` on the CPU, so it is identical too.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import ptxtrain.ep.layout as lay
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.testing.triton_interp import patch_applied

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
runnable = pytest.mark.skipif(
    DEVICE == "cpu" and not (lay.triton is not None and patch_applied()),
    reason="kernels can't run: no GPU, and TRITON_INTERPRET=1 or the interpreter patch is missing",
)


def _topk(g, n_tokens, k, num_experts, *, dup=True, p_none=0.2, bad=False, deaf=None, per=1):
    """Random ids in [0, E), some -1, duplicates within a row (the layout counts a token once
    per rank, an expert once per slot), optionally invalid ids and a rank nobody routes to."""
    idx = torch.randint(0, num_experts, (n_tokens, k), generator=g)
    if not dup:
        idx = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(n_tokens)])
        idx = idx.reshape(n_tokens, k)
    if deaf is not None:
        idx = torch.where(idx // per == deaf, (idx + per) % num_experts, idx)
    idx = torch.where(torch.rand(n_tokens, k, generator=g) < p_none, -1, idx)
    if bad and n_tokens:
        idx[0, 0] = -3
        idx[-1, -1] = num_experts + 2
    return idx.to(DEVICE)


def _check_layout(idx, num_experts, num_ranks, extra=()):
    got = lay.send_layout(idx, num_experts, num_ranks, use_triton=True, extra=extra)
    want = lay.torch_send_layout(idx, num_experts, num_ranks, extra=extra)
    in_rank, counts, order, slot = got
    assert_bitwise_equal(in_rank, want[0])
    assert_bitwise_equal(counts[0], want[1][0])
    n_sent = int(want[1][0, :, 0].sum())
    assert_bitwise_equal(order[:n_sent], want[2][:n_sent])
    # slot[t, r]: place of (t, r) in the send order, -1 where t is not sent to r.
    places = torch.arange(n_sent, device=idx.device)
    expect = torch.full_like(slot, -1)
    if n_sent:
        dst = torch.repeat_interleave(want[1][0, :, 0])
        expect[order[:n_sent], dst] = places
    assert_bitwise_equal(slot, expect)
    return got, want, n_sent


LAYOUTS = [
    # (T, k, E, R, options)
    (0, 4, 16, 2, {}),
    (1, 4, 16, 2, {}),
    (1, 3, 6, 3, {"p_none": 1.0}),  # the only token goes nowhere
    (37, 4, 16, 4, {"bad": True}),
    (64, 8, 32, 2, {"dup": False, "p_none": 0.0}),
    (50, 3, 12, 4, {"deaf": 2, "per": 3}),  # rank 2 gets nothing
    (130, 2, 6, 6, {}),  # R not a power of two, more tokens than one block
]


@runnable
@pytest.mark.parametrize(("n_tokens", "k", "n_exp", "n_ranks", "opts"), LAYOUTS)
def test_send_layout_matches_torch(n_tokens, k, n_exp, n_ranks, opts):
    g = torch.Generator().manual_seed(n_tokens * 7 + k)
    idx = _topk(g, n_tokens, k, n_exp, **opts)
    _, want, _ = _check_layout(idx, n_exp, n_ranks)
    if opts.get("bad"):
        assert int(want[1][0, 0, 2]) == 2  # both invalid ids are counted
    if "deaf" in opts:
        assert int(want[1][0, opts["deaf"], 0]) == 0


@runnable
@pytest.mark.parametrize(("block_t", "n_tokens", "n_ranks"), [(4, 61, 4), (8, 8, 2), (2, 37, 3)])
def test_send_layout_across_blocks(monkeypatch, block_t, n_tokens, n_ranks):
    """Many programs (tokens per program forced small, more than 16 blocks so program 0 walks
    the block histograms in several chunks): each block's places start after the earlier
    blocks' tokens for the same rank, the histograms of all blocks add up."""
    monkeypatch.setattr(lay, "_LAYOUT_BLOCK_T", block_t)
    g = torch.Generator().manual_seed(block_t * 100 + n_tokens)
    idx = _topk(g, n_tokens, 4, 4 * n_ranks, bad=True)
    _check_layout(idx, 4 * n_ranks, n_ranks)


@runnable
@pytest.mark.parametrize(
    ("block_t", "n_tokens", "n_ranks", "opts"),
    [(1, 300, 4, {"bad": True}), (2, 333, 6, {"p_none": 0.7}), (2, 250, 5, {"deaf": 1, "per": 4})],
)
def test_send_layout_hundreds_of_blocks(monkeypatch, block_t, n_tokens, n_ranks, opts):
    """100+ programs: each reads its earlier blocks' tokens per rank from the prefix over blocks
    (and the totals from its last row); blocks with no token for a rank, a rank with none at
    all, invalid ids in the first and last block."""
    monkeypatch.setattr(lay, "_LAYOUT_BLOCK_T", block_t)
    assert -(-n_tokens // block_t) >= 100  # the case this test is for: NB in the hundreds
    g = torch.Generator().manual_seed(block_t * 1000 + n_tokens)
    idx = _topk(g, n_tokens, 3, 4 * n_ranks, **opts)
    _, want, _ = _check_layout(idx, 4 * n_ranks, n_ranks)
    if "deaf" in opts:
        assert int(want[1][0, opts["deaf"], 0]) == 0


@runnable
@pytest.mark.parametrize("n_rows", [0, 1, 23])
def test_pack_unpack_match_torch(n_rows):
    g = torch.Generator().manual_seed(n_rows)
    n_tok = 19
    parts = [
        torch.randn(n_tok, 40, generator=g).to(torch.float8_e4m3fn).view(torch.uint8),
        torch.rand(n_tok, 1, generator=g),  # scales
        torch.rand(n_tok, 3, generator=g, dtype=torch.float64),
        torch.randint(-1, 9, (n_tok, 3), generator=g),
        torch.arange(n_tok).unsqueeze(1),
    ]
    parts = [p.to(DEVICE) for p in parts]
    rows = torch.randint(0, n_tok, (n_rows,), generator=g).to(DEVICE)
    used = sum(p[0].numel() * p.element_size() for p in parts)
    for width, sel in ((used, rows), (used + 12, None)):  # exact width, 16-byte padded rows
        got = lay.pack_rows(parts, width, sel, use_triton=True)
        want = lay.torch_pack_rows(parts, width, sel)
        assert_bitwise_equal(got[:, :used], want[:, :used])  # the padding is never read
        back = lay.unpack_rows(got, parts, use_triton=True)
        for b, w in zip(back, lay.torch_unpack_rows(want, parts), strict=True):
            assert b.is_contiguous()
            assert_bitwise_equal(b, w)
    # Odd byte widths: the kernel falls back to byte words.
    odd = [torch.randint(0, 255, (n_tok, 5), generator=g, dtype=torch.uint8).to(DEVICE)] * 2
    assert_bitwise_equal(
        lay.pack_rows(odd, 10, rows, use_triton=True), lay.torch_pack_rows(odd, 10, rows)
    )


@runnable
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize(("n_tokens", "n_ranks"), [(0, 2), (1, 2), (29, 4)])
def test_combine_sum_matches_index_add(dtype, n_tokens, n_ranks):
    g = torch.Generator().manual_seed(n_tokens + n_ranks)
    idx = _topk(g, n_tokens, 3, 4 * n_ranks)
    (_, _, order, slot), _, n_sent = _check_layout(idx, 4 * n_ranks, n_ranks)
    back = (torch.randn(n_sent, 33, generator=g) * 100).to(dtype).to(DEVICE)
    got = lay.combine_sum(back, slot)
    # Against index_add on the CPU (sequential, ascending rows); CUDA's adds in a varying order.
    want = lay.torch_combine_sum(back.cpu(), order[:n_sent].cpu(), n_tokens)
    assert_bitwise_equal(got.cpu(), want)


@runnable
@pytest.mark.parametrize("extra", [(7,), (5 * 2**33 + 3, 1)])
def test_send_layout_appends_the_callers_values(extra):
    # Buffer.dispatch sends its signature in the count message's last columns: written by the
    # layout kernel (no extra launches), equal to the torch twin's, one value per column and row.
    g = torch.Generator().manual_seed(11)
    idx = _topk(g, 37, 4, 16)
    (_, counts, _, _), *_ = _check_layout(idx, 16, 4, extra)
    assert counts.shape[2] == 3 + 16 // 4 + len(extra)
    for j, value in enumerate(extra):
        assert counts[0, :, 3 + 4 + j].tolist() == [value] * 4
    with pytest.raises(ValueError, match="at most two"):
        lay.send_layout(idx, 16, 4, extra=(1, 2, 3))


@runnable
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("counts", "k", "epr", "rank"),
    [
        ([0, 0], 4, 8, 0),  # nothing received
        ([1, 0], 3, 3, 1),  # one row, from rank 0
        ([5, 0, 9, 3], 8, 4, 2),  # an empty source in the middle, k = 8
        ([0, 7, 0, 0, 6, 11], 3, 2, 5),  # R = 6, leading and repeated empty sources
    ],
)
def test_recv_tail_matches_torch(wdtype, counts, k, epr, rank):
    # The dispatch's post-payload step: local ids / weights, source index and source rank per
    # row. Integer selects and copies only, so the kernel and its twin agree bit for bit; the
    # source rank is also checked against repeat_interleave of the counts directly.
    g = torch.Generator().manual_seed(sum(counts) + k)
    n, n_ranks = sum(counts), len(counts)
    num_experts = epr * n_ranks
    glob = torch.randint(-1, num_experts, (n, k), generator=g)
    w = torch.randn(n, k, generator=g, dtype=wdtype)
    if n:
        w[0, 0] = -0.0  # a signed zero survives where the expert is local
        glob[0, 0] = rank * epr
    src = torch.randint(0, 50, (n, 1), generator=g)
    off = torch.nn.functional.pad(torch.tensor(counts).cumsum(0), (1, 0))
    args = [t.to(DEVICE) for t in (w, glob, src, off)]
    got = lay.recv_tail(*args, rank, epr, use_triton=True)
    want = lay.torch_recv_tail(*args, rank, epr)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        assert_bitwise_equal(a, b)
    assert got[2].is_contiguous()
    by_rank = torch.repeat_interleave(torch.arange(n_ranks), torch.tensor(counts))
    assert_bitwise_equal(got[3].cpu(), by_rank)
    local = (glob >= rank * epr) & (glob < (rank + 1) * epr)
    assert_bitwise_equal(got[0].cpu(), torch.where(local, glob - rank * epr, -1))
    assert_bitwise_equal(got[1].cpu(), torch.where(local, w, 0.0))
    if n:
        assert torch.signbit(got[1][0, 0].cpu())
