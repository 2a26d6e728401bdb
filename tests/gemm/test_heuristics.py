"""GEMM launch-config heuristics: pure functions, checked without a GPU."""

import dataclasses

import pytest
import torch

from ptxtrain.gemm.heuristics import (
    BLOCK_K,
    GLUON_TILES,
    H100_SMS,
    VARIANTS,
    GemmConfig,
    autotune_configs,
    device_sms,
    gluon_split_k,
    gluon_tile,
    m_bucket,
    num_tiles,
    prefers_gluon,
    select_config,
)
from ptxtrain.testing.shapes import (
    AWKWARD_M,
    AWKWARD_NK,
    DSV3_DENSE_NK,
    DSV3_EXTRA_NK,
    DSV3_WGRAD_MN,
)

DENSE = DSV3_DENSE_NK + DSV3_EXTRA_NK
SMEM_LIMIT = 227 * 1024  # sm_90 shared memory per block


def test_config_defaults_and_properties():
    cfg = GemmConfig()
    assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (64, 128, 4, 3)
    assert cfg.block_k == BLOCK_K == 128
    assert not cfg.persistent and not cfg.uses_tma
    tp = GemmConfig(variant="tma_persistent", programs_per_sm=2)
    assert tp.persistent and tp.uses_tma
    assert GemmConfig(128, 128, 8).acc_regs_per_thread() == 2 * 128 * 128 // 256
    assert GemmConfig(64, 128, 4, 3).smem_bytes() == 3 * (64 + 128) * 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_m = 128  # frozen: a config is a value


@pytest.mark.parametrize(
    "field,value",
    [
        ("block_m", 32),
        ("block_n", 96),
        ("num_warps", 2),
        ("num_stages", 0),
        ("variant", "warp_specialized"),
        ("programs_per_sm", 5),
        ("group_m", 0),
        ("block_m", True),
    ],
)
def test_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=f"GemmConfig.{field}"):
        GemmConfig(**{field: value})


@pytest.mark.parametrize("m", [0, 1, 13, 64, 128, 129, 4096, 16384])
@pytest.mark.parametrize("n,k", [*DENSE, *AWKWARD_NK])
@pytest.mark.parametrize("kind", ["1d2d", "1d1d"])
def test_select_config_is_valid_and_fills_the_gpu(m, n, k, kind):
    cfg = select_config(m, n, k, kind)
    assert isinstance(cfg, GemmConfig)
    assert cfg == select_config(m, n, k, kind)  # deterministic
    # No spills: two fp32 tiles within 128 registers/thread; operand ring within shared memory.
    assert cfg.acc_regs_per_thread() <= 128 and cfg.smem_bytes() <= SMEM_LIMIT - 64 * 1024
    tiles = num_tiles(max(m, 1), max(n, 1), cfg)
    # Fill the SMs: the chosen tiles never leave SMs idle while a 64x64 split would use them.
    finest = num_tiles(max(m, 1), max(n, 1), GemmConfig(64, 64))
    assert tiles >= min(H100_SMS, finest), f"{m=} {n=} {k=}: {tiles} tiles for {cfg}"
    if cfg.persistent:
        assert cfg.programs_per_sm >= 2  # one program per SM leaves its promotion unhidden


@pytest.mark.parametrize("n,k", DENSE)
def test_select_config_dsv3_regimes(n, k):
    # Decode-sized M: 64-row tiles, pointer loads (lowest host overhead), tiles spread over SMs.
    small = select_config(64, n, k)
    assert small.block_m == 64 and small.variant == "tiled"
    # Training-sized M: 64x128 one-warpgroup tiles (2-3 programs per SM) loaded through TMA.
    big = select_config(4096, n, k)
    assert (big.block_m, big.block_n, big.num_warps, big.num_stages) == (64, 128, 4, 3)
    assert big.uses_tma
    assert big.persistent == (k <= 512)


@pytest.mark.parametrize("m,n", DSV3_WGRAD_MN)
def test_select_config_wgrad_is_persistent_tma(m, n):
    cfg = select_config(m, n, 4096, "1d1d")
    assert cfg.variant == "tma_persistent" and cfg.programs_per_sm == 2


