"""Where the first training step's time goes on a fresh machine: JIT compiles (NVRTC, Triton)
against everything else (GPU diagnostic).

    python -m benchmarks.diag_first_step [--preset small] [--batch 8] [--seq 1024] [--json OUT]

Points ptxtrain's JIT cache and Triton's cache at empty temporary folders (as on a fresh
machine), times every NVRTC compile (``ptxtrain.jit.compiler._nvrtc_compile``) and every Triton
compile (``JITFunction._do_compile``), and runs ``ptxtrain train`` for ``--steps`` FP8 steps in
this process; then prints the first step's time, the compile counts and seconds of each kind
(NVRTC's split into the training thread's and ``ptxtrain.nn.prewarm``'s background threads'),
and the slowest compiles. ``PTXTRAIN_JIT_PREWARM=0`` in the environment measures without the
background compiles. The DeepGEMM users' complaint this measures: the first run's JIT cost
(ANCHORS §1).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="first-step-")
    os.environ["PTXTRAIN_JIT_CACHE_DIR"] = os.path.join(tmp, "ptxtrain-jit")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton")

    import triton.runtime.jit as tjit

    import ptxtrain.jit.compiler as jc

    events: list[dict] = []

    def timed(kind, fn, name_of):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                events.append({"kind": kind, "name": name_of(a, kw),
                               "s": time.perf_counter() - t0,
                               "thread": threading.current_thread().name})  # fmt: skip

        return wrapper

    jc._nvrtc_compile = timed("nvrtc", jc._nvrtc_compile, lambda a, kw: str(a[1])[:120])
    do_compile = tjit.JITFunction._do_compile
    tjit.JITFunction._do_compile = timed(
        "triton", do_compile, lambda a, kw: getattr(a[0], "__name__", str(a[0]))[:120]
    )

    from ptxtrain.bench.timing import environment
    from ptxtrain.train.loop import TrainArgs, train

    t0 = time.perf_counter()
    summary = train(
        TrainArgs(
            preset=args.preset, precision="fp8", steps=args.steps, batch_size=args.batch,
            seq_len=args.seq, eval_every=0, sample_tokens=0, ckpt_every=0,
            out=os.path.join(tmp, "run"), progress=False,
        )
    )  # fmt: skip
    total = time.perf_counter() - t0
    per_kind = {}
    for kind in ("nvrtc", "triton"):
        ev = [e for e in events if e["kind"] == kind]
        main = [e for e in ev if not e["thread"].startswith("ptxtrain-jit")]
        per_kind[kind] = {"count": len(ev), "seconds": round(sum(e["s"] for e in ev), 2),
                          "on_main_thread": len(main),
                          "main_thread_seconds": round(sum(e["s"] for e in main), 2)}  # fmt: skip
    slow = sorted(events, key=lambda e: -e["s"])[:15]
    record = {
        "bench": "diag_first_step",
        "env": environment(),
        "preset": args.preset,
        "tokens_per_step": args.batch * args.seq,
        "first_step_s": summary["first_step_s"],
        "steady_tokens_per_s": summary["steady_tokens_per_s"],
        "train_call_s": round(total, 2),
        "compiles": per_kind,
        "slowest": slow,
        "events": events,
    }
    nv, tr = per_kind["nvrtc"], per_kind["triton"]
    print(f"first step {summary['first_step_s']:.1f} s (train() call {total:.1f} s); "
          f"NVRTC {nv['count']} compiles {nv['seconds']} s "
          f"({nv['on_main_thread']} on the main thread, {nv['main_thread_seconds']} s); "
          f"Triton {tr['count']} compiles {tr['seconds']} s")  # fmt: skip
    for e in slow:
        print(f"  {e['kind']:6} {e['s']:6.2f} s  {e['thread'][:16]:16} {e['name']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
