"""Is a training step's gradient a pure function of its inputs? (GPU diagnostic.)

Builds the ``small`` preset with FP8 layers of ``--recipe``, takes one fixed batch, and runs
forward + backward ``--repeats`` times from the same weights (no optimizer step). Every
parameter's gradient of every repeat is compared bit for bit with the first; the parameters whose
gradients differ are listed (name, how many repeats differ, largest difference). A second part
repeats the quantizers alone on fixed inputs (pow2 and not, FULL and ragged shapes) and checks
every output against the first call and the reference.

Two more parts hunt rarer, timing-dependent differences (session 25): ``--async-repeats N``
repeats forward + backward N times with no host synchronization between repeats (the host runs
ahead, kernels overlap as in training: PDL tails, the caching allocator's reuse) and compares
every gradient with the first repeat's on the device, reading the verdict once at the end;
``--train-runs R`` runs ``ptxtrain.train.loop.train`` R times in this process
(``--train-steps`` steps each, fresh model and optimizer, the CLI's defaults otherwise) and
compares the per-step losses bit for bit. ``--attn-repeats N`` isolates the attention core:
``F.scaled_dot_product_attention`` forward + backward at the ``small`` model's shape (MLA heads:
q / k 96, v 64, causal), N times from the same inputs, with and without
:func:`ptxtrain.train.loop.deterministic_mode`: how many repeats give another dQ / dK / dV than
the first, and the median time of one forward + backward in each mode.
``--deterministic`` runs the model, async and train parts inside ``deterministic_mode()`` (what
``ptxtrain train --deterministic`` does), unlike ``--strict``'s warn-only mode, which names the
nondeterministic ops but still runs them.

    python -m benchmarks.diag_determinism --recipe deepseek_pow2 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from contextlib import nullcontext

import torch


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _model_and_batch(recipe: str, batch: int, seq: int, seed: int):
    """The ``small`` model with FP8 layers of ``recipe`` (seed 0) and one fixed batch."""
    from ptxtrain.model import build_model, get_preset
    from ptxtrain.model.deepseek import convert_model_to_fp8_training

    torch.manual_seed(0)
    model = build_model(get_preset("small"), device="cuda", seed=0)
    convert_model_to_fp8_training(model, recipe)
    model.train()
    g = torch.Generator(device="cpu").manual_seed(seed)
    return model, torch.randint(0, 256, (batch, seq + 1), generator=g).cuda()


def model_part(recipe: str, repeats: int, batch: int, seq: int) -> dict:
    model, x = _model_and_batch(recipe, batch, seq, seed=1)
    runs = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        out = model(x[:, :-1], x[:, 1:])
        out.loss.backward()
        torch.cuda.synchronize()
        runs.append((float(out.loss.detach()), _grads(model)))
    g0 = runs[0][1]
    diff: dict[str, dict] = {}
    for _, gi in runs[1:]:
        for name, t in gi.items():
            if not torch.equal(t, g0[name]):
                d = diff.setdefault(name, {"repeats": 0, "max_abs": 0.0})
                d["repeats"] += 1
                d["max_abs"] = max(d["max_abs"], float((t.float() - g0[name].float()).abs().max()))
    return {
        "recipe": recipe,
        "losses": [r[0] for r in runs],
        "params": len(g0),
        "differing": diff,
    }


def async_part(recipe: str, repeats: int, batch: int, seq: int) -> dict:
    """Forward + backward ``repeats`` times with no host sync in between; per parameter, the
    repeats whose gradient differs from the first's and the largest difference (device-side)."""
    model, x = _model_and_batch(recipe, batch, seq, seed=2)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    first = None
    bad = torch.zeros(len(names), dtype=torch.int64, device="cuda")
    worst = torch.zeros(len(names), dtype=torch.float32, device="cuda")
    losses = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        out = model(x[:, :-1], x[:, 1:])
        out.loss.backward()
        losses.append(out.loss.detach().float())
        grads = [dict(model.named_parameters())[n].grad for n in names]
        if first is None:
            first = [t.detach().clone() for t in grads]
            continue
        for i, (t, t0) in enumerate(zip(grads, first, strict=True)):
            ne = t != t0
            bad[i] += ne.any()
            worst[i] = torch.maximum(worst[i], (t.float() - t0.float()).abs().max())
    torch.cuda.synchronize()
    loss_vals = torch.stack(losses).cpu().tolist()
    diff = {
        names[i]: {"repeats": int(bad[i]), "max_abs": float(worst[i])}
        for i in range(len(names))
        if int(bad[i])
    }
    return {"recipe": recipe, "repeats": repeats, "distinct_losses": sorted(set(loss_vals)),
            "params": len(names), "differing": diff}  # fmt: skip