def test_select_config_depends_on_num_sms():
    # 2112 columns in 64-wide tiles are 33 tiles at M = 64: at most two waves on 17 SMs, not on 8.
    assert select_config(64, 2112, 7168, num_sms=17).block_n == 64
    assert select_config(64, 2112, 7168, num_sms=8).block_n == 128


def test_device_sms_off_cuda_is_an_h200():
    # The interpreter (CPU tensors) chooses configs as for the GPU the kernels are meant for.
    assert device_sms(torch.device("cpu")) == H100_SMS == 132


@pytest.mark.gpu
def test_gpu_device_sms_matches_the_device():
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert device_sms(torch.device("cuda")) == props.multi_processor_count


@pytest.mark.parametrize("variant", VARIANTS)
def test_select_config_variant_override(variant):
    cfg = select_config(4096, 7168, 2048, variant=variant)
    auto = select_config(4096, 7168, 2048)
    assert cfg.variant == variant
    assert (cfg.block_m, cfg.block_n) == (auto.block_m, auto.block_n)
    assert cfg.programs_per_sm == (2 if cfg.persistent else 1)


@pytest.mark.parametrize(
    "args,kwargs,exc,match",
    [
        ((-1, 8, 8), {}, ValueError, "m must be >= 0"),
        ((8, 8.0, 8), {}, TypeError, "n must be an int"),
        ((8, 8, True), {}, TypeError, "k must be an int"),
        ((8, 8, 8, "2d2d"), {}, ValueError, "kind must be one of"),
        ((8, 8, 8, "1d2d", 0), {}, ValueError, "num_sms must be an int >= 1"),
        ((8, 8, 8), {"variant": "fast"}, ValueError, "variant must be one of"),
    ],
)
def test_select_config_rejects_bad_arguments(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        select_config(*args, **kwargs)


def test_m_bucket():
    assert [m_bucket(m) for m in (0, 1, 16, 17, 64, 65, 4096, 4097, 100000)] == [
        16,
        16,
        16,
        32,
        64,
        128,
        4096,
        8192,
        8192,
    ]
    with pytest.raises(ValueError, match="m must be an int >= 0"):
        m_bucket(-3)


@pytest.mark.parametrize("m", [*AWKWARD_M, 4096])
def test_autotune_configs(m):
    cands = autotune_configs(m, 7168, 2048)
    assert cands[0] == select_config(m, 7168, 2048)  # the heuristic's choice is tried first
    assert len(set(cands)) == len(cands)
    assert {c.variant for c in cands} == set(VARIANTS)
    for c in cands:
        assert c.acc_regs_per_thread() <= 128 and c.smem_bytes() <= SMEM_LIMIT - 64 * 1024, c
        assert m > 64 or c.block_m == 64, c  # a 128-row tile would be more than half empty
        assert c.persistent or c.programs_per_sm == 1, c
    pointer_only = autotune_configs(m, 7168, 2048, variants=("tiled", "persistent"))
    assert pointer_only and all(not c.uses_tma for c in pointer_only)
    with pytest.raises(ValueError, match="variant must be one of"):
        autotune_configs(m, 7168, 2048, variants=("tiled", "nope"))


def test_prefers_gluon_takes_gemms_of_two_waves():
    """The warp-specialized Gluon kernel from 2 waves of 128x128 tiles (264 on 132 SMs)."""
    # Every V3 shape at M = 4096 (4096 x 2112: 32 x 17 = 544 tiles), and every wgrad shape.
    assert all(prefers_gluon(4096, n, k) for n, k in DSV3_DENSE_NK)
    assert all(prefers_gluon(m, n, 4096, "1d1d") for m, n in DSV3_WGRAD_MN)
    assert prefers_gluon(2048, 2112, 7168)  # 16 x 17 = 272
    # Decode-sized M stays on the Triton kernel (M = 128 x N = 32768: 256 tiles).
    assert not any(prefers_gluon(m, n, k) for m in (1, 64, 128) for n, k in DSV3_DENSE_NK)
    assert not prefers_gluon(4096, 7168, 0)  # K = 0: nothing to multiply
    # The boundary: 264 tiles = 2 x 132; a partial row of tiles counts.
    assert prefers_gluon(128 + 1, 128 * 132, 512)  # 2 x 132
    assert not prefers_gluon(128, 128 * 263, 512, "1d1d")  # 1 x 263
    assert prefers_gluon(128, 128 * 264, 512, num_sms=132)
    assert not prefers_gluon(128, 128 * 264, 512, num_sms=133)
    with pytest.raises(ValueError, match="kind"):
        prefers_gluon(4096, 7168, 2048, "2d2d")
    with pytest.raises(TypeError, match="m must be an int"):
        prefers_gluon(4096.0, 7168, 2048)


def test_gluon_tile_by_wave_fill():
    """The fewest-L2-bytes tile whose waves fill within 5 points of the best-filling tile."""
    picks = {(n, k): gluon_tile(4096, n, k) for n, k in DSV3_DENSE_NK}
    # 4096 x 2112: 256x128's 16 x 17 = 272 tiles are 2 waves and 8 tiles, which the split tail
    # cuts into 7 K-slices each: 97.5% (without the split 69%, 256x64's 528 tiles 100%).
    assert picks == {nk: (256, 128) for nk in DSV3_DENSE_NK}, picks
    # 448 tiles of 256x128 whose 52 last are split only 2 ways: 85% (counted as 3.5 waves,
    # 97%, as 128x128's 896 tiles, they measured slower)
    assert gluon_tile(2048, 7168, 2048) == (128, 128)
    assert gluon_tile(2048, 4096, 7168) == (256, 128)  # 256 tiles: 97%, as 128x128's 512
    # 1024 x 7168 x 16384: 128x128's 448 tiles leave 52 split only 2 ways (85%, as 256x128)
    assert gluon_tile(1024, 7168, 16384) == (256, 128)
    # K = 256 (2 blocks) cannot be split: 256x128's 272 tiles fill 69% of 3 waves, 128x128's
    # 544 82% of 5, 256x64's 528 4 waves exactly.
    assert gluon_tile(4096, 2112, 256) == (256, 64)
    assert all(gluon_tile(m, n, 4096, "1d1d") == (128, 128) for m, n in DSV3_WGRAD_MN)
    assert gluon_tile(0, 0, 0) == GLUON_TILES[0]  # no tiles: nothing to fill either way
    with pytest.raises(ValueError, match="num_sms"):
        gluon_tile(4096, 7168, 2048, num_sms=0)


def test_gluon_split_k():
    """The partial last wave's tiles cut into K-slices: SMs per tail tile, at most 16 (or the
    given cap), at least 8 K blocks per slice; none without a partial wave or with fewer than
    2 slices."""
    assert gluon_split_k(272, 132, 56) == (264, 7)  # 8 tail tiles: 16 SMs each, 56 / 8 = 7
    assert gluon_split_k(272, 132, 56, max_splits=4) == (264, 4)
    assert gluon_split_k(952, 132, 32) == (924, 4)  # 28 tail tiles: 4 SMs each
    assert gluon_split_k(2304, 132, 32) == (2244, 2)  # 60 tail tiles: 2 SMs each
    assert gluon_split_k(3072, 132, 12) == (3072, 1)  # 12 K blocks: one slice of >= 8
    assert gluon_split_k(3, 132, 16) == (0, 2)  # one partial wave only: every tile split
    assert gluon_split_k(8, 132, 1000) == (0, 16)  # at most 16 slices
    assert gluon_split_k(512, 132, 56) == (512, 1)  # 116 tail tiles: 1 SM each
    assert gluon_split_k(264, 132, 56) == (264, 1)  # whole waves
    assert gluon_split_k(0, 132, 56) == (0, 1)
    for bad in (-1, 1.0, True):
        with pytest.raises(ValueError, match="num_tiles"):
            gluon_split_k(bad, 132, 56)
    with pytest.raises(ValueError, match="num_sms"):
        gluon_split_k(272, 0, 56)
    with pytest.raises(ValueError, match="k_blocks"):
        gluon_split_k(272, 132, -1)
