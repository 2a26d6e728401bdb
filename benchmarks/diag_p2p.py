"""Reproduce DualPipe's NCCL crash (CUDA error 700 at the first crossed send) and check each fix.

    torchrun --nproc-per-node 2 -m benchmarks.diag_p2p [--variants a,b,...] [--timeout 120]
        [--numel 1048576] [--json OUT.json]

Every variant runs in a fresh pair of child processes (one per rank, with its own process group
and rendezvous port), so a crash or a hang ends that variant only: PASS, CRASH (exit code and the
last stderr lines) or HANG (killed after ``--timeout`` s). Rank 0 prints one table for both ranks
at the end (and writes it to ``--json``). ``DIAG_P2P_CPU=1`` runs the same on CPU gloo, where
every variant should pass: a smoke test of the script itself. Variants (``--numel`` float32
elements per message):

- ``crossed_lazy``: on a fresh group both ranks ``isend`` to each other, then ``recv``: the first
  step of DualPipe on 2 ranks. Expected to CRASH on NCCL 2.28 (see ``ptxtrain.parallel._p2p``).
- ``crossed_after_connect``: the same after ``P2P.connect`` (ordered, matched warm-up through
  the same unbatched ops). Expected PASS: the fix.
- ``crossed_after_batched_warmup``: the same after a ``batch_isend_irecv`` warm-up (which runs on
  the group's communicator, not on the 2-rank one unbatched ops create). Expected to CRASH.
- ``crossed_batched``: the crossed exchange as one ``batch_isend_irecv``. Expected PASS.
- ``crossed_large_after_connect``: ``P2P.connect``, then crossed unbatched sends of 64x
  ``--numel`` elements: beyond NCCL's buffers a crossed pair of unbatched sends can block each
  other (HANG), which the schedules avoid only because activations are smaller. Informational.
- ``dualpipe_no_connect`` / ``dualpipe``: a toy 2-stage DualPipe step (float32 Linear stages on
  the GPU) without / with the eager connect. Expected CRASH / PASS.
- ``model_dualpipe``: ``PipelineRunner`` over the ``small`` preset (MTP off, fp32), 3 steps
  sequential F&B, then 3 steps from the same weights with the two-stream overlap hook; prints both
  losses, the max difference and ms/step of each. PASS when the losses agree within 1e-4.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

VARIANTS = (
    "crossed_lazy",
    "crossed_after_connect",
    "crossed_after_batched_warmup",
    "crossed_batched",
    "crossed_large_after_connect",
    "crossed_large_directional",
    "dualpipe_no_connect",
    "dualpipe",
    "model_dualpipe",
)


# ------------------------------------------------------------------ child: one variant, one rank
def _sync(torch, dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _crossed(dist, torch, dev, numel: int, rank: int, groups=None) -> None:
    """Both ranks isend to each other, then recv; ``groups``: ``{(src, dst): group}`` puts each
    direction on its own group (``directional_groups``), else both share the default group."""
    peer = 1 - rank
    groups = groups or {}
    mine = torch.full((numel,), float(rank + 1), device=dev)
    got = torch.zeros(numel, device=dev)
    work = dist.isend(mine, peer, group=groups.get((rank, peer)))
    dist.recv(got, peer, group=groups.get((peer, rank)))
    work.wait()
    _sync(torch, dev)
    if not bool((got == float(peer + 1)).all()):
        raise RuntimeError("crossed exchange delivered wrong values")


def _toy_dualpipe(torch, dev, connect: bool) -> dict:
    from torch import nn

    from ptxtrain.parallel import DualPipe
    from ptxtrain.parallel._p2p import P2P

    if not connect:
        P2P.connect = lambda self, peers: None  # the schedule as it was before the fix
    import torch.distributed as dist

    rank = dist.get_rank()
    dim, rows = (1024, 512) if dev.type == "cuda" else (32, 4)

    def stage(seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim)).to(dev)

    pipe = DualPipe((stage(rank), stage(1 - rank)))
    g = torch.Generator(device=dev).manual_seed(rank)
    x = torch.randn(4 * rows, dim, device=dev, generator=g)
    y = torch.randn(4 * rows, dim, device=dev, generator=g)
    loss, _ = pipe.step(x, num_chunks=8, criterion=lambda h, t: ((h - t) ** 2).mean(), labels=(y,))
    _sync(torch, dev)
    return {"loss": float(loss)}


class _PlainGrads:
    """The optimizer argument of ``PipelineRunner.reduce_grads``: plain ``.grad``."""

    @staticmethod
    def grad_for(p):
        return p.grad


def _model_dualpipe(torch, dev) -> dict:
    import torch.distributed as dist

    from ptxtrain.model import build_model
    from ptxtrain.model.config import get_preset
    from ptxtrain.train.pipeline import PipelineRunner

    preset = "small" if dev.type == "cuda" else "tiny"
    cfg = type(get_preset(preset)).from_dict({**get_preset(preset).to_dict(), "mtp_depth": 0})
    batch, seq = (16, 256) if dev.type == "cuda" else (4, 16)
    out: dict = {}
    for overlap in (False, True):
        model = build_model(cfg, dtype=torch.float32, device=dev, seed=0)
        runner = PipelineRunner(model, "dualpipe", 4, overlap=overlap)
        losses, times = [], []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g).to(dev)
            _sync(torch, dev)
            dist.barrier()
            t0 = time.perf_counter()
            res = runner.step(x, x.roll(-1, dims=1))
            _sync(torch, dev)
            times.append(time.perf_counter() - t0)
            losses.append(float(res.lm_loss))
            runner.reduce_grads(_PlainGrads)  # sum the two copies' grads (DualPipe)
            with torch.no_grad():  # a plain SGD step so the three steps differ
                for p in runner.module.parameters():
                    if p.grad is not None:
                        p.sub_(1e-2 * p.grad)
                        p.grad = None
        key = "overlap" if overlap else "sequential"
        out[key] = {"losses": losses, "ms_per_step": 1e3 * min(times[1:])}
    diff = max(abs(a - b) for a, b in zip(out["overlap"]["losses"], out["sequential"]["losses"]))
    out["max_loss_diff"] = diff
    if diff > 1e-4:
        raise RuntimeError(f"overlap hook changes the losses by {diff:.3e}: {out}")
    return out


def run_child(variant: str, numel: int) -> None:
    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if os.environ.get("DIAG_P2P_CPU") == "1":  # a smoke test of this script on CPU gloo
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("diag_p2p needs exactly 2 ranks")
    info: dict = {}
    if variant == "crossed_lazy":
        _crossed(dist, torch, dev, numel, rank)
    elif variant == "crossed_after_connect":
        from ptxtrain.parallel._p2p import P2P

        P2P(None, dev).connect([1 - rank])
        _crossed(dist, torch, dev, numel, rank)
    elif variant == "crossed_after_batched_warmup":
        a, b = torch.ones(1, device=dev), torch.zeros(1, device=dev)
        ops = [dist.P2POp(dist.isend, a, 1 - rank), dist.P2POp(dist.irecv, b, 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        _crossed(dist, torch, dev, numel, rank)
    elif variant == "crossed_batched":
        mine = torch.full((numel,), float(rank + 1), device=dev)
        got = torch.zeros(numel, device=dev)
        ops = [dist.P2POp(dist.isend, mine, 1 - rank), dist.P2POp(dist.irecv, got, 1 - rank)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        _sync(torch, dev)
        if not bool((got == float(2 - rank)).all()):
            raise RuntimeError("batched exchange delivered wrong values")
    elif variant == "crossed_large_after_connect":
        from ptxtrain.parallel._p2p import P2P

        P2P(None, dev).connect([1 - rank])
        _crossed(dist, torch, dev, 64 * numel, rank)
    elif variant == "crossed_large_directional":
        from ptxtrain.parallel._p2p import P2P, directional_groups

        groups = directional_groups([(0, 1)])
        P2P(None, dev, groups).connect([1 - rank])
        _crossed(dist, torch, dev, 64 * numel, rank, groups)
    elif variant == "dualpipe_no_connect":
        info = _toy_dualpipe(torch, dev, connect=False)
    elif variant == "dualpipe":
        info = _toy_dualpipe(torch, dev, connect=True)
    elif variant == "model_dualpipe":
        info = _model_dualpipe(torch, dev)
    else:
        raise SystemExit(f"unknown variant {variant!r}; known: {', '.join(VARIANTS)}")
    dist.barrier()
    print("DIAG_RESULT " + json.dumps(info), flush=True)
    dist.destroy_process_group()


# ------------------------------------------------------------------ driver: one per torchrun rank
def _store(rank: int, world: int, port: int):
    from torch.distributed import TCPStore

    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return TCPStore(addr, port, world, is_master=rank == 0, timeout=_td(3600))


def _td(s: float):
    import datetime

    return datetime.timedelta(seconds=s)


def _barrier(store, key: str, world: int) -> None:
    store.add(key, 1)
    while int(store.add(key, 0)) < world:
        time.sleep(0.05)


def run_variant(variant: str, port: int, args) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    env["MASTER_PORT"] = str(port)
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, "-m", "benchmarks.diag_p2p", "--child", variant]
    cmd += ["--numel", str(args.numel)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # our own child, by its handle
        out, err = proc.communicate()
        status = "HANG"
    else:
        status = "PASS" if proc.returncode == 0 else "CRASH"
    result: dict = {"status": status, "rc": proc.returncode, "s": round(time.monotonic() - t0, 1)}
    for line in out.splitlines():
        if line.startswith("DIAG_RESULT "):
            result["info"] = json.loads(line[len("DIAG_RESULT ") :])
    if status != "PASS":
        tail = [ln for ln in err.splitlines() if ln.strip()][-6:]
        result["stderr_tail"] = tail
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per variant")
    ap.add_argument("--numel", type=int, default=1 << 20, help="float32 elements per message")
    ap.add_argument("--json", help="rank 0 writes the table here")
    args = ap.parse_args()
    if args.child:
        run_child(args.child, args.numel)
        return
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun --nproc-per-node 2 (see the module docstring)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    base = int(os.environ.get("MASTER_PORT", "29500")) + 101
    store = _store(rank, world, base)
    results = {}
    for i, v in enumerate(variants):
        _barrier(store, f"start/{v}", world)  # both ranks start each variant together
        results[v] = run_variant(v, base + 1 + i, args)
        store.set(f"result/{v}/{rank}", json.dumps(results[v]))
        print(f"[rank {rank}] {v}: {results[v]['status']}", flush=True)
    _barrier(store, "done", world)
    if rank != 0:
        store.add("bye", 1)  # the last use of the store, which rank 0 hosts
        return
    store.add("bye", 1)
    table = {
        v: {r: json.loads(store.get(f"result/{v}/{r}")) for r in range(world)} for v in variants
    }
    print(f"\n{'variant':32s} " + " ".join(f"rank {r:<8d}" for r in range(world)))
    for v, per in table.items():
        print(f"{v:32s} " + " ".join(f"{per[r]['status']:13s}" for r in range(world)))
        for r in range(world):
            if "info" in per[r] and per[r]["info"]:
                print(f"    rank {r}: {json.dumps(per[r]['info'])}")
            for ln in per[r].get("stderr_tail", []):
                print(f"    rank {r} | {ln[:160]}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
    while int(store.add("bye", 0)) < world:  # keep the store up until every rank is done
        time.sleep(0.05)


if __name__ == "__main__":
    main()
