"""Grouped FP8 GEMMs vs the dense FP8 GEMM at the same total M, on a GPU (issue 5's target).

    python3 -m benchmarks.bench_grouped [--json OUT.json]

DeepSeek-V3 expert shapes N x K = 4096 x 7168 and 7168 x 2048; 8 experts of 512 tokens (4096
rows in all, already multiples of the 128-row alignment), and for the m-grouped contiguous GEMM
against dense PTX also DeepGEMM's settings (``--configs``: 8 x 4096 and 4 x 8192, ANCHORS §1:
1214-1346 TFLOPS there on an H800), same method as ``ptxtrain bench gemm``
(CUDA events, L2 flushed, launch hidden, median). Every result is checked (calc_diff < 1e-3
against the matmul of the unquantized inputs) before it is timed.

Diagnostics: ``--same-expert`` also times the m-grouped GEMM with every row on
expert 0 (one B, as the dense GEMM reads it) and the kernel alone (its per-call ``block_group``
reduction outside the timing); ``--dense-cfg`` times the dense kernel with explicit block sizes
and rasterization; ``--cfg`` / ``--ab`` vary the m-grouped kernel's.
"""

# The timed lambdas close over loop variables on purpose: each is called within its iteration.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch

from benchmarks.ab_ptx import parse_variant
from benchmarks.profile_gemm import parse_config
from ptxtrain.bench.gemm import SF_LAYOUT
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas, grouped, ptx
from ptxtrain.gemm import triton as tg
from ptxtrain.gemm.heuristics import select_config
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff

G, ROWS = 8, 512


def timed(timer, name, fn, flops, want, rows, shape, **info):
    """Check ``fn()`` (calc_diff < 1e-3, the GEMM contract's bound), time it, record a row
    (``info`` adds fields) and print it; returns TFLOPS."""
    d = fn()
    diff = calc_diff(d.float(), want)
    assert diff < 1e-3, f"{name} {shape}: calc_diff {diff:.2e}"
    us = timer(fn)
    tflops = flops / (us * 1e-6) / 1e12
    rows.append(dict(shape=shape, op=name, us=us, tflops=tflops, calc_diff=diff, **info))
    print(f"{shape!s:<22} {name:<28} {us:9.1f} µs {tflops:7.0f} TFLOPS  diff {diff:.1e}")
    return tflops


def m_grouped_operands(n: int, k: int, groups: int = G, rows: int = ROWS) -> dict:
    """``groups`` experts x ``rows`` tokens of A [groups·rows, k] and B [groups, n, k] (fp32
    randn on CUDA), their FP8 quantizations, ``m_indices`` and the reference D of the m-grouped
    GEMM."""
    m = groups * rows
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(groups, n, k, device="cuda")
    qws = [per_block_cast_to_fp8(w[g]) for g in range(groups)]
    return dict(
        m=m,
        x=x,
        w=w,
        qa=per_token_cast_to_fp8(x, sf_layout=SF_LAYOUT),
        qws=qws,
        qb=(torch.stack([q for q, _ in qws]), torch.stack([s for _, s in qws])),
        m_indices=torch.arange(groups, device="cuda", dtype=torch.int32).repeat_interleave(rows),
        want=torch.cat([x[g * rows : (g + 1) * rows] @ w[g].t() for g in range(groups)]),
    )


