"""Summarize an ncu SourceCounters CSV (``--page source --print-source sass --csv``): where the
warps of a kernel wait, by stall reason, by opcode and by SASS line.

    python3 -m benchmarks.ncu_stalls ncu-gemm-4096x7168x16384-source.csv [--top 25]

Prints the stall-sampling totals per reason (share of all samples), the samples per opcode, and
the ``--top`` SASS lines with the most samples and their two largest reasons.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections import Counter


def read_rows(path: str) -> list[dict[str, str]]:
    """The per-SASS-line rows of the first kernel in an ncu source CSV (``==PROF==`` lines and
    the kernel-name line skipped).

    Raises:
        ValueError: no ``"Address","Source"`` header in the file.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [ln for ln in f if not ln.startswith("==")]
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"Address","Source"')), None)
    if start is None:
        raise ValueError(f"{path}: no SourceCounters table (no line starting with Address,Source)")
    end = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith('"Kernel Name"')),
        len(lines),
    )
    return list(csv.DictReader(io.StringIO("".join(lines[start:end]))))


def _num(text: str | None) -> float:
    try:
        return float((text or "0").replace(",", ""))
    except ValueError:
        return 0.0


def summarize(rows: list[dict[str, str]], top: int = 25) -> str:
    """Text tables: samples per stall reason, per opcode, and the ``top`` busiest lines."""
    # (the "(Not Issued)" twins of each reason count a subset of the same samples)
    reasons = [
        c for c in (rows[0].keys() if rows else []) if c.startswith("stall_") and "(" not in c
    ]
    samples_col = "Warp Stall Sampling (All Samples)"
    total = sum(_num(r.get(samples_col)) for r in rows) or 1.0
    by_reason = Counter({c: sum(_num(r.get(c)) for r in rows) for c in reasons})
    by_op: Counter[str] = Counter()
    for r in rows:
        op = (r.get("Source") or "").split()
        name = op[0] if op and not op[0].startswith("@") else (op[1] if len(op) > 1 else "?")
        by_op[name.split(".")[0]] += _num(r.get(samples_col))
    out = [f"samples {total:.0f}", "by reason:"]
    out += [f"  {c[6:]:<20} {v / total:6.1%}" for c, v in by_reason.most_common() if v > 0]
    out.append("by opcode:")
    out += [f"  {op:<20} {v / total:6.1%}" for op, v in by_op.most_common(15)]
    out.append(f"top {top} lines:")
    busiest = sorted(rows, key=lambda r: -_num(r.get(samples_col)))[:top]
    for r in busiest:
        mine = sorted(((_num(r.get(c)), c[6:]) for c in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {v / total:.1%}" for v, name in mine if v > 0)
        src = " ".join((r.get("Source") or "").split())[:70]
        share = _num(r.get(samples_col)) / total
        out.append(f"  {r.get('Address', '?'):>6} {share:6.1%}  {src:<70} {why}")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("csv")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    print(summarize(read_rows(args.csv), args.top))


if __name__ == "__main__":
    main()
