"""The hand-written sm_90a FP8 GEMMs (ptxtrain.gemm.ptx).

Without a GPU: the block-size heuristic (pure), and NVRTC compiles every variant the heuristic
picks for the DeepSeek-V3 shapes, checking the SASS (QGMMA present, no local-memory spills).
GPU-marked tests check the kernels against the unquantized product (calc_diff) and the
reference GEMM over the DeepSeek-V3 shapes and awkward ones (M = 0, 1, 13, 129; N, K tails).
"""

import dataclasses
import re
import subprocess

import pytest
import torch

from ptxtrain.gemm import ptx
from ptxtrain.jit import nvrtc_available
from ptxtrain.jit.cache import find_cuobjdump
from ptxtrain.quant.ref import (
    per_block_cast_back,
    per_block_cast_to_fp8,
    per_token_cast_back,
    per_token_cast_to_fp8,
)
from ptxtrain.testing import calc_diff
from ptxtrain.testing.shapes import DSV3_DENSE_NK, DSV3_EXTRA_NK, DSV3_WGRAD_K, DSV3_WGRAD_MN
from tests.gemm._bounds import CALC_DIFF_MAX
from tests.gemm._inputs import scaled_operands

H200_SMS = 132


# ---- heuristic (pure) ----------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 13, 64, 128, 129, 4096, 8192])
@pytest.mark.parametrize("n,k", DSV3_DENSE_NK + DSV3_EXTRA_NK + ((100, 272),))
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
def test_config_is_valid_and_fills_the_sms(kind, m, n, k):
    cfg = ptx.select_config(kind, m, n, k, H200_SMS)
    assert cfg.block_m in (64, 128, 256) and cfg.block_n % 16 == 0 and 16 <= cfg.block_n <= 160
    assert cfg.block_m < 256 or cfg.block_n <= 128  # registers: 1.5 x block_n accumulators
    assert not cfg.double_acc or (cfg.block_m <= 128 and cfg.block_n <= 128)  # 3 x block_n / 2
    # 8 stages cap tiles that fill the SMs, 16 decode-sized ones (select_config)
    large = -(-max(m, 1) // 128) * -(-n // 128) >= 2 * H200_SMS
    assert 2 <= cfg.num_stages <= (8 if large else 16)
    assert ptx.smem_bytes(cfg.block_m, cfg.block_n, cfg.num_stages, kind) <= 227 * 1024
    if m <= 64:
        assert cfg.block_m == 64
    if cfg.cluster == 2:  # multicast only pays (and only pairs) with two or more M-blocks
        assert -(-m // cfg.block_m) >= 2


def test_config_at_large_and_decode_m():
    # M = 4096: 128x128 tiles with double accumulators and no multicast are the fastest on 4 of
    # the 6 V3 shapes on an H200.
    cfg = ptx.select_config("1d2d", 4096, 4096, 7168, H200_SMS)
    assert (cfg.block_m, cfg.block_n, cfg.cluster, cfg.double_acc) == (128, 128, 1, True)
    # Decode-sized M: narrow tiles spread over the SMs, one 64-row math warpgroup per tile at
    # M <= 64; at M = 128 the 64xBN pick (BN >= 64) becomes one 128-row M-block of BN / 2
    # columns, two warpgroups per tile (at M = 100 that is slower, so it keeps the 64-row
    # tiles).
    for (m, n, k), (bm, bn) in {
        (64, 2112, 7168): (64, 32),
        (64, 32768, 512): (64, 128),
        (128, 2112, 7168): (64, 32),
        (128, 4096, 7168): (128, 32),
        (128, 7168, 16384): (128, 64),
        (128, 24576, 1536): (128, 64),
        (100, 24576, 1536): (64, 128),
    }.items():
        small = ptx.select_config("1d2d", m, n, k, H200_SMS)
        assert (small.block_m, small.block_n, small.cluster) == (bm, bn, 1), (m, n, k, small)
    assert ptx.select_config("1d1d", 128, 7168, 16384, H200_SMS).block_m == 64  # 1D2D only


def test_config_rejects_bad_arguments():
    with pytest.raises(ValueError, match="kind"):
        ptx.select_config("2d2d", 64, 64, 128, 132)
    with pytest.raises(ValueError, match="num_sms"):
        ptx.select_config("1d2d", 64, 64, 128, 0)


def test_rasterization_group_per_kind():
    # Dense kernels keep 2048-row rasterization groups (best geomean over the V3 shapes on an
    # H200); the m-grouped contiguous GEMM takes 512 (one expert's B in flight, 1.01-1.03x).
    for n, k in ((4096, 7168), (7168, 2048)):
        assert ptx.select_config("1d2d", 4096, n, k, H200_SMS).raster_m == 2048
        assert ptx.grouped_config(4096, n, k, H200_SMS).raster_m == 512
        # With the group count: about one expert's rows, a power of two in [512, 2048].
        for m, groups, want in ((4096, 8, 512), (8192, 8, 1024), (32768, 8, 2048),
                                (32768, 4, 2048), (4096, 64, 512), (3000, 2, 1024)):  # fmt: skip
            assert ptx.grouped_config(m, n, k, H200_SMS, groups).raster_m == want, (m, groups)
    # The constant reaches the kernel's template arguments and its cache name.
    cfg = dataclasses.replace(ptx.grouped_config(4096, 4096, 7168, H200_SMS), raster_m=1024)
    src, expr = ptx.kernel_source("m_grouped", cfg, 4096, 7168, torch.bfloat16, False)
    assert expr.endswith(", 1, 1024, false, false>") and "fp8_gemm.cuh" in src


def test_run_with_config_rejects_a_bad_rasterization_group():
    g = torch.Generator().manual_seed(3)
    a = per_token_cast_to_fp8(torch.randn(4, 256, generator=g))
    b = per_block_cast_to_fp8(torch.randn(128, 256, generator=g))
    cfg = dataclasses.replace(ptx.select_config("1d2d", 4, 128, 256, H200_SMS), raster_m=1000)
    with pytest.raises(ValueError, match="raster_m=1000"):
        ptx.run_with_config("1d2d", a, b, cfg, torch.bfloat16)
    # one stage with double accumulators would wait for the stage it holds: refused, not hung
    cfg = ptx.PtxConfig(64, 64, 1, 1, double_acc=True)
    with pytest.raises(ValueError, match="num_stages=1"):
        ptx.run_with_config("1d2d", a, b, cfg, torch.bfloat16)
    # multicast of A pairs two CTAs: a cluster of one has no peer to share it with
    cfg = ptx.PtxConfig(64, 64, 8, 1, double_acc=True, multicast_a=True)
    with pytest.raises(ValueError, match="multicast_a=True"):
        ptx.run_with_config("1d2d", a, b, cfg, torch.bfloat16)
    # the split tail is built for the double-accumulator kernels only
    cfg = ptx.PtxConfig(256, 128, 4, 2, split_k=True)
    with pytest.raises(ValueError, match="split_k=True"):
        ptx.run_with_config("1d2d", a, b, cfg, torch.bfloat16)
    # a negative number of staged epilogue boxes: refused before NVRTC sees it
    cfg = ptx.PtxConfig(128, 128, 4, 1, tma_store=True, epi_boxes=-1)
    with pytest.raises(ValueError, match="epi_boxes=-1"):
        ptx.run_with_config("1d2d", a, b, cfg, torch.bfloat16)
    # 192-column tiles: 1D2D only (1D1D's per-column scales of B would spill), not with
    # 256-row tiles, and 176 spans three scale blocks of B at some tiles
    cfg = ptx.PtxConfig(128, 192, 4, 1)
    b1 = per_token_cast_to_fp8(torch.randn(128, 256, generator=g))
    with pytest.raises(ValueError, match="block_n=192"):
        ptx.run_with_config("1d1d", a, b1, cfg, torch.float32)
    for bad in (ptx.PtxConfig(256, 192, 3, 1), ptx.PtxConfig(128, 176, 4, 1)):
        with pytest.raises(ValueError, match=f"block_n={bad.block_n}"):
            ptx.run_with_config("1d2d", a, b, bad, torch.bfloat16)


@pytest.mark.parametrize(
    "units,grid,num_kb,quantum,want",
    [
        (544, 132, 56, 8, (528, 7)),  # 4096 x 2112 x 7168, 128x128: 4 waves + 16 tiles, 7 chunks
        (544, 132, 200, 8, (528, 8)),  # more K: as many slices as the idle SMs take (132 // 16)
        (153, 132, 17, 8, (132, 2)),  # 2 whole chunks (+ 1 block for the last slice)
        (136, 132, 24, 4, (132, 6)),  # 4-block chunks (PTXTRAIN_GEMM_CHUNK=4): 6 of 33 fit
        (1024, 132, 56, 8, (1024, 1)),  # 100 tail tiles: no two slices of each fit
        (528, 132, 56, 8, (528, 1)),  # whole waves only
        (66, 132, 56, 8, (0, 2)),  # 64 x 2112 x 7168, 64x32: one partial wave, cut in 2
        (40, 132, 56, 8, (0, 3)),  # 132 // 40 slices per tile
        (100, 132, 56, 8, (100, 1)),  # one partial wave, no two slices of each fit
        (0, 132, 56, 8, (0, 1)),  # M = 0: nothing to cut
        (544, 132, 4, 8, (544, 1)),  # K = 512: no whole chunk to cut at
    ],
)
def test_split_tail(units, grid, num_kb, quantum, want):
    assert ptx.split_tail(units, grid, num_kb, quantum) == want


def test_split_quantum_follows_the_chunk_define():
    # Slices are cut at whole chunks of PTXTRAIN_GEMM_CHUNK blocks (8 unless an A/B overrides it).
    assert ptx._split_quantum() == 8
    try:
        ptx.set_source_defines("#define PTXTRAIN_GEMM_CHUNK 16\n")
        assert ptx._split_quantum() == 16
    finally:
        ptx.set_source_defines("")
    assert ptx._split_quantum() == 8


def test_split_tail_rejects_bad_arguments():
    with pytest.raises(ValueError, match="grid_units and quantum must be positive"):
        ptx.split_tail(10, 0, 8, 8)
    with pytest.raises(ValueError, match="units and num_kb must be >= 0"):
        ptx.split_tail(-1, 132, 8, 8)


def test_select_config_splits_short_last_waves():
    # 4.12 waves of 128x128 tiles: the only V3 1D2D shape at M = 4096 with a short last wave
    # that K-slices can fill.
    split = {
        (n, k): ptx.select_config("1d2d", 4096, n, k, H200_SMS).split_k for n, k in DSV3_DENSE_NK
    }
    assert split == {(n, k): (n, k) == (2112, 7168) for n, k in DSV3_DENSE_NK}
    # Wgrad (K = 4096, 4 chunks): 952 tiles = 7 waves + 28 (4 slices), 2304 = 17 + 60 (2),
    # 7168 = 54 + 40 (3); 1024 and 1792 tiles leave 100 and 76 (no two slices fit), 896 (64-row
    # tiles) leaves 104.
    want = {(7168, 2112): True, (1536, 24576): True, (16384, 7168): True}
    for m, n in DSV3_WGRAD_MN:
        got = ptx.select_config("1d1d", m, n, 4096, H200_SMS).split_k
        assert got == want.get((m, n), False), (m, n)
    # Decode-sized M: 1D2D tiles that leave at least half the SMs idle are cut too (64 x 2112 x
    # 7168: 66 tiles of 64x32 in 2 slices); the other V3 decode shapes fill the SMs.
    for m in (64, 128):
        split = {
            (n, k): ptx.select_config("1d2d", m, n, k, H200_SMS).split_k for n, k in DSV3_DENSE_NK
        }
        assert split == {(n, k): m == 64 and (n, k) == (2112, 7168) for n, k in DSV3_DENSE_NK}
    assert ptx.select_config("1d2d", 13, 1000, 3008, H200_SMS).split_k  # 16 tiles, 24 blocks
    assert not ptx.select_config("1d2d", 13, 1000, 1024, H200_SMS).split_k  # one 8-block chunk
    assert not ptx.select_config("1d1d", 64, 2112, 7168, H200_SMS).split_k  # 1D2D only
    # M-grouped: the dense rule (4096 x 2112 x 7168 cut); masked (split=False): never.
    assert ptx.grouped_config(4096, 2112, 7168, H200_SMS).split_k
    assert not ptx.grouped_config(4096, 2112, 7168, H200_SMS, split=False).split_k
    assert not ptx.grouped_config(4096, 4096, 2048, H200_SMS).split_k  # 1024 tiles, 16 blocks
    _, expr = ptx.kernel_source(
        "1d2d", ptx.select_config("1d2d", 4096, 2112, 7168, H200_SMS), 2112, 7168,
        torch.bfloat16, False,
    )  # fmt: skip
    assert expr.endswith(", false, true>")


def test_multicast_a_reaches_the_kernel():
    # The kernel's kMcastA template argument follows the config (SASS: the compile test).
    cfg = ptx.PtxConfig(64, 16, 16, 2, double_acc=True, multicast_a=True)
    _, expr = ptx.kernel_source("1d2d", cfg, 2112, 7168, torch.bfloat16, False)
    assert expr.endswith(", 2048, true, false>")
    plain = dataclasses.replace(cfg, multicast_a=False)
    assert ptx.kernel_source("1d2d", plain, 2112, 7168, torch.bfloat16, False)[1].endswith(
        ", 2048, false, false>"
    )


def test_epilogue_staging_boxes():
    # Boxes of 64 rows x 128 bytes staged per math warpgroup (the kernel's kEpiBoxes) and their
    # shared memory: a 128-column bf16 wave is 2 boxes (fp32: 4); 0 = a wave's boxes; a 256-row
    # tile may stage both waves (twice a wave's boxes), other tiles clamp to one wave's.
    bf16, f32 = torch.bfloat16, torch.float32
    cases = [
        ((256, 128, bf16, 0), 2), ((256, 128, bf16, 1), 1), ((256, 128, bf16, 4), 4),
        ((256, 128, bf16, 3), 2), ((256, 128, f32, 8), 8), ((128, 128, bf16, 4), 2),
        ((64, 64, bf16, 0), 1), ((128, 128, f32, 0), 4),
    ]  # fmt: skip
    for (bm, bn, dtype, boxes), want in cases:
        cfg = ptx.PtxConfig(bm, bn, 3, 1, tma_store=True, epi_boxes=boxes)
        assert ptx._epi_boxes(cfg, dtype) == want, (bm, bn, dtype, boxes)
        warpgroups = 1 if bm == 64 else 2
        assert ptx.epilogue_bytes(bm, bn, dtype, boxes) == warpgroups * want * 64 * 128
    # The kernel template gets the whole-tile count (its EpiShape::kWholeTile).
    cfg = ptx.PtxConfig(256, 128, 3, 2, tma_store=True, epi_boxes=4)
    assert ", 4, 0, 2048," in ptx.kernel_source("1d2d", cfg, 7168, 2048, bf16, False)[1]


def test_source_defines_reach_the_kernel_source_and_reset():
    # The A/B hook of benchmarks/ab_ptx.py: the text goes before the header and "" restores it.
    cfg = ptx.select_config("1d2d", 4096, 7168, 2048, H200_SMS)
    plain, _ = ptx.kernel_source("1d2d", cfg, 7168, 2048, torch.bfloat16, False)
    try:
        ptx.set_source_defines("#define PTXTRAIN_GEMM_CHUNK 4\n")
        src, _ = ptx.kernel_source("1d2d", cfg, 7168, 2048, torch.bfloat16, False)
        assert src == "#define PTXTRAIN_GEMM_CHUNK 4\n" + plain
    finally:
        ptx.set_source_defines("")
    assert ptx.kernel_source("1d2d", cfg, 7168, 2048, torch.bfloat16, False)[0] == plain
    with pytest.raises(TypeError, match="text must be a str"):
        ptx.set_source_defines(None)


def test_generated_wgmma_wrapper_lists_every_accumulator():
    src = ptx._wgmma_struct(112)
    assert "m64n112k32.f32.e4m3.e4m3" in src
    assert src.count('"+f"(d[') == 56 and "%55}" in src and "%58, 0" in src


# ---- compile-only (NVRTC, no GPU) --------------------------------------------------------------


def _variants():
    seen = {}
    for m in (64, 128, 4096):
        for n, k in DSV3_DENSE_NK + DSV3_EXTRA_NK:
            cfg = ptx.select_config("1d2d", m, n, k, H200_SMS)
            seen[("1d2d", cfg, n, k, torch.bfloat16, False)] = None
    for m, n in DSV3_WGRAD_MN:
        k = DSV3_WGRAD_K[0]
        cfg = ptx.select_config("1d1d", m, n, k, H200_SMS)
        seen[("1d1d", cfg, n, k, torch.float32, True)] = None
    for n, k in DSV3_DENSE_NK:  # Fp8Linear's wgrad: dW [N, K] in bf16, K = the tokens
        tokens = DSV3_WGRAD_K[0]
        cfg = ptx.select_config("1d1d", n, k, tokens, H200_SMS)
        seen[("1d1d", cfg, k, tokens, torch.bfloat16, False)] = None
        # and its dgrad: dx [tokens, K] = dy [tokens, N] · W, i.e. a 1D2D GEMM with N and K swapped
        cfg = ptx.select_config("1d2d", tokens, k, n, H200_SMS)
        seen[("1d2d", cfg, k, n, torch.bfloat16, False)] = None
    for n, k in ((4096, 7168), (7168, 2048)):  # the MoE experts' m-grouped GEMMs
        cfg = ptx.grouped_config(8192, n, k, H200_SMS)
        seen[("m_grouped", cfg, n, k, torch.bfloat16, False)] = None
    for m, n in ((4096, 7168), (7168, 2048)):  # and their k-grouped wgrad (K from k_offsets)
        cfg = ptx.k_grouped_config(m, n, H200_SMS)
        seen[("k_grouped", cfg, n, 128, torch.float32, True)] = None
    for n, k in ((4096, 7168), (7168, 2048)):  # and the masked (decode) GEMM
        cfg = ptx.grouped_config(8 * 256, n, k, H200_SMS)
        seen[("masked", cfg, n, k, torch.bfloat16, False)] = None
    # Multicast of A (no heuristic picks it; run_with_config can): both kinds, TMA-store epilogue.
    a16 = ptx.PtxConfig(64, 16, 16, 2, double_acc=True, multicast_a=True)
    seen[("1d2d", a16, 2112, 7168, torch.bfloat16, False)] = None
    a64 = ptx.PtxConfig(64, 64, 8, 2, double_acc=True, tma_store=True, multicast_a=True)
    seen[("1d1d", a64, 576, 7168, torch.float32, True)] = None
    return list(seen)


@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("block_n,ok", [(176, False), (208, False), (144, True), (192, True)])
def test_kernel_block_n_rule_matches_the_scale_blocks(block_n, ok, tmp_path, monkeypatch):
    # The kernel itself refuses tiles that can span three 128-column scale blocks of B (176: a
    # tile starting 112 columns into a block ends at 288), not only run_with_config.
    from ptxtrain.jit import JitCompileError

    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path))
    cfg = ptx.PtxConfig(64, block_n, 4, 1)
    if ok:
        ptx.compile_gemm("1d2d", cfg, 2112, 1536, torch.bfloat16, False)
    else:
        with pytest.raises(JitCompileError, match="BLOCK_N"):
            ptx.compile_gemm("1d2d", cfg, 2112, 1536, torch.bfloat16, False)


