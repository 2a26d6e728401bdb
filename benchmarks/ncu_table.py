"""Turn ncu's raw metrics of ``benchmarks.profile_gemm --grid`` runs into one table per shape:
time, SM clock, tensor-core busy fraction, DRAM and L2 throughput, for the PTX GEMM and cuBLAS.

    ncu --csv --page raw --print-units base --metrics <METRICS> --nvtx --nvtx-include measure/ \
        --log-file ptx.csv -k regex:fp8_gemm_nt_kernel \
        python3 -m benchmarks.profile_gemm --grid 1d2d --backend ptx > ptx.shapes
    (the same for --backend cublas, with -k regex:'gemm|nvjet|xmma|cutlass'; run_gpu.sh ncugrid)
    python3 -m benchmarks.ncu_table --kind 1d2d --ptx ptx.csv ptx.shapes \
        --cublas cublas.csv cublas.shapes --json out.json

Tensor-core busy = 2·M·N·K / (8192 FP8 FLOP per SM per cycle (dense e4m3 wgmma on sm_90:
1979 TFLOPS at 1830 MHz over 132 SMs) · SMs · elapsed SM cycles): the fraction of the kernel's
cycles the tensor cores would need at their peak rate, the same for every backend. ``METRICS``
is :data:`METRICS`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json

METRICS = (
    "gpu__time_duration.sum",
    "sm__cycles_elapsed.max",
    "sm__cycles_elapsed.avg.per_second",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l1tex__m_xbar2l1tex_read_bytes.sum",
    "launch__grid_size",
    "launch__registers_per_thread",
)
FP8_FLOP_PER_SM_CYCLE = 8192  # dense e4m3 wgmma, sm_90 (1979e12 / (132 * 1.83e9))


def read_kernels(path: str) -> list[dict[str, str]]:
    """Rows of an ``ncu --csv --page raw`` log, one per profiled kernel (the units row dropped).

    Raises:
        ValueError: no CSV header (a line starting with "ID") in the file.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError(f'{path}: no ncu raw CSV header (a line starting with "ID")')
    rows = list(csv.DictReader(io.StringIO("".join(lines[start:]))))
    return [r for r in rows if (r.get("ID") or "").strip().isdigit()]


def read_shapes(path: str) -> list[tuple[int, int, int]]:
    """The ``shape KIND M N K ...`` lines ``profile_gemm --grid`` printed, in launch order."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for ln in f:
            parts = ln.split()
            if len(parts) >= 5 and parts[0] == "shape":
                out.append((int(parts[2]), int(parts[3]), int(parts[4])))
    return out


def _f(row: dict[str, str], name: str) -> float:
    return float((row.get(name) or "nan").replace(",", ""))


def summarize(kernels: list[dict[str, str]], shapes: list[tuple[int, int, int]], sms: int = 132):
    """One dict per shape: µs, GHz, tensor-core busy, DRAM TB/s and % of peak, L2 %, grid.

    ncu may profile more than one kernel per GEMM call (cuBLAS): the kernels are split over the
    shapes in order, evenly, and their times and bytes summed per shape.

    Raises:
        ValueError: the kernel count is not a multiple of the shape count.
    """
    if not shapes or len(kernels) % len(shapes):
        raise ValueError(f"{len(kernels)} profiled kernels do not split over {len(shapes)} shapes")
    per = len(kernels) // len(shapes)
    out = []
    for i, (m, n, k) in enumerate(shapes):
        ks = kernels[i * per : (i + 1) * per]
        ns = sum(_f(r, "gpu__time_duration.sum") for r in ks)
        cycles = sum(_f(r, "sm__cycles_elapsed.max") for r in ks)
        dram = sum(_f(r, "dram__bytes_read.sum") + _f(r, "dram__bytes_write.sum") for r in ks)
        main = max(ks, key=lambda r: _f(r, "gpu__time_duration.sum"))
        out.append(
            dict(
                m=m,
                n=n,
                k=k,
                kernels=per,
                us=ns / 1e3,
                ghz=_f(main, "sm__cycles_elapsed.avg.per_second") / 1e9,
                tc_busy=2.0 * m * n * k / (FP8_FLOP_PER_SM_CYCLE * sms * cycles),
                dram_tbs=dram / ns / 1e3,
                dram_pct=_f(main, "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                l2_pct=_f(main, "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
                xbar_mb=sum(_f(r, "l1tex__m_xbar2l1tex_read_bytes.sum") for r in ks) / 1e6,
                grid=int(_f(main, "launch__grid_size")),
                regs=int(_f(main, "launch__registers_per_thread")),
                name=(main.get("Kernel Name") or "")[:90],
            )
        )
    return out


def limit(row: dict) -> str:
    """A one-word reading of what bounds the kernel: tensor cores, DRAM, or neither (latency:
    too few tiles or too short a K loop to cover the pipeline's fill and the epilogue)."""
    if row["tc_busy"] >= 0.6:
        return "tensor"
    if row["dram_pct"] >= 60:
        return "dram"
    return "latency"


def format_table(kind: str, ptx_rows: list[dict], cublas_rows: list[dict]) -> str:
    head = (
        f"{kind}: M N K | PTX us GHz TC% DRAM% L2% grid limit | cuBLAS us GHz TC% DRAM% L2% "
        "limit | cuBLAS/PTX"
    )
    lines = [head]
    for p, c in zip(ptx_rows, cublas_rows, strict=True):
        lines.append(
            f"{p['m']:>5} {p['n']:>5} {p['k']:>5} | {p['us']:8.1f} {p['ghz']:.2f} "
            f"{100 * p['tc_busy']:5.1f} {p['dram_pct']:5.1f} {p['l2_pct']:5.1f} {p['grid']:>4} "
            f"{limit(p):<7} | {c['us']:8.1f} {c['ghz']:.2f} {100 * c['tc_busy']:5.1f} "
            f"{c['dram_pct']:5.1f} {c['l2_pct']:5.1f} {limit(c):<7} | {c['us'] / p['us']:.3f}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--kind", choices=["1d2d", "1d1d"], required=True)
    p.add_argument("--ptx", nargs=2, metavar=("CSV", "SHAPES"), required=True)
    p.add_argument("--cublas", nargs=2, metavar=("CSV", "SHAPES"), required=True)
    p.add_argument("--sms", type=int, default=132)
    p.add_argument("--json")
    args = p.parse_args()
    ptx_rows = summarize(read_kernels(args.ptx[0]), read_shapes(args.ptx[1]), args.sms)
    cublas_rows = summarize(read_kernels(args.cublas[0]), read_shapes(args.cublas[1]), args.sms)
    print(format_table(args.kind, ptx_rows, cublas_rows))
    if args.json:
        for r in ptx_rows + cublas_rows:
            r["limit"] = limit(r)
        from ptxtrain.bench.timing import environment

        record = {"env": environment(), "bench": "ncu_table", "kind": args.kind}
        with open(args.json, "w") as f:
            json.dump({**record, "ptx": ptx_rows, "cublas": cublas_rows}, f, indent=1)


if __name__ == "__main__":
    main()
