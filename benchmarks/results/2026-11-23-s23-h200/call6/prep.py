"""Call 6's timing of the TF32 scale split built per call by PyTorch ops (ptx._tc_scale_operand
of commit 4245b7b, reverted since), as run: python3 prep.py OUT.json."""

import json
import sys

import torch

from ptxtrain.bench.timing import GpuTimer
from ptxtrain.gemm import ptx

t = GpuTimer(repeats=30)
rows = []
for m, n in [(2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048)]:
    kb = 32
    sa = torch.rand(kb, m, device="cuda") + 0.5
    sb = torch.rand(kb, n, device="cuda") + 0.5

    def prep(sa=sa, sb=sb, m=m, n=n):
        return ptx._tc_scale_operand(sa, m, "a"), ptx._tc_scale_operand(sb, n, "b")

    us = t(prep)
    rows.append(dict(m=m, n=n, prep_us=us))
    print(m, n, f"prep {us:.1f} us", flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(rows, f)
