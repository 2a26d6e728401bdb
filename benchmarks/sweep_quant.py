"""Sweep the quantizers' kernel configs on a GPU: GB/s and fraction of copy bandwidth.

    python3 -m benchmarks.sweep_quant [--json OUT.json]           # Triton tile configs
    python3 -m benchmarks.sweep_quant --cuda [--json OUT.json]    # CUDA kernel variants

Triton: each config's output is checked bit-exact against the default config's before it is
timed; the result picks the defaults of ``ptxtrain.quant.triton._config_1x`` (rules quoted
there).

CUDA (``--cuda``): every op x ``ptxtrain.quant.cuda.VARIANTS`` entry x shape (4096x7168,
7168x4096, 16384x7168 bf16; ``--variants a,b`` and ``--shapes 4096x7168,...`` narrow it,
``--pow2`` times power-of-two scales). Each variant's output is checked bit-exact against the
default variant's (itself checked against the reference by the GPU tests) before it is timed;
the last lines name the fastest variant per op (best worst-case fraction of copy bandwidth over
the shapes), to copy into ``ptxtrain.quant.cuda.SELECT``. Bytes = input read + FP8 and scales
written, as ``ptxtrain bench quant``.
"""

from __future__ import annotations

import argparse
import json

import torch

from ptxtrain.bench.quant import logical_bytes
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.quant import triton as tq
from ptxtrain.testing import assert_bitwise_equal

C = tq.QuantConfig
ROW = [C(16, 128, 128, 4), C(32, 128, 128, 4), C(64, 128, 128, 4), C(64, 128, 128, 8),
       C(128, 128, 128, 8), C(32, 128, 128, 2)]  # fmt: skip
COL = [C(128, 64, 64, 4), C(128, 64, 64, 8), C(128, 32, 32, 4), C(128, 128, 128, 8),
       C(128, 128, 64, 8), C(128, 64, 32, 4)]  # fmt: skip
BOTH = [C(128, 128, 64, 4), C(128, 128, 128, 8), C(128, 128, 64, 8), C(128, 128, 32, 8),
        C(128, 128, 128, 16)]  # fmt: skip


def _label(cfg) -> str:
    return f"bm{cfg.block_m}/bk{cfg.block_k}/sk{cfg.sub_k}/w{cfg.num_warps}"


def _sweep_shape(m: int, k: int, timer: GpuTimer, rows: list) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_gbs = 4 * m * k / (timer(lambda: y.copy_(x)) * 1e-6) / 1e9

    def record(op, label, fn, want, nbytes):
        got = fn()
        for g, w in zip(got, want):
            assert_bitwise_equal(g, w, f"{op} {label}")
        us = timer(fn)
        gbs = nbytes / (us * 1e-6) / 1e9
        rows.append(dict(m=m, k=k, op=op, config=label, us=us, gbs=gbs, frac=gbs / copy_gbs))
        print(
            f"{m:>6} {k:>6} {op:>14} {label:<36} {us:8.1f} µs {gbs:6.0f} GB/s "
            f"{gbs / copy_gbs:5.2f} of copy ({copy_gbs:.0f})",
            flush=True,
        )

    def q1x(cfg, row, col):
        return lambda: tq.quant_1x_unchecked(x, 128, False, "row", row=row, col=col, config=cfg)

    ops = (("per_token", ROW, True, False), ("per_token_t", COL, False, True),
           ("both", BOTH, True, True))  # fmt: skip
    for op, cfgs, row, col in ops:
        want = q1x(None, row, col)()
        for cfg in cfgs:
            record(op, _label(cfg), q1x(cfg, row, col), want, logical_bytes(op, m, k))
    want = tq.per_token_cast_to_fp8_both(x)
    for rc in ROW[1:3]:
        for cc in COL[:3:2]:
            row_fn, col_fn = q1x(rc, True, False), q1x(cc, False, True)
            label = f"{_label(rc)}+{_label(cc)}"
            record("both_split", label, lambda r=row_fn, c=col_fn: (*r(), *c()), want,
                   logical_bytes("both", m, k))  # fmt: skip
    for op, trans in (("per_block", False), ("per_block_both", True)):
        want = tq.quant_block_unchecked(x, 128, False, transposed=trans)
        for warps in (8, 16):

            def fn(w=warps, t=trans):
                return tq.quant_block_unchecked(x, 128, False, transposed=t, num_warps=w)

            record(op, f"num_warps={warps}", fn, want, logical_bytes(op, m, k))


