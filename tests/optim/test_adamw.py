"""Tests for ptxtrain.optim: AdamW (BF16 moments, FP32 master weights and grads), byte counts."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from safetensors.torch import load, save

from ptxtrain.optim import AdamW, GradInBuffer, optimizer_state_bytes
from ptxtrain.testing.numeric import assert_bitwise_equal, calc_diff

BETAS = (0.9, 0.95)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _linear(seed: int, dtype: torch.dtype, d_in: int = 24, d_out: int = 10) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(d_in, d_out).to(dtype)


def _microbatch(seed: int, n: int = 16, d_in: int = 24, d_out: int = 10):
    g = _gen(seed)
    return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)


def _flatten(sd: dict) -> dict[str, torch.Tensor]:
    return {f"{pid}.{k}": v for pid, entry in sd["state"].items() for k, v in entry.items()}


def _assert_state_dicts_bitwise(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    flat_a, flat_b = _flatten(a), _flatten(b)
    assert flat_a.keys() == flat_b.keys()
    for key in flat_a:
        assert_bitwise_equal(flat_b[key], flat_a[key], name=key)


# --------------------------------------------------------------------------- agreement with torch
@pytest.mark.parametrize("foreach", [False, True])
def test_matches_torch_adamw_fp32_with_groups_and_lr_schedule(foreach):
    g = _gen(0)
    shapes = [(7, 5), (13,), (3, 4, 2)]
    ours = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in ours]

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0, "lr": 3e-3}]

    opt = AdamW(
        groups(ours),
        lr=1e-2,
        betas=BETAS,
        eps=1e-8,
        weight_decay=0.1,
        moment_dtype=torch.float32,
        foreach=foreach,
    )
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2, betas=BETAS, eps=1e-8, weight_decay=0.1)
    for step in range(6):
        for p, q in zip(ours, ref):
            grad = torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad.clone(), grad.clone()
        for o in (opt, ref_opt):  # warmup-like change of lr between steps, per group
            o.param_groups[0]["lr"] = 1e-2 * (step + 1) / 6
            o.param_groups[1]["lr"] = 3e-3 * (6 - step) / 6
        opt.step()
        ref_opt.step()
        for i, (p, q) in enumerate(zip(ours, ref)):
            # Same FP32 formula in the same operation order (bitwise on CPU today); rtol 1e-6 ≈ 8
            # FP32 ulps leaves room for a torch release that reorders an op, nothing more.
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"param {i}, {step=}")
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(
                    opt.state[p][key],
                    ref_opt.state[q][key],
                    rtol=1e-6,
                    atol=1e-12,
                    msg=f"{key} of param {i}, {step=}",
                )
                assert opt.state[p][key].dtype == torch.float32
            assert "master" not in opt.state[p]  # FP32 params need no master


def test_bf16_params_and_moments_track_fp32_torch_adamw():
    g = _gen(1)
    x = torch.randn(256, 32, generator=g)
    w_true = torch.randn(8, 32, generator=g) / 32**0.5
    y = x @ w_true.T + 0.01 * torch.randn(256, 8, generator=g)
    w0 = (0.1 * torch.randn(8, 32, generator=g)).bfloat16()
    w = torch.nn.Parameter(w0.clone())  # BF16 working weight
    w_ref = torch.nn.Parameter(w0.float())  # same start, FP32 everything
    opt = AdamW([w], lr=1e-2, betas=BETAS, weight_decay=0.01)
    ref_opt = torch.optim.AdamW([w_ref], lr=1e-2, betas=BETAS, weight_decay=0.01)
    x_bf16 = x.bfloat16()
    losses, ref_losses = [], []
    for step in range(200):
        for o in (opt, ref_opt):
            o.param_groups[0]["lr"] = 1e-2 * min(1.0, (step + 1) / 20)
        loss = ((x_bf16 @ w.T).float() - y).pow(2).mean()
        loss.backward()
        ref_loss = (x @ w_ref.T - y).pow(2).mean()
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())

    master = opt.state[w]["master"]
    assert master.dtype == torch.float32 and opt.state[w]["exp_avg"].dtype == torch.bfloat16
    assert_bitwise_equal(w.detach(), master.bfloat16(), name="bf16 param vs rounded master")
    rel = float((master - w_ref.detach()).norm() / w_ref.detach().norm())
    # BF16 inputs/weights in the forward, BF16 grads and BF16 moments each add ~2^-9 relative
    # noise per step; measured rel ≈ 0.35% over 5 seeds. 1.5% is 4x that, and far below the
    # ~100% a wrong update would give.
    assert rel < 1.5e-2, f"{rel=:.3e}, calc_diff={calc_diff(master, w_ref.detach()):.2e}"
    # Loss falls ~10^4x (to the BF16 forward's noise floor ~1e-4); require 100x.
    assert losses[-1] < 0.01 * losses[0], f"{losses[0]=}, {losses[-1]=}"
    # Both runs reach nearly the same loss: measured |diff| ≈ 2e-5, bound 1e-4 · initial ≈ 1.2e-4.
    assert abs(losses[-1] - ref_losses[-1]) < 1e-4 * losses[0], (losses[-1], ref_losses[-1])


def test_step_uses_fp32_grad_and_master_like_torch_fp32():
    """One step on a BF16 param equals torch AdamW on its FP32 master fed the FP32 grad buffer."""
    model = _linear(2, torch.bfloat16)
    ref = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = AdamW(
        model.parameters(), lr=3e-3, betas=BETAS, weight_decay=0.1, moment_dtype=torch.float32
    )
    ref_opt = torch.optim.AdamW(ref, lr=3e-3, betas=BETAS, weight_decay=0.1)
    for step in range(3):
        x, y = _microbatch(step)
        (model(x.bfloat16()).float() - y).pow(2).mean().backward()
        for p, q in zip(model.parameters(), ref):
            assert isinstance(p.grad, GradInBuffer)  # the hook moved it into the FP32 buffer
            q.grad = opt.grad_for(p).clone()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        for i, (p, q) in enumerate(zip(model.parameters(), ref)):
            # Same FP32 arithmetic on the same inputs (bitwise on CPU); 1e-6 ≈ 8 ulps of slack.
            torch.testing.assert_close(
                opt.state[p]["master"], q.detach(), rtol=1e-6, atol=1e-7, msg=f"master {i}, {step=}"
            )
            assert_bitwise_equal(p.detach(), opt.state[p]["master"].bfloat16(), name=f"param {i}")


def test_bf16_param_without_master_is_updated_in_fp32_and_rounded():
    g = _gen(3)
    w = torch.randn(6, 9, generator=g).bfloat16().requires_grad_()
    w_ref = w.detach().float().requires_grad_()
    opt = AdamW([w], lr=1e-2, master_weights=False, moment_dtype=torch.float32, fp32_grads=False)
    ref_opt = torch.optim.AdamW([w_ref], lr=1e-2, betas=BETAS, weight_decay=0.1)
    grad = torch.randn(6, 9, generator=g).bfloat16()
    w.grad, w_ref.grad = grad.clone(), grad.float()
    opt.step()
    ref_opt.step()
    assert "master" not in opt.state[w]
    # One step from the same FP32 start, then a single round to BF16 in ours: bitwise equal.
    assert_bitwise_equal(w.detach(), w_ref.detach().bfloat16(), name="bf16 param")


# --------------------------------------------------------------------------- FP32 gradients
def test_fp32_grad_accumulation_over_two_microbatches_is_fp32_sum():
    model = _linear(4, torch.bfloat16)
    params = list(model.parameters())
    x0, y0 = _microbatch(40)
    x1, y1 = _microbatch(41)

    def loss_of(x, y):
        return (model(x.bfloat16()).float() - y).pow(2).sum()

    # Per-micro-batch BF16 grads, taken before the optimizer exists (no hooks yet).
    g0 = torch.autograd.grad(loss_of(x0, y0), params)
    g1 = torch.autograd.grad(loss_of(x1, y1), params)

    opt = AdamW(model.parameters())
    loss_of(x0, y0).backward()
    loss_of(x1, y1).backward()
    lost_in_bf16 = False
    for i, p in enumerate(params):
        assert isinstance(p.grad, GradInBuffer), f"param {i}: the hook must free the BF16 grad"
        buf = opt.grad_for(p)
        assert buf.dtype == torch.float32 and buf.shape == p.shape
        expected = g0[i].float() + g1[i].float()
        assert_bitwise_equal(buf, expected, name=f"fp32 grad sum of param {i}")
        lost_in_bf16 |= not torch.equal(expected.bfloat16().float(), expected)
    assert lost_in_bf16, "the test data should make BF16 accumulation inexact somewhere"

    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(opt.grad_for(p)) == 0 for p in params)
    opt.zero_grad()
    assert all(opt.grad_for(p) is None for p in params)
    assert opt.state_bytes()["grad"] == 0


def test_newest_optimizer_owns_the_grads_and_remove_hooks():
    model = _linear(5, torch.bfloat16)
    old = AdamW(model.parameters())
    new = AdamW(model.parameters())
    x, y = _microbatch(50)
    (model(x.bfloat16()).float() - y).pow(2).mean().backward()
    for p in model.parameters():
        assert old.grad_for(p) is None
        assert new.grad_for(p).dtype == torch.float32
    new.zero_grad()
    new.remove_hooks()
    (model(x.bfloat16()).float() - y).pow(2).mean().backward()
    for p in model.parameters():  # no hook is active any more: the BF16 grad stays on p
        assert p.grad is not None and p.grad.dtype == torch.bfloat16
        assert new.grad_for(p) is p.grad


def test_hand_set_grad_is_folded_into_fp32_buffer():
    model = _linear(6, torch.bfloat16)
    opt = AdamW(model.parameters())
    x, y = _microbatch(60)
    (model(x.bfloat16()).float() - y).pow(2).mean().backward()
    w = model.weight
    before = opt.grad_for(w).clone()
    extra = torch.randn(w.shape, generator=_gen(61)).bfloat16()
    w.grad = extra.clone()
    assert_bitwise_equal(opt.grad_for(w), before + extra.float(), name="folded grad")
    assert isinstance(w.grad, GradInBuffer)


def test_generator_groups_add_param_group_and_closure():
    model = _linear(17, torch.bfloat16)
    head = torch.nn.Linear(10, 3).bfloat16()
    opt = AdamW([{"params": (p for p in model.parameters())}], lr=1e-2)
    assert len(opt.param_groups[0]["params"]) == 2  # the generator was not lost
    opt.add_param_group({"params": head.parameters(), "lr": 1e-3})
    x, y = _microbatch(170, d_out=3)
    before = [p.detach().clone() for p in (*model.parameters(), *head.parameters())]

    def closure():
        loss = (head(model(x.bfloat16())).float() - y).pow(2).mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert loss is not None and loss.requires_grad  # computed under enable_grad
    for i, p in enumerate((*model.parameters(), *head.parameters())):
        hooked = isinstance(p.grad, GradInBuffer) and opt.grad_for(p).dtype == torch.float32
        assert hooked, f"param {i} not hooked"
        assert not torch.equal(p.detach(), before[i]), f"param {i} was not updated"
        assert "master" in opt.state[p]


@pytest.mark.parametrize("foreach", [False, True])
def test_clip_grad_norm_matches_torch_on_the_grads_step_uses(foreach):
    model = _linear(7, torch.bfloat16)
    opt = AdamW(model.parameters(), foreach=foreach)
    x, y = _microbatch(70)
    (model(x.bfloat16()).float() - y).pow(2).sum().backward()
    ref = [opt.grad_for(p).clone().requires_grad_() for p in model.parameters()]
    for r in ref:
        r.grad = r.detach().clone()
    expected_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm=0.5)
    total = opt.clip_grad_norm_(0.5)
    assert total.dtype == torch.float32 and total.dim() == 0
    assert float(total) > 0.5  # so clipping really happened
    # Same FP32 norms and scale; only the summation order inside vector_norm may differ.
    torch.testing.assert_close(total, expected_norm, rtol=1e-6, atol=0)
    for i, (p, r) in enumerate(zip(model.parameters(), ref)):
        torch.testing.assert_close(
            opt.grad_for(p), r.grad, rtol=1e-6, atol=1e-9, msg=f"clipped grad {i}"
        )
    opt.zero_grad()
    assert float(opt.clip_grad_norm_(1.0)) == 0.0  # no grads at all


def test_clip_grad_norm_error_if_nonfinite():
    w = torch.randn(4, 4, generator=_gen(8)).requires_grad_()
    opt = AdamW([w])
    w.grad = torch.full((4, 4), math.inf)
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, error_if_nonfinite=True)


# --------------------------------------------------------------------------- checkpoints
def _mixed_setup(seed: int):
    """A BF16 Linear plus an FP32 LayerNorm in two groups: masters only on the BF16 params."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 10).bfloat16(), torch.nn.LayerNorm(10))
    groups = [
        {"params": list(model[0].parameters())},
        {"params": list(model[1].parameters()), "weight_decay": 0.0},
    ]
    return model, groups


