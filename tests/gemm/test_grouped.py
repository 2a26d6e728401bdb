"""Grouped FP8 GEMMs (ptxtrain.gemm.grouped) against the unquantized product and the references.

Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/conftest.py sets
``TRITON_INTERPRET=1``) on small shapes with the awkward group sizes (0, 1, 127, 129 rows) and N, K
tails; the GPU-marked tests repeat the checks on the DeepSeek-V3 expert shapes.
"""

import pytest
import torch

pytest.importorskip("triton")

import ptxtrain.gemm.grouped as gg
from ptxtrain.gemm import ref
from ptxtrain.gemm.heuristics import GemmConfig
from ptxtrain.moe.ref import grouped_layout_ref, permute_quant_ref
from ptxtrain.quant.ref import (
    FP8_DTYPE,
    per_block_cast_back,
    per_block_cast_to_fp8,
    per_token_cast_back,
    per_token_cast_to_fp8,
)
from ptxtrain.testing import calc_diff
from tests._sm90 import run_sm90_script
from tests.gemm._bounds import BF16_REL, CALC_DIFF_MAX, REF_REL

INTERPRETED = gg.is_interpreted()
HAS_GPU = torch.cuda.is_available()
DEVICE = "cuda" if HAS_GPU else "cpu"

runnable = pytest.mark.skipif(
    not (INTERPRETED or HAS_GPU),
    reason="no GPU and ptxtrain.gemm.grouped was imported before TRITON_INTERPRET=1 was set",
)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _quant_b(w):
    """[G, N, K] weights -> ([G, N, K] fp8, [G, ⌈N/128⌉, ⌈K/128⌉] sf), 128x128 blocks per group."""
    pairs = [per_block_cast_to_fp8(w[g]) for g in range(w.shape[0])]
    kb = -(-w.shape[2] // 128)
    nb = -(-w.shape[1] // 128)
    if not pairs:
        return (
            torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device),
            torch.empty((0, nb, kb), device=w.device),
        )
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def _weights(g, n, k, seed):
    """Group weights whose 128x128 blocks differ in magnitude (so per-block scales matter)."""
    gen = _gen(seed)
    gain = torch.exp(torch.randn(g, -(-n // 128), 1, generator=gen)).repeat_interleave(128, 1)
    return torch.randn(g, n, k, generator=gen) * gain[:, :n]


def _tokens(m, k, seed):
    """Rows and 128-column blocks of different magnitudes (per-row, per-block scales matter)."""
    gen = _gen(seed)
    k_gain = torch.exp(torch.randn(-(-k // 128), generator=gen)).repeat_interleave(128)[:k]
    return torch.randn(m, k, generator=gen) * torch.exp(torch.randn(m, 1, generator=gen)) * k_gain


def _assert_close_to_ref(got, want, a_hp, b_hp, what):
    """``got`` within fp32 reordering (+ bf16 rounding) of ``want``; a_hp [.., K], b_hp [N, K]."""
    bound = REF_REL * (a_hp.abs() @ b_hp.abs().t()).double()
    if got.dtype == torch.bfloat16:
        bound += BF16_REL * want.double().abs()
    err = (got.double() - want.double()).abs()
    bad = err > bound
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements off the reference; first at "
            f"{idx}: {got[idx].item()!r} vs {want[idx].item()!r} (bound {bound[idx].item():.3e})"
        )


def _contiguous_case(sizes, n, k, seed, device=DEVICE):
    """Expert-contiguous padded layout: x [M_total, K], w [G, N, K]. Padding rows hold random
    garbage: their output must be zeros whatever A holds there."""
    counts = torch.tensor(sizes, dtype=torch.int64)
    padded_rows, m_indices = grouped_layout_ref(counts, gg.get_m_alignment_for_contiguous_layout())
    x = torch.randn(m_indices.numel(), k, generator=_gen(seed + 2))
    x[padded_rows] = _tokens(int(counts.sum()), k, seed)
    w = _weights(len(sizes), n, k, seed + 1)
    return x.to(device), w.to(device), m_indices.to(device)


def _check_contiguous(got, x, w, m_indices, qa, qb, what):
    mi = m_indices.long()
    oracle = torch.zeros(got.shape, dtype=torch.float64, device=x.device)
    want = ref.m_grouped_fp8_gemm_nt_contiguous_ref(qa, qb, m_indices, out_dtype=torch.float32)
    for g in range(w.shape[0]):
        rows = (mi == g).nonzero().flatten()
        oracle[rows] = x[rows].double() @ w[g].double().t()
        b_hp = per_block_cast_back(qb[0][g], qb[1][g])
        a_hp = per_token_cast_back(*qa)[rows]
        _assert_close_to_ref(got[rows], want[rows], a_hp, b_hp, f"{what}, group {g}")
    diff = calc_diff(got, oracle)
    assert diff < CALC_DIFF_MAX, f"{what}: {diff=:.2e}"
    pad = mi < 0
    assert bool((got[pad] == 0).all()), f"{what}: padding rows must be zeros"


# (group sizes, N, K, out dtype, config): the awkward sizes with N and K tails; 128-row tiles;
# K = 0 groups; N below one tile.
CONTIGUOUS_CASES = [
    ((0, 1, 127, 129), 200, 300, torch.float32, None),
    ((129, 0, 3), 192, 256, torch.bfloat16, GemmConfig(128, 128, 8, 2)),
    ((5,), 40, 130, torch.bfloat16, GemmConfig(64, 64, 4, 2)),
    ((1, 1), 64, 128, torch.float32, GemmConfig(64, 256, 8, 2)),
]


@runnable
@pytest.mark.parametrize("sizes,n,k,out_dtype,config", CONTIGUOUS_CASES)
def test_m_grouped_contiguous_oracle_and_reference(sizes, n, k, out_dtype, config):
    x, w, m_indices = _contiguous_case(sizes, n, k, seed=sum(sizes) + n + k)
    qa, qb = per_token_cast_to_fp8(x), _quant_b(w)
    # A stale out: padding rows and skipped tiles must be overwritten with zeros.
    out = torch.full((x.shape[0], n), 7.0, dtype=out_dtype, device=x.device)
    got = gg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices, out=out, config=config)
    assert got is out
    _check_contiguous(got, x, w, m_indices, qa, qb, f"{sizes=}, {n=}, {k=}")


@runnable
def test_m_grouped_contiguous_from_permute_quant():
    """The layout permute_quant builds with align=M_ALIGNMENT feeds the GEMM as is."""
    t, e, top_k, d, n = 40, 4, 2, 256, 96
    gen = _gen(5)
    x = _tokens(t, d, 6)
    topk_idx = torch.randint(0, e, (t, top_k), generator=gen)
    pq = permute_quant_ref(x, topk_idx, e, align=gg.M_ALIGNMENT)
    w = _weights(e, n, d, 7)
    qb = _quant_b(w)
    a = (pq.x_fp8.to(DEVICE), pq.sf.to(DEVICE))
    m_indices = pq.m_indices.to(DEVICE)
    qb = (qb[0].to(DEVICE), qb[1].to(DEVICE))
    got = gg.m_grouped_fp8_gemm_nt_contiguous(a, qb, m_indices, out_dtype=torch.float32)
    x_rows = torch.zeros(m_indices.numel(), d)
    x_rows[pq.padded_rows] = x[pq.sorted_slots // top_k]
    _check_contiguous(got, x_rows.to(DEVICE), w.to(DEVICE), m_indices, a, qb, "permute_quant")


@runnable
@pytest.mark.parametrize(
    "masked,m_max,n,k,out_dtype",
    [((0, 1, 129), 130, 100, 200, torch.bfloat16), ((64, 3), 64, 136, 384, torch.float32)],
)
def test_m_grouped_masked_oracle_and_reference(masked, m_max, n, k, out_dtype):
    g = len(masked)
    x = _tokens(g * m_max, k, seed=m_max + k).view(g, m_max, k).to(DEVICE)
    w = _weights(g, n, k, seed=n).to(DEVICE)
    qa_flat = per_token_cast_to_fp8(x.view(g * m_max, k))
    qa = (qa_flat[0].view(g, m_max, k), qa_flat[1].view(g, m_max, -1))
    qb = _quant_b(w)
    masked_m = torch.tensor(masked, dtype=torch.int32, device=DEVICE)
    sentinel = 3.0
    out = torch.full((g, m_max, n), sentinel, dtype=out_dtype, device=DEVICE)
    got = gg.m_grouped_fp8_gemm_nt_masked(qa, qb, masked_m, expected_m=max(masked), out=out)
    want = ref.m_grouped_fp8_gemm_nt_masked_ref(qa, qb, masked_m, out_dtype=torch.float32)
    for grp, rows in enumerate(masked):
        oracle = x[grp, :rows].double() @ w[grp].double().t()
        if rows:
            diff = calc_diff(got[grp, :rows], oracle)
            assert diff < CALC_DIFF_MAX, f"group {grp}: {diff=:.2e}"
        a_hp = per_token_cast_back(qa[0][grp, :rows], qa[1][grp, :rows])
        b_hp = per_block_cast_back(qb[0][grp], qb[1][grp])
        _assert_close_to_ref(got[grp, :rows], want[grp, :rows], a_hp, b_hp, f"group {grp}")
        # Rows past masked_m: the reference writes zeros; the kernel leaves them untouched.
        assert bool((want[grp, rows:] == 0).all())
        if gg._use_triton(x.device):
            assert bool((got[grp, rows:] == sentinel).all()), f"group {grp}: rows past masked_m"


# (M, N, ks): empty groups, one and several 128-token blocks, M and N tails.
K_GROUPED_CASES = [(100, 72, (0, 128, 256, 128)), (130, 64, (128,)), (64, 200, (256, 0))]


@runnable
@pytest.mark.parametrize("m,n,ks", K_GROUPED_CASES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_k_grouped_oracle_and_reference(m, n, ks, accumulate):
    k_total = sum(ks)
    seed = m + n + k_total + accumulate
    dy_t = _tokens(m, k_total, seed).to(DEVICE)  # A [M, K_total]: K = tokens
    x_t = _tokens(n, k_total, seed + 1).to(DEVICE)  # B [N, K_total]
    qa, qb = per_token_cast_to_fp8(dy_t), per_token_cast_to_fp8(x_t)
    base = torch.randn(len(ks), m, n, generator=_gen(seed + 2)).to(DEVICE)
    out = base.clone() if accumulate else torch.full_like(base, 5.0)
    got = gg.k_grouped_fp8_gemm_nt_contiguous(qa, qb, list(ks), out=out, accumulate=accumulate)
    assert got is out and got.dtype == torch.float32
    start = 0
    for grp, kg in enumerate(ks):
        cols = slice(start, start + kg)
        result = got[grp] - base[grp] if accumulate else got[grp]
        if kg == 0:
            assert bool((result == 0).all()), f"group {grp} with ks = 0 must add nothing"
        else:
            oracle = dy_t[:, cols].double() @ x_t[:, cols].double().t()
            diff = calc_diff(result, oracle)
            assert diff < CALC_DIFF_MAX, f"group {grp}: {diff=:.2e}"
            blocks = slice(start // 128, (start + kg) // 128)
            a_hp = per_token_cast_back(qa[0][:, cols], qa[1][:, blocks])
            b_hp = per_token_cast_back(qb[0][:, cols], qb[1][:, blocks])
            want = a_hp @ b_hp.t()
            _assert_close_to_ref(result, want, a_hp, b_hp, f"group {grp}")
        start += kg
    want_all = ref.k_grouped_fp8_gemm_nt_contiguous_ref(qa, qb, torch.tensor(ks))
    assert want_all.shape == (len(ks), m, n)


@runnable
@pytest.mark.parametrize("m,n,ks", K_GROUPED_CASES)
def test_k_grouped_device_sizes(m, n, ks):
    # ks_tensor (sizes on the device, read by the kernel only): A and B sized from an upper bound
    # with 256 trailing columns past the groups; those hold huge values, so reading them would
    # show. The result equals the host-ks call on the trimmed operands bit for bit (same kernel
    # arithmetic over the same columns).
    used = sum(ks)
    seed = 7 * m + n + used
    dy_t = _tokens(m, used + 256, seed)
    x_t = _tokens(n, used + 256, seed + 1)
    dy_t[:, used:] = 3e4
    x_t[:, used:] = -3e4
    qa, qb = per_token_cast_to_fp8(dy_t.to(DEVICE)), per_token_cast_to_fp8(x_t.to(DEVICE))
    sizes = torch.tensor(ks, dtype=torch.int32, device=DEVICE)
    got = gg.k_grouped_fp8_gemm_nt_contiguous(qa, qb, None, ks_tensor=sizes)

    def trim(q):
        return q[0][:, :used], q[1][:, : used // 128]

    want = gg.k_grouped_fp8_gemm_nt_contiguous(trim(qa), trim(qb), list(ks))
    assert torch.equal(got, want), f"{m=}, {n=}, {ks=}"
    ref_got = ref.k_grouped_fp8_gemm_nt_contiguous_ref(qa, qb, None, ks_tensor=sizes)
    assert torch.equal(ref_got, ref.k_grouped_fp8_gemm_nt_contiguous_ref(trim(qa), trim(qb), ks))


@runnable
def test_k_grouped_device_sizes_bad_input():
    q = per_token_cast_to_fp8(torch.randn(16, 256, generator=_gen(4)).to(DEVICE))
    sizes = torch.tensor([128, 128], device=DEVICE)
    with pytest.raises(ValueError, match="exactly one of ks"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, [128, 128], ks_tensor=sizes)
    with pytest.raises(ValueError, match="exactly one of ks"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, None)
    with pytest.raises(TypeError, match="ks_tensor must be a 1-D int32 / int64"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, None, ks_tensor=sizes.float())
    with pytest.raises(TypeError, match=r"ks_tensor must be a torch\.Tensor"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, None, ks_tensor=[128, 128])
    with pytest.raises(ValueError, match="summing to at most K_total = 256"):
        ref.k_grouped_fp8_gemm_nt_contiguous_ref(
            q, q, None, ks_tensor=torch.tensor([256, 128], device=DEVICE)
        )


def test_alignment_constants():
    assert gg.get_m_alignment_for_contiguous_layout() == gg.M_ALIGNMENT == ref.M_GROUPED_ALIGNMENT
    assert gg.M_ALIGNMENT % 128 == 0  # tiles of 64 and 128 rows never span two groups


@runnable
def test_dispatch(monkeypatch):
    """Triton on CUDA or under the interpreter; PTXTRAIN_GEMM_BACKEND=ref forces the reference."""
    x, w, m_indices = _contiguous_case((3, 0), 64, 128, seed=11)
    qa, qb = per_token_cast_to_fp8(x), _quant_b(w)

    def boom(*args, **kwargs):
        raise RuntimeError("wrong backend")

    with monkeypatch.context() as mp:
        mp.setattr(gg.ref, "m_grouped_fp8_gemm_nt_contiguous_ref", boom)
        gg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices)  # Triton path
        # PTXTRAIN_GEMM_BACKEND=ptx (valid for ptxtrain.gemm) is accepted here too: the PTX
        # kernel where it runs (sm_90, K-major B), Triton otherwise.
        mp.setenv("PTXTRAIN_GEMM_BACKEND", "ptx")
        gg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices)
        gg.k_grouped_fp8_gemm_nt_contiguous(qa, qa, [128])
    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "ref")
    monkeypatch.setattr(gg, "_contiguous_triton", boom)
    monkeypatch.setattr(gg, "m_grouped_fp8_gemm_nt_masked_triton", boom)
    monkeypatch.setattr(gg, "_k_grouped_triton", boom)
    got = gg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices)
    want = ref.m_grouped_fp8_gemm_nt_contiguous_ref(qa, qb, m_indices)
    assert torch.equal(got, want)
    qa3 = (qa[0][:128].unsqueeze(0), qa[1][:128].unsqueeze(0))
    masked_m = torch.tensor([3], dtype=torch.int32, device=x.device)
    gg.m_grouped_fp8_gemm_nt_masked(qa3, (qb[0][:1], qb[1][:1]), masked_m)
    gg.k_grouped_fp8_gemm_nt_contiguous(qa, qa, [128])


# ---------------------------------------------------------------------------------------------
# Bad input: every backend shares the validators; run them on the Triton path where it runs.
# ---------------------------------------------------------------------------------------------


def _small_contiguous():
    x, w, m_indices = _contiguous_case((3, 130), 64, 128, seed=3, device="cpu")
    return per_token_cast_to_fp8(x), _quant_b(w), m_indices


@pytest.mark.parametrize(
    "mutate,err,match",
    [
        (lambda a, b, mi: (a, b, mi.long()), TypeError, "m_indices must have dtype int32"),
        (lambda a, b, mi: (a, b, mi[:-1]), ValueError, "one entry per row"),
        (lambda a, b, mi: ((a[0][:-1], a[1][:-1]), b, mi[:-1]), ValueError, "multiple of 128"),
        (lambda a, b, mi: (a, b, torch.where(mi == 1, 2, mi)), ValueError, r"\[-1, 2\)"),
        (lambda a, b, mi: (a, b, torch.where(mi < 0, -2, mi)), ValueError, r"\[-1, 2\)"),
        (lambda a, b, mi: (a, b, torch.where(mi < 0, 1, mi)), ValueError, "mix groups 0 and 1"),
        (lambda a, b, mi: (a, (b[0], b[1][:, :, :0]), mi), ValueError, "b sf must have shape"),
        (lambda a, b, mi: (a, (b[0][0], b[1][0]), mi), ValueError, "3-D"),
        (lambda a, b, mi: (a, (b[0][:, :, :64], b[1]), mi), ValueError, "share K"),
        (lambda a, b, mi: (a[0], b, mi), TypeError, "a must be a pair"),
        (lambda a, b, mi: ((a[0].float(), a[1]), b, mi), TypeError, "float8_e4m3fn"),
    ],
)
def test_m_grouped_contiguous_bad_input(mutate, err, match):
    a, b, m_indices = mutate(*_small_contiguous())
    with pytest.raises(err, match=match):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices)
    with pytest.raises(err, match=match):
        ref.m_grouped_fp8_gemm_nt_contiguous_ref(a, b, m_indices)


def test_m_grouped_contiguous_bad_out():
    a, b, m_indices = _small_contiguous()
    with pytest.raises(ValueError, match=r"out must have shape \(384, 64\)"):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, out=torch.empty(384, 63))
    with pytest.raises(TypeError, match="out_dtype"):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, b, m_indices, out_dtype=torch.float16)
    with pytest.raises(TypeError, match="config"):
        gg._contiguous_triton(a, b, m_indices, None, torch.bfloat16, True, "fast")


def _small_masked(masked=(1, 2)):
    g, m_max, k, n = len(masked), 8, 128, 64
    x = torch.randn(g * m_max, k, generator=_gen(1))
    qa = per_token_cast_to_fp8(x)
    qa = (qa[0].view(g, m_max, k), qa[1].view(g, m_max, 1))
    qb = _quant_b(torch.randn(g, n, k, generator=_gen(2)))
    return qa, qb, torch.tensor(masked, dtype=torch.int32)


def test_m_grouped_masked_bad_input():
    a, b, masked_m = _small_masked()
    with pytest.raises(TypeError, match="masked_m must have dtype int32"):
        gg.m_grouped_fp8_gemm_nt_masked(a, b, masked_m.long())
    with pytest.raises(ValueError, match="one entry per group"):
        gg.m_grouped_fp8_gemm_nt_masked(a, b, masked_m[:1])
    with pytest.raises(ValueError, match="same number of groups"):
        gg.m_grouped_fp8_gemm_nt_masked(a, (b[0][:1], b[1][:1]), masked_m)
    with pytest.raises(ValueError, match="expected_m"):
        gg.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, expected_m=-1)
    with pytest.raises(ValueError, match=r"a sf must have shape \(2, 8, 1\)"):
        gg.m_grouped_fp8_gemm_nt_masked((a[0], a[1][:, :4]), b, masked_m)
    with pytest.raises(ValueError, match=r"out must have shape \(2, 8, 64\)"):
        gg.m_grouped_fp8_gemm_nt_masked(a, b, masked_m, out=torch.empty(2, 8, 65))
    # masked_m's values are checked where they are read on the host (the reference path).
    with pytest.raises(ValueError, match=r"masked_m must lie in \[0, M_max = 8\]"):
        ref.m_grouped_fp8_gemm_nt_masked_ref(a, b, torch.tensor([9, 0], dtype=torch.int32))


@runnable
def test_m_grouped_masked_clamps_on_device():
    """The Triton path never syncs on masked_m: values past M_max act as M_max, negatives as 0."""
    a, b, _ = _small_masked()
    a = tuple(t.to(DEVICE) for t in a)
    b = tuple(t.to(DEVICE) for t in b)
    wild = torch.tensor([100, -5], dtype=torch.int32, device=DEVICE)
    out = torch.full((2, 8, 64), 3.0, device=DEVICE)
    got = gg.m_grouped_fp8_gemm_nt_masked_triton(a, b, wild, None, out, torch.float32)
    want = ref.m_grouped_fp8_gemm_nt_masked_ref(
        a, b, torch.tensor([8, 0], dtype=torch.int32, device=DEVICE), out_dtype=torch.float32
    )
    a_hp = per_token_cast_back(a[0][0], a[1][0])
    b_hp = per_block_cast_back(b[0][0], b[1][0])
    _assert_close_to_ref(got[0], want[0], a_hp, b_hp, "clamped group")
    assert bool((got[1] == 3.0).all())


@runnable
def test_strided_m_indices_and_masked_m():
    """``m_indices`` / ``masked_m`` that are strided views (every other entry of a longer
    vector) give the reference's result: the kernels index them with unit stride."""
    a, b, m_indices = _small_contiguous()
    a = tuple(t.to(DEVICE) for t in a)
    b = tuple(t.to(DEVICE) for t in b)
    # Interleave junk (-1, group 1) between the real entries: a wrong stride reads it.
    junk = torch.where(m_indices == 0, 1, -1).to(torch.int32)
    wide = torch.stack([m_indices, junk], dim=1).flatten()
    strided = wide.to(DEVICE)[0::2]
    assert not strided.is_contiguous() and torch.equal(strided.cpu(), m_indices)
    got = gg.m_grouped_fp8_gemm_nt_contiguous(a, b, strided, out_dtype=torch.float32)
    want = ref.m_grouped_fp8_gemm_nt_contiguous_ref(
        a, b, m_indices.to(DEVICE), out_dtype=torch.float32
    )
    for g in range(2):
        rows = (m_indices.to(DEVICE) == g).nonzero().flatten()
        a_hp = per_token_cast_back(*a)[rows]
        b_hp = per_block_cast_back(b[0][g], b[1][g])
        _assert_close_to_ref(got[rows], want[rows], a_hp, b_hp, f"strided m_indices, group {g}")
    assert bool((got[m_indices.to(DEVICE) < 0] == 0).all())

    qa, qb, masked_m = _small_masked((5, 2))
    qa = tuple(t.to(DEVICE) for t in qa)
    qb = tuple(t.to(DEVICE) for t in qb)
    strided = torch.tensor([5, 0, 2, 0], dtype=torch.int32, device=DEVICE)[0::2]
    got = gg.m_grouped_fp8_gemm_nt_masked(qa, qb, strided, out_dtype=torch.float32)
    want = ref.m_grouped_fp8_gemm_nt_masked_ref(
        qa, qb, masked_m.to(DEVICE), out_dtype=torch.float32
    )
    for grp, rows in enumerate((5, 2)):
        a_hp = per_token_cast_back(qa[0][grp, :rows], qa[1][grp, :rows])
        b_hp = per_block_cast_back(qb[0][grp], qb[1][grp])
        _assert_close_to_ref(got[grp, :rows], want[grp, :rows], a_hp, b_hp, f"masked g{grp}")


def test_ptx_m_grouped_passes_contiguous_m_indices(monkeypatch):
    """The PTX launch hands the kernel ``m_indices`` by pointer (unit stride): a strided view
    must be made contiguous first. CPU check of the host code, with the launch stubbed."""
    from ptxtrain.gemm import ptx

    a, b, m_indices = _small_contiguous()
    seen = []
    monkeypatch.setattr(ptx, "_check_runnable", lambda *args: None)
    monkeypatch.setattr(ptx, "launch_gemm", lambda *args: seen.append(args[7][0]))
    wide = torch.stack([m_indices, torch.full_like(m_indices, -1)], dim=1).flatten()
    ptx.m_grouped_fp8_gemm_nt_contiguous(a, b, wide[0::2])
    assert len(seen) == 1 and seen[0].is_contiguous() and torch.equal(seen[0], m_indices)


def test_k_grouped_bad_input():
    q = per_token_cast_to_fp8(torch.randn(16, 256, generator=_gen(3)))
    with pytest.raises(ValueError, match="multiple of 128"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, [100, 156])
    with pytest.raises(ValueError, match="sum to K_total = 256"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, [128])
    with pytest.raises(TypeError, match="list of ints"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, [128.0, 128.0])
    with pytest.raises(TypeError, match="ks must be"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, 256)
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, [256], accumulate=True)
    with pytest.raises(TypeError, match="float32"):
        gg.k_grouped_fp8_gemm_nt_contiguous(
            q, q, [256], out=torch.empty(1, 16, 16, dtype=torch.bfloat16)
        )
    with pytest.raises(ValueError, match=r"out must have shape \(2, 16, 16\)"):
        gg.k_grouped_fp8_gemm_nt_contiguous(q, q, [128, 128], out=torch.empty(1, 16, 16))
    with pytest.raises(ValueError, match="a sf must have shape"):
        gg.k_grouped_fp8_gemm_nt_contiguous((q[0], q[1][:, :1]), q, [256])


