"""Where the warp-specialized Gluon GEMM's pointer-path output differs from the reference
(session 15, call 11: test_gpu_ws_accumulate[strided-128] failed in call 10).

    python3 -m benchmarks.diag_gluon_acc

For 1D1D 2048 x 4160 x 512 into an fp32 view with rows of 4163 floats (not 16-byte aligned: the
pointer epilogue), with and without D +=, 128- and 256-row tiles, twice each: the fraction of
wrong elements, the largest error, and which 64-row / 128-column blocks hold them.
"""

from __future__ import annotations

import torch

from ptxtrain.gemm import gluon, ref
from ptxtrain.quant.ref import per_token_cast_to_fp8
from tests.gemm._inputs import scaled_operands


def main() -> None:
    m, n, k = 2048, 4160, 512
    x, w = scaled_operands(m, n, k, 13, "cuda")
    qa, qb = per_token_cast_to_fp8(x), per_token_cast_to_fp8(w)
    want = ref.fp8_gemm_nt_1d1d(qa, qb)
    for block_m in (128, 256):
        cfg = gluon.GluonConfig(block_m, 128, 8, 4 if block_m == 128 else 3, 4,
                                warp_specialized=True)  # fmt: skip
        for accumulate in (False, True):
            for pad in (3, 4):  # 4163 floats: pointer path; 4164: TMA
                for rep in range(2):
                    base = torch.randn(m, n + pad, device="cuda")
                    out = base[:, :n]
                    before = out.clone()
                    gluon.fp8_gemm("1d1d", qa, qb, out, torch.float32, accumulate, cfg)
                    torch.cuda.synchronize()
                    expect = before + want if accumulate else want
                    err = (out - expect).abs()
                    tol = 1e-4 * expect.abs().max()
                    bad = err > tol
                    line = (f"bm={block_m} acc={accumulate} pad={pad} rep={rep}: "
                            f"wrong {bad.float().mean().item():.4%} max err "
                            f"{err.max().item():.3g} (tol {tol.item():.3g})")  # fmt: skip
                    if bad.any():
                        rb = torch.nonzero(bad)[:, 0] // 64
                        cb = torch.nonzero(bad)[:, 1] // 128
                        blocks = sorted(set(zip(rb.tolist(), cb.tolist())))
                        line += f"; {len(blocks)} blocks (64 x 128), first {blocks[:8]}"
                        nan = torch.isnan(out).sum().item()
                        line += f"; NaN {nan}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