def _train_mixed(model, opt, seeds):
    for s in seeds:
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (0.5 + 0.5 * math.cos(s / 10))  # cosine-like schedule
        for mb in range(2):
            x, y = _microbatch(1000 * s + mb)
            (model(x.bfloat16()).float() - y).pow(2).mean().backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trip_is_bitwise_and_keeps_dtypes():
    model, groups = _mixed_setup(9)
    opt = AdamW(groups, lr=1e-2)
    _train_mixed(model, opt, range(3))
    saved = copy.deepcopy(opt.state_dict())

    model2, groups2 = _mixed_setup(9)
    opt2 = AdamW(groups2, lr=5.0)  # a different lr: the loaded groups must win
    opt2.load_state_dict(saved)
    # Again (a retried resume): the first load ran torch's __setstate__, which adds a default
    # ("differentiable") that no group holds.
    opt2.load_state_dict(saved)
    _assert_state_dicts_bitwise(saved, opt2.state_dict())
    for p in model2[0].parameters():  # torch's own loader would cast these to the param's dtype
        assert opt2.state[p]["master"].dtype == torch.float32
    for p in model2[1].parameters():
        assert "master" not in opt2.state[p]
        assert opt2.state[p]["exp_avg"].dtype == torch.bfloat16  # not widened to FP32
    # Loaded tensors are copies: stepping opt2 must not touch the saved dict.
    before = copy.deepcopy(saved)
    _train_mixed(model2, opt2, range(3, 4))
    _assert_state_dicts_bitwise(before, saved)


