"""Triton routing and permutation kernels (ptxtrain.moe.triton) against ptxtrain.moe.ref.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` with the interpreter patch
(tests/conftest.py). Every comparison is bit for bit: the kernels follow the references' order of
operations (see the design note of ptxtrain/moe/triton.py). The GPU-marked tests repeat them at
DeepSeek-V3 sizes (T = 4096, D = 7168, E = 256 in 8 groups, 4 kept, top-8); the compile-only
test builds the three kernels for sm_90 without a GPU and reads their PTX.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import ptxtrain.moe.triton as mt
from ptxtrain.moe import ref
from ptxtrain.quant.ref import AMAX_EPS, FP8_MAX, per_token_cast_to_fp8
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.testing.triton_interp import patch_applied
from tests._sm90 import run_sm90_script

INTERPRETED = mt._kernels_interpreted()
HAS_GPU = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"

runnable = pytest.mark.skipif(
    not ((INTERPRETED and patch_applied()) or (HAS_GPU and not INTERPRETED)),
    reason="kernels can't run: no GPU, and TRITON_INTERPRET=1 or the interpreter patch is missing",
)

TOKENS = (0, 1, 13, 64)
# (E, G, M, k, route_scale): V3-like groups, no group limit, one expert per group, E and E/G not
# powers of two, a single group.
ROUTING = [
    (16, 4, 2, 4, 2.5),
    (16, 4, 4, 4, 1.0),
    (16, 16, 5, 4, 1.0),
    (12, 4, 3, 3, 1.7),
    (8, 1, 1, 2, 1.0),
]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _route_kw(n_groups, n_limited, k, scale):
    return dict(top_k=k, n_groups=n_groups, n_limited_groups=n_limited, route_scale=scale)


def _logits(n_tokens, n_experts, seed, *, ties=False):
    g = _gen(seed)
    if ties:  # few distinct values (and saturated sigmoids): equal s + b within and across groups
        vals = torch.tensor([-40.0, -1.0, 0.0, 0.5, 40.0])
        return vals[torch.randint(0, len(vals), (n_tokens, n_experts), generator=g)]
    return torch.randn(n_tokens, n_experts, generator=g) * 2


def _bias(n_experts, seed, *, ties=False):
    if ties:
        return torch.zeros(n_experts)
    return torch.randn(n_experts, generator=_gen(seed)) * 0.1


def _distinct_topk(n_tokens, n_experts, k, seed):
    """[T, k] int64, k distinct experts per token (a random permutation prefix per row)."""
    g = _gen(seed)
    return torch.rand(n_tokens, n_experts, generator=g).argsort(dim=1)[:, :k].contiguous()


def _tokens(n_tokens, dim, dtype, seed):
    g = _gen(seed)
    # Heavy-tailed row magnitudes so the 1x128 scales differ from row to row.
    x = torch.randn(n_tokens, dim, generator=g) * torch.exp(
        2 * torch.randn(n_tokens, 1, generator=g)
    )
    return x.to(dtype)


def _assert_equal_outputs(got, want, names, where):
    for name, a, b in zip(names, got, want, strict=True):
        if a is None or b is None:
            assert a is None and b is None, f"{name}: {a} vs {b} ({where})"
            continue
        assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} vs {b.dtype} ({where})"
        assert_bitwise_equal(a.cpu(), b.cpu(), name=f"{name} ({where})")


# --------------------------------------------------------------------------------------------
# References: the tie rule and the padded layout, against brute force
# --------------------------------------------------------------------------------------------


def _brute_route(logits, bias, k, n_groups, n_limited, scale):
    """One token at a time in Python, ties to the lower index, the reference's fp32 gate order."""
    s_all = logits.float().sigmoid()
    c_all = s_all + bias.float()
    n_experts = logits.shape[1]
    per = n_experts // n_groups
    idx_rows, w_rows = [], []
    for s, c in zip(s_all, c_all, strict=True):
        cl = c.tolist()
        group_score = []
        for g in range(n_groups):
            top2 = sorted(c[g * per : (g + 1) * per].tolist(), reverse=True)[:2]
            group_score.append(float(torch.tensor(top2).sum()))
        kept = sorted(range(n_groups), key=lambda g: (-group_score[g], g))[:n_limited]
        cand = [e for e in range(n_experts) if e // per in kept]
        picks = sorted(cand, key=lambda e: (-cl[e], e))[:k]
        gates = s[picks]
        denom = gates[0]
        for gate in gates[1:]:
            denom = denom + gate
        idx_rows.append(picks)
        w_rows.append(gates / (denom + 1e-20) * scale)
    return torch.tensor(idx_rows, dtype=torch.int64).view(-1, k), torch.stack(w_rows)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("n_experts", "n_groups", "n_limited", "k", "scale"), ROUTING)