@pytest.mark.slow
@pytest.mark.skipif(not nvrtc_available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
def test_every_dsv3_variant_compiles_to_qgmma_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("PTXTRAIN_JIT_CACHE_DIR", str(tmp_path))
    ptx.compile_gemm.cache_clear()
    cuobjdump = find_cuobjdump()
    variants = _variants()
    assert len(variants) >= 10
    for args in variants:
        compiled, expr = ptx.compile_gemm(*args)
        assert expr in compiled.symbols
        if cuobjdump is None:
            continue
        path = compiled.cache_path / "kernel.cubin"
        res = subprocess.run(
            [cuobjdump, "-res-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
        assert "LOCAL:0" in res, f"{args}: local memory:\n{res}"
        sass = subprocess.run(
            [cuobjdump, "-sass", str(path)], capture_output=True, text=True, check=True
        ).stdout
        assert "STL" not in sass, f"{args}: register spills (STL) in the SASS"
        # Registers within the budget: the launch allocation fits one CTA per SM (65536
        # registers over the CTA's threads, in steps of 8), and kernels with two math
        # warpgroups move them with setmaxnreg (producer down to 40, math up to 232: 128 x 40 +
        # 256 x 232 <= 65536) so the math code may use up to 232.
        cfg = args[1]
        regs = int(re.search(r"REG:(\d+)", res).group(1))
        assert regs <= min(255, 65536 // cfg.num_threads // 8 * 8), f"{args}: {regs} registers"
        if cfg.num_threads == 384:
            alloc = re.findall(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \w+, (0x[0-9a-f]+)", sass)
            dealloc = re.findall(r"USETMAXREG\.DEALLOC\.CTAPOOL (0x[0-9a-f]+)", sass)
            assert [int(v, 16) for v in alloc] == [232], f"{args}: setmaxnreg.inc {alloc}"
            assert [int(v, 16) for v in dealloc] == [40], f"{args}: setmaxnreg.dec {dealloc}"
            assert 128 * 40 + 256 * 232 <= 65536
        else:  # one math warpgroup: no reallocation
            assert "USETMAXREG" not in sass, f"{args}: setmaxnreg with one math warpgroup"
        waves = 2 if args[1].block_m == 256 else 1  # block_m = 256: two waves of 64-row wgmmas
        count = sass.count("QGMMA")  # 4 per wave per copy of the (unrolled) K-loop body
        assert count >= 4 * waves and count % (4 * waves) == 0, f"{args}: {count} QGMMA"
    ptx.compile_gemm.cache_clear()


def test_block_groups_cache_follows_in_place_changes():
    # Per 64-row block the largest index (the block's group, -1 for padding only), cached on the
    # tensor until it changes in place.
    m = torch.tensor([0] * 128 + [1] * 100 + [-1] * 28, dtype=torch.int32)
    first = ptx._cached_block_groups(m)
    assert first.tolist() == [0, 0, 1, 1]
    assert ptx._cached_block_groups(m) is first  # reused while m is unchanged
    m[128:192] = 2  # in place: the version counter moves
    again = ptx._cached_block_groups(m)
    assert again is not first and again.tolist() == [0, 0, 2, 1]
    view = m[:64]
    view.fill_(-1)  # through a view: the same counter
    assert ptx._cached_block_groups(m).tolist() == [-1, 0, 2, 1]
    with torch.inference_mode():  # no version counter: computed every time
        inf = torch.zeros(64, dtype=torch.int32)
        assert ptx._cached_block_groups(inf).tolist() == [0]
        assert not hasattr(inf, "_ptxtrain_block_groups")


def test_unsupported_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only answer")
    assert not ptx.supports(4096, 7168, 2048)
    qa = per_token_cast_to_fp8(torch.randn(4, 256))
    qb = per_block_cast_to_fp8(torch.randn(32, 256))
    with pytest.raises(ValueError, match="CUDA"):
        ptx.fp8_gemm_nt(qa, qb)


def test_empty_n_launches_nothing(monkeypatch):
    # N = 0 (a forced ptx backend): an empty D, as M = 0 gives, and no kernel launch (its TMA
    # descriptor of an empty B would be invalid). Host code only: the device checks are stubbed.
    monkeypatch.setattr(ptx, "_check_runnable", lambda *args: None)
    monkeypatch.setattr(ptx, "launch_gemm", lambda *args, **kw: pytest.fail("launched for N = 0"))
    qa = per_token_cast_to_fp8(torch.randn(4, 256))
    d = ptx.fp8_gemm_nt(qa, per_block_cast_to_fp8(torch.randn(0, 256)))
    assert d.shape == (4, 0) and d.dtype == torch.bfloat16
    d = ptx.fp8_gemm_nt_1d1d(qa, per_token_cast_to_fp8(torch.randn(0, 256)))
    assert d.shape == (4, 0) and d.dtype == torch.float32


# ---- GPU ---------------------------------------------------------------------------------------


def _inputs(m, n, k, seed):
    return scaled_operands(m, n, k, seed, "cuda")


def _check(got, want_exact, m, n, k, what):
    diff = calc_diff(got, want_exact)
    assert diff < CALC_DIFF_MAX, f"{what} {m=} {n=} {k=}: calc_diff {diff:.2e}"


AWKWARD = [(1, 576, 7168), (13, 2112, 1536), (129, 300, 272), (200, 100, 64), (4096, 2112, 7168)]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 13, 64, 128, 129, 4096])
@pytest.mark.parametrize("n,k", DSV3_DENSE_NK + DSV3_EXTRA_NK)
def test_gpu_1d2d_dsv3(m, n, k):
    x, w = _inputs(m, n, k, seed=m * 7 + n + k)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    got = ptx.fp8_gemm_nt(qa, qb)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    _check(got, x.double() @ w.double().t(), m, n, k, "1d2d vs unquantized")
    # Against the reference GEMM of the same FP8 operands: only summation order and the tensor
    # cores' ~14-bit block sums differ (DeepSeek-V3 §3.3), so the relative error is far below
    # the quantization error; a wrong scale or tile moves it to O(1).
    want = per_token_cast_back(*qa).double() @ per_block_cast_back(*qb).double().t()
    rel = (got.double() - want).norm() / want.norm().clamp_min(1e-30)
    assert rel < 5e-3, f"{m=} {n=} {k=}: {rel=:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", AWKWARD)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_1d2d_awkward_and_out(m, n, k, out_dtype):
    x, w = _inputs(m, n, k, seed=m + n + k)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    got = ptx.fp8_gemm_nt(qa, qb, out_dtype=out_dtype)
    assert got.dtype == out_dtype
    _check(got, x.double() @ w.double().t(), m, n, k, f"1d2d {out_dtype}")
    # A non-contiguous out gets the same numbers.
    big = torch.full((m, n + 8), float("nan"), dtype=out_dtype, device="cuda")
    ptx.fp8_gemm_nt(qa, qb, out=big[:, :n])
    torch.testing.assert_close(big[:, :n], got, rtol=0, atol=0)  # same kernel, same inputs
    assert torch.isnan(big[:, n:]).all()


@pytest.mark.gpu
def test_gpu_1d2d_m0_and_mn_major_scales():
    qa = per_token_cast_to_fp8(torch.randn(0, 512, device="cuda"))
    qb = per_block_cast_to_fp8(torch.randn(256, 512, device="cuda"))
    assert ptx.fp8_gemm_nt(qa, qb).shape == (0, 256)
    x, w = _inputs(100, 256, 512, seed=3)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    sf_mn = torch.empty(4, 100, device="cuda").t()  # [100, 4], strides (1, 100): MN-major
    sf_mn.copy_(qa[1])
    assert sf_mn.stride() == (1, 100)
    a = ptx.fp8_gemm_nt((qa[0], sf_mn), qb)
    b = ptx.fp8_gemm_nt(qa, qb)
    torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same scales in two layouts


@pytest.mark.gpu
@pytest.mark.parametrize("m,n", DSV3_WGRAD_MN)
@pytest.mark.parametrize("k", DSV3_WGRAD_K[:1])
def test_gpu_1d1d_wgrad_dsv3(m, n, k):
    x, w = _inputs(m, n, k, seed=m + n)
    qa, qb = per_token_cast_to_fp8(x), per_token_cast_to_fp8(w)
    got = ptx.fp8_gemm_nt_1d1d(qa, qb)
    assert got.dtype == torch.float32
    _check(got, x.double() @ w.double().t(), m, n, k, "1d1d")
    out = torch.randn(m, n, device="cuda")
    before = out.clone()
    ptx.fp8_gemm_nt_1d1d(qa, qb, out=out, accumulate=True)
    torch.testing.assert_close(out, before + got, rtol=1e-5, atol=1e-4)  # one fp32 add
    bf = ptx.fp8_gemm_nt_1d1d(qa, qb, out_dtype=torch.bfloat16)
    torch.testing.assert_close(bf, got.bfloat16(), rtol=2**-7, atol=0)  # one bf16 rounding


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", AWKWARD)
def test_gpu_1d1d_awkward(m, n, k):
    x, w = _inputs(m, n, k, seed=m * 3 + k)
    qa, qb = per_token_cast_to_fp8(x), per_token_cast_to_fp8(w)
    _check(ptx.fp8_gemm_nt_1d1d(qa, qb), x.double() @ w.double().t(), m, n, k, "1d1d awkward")


@pytest.mark.gpu
def test_gpu_bad_k_raises_before_launch():
    qa = per_token_cast_to_fp8(torch.randn(8, 200, device="cuda"))
    qb = per_block_cast_to_fp8(torch.randn(64, 200, device="cuda"))
    assert not ptx.supports(8, 64, 200)
    with pytest.raises(ValueError, match="K % 16"):
        ptx.fp8_gemm_nt(qa, qb)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
@pytest.mark.parametrize(
    "cfg",
    [
        ptx.PtxConfig(128, 160, 6, 2),
        ptx.PtxConfig(64, 112, 8, 2),
        ptx.PtxConfig(128, 48, 8, 1),
        ptx.PtxConfig(256, 128, 4, 2),
        ptx.PtxConfig(256, 64, 5, 1),
        ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=True),
        ptx.PtxConfig(64, 64, 8, 1, double_acc=True, tma_store=True),
        ptx.PtxConfig(256, 128, 4, 2, tma_store=True, epi_boxes=1),
        ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=True, epi_boxes=2),
        ptx.PtxConfig(64, 16, 16, 2, double_acc=True, multicast_a=True),
        ptx.PtxConfig(64, 64, 8, 2, double_acc=True, tma_store=True, multicast_a=True),
        ptx.PtxConfig(128, 48, 8, 2, multicast_a=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("m,n,k", [(129, 2112, 1536), (1000, 576, 7168), (13, 300, 272)])
def test_gpu_every_block_shape_and_cluster(kind, cfg, m, n, k):
    # Odd M-block counts leave the second CTA of a cluster a zero-filled phantom block (odd
    # N-block counts with multicast_a: 2112 / 64, 300 / 16, 300 / 64); N tails cut a tile and
    # its multicast half; BLOCK_N = 112 / 160 straddle two scale blocks of B.
    x, w = _inputs(m, n, k, seed=m + k)
    qa = per_token_cast_to_fp8(x)
    qb = per_block_cast_to_fp8(w) if kind == "1d2d" else per_token_cast_to_fp8(w)
    out_dtype = torch.bfloat16 if kind == "1d2d" else torch.float32
    got = ptx.run_with_config(kind, qa, qb, cfg, out_dtype)
    _check(got, x.double() @ w.double().t(), m, n, k, f"{kind} {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [
        ptx.PtxConfig(128, 192, 4, 1, tma_store=True),
        ptx.PtxConfig(128, 192, 4, 2, tma_store=True),
        ptx.PtxConfig(128, 192, 5, 1),
        ptx.PtxConfig(128, 192, 4, 2, multicast_a=True),
        ptx.PtxConfig(64, 192, 6, 1, tma_store=True),
    ],
    ids=str,
)
@pytest.mark.parametrize(
    "m,n,k", [(129, 2112, 1536), (1000, 576, 7168), (13, 300, 272), (4096, 2112, 7168)]
)
def test_gpu_1d2d_192_column_tiles(cfg, m, n, k):
    # 192-column tiles start 0 or 64 columns into a scale block of B (2112 = 11 x 192, 576 = 3 x
    # 192; 300: an N tail inside the second block), with TMA-store and direct epilogues and both
    # multicasts.
    x, w = _inputs(m, n, k, seed=m + n)
    got = ptx.run_with_config(
        "1d2d", per_token_cast_to_fp8(x), per_block_cast_to_fp8(w), cfg, torch.bfloat16
    )
    _check(got, x.double() @ w.double().t(), m, n, k, f"1d2d {cfg}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind,m,n,k,out_dtype,accumulate",
    [
        ("1d2d", 4096, 2112, 7168, torch.bfloat16, False),  # V3: 4 waves + 16 tiles, 7 slices
        ("1d2d", 1037, 2112, 2176, torch.bfloat16, False),  # M tail; 17 K blocks: 2 chunks + 1
        ("1d2d", 2112, 1000, 3008, torch.float32, False),  # N tail (direct stores), K tail
        ("1d1d", 7168, 2112, 4096, torch.float32, True),  # V3 wgrad: 7 waves + 28 tiles, 4 slices
        ("1d1d", 2061, 1000, 2176, torch.float32, False),  # 1D1D with M, N and K tails
        ("1d1d", 1037, 2112, 2176, torch.bfloat16, False),
    ],
)
def test_gpu_split_tail(kind, m, n, k, out_dtype, accumulate):
    cfg = ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=True, split_k=True)
    _check_split(kind, m, n, k, out_dtype, accumulate, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,k,cfg",
    [
        # decode-sized M: one partial wave of tiles, each cut into K-slices on the idle SMs
        (64, 2112, 7168, ptx.PtxConfig(64, 32, 16, 1, double_acc=True, split_k=True)),  # 66 x 2
        (
            13,
            1000,
            3008,
            ptx.PtxConfig(64, 64, 13, 1, double_acc=True, tma_store=True, split_k=True),
        ),  # 16 tiles x 3 (24 blocks: 3 chunks)
        # 64-row tiles of K <= 2048: B's scales through the stage (sfb_in_stage), sliced
        (13, 1000, 2048, ptx.PtxConfig(64, 32, 16, 1, double_acc=True, split_k=True)),  # 32 x 2
        (
            129,
            576,
            7168,
            ptx.PtxConfig(128, 64, 8, 1, double_acc=True, tma_store=True, split_k=True),
        ),  # 18 tiles x 7, M tail
    ],
    ids=str,
)
def test_gpu_split_of_a_single_partial_wave(m, n, k, cfg):
    _check_split("1d2d", m, n, k, torch.bfloat16, False, cfg)


def _check_split(kind, m, n, k, out_dtype, accumulate, cfg):
    # Split tail against the unquantized product and the same config without it (a different
    # FP32 summation order of the cut tiles: equal up to rounding, not bitwise); the slices are
    # summed in slice order, so repeated runs are bitwise equal, and they also show that each
    # run leaves its tile counters at zero for the next (a stale count would skip stores).
    x, w = _inputs(m, n, k, seed=m + 3 * n + k)
    qa = per_token_cast_to_fp8(x)
    qb = per_block_cast_to_fp8(w) if kind == "1d2d" else per_token_cast_to_fp8(w)
    units = ((m + cfg.block_m - 1) // cfg.block_m) * ((n + cfg.block_n - 1) // cfg.block_n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # the launch itself cuts slices (not only split_tail's arithmetic)
    plan = ptx._plan(kind, m, n, k, out_dtype, accumulate, cfg, True, torch.cuda.current_device())
    assert plan[3][1] > 1, f"no split planned: {plan[3]}"
    assert ptx.split_tail(units, sms, (k + 127) // 128, 8)[1] > 1, "the shape must cut slices"
    base = torch.randn(m, n, device="cuda") if accumulate else None

    def run(c, out=None):
        if accumulate:
            out = base.clone()
        return ptx.run_with_config(kind, qa, qb, c, out_dtype, out=out, accumulate=accumulate)

    got = [run(cfg) for _ in range(3)]
    for again in got[1:]:
        torch.testing.assert_close(again, got[0], rtol=0, atol=0)
    want = x.double() @ w.double().t() + (base.double() if accumulate else 0)
    _check(got[0], want, m, n, k, f"{kind} split tail {cfg}")
    whole = run(dataclasses.replace(cfg, split_k=False))
    # Both sum the same FP32 block products; only the cut tiles' order of additions differs.
    assert calc_diff(got[0], whole) < 1e-6
    if not accumulate:
        # Into a given D (the finisher's direct stores write every element of the cut tiles).
        out = torch.full((m, n), float("nan"), dtype=out_dtype, device="cuda")
        run(cfg, out)
        torch.testing.assert_close(out, got[0], rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg,n,k",
    [
        # K = 512 keeps the row-scale reads after the wgmma wait, where the stage race lived
        (ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=False), 32768, 512),
        (ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=True), 32768, 512),
        (ptx.PtxConfig(256, 128, 3, 2, tma_store=True), 2112, 512),  # B multicast to a CTA pair
        (ptx.PtxConfig(64, 64, 3, 2, multicast_a=True), 2112, 512),  # A multicast
        # split-tail fixup (K = 7168: 56 K blocks, whole chunks to cut the partial wave into)
        (ptx.PtxConfig(128, 128, 3, 1, double_acc=True, split_k=True), 2112, 7168),
    ],
    ids=["direct", "tma-store", "cluster2-b", "cluster2-a", "split"],
)
def test_gpu_repeated_runs_are_bitwise_equal(cfg, n, k):
    # Each kernel adds its FP32 block products (and split slices) in a fixed order, so runs on
    # the same operands must agree bitwise. A race between a math warp's shared-memory reads of
    # a stage's scales and the producer's next TMA into that stage breaks this (8 rows x 128
    # columns of one tile) unless the release fence orders them: with the fence removed
    # (PTXTRAIN_GEMM_DIAG_NO_RELEASE_FENCE) such runs differ. The cluster cases reuse stages
    # across a CTA pair (a peer's multicast overwrites a stage only after both CTAs released it,
    # by remote arrives) and the split case hands the workspace between CTAs; few stages recycle
    # them fast.
    m = 4096
    x, w = _inputs(m, n, k, seed=11)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    first = ptx.run_with_config("1d2d", qa, qb, cfg, torch.float32)
    _check(first, x.double() @ w.double().t(), m, n, k, f"repeated {cfg}")
    differing = [
        int((ptx.run_with_config("1d2d", qa, qb, cfg, torch.float32) != first).sum())
        for _ in range(40)
    ]
    assert not any(differing), f"runs differing from the first: {differing}"


@pytest.mark.gpu
def test_gpu_split_tail_in_cuda_graphs():
    # Two graphs captured on the same stream, each with counters of its own, replayed on two
    # streams at once: each must give the eager result bitwise (shared counters would let a
    # warp of one graph count the other's slices and store an incomplete sum).
    m, n, k = 4096, 2112, 7168
    x, w = _inputs(m, n, k, seed=11)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    cfg = ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=True, split_k=True)
    want = ptx.run_with_config("1d2d", qa, qb, cfg, torch.bfloat16)
    outs = [torch.empty_like(want) for _ in range(2)]
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    ptx.run_with_config("1d2d", qa, qb, cfg, torch.bfloat16, out=outs[0])  # warm: compile
    for g, out in zip(graphs, outs, strict=True):
        with torch.cuda.graph(g):
            ptx.run_with_config("1d2d", qa, qb, cfg, torch.bfloat16, out=out)
    streams = [torch.cuda.Stream() for _ in range(2)]
    for _ in range(3):
        for out in outs:
            out.fill_(float("nan"))
        torch.cuda.synchronize()
        for g, st in zip(graphs, streams, strict=True):
            with torch.cuda.stream(st):
                g.replay()
        torch.cuda.synchronize()
        for out in outs:
            torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kind,out_dtype,accumulate",
    [
        ("1d2d", torch.bfloat16, False),
        ("1d2d", torch.float32, False),
        ("1d1d", torch.float32, False),
        ("1d1d", torch.float32, True),
        ("1d1d", torch.bfloat16, False),
    ],
)
@pytest.mark.parametrize("m,n,k", [(129, 576, 1536), (4096, 2112, 7168), (13, 7168, 512)])
def test_gpu_tma_store_epilogue_equals_direct_stores(kind, out_dtype, accumulate, m, n, k):
    # The two epilogues write the same FP32 accumulators (the same main loop), rounded by the
    # same cvt.rn: bitwise equal. Accumulate: TMA adds (cp.reduce.async.bulk .add) vs a load,
    # one fp32 add and a store: the same single rounding of old + new.
    x, w = _inputs(m, n, k, seed=m + 2 * n + k)
    qa = per_token_cast_to_fp8(x)
    qb = per_block_cast_to_fp8(w) if kind == "1d2d" else per_token_cast_to_fp8(w)
    base = torch.randn(m, n, device="cuda").to(out_dtype) if accumulate else None
    got = {}
    # (tma_store, epi_boxes): direct stores, the whole tile staged, one box at a time (rounds).
    for tma, boxes in ((False, 0), (True, 0), (True, 1)):
        cfg = ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=tma, epi_boxes=boxes)
        out = base.clone() if accumulate else None
        got[tma, boxes] = ptx.run_with_config(
            kind, qa, qb, cfg, out_dtype, out=out, accumulate=accumulate
        )
    for key in ((True, 0), (True, 1)):
        torch.testing.assert_close(got[key], got[False, 0], rtol=0, atol=0)
    got[True] = got[True, 0]
    want = x.double() @ w.double().t() + (base.double() if accumulate else 0)
    _check(got[True], want, m, n, k, f"{kind} tma store")
    # A contiguous D at a 2- or 4-byte offset (misaligned for the epilogues' vector stores) is
    # written through an aligned temporary: the same numbers, nothing outside D touched.
    flat = torch.full((m * n + 8,), float("nan"), dtype=out_dtype, device="cuda")
    shifted = flat[1 : 1 + m * n].view(m, n)
    assert shifted.data_ptr() % 16 != 0
    if accumulate:
        shifted.copy_(base)
    cfg = ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=True)
    ptx.run_with_config(kind, qa, qb, cfg, out_dtype, out=shifted, accumulate=accumulate)
    torch.testing.assert_close(shifted, got[True], rtol=0, atol=0)
    assert torch.isnan(flat[0]) and torch.isnan(flat[1 + m * n :]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "m,n,k", [(129, 576, 1536), (4096, 2112, 7168), (13, 7168, 512), (300, 1000, 2048)]
)
def test_gpu_256_row_epilogue_stagings_agree(out_dtype, m, n, k):
    # 256-row tiles (two waves per math warpgroup): direct stores, one staged box per round,
    # a wave's boxes per round, and (bf16 D) both waves staged at once (epi_boxes = twice a
    # wave's boxes, no wait between the waves) store the same accumulators with the same cvt.rn:
    # bitwise equal, and right against the FP64 product (M and N tails clip the second wave).
    x, w = _inputs(m, n, k, seed=3 * m + n + k)
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    wave_boxes = 2 if out_dtype == torch.bfloat16 else 4  # 128 columns in 128-byte boxes
    variants = [(False, 0, 4), (True, 1, 4), (True, wave_boxes, 3)]
    if out_dtype == torch.bfloat16:  # (fp32: both waves' boxes exceed shared memory)
        variants.append((True, 2 * wave_boxes, 3))
    got = {}
    for tma, boxes, stages in variants:
        cfg = ptx.PtxConfig(256, 128, stages, 2, tma_store=tma, epi_boxes=boxes)
        got[tma, boxes] = ptx.run_with_config("1d2d", qa, qb, cfg, out_dtype)
    for key, val in got.items():
        torch.testing.assert_close(val, got[False, 0], rtol=0, atol=0, msg=f"{key}")
    _check(got[False, 0], x.double() @ w.double().t(), m, n, k, "256-row epilogues")


