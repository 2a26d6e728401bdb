"""Triton block-scaled FP8 GEMMs against the unquantized product and the reference GEMM.

Without a GPU the kernels run in Triton's CPU interpreter (tests/gemm/conftest.py sets
``TRITON_INTERPRET=1``); shapes stay small there (cost grows with programs x K steps). The
GPU-marked tests repeat the checks at the DeepSeek-V3 shapes. The compile-only test builds the
kernels for sm_90a without a GPU and reads their PTX and SASS.
"""

import pytest
import torch

pytest.importorskip("triton")

import ptxtrain.gemm.triton as tg
from ptxtrain.gemm import ref
from ptxtrain.gemm.heuristics import VARIANTS, GemmConfig, select_config
from ptxtrain.quant.ref import (
    FP8_DTYPE,
    per_block_cast_back,
    per_block_cast_to_fp8,
    per_token_cast_back,
    per_token_cast_to_fp8,
)
from ptxtrain.testing import assert_bitwise_equal, calc_diff
from ptxtrain.testing.shapes import DSV3_DENSE_NK, DSV3_EXTRA_NK, DSV3_WGRAD_K, DSV3_WGRAD_MN
from tests._sm90 import run_sm90_script
from tests.gemm._bounds import BF16_REL, CALC_DIFF_MAX, REF_REL
from tests.gemm._inputs import scaled_operands

INTERPRETED = tg.is_interpreted()
HAS_GPU = torch.cuda.is_available()
DEVICE = "cpu" if INTERPRETED else "cuda"

runnable = pytest.mark.skipif(
    not (INTERPRETED or HAS_GPU),
    reason=(
        "kernels can't run: no GPU, and ptxtrain.gemm.triton was imported before "
        "TRITON_INTERPRET=1 was set (tests/gemm/conftest.py sets it; set it in tests/conftest.py "
        "if another module imports the kernels first)"
    ),
)


def _inputs(m, n, k, seed, device=DEVICE):
    return scaled_operands(m, n, k, seed, device)


def _quantize(x, w, kind):
    qa = per_token_cast_to_fp8(x)
    qb = per_block_cast_to_fp8(w) if kind == "1d2d" else per_token_cast_to_fp8(w)
    return qa, qb


def _dequant(qa, qb, kind):
    a_hp = per_token_cast_back(*qa)
    b_hp = per_block_cast_back(*qb) if kind == "1d2d" else per_token_cast_back(*qb)
    return a_hp, b_hp


def _assert_matches_ref(got, want, qa, qb, kind, what):
    """``got`` within fp32-reordering (plus bf16 rounding) of the reference GEMM ``want``."""
    a_hp, b_hp = _dequant(qa, qb, kind)
    bound = REF_REL * (a_hp.abs() @ b_hp.abs().t()).double()  # [M, N]
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


def _oracle_diff(got, x, w):
    return calc_diff(got, x.double() @ w.double().t())


# M from the awkward set (0, 1, 13, 129), N and K with tails, and DeepSeek-V3 shapes scaled down
# by 16 with their tails kept (2112x7168 -> 192x384, 7168x16384 -> 384x1024, 576 stays).
CPU_SHAPES = [
    (0, 200, 300),
    (1, 576, 200),
    (13, 200, 300),
    (129, 300, 384),
    (13, 192, 384),
    (1, 384, 1024),
]