# ---------------------------------------------------------------------------------------------
# DeepSeek-V3 expert shapes (GPU only)
# ---------------------------------------------------------------------------------------------

DSV3_EXPERT_NK = [(4096, 7168), (7168, 2048)]  # gate+up, down projections of one expert


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", DSV3_EXPERT_NK)
def test_gpu_m_grouped_contiguous_dsv3(n, k):
    sizes = (0, 1, 127, 129, 700, 1024, 1000, 1114)  # 8 groups, 4095 rows (4608 padded)
    x, w, m_indices = _contiguous_case(sizes, n, k, seed=n + k)
    qa, qb = per_token_cast_to_fp8(x), _quant_b(w)
    got = gg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices)
    _check_contiguous(got, x, w, m_indices, qa, qb, f"{n=}, {k=}")


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", DSV3_EXPERT_NK)
def test_gpu_m_grouped_masked_dsv3(n, k):
    g, m_max = 8, 256
    masked = torch.tensor([0, 1, 64, 127, 128, 129, 200, 256], dtype=torch.int32, device="cuda")
    x = _tokens(g * m_max, k, seed=k).cuda()
    w = _weights(g, n, k, seed=n).cuda()
    qa = per_token_cast_to_fp8(x)
    qa = (qa[0].view(g, m_max, k), qa[1].view(g, m_max, -1))
    got = gg.m_grouped_fp8_gemm_nt_masked(qa, _quant_b(w), masked, expected_m=128)
    x = x.view(g, m_max, k)
    for grp, rows in enumerate(masked.tolist()):
        if rows:
            diff = calc_diff(got[grp, :rows], x[grp, :rows].double() @ w[grp].double().t())
            assert diff < CALC_DIFF_MAX, f"group {grp}: {diff=:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", [(4096, 7168), (7168, 2048)])  # dW of gate+up, of down