def test_route_from_logits_ref_rule(n_experts, n_groups, n_limited, k, scale, ties):
    logits = _logits(24, n_experts, seed=n_experts + k, ties=ties)
    bias = _bias(n_experts, seed=k, ties=ties)
    kw = _route_kw(n_groups, n_limited, k, scale)
    idx, w, s = ref.route_from_logits_ref(logits, bias, **kw)
    idx_bf, w_bf = _brute_route(logits, bias, k, n_groups, n_limited, scale)
    where = f"{n_experts=} {n_groups=} {n_limited=} {k=} {ties=}"
    # Same fp32 operations in the same order, ties to the lower index: equal bit for bit.
    assert torch.equal(idx, idx_bf), where
    assert_bitwise_equal(w, w_bf, name=f"topk_weights ({where})")
    assert_bitwise_equal(s, logits.sigmoid(), name=f"scores ({where})")


def test_route_ref_goes_through_logits():
    g = _gen(5)
    x, weight = torch.randn(20, 24, generator=g), torch.randn(16, 24, generator=g) * 0.2
    bias = _bias(16, seed=6)
    kw = _route_kw(4, 2, 4, 2.5)
    logits = torch.nn.functional.linear(x, weight)
    for a, b in zip(
        ref.route_ref(x, weight, bias, **kw), ref.route_from_logits_ref(logits, bias, **kw)
    ):
        assert torch.equal(a, b)