def train_part(
    recipe: str, runs: int, steps: int, batch: int, seq: int, out: str, det: bool = False
) -> dict:
    """``train()`` ``runs`` times in this process (``det``: ``--deterministic``); the per-step
    losses of every run."""
    from ptxtrain.train.loop import TrainArgs, train

    all_losses = []
    for i in range(runs):
        args = TrainArgs(
            preset="small", precision="fp8", fp8_recipe=recipe, steps=steps, batch_size=batch,
            seq_len=seq, eval_every=0, sample_tokens=0, ckpt_every=0, out=f"{out}/{recipe}-{i}",
            overwrite=True, progress=False, deterministic=det,
        )  # fmt: skip
        all_losses.append(train(args)["losses"])
    first = all_losses[0]
    diverged = [
        next((s + 1 for s, (a, b) in enumerate(zip(first, run, strict=True)) if a != b), None)
        for run in all_losses
    ]
    return {"recipe": recipe, "runs": runs, "steps": steps, "losses": all_losses,
            "first_differing_step": diverged}  # fmt: skip


def attn_part(repeats: int, batch: int, seq: int) -> list[dict]:
    """SDPA forward + backward repeated from fixed inputs, in both modes and under each SDPA
    backend that takes the shape (see the module note); Flash attention needs one head dim for
    q, k and v, so it runs with v zero-padded to 96 columns (what a model would have to do)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ptxtrain.train.loop import deterministic_mode

    g = torch.Generator(device="cuda").manual_seed(3)
    heads, qk, v_dim = 12, 96, 64

    def leaf(d):
        return torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16,
                           generator=g).requires_grad_()  # fmt: skip

    q, k, v = leaf(qk), leaf(qk), leaf(v_dim)
    dout = torch.randn(batch, heads, seq, v_dim, device="cuda", dtype=torch.bfloat16, generator=g)

    def step(pad: bool):
        q.grad = k.grad = v.grad = None
        vv = F.pad(v, (0, qk - v_dim)) if pad else v
        o = F.scaled_dot_product_attention(q, k, vv, is_causal=True)
        (o[..., :v_dim] if pad else o).backward(dout)
        return q.grad, k.grad, v.grad

    backends = [
        ("default", None),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("flash_v_padded", SDPBackend.FLASH_ATTENTION),
        ("math", SDPBackend.MATH),
    ]
    rows = []
    for (name, backend), det in itertools.product(backends, (False, True)):
        pad = name == "flash_v_padded"
        row = {"backend": name, "deterministic": det, "repeats": repeats,
               "shape": [batch, heads, seq, qk, v_dim]}  # fmt: skip
        try:
            with deterministic_mode(det), sdpa_kernel(backend) if backend else nullcontext():
                first = [t.clone() for t in step(pad)]
                differ = torch.zeros(3, dtype=torch.int64, device="cuda")
                for _ in range(repeats):
                    for i, (a, b) in enumerate(zip(step(pad), first, strict=True)):
                        differ[i] += (a != b).any()
                times = []
                for _ in range(20):
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    step(pad)
                    e1.record()
                    e1.synchronize()
                    times.append(e0.elapsed_time(e1) * 1e3)
        except RuntimeError as e:  # the backend refuses the shape or the mode
            row["error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            continue
        times.sort()
        dq, dk, dv = (int(c) for c in differ.cpu())
        row.update(dq_differing=dq, dk_differing=dk, dv_differing=dv,
                   fwd_bwd_us=times[len(times) // 2])  # fmt: skip
        rows.append(row)
    return rows


def quant_part(repeats: int) -> list[dict]:
    from ptxtrain import quant
    from ptxtrain.quant import ref
    from ptxtrain.testing import assert_bitwise_equal

    rows = []
    shapes = [(8192, 768), (8192, 384), (1000, 768), (8192, 1536), (4096, 7168), (129, 300)]
    ops = [
        ("per_token_cast_to_fp8_both", {"sf_layout": "mn_major"}),
        ("per_token_cast_to_fp8", {"sf_layout": "mn_major"}),
        ("per_token_cast_to_fp8_t", {"sf_layout": "mn_major"}),
        ("per_block_cast_to_fp8_both", {}),
        ("per_block_cast_to_fp8", {}),
    ]
    for m, k in shapes:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * 3
        for op, kw in ops:
            for pow2 in (False, True):
                fn = getattr(quant, op)
                first = [t.clone() for t in fn(x, pow2_scale=pow2, **kw)]
                bad = 0
                for _ in range(repeats):
                    got = fn(x, pow2_scale=pow2, **kw)
                    bad += any(not torch.equal(a, b) for a, b in zip(first, got, strict=True))
                want = getattr(ref, op)(x.cpu(), pow2_scale=pow2)
                ref_ok = True
                try:  # reference layout is row-major: compare the FP8 payloads only
                    for a, b in zip(first, want, strict=True):
                        if a.dtype == torch.float8_e4m3fn:
                            assert_bitwise_equal(a.cpu(), b, op)
                except AssertionError:
                    ref_ok = False
                rows.append(
                    {"m": m, "k": k, "op": op, "pow2": pow2, "repeats_differing": bad,
                     "fp8_equals_reference": ref_ok}
                )  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--recipe", action="append", help="Fp8Linear recipe(s) (default: both)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--quant-repeats", type=int, default=50)
    p.add_argument(
        "--strict",
        action="store_true",
        help="torch.use_deterministic_algorithms(True, warn_only=True): PyTorch then warns at "
        "every op of the step that has no deterministic implementation (names the suspects)",
    )
    p.add_argument("--async-repeats", type=int, default=0, help="see the module note")
    p.add_argument("--attn-repeats", type=int, default=0, help="see the module note")
    p.add_argument(
        "--deterministic", action="store_true", help="ptxtrain.train.loop.deterministic_mode()"
    )
    p.add_argument("--train-runs", type=int, default=0, help="see the module note")
    p.add_argument("--train-steps", type=int, default=8)
    p.add_argument("--train-out", default="/tmp/diag_determinism_runs")
    p.add_argument("--no-model", action="store_true", help="skip the synchronized repeats")
    p.add_argument("--json")
    args = p.parse_args()
    from ptxtrain.bench.timing import environment
    from ptxtrain.train.loop import deterministic_mode

    record = {"bench": "diag_determinism", "env": environment(), "model": [], "quant": [],
              "async": [], "train": [], "attn": [],
              "deterministic": args.deterministic}  # fmt: skip
    if args.attn_repeats:
        record["attn"] = attn_part(args.attn_repeats, args.batch, args.seq)
        for r in record["attn"]:
            head = f"attention {r['backend']} deterministic={r['deterministic']}:"
            if "error" in r:
                print(head, r["error"], flush=True)
                continue
            print(f"{head} of {r['repeats']} repeats, dQ / dK / dV differing "
                  f"{r['dq_differing']} / {r['dk_differing']} / {r['dv_differing']}; "
                  f"fwd + bwd {r['fwd_bwd_us']:.1f} us", flush=True)  # fmt: skip
    if args.strict:
        torch.use_deterministic_algorithms(True, warn_only=True)
    with deterministic_mode(args.deterministic):
        _model_parts(args, record)
    record["quant"] = quant_part(args.quant_repeats) if args.quant_repeats else []
    for q in record["quant"]:
        if q["repeats_differing"] or not q["fp8_equals_reference"]:
            print("quant:", q)
    print(f"quant: {len(record['quant'])} cases checked")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)


def _model_parts(args, record: dict) -> None:
    recipes = args.recipe or ["deepseek", "deepseek_pow2"]
    for recipe in recipes if args.async_repeats else []:
        r = async_part(recipe, args.async_repeats, args.batch, args.seq)
        record["async"].append(r)
        print(f"{recipe} async x{args.async_repeats}: {len(r['distinct_losses'])} distinct "
              f"losses {r['distinct_losses'][:4]}; {len(r['differing'])} of {r['params']} "
              "parameters with differing gradients", flush=True)  # fmt: skip
        for name, d in sorted(r["differing"].items())[:40]:
            print(f"   {name}: {d['repeats']} repeats, max |diff| {d['max_abs']:.3g}")
    for recipe in recipes if args.train_runs else []:
        r = train_part(recipe, args.train_runs, args.train_steps, args.batch, args.seq,
                       args.train_out, args.deterministic)  # fmt: skip
        record["train"].append(r)
        print(f"{recipe} train x{args.train_runs}: first differing step per run "
              f"{r['first_differing_step']}; last losses {[run[-1] for run in r['losses']]}",
              flush=True)  # fmt: skip
    for recipe in [] if args.no_model else recipes:
        r = model_part(recipe, args.repeats, args.batch, args.seq)
        record["model"].append(r)
        print(f"{recipe}: losses {r['losses']}; {len(r['differing'])} of {r['params']} "
              "parameters with differing gradients")  # fmt: skip
        for name, d in sorted(r["differing"].items())[:40]:
            print(f"   {name}: {d['repeats']} repeats, max |diff| {d['max_abs']:.3g}")


if __name__ == "__main__":
    main()
