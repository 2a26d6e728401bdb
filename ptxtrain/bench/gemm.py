"""``ptxtrain bench gemm``: FP8 GEMM backends vs cuBLAS blockwise FP8 and BF16 cuBLAS, one process.

For each DeepSeek-V3 shape: µs and TFLOPS (2·M·N·K / time) per backend, the accuracy of each
backend (``calc_diff`` against a matmul of the unquantized inputs), and ratios to the baselines.
The geometric mean of backend / cuBLAS-blockwise per M is the figure the issues' targets use.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff
from ptxtrain.testing.shapes import DSV3_DENSE_NK, DSV3_M, DSV3_WGRAD_MN

# The 1x128 scales are quantized MN-major ("mn_major"), the layout Fp8Linear's CUDA path writes
# and the one cuBLAS blockwise and the PTX kernels read: with row-major scales both copy them
# into it inside the timed call (a second kernel, ~2 µs of a decode-sized GEMM), which Triton,
# reading any strides, does not.
SF_LAYOUT = "mn_major"


def quantize_operands(x: torch.Tensor, w: torch.Tensor, kind: str = "1d2d") -> tuple:
    """``x [M, K]`` and ``w [N, K]`` (float) quantized as the GEMM benchmarks feed them:
    ``(qa, qb)`` with A per 1x128 tile (``SF_LAYOUT`` scales) and B per 128x128 block (1D2D)
    or per 1x128 tile (1D1D, wgrad)."""
    qa = per_token_cast_to_fp8(x, sf_layout=SF_LAYOUT)
    if kind == "1d2d":
        return qa, per_block_cast_to_fp8(w)
    return qa, per_token_cast_to_fp8(w, sf_layout=SF_LAYOUT)


def random_problem(m: int, n: int, k: int, kind: str = "1d2d") -> tuple:
    """Fresh Gaussian ``x [M, K]``, ``w [N, K]`` on the GPU: ``(want, qa, qb)`` with ``want =
    x @ wᵀ`` (fp32, the accuracy oracle) and the operands of :func:`quantize_operands`."""
    x, w = torch.randn(m, k, device="cuda"), torch.randn(n, k, device="cuda")
    return (x @ w.t(), *quantize_operands(x, w, kind))


def fp8_backends(kind: str = "1d2d") -> dict[str, Callable]:
    """The FP8 GEMM backends importable here, by name (``cublas`` first: it is the baseline)."""
    from ptxtrain.gemm import cublas

    name = "fp8_gemm_nt" if kind == "1d2d" else "fp8_gemm_nt_1d1d"
    found = {"cublas": getattr(cublas, name)}
    try:
        from ptxtrain.gemm import triton as triton_gemm

        found["triton"] = getattr(triton_gemm, name)
    except ImportError:
        pass
    from ptxtrain.gemm import ptx

    if ptx.supports(4096, 7168, 2048):
        found["ptx"] = getattr(ptx, name)
    return found


def _geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _time_backends(
    row: dict,
    backends: dict,
    qa,
    qb,
    want: torch.Tensor,
    timer,
    b_for: dict | None = None,
    kind: str = "1d2d",
) -> None:
    """Check and time each backend on one shape; fill ``row``'s calc_diff, µs and TFLOPS, and
    with a ``triton`` backend the kernel its default runs (``triton_kernel``).
    ``b_for``: backend name → its own B operand (same values, the scale layout it reads)."""
    for name, fn in backends.items():
        qb_name = (b_for or {}).get(name, qb)
        try:
            d = fn(qa, qb_name)
            row["calc_diff"][name] = calc_diff(d, want)
            row["us"][name] = timer(lambda fn=fn, qb_name=qb_name: fn(qa, qb_name))
            row.setdefault("host_us", {})[name] = timer.last_host_us
        except (ValueError, RuntimeError, NotImplementedError) as e:
            row["us"][name] = None
            row.setdefault("errors", {})[name] = str(e).splitlines()[0][:200]
    if "triton" in backends:  # which Triton-backend kernel ran (the Gluon one from 2 waves)
        from ptxtrain.gemm import triton as triton_gemm

        row["triton_kernel"] = triton_gemm.default_kernel(kind, row["m"], row["n"], row["k"])
    flops = 2.0 * row["m"] * row["n"] * row["k"]
    for name, us in row["us"].items():
        row["tflops"][name] = flops / (us * 1e-6) / 1e12 if us else None


def bench_1d2d(ms=DSV3_M, shapes=DSV3_DENSE_NK, *, repeats: int = 50) -> dict:
    """Time every 1D2D backend and BF16 cuBLAS on ``ms`` x ``shapes``; return a results record."""
    timer = GpuTimer(repeats=repeats)
    backends = fp8_backends("1d2d")
    rows = []
    for m in ms:
        for n, k in shapes:
            x = torch.randn(m, k, device="cuda")
            w = torch.randn(n, k, device="cuda")
            want = x @ w.t()
            xb, wb = x.bfloat16(), w.bfloat16()
            qa, qb = per_token_cast_to_fp8(x, sf_layout=SF_LAYOUT), per_block_cast_to_fp8(w)
            row = {"m": m, "n": n, "k": k, "us": {}, "tflops": {}, "calc_diff": {}}
            row["us"]["bf16"] = timer(lambda xb=xb, wb=wb: xb @ wb.t())
            _time_backends(row, backends, qa, qb, want, timer)
            rows.append(row)
            del x, w, want, xb, wb, qa, qb
    return {
        "bench": "gemm_1d2d",
        "env": environment(),
        "method": _METHOD,
        "rows": rows,
        "summary": _summary(rows, list(backends)),
    }


def bench_1d1d(k_tokens: int = 4096, pairs=DSV3_WGRAD_MN, *, repeats: int = 50) -> dict:
    """Time the wgrad (1D1D, fp32 out) backends and an fp32-out BF16 matmul over ``pairs``."""
    timer = GpuTimer(repeats=repeats)
    backends = fp8_backends("1d1d")
    has_out_dtype = _mm_has_out_dtype()
    from ptxtrain.gemm import cublas

    cublas_sf_b = cublas.sf_b_layout_1d1d(torch.device("cuda", torch.cuda.current_device()))
    rows = []
    for m, n in pairs:
        k = k_tokens
        a = torch.randn(m, k, device="cuda")
        b = torch.randn(n, k, device="cuda")
        want = a @ b.t()
        ab, bb = a.bfloat16(), b.bfloat16()
        qa = per_token_cast_to_fp8(a, sf_layout=SF_LAYOUT)
        qb = per_token_cast_to_fp8(b, sf_layout=SF_LAYOUT)
        # cuBLAS's 1D1D reads B's scales in a layout of its own (probed): given in that layout,
        # so its time holds no copy that the others (MN-major, any strides) do not make either.
        b_for = {}
        if "cublas" in backends and cublas_sf_b not in (None, SF_LAYOUT):
            b_for["cublas"] = per_token_cast_to_fp8(b, sf_layout=cublas_sf_b)
        row = {"m": m, "n": n, "k": k, "us": {}, "tflops": {}, "calc_diff": {}}
        row["cublas_sf_b_layout"] = cublas_sf_b
        if has_out_dtype:
            row["us"]["bf16"] = timer(
                lambda ab=ab, bb=bb: torch.mm(ab, bb.t(), out_dtype=torch.float32)
            )
        else:
            row["us"]["bf16"] = timer(lambda ab=ab, bb=bb: (ab @ bb.t()).float())
        _time_backends(row, backends, qa, qb, want, timer, b_for, kind="1d1d")
        rows.append(row)
        del a, b, want, ab, bb, qa, qb, b_for
    return {
        "bench": "gemm_1d1d",
        "env": environment(),
        "method": _METHOD,
        "rows": rows,
        "summary": _summary(rows, list(backends)),
    }


def _mm_has_out_dtype() -> bool:
    try:
        torch.mm(
            torch.ones(1, 1, dtype=torch.bfloat16, device="cuda"),
            torch.ones(1, 1, dtype=torch.bfloat16, device="cuda"),
            out_dtype=torch.float32,
        )
        return True
    except (TypeError, RuntimeError):
        return False


_METHOD = (
    "CUDA events around single calls; 256 MB memset before each call (L2 flush); device "
    "sleep queued before the start event (launch overhead hidden); median of repeats; "
    "TFLOPS = 2*M*N*K/time; calc_diff vs fp32 matmul of the unquantized inputs; 1x128 "
    f"scales quantized {SF_LAYOUT}"
)


def _summary(rows: list[dict], backends: list[str]) -> dict:
    out = {}
    for m in sorted({r["m"] for r in rows}):
        sel = [r for r in rows if r["m"] == m]
        for name in backends:
            if name == "cublas":
                continue
            ratios = [
                r["us"]["cublas"] / r["us"][name]
                for r in sel
                if r["us"].get(name) and r["us"].get("cublas")
            ]
            out[f"geomean_{name}_over_cublas_m{m}"] = _geomean(ratios)
        ratios = [
            r["us"]["bf16"] / r["us"]["cublas"]
            for r in sel
            if r["us"].get("cublas") and r["us"].get("bf16")
        ]
        out[f"geomean_cublas_over_bf16_m{m}"] = _geomean(ratios)
    for name in backends:  # over every row (1D1D: its rows' m are the layers' K, not one M)
        if name != "cublas":
            ratios = [
                r["us"]["cublas"] / r["us"][name]
                for r in rows
                if r["us"].get(name) and r["us"].get("cublas")
            ]
            out[f"geomean_{name}_over_cublas_all"] = _geomean(ratios)
    return out


def format_table(result: dict) -> str:
    """Render a results record as a fixed-width table (µs, TFLOPS, ratio to cuBLAS blockwise)."""
    rows = result["rows"]
    names = list(rows[0]["us"]) if rows else []
    head = f"{'M':>6} {'N':>6} {'K':>6} " + " ".join(
        f"{n + ' µs':>12} {'TFLOPS':>7}" for n in names
    )
    head += " " + " ".join(f"{n + ' x cuBLAS':>14}" for n in names if n != "cublas")
    kernels = any("triton_kernel" in r for r in rows)
    head += "  triton kernel" if kernels else ""
    lines = [head]
    for r in rows:
        cells = []
        for n in names:
            us, tf = r["us"].get(n), r["tflops"].get(n)
            cells.append(f"{us:12.1f} {tf:7.0f}" if us else f"{'n/a':>12} {'':>7}")
        ratios = []
        for n in names:
            if n == "cublas":
                continue
            c, u = r["us"].get("cublas"), r["us"].get(n)
            ratios.append(f"{c / u:14.2f}" if c and u else f"{'n/a':>14}")
        lines.append(
            f"{r['m']:>6} {r['n']:>6} {r['k']:>6} "
            + " ".join(cells)
            + " "
            + " ".join(ratios)
            + (f"  {r.get('triton_kernel', '')}" if kernels else "")
        )
    for key, val in result.get("summary", {}).items():
        lines.append(f"{key}: {val:.3f}")
    hosts = {
        n: sorted(r["host_us"][n] for r in rows if r.get("host_us", {}).get(n) is not None)
        for n in names
    }
    cells = [f"{n} {v[len(v) // 2]:.1f}" for n, v in hosts.items() if v]
    if cells:
        lines.append("host µs per call (median over shapes): " + ", ".join(cells))
    return "\n".join(lines)
