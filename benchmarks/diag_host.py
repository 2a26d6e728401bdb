"""Where the host (CPU) time of an FP8 Linear's forward + backward goes, on a GPU machine.

    python3 -m benchmarks.diag_host [--json OUT.json]

Prints the median host µs of each building block (called after the device is idle, so the host
never waits on a full queue) and a cProfile of 20 forward + backward calls (top 45 by
cumulative, top 40 by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats

import torch

from ptxtrain import gemm, quant
from ptxtrain.bench.timing import GpuTimer, environment
from ptxtrain.gemm import cublas
from ptxtrain.gemm import triton as tg
from ptxtrain.nn import Fp8Linear
from ptxtrain.quant import triton as tq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    timer = GpuTimer()
    m, n, k = 4096, 2112, 7168
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    qa = quant.per_token_cast_to_fp8(x)
    qb = quant.per_block_cast_to_fp8(w)
    sfa_mn = qa[1].t().contiguous().t()
    sfb_t = qb[1].contiguous().t()
    calls = {
        "torch.empty": lambda: torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
        "bf16 matmul": lambda: x @ w.t(),
        "_scaled_mm raw": lambda: torch._scaled_mm(
            qa[0], qb[0].t(), sfa_mn, sfb_t, out_dtype=torch.bfloat16
        ),
        "cublas.fp8_gemm_nt": lambda: cublas.fp8_gemm_nt(qa, qb),
        "gemm.fp8_gemm_nt (dispatch)": lambda: gemm.fp8_gemm_nt(qa, qb),
        "triton.fp8_gemm_nt": lambda: tg.fp8_gemm_nt(qa, qb),
        "tq.per_token_cast_to_fp8": lambda: tq.per_token_cast_to_fp8(x),
        "tq.per_token_cast_to_fp8_both": lambda: tq.per_token_cast_to_fp8_both(x),
        "quant.per_token_cast_to_fp8_both (dispatch)": lambda: quant.per_token_cast_to_fp8_both(x),
        "sf mn-major copy": lambda: qa[1].t().contiguous().t(),
    }
    lin = Fp8Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    bf = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)

    def fwd_bwd(layer):
        def run():
            layer.weight.grad = None
            xg.grad = None
            layer(xg).backward(dy)

        return run

    calls["Fp8Linear fwd"] = lambda: lin(xg)
    calls["Fp8Linear fwd+bwd"] = fwd_bwd(lin)
    calls["nn.Linear bf16 fwd+bwd"] = fwd_bwd(bf)
    host = {}
    for name, fn in calls.items():
        fn()
        host[name] = timer.host_us(fn, calls=20)
        print(f"{name:<45} {host[name]:8.1f} µs host", flush=True)
    prof = cProfile.Profile()
    run = fwd_bwd(lin)
    prof.enable()
    for _ in range(20):
        run()
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumtime").print_stats(45)
    print(buf.getvalue()[-7000:])
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    print(buf.getvalue()[-6500:])
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    table = tp.key_averages().table(
        sort_by="self_cpu_time_total", row_limit=28, max_name_column_width=60
    )
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bench": "diag_host", "env": environment(), "host_us": host}, f, indent=1)


if __name__ == "__main__":
    main()
