"""The Gluon FP8 GEMM (``ptxtrain.gemm.gluon``): compile-only structure checks on CPU, and the
kernel against the reference GEMM and the unquantized product on a GPU."""

import dataclasses

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from ptxtrain._checks import ceil_div
from ptxtrain.gemm import ref
from ptxtrain.quant.ref import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff
from tests._sm90 import run_sm90_script
from tests.gemm._bounds import CALC_DIFF_MAX
from tests.gemm._inputs import scaled_operands

_COMPILE = """
from ptxtrain.gemm import gluon

results = {}
for name, kind, kw in [("1d2d_128x64", "1d2d", dict(block_m=128, block_n=64, num_warps=8)),
                       # per-column scales of 1D1D: chunks of 2 (4 spill)
                       ("1d1d_128x64", "1d1d", dict(block_m=128, block_n=64, num_warps=8,
                                                    out="fp32", accumulate=True, chunk=2)),
                       ("1d2d_64x64", "1d2d", dict(block_m=64, block_n=64, num_warps=4)),
                       ("1d2d_ws", "1d2d", dict(block_n=128, ws=True)),
                       ("1d2d_wsg", "1d2d", dict(block_n=128, ws=True, scales_tma=False)),
                       # two 64-row waves per consumer: the first wave's promotion pinned
                       # before the second's WGMMAs (else two block accumulators spill)
                       ("1d2d_ws256", "1d2d", dict(block_m=256, block_n=128, num_stages=3,
                                                   ws=True)),
                       # D += through TMA loads and stores: no per-element pointers to spill
                       ("1d1d_acc_ws", "1d1d", dict(block_n=128, ws=True, out="fp32",
                                                    accumulate=True)),
                       # the Triton backend's 256x128 config: two staging buffers each
                       ("1d2d_ws256b2", "1d2d", dict(block_m=256, block_n=128, num_stages=3,
                                                     ws=True, store_buffers=2)),
                       # the split tail's second loop over K-slices
                       ("1d2d_ws256_split", "1d2d", dict(block_m=256, block_n=128,
                                                         num_stages=3, ws=True, split=True)),
                       ("1d1d_acc_ws_split", "1d1d", dict(block_n=128, ws=True, out="fp32",
                                                          accumulate=True, split=True))]:
    ck = gluon._compile_for_sm90(kind, **kw)
    ptx = ck.asm["ptx"]
    nreg = re.findall(r"setmaxnreg\\.(\\w+)\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)
    results[name] = {"waits": re.findall(r"wgmma\\.wait_group\\.sync\\.aligned\\s+(\\d+)", ptx),
                     "setmaxnreg": nreg,
                     "warps": ck.metadata.num_warps, **sass_info(ck.asm["cubin"])}
    if os.access(_CUOBJDUMP, os.X_OK):
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run([_CUOBJDUMP, "-sass", f.name], capture_output=True,
                              text=True).stdout
        results[name]["depbar"] = re.findall(r"WARPGROUP\\.DEPBAR\\.LE\\s+gsb0,\\s*(0x\\d+)", sass)
emit(results)
"""


def test_compile_overlaps_promotion_without_spills(tmp_path):
    results = run_sm90_script(_COMPILE, tmp_path)
    assert len(results) == 10, results
    for name, r in results.items():
        if "_ws" in name:
            # A 4-warp producer down to 40 registers, two 4-warp consumers up to 232.
            assert r["warps"] == 12 and ["dec", "40"] in r["setmaxnreg"], (name, r)
            assert ["inc", "232"] in r["setmaxnreg"], (name, r)
        else:
            # Block kb - 1 is retired alone (wait_group 1) while block kb's WGMMAs run.
            assert "1" in r["waits"], (name, r)
            if "depbar" in r:  # ptxas kept the overlap (no C7514 serialization: all 0x0 then)
                assert "0x1" in r["depbar"], (name, r)
        if "regs" in r:
            assert r["local"] == 0 and r["stack"] == 0, (name, r)  # no spills
        if "sass_qgmma" in r:
            assert any(q.endswith("F32.E4M3.E4M3") for q in r["sass_qgmma"]), (name, r)