def _m_grouped_problem(sizes, n: int, k: int, seed: int):
    """An m-grouped GEMM on CUDA with ``sizes`` rows per group (each padded to 128 rows, the
    padding rows of A random garbage): ``(m_indices, (A fp8, sf), (B [G, N, K] fp8, sf), want)``,
    ``want`` the fp64 product of each group's rows with its B (zeros on padding rows)."""
    from ptxtrain.moe.ref import grouped_layout_ref

    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(sizes, dtype=torch.int64)
    padded_rows, m_indices = grouped_layout_ref(counts, 128)
    x = torch.randn(m_indices.numel(), k, generator=g) * 3  # padding rows: garbage
    x[padded_rows] = torch.randn(int(counts.sum()), k, generator=g)
    w = torch.randn(len(sizes), n, k, generator=g)
    x, w, m_indices = x.cuda(), w.cuda(), m_indices.cuda()
    qa = per_token_cast_to_fp8(x)
    qb = [per_block_cast_to_fp8(w[i]) for i in range(len(sizes))]
    qb = (torch.stack([q[0] for q in qb]), torch.stack([q[1] for q in qb]))
    mi = m_indices.long()
    want = torch.zeros((m_indices.numel(), n), dtype=torch.float64, device="cuda")
    for i in range(len(sizes)):
        rows = (mi == i).nonzero().flatten()
        want[rows] = x[rows].double() @ w[i].double().t()
    return m_indices, qa, qb, want


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sizes,n,k,out_dtype",
    [
        ((0, 1, 127, 129, 700, 1024, 1000, 1114), 4096, 7168, torch.bfloat16),
        ((0, 1, 127, 129, 700, 1024, 1000, 1114), 7168, 2048, torch.bfloat16),
        ((3, 0, 129, 64), 300, 272, torch.bfloat16),  # N, K tails: direct-store epilogue
        ((5, 200, 1), 576, 1536, torch.float32),
    ],
)
def test_gpu_m_grouped_contiguous(sizes, n, k, out_dtype):
    # The PTX m-grouped kernel against the dense product of each group's rows (fp64) and the
    # reference on the same FP8 operands; padding rows (random garbage in A) must store zeros.
    from ptxtrain.gemm import grouped as gg

    m_indices, qa, qb, want = _m_grouped_problem(sizes, n, k, seed=n + k)
    got = ptx.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices, out_dtype=out_dtype)
    assert got.dtype == out_dtype and got.shape == (m_indices.numel(), n)
    mi = m_indices.long()
    _check(got, want, m_indices.numel(), n, k, f"m-grouped {sizes}")
    assert bool((got[mi < 0] == 0).all()), "padding rows must be zeros"
    # The dispatcher sends a K-major B here (same kernel: bitwise); a transposed-view B (not
    # K-major) goes to Triton, still correct.
    torch.testing.assert_close(
        gg.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices, out_dtype=out_dtype),
        got,
        rtol=0,
        atol=0,
    )
    # Without the index check, a chunk naming a group >= G is a zero tile, not a wild read.
    bad = m_indices.clone()
    first = int((mi >= 0).nonzero()[0])
    chunk = first // 128 * 128
    bad[chunk : chunk + 128] = torch.where(bad[chunk : chunk + 128] >= 0, len(sizes) + 5, -1)
    res = ptx.m_grouped_fp8_gemm_nt_contiguous(
        qa, qb, bad, out_dtype=out_dtype, check_indices=False
    )
    assert bool((res[chunk : chunk + 128] == 0).all())
    keep = torch.ones(res.shape[0], dtype=torch.bool, device="cuda")
    keep[chunk : chunk + 128] = False
    torch.testing.assert_close(res[keep], got[keep], rtol=0, atol=0)  # other tiles unchanged
    # Padding rows anywhere in their 128-row chunk (the contract's layout; the kernel takes a
    # tile's group as the largest index of its rows): every chunk reversed, padding rows first,
    # gives the same rows bit for bit.
    perm = torch.arange(m_indices.numel(), device="cuda").view(-1, 128).flip(1).flatten()
    rev = ptx.m_grouped_fp8_gemm_nt_contiguous(
        (qa[0][perm], qa[1][perm]), qb, m_indices[perm], out_dtype=out_dtype
    )
    torch.testing.assert_close(rev, got[perm], rtol=0, atol=0)
    # The per-64-row groups are cached on the m_indices tensor: an in-place change (a chunk of
    # real rows turned into padding) must reach the next call, which then zeroes those rows.
    mine = m_indices.clone()
    assert ptx.m_grouped_fp8_gemm_nt_contiguous(qa, qb, mine, out_dtype=out_dtype).equal(got)
    mine[chunk : chunk + 128] = -1
    res = ptx.m_grouped_fp8_gemm_nt_contiguous(qa, qb, mine, out_dtype=out_dtype)
    assert bool((res[chunk : chunk + 128] == 0).all())
    torch.testing.assert_close(res[keep], got[keep], rtol=0, atol=0)