@runnable
@pytest.mark.parametrize("m,n,k", CPU_SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_nt_oracle_and_reference(m, n, k, out_dtype):
    x, w = _inputs(m, n, k, seed=m * 7 + n + k)
    qa, qb = _quantize(x, w, "1d2d")
    got = tg.fp8_gemm_nt(qa, qb, out_dtype=out_dtype)
    assert got.shape == (m, n) and got.dtype == out_dtype and got.device == x.device
    diff = _oracle_diff(got, x, w)
    assert diff < CALC_DIFF_MAX, f"{m=}, {n=}, {k=}, {diff=:.2e}"
    want = ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    _assert_matches_ref(got, want, qa, qb, "1d2d", f"{m=}, {n=}, {k=}")


# Tiles and variants on one shape with M, N and K tails (K = 208: 16-byte rows, so TMA applies).
# 64-wide tiles take sf_b as one scalar per step; 256-wide ones straddle two 128-row scale blocks.
VARIANT_CASES = [
    (GemmConfig(64, 64, 4, 2), None),
    (GemmConfig(128, 128, 8, 2), None),
    (GemmConfig(64, 256, 8, 2), None),
    (GemmConfig(128, 256, 8, 2, 1, "tma"), None),
    (GemmConfig(64, 128, 4, 2, 2, "tma_persistent", 2), 1),  # 2 programs walk 9 tiles
    (GemmConfig(64, 64, 4, 2, 8, "persistent"), 3),
]


@runnable
@pytest.mark.parametrize("cfg,num_sms", VARIANT_CASES, ids=lambda v: str(v).replace(" ", ""))
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
def test_tiles_and_variants(cfg, num_sms, kind):
    m, n, k = 129, 300, 208
    x, w = _inputs(m, n, k, seed=5)
    qa, qb = _quantize(x, w, kind)
    got = tg.fp8_gemm(kind, qa, qb, None, torch.float32, False, cfg, num_sms=num_sms)
    if kind == "1d2d":
        want = ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    else:
        want = ref.fp8_gemm_nt_1d1d(qa, qb)
    _assert_matches_ref(got, want, qa, qb, kind, f"{kind} {cfg}")
    assert _oracle_diff(got, x, w) < CALC_DIFF_MAX


def test_tma_configs_fall_back_to_their_pointer_twin():
    # TMA needs 16-byte aligned K-major rows: a [M, 200] fp8 operand (200-byte rows) cannot,
    # so the TMA variants run as their pointer twins.
    a = torch.zeros(64, 200, dtype=torch.float8_e4m3fn)
    b = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    cases = [
        (GemmConfig(64, 128, 4, 3, 8, "tma"), GemmConfig(64, 128, 4, 3, 8, "tiled")),
        (
            GemmConfig(64, 128, 4, 3, 8, "tma_persistent", 2),
            GemmConfig(64, 128, 4, 3, 8, "persistent", 2),
        ),
    ]
    for cfg, want in cases:
        assert tg._effective_config(cfg, a, b) == want, cfg
        assert tg._effective_config(cfg, b, b) == cfg  # 256-byte rows: TMA as asked


@runnable
@pytest.mark.parametrize("m,n,k", [(13, 200, 300), (129, 260, 384), (1, 64, 128)])
def test_fp8_gemm_nt_1d1d_and_accumulate(m, n, k):
    x, w = _inputs(m, n, k, seed=m + n + k)
    qa, qb = _quantize(x, w, "1d1d")
    got = tg.fp8_gemm_nt_1d1d(qa, qb)
    assert got.shape == (m, n) and got.dtype == torch.float32
    diff = _oracle_diff(got, x, w)
    assert diff < CALC_DIFF_MAX, f"{m=}, {n=}, {k=}, {diff=:.2e}"
    want = ref.fp8_gemm_nt_1d1d(qa, qb)
    _assert_matches_ref(got, want, qa, qb, "1d1d", f"{m=}, {n=}, {k=}")
    c = torch.randn(m, n, generator=torch.Generator().manual_seed(1)).to(x.device)
    out = c.clone()
    res = tg.fp8_gemm_nt_1d1d(qa, qb, out=out, accumulate=True)
    assert res is out
    # out = c + (this kernel's product): one more fp32 rounding of the sum.
    torch.testing.assert_close(out, c + got, rtol=2e-7, atol=1e-6)
    out2 = torch.full_like(c, float("nan"))
    tg.fp8_gemm_nt_1d1d(qa, qb, out=out2)  # accumulate=False overwrites, NaNs included
    assert_bitwise_equal(out2, got, "1d1d with out")
    got16 = tg.fp8_gemm_nt_1d1d(qa, qb, out_dtype=torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    # One rounding of the same fp32 sum to bf16 (8 significant bits; the interpreter truncates,
    # the GPU rounds to nearest): within 2^-7 relative of the fp32 result, never further.
    torch.testing.assert_close(got16.float(), got, rtol=2**-7, atol=1e-30)


@runnable
def test_layouts_give_identical_results():
    """MN-major sf_a, padded rows, strided scales and a transposed out view change no bit."""
    m, n, k = 13, 200, 300
    x, w = _inputs(m, n, k, seed=3)
    (a8, sa), (b8, sb) = _quantize(x, w, "1d2d")
    base = tg.fp8_gemm_nt((a8, sa), (b8, sb), out_dtype=torch.float32)
    # sf_a MN-major, as cuBLAS wants it (docs/design.md §2): strides (1, M).
    sa_mn = sa.t().contiguous().t()
    assert sa_mn.stride() == (1, m)
    assert_bitwise_equal(tg.fp8_gemm_nt((a8, sa_mn), (b8, sb), out_dtype=torch.float32), base)
    # fp8 rows padded to 320 bytes, sf_b a column slice of a wider tensor.
    a_pad = torch.zeros(m, 320, dtype=torch.uint8, device=a8.device).view(FP8_DTYPE)[:, :k]
    a_pad.copy_(a8)
    sb_wide = torch.zeros(sb.shape[0], sb.shape[1] + 3, device=sb.device)[:, 1 : 1 + sb.shape[1]]
    sb_wide.copy_(sb)
    got = tg.fp8_gemm_nt((a_pad, sa), (b8, sb_wide), out_dtype=torch.float32)
    assert_bitwise_equal(got, base, "padded a, strided sf_b")
    # out as a transposed view of an [N, M] buffer.
    buf = torch.full((n, m), float("nan"), device=x.device)
    res = tg.fp8_gemm_nt((a8, sa), (b8, sb), out=buf.t())
    assert_bitwise_equal(buf.t(), base, "transposed out")
    assert res.data_ptr() == buf.data_ptr()
    # 1D1D: sf_b MN-major too.
    qb1 = per_token_cast_to_fp8(w)
    base1 = tg.fp8_gemm_nt_1d1d((a8, sa), qb1)
    got1 = tg.fp8_gemm_nt_1d1d((a8, sa_mn), (qb1[0], qb1[1].t().contiguous().t()))
    assert_bitwise_equal(got1, base1, "1d1d MN-major scales")


@runnable
def test_scales_are_applied_per_128_k_block():
    # Independent formulation: D = Σ_kb sf_a[:, kb] sf_b[nb, kb] (A_kb · B_kbᵀ) in float64 — the
    # sum the kernel promotes to FP32 once per 128 K. Scales spread over 2^±12 so that a scale
    # taken from the wrong row, column block or K block is off by orders of magnitude.
    m, n, k = 70, 260, 384
    g = torch.Generator().manual_seed(11)
    (a8, sa), (b8, sb) = _quantize(*_inputs(m, n, k, seed=11), "1d2d")
    sa = torch.ldexp(torch.ones_like(sa), torch.randint(-12, 13, sa.shape, generator=g).to(DEVICE))
    sb = torch.ldexp(torch.ones_like(sb), torch.randint(-12, 13, sb.shape, generator=g).to(DEVICE))
    want = torch.zeros(m, n, dtype=torch.float64, device=DEVICE)
    for kb in range(sa.shape[1]):
        ks = slice(kb * 128, (kb + 1) * 128)
        part = a8[:, ks].double() @ b8[:, ks].double().t()  # [M, N], exact
        sfb = sb[:, kb].double().repeat_interleave(128)[:n]  # [N]
        want += part * sa[:, kb].double()[:, None] * sfb[None, :]
    got = tg.fp8_gemm_nt((a8, sa), (b8, sb), out_dtype=torch.float32)
    _assert_matches_ref(got, want, (a8, sa), (b8, sb), "1d2d", "per-block scales")


@runnable
def test_interpreter_decodes_every_e4m3_code():
    # D = A · Iᵀ with unit scales reproduces A exactly: every finite e4m3 code (subnormals, ±0,
    # ±448) must come back as its value. Under the interpreter this checks that tl.dot decodes
    # fp8 operands exactly; on a GPU it checks the same through the tensor cores.
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # drop the two NaN codes
    a8 = codes.repeat(3)[: 4 * 128].view(4, 128).view(FP8_DTYPE).to(DEVICE)
    eye = torch.eye(128).to(FP8_DTYPE).to(DEVICE)
    got = tg.fp8_gemm_nt(
        (a8, torch.ones(4, 1, device=DEVICE)),
        (eye, torch.ones(1, 1, device=DEVICE)),
        out_dtype=torch.float32,
    )
    # torch.equal: -0.0 (code 0x80) times 1 plus +0.0 products sums to +0.0, equal in value.
    assert torch.equal(got, a8.float()), (got != a8.float()).nonzero()[:5]


@runnable
def test_empty_sizes_launch_nothing(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("a kernel was launched for an empty GEMM")

    monkeypatch.setattr(tg, "_launch", no_launch)
    for m, n, k in ((0, 200, 300), (13, 0, 300)):
        qa, qb = _quantize(*_inputs(m, n, k, seed=0), "1d2d")
        got = tg.fp8_gemm_nt(qa, qb)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # K = 0: zeros; with accumulate, out is left as it was.
    qa, qb = _quantize(*_inputs(5, 7, 0, seed=0), "1d1d")
    out = torch.full((5, 7), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    res = tg.fp8_gemm_nt(qa, (qb[0], torch.ones(1, 0, device=DEVICE)), out=out)
    assert res is out and torch.all(out == 0)
    acc = torch.randn(5, 7, device=DEVICE)
    before = acc.clone()
    tg.fp8_gemm_nt_1d1d(qa, qb, out=acc, accumulate=True)
    assert_bitwise_equal(acc, before, "K = 0 accumulate")


def _bad_cases():
    x, w = _inputs(4, 6, 256, seed=2, device="cpu")
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    qb1 = per_token_cast_to_fp8(w)
    w200 = per_block_cast_to_fp8(torch.randn(6, 200))
    return [
        ("nt", (qa, w200), {}),  # K mismatch
        ("nt", (qa, qb1), {}),  # 1x128 scales where 128x128 are needed
        ("nt", ((qa[0], qa[1][:, :1]), qb), {}),  # sf_a too narrow
        ("nt", (qa[0], qb), {}),  # not a pair
        ("nt", ((x, qa[1]), qb), {}),  # fp32 data
        ("nt", ((qa[0], qa[1].double()), qb), {}),  # fp64 scales
        ("nt", (qa, qb), {"out_dtype": torch.float16}),
        ("nt", (qa, qb), {"out": torch.empty(6, 4)}),
        ("nt", (qa, qb), {"out": torch.empty(4, 6, dtype=torch.float16)}),
        ("1d1d", (qa, qb1), {"accumulate": True}),
        ("1d1d", (qa, qb1), {"out": torch.empty(4, 6, dtype=torch.float16)}),
        ("1d1d", (qa, qb1), {"out": torch.empty(4, 6, dtype=torch.bfloat16), "accumulate": True}),
        ("1d1d", (qa, qb1), {"out_dtype": torch.float16}),
        ("1d1d", (qa, qb), {}),  # 128x128 scales where 1x128 are needed
        ("1d1d", ((qa[0][:, :128], qa[1][:, :1]), qb1), {}),  # K mismatch
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input_raises_like_the_reference_before_launch(case, monkeypatch):
    kind, args, kwargs = _bad_cases()[case]
    monkeypatch.setattr(tg, "_launch", lambda *a, **k: pytest.fail("launched on bad input"))
    ref_fn = ref.fp8_gemm_nt if kind == "nt" else ref.fp8_gemm_nt_1d1d
    tri_fn = tg.fp8_gemm_nt if kind == "nt" else tg.fp8_gemm_nt_1d1d
    with pytest.raises((TypeError, ValueError)) as want:
        ref_fn(*args, **kwargs)
    with pytest.raises(want.type) as got:
        tri_fn(*args, **kwargs)
    assert str(got.value) == str(want.value)


def test_backend_specific_errors(monkeypatch):
    monkeypatch.setattr(tg, "_launch", lambda *a, **k: pytest.fail("launched on bad input"))
    x, w = _inputs(4, 6, 256, seed=2, device="cpu")
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    with pytest.raises(TypeError, match="config must be a GemmConfig, 'autotune' or None"):
        tg.fp8_gemm_nt(qa, qb, config="fastest")
    with pytest.raises(ValueError, match="out must not repeat memory"):
        tg.fp8_gemm_nt(qa, qb, out=torch.empty(1, 6, dtype=torch.bfloat16).expand(4, 6))
    with pytest.raises(
        ValueError, match="tensors must be on one device, got a on cpu, sf_a on meta"
    ):
        tg.fp8_gemm_nt((qa[0], qa[1].to("meta")), qb)
    monkeypatch.setattr(tg, "is_interpreted", lambda: False)
    with pytest.raises(ValueError, match="needs CUDA tensors, got cpu"):
        tg.fp8_gemm_nt(qa, qb)


def test_fp8_gemm_refuses_an_unknown_kind_and_1d2d_accumulate(monkeypatch):
    monkeypatch.setattr(tg, "_launch", lambda *a, **k: pytest.fail("launched on bad input"))
    x, w = _inputs(4, 6, 256, seed=3, device="cpu")
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    out = torch.randn(4, 6)
    with pytest.raises(ValueError, match="kind must be '1d2d' or '1d1d', got '2d2d'"):
        tg.fp8_gemm("2d2d", qa, qb, out, torch.float32, False, None)
    with pytest.raises(ValueError, match="accumulate: the 1D2D GEMM has no accumulate mode"):
        tg.fp8_gemm("1d2d", qa, qb, out, torch.float32, True, None)


@runnable
def test_autotune_picks_a_correct_config_once(monkeypatch):
    m, n, k = 13, 64, 128
    x, w = _inputs(m, n, k, seed=4)
    qa, qb = _quantize(x, w, "1d2d")
    timed = []
    real = tg._time_once
    monkeypatch.setattr(tg, "_time_once", lambda fn, dev: timed.append(1) or real(fn, dev))
    monkeypatch.setattr(tg, "_TUNED", {})
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    tg.fp8_gemm_nt(qa, qb, out=out, config="autotune")
    assert len(timed) > 1 and len(tg._TUNED) == 1
    cfg = next(iter(tg._TUNED.values()))
    assert isinstance(cfg, GemmConfig)
    _assert_matches_ref(out, ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32), qa, qb, "1d2d", "")
    n_timed = len(timed)
    tg.fp8_gemm_nt(qa, qb, out=out, config="autotune")  # same bucket: cached, not re-timed
    assert len(timed) == n_timed


# ---------------------------------------------------------------------------------------------
# Compile-only: sm_90a PTX / SASS without a GPU
# ---------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = """
from ptxtrain.gemm import triton as tg
from ptxtrain.gemm.heuristics import GemmConfig

results = {}
for name, kind, cfg in [
    ("1d2d_tma", "1d2d", GemmConfig(64, 128, 4, 3, 8, "tma")),
    ("1d2d_tiled_bn256", "1d2d", GemmConfig(64, 256, 8, 3, 8, "tiled")),
    ("1d1d_tma_persistent", "1d1d", GemmConfig(64, 128, 4, 3, 8, "tma_persistent", 2)),
]:
    ck = tg._compile_for_sm90(kind, cfg)
    ptx = ck.asm["ptx"]
    results[name] = {"wgmma_e4m3": len(re.findall(r"wgmma\\.mma_async\\S*\\.e4m3\\.e4m3", ptx)),
                     "tma": len(re.findall(r"cp\\.async\\.bulk\\.tensor", ptx)),
                     "ws_ops": ck.asm["ttgir"].count("ttg.warp_specialize("),
                     "warps": ck.metadata.num_warps,
                     **sass_info(ck.asm["cubin"])}
emit(results)
"""


def test_compile_for_sm90a_without_gpu(tmp_path):
    results = run_sm90_script(_COMPILE_SCRIPT, tmp_path)
    assert len(results) == 3, results
    for name, r in results.items():
        # 4 WGMMAs of k = 32 per 128-K block, e4m3 x e4m3 with fp32 accumulators.
        assert r["wgmma_e4m3"] >= 4, (name, r)
        assert (r["tma"] > 0) == ("tma" in name), (name, r)
        # No warp-specialized region (Triton 3.6's Hopper pass faults on sm_90).
        assert r["ws_ops"] == 0 and r["warps"] == 4 * (1 + ("bn256" in name)), (name, r)
        if "sass_qgmma" not in r:
            continue  # cuobjdump missing from the wheel: PTX checks only
        assert any(q.endswith("F32.E4M3.E4M3") for q in r["sass_qgmma"]), (name, r)
        if "regs" in r:
            # No spills: spilled registers would show as a stack frame or local memory.
            assert r["stack"] == 0 and r["local"] == 0, (name, r)
            assert r["regs"] <= 255, (name, r)


# ---------------------------------------------------------------------------------------------
# GPU: DeepSeek-V3 shapes
# ---------------------------------------------------------------------------------------------

GPU_M = (1, 64, 128, 4096)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", DSV3_DENSE_NK + DSV3_EXTRA_NK)
@pytest.mark.parametrize("m", GPU_M)
def test_gpu_fp8_gemm_nt_dsv3(m, n, k):
    x, w = _inputs(m, n, k, seed=m + n + k, device="cuda")
    qa, qb = _quantize(x, w, "1d2d")
    got = tg.fp8_gemm_nt(qa, qb)
    diff = _oracle_diff(got, x, w)
    assert diff < CALC_DIFF_MAX, f"{m=}, {n=}, {k=}, {diff=:.2e}"
    want = ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    # The tensor cores sum each 128-K block in their own order and precision (about fp32, ~14
    # bits kept per DeepSeek-V3 §3.3 before promotion): compare relative to the result's scale.
    rel = (got.double() - want.double()).norm() / want.double().norm()
    assert rel < 5e-3, f"{m=}, {n=}, {k=}, {rel=:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", DSV3_WGRAD_MN)
@pytest.mark.parametrize("k", DSV3_WGRAD_K[:1])
def test_gpu_fp8_gemm_nt_1d1d_wgrad(m, n, k):
    x, w = _inputs(m, n, k, seed=m + n, device="cuda")
    qa, qb = _quantize(x, w, "1d1d")
    got = tg.fp8_gemm_nt_1d1d(qa, qb)
    diff = _oracle_diff(got, x, w)
    assert diff < CALC_DIFF_MAX, f"{m=}, {n=}, {k=}, {diff=:.2e}"
    out = torch.randn(m, n, device="cuda")
    c = out.clone()
    tg.fp8_gemm_nt_1d1d(qa, qb, out=out, accumulate=True)
    torch.testing.assert_close(out, c + got, rtol=1e-5, atol=1e-4)  # fp32 add, GEMM re-run


@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
@pytest.mark.parametrize("m,n,k", [(129, 576, 7168), (4096, 2112, 1536), (13, 300, 200)])
def test_gpu_every_variant(variant, kind, m, n, k):
    x, w = _inputs(m, n, k, seed=7, device="cuda")
    qa, qb = _quantize(x, w, kind)
    cfg = select_config(m, n, k, kind, variant=variant)
    out = torch.full((m, n), float("nan"), device="cuda")
    tg.fp8_gemm(kind, qa, qb, out, torch.float32, False, cfg)
    diff = _oracle_diff(out, x, w)
    assert diff < CALC_DIFF_MAX, f"{kind} {variant} {m=}, {n=}, {k=}, {diff=:.2e}"


@pytest.mark.gpu
def test_gpu_autotune():
    m, n, k = 256, 2112, 1536
    x, w = _inputs(m, n, k, seed=8, device="cuda")
    qa, qb = _quantize(x, w, "1d2d")
    got = tg.fp8_gemm_nt(qa, qb, config="autotune")
    assert _oracle_diff(got, x, w) < CALC_DIFF_MAX


@pytest.mark.gpu
def test_gpu_default_routes_large_1d2d_to_gluon(monkeypatch):
    """The default config runs the warp-specialized Gluon kernel where ``prefers_gluon`` says
    (here 1032 x 13560: 9 x 106 = 954 tiles of 128x128, with M and N tails), not with
    ``PTXTRAIN_TRITON_GLUON=0`` nor for operands TMA cannot load; all three agree with the
    reference."""
    from ptxtrain.gemm import gluon
    from ptxtrain.gemm.heuristics import device_sms, prefers_gluon

    m, n, k = 1032, 13560, 640
    assert prefers_gluon(m, n, k, "1d2d", device_sms(torch.device("cuda")))
    calls = []
    real = gluon.launch_checked  # (the route enters the Gluon kernel here)
    monkeypatch.setattr(gluon, "launch_checked", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w = _inputs(m, n, k, seed=12, device="cuda")
    qa, qb = _quantize(x, w, "1d2d")
    want = ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    got = tg.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    assert calls == [1]
    # Same FP8 products and per-128-K promotion: only the fp32 summation order differs.
    assert calc_diff(got, want) < 1e-6
    monkeypatch.setenv("PTXTRAIN_TRITON_GLUON", "0")
    got = tg.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    assert calls == [1] and calc_diff(got, want) < 1e-6
    monkeypatch.delenv("PTXTRAIN_TRITON_GLUON")
    a_pad = torch.empty(m, k + 8, dtype=qa[0].dtype, device="cuda")  # rows 648 B: not 16-aligned
    a_pad[:, :k] = qa[0]
    got = tg.fp8_gemm_nt((a_pad[:, :k], qa[1]), qb, out_dtype=torch.float32)
    assert calls == [1] and calc_diff(got, want) < 1e-6


@pytest.mark.gpu
def test_gpu_column_major_out_beyond_int32_stays_on_triton(monkeypatch):
    """A column-major out whose column offsets pass 2^31 elements is not routed to the Gluon
    kernel (int32 column offsets there); the Triton kernel takes it with int64 offsets."""
    from ptxtrain.gemm import gluon

    m, n, k = 65536, 32800, 128  # (N - 1) x M = 2.15e9 > 2^31
    calls = []
    real = gluon.launch_checked
    monkeypatch.setattr(gluon, "launch_checked", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w = _inputs(m, n, k, seed=19, device="cuda")
    qa, qb = _quantize(x, w, "1d2d")
    out = torch.empty(n, m, device="cuda", dtype=torch.bfloat16).t()  # [M, N], strides (1, M)
    tg.fp8_gemm_nt(qa, qb, out=out)
    assert calls == []
    rows = torch.randint(0, m, (64,), device="cuda")
    want = ref.fp8_gemm_nt((qa[0][rows], qa[1][rows]), qb, out_dtype=torch.float32)
    # Spot-check 64 rows against the reference (bf16 rounding of the output).
    assert calc_diff(out[rows].float(), want) < 1e-5