def test_config_rejects_bad_fields():
    from ptxtrain.gemm.gluon import GluonConfig

    with pytest.raises(ValueError, match="block_m"):
        GluonConfig(block_m=64, num_warps=8)
    with pytest.raises(ValueError, match="block_n"):
        GluonConfig(block_n=96)
    with pytest.raises(ValueError, match="chunk"):
        GluonConfig(chunk=3)
    with pytest.raises(ValueError, match="split_k must be a bool"):
        GluonConfig(split_k=1)
    for bad in (0, True, 2.0):  # a bool or 0 would reach the kernel's raster as GROUP_M
        with pytest.raises(ValueError, match="group_m"):
            GluonConfig(group_m=bad)
    with pytest.raises(ValueError, match="warp_specialized"):
        GluonConfig(block_n=64, warp_specialized=1)
    with pytest.raises(ValueError, match="scales_tma"):
        GluonConfig(scales_tma="yes")
    for bad in (0, 3, True):
        with pytest.raises(ValueError, match="store_buffers"):
            GluonConfig(store_buffers=bad)
    # Two bf16 staging buffers per consumer with 256-row tiles: 144 KiB ring + 64 KiB fits;
    # with fp32 staging (128 KiB) it would not (fp8_gemm refuses it against the actual out).
    b2 = GluonConfig(256, 128, 8, 3, warp_specialized=True, store_buffers=2)
    assert b2.smem_bytes(2) <= 227 * 1024 < b2.smem_bytes(4)
    # The warp-specialized kernel's WGMMAs need 64-row consumers (Triton: "WGMMA result M
    # dimension must be divisible by 64" for a 32-row A box).
    with pytest.raises(ValueError, match="block_m 128 or 256 and num_warps=8"):
        GluonConfig(block_m=64, num_warps=4, warp_specialized=True)
    with pytest.raises(ValueError, match="block_m 128 or 256 and num_warps=8"):
        GluonConfig(block_m=512, num_warps=8, warp_specialized=True)
    GluonConfig(block_m=256, block_n=128, num_stages=3, warp_specialized=True)
    with pytest.raises(ValueError, match="shared memory"):  # 4 x 48 KiB + staging + scales
        GluonConfig(block_m=256, block_n=128, num_stages=4, warp_specialized=True)
    with pytest.raises(ValueError, match="num_warps in"):  # 256 rows: warp-specialized only
        GluonConfig(block_m=256, num_warps=8)
    # 8 stages of 128x128 + 128x128 tiles: 256 KiB, more shared memory than an SM has.
    with pytest.raises(ValueError, match="shared memory"):
        GluonConfig(128, 128, 8, 8)
    # 160 KiB ring + 5 KiB of scales + 32 KiB bf16 staging fits; fp32 staging (64 KiB) would
    # not, which fp8_gemm checks against the actual out (GPU test below).
    cfg = GluonConfig(128, 128, 8, 5, warp_specialized=True)
    # ring + bf16 staging + TMA'd scales (stages + 1 slots) + 1 KiB for barriers and alignment
    assert cfg.smem_bytes(2) == 5 * 256 * 128 + 2 * 64 * 128 * 2 + 6 * 256 * 4 + 1024
    assert cfg.smem_bytes(2) <= 227 * 1024
    assert cfg.smem_bytes(4) > 227 * 1024
    assert GluonConfig(128, 128, 8, 5, warp_specialized=True, scales_tma=False).smem_bytes(4) <= (
        227 * 1024
    )


def test_ws_config_fits_every_tile_and_output():
    """Every tile the Triton backend can route here has a config that fits shared memory with
    bf16 and fp32 staging."""
    from ptxtrain.gemm.gluon import ws_config
    from ptxtrain.gemm.heuristics import GLUON_TILES, SM90_SMEM_BYTES

    for bm, bn in GLUON_TILES:
        for size in (2, 4):
            cfg = ws_config(bm, bn, size)
            assert (cfg.block_m, cfg.block_n, cfg.warp_specialized) == (bm, bn, True)
            assert cfg.smem_bytes(size) <= SM90_SMEM_BYTES
    assert ws_config(256, 64, 2).num_stages == 5 and ws_config(256, 64, 4).num_stages == 4
    assert ws_config(128, 128, 4).num_stages == 4
    # 256x128: two bf16 staging buffers per consumer; one with fp32 (128 KiB would not fit).
    assert (ws_config(256, 128, 2).store_buffers, ws_config(256, 128, 4).store_buffers) == (2, 1)
    assert ws_config(256, 128, 4).num_stages == 3
    with pytest.raises(KeyError):
        ws_config(64, 64)


