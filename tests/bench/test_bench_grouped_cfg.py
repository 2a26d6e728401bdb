"""``benchmarks/bench_grouped.py --cfg``: explicit m-grouped PTX configs, parsed before any GPU
work, and the launch path they take."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_grouped import _grouped_cfg
from ptxtrain.gemm import ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8


def test_config_and_rasterization_rows():
    cfg = _grouped_cfg("128x128s6c1de1:r256")
    assert (cfg.block_m, cfg.block_n, cfg.num_stages, cfg.cluster) == (128, 128, 6, 1)
    assert cfg.double_acc and cfg.tma_store and cfg.epi_boxes == 1 and cfg.raster_m == 256
    # without a raster part: 512 rows, grouped_config's choice when the group sizes are unknown
    assert _grouped_cfg("128x128s5c1dk").raster_m == 512 and _grouped_cfg("128x128s5c1dk").split_k
    with pytest.raises(ValueError, match="raster"):
        _grouped_cfg("128x128s5c1d:rfour")
    with pytest.raises(ValueError, match="128x128s5c1d"):
        _grouped_cfg("128x128")


def test_explicit_config_reaches_the_launch(monkeypatch):
    # The config given to ptx.m_grouped_contiguous_unchecked is the one launched (None: the
    # heuristic's), with the per-64-row-block groups the kernel reads. Host code only: no kernel
    # runs.
    seen = {}

    def fake_launch(kind, a, b, out, accumulate, out_dtype, cfg=None, grouped=None, k_offsets=None):
        seen.update(kind=kind, cfg=cfg, block_group=grouped[1].tolist())

    monkeypatch.setattr(ptx, "_check_runnable", lambda *args: None)
    monkeypatch.setattr(ptx, "launch_gemm", fake_launch)
    g = torch.Generator().manual_seed(0)
    qa = per_token_cast_to_fp8(torch.randn(256, 256, generator=g))
    qws = [per_block_cast_to_fp8(torch.randn(128, 256, generator=g)) for _ in range(2)]
    qb = (torch.stack([q for q, _ in qws]), torch.stack([s for _, s in qws]))
    m_indices = torch.tensor([0] * 128 + [1] * 100 + [-1] * 28, dtype=torch.int32)
    cfg = _grouped_cfg("128x128s5c1d:r256")
    dims = (256, 128, 256, 2)
    ptx.m_grouped_contiguous_unchecked(qa, qb, m_indices, None, torch.bfloat16, dims, cfg)
    assert seen == dict(kind="m_grouped", cfg=cfg, block_group=[0, 0, 1, 1])
    ptx.m_grouped_contiguous_unchecked(qa, qb, m_indices, None, torch.bfloat16, dims)
    assert seen["cfg"] is None
