"""Launch one CUDA quantizer a few times on a bf16 tensor, for ``ncu`` (run_gpu.sh ncuquant).

    ncu -k regex:cast_fp8 --launch-skip 2 --launch-count 1 python3 -m benchmarks.profile_quant \
        --op both --shape 4096 7168

The first launches compile and warm up; profile a later one.
"""

from __future__ import annotations

import argparse

import torch

from ptxtrain.quant import cuda

OPS = {
    "token": cuda.per_token_cast_to_fp8,
    "t": cuda.per_token_cast_to_fp8_t,
    "both": cuda.per_token_cast_to_fp8_both,
    "block": cuda.per_block_cast_to_fp8,
    "block_both": cuda.per_block_cast_to_fp8_both,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--op", choices=sorted(OPS), default="both")
    p.add_argument("--shape", type=int, nargs=2, default=[4096, 7168])
    p.add_argument("--iters", type=int, default=4)
    args = p.parse_args()
    x = torch.randn(*args.shape, device="cuda", dtype=torch.bfloat16)
    for _ in range(args.iters):
        OPS[args.op](x)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