def test_gpu_k_grouped_dsv3(m, n):
    ks = [0, 128, 256, 512, 640, 1024, 768, 768]  # 8 experts, 4096 tokens
    dy_t = _tokens(m, sum(ks), seed=m).cuda()
    x_t = _tokens(n, sum(ks), seed=n).cuda()
    got = gg.k_grouped_fp8_gemm_nt_contiguous(
        per_token_cast_to_fp8(dy_t), per_token_cast_to_fp8(x_t), ks
    )
    start = 0
    for grp, kg in enumerate(ks):
        if kg:
            oracle = dy_t[:, start : start + kg].double() @ x_t[:, start : start + kg].double().t()
            diff = calc_diff(got[grp], oracle)
            assert diff < CALC_DIFF_MAX, f"group {grp}: {diff=:.2e}"
        else:
            assert bool((got[grp] == 0).all())
        start += kg


# ---------------------------------------------------------------------------------------------
# Compile-only: the kernels build for sm_90a (no GPU needed) with FP8 WGMMAs and no spills.
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
from ptxtrain.gemm import grouped as gg
from ptxtrain.gemm.heuristics import GemmConfig

results = {}
for op, cfg in [("contiguous", GemmConfig(64, 128, 4, 3)),
                ("contiguous", GemmConfig(128, 128, 8, 3)),
                ("masked", GemmConfig(64, 64, 4, 5)),
                ("k_grouped", GemmConfig(64, 128, 4, 3))]:
    ck = gg._compile_for_sm90(op, cfg)
    wgmma = len(re.findall(r"wgmma\\.mma_async\\S*\\.e4m3\\.e4m3", ck.asm["ptx"]))
    results[f"{op}_{cfg.block_m}x{cfg.block_n}"] = {"wgmma_e4m3": wgmma,
                                                    **sass_info(ck.asm["cubin"])}