def _brute_layout(counts, align):
    rows, m_idx = [], []
    for e, n in enumerate(counts):
        base = len(m_idx)
        rows += [base + i for i in range(n)]
        padded = -(-n // align) * align
        m_idx += [e] * n + [-1] * (padded - n)
    return rows, m_idx


@pytest.mark.parametrize("align", [1, 4, 128])
def test_grouped_layout_ref(align):
    counts = torch.randint(0, 9, (16,), generator=_gen(align))
    counts[3] = 0  # an empty expert takes no rows
    padded_rows, m_indices = ref.grouped_layout_ref(counts, align)
    rows_bf, m_bf = _brute_layout(counts.tolist(), align)
    assert padded_rows.tolist() == rows_bf
    assert m_indices.dtype == torch.int32 and m_indices.tolist() == m_bf


# --------------------------------------------------------------------------------------------
# fused_route
# --------------------------------------------------------------------------------------------


@runnable
@pytest.mark.parametrize("n_tokens", TOKENS)
@pytest.mark.parametrize(("n_experts", "n_groups", "n_limited", "k", "scale"), ROUTING)
def test_fused_route_matches_ref(n_tokens, n_experts, n_groups, n_limited, k, scale):
    kw = _route_kw(n_groups, n_limited, k, scale)
    for ties in (False, True):
        logits = _logits(n_tokens, n_experts, seed=n_tokens + n_experts, ties=ties).to(DEVICE)
        bias = _bias(n_experts, seed=n_tokens, ties=ties).to(DEVICE)
        got = mt.fused_route(logits, bias, **kw)
        want = ref.route_from_logits_ref(logits, bias, **kw)
        where = f"{n_tokens=} {n_experts=} {n_groups=} {n_limited=} {k=} {ties=}"
        _assert_equal_outputs(got, want, ("topk_idx", "topk_weights", "scores"), where)


@runnable
def test_fused_route_low_precision_logits_and_duplicate_free():
    logits = _logits(64, 16, seed=9).to(torch.bfloat16).to(DEVICE)
    bias = _bias(16, seed=9).to(DEVICE)
    kw = _route_kw(4, 2, 4, 2.5)
    got = mt.fused_route(logits, bias, **kw)
    _assert_equal_outputs(
        got, ref.route_from_logits_ref(logits, bias, **kw), ("i", "w", "s"), "bf16"
    )
    idx = got[0].cpu()
    assert all(len(set(row)) == 4 for row in idx.tolist())  # k distinct experts per token
    assert max(len(set((row // 4).tolist())) for row in idx) <= 2  # at most M groups per token


# --------------------------------------------------------------------------------------------
# permute_quant
# --------------------------------------------------------------------------------------------

PQ_NAMES = ("x_fp8", "sf", "sorted_slots", "tokens_per_expert", "padded_rows", "m_indices")


@runnable
@pytest.mark.parametrize("n_tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_permute_quant_matches_permute_then_quantize(n_tokens, dtype):
    n_experts, k, dim = 16, 4, 200
    x = _tokens(n_tokens, dim, dtype, seed=n_tokens).to(DEVICE)
    topk_idx = _distinct_topk(n_tokens, n_experts, k, seed=n_tokens).to(DEVICE)
    got = mt.permute_quant(x, topk_idx, n_experts)
    # The brief's definition, spelled out: permute_ref, then the reference 1x128 quantizer.
    x_perm, slots, per_expert = ref.permute_ref(x, topk_idx, n_experts)
    x_fp8, sf = per_token_cast_to_fp8(x_perm)
    want = (x_fp8, sf, slots, per_expert, None, None)
    _assert_equal_outputs(got, want, PQ_NAMES, f"{n_tokens=} {dtype=}")
    assert got.x_fp8.shape == (n_tokens * k, dim) and got.sf.shape == (n_tokens * k, 2)


@runnable
@pytest.mark.parametrize("n_tokens", TOKENS)
@pytest.mark.parametrize("align", [8, 128])
def test_permute_quant_padded_layout(n_tokens, align):
    n_experts, k, dim = 16, 4, 200
    x = _tokens(n_tokens, dim, torch.bfloat16, seed=n_tokens + 1).to(DEVICE)
    topk_idx = _distinct_topk(n_tokens, n_experts, k, seed=n_tokens + 1).to(DEVICE)
    got = mt.permute_quant(x, topk_idx, n_experts, align=align)
    want = ref.permute_quant_ref(x, topk_idx, n_experts, align=align)
    _assert_equal_outputs(got, want, PQ_NAMES, f"{n_tokens=} {align=}")
    assert got.x_fp8.shape[0] % align == 0
    pad = got.m_indices == -1
    if bool(pad.any()):  # padding rows are a quantized zero row
        assert not bool(got.x_fp8[pad].view(torch.uint8).any())
        expected_sf = torch.tensor(AMAX_EPS) / torch.tensor(FP8_MAX)
        assert bool((got.sf[pad].cpu() == expected_sf).all())


@runnable
def test_permute_quant_duplicates_strides_and_mn_major():
    n_experts, dim = 16, 200
    x = _tokens(13, 2 * dim, torch.bfloat16, seed=3).to(DEVICE)[:, ::2]  # stride(-1) == 2
    topk_idx = torch.randint(0, n_experts, (13, 4), generator=_gen(3)).to(DEVICE)
    topk_idx[:, 1] = topk_idx[:, 0]  # one expert twice per token: each slot is its own row
    got = mt.permute_quant(x, topk_idx, n_experts, align=8, sf_layout="mn_major")
    want = ref.permute_quant_ref(x, topk_idx, n_experts, align=8)
    _assert_equal_outputs(got, want, PQ_NAMES, "duplicates, strided x, mn_major sf")
    assert got.sf.stride(0) == 1


# --------------------------------------------------------------------------------------------
# unpermute_weighted
# --------------------------------------------------------------------------------------------


@runnable
@pytest.mark.parametrize("n_tokens", TOKENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpermute_weighted_matches_ref(n_tokens, dtype):
    n_experts, k, dim = 16, 4, 200
    logits, bias = _logits(n_tokens, n_experts, seed=n_tokens), _bias(n_experts, seed=1)
    topk_idx, topk_w, _ = ref.route_from_logits_ref(logits, bias, **_route_kw(4, 2, k, 2.5))
    _, slots, _ = ref.permute_ref(torch.empty(n_tokens, 0), topk_idx, n_experts)
    y = _tokens(n_tokens * k, dim, dtype, seed=n_tokens + 2)
    got = mt.unpermute_weighted(y.to(DEVICE), slots.to(DEVICE), topk_w.to(DEVICE), n_tokens)
    # fp32 products summed in ascending row order, as the CPU index_add: bitwise.
    assert_bitwise_equal(
        got.cpu(), ref.unpermute_ref(y, slots, topk_w), name=f"{n_tokens=} {dtype=}"
    )
    # Without the range check (the layer's own slots): the same kernel, the same bits.
    unchecked = mt.unpermute_weighted(
        y.to(DEVICE), slots.to(DEVICE), topk_w.to(DEVICE), n_tokens, check_slots=False
    )
    assert_bitwise_equal(unchecked, got, name=f"unchecked {n_tokens=} {dtype=}")


@runnable
@pytest.mark.parametrize("n_tokens", [13, 64])
def test_unpermute_weighted_padded_rows(n_tokens):
    n_experts, k, dim = 16, 4, 200
    x = _tokens(n_tokens, dim, torch.bfloat16, seed=7)
    topk_idx = _distinct_topk(n_tokens, n_experts, k, seed=7)
    topk_w = torch.rand(n_tokens, k, generator=_gen(8))
    perm = mt.permute_quant(x.to(DEVICE), topk_idx.to(DEVICE), n_experts, align=8)
    y = _tokens(perm.x_fp8.shape[0], dim, torch.bfloat16, seed=9)  # expert outputs, padded layout
    got = mt.unpermute_weighted(
        y.to(DEVICE), perm.sorted_slots, topk_w.to(DEVICE), n_tokens, padded_rows=perm.padded_rows
    )
    want = ref.unpermute_ref(y[perm.padded_rows.cpu()], perm.sorted_slots.cpu(), topk_w)
    assert_bitwise_equal(got.cpu(), want, name=f"padded {n_tokens=}")


# --------------------------------------------------------------------------------------------
# Bad input: clear errors before any launch
# --------------------------------------------------------------------------------------------


def test_bad_input_raises():
    logits, bias = torch.randn(4, 16), torch.zeros(16)
    kw = _route_kw(4, 2, 4, 1.0)
    with pytest.raises(ValueError, match="bias"):
        mt.fused_route(logits, torch.zeros(15), **kw)
    with pytest.raises(TypeError, match="logits"):
        mt.fused_route(logits.long(), bias, **kw)
    with pytest.raises(ValueError, match="top_k"):
        mt.fused_route(logits, bias, **_route_kw(4, 2, 9, 1.0))
    with pytest.raises(ValueError, match="n_groups"):
        mt.fused_route(logits, bias, **_route_kw(5, 2, 4, 1.0))
    with pytest.raises(TypeError, match="top_k"):
        mt.fused_route(logits, bias, **_route_kw(4, 2, 2.0, 1.0))

    x, idx = torch.randn(4, 200), torch.randint(0, 16, (4, 2))
    with pytest.raises(ValueError, match="topk_idx values"):
        mt.permute_quant(x, idx + 8, 16)
    with pytest.raises(ValueError, match="topk_idx"):
        mt.permute_quant(x, idx[:3], 16)
    with pytest.raises(TypeError, match="topk_idx"):
        mt.permute_quant(x, idx.int(), 16)
    with pytest.raises(ValueError, match="align"):
        mt.permute_quant(x, idx, 16, align=0)
    with pytest.raises(ValueError, match="sf_layout"):
        mt.permute_quant(x, idx, 16, sf_layout="col")

    y, slots, w = torch.randn(8, 200), torch.arange(8), torch.rand(4, 2)
    with pytest.raises(ValueError, match="y must be"):
        mt.unpermute_weighted(y[:7], slots, w, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        mt.unpermute_weighted(y, slots, w, 5)
    with pytest.raises(ValueError, match="sorted_slots values"):
        mt.unpermute_weighted(y, slots + 1, w, 4)
    with pytest.raises(ValueError, match="padded_rows values"):
        mt.unpermute_weighted(y, slots, w, 4, padded_rows=slots + 3)
    with pytest.raises(TypeError, match="sorted_slots"):
        mt.unpermute_weighted(y, slots.float(), w, 4)
    with pytest.raises(ValueError, match=r"y must be \[num_valid, D\] = \[5, D\]"):
        mt.unpermute_weighted(y, slots, w, 4, num_valid=5)
    with pytest.raises(ValueError, match="num_valid must be in"):
        mt.unpermute_weighted(y, slots, w, 4, num_valid=9)
    with pytest.raises(ValueError, match="num_valid and padded_rows exclude each other"):
        mt.unpermute_weighted(y[:5], slots, w, 4, num_valid=5, padded_rows=slots)


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    monkeypatch.setattr(mt, "_kernels_interpreted", lambda: False)
    cuda_needed = r"must be a CUDA tensor.*TRITON_INTERPRET=1"
    with pytest.raises(ValueError, match=cuda_needed):
        mt.fused_route(torch.randn(4, 16), torch.zeros(16), **_route_kw(4, 2, 4, 1.0))
    with pytest.raises(ValueError, match=cuda_needed):
        mt.permute_quant(torch.randn(4, 200), torch.randint(0, 16, (4, 2)), 16)
    with pytest.raises(ValueError, match=cuda_needed):
        mt.unpermute_weighted(torch.randn(8, 200), torch.arange(8), torch.rand(4, 2), 4)


# --------------------------------------------------------------------------------------------
# DeepSeek-V3 sizes on a GPU
# --------------------------------------------------------------------------------------------

V3 = dict(n_tokens=4096, dim=7168, n_experts=256, n_groups=8, n_limited=4, k=8, scale=2.5)


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True])
def test_v3_fused_route_gpu(ties):
    logits = _logits(V3["n_tokens"], V3["n_experts"], seed=11, ties=ties).cuda()
    bias = _bias(V3["n_experts"], seed=11, ties=ties).cuda()
    kw = _route_kw(V3["n_groups"], V3["n_limited"], V3["k"], V3["scale"])
    got = mt.fused_route(logits, bias, **kw)
    want = ref.route_from_logits_ref(logits, bias, **kw)  # same device: bitwise
    _assert_equal_outputs(got, want, ("topk_idx", "topk_weights", "scores"), f"V3 route {ties=}")


@pytest.mark.gpu
@pytest.mark.parametrize("align", [None, 128])
def test_v3_permute_quant_gpu(align):
    x = _tokens(V3["n_tokens"], V3["dim"], torch.bfloat16, seed=12).cuda()
    idx = _distinct_topk(V3["n_tokens"], V3["n_experts"], V3["k"], seed=12).cuda()
    got = mt.permute_quant(x, idx, V3["n_experts"], align=align)
    want = ref.permute_quant_ref(x, idx, V3["n_experts"], align=align)
    _assert_equal_outputs(got, want, PQ_NAMES, f"V3 permute_quant {align=}")


@pytest.mark.gpu
def test_v3_unpermute_weighted_gpu():
    n, k = V3["n_tokens"], V3["k"]
    idx = _distinct_topk(n, V3["n_experts"], k, seed=13)
    w = torch.rand(n, k, generator=_gen(13))
    _, slots, _ = ref.permute_ref(torch.empty(n, 0), idx, V3["n_experts"])
    y = _tokens(n * k, V3["dim"], torch.bfloat16, seed=13)
    got = mt.unpermute_weighted(y.cuda(), slots.cuda(), w.cuda(), n)
    # The CPU reference adds in a fixed order (CUDA's index_add uses atomics): bitwise.
    assert_bitwise_equal(got.cpu(), ref.unpermute_ref(y, slots, w), name="V3 unpermute")
    # Only the first rows (an EP rank's own experts' slots; the rest skipped): bitwise too.
    nv = n * k * 3 // 5
    got = mt.unpermute_weighted(y[:nv].cuda(), slots.cuda(), w.cuda(), n, num_valid=nv)
    want = ref.unpermute_ref(y[:nv], slots, w, num_valid=nv)
    assert_bitwise_equal(got.cpu(), want, name="V3 unpermute, valid rows only")


# --------------------------------------------------------------------------------------------
# Compile-only: the kernels' PTX for sm_90 at DeepSeek-V3 constants, no GPU needed
# --------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
import ptxtrain.moe.triton as mt

cases = {  # kernel, pointer types, constexprs, enable_fp_fusion (as the wrappers launch)
    "route": (mt._route_kernel,
              {"scores_ptr": "*fp32", "bias_ptr": "*fp32", "idx_ptr": "*i64", "w_ptr": "*fp32"},
              dict(E=256, G=8, PG=32, GP=8, PGP=32, N_LIMITED=4, K=8, KP=8, BLOCK_T=8),
              False),
    "scatter_quant": (mt._scatter_quant_kernel,
                      {"x_ptr": "*bf16", "slot_row_ptr": "*i64", "q_ptr": "*fp8e4nv",
                       "sf_ptr": "*fp32"},
                      dict(K=8, BLOCK_M=64, BLOCK_K=128), True),
    "padding": (mt._padding_rows_kernel,
                {"m_idx_ptr": "*i32", "q_ptr": "*fp8e4nv", "sf_ptr": "*fp32"},
                dict(BLOCK_M=64, BLOCK_K=128), True),
    "unpermute": (mt._unpermute_kernel,
                  {"y_ptr": "*bf16", "slot_row_ptr": "*i64", "w_ptr": "*fp32",
                   "out_ptr": "*bf16"},
                  dict(K=8, KP=8, BLOCK_T=16, BLOCK_D=256), False),
}
result = {}
for label, (kernel, ptrs, consts, fusion) in cases.items():
    sig = {n: ptrs.get(n, "fp32" if n == "route_scale" else "i32")
           for n in kernel.arg_names if n not in consts}
    sig.update({n: "constexpr" for n in consts})
    # What the launcher infers at D = 7168: 16-byte aligned pointers, D and row strides
    # divisible by 16.
    aligned = list(ptrs) + [n for n in ("D", "stride_xm", "stride_qm", "stride_ym",
                                        "stride_om") if n in kernel.arg_names]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=target,
                              options={"num_warps": 4, "enable_fp_fusion": fusion})
    ptx = compiled.asm["ptx"]
    result[label] = {
        "fma": ptx.count("fma.rn.f32"),
        "div_rn": ptx.count("div.rn.f32"),
        "div_approx": len(re.findall(r"div\\.(full|approx)\\.f32", ptx)),
        "cvt_e4m3x2": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
        "ld_global": re.findall(r"ld\\.global[.\\w]*", ptx),
        "st_global": re.findall(r"st\\.global[.\\w]*", ptx),
    }
emit(result)
"""


def test_compile_kernels_for_sm90_ptx(tmp_path):
    result = run_sm90_script(_COMPILE_SCRIPT, tmp_path)
    route, quant, unperm = result["route"], result["scatter_quant"], result["unpermute"]
    # Exactness needs separately rounded multiplies and adds where the reference has them: with
    # fp contraction off no FMA appears, and the gate division is IEEE div.rn, never div.full.
    assert route["fma"] == 0 and route["div_rn"] > 0 and route["div_approx"] == 0, route
    assert unperm["fma"] == 0, unperm
    # The quantizer's saturating RNE cast and its IEEE-exact division (ptxtrain.quant.triton).
    assert quant["cvt_e4m3x2"] > 0 and quant["div_approx"] == 0, quant
    # The D-wide rows (and the score rows) arrive in 128-bit vectors.
    for r in (route, quant, unperm):
        assert any(".v4." in op for op in r["ld_global"]), r
    # The fp8 rows leave in 128-bit vectors (a scattered row is still 128 contiguous bytes).
    for r in (quant, result["padding"]):
        assert any(".v4." in op for op in r["st_global"]), r