def _token(row: bool, col: bool):
    def run(cq, x, variant, pow2, layout="row"):
        return cq.quant_token_unchecked(x, pow2, layout, row=row, col=col, variant=variant)

    return run


def _block(transposed: bool):
    def run(cq, x, variant, pow2, layout="row"):  # (128x128 scales have one layout)
        return cq.quant_block_unchecked(x, pow2, transposed=transposed, variant=variant)

    return run


# sweep op (also ptxtrain.bench.quant's op name, for the byte count) -> runner of the cuda backend
_CUDA_OPS = {
    "per_token": _token(True, False),
    "per_token_t": _token(False, True),
    "both": _token(True, True),
    "per_block": _block(False),
    "per_block_both": _block(True),
}


def _sweep_cuda(
    shapes, names, timer, rows: list, *, pow2: bool = False, layout: str = "row", device="cuda"
) -> None:
    from ptxtrain.quant import cuda as cq

    for m, k in shapes:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy_gbs = 4 * m * k / (timer(lambda x=x, y=y: y.copy_(x)) * 1e-6) / 1e9
        for op, run in _CUDA_OPS.items():
            want = run(cq, x, cq.DEFAULT_VARIANT, pow2, layout)
            for name in names:
                variant = cq.VARIANTS[name]
                got = run(cq, x, variant, pow2, layout)
                for g, w in zip(got, want, strict=True):
                    assert_bitwise_equal(g, w, f"cuda {op} {name} {m}x{k}")
                us = timer(lambda r=run, v=variant, x=x: r(cq, x, v, pow2, layout))
                gbs = logical_bytes(op, m, k) / (us * 1e-6) / 1e9
                frac = gbs / copy_gbs
                rows.append(dict(m=m, k=k, op=op, config=f"cuda:{name}", us=us, gbs=gbs,
                                 frac=frac, sf_layout=layout))  # fmt: skip
                print(
                    f"{m:>6} {k:>6} {op:>14} cuda:{name:<16} {us:8.1f} µs {gbs:6.0f} GB/s "
                    f"{frac:5.2f} of copy ({copy_gbs:.0f})",
                    flush=True,
                )
    print("\nfastest variant per op (worst fraction of copy over the shapes, higher is better):")
    for op in _CUDA_OPS:
        worst = {
            n: min(r["frac"] for r in rows if r["op"] == op and r["config"] == f"cuda:{n}")
            for n in names
        }
        best = max(worst, key=worst.get)
        print(f"  {op:>14}: {best} ({worst[best]:.2f}; default {worst.get('default', 0):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--cuda", action="store_true", help="sweep ptxtrain.quant.cuda.VARIANTS")
    ap.add_argument("--variants", help="comma-separated VARIANTS names (with --cuda)")
    ap.add_argument("--shapes", help="comma-separated MxK (with --cuda)")
    ap.add_argument("--pow2", action="store_true", help="pow2_scale=True (with --cuda)")
    ap.add_argument(
        "--sf-layout",
        choices=["row", "mn_major"],
        default="row",
        help="scale layout of the 1x128 / 128x1 ops (with --cuda; Fp8Linear uses mn_major on CUDA)",
    )
    args = ap.parse_args()
    timer = GpuTimer(repeats=30)
    rows: list = []
    if args.cuda:
        from ptxtrain.quant import cuda as cq

        names = args.variants.split(",") if args.variants else list(cq.VARIANTS)
        unknown = [n for n in names if n not in cq.VARIANTS]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known {list(cq.VARIANTS)}")
        if "default" not in names:
            names.insert(0, "default")
        shapes = ((4096, 7168), (7168, 4096), (16384, 7168))
        if args.shapes:
            shapes = tuple(tuple(int(d) for d in s.split("x")) for s in args.shapes.split(","))
        _sweep_cuda(shapes, names, timer, rows, pow2=args.pow2, layout=args.sf_layout)
    else:
        for m, k in ((4096, 7168), (8192, 7168), (4096, 2112)):
            _sweep_shape(m, k, timer, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "sweep_quant", "env": environment(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