emit(results)
"""


def test_compile_for_sm90a_without_gpu(tmp_path):
    results = run_sm90_script(_COMPILE_SCRIPT, tmp_path)
    assert len(results) == 4, results
    for name, r in results.items():
        # At least 4 WGMMAs of k = 32 per 128-K block, e4m3 x e4m3 with fp32 accumulators.
        assert r["wgmma_e4m3"] >= 4, (name, r)
        if "regs" in r:  # cuobjdump present: no spills (stack frame or local memory)
            assert r["stack"] == 0 and r["local"] == 0, (name, r)


def test_masked_ptx_rule_and_cpu_routing(monkeypatch):
    """``auto`` takes the PTX masked kernel where it measured faster (M_max <= 128 or K <= 2048,
    H200), never for CPU tensors or under a forced other backend."""
    from ptxtrain.gemm import grouped as gg

    assert gg.masked_ptx_wins(64, 7168) and gg.masked_ptx_wins(128, 7168)
    assert gg.masked_ptx_wins(256, 2048) and not gg.masked_ptx_wins(256, 7168)
    a = (torch.zeros(2, 64, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 64, 2))
    b = (torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 1, 2))
    for forced in ("auto", "ptx", "triton"):
        monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", forced)
        assert gg._use_ptx_masked(a, b, None) is False  # CPU tensors: never the PTX kernel


@pytest.mark.gpu
def test_gpu_masked_auto_routing(monkeypatch):
    from ptxtrain.gemm import grouped as gg

    monkeypatch.delenv("PTXTRAIN_GEMM_BACKEND", raising=False)
    fp8 = torch.float8_e4m3fn
    for m_max, k, want in ((128, 7168, True), (256, 7168, False), (256, 2048, True)):
        a = (torch.zeros(2, m_max, k, dtype=fp8, device="cuda"),
             torch.ones(2, m_max, k // 128, device="cuda"))  # fmt: skip
        b = (torch.zeros(2, 256, k, dtype=fp8, device="cuda"),
             torch.ones(2, 2, k // 128, device="cuda"))  # fmt: skip
        assert gg._use_ptx_masked(a, b, None) is want, (m_max, k)