@pytest.mark.parametrize("via", ["state_dict", "safetensors"])
def test_resumed_optimizer_continues_exactly(via):
    model_a, groups_a = _mixed_setup(10)
    opt_a = AdamW(groups_a, lr=1e-2)
    _train_mixed(model_a, opt_a, range(6))  # uninterrupted

    model_b, groups_b = _mixed_setup(10)
    opt_b = AdamW(groups_b, lr=1e-2)
    _train_mixed(model_b, opt_b, range(3))
    model_sd = copy.deepcopy(model_b.state_dict())
    opt_sd = opt_b.state_dict()
    if via == "safetensors":  # plain tensors under the same keys, JSON-style string ids
        blob = save(_flatten(opt_sd))
        loaded = load(blob)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in loaded.items():
            pid, key = name.split(".", 1)
            state.setdefault(pid, {})[key] = t
        opt_sd = {"state": state, "param_groups": copy.deepcopy(opt_sd["param_groups"])}
    else:
        buf = io.BytesIO()
        torch.save(opt_sd, buf)
        buf.seek(0)
        opt_sd = torch.load(buf)
    del opt_b, model_b

    model_c, groups_c = _mixed_setup(999)  # different init: everything must come from the ckpt
    model_c.load_state_dict(model_sd)
    opt_c = AdamW(groups_c, lr=1e-2)
    opt_c.load_state_dict(opt_sd)
    _train_mixed(model_c, opt_c, range(3, 6))

    for (name, pa), pc in zip(model_a.named_parameters(), model_c.parameters()):
        assert_bitwise_equal(pc.detach(), pa.detach(), name=name)
    _assert_state_dicts_bitwise(opt_a.state_dict(), opt_c.state_dict())