def test_mn_major_scales():
    """The TMA'd scales need sf [rows, KB] with strides (1, 4·⌈rows/4⌉): kept when already so,
    copied (same values) otherwise."""
    from ptxtrain.gemm.gluon import _mn_major

    g = torch.Generator().manual_seed(3)
    for rows, kb in [(13, 5), (64, 1), (4096, 56), (1, 3)]:
        sf = torch.rand(rows, kb, generator=g) + 0.5
        pad = -(-rows // 4) * 4
        mn = torch.empty(kb, pad).t()[:rows].copy_(sf)
        assert _mn_major(mn) is mn
        got = _mn_major(sf)  # row-major: copied
        assert torch.equal(got, sf) and got.stride(0) == 1
        assert kb == 1 or got.stride(1) == pad
        assert got.data_ptr() % 16 == 0
        odd = torch.empty(kb, pad + 1).t()[:rows].copy_(sf)  # MN-major, unaligned columns
        assert (_mn_major(odd) is odd) == (kb == 1 and odd.data_ptr() % 16 == 0)
        assert torch.equal(_mn_major(odd), sf)


def test_out_offsets_must_fit_int32():
    from ptxtrain.gemm.gluon import _check_out_offsets

    _check_out_offsets(4096, 7168, 7168, 1)  # row-major: fine at any size
    _check_out_offsets(1, 1, 1, 2**40)  # one column: no column offset at all
    with pytest.raises(ValueError, match="64-bit offsets"):  # column-major, M x N >= 2^31
        _check_out_offsets(65536, 32769, 1, 65536)  # (N - 1) x 65536 = 2^31
    _check_out_offsets(65536, 32768, 1, 65536)  # 2^31 - 65536: the largest offset still fits


def test_fp8_gemm_rejects_bad_input_before_any_launch():
    """The GEMM contract's checks run first (on CPU tensors here, so nothing could launch)."""
    from ptxtrain.gemm import gluon

    x, w = scaled_operands(4, 8, 256, 0, "cpu")
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    with pytest.raises(ValueError, match="kind"):
        gluon.fp8_gemm("1x1", qa, qb)
    with pytest.raises(ValueError, match="must share K"):  # B's K (128), A's 256
        gluon.fp8_gemm("1d2d", qa, per_block_cast_to_fp8(w[:, :128]))
    with pytest.raises(ValueError, match=r"out must have shape \(4, 8\)"):
        gluon.fp8_gemm("1d2d", qa, qb, out=torch.empty(4, 9))
    with pytest.raises(ValueError, match="accumulate"):
        gluon.fp8_gemm("1d2d", qa, qb, out=torch.empty(4, 8), accumulate=True)
    with pytest.raises(TypeError, match="GluonConfig"):
        gluon.fp8_gemm("1d2d", qa, qb, config="128x128")
    with pytest.raises(ValueError, match="CUDA"):  # valid operands, but not on a GPU
        gluon.fp8_gemm("1d2d", qa, qb)


def _reference(kind, qa, qb):
    """The reference GEMM of ``kind`` in fp32."""
    if kind == "1d2d":
        return ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    return ref.fp8_gemm_nt_1d1d(qa, qb)


def _operands(m, n, k, kind, seed):
    x, w = scaled_operands(m, n, k, seed, "cuda")
    qa = per_token_cast_to_fp8(x)
    qb = per_token_cast_to_fp8(w) if kind == "1d1d" else per_block_cast_to_fp8(w)
    return x, w, qa, qb


# DeepSeek-V3 shapes and awkward ones: M = 1, 13, 129; N, K not multiples of 128 (K a multiple
# of 16 for TMA's row alignment); K of 1, 3 and 56 blocks (tail loop only, a chunk + tail, and
# whole chunks).
SHAPES = [(1, 2112, 7168), (13, 300, 208), (129, 576, 1536), (256, 7168, 2048),
          (4096, 2112, 7168), (300, 4096, 400)]  # fmt: skip
# (block_m, block_n, num_warps, num_stages, chunk, warp_specialized)
CONFIGS = [
    (128, 64, 8, 4, 4, False),
    (64, 64, 4, 6, 8, False),
    (128, 128, 8, 4, 4, False),
    (64, 128, 4, 4, 2, False),
    (128, 64, 8, 6, 2, False),
    (128, 128, 8, 4, 4, True),
    (128, 64, 8, 6, 4, True),
    (256, 128, 8, 3, 4, True),
    (256, 64, 8, 4, 4, True),
]  # fmt: skip (fp32 out: 5 stages of 256x64 do not fit)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_gpu_matches_reference(m, n, k, kind, cfg):
    from ptxtrain.gemm import gluon

    config = gluon.GluonConfig(*cfg[:5], warp_specialized=cfg[5])
    x, w, qa, qb = _operands(m, n, k, kind, seed=m + n + k)
    out = torch.full((m, n), float("nan"), device="cuda")
    gluon.fp8_gemm(kind, qa, qb, out, torch.float32, False, config)
    want = _reference(kind, qa, qb)
    # Same FP8 products, same per-128-K promotion: only the fp32 summation order differs.
    assert calc_diff(out, want) < 1e-6, (m, n, k, kind, cfg)
    # The GEMM contract (docs/design.md §2): within calc_diff 1e-3 of the unquantized product.
    assert calc_diff(out, x @ w.t()) < CALC_DIFF_MAX
    if kind == "1d1d":  # D += (wgrad accumulation into fp32)
        before = out.clone()
        gluon.fp8_gemm(kind, qa, qb, out, torch.float32, True, config)
        assert calc_diff(out, before + want) < 1e-6


_LAYOUT_CONFIGS = {
    "plain": dict(),
    "ws": dict(warp_specialized=True),
    # 256 rows, two staging buffers per consumer (the fp32 case, N = 301, stores through
    # pointers: no staging)
    "ws256b2": dict(block_m=256, num_stages=3, warp_specialized=True, store_buffers=2),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(_LAYOUT_CONFIGS))
@pytest.mark.parametrize("out_kind", ["bf16", "bf16_strided", "fp32_odd_n"])
def test_gpu_output_layouts(out_kind, variant):
    """bf16 output (the default, the TMA-store epilogue when warp-specialized), a strided bf16
    out and an fp32 out whose rows are not 16-byte aligned (N = 301: the pointer-store path)."""
    from ptxtrain.gemm import gluon

    m, n, k = 300, 301 if out_kind == "fp32_odd_n" else 576, 1536
    x, w, qa, qb = _operands(m, n, k, "1d2d", seed=11)
    kw = {"block_m": 128, "block_n": 128, "num_stages": 4, **_LAYOUT_CONFIGS[variant]}
    cfg = gluon.GluonConfig(**kw)
    if out_kind == "bf16_strided":
        out = torch.full((m, n + 8), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :n]
    else:
        dtype = torch.float32 if out_kind == "fp32_odd_n" else torch.bfloat16
        out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    gluon.fp8_gemm("1d2d", qa, qb, out, out.dtype, False, cfg)
    want = ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    # bf16 rounding of the fp32 result bounds the difference (2^-8 relative per element).
    assert calc_diff(out.float(), want) < (1e-5 if out.dtype == torch.bfloat16 else 1e-6)
    assert calc_diff(out.float(), x @ w.t()) < CALC_DIFF_MAX


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [128, 256])
@pytest.mark.parametrize("scales_tma", [True, False])
@pytest.mark.parametrize("sf_layout", ["row", "mn_major"])
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
@pytest.mark.parametrize("m,n,k", [(13, 300, 208), (129, 576, 1536), (4096, 2112, 7168)])
def test_gpu_scale_paths(m, n, k, kind, sf_layout, scales_tma, block_m):
    """The warp-specialized kernel's scales through TMA (sf_a copied to MN-major first when
    row-major; M = 13, 129 leave rows of the last box past M) and from global memory, with one
    or two 64-row waves per consumer."""
    from ptxtrain.gemm import gluon
    from ptxtrain.quant import per_token_cast_to_fp8 as cast

    x, w = scaled_operands(m, n, k, m + 7, "cuda")
    qa = cast(x, sf_layout=sf_layout)
    qb = cast(w, sf_layout=sf_layout) if kind == "1d1d" else per_block_cast_to_fp8(w)
    cfg = gluon.GluonConfig(block_m, 128, 8, 4 if block_m == 128 else 3, 4,
                            warp_specialized=True, scales_tma=scales_tma)  # fmt: skip
    out = torch.full((m, n), float("nan"), device="cuda")
    gluon.fp8_gemm(kind, qa, qb, out, torch.float32, False, cfg)
    want = _reference(kind, qa, qb)
    # Same FP8 products, same per-128-K promotion: only the fp32 summation order differs.
    assert calc_diff(out, want) < 1e-6, (m, n, k, kind, sf_layout, scales_tma)


