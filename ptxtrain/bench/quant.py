"""``ptxtrain bench quant``: quantization kernels in GB/s against the device's copy bandwidth.

Bytes counted are the fewest a kernel must move: the BF16 input read once, the FP8 outputs and
FP32 scales written once. The baseline is a BF16 device-to-device copy of the same tensor timed
in the same process (bytes read + written), so the ratio is the fraction of achievable bandwidth.
The reference (PyTorch ops on the GPU) is timed too, as the number the kernels replace.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ptxtrain._checks import ceil_div
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.quant import ref

QUANT_SHAPES: tuple[tuple[int, int], ...] = (
    (4096, 7168),
    (8192, 7168),
    (4096, 2112),
    (16384, 4096),
)

# name -> (function name, bytes written per input element besides the scales, scale layout).
# The ":mn" rows write the scales MN-major (``sf_layout="mn_major"``), the layout Fp8Linear asks
# for on CUDA (the GEMMs' TMA layout): the same bytes, stored coalesced along M or N; the
# reference has no such option, so those rows time the GPU backends only.
_OPS = {
    "per_token": ("per_token_cast_to_fp8", 1, "row"),
    "per_token:mn": ("per_token_cast_to_fp8", 1, "mn_major"),
    "per_token_t": ("per_token_cast_to_fp8_t", 1, "row"),
    "per_token_t:mn": ("per_token_cast_to_fp8_t", 1, "mn_major"),
    "per_block": ("per_block_cast_to_fp8", 1, "row"),
    "both": ("per_token_cast_to_fp8_both", 2, "row"),
    "both:mn": ("per_token_cast_to_fp8_both", 2, "mn_major"),
    "per_block_both": ("per_block_cast_to_fp8_both", 2, "row"),
}


def logical_bytes(op: str, m: int, k: int) -> int:
    """Bytes a quantizer must move for a bf16 [M, K] input (see the module note): the input
    read once, the e4m3 outputs (one or two, 1 byte per element) and the fp32 scales written once.

    Args:
        op: a row name of this bench: ``per_token``, ``per_token_t``, ``per_block``, ``both``,
            ``per_block_both``, or ``per_token:mn``, ``per_token_t:mn``, ``both:mn`` (MN-major
            scales, the same bytes).
        m, k: the input's rows and columns.

    Raises:
        ValueError: ``op`` is not one of those names.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    op = op.split(":")[0]
    read = 2 * m * k  # bf16 input
    fp8 = _OPS[op][1] * m * k
    if op == "per_token":
        sf = 4 * m * ceil_div(k, 128)
    elif op == "per_token_t":
        sf = 4 * k * ceil_div(m, 128)
    elif op == "per_block":
        sf = 4 * ceil_div(m, 128) * ceil_div(k, 128)
    elif op == "per_block_both":
        sf = 8 * ceil_div(m, 128) * ceil_div(k, 128)
    else:
        sf = 4 * (m * ceil_div(k, 128) + k * ceil_div(m, 128))
    return read + fp8 + sf


def quant_backends() -> dict[str, object]:
    """Modules that implement the quantizers, by backend name (``ref`` always; ``triton`` when
    installed; ``cuda`` when NVRTC imports and the current GPU is sm_90 with its driver)."""
    found: dict[str, object] = {"ref": ref}
    try:
        from ptxtrain.quant import triton as triton_quant

        found["triton"] = triton_quant
    except ImportError:
        pass
    try:
        from ptxtrain.quant import cuda as cuda_quant

        if torch.cuda.is_available() and cuda_quant.usable(torch.device("cuda")):
            found["cuda"] = cuda_quant
    except ImportError:
        pass
    return found


def bench_quant(shapes=QUANT_SHAPES, *, repeats: int = 50) -> dict:
    """Time every quantizer of every backend and a BF16 copy; return a results record."""
    from ptxtrain.testing import assert_bitwise_equal

    timer = GpuTimer(repeats=repeats)
    backends = quant_backends()
    rows = []
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        copy_us = timer(lambda x=x, y=y: y.copy_(x))
        copy_gbs = 2 * 2 * m * k / (copy_us * 1e-6) / 1e9
        for op, (fname, _, layout) in _OPS.items():
            want = getattr(ref, fname)(x)
            kw = {} if layout == "row" else {"sf_layout": layout}
            row = {
                "m": m,
                "k": k,
                "op": op,
                "bytes": logical_bytes(op, m, k),
                "copy_us": copy_us,
                "copy_gbs": copy_gbs,
                "us": {},
                "gbs": {},
                "bit_exact": {},
            }
            for name, mod in backends.items():
                if kw and mod is ref:
                    continue  # (no MN-major option in the reference)
                fn: Callable = getattr(mod, fname)
                got = fn(x, **kw)
                try:
                    for g, w in zip(got, want):
                        assert_bitwise_equal(g, w, f"{name}.{fname}")
                    row["bit_exact"][name] = True
                except AssertionError as e:
                    row["bit_exact"][name] = str(e)[:200]
                us = timer(lambda fn=fn, x=x, kw=kw: fn(x, **kw))
                row["us"][name] = us
                row["gbs"][name] = row["bytes"] / (us * 1e-6) / 1e9
            rows.append(row)
        del x, y
    return {
        "bench": "quant",
        "env": environment(),
        "rows": rows,
        "method": "CUDA events, L2 flushed, launch hidden, median; GB/s = (bf16 read + fp8 "
        "and fp32-scale writes) / time; copy = bf16 device copy, bytes read+written",
    }


def format_table(result: dict) -> str:
    """Render a quant results record: µs, GB/s and fraction of copy bandwidth per backend."""
    rows = result["rows"]
    names = list(dict.fromkeys(n for r in rows for n in r["us"]))
    lines = [
        f"{'M':>6} {'K':>6} {'op':>12} {'copy GB/s':>10} "
        + " ".join(f"{n + ' µs':>10} {'GB/s':>7} {'/copy':>6} {'exact':>5}" for n in names)
    ]
    for r in rows:
        cells = [
            f"{r['us'][n]:10.1f} {r['gbs'][n]:7.0f} {r['gbs'][n] / r['copy_gbs']:6.2f} "
            f"{'yes' if r['bit_exact'][n] is True else 'NO':>5}"
            if n in r["us"]
            else f"{'-':>10} {'-':>7} {'-':>6} {'-':>5}"
            for n in names
        ]
        lines.append(
            f"{r['m']:>6} {r['k']:>6} {r['op']:>12} {r['copy_gbs']:10.0f} " + " ".join(cells)
        )
    return "\n".join(lines)