def test_load_state_dict_rejects_mismatches():
    model, groups = _mixed_setup(11)
    opt = AdamW(groups)
    _train_mixed(model, opt, range(1))
    sd = copy.deepcopy(opt.state_dict())
    with pytest.raises(TypeError, match="state_dict"):
        opt.load_state_dict({"state": {}})
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict({"state": {}, "param_groups": sd["param_groups"][:1]})
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["param_groups"][0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr"):
        opt.load_state_dict(bad)


# --------------------------------------------------------------------------- byte accounting
def _n_elems(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_state_bytes_bf16_model_is_14_bytes_per_param():
    model = _linear(12, torch.bfloat16)
    opt = AdamW(model.parameters())
    n, n_tensors = _n_elems(model), len(list(model.parameters()))
    x, y = _microbatch(120)
    (model(x.bfloat16()).float() - y).pow(2).mean().backward()
    opt.step()  # grads still held: the training-time peak
    got = opt.state_bytes()
    expected = {
        "param": 2 * n,  # BF16 working weights
        "grad": 4 * n,  # FP32 gradient buffers (p.grad holds a storage-less stand-in)
        "master": 4 * n,
        "exp_avg": 2 * n,
        "exp_avg_sq": 2 * n,
        "other": 4 * n_tensors,  # one 0-d FP32 step counter per tensor
    }
    expected["total"] = sum(expected.values())
    expected["numel"] = n
    expected["per_param"] = expected["total"] / n
    assert got == expected
    core = got["total"] - got["other"]
    assert core == 14 * n  # 2 + 4 + 4 + 2 + 2, docs/design.md §1

    opt.zero_grad()
    assert opt.state_bytes()["grad"] == 0


def test_optimizer_state_bytes_torch_adamw_fp32_is_16_bytes_per_param():
    model = _linear(13, torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    n, n_tensors = _n_elems(model), len(list(model.parameters()))
    before = optimizer_state_bytes(opt)
    assert before["exp_avg"] == 0 and before["grad"] == 0  # nothing allocated yet
    x, y = _microbatch(130)
    (model(x) - y).pow(2).mean().backward()
    opt.step()
    got = optimizer_state_bytes(opt)
    assert (got["param"], got["grad"], got["master"]) == (4 * n, 4 * n, 0)
    assert (got["exp_avg"], got["exp_avg_sq"], got["other"]) == (4 * n, 4 * n, 4 * n_tensors)
    assert got["total"] - got["other"] == 16 * n
    assert got["per_param"] == got["total"] / n

    # Our AdamW over FP32 params with BF16 moments: no master, 4 + 4 + 2 + 2 = 12.
    ours = AdamW(model.parameters())
    ours.step()
    mine = ours.state_bytes()
    assert (mine["master"], mine["exp_avg"], mine["exp_avg_sq"]) == (0, 2 * n, 2 * n)
    assert mine["total"] - mine["other"] == 12 * n


def test_optimizer_state_bytes_subset_and_other_optimizers():
    model = _linear(14, torch.float32)
    w, b = model.weight, model.bias
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    (model(_microbatch(140)[0]).pow(2).mean()).backward()
    opt.step()
    only_w = optimizer_state_bytes(opt, params=[w])
    assert only_w["param"] == 4 * w.numel() and only_w["numel"] == w.numel()
    assert only_w["other"] == 4 * w.numel()  # SGD's momentum_buffer
    full = optimizer_state_bytes(opt)
    assert full["total"] == only_w["total"] + optimizer_state_bytes(opt, params=[b])["total"]

    with pytest.raises(TypeError, match="optimizer"):
        optimizer_state_bytes(model)
    with pytest.raises(ValueError, match="params"):
        optimizer_state_bytes(opt, params=[torch.zeros(3)])
    with pytest.raises(TypeError, match="params"):
        optimizer_state_bytes(opt, params=["w"])


# --------------------------------------------------------------------------- validation
def _p():
    return [torch.randn(3, generator=_gen(15)).requires_grad_()]


@pytest.mark.parametrize(
    ("kwargs", "exc", "name"),
    [
        ({"lr": -1e-3}, ValueError, "lr"),
        ({"lr": float("nan")}, ValueError, "lr"),
        ({"lr": "1e-3"}, TypeError, "lr"),
        ({"betas": (1.0, 0.95)}, ValueError, "betas"),
        ({"betas": (0.9, -0.1)}, ValueError, "betas"),
        ({"betas": (0.9,)}, TypeError, "betas"),
        ({"betas": (0.9, None)}, TypeError, "betas"),
        ({"eps": -1e-8}, ValueError, "eps"),
        ({"eps": True}, TypeError, "eps"),
        ({"weight_decay": -0.1}, ValueError, "weight_decay"),
        ({"weight_decay": math.inf}, ValueError, "weight_decay"),
        ({"moment_dtype": torch.float16}, TypeError, "moment_dtype"),
        ({"moment_dtype": torch.int8}, TypeError, "moment_dtype"),
        ({"moment_dtype": "bf16"}, TypeError, "moment_dtype"),
        ({"master_weights": 1}, TypeError, "master_weights"),
        ({"fp32_grads": "yes"}, TypeError, "fp32_grads"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(kwargs, exc, name):
    with pytest.raises(exc, match=name):
        AdamW(_p(), **kwargs)


def test_bad_groups_params_and_runtime_lr_raise():
    with pytest.raises(ValueError, match="lr"):
        AdamW([{"params": _p(), "lr": -1.0}])
    with pytest.raises(TypeError, match="params"):
        AdamW([torch.arange(3)])
    with pytest.raises(TypeError, match="max_norm"):
        AdamW(_p()).clip_grad_norm_("1")
    opt = AdamW(_p())
    opt.param_groups[0]["params"][0].grad = torch.randn(3, generator=_gen(16))
    opt.param_groups[0]["lr"] = -0.5  # a scheduler bug must not silently ascend
    with pytest.raises(ValueError, match="lr"):
        opt.step()


def test_parameter_given_twice_raises():
    # torch only warns for a duplicate inside one group, then steps the parameter twice.
    p = _p()[0]
    with pytest.raises(ValueError, match=r"params\[1\] is the same tensor as params\[0\]"):
        AdamW([p, p])
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's own check
        AdamW([{"params": [p]}, {"params": [p]}])
    opt = AdamW([p])
    with pytest.raises(ValueError):
        opt.add_param_group({"params": [p]})


@pytest.mark.parametrize("fused", [False, True])
def test_torch_clip_grad_norm_raises_instead_of_clipping_nothing(fused):
    # The gradients live in the FP32 buffers: torch.nn.utils.clip_grad_norm_ over the model's
    # parameters would see none, clip nothing and return 0. It must raise, naming the fix.
    model = _linear(90, torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2, fused=fused)
    for micro in range(2):  # a second micro-batch accumulates past the stand-in
        x, y = _microbatch(91 + micro)
        (model(x.bfloat16()).float() - y).pow(2).mean().backward()
    for foreach in (None, True, False):
        with pytest.raises(RuntimeError, match=r"optimizer\.clip_grad_norm_"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=foreach)
    assert "grad_for" in repr(model.weight.grad)
    with pytest.raises(RuntimeError, match="FP32 buffer"):
        model.zero_grad(set_to_none=False)
    # The optimizer's own clipping gives torch's answer on the FP32 gradients.
    stand_ins = [torch.zeros_like(opt.grad_for(p)) for p in model.parameters()]
    for t, p in zip(stand_ins, model.parameters()):
        t.grad = opt.grad_for(p).clone()
    want = torch.nn.utils.clip_grad_norm_(stand_ins, 1.0, foreach=False)
    assert float(want) > 1.0  # the clip is active, so a no-op would show
    assert torch.equal(opt.clip_grad_norm_(1.0), want)
    for t, p in zip(stand_ins, model.parameters()):
        assert torch.equal(opt.grad_for(p), t.grad)
    opt.step()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is None for p in model.parameters())
    assert copy.deepcopy(model).weight.grad is None


def test_torch_clip_grad_norm_works_without_fp32_grads():
    # fp32_grads=False keeps autograd's p.grad: torch's clipping sees and scales it.
    model = _linear(92, torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2, fp32_grads=False)
    x, y = _microbatch(93)
    (model(x.bfloat16()).float() - y).pow(2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    assert float(norm) > 1e-3  # real gradients, well above the clip threshold
    assert opt.grad_for(model.weight) is model.weight.grad