@pytest.mark.gpu
def test_gpu_refuses_staging_over_shared_memory():
    """5 stages fit with bf16 staging but not with fp32: refused before the launch."""
    from ptxtrain.gemm import gluon

    _, _, qa, qb = _operands(256, 256, 512, "1d2d", seed=5)
    cfg = gluon.GluonConfig(128, 128, 8, 5, warp_specialized=True)
    gluon.fp8_gemm("1d2d", qa, qb, None, torch.bfloat16, False, cfg)
    with pytest.raises(ValueError, match="shared memory"):
        gluon.fp8_gemm("1d2d", qa, qb, None, torch.float32, False, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [128, 256])
@pytest.mark.parametrize("out_kind", ["tma", "odd_n", "strided"])
def test_gpu_ws_accumulate(out_kind, block_m):
    """1D1D D += in the warp-specialized kernel: through TMA loads and stores (row-contiguous
    fp32 out; with two waves the second wave's out loads after the first's store), or
    pointers (N = 301: rows not 16-byte aligned; a view with rows of 4163 floats, 16652 bytes).
    2048 x 4160 is 528 tiles of 128 rows or 264 of 256 on 132 SMs: each program runs several
    (the barrier phases of the out loads across tiles)."""
    from ptxtrain.gemm import gluon

    m, n, k = 2048, 301 if out_kind == "odd_n" else 4160, 512
    _, _, qa, qb = _operands(m, n, k, "1d1d", seed=13)
    cfg = gluon.GluonConfig(block_m, 128, 8, 4 if block_m == 128 else 3, 4,
                            warp_specialized=True)  # fmt: skip
    base = torch.randn(m, n + 3, device="cuda")
    out = base[:, :n] if out_kind == "strided" else base[:, :n].contiguous()
    before = out.clone()
    gluon.fp8_gemm("1d1d", qa, qb, out, torch.float32, True, cfg)
    # Same FP8 products, same per-128-K promotion, one fp32 add: summation order only.
    assert calc_diff(out, before + ref.fp8_gemm_nt_1d1d(qa, qb)) < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("block_m", [128, 256])
