"""Which epilogue / header switch gives a wrong tile, on a GPU (a failing equality test's triage).

    python3 -m benchmarks.diag_epilogue

Runs the 1D2D PTX GEMM at 4096 x 2112 x 7168 with 128x128 double-accumulator tiles through the
direct-store and the two TMA-store epilogues, under each header switch setting given in
``VARIANTS``, ``REPEATS`` times each; prints calc_diff against the FP64 matmul of the unquantized
inputs and whether repeated runs are bitwise equal.
"""

from __future__ import annotations

import torch

from ptxtrain.gemm import ptx
from ptxtrain.quant import per_block_cast_to_fp8, per_token_cast_to_fp8
from ptxtrain.testing import calc_diff

VARIANTS = ("",)
REPEATS = 8


def main() -> None:
    m, n, k = 4096, 2112, 7168
    g = torch.Generator(device="cuda").manual_seed(m + 2 * n + k)
    x = torch.randn(m, k, device="cuda", generator=g)
    w = torch.randn(n, k, device="cuda", generator=g)
    want = (x.double() @ w.double().t()).float()
    qa, qb = per_token_cast_to_fp8(x), per_block_cast_to_fp8(w)
    for defines in VARIANTS:
        ptx.set_source_defines(defines)
        try:
            for tma, boxes in ((False, 0), (True, 0), (True, 1)):
                cfg = ptx.PtxConfig(128, 128, 5, 1, double_acc=True, tma_store=tma, epi_boxes=boxes)
                outs = [
                    ptx.run_with_config("1d2d", qa, qb, cfg, torch.bfloat16) for _ in range(REPEATS)
                ]
                diffs = [calc_diff(o.float(), want) for o in outs]
                same = all(torch.equal(outs[0], o) for o in outs[1:])
                print(f"{defines.strip() or 'default':<40} tma={tma!s:<5} boxes={boxes} "
                      f"calc_diff {max(diffs):.1e} (max) repeat-equal {same}",
                      flush=True)  # fmt: skip
        finally:
            ptx.set_source_defines("")


if __name__ == "__main__":
    main()