def _grouped_cfg(spec: str) -> ptx.PtxConfig:
    """``"128x128s6c1de1:r256"`` -> the PtxConfig (raster_m 256; default grouped_config's for
    unknown group sizes, ``ptx.GROUPED_RASTER_M``).

    Raises:
        ValueError: a malformed config or raster part.
    """
    text, _, raster = spec.partition(":r")
    cfg = parse_config(text)
    if raster and not raster.isdigit():
        raise ValueError(f"--cfg {spec!r}: expected CONFIG[:rROWS], got raster {raster!r}")
    return dataclasses.replace(cfg, raster_m=int(raster) if raster else ptx.GROUPED_RASTER_M)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument(
        "--configs",
        default=f"{G}x{ROWS},8x4096,4x8192",
        help="m-grouped experts x rows per expert (DeepGEMM's tests: 8x4096 and 4x8192)",
    )
    ap.add_argument(
        "--ab",
        nargs="*",
        default=[],
        help="header switches (#MACRO=VALUE, as benchmarks.ab_ptx) under which the m-grouped "
        "contiguous GEMM is timed again, in the same process, against the same dense PTX",
    )
    ap.add_argument(
        "--cfg",
        nargs="*",
        default=[],
        help="explicit PTX configs of the m-grouped contiguous GEMM (BMxBNsSTAGEScCLUSTER[a][d]"
        "[k][eN] as benchmarks.profile_gemm, with an optional ':rROWS' rasterization group), each "
        "timed in the same process against the same dense PTX",
    )
    ap.add_argument(
        "--dense-cfg",
        nargs="*",
        default=[],
        help="explicit PTX configs of the dense GEMM (as --cfg; ':rROWS' sets its rasterization "
        "group, default 512 as the grouped kernel's), timed against the heuristic's dense PTX",
    )
    ap.add_argument(
        "--same-expert",
        action="store_true",
        help="diagnostic: also time the m-grouped contiguous GEMM with every row on expert 0 "
        "(m_indices all 0: the grouped kernel over one B, as the dense GEMM reads it), to tell "
        "the cost of reading a different B per group from the grouped kernel's own",
    )
    args = ap.parse_args()
    timer = GpuTimer(repeats=30)
    rows: list = []
    summary = {}
    configs = [tuple(int(v) for v in c.split("x")) for c in args.configs.split(",")]
    for (g_, rows_), (n, k) in itertools.product(configs, ((4096, 7168), (7168, 2048))):
        ops = m_grouped_operands(n, k, g_, rows_)
        m, x, w, qa, qws, qb = (ops[key] for key in ("m", "x", "w", "qa", "qws", "qb"))
        m_indices, want = ops["m_indices"], ops["want"]
        flops = 2.0 * m * n * k
        shape = (m, n, k)
        tag = f"{n}x{k}" + ("" if (g_, rows_) == (G, ROWS) else f"_{g_}x{rows_}")
        grp = timed(timer, "m_grouped_contiguous", lambda: grouped.m_grouped_fp8_gemm_nt_contiguous(
            qa, qb, m_indices, check_indices=False), flops, want, rows, shape,
            groups=g_, rows_per_group=rows_)  # fmt: skip
        dense_want = x @ w[0].t()
        qd = qws[0]
        dptx = timed(timer, "dense ptx", lambda: ptx.fp8_gemm_nt(qa, qd), flops, dense_want, rows,
                    shape, groups=g_, rows_per_group=rows_)  # fmt: skip
        summary[f"grouped_over_dense_ptx_{tag}"] = grp / dptx
        for spec in args.dense_cfg:
            dcfg = _grouped_cfg(spec)
            alt = timed(timer, f"dense ptx {spec}",
                        lambda: ptx.run_with_config("1d2d", qa, qd, dcfg, torch.bfloat16),
                        flops, dense_want, rows, shape, cfg=dcfg.__dict__)  # fmt: skip
            summary[f"dense[{spec}]_over_dense_ptx_{tag}"] = alt / dptx
        # --same-expert: every row on expert 0, checked against dense_want
        zeros = torch.zeros_like(m_indices) if args.same_expert else None
        if args.same_expert:
            one = timed(timer, "m_grouped_contiguous same-expert",
                        lambda: grouped.m_grouped_fp8_gemm_nt_contiguous(
                            qa, qb, zeros, check_indices=False),
                        flops, dense_want, rows, shape, groups=g_,
                        rows_per_group=rows_)  # fmt: skip
            summary[f"grouped_same_expert_over_dense_ptx_{tag}"] = one / dptx
            # and the kernel alone: the per-64-row groups computed once, outside the timing
            block_group = ptx.block_groups(m_indices)
            d_buf = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

            def kernel_only():
                ptx.launch_gemm("m_grouped", qa, qb, d_buf, False, torch.bfloat16, None,
                                (m_indices, block_group))  # fmt: skip
                return d_buf

            alone = timed(timer, "m_grouped_contiguous kernel only", kernel_only, flops, want,
                          rows, shape, groups=g_, rows_per_group=rows_)  # fmt: skip
            summary[f"grouped_kernel_only_over_dense_ptx_{tag}"] = alone / dptx
        for spec in args.ab:
            defines = parse_variant(f"ab:{spec}")[2]
            ptx.set_source_defines(defines)
            try:
                alt = timed(timer, f"m_grouped_contiguous {spec}",
                            lambda: grouped.m_grouped_fp8_gemm_nt_contiguous(
                                qa, qb, m_indices, check_indices=False),
                            flops, want, rows, shape, groups=g_, rows_per_group=rows_)  # fmt: skip
            finally:
                ptx.set_source_defines("")
            summary[f"grouped[{spec}]_over_dense_ptx_{tag}"] = alt / dptx
        cases = [("", m_indices, want)]
        if args.same_expert:  # each config also with every row on expert 0
            cases.append(("same-expert ", zeros, dense_want))
        for spec, (label, idx, ref_d) in itertools.product(args.cfg, cases):
            cfg = _grouped_cfg(spec)
            alt = timed(timer, f"m_grouped_contiguous {label}{spec}",
                        lambda: ptx.m_grouped_contiguous_unchecked(
                            qa, qb, idx, None, torch.bfloat16, (m, n, k, g_), cfg),
                        flops, ref_d, rows, shape, groups=g_, rows_per_group=rows_,
                        cfg=cfg.__dict__)  # fmt: skip
            key = "grouped_same_expert" if label else "grouped"
            summary[f"{key}[{spec}]_over_dense_ptx_{tag}"] = alt / dptx
        if (g_, rows_) != (G, ROWS):
            del ops, x, w, qa, qws, qb, want, dense_want
            continue  # the other backends at the default setting only
        tcfg = select_config(
            m, n, k, "1d2d", torch.cuda.get_device_properties(0).multi_processor_count
        )
        grp_tri = timed(timer, "m_grouped_contiguous triton",
                       lambda: grouped.m_grouped_fp8_gemm_nt_contiguous(
                           qa, qb, m_indices, check_indices=False, config=tcfg),
                       flops, want, rows, shape)  # fmt: skip
        tri = timed(timer, "dense triton", lambda: tg.fp8_gemm_nt(qa, qd), flops, dense_want, rows,
                   shape)  # fmt: skip
        cub = timed(timer, "dense cublas", lambda: cublas.fp8_gemm_nt(qa, qd), flops, dense_want,
                   rows, shape)  # fmt: skip
        xm = x.view(G, ROWS, k)
        qam = per_token_cast_to_fp8(x)
        qa3 = (qam[0].view(G, ROWS, k), qam[1].view(G, ROWS, -1))
        masked_m = torch.full((G,), ROWS, device="cuda", dtype=torch.int32)
        want3 = torch.einsum("gmk,gnk->gmn", xm, w)
        timed(timer, "m_grouped_masked", lambda: grouped.m_grouped_fp8_gemm_nt_masked(
            qa3, qb, masked_m, ROWS), flops, want3, rows, shape)  # fmt: skip
        summary[f"grouped_over_dense_triton_{n}x{k}"] = grp / tri
        summary[f"grouped_over_dense_cublas_{n}x{k}"] = grp / cub
        summary[f"grouped_triton_over_dense_triton_{n}x{k}"] = grp_tri / tri
    # k-grouped wgrad: D[g] [M, N] = dy_gᵀ x_g over 8 experts of 512 tokens each.
    for mm, nn in ((4096, 7168), (7168, 2048)):
        kt = G * ROWS
        a = torch.randn(mm, kt, device="cuda")
        b = torch.randn(nn, kt, device="cuda")
        qa, qb = per_token_cast_to_fp8(a), per_token_cast_to_fp8(b)
        ks = [ROWS] * G
        sl = [slice(g * ROWS, (g + 1) * ROWS) for g in range(G)]
        want = torch.stack([a[:, s] @ b[:, s].t() for s in sl])
        flops = 2.0 * mm * nn * kt
        kp = timed(timer, "k_grouped_contiguous", lambda: grouped.k_grouped_fp8_gemm_nt_contiguous(
            qa, qb, ks), flops, want, rows, (mm, nn, kt))  # fmt: skip
        kcfg = select_config(
            mm, nn, ROWS, "1d1d", torch.cuda.get_device_properties(0).multi_processor_count
        )
        kt_ = timed(timer, "k_grouped_contiguous triton",
                   lambda: grouped.k_grouped_fp8_gemm_nt_contiguous(qa, qb, ks, config=kcfg),
                   flops, want, rows, (mm, nn, kt))  # fmt: skip
        summary[f"k_grouped_over_triton_{mm}x{nn}"] = kp / kt_
    # Masked (decode) GEMM, PTX vs Triton: G experts, M_max rows each, masked_m drawn in
    # [1, M_max] (mean near expected_m); only valid rows are compared and counted.
    gen = torch.Generator(device="cuda").manual_seed(0)
    for g_, m_max in ((16, 64), (16, 128), (8, 256)):
        for n, k in ((4096, 7168), (7168, 2048)):
            masked_m = torch.randint(
                1, m_max + 1, (g_,), device="cuda", dtype=torch.int32, generator=gen
            )
            x = torch.randn(g_ * m_max, k, device="cuda")
            w = torch.randn(g_, n, k, device="cuda")
            qx = per_token_cast_to_fp8(x)
            qa3 = (qx[0].view(g_, m_max, k), qx[1].view(g_, m_max, -1))
            qws = [per_block_cast_to_fp8(w[i]) for i in range(g_)]
            qb = (torch.stack([q for q, _ in qws]), torch.stack([s_ for _, s_ in qws]))
            valid = torch.arange(m_max, device="cuda")[None, :] < masked_m[:, None]  # [G, M_max]
            want = torch.einsum("gmk,gnk->gmn", x.view(g_, m_max, k), w) * valid[..., None]
            flops = 2.0 * int(masked_m.sum()) * n * k
            shape = (g_, m_max, n, k)
            expected = int(masked_m.float().mean().round())

            tflops = {}
            for name, fn in (
                ("masked triton", grouped.m_grouped_fp8_gemm_nt_masked_triton),
                ("masked ptx", ptx.m_grouped_fp8_gemm_nt_masked),
            ):

                def call(fn=fn, qa3=qa3, qb=qb, mm=masked_m, e=expected):
                    return fn(qa3, qb, mm, e)

                # Rows past masked_m are unspecified: compare the valid ones only.
                d = torch.where(valid[..., None], call().float(), 0.0)  # NaN-safe masking
                diff = calc_diff(d, want)
                assert diff < 1e-3, f"{name} {shape}: calc_diff {diff:.2e}"
                us = timer(call)
                tflops[name] = flops / (us * 1e-6) / 1e12
                rows.append(dict(shape=shape, op=name, us=us, tflops=tflops[name], calc_diff=diff))
                print(f"{shape!s:<22} {name:<28} {us:9.1f} µs {tflops[name]:7.0f} TFLOPS")
            px, tri = tflops["masked ptx"], tflops["masked triton"]
            summary[f"masked_ptx_over_triton_{g_}x{m_max}_{n}x{k}"] = px / tri
    for key, val in summary.items():
        print(f"{key}: {val:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "grouped", "env": environment(), "rows": rows, "summary": summary},
                      f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
