"""benchmarks/ab_ptx.py's variant specs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks import ab_ptx
from ptxtrain.gemm import ptx
from ptxtrain.gemm.heuristics import SM90_SMEM_BYTES


def test_stage_specs_with_and_without_epilogue_boxes():
    assert ab_ptx.parse_variant("s5:s5") == ("s5", "s5", "", None, "off")
    name, cfg_text, defines, split, ffma_yield = ab_ptx.parse_variant(
        "x:s6e1:#PTXTRAIN_GEMM_CHUNK=16:nosplit"
    )
    assert (name, cfg_text, split, ffma_yield) == ("x", "s6e1", False, "off")
    assert defines == "#define PTXTRAIN_GEMM_CHUNK 16\n"
    for bad in ("x:s6e", "x:se1", "x:s6e1x"):
        with pytest.raises(ValueError):  # not a stage spec, so parsed (and refused) as a config
            ab_ptx.parse_variant(bad)


def test_stage_spec_keeps_the_heuristic_tiles_and_fits_shared_memory():
    base = ptx.select_config("1d1d", 4096, 7168, 4096, 132)
    cfg = ab_ptx._with_stages(base, 32, "1d1d", torch.bfloat16)
    assert (cfg.block_m, cfg.block_n) == (base.block_m, base.block_n)
    assert ptx.config_smem_bytes(cfg, "1d1d", torch.bfloat16) <= SM90_SMEM_BYTES
    deeper = ab_ptx._with_stages(dataclasses.replace(base, epi_boxes=1), 32, "1d1d", torch.bfloat16)
    # one staged box per warpgroup instead of the whole tile leaves room for more stages
    assert deeper.num_stages > cfg.num_stages
