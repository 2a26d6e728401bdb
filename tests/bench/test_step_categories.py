"""benchmarks/step_categories.py: kernel names to categories, interval unions, the breakdown."""

from __future__ import annotations

import pytest

from benchmarks import step_categories as sc
from ptxtrain.parallel.timeline import union_length


@pytest.mark.parametrize(
    "name,category",
    [
        ("void fp8_gemm_nt_kernel<Mma, 128, 160, 5, 2048, 7168>(...)", "gemm"),
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_NNT", "gemm"),
        ("_fp8_gemm_kernel", "gemm"),
        ("cutlass::device_kernel<GroupedGemmKernel>", "gemm"),
        (
            "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShape_Layout",
            "gemm",
        ),
        ("_m_grouped_contiguous_kernel", "gemm"),
        ("_adamw_update_kernel", "optimizer"),
        ("void cast_fp8<1, false, true, true, false>(...)", "quantize"),
        ("_quant_1x_kernel", "quantize"),
        ("flash_fwd_kernel", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90", "attention"),
        ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", "attention"),
        ("_fused_adamw_kernel", "optimizer"),
        ("void multi_tensor_apply_kernel<...>", "optimizer"),
        ("_layout_gather_kernel", "moe_layout"),
        ("_unpermute_kernel", "moe_layout"),
        ("void at::native::radixSortKVInPlace<...>", "moe_layout"),
        ("void at::native::vectorized_elementwise_kernel<4, silu>", "elementwise"),
        ("Memset (Device)", "elementwise"),
    ],
)
def test_categorize(name, category):
    assert sc.categorize(name) == category


def test_union_length_merges_overlaps():
    assert union_length([]) == 0.0
    assert union_length([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    assert union_length([(5, 6), (1, 2), (1.5, 1.7)]) == pytest.approx(2.0)


def test_breakdown_sums_to_the_span_without_overlap():
    kernels = [
        ("fp8_gemm_nt_kernel", 0.0, 4.0),
        ("cast_fp8", 4.0, 5.0),
        ("_unpermute_kernel", 6.0, 7.0),
    ]
    out = sc.breakdown(kernels, span=10.0)
    assert out["gemm"] == 4.0 and out["quantize"] == 1.0 and out["moe_layout"] == 1.0
    assert out["idle"] == pytest.approx(4.0)
    assert sum(out.values()) == pytest.approx(10.0)
    table = sc.format_breakdown(out, 10.0)
    assert "idle" in table and "40.0%" in table