@pytest.mark.parametrize("buffers", [1, 2])
def test_gpu_store_buffers_across_tiles(block_m, buffers):
    """Staging buffers used in turn across a program's tiles: 2048 x 4224 is 528 tiles of 128
    rows (4 per program on 132 SMs) or 264 of 256 (2 per program), bf16 out through TMA."""
    from ptxtrain.gemm import gluon

    m, n, k = 2048, 4224, 512
    _, _, qa, qb = _operands(m, n, k, "1d2d", seed=17)
    cfg = gluon.GluonConfig(block_m, 128, 8, 3, 4, warp_specialized=True, store_buffers=buffers)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    gluon.fp8_gemm("1d2d", qa, qb, out, out.dtype, False, cfg)
    want = ref.fp8_gemm_nt(qa, qb, out_dtype=torch.float32)
    # bf16 rounding of the fp32 result bounds the difference (2^-8 relative per element).
    assert calc_diff(out.float(), want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
@pytest.mark.parametrize("block_m", [128, 256])
def test_gpu_pointer_epilogue_across_tiles(block_m, kind):
    """Pointer stores (an fp32 view with rows of 4163 floats) with several tiles per program
    (528 or 264 tiles on 132 SMs), three runs. Without the scales' loads completed before the
    stage's release, 0.1% of these outputs come out wrong, in different places each run."""
    from ptxtrain.gemm import gluon

    m, n, k = 2048, 4160, 512
    _, _, qa, qb = _operands(m, n, k, kind, seed=23)
    cfg = gluon.GluonConfig(block_m, 128, 8, 4 if block_m == 128 else 3, 4,
                            warp_specialized=True)  # fmt: skip
    want = _reference(kind, qa, qb)
    for _ in range(3):
        out = torch.full((m, n + 3), float("nan"), device="cuda")[:, :n]
        gluon.fp8_gemm(kind, qa, qb, out, torch.float32, False, cfg)
        # Same FP8 products, same per-128-K promotion: only the fp32 summation order differs.
        assert calc_diff(out, want) < 1e-6


# (m, n, k, kind, block_m): the tiles and split on 132 SMs (heuristics.gluon_split_k)
_SPLIT_CASES = [
    (4096, 2112, 7168, "1d2d", 256),  # 272 tiles: 264 whole, 8 cut into 7 slices
    (13, 300, 2048, "1d2d", 128),  # 3 tiles, M and N tails: all cut into 2 slices
    (129, 576, 3072, "1d1d", 128),  # 10 tiles: all cut into 3 slices
    (7168, 2112, 4096, "1d1d", 128),  # 952 tiles: 924 whole, 28 cut into 4 slices
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("m,n,k,kind,block_m", _SPLIT_CASES)
def test_gpu_split_tail(m, n, k, kind, block_m, accumulate, layout):
    """``GluonConfig.split_k``: the split tiles' K-slices summed by the finishing kernel match
    the reference (and ``D +=`` for 1D1D), bitwise the same over repeated runs; into a
    row-major out (TMA stores for the whole tiles) and a column-major view (pointer stores)."""
    from ptxtrain.gemm import gluon
    from ptxtrain.gemm.heuristics import device_sms, gluon_split_k

    if accumulate and kind == "1d2d":
        pytest.skip("D += is a 1D1D option")
    sms = device_sms(torch.device("cuda"))
    tiles = ceil_div(m, block_m) * ceil_div(n, 128)
    whole, splits = gluon_split_k(tiles, sms, ceil_div(k, 128))
    if sms == 132:  # the cases are chosen for 132 SMs (H100 SXM / H200)
        assert splits > 1 and whole < tiles
    _, _, qa, qb = _operands(m, n, k, kind, seed=m + n + k + 5)
    cfg = gluon.ws_config(block_m, 128, 4)
    assert cfg.split_k
    want = _reference(kind, qa, qb)
    d0 = torch.randn(m, n, device="cuda") if accumulate else None
    runs = []
    for _ in range(2):
        out = torch.full((m, n) if layout == "row" else (n, m), float("nan"), device="cuda")
        out = out if layout == "row" else out.t()
        if accumulate:
            out.copy_(d0)
        gluon.fp8_gemm(kind, qa, qb, out, torch.float32, accumulate, cfg)
        runs.append(out)
    # Same FP8 products, same per-128-K promotion: only the fp32 summation order differs.
    assert calc_diff(runs[0], want + d0 if accumulate else want) < 1e-6
    assert torch.equal(runs[0], runs[1])  # slices summed in slice order: repeatable
    whole_only = gluon.fp8_gemm(kind, qa, qb, None, torch.float32, False,
                                dataclasses.replace(cfg, split_k=False))  # fmt: skip
    assert calc_diff(whole_only, want) < 1e-6