@pytest.mark.gpu
def test_gpu_m_grouped_split_tail(monkeypatch):
    # 8 experts of 0-640 rows at 4096 x 7168: 34 x 32 tiles of 128x128 on an H200's 132 SMs = 8
    # waves + 32 tiles, which grouped_config cuts into K-slices. Against the same kernel without the
    # cut: the same products summed in another order (fp32 partial sums, then one bf16
    # rounding), and the cut runs repeat bitwise (slices summed in slice order).
    from ptxtrain.moe.ref import grouped_layout_ref

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sizes, n, k = [640, 600, 0, 640, 639, 640, 640, 500], 4096, 7168
    rows = grouped_layout_ref(torch.tensor(sizes), 128)[1].numel()
    if not ptx.grouped_config(rows, n, k, sms, len(sizes)).split_k:
        pytest.skip(f"no partial last wave on {sms} SMs")
    m_indices, qa, qb, want = _m_grouped_problem(sizes, n, k, seed=5)
    ptx._plan.cache_clear()
    cut = [ptx.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices) for _ in range(3)]
    for other in cut[1:]:
        torch.testing.assert_close(other, cut[0], rtol=0, atol=0)
    monkeypatch.setattr(ptx, "_SPLIT_TAIL", False)
    ptx._plan.cache_clear()
    whole = ptx.m_grouped_fp8_gemm_nt_contiguous(qa, qb, m_indices)
    ptx._plan.cache_clear()
    # (bf16 D: the two fp32 sums round to the same or to adjacent bf16 values, ~1e-6 calc_diff)
    assert calc_diff(cut[0].float(), whole.float()) < 1e-5
    assert bool((cut[0][m_indices < 0] == 0).all()), "padding rows must be zeros"
    _check(cut[0], want, m_indices.numel(), n, k, "m-grouped split tail")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "m,n,ks",
    [
        (4096, 7168, [0, 128, 256, 512, 640, 1024, 768, 768]),  # dW of gate+up, 8 experts
        (7168, 2048, [512] * 8),  # dW of down
        (13, 300, [128, 0, 384]),  # M, N tails: direct-store epilogue for M % BLOCK_M != 0
        (200, 576, [0, 0]),  # every group empty
    ],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_gpu_k_grouped(m, n, ks, accumulate):
    # The PTX k-grouped (wgrad) kernel against each group's fp64 product; accumulate adds to a
    # random fp32 D; the dispatcher (ptxtrain.gemm.grouped) sends the call here on sm_90.
    from ptxtrain.gemm import grouped as gg

    total = sum(ks)
    g = torch.Generator().manual_seed(m + n + total)
    a = torch.randn(m, total, generator=g).cuda()
    b = torch.randn(n, total, generator=g).cuda()
    qa, qb = per_token_cast_to_fp8(a), per_token_cast_to_fp8(b)
    base = torch.randn(len(ks), m, n, generator=g).cuda()
    out = base.clone() if accumulate else None
    got = ptx.k_grouped_fp8_gemm_nt_contiguous(qa, qb, ks, out=out, accumulate=accumulate)
    assert got.shape == (len(ks), m, n) and got.dtype == torch.float32
    start = 0
    for i, kg in enumerate(ks):
        want = a[:, start : start + kg].double() @ b[:, start : start + kg].double().t()
        if accumulate:
            want = want + base[i].double()
        if kg == 0:
            # An empty group: exactly zeros, or D unchanged when accumulating.
            torch.testing.assert_close(got[i], base[i] if accumulate else torch.zeros_like(got[i]))
        else:
            _check(got[i], want, m, n, kg, f"k-grouped group {i}")
        start += kg
    again = gg.k_grouped_fp8_gemm_nt_contiguous(
        qa, qb, ks, out=base.clone() if accumulate else None, accumulate=accumulate
    )
    torch.testing.assert_close(again, got, rtol=0, atol=0)  # same kernel through the dispatcher

    # The sizes as a device tensor (no host sync), with 128 unused trailing columns of A and B:
    # the same K ranges, so the same bits.
    def pad(q):
        return (
            torch.cat([q[0], torch.full_like(q[0][:, :128], 100.0)], 1),
            torch.cat([q[1], torch.full_like(q[1][:, :1], 1e3)], 1),
        )

    dev = ptx.k_grouped_fp8_gemm_nt_contiguous(
        pad(qa), pad(qb), None, ks_tensor=torch.tensor(ks, device="cuda"),
        out=base.clone() if accumulate else None, accumulate=accumulate,
    )  # fmt: skip
    torch.testing.assert_close(dev, got, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "g,m_max,n,k,out_dtype",
    [
        (8, 256, 4096, 7168, torch.bfloat16),
        (8, 256, 7168, 2048, torch.bfloat16),
        (3, 100, 300, 272, torch.bfloat16),  # M_max, N, K tails: direct-store epilogue
        (4, 128, 576, 1536, torch.float32),
    ],
)
def test_gpu_m_grouped_masked(g, m_max, n, k, out_dtype, monkeypatch):
    # The PTX masked (decode) kernel: rows below masked_m[g] against each group's fp64 product
    # (rows past it are unspecified); masked_m read on the device only; with
    # PTXTRAIN_GEMM_BACKEND=ptx the dispatcher (ptxtrain.gemm.grouped) sends the call here
    # (same kernel: bitwise).
    from ptxtrain.gemm import grouped as gg

    monkeypatch.setenv("PTXTRAIN_GEMM_BACKEND", "ptx")
    gen = torch.Generator().manual_seed(g * m_max + n + k)
    counts = [0, 1, 64, 127, 128, 129, 200, 256][:g] if m_max == 256 else [m_max, 0, 37, 5][:g]
    masked_m = torch.tensor(counts, dtype=torch.int32, device="cuda")
    x = torch.randn(g, m_max, k, generator=gen).cuda()
    w = torch.randn(g, n, k, generator=gen).cuda()
    qa = per_token_cast_to_fp8(x.view(-1, k))
    qa = (qa[0].view(g, m_max, k), qa[1].view(g, m_max, -1))
    qb = [per_block_cast_to_fp8(w[i]) for i in range(g)]
    qb = (torch.stack([q[0] for q in qb]), torch.stack([q[1] for q in qb]))
    got = ptx.m_grouped_fp8_gemm_nt_masked(qa, qb, masked_m, out_dtype=out_dtype)
    assert got.shape == (g, m_max, n) and got.dtype == out_dtype
    for i, c in enumerate(counts):
        if c:
            want = x[i, :c].double() @ w[i].double().t()
            _check(got[i, :c], want, c, n, k, f"masked group {i}")
    again = gg.m_grouped_fp8_gemm_nt_masked(qa, qb, masked_m, out_dtype=out_dtype)
    for i, c in enumerate(counts):
        torch.testing.assert_close(again[i, :c], got[i, :c], rtol=0, atol=0)
