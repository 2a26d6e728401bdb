"""Does Triton's automatic warp specialization work on this GPU?

Each case runs in its own process under a time limit (a hung kernel cannot be interrupted
in-process) and reports ``ok`` / ``wrong`` / ``hang`` / ``error``:

- ``plain_fp16_ws``: a minimal bf16 GEMM of our own (TMA descriptors, ``tl.dot``, one
  ``tl.range(..., warp_specialize=True)`` K loop), no scales: Triton's Hopper pass alone.
- ``plain_fp16``: the same kernel without warp specialization (the control).

On an H200 with Triton 3.6 (session 14) the control is correct and the specialized kernel
faults (illegal memory access); ptxtrain's own warp-specialized Triton variants, since removed,
hung (1D2D) or faulted (1D1D) the same way.

    python3 -m benchmarks.probe_triton_ws [--timeout 45] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_PLAIN = r"""
import torch, triton, triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

@triton.jit
def k(a_d, b_d, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
      WS: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=3, warp_specialize=WS):
        a = a_d.load([pm * BM, kk * BK])
        b = b_d.load([pn * BN, kk * BK])
        acc = tl.dot(a, b.T, acc)
    rm = pm * BM + tl.arange(0, BM)[:, None]
    rn = pn * BN + tl.arange(0, BN)[None, :]
    tl.store(c_ptr + rm * N + rn, acc, mask=(rm < M) & (rn < N))

M = N = 1024; K = 2048; BM, BN, BK = 128, 128, 64
a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
c = torch.empty(M, N, device="cuda", dtype=torch.float32)
ad = TensorDescriptor.from_tensor(a, [BM, BK]); bd = TensorDescriptor.from_tensor(b, [BN, BK])
k[(M // BM, N // BN)](ad, bd, c, M, N, K, BM, BN, BK, WS, num_warps=4)
torch.cuda.synchronize()
err = ((c - a.float() @ b.float().T).norm() / (a.float() @ b.float().T).norm()).item()
print("RESULT", "ok" if err < 1e-2 else "wrong", err)
"""


def _run(code: str, timeout: float) -> dict:
    # A file, not ``-c``: ``@triton.jit`` reads the function's source from its file.
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(code)
    try:
        p = subprocess.run([sys.executable, f.name], capture_output=True, text=True,
                           timeout=timeout, env=os.environ.copy())  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"status": "hang", "detail": f"no result in {timeout} s"}
    finally:
        os.unlink(f.name)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            _, status, value = line.split()
            return {"status": status, "detail": float(value)}
    return {"status": "error", "detail": (p.stderr or p.stdout)[-600:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--timeout", type=float, default=45.0)
    p.add_argument("--json")
    p.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = p.parse_args()
    cases = {
        "plain_fp16": "WS = False\n" + _PLAIN,
        "plain_fp16_ws": "WS = True\n" + _PLAIN,
    }
    rows = {}
    for name, code in cases.items():
        if args.only and name not in args.only:
            continue
        rows[name] = _run(code, args.timeout)
        print(f"{name:28s} {rows[name]['status']:6s} {rows[name]['detail']}", flush=True)
    if args.json:
        from ptxtrain.bench.timing import environment

        with open(args.json, "w") as f:
            json.dump({"env": environment(), "bench": "probe_triton_ws", "rows": rows}, f)


if __name__ == "__main__":
    main()
