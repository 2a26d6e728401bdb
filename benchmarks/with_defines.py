"""Run a ``ptxtrain`` command with compile-time switches of the PTX GEMM header set, for A/B runs
of whole benchmarks in separate processes (``benchmarks.ab_ptx`` does it per GEMM in one).

    python3 -m benchmarks.with_defines "#PTXTRAIN_GEMM_CHUNK=16" -- bench linear --json x.json

Each ``#MACRO=VALUE`` becomes a ``#define`` before the header (``ptx.set_source_defines``).

Raises:
    SystemExit: no ``--`` separating the switches from the command.
"""

from __future__ import annotations

import sys

from benchmarks.ab_ptx import parse_variant
from ptxtrain.cli import main as cli_main
from ptxtrain.gemm import ptx


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: python3 -m benchmarks.with_defines [#MACRO=VALUE ...] -- COMMAND")
    cut = argv.index("--")
    defines = "".join(parse_variant(f"x:{spec}")[2] for spec in argv[:cut])
    ptx.set_source_defines(defines)
    return cli_main(argv[cut + 1 :])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
