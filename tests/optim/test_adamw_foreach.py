"""ptxtrain.optim.AdamW: the multi-tensor (foreach) path against the per-tensor path (bitwise on
CPU; within about an FP32 ulp per step on CUDA)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ptxtrain.optim import AdamW
from ptxtrain.optim.adamw import _cuda_reciprocal
from ptxtrain.testing.numeric import assert_bitwise_equal

BETAS = (0.9, 0.95)
# Awkward shapes: a matrix, a vector, a 3-d tensor, a single element, a 0-d scalar.
SHAPES = [(16, 12), (12,), (3, 5, 2), (1,), ()]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _leaves(seed: int, dtypes, device: str = "cpu") -> list[torch.Tensor]:
    """One fresh random leaf per (shape, dtype); the first is a non-contiguous (transposed) leaf."""
    g = _gen(seed)
    out = []
    for i, dtype in enumerate(dtypes):
        shape = SHAPES[i % len(SHAPES)]
        if i == 0:
            t = torch.randn(tuple(reversed(shape)), generator=g).t()
        else:
            t = torch.randn(shape, generator=g)
        out.append(t.to(device=device, dtype=dtype).detach().requires_grad_())
    return out


def _clones(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


def _set_grads(opt_params, grads) -> None:
    """``p.grad = g`` in ``p``'s own layout, as autograd lays gradients out (a 2-norm sums in
    memory order, so the transposed leaf's norm depends on it)."""
    for p, g in zip(opt_params, grads):
        p.grad = None if g is None else torch.empty_like(p).copy_(g)


# CUDA tolerances per dtype (rtol, atol). Measured on an H200: the foreach kernels leave a few
# FP32 values one ulp away from the per-tensor ones per step; over 4 steps that stays within a
# few ulps (rtol 2^-20 = 8 ulps), and for values near zero within a few ulps of the update's
# own size (lr <= 1.1e-2: atol 1e-6 covers ~8 ulps of a unit-size parameter). A low-precision
# copy rounded from an FP32 value one ulp away may land on the neighbouring value: one ulp of
# its own (bf16 2^-7, fp16 2^-10 relative; atol 1e-5 near zero). FP64 likewise at 2^-52.
_CUDA_TOL = {
    torch.float32: (2.0**-20, 1e-6),
    torch.float64: (2.0**-49, 1e-14),
    torch.bfloat16: (2.0**-7, 1e-5),
    torch.float16: (2.0**-10, 1e-5),
}


def _check(actual, expected, name: str, tol: dict | None) -> None:
    """Bitwise equal (``tol`` None), or within ``tol[dtype] = (rtol, atol)``."""
    if tol is None:
        assert_bitwise_equal(actual, expected, name=name)
    else:
        rtol, atol = tol[actual.dtype]
        torch.testing.assert_close(
            actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}"
        )


def _assert_same(a: AdamW, b: AdamW, params_a, params_b, where: str, tol=None) -> None:
    """Params, FP32 grad buffers and every state tensor of ``a`` and ``b`` are bitwise equal,
    or within ``tol`` when given (on CUDA by default within the tolerances above)."""
    for i, (p, q) in enumerate(zip(params_a, params_b)):
        t = _CUDA_TOL if tol is None and p.device.type == "cuda" else tol
        _check(q.detach(), p.detach(), f"{where}: param {i}", t)
        sa, sb = a.state.get(p, {}), b.state.get(q, {})
        assert sa.keys() == sb.keys(), f"{where}: state keys of param {i}"
        for key in sa:  # step counters are exact on every path
            _check(sb[key], sa[key], f"{where}: {key} of param {i}", None if key == "step" else t)


def _run_pair(
    dtypes,
    *,
    steps: int = 4,
    seed: int = 0,
    device: str = "cpu",
    skip: bool = False,
    groups: bool = False,
    chunk_numel: int | None = None,
    other: dict | None = None,
    clip: tuple[float, ...] = (),
    tol: dict | None = None,
    **kwargs,
):
    """Train two optimizers, per-tensor (``foreach=False``) and ``AdamW(**other)`` (default
    ``foreach=True``), on identical params and grads, clipping by ``clip[step % len(clip)]``
    when given; compare after every step (bitwise, or within ``tol``)."""
    params_ref = _leaves(seed, dtypes, device)
    params_fe = _clones(params_ref)
    start = [p.detach().clone() for p in params_ref]

    def build(ps, **path):
        if groups:  # different lr, betas, eps and weight decay per group
            ps = [
                {"params": ps[::2]},
                {"params": ps[1::2], "lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6},
            ]
            ps[1]["weight_decay"] = 0.0 if kwargs.get("weight_decay", 0.1) else 0.05
        return AdamW(ps, **path, **kwargs)

    ref = build(params_ref, foreach=False, fused=False)
    fe = build(params_fe, **(other or {"foreach": True}))
    if chunk_numel is not None:
        fe._foreach_chunk_numel = chunk_numel
    g = _gen(seed + 1)
    for step in range(steps):
        grads = []
        for i, p in enumerate(params_ref):
            grad = torch.randn(p.shape, generator=g).to(device=device, dtype=p.dtype)
            # Some params get no grad on some steps: they are skipped and their step stays.
            grads.append(None if skip and i % 3 == 0 and step % 2 == 1 else grad)
        totals = []
        for opt, ps in ((ref, params_ref), (fe, params_fe)):
            _set_grads(ps, grads)
            for k, group in enumerate(opt.param_groups):  # an lr schedule, per group
                group["lr"] = (1e-2 + 1e-3 * k) * (0.5 + 0.5 * math.cos(step / 3))
            if clip:
                totals.append(opt.clip_grad_norm_(clip[step % len(clip)]))
            opt.step()
            opt.zero_grad()
        if clip:
            t = _CUDA_TOL if tol is None and device == "cuda" else tol
            _check(totals[1], totals[0], f"step {step}: total norm", t)
        _assert_same(ref, fe, params_ref, params_fe, f"step {step}", tol)
    for i, (p, p0) in enumerate(zip(params_fe, start)):
        if "master" not in fe.state[p] and p.dtype in (torch.bfloat16, torch.float16):
            continue  # without a master, updates under half an ulp round back: nothing to see
        weight = fe.state[p].get("master", p.detach())  # a BF16 weight may round back to p0
        assert not torch.equal(weight, p0.to(weight.dtype)), f"param {i} was never updated"
    return ref, fe, params_ref, params_fe


# --------------------------------------------------------------------------- step: bitwise
CONFIGS = {
    "bf16_master_bf16_moments": ([torch.bfloat16] * 5, {}),
    "fp32_params": ([torch.float32] * 5, {}),
    "fp64_params": ([torch.float64] * 5, {}),
    "fp16_params": ([torch.float16] * 5, {}),
    "fp32_moments": ([torch.bfloat16] * 5, {"moment_dtype": torch.float32}),
    "no_master": ([torch.bfloat16] * 5, {"master_weights": False}),
    "bf16_grads_no_fp32_buffers": ([torch.bfloat16] * 5, {"fp32_grads": False}),
    "mixed_dtypes_one_group": (
        [
            torch.bfloat16,
            torch.float32,
            torch.float64,
            torch.bfloat16,
            torch.float16,
            torch.float32,
        ],
        {},
    ),
}


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_foreach_step_is_bitwise_the_per_tensor_step(config, weight_decay):
    dtypes, kwargs = CONFIGS[config]
    _run_pair(dtypes, weight_decay=weight_decay, seed=len(config), **kwargs)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_foreach_groups_skipped_params_and_chunks(weight_decay):
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float64, torch.bfloat16] * 2
    # chunk_numel=100 splits every bucket into several multi-tensor updates.
    ref, fe, params_ref, params_fe = _run_pair(
        dtypes,
        steps=5,
        skip=True,
        groups=True,
        chunk_numel=100,
        weight_decay=weight_decay,
        seed=3,
    )
    counts = [int(fe.state[p]["step"]) for p in params_fe]
    assert counts == [int(ref.state[p]["step"]) for p in params_ref]
    assert counts == [3 if i % 3 == 0 else 5 for i in range(len(dtypes))]  # skipped: no advance
    for p in params_fe:
        step = fe.state[p]["step"]
        assert step.dtype == torch.float32 and step.dim() == 0 and step.device.type == "cpu"


def test_foreach_after_state_dict_round_trip():
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float64, torch.bfloat16]
    ref, _, params_ref, _ = _run_pair(dtypes, steps=3, groups=True, seed=4)
    saved = copy.deepcopy(ref.state_dict())
    g = _gen(40)
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params_ref]

    runs = []
    for foreach in (False, True):
        params = _clones(params_ref)
        groups = [{"params": params[::2]}, {"params": params[1::2], "lr": 1.0}]
        opt = AdamW(groups, foreach=foreach)
        opt.load_state_dict(saved)
        for _ in range(2):
            _set_grads(params, grads)
            opt.step()
        runs.append((opt, params))
    (a, pa), (b, pb) = runs
    _assert_same(a, b, pa, pb, "after load_state_dict")
    assert a.state_dict()["param_groups"] == b.state_dict()["param_groups"]
    assert int(b.state[pb[0]]["step"]) == 5


def test_foreach_choice_of_path(monkeypatch):
    calls = {"one": 0, "foreach": 0}
    one, many = AdamW._update_one, AdamW._update_foreach

    def spy_one(self, *args):
        calls["one"] += 1
        return one(self, *args)

    def spy_many(self, *args):
        calls["foreach"] += 1
        return many(self, *args)

    monkeypatch.setattr(AdamW, "_update_one", spy_one)
    monkeypatch.setattr(AdamW, "_update_foreach", spy_many)
    for foreach, expected in ((None, {"one": 3, "foreach": 0}), (True, {"one": 0, "foreach": 2})):
        calls.update(one=0, foreach=0)
        params = _leaves(5, [torch.bfloat16, torch.float32, torch.bfloat16])
        opt = AdamW(params, foreach=foreach)
        _set_grads(params, [torch.randn(p.shape, generator=_gen(50)).to(p.dtype) for p in params])
        opt.step()
        # None on CPU: per tensor. True: one multi-tensor update per (dtype, ...) bucket.
        assert calls == expected, f"{foreach=}"


def test_foreach_sparse_grad_raises():
    w = torch.randn(4, 3, generator=_gen(6)).requires_grad_()
    opt = AdamW([w], foreach=True)
    w.grad = torch.randn(4, 3, generator=_gen(7)).to_sparse()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()


@pytest.mark.parametrize("foreach", ["yes", 1, 0, 1.0])
def test_foreach_must_be_none_or_bool(foreach):
    with pytest.raises(TypeError, match="foreach"):
        AdamW([torch.randn(3, generator=_gen(8)).requires_grad_()], foreach=foreach)


def test_cuda_reciprocal_is_the_fp32_quotient():
    # √(1-β2^t) for usual β2 and t, plus random values: 1/x rounded as an FP32 op would.
    xs = [(1 - b**t) ** 0.5 for b in (0.95, 0.999, 0.9999) for t in range(1, 200)]
    xs += torch.rand(500, generator=_gen(13), dtype=torch.float64).add_(1e-3).tolist()
    got = torch.tensor([_cuda_reciprocal(x, torch.float32) for x in xs], dtype=torch.float64)
    want = 1.0 / torch.tensor(xs, dtype=torch.float32)  # FP32 division, correctly rounded
    assert_bitwise_equal(got.float(), want, name="FP32 reciprocals")
    assert torch.equal(got, got.float().double())  # already FP32 values: no second rounding
    assert _cuda_reciprocal(xs[0], torch.float64) == 1.0 / xs[0]


# --------------------------------------------------------------------------- clip_grad_norm_
def _clip_pair(norm_type, device: str = "cpu", max_norm: float = 0.5, seed: int = 9):
    """Clip identical gradients of mixed dtypes with both paths; return totals and grads."""
    dtypes = [torch.bfloat16, torch.float32, torch.float64, torch.bfloat16, torch.float32]
    params_ref = _leaves(seed, dtypes, device)
    g = _gen(seed + 1)
    grads = [torch.randn(p.shape, generator=g).to(device=device, dtype=p.dtype) for p in params_ref]
    out = []
    for foreach in (False, True):
        params = _clones(params_ref)
        # The BF16 params' grads are folded into FP32 buffers: the norms see FP32 and FP64.
        opt = AdamW(params, foreach=foreach)
        _set_grads(params, grads)
        total = opt.clip_grad_norm_(max_norm, norm_type=norm_type)
        out.append((total, [opt.grad_for(p) for p in params]))
    return out


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.5])
def test_foreach_clip_grad_norm_is_bitwise_on_cpu(norm_type):
    # On CPU torch._foreach_norm loops over linalg.vector_norm, so everything is bitwise.
    (t_ref, g_ref), (t_fe, g_fe) = _clip_pair(norm_type)
    assert float(t_ref) > 0.5  # clipping really scales
    assert_bitwise_equal(t_fe, t_ref, name="total norm")
    for i, (a, b) in enumerate(zip(g_ref, g_fe)):
        assert_bitwise_equal(b, a, name=f"clipped grad {i}")


def test_foreach_clip_grad_norm_bf16_grads_nonfinite_and_empty():
    params = _leaves(11, [torch.bfloat16, torch.bfloat16, torch.float32])
    grads = [torch.randn(p.shape, generator=_gen(12)).to(p.dtype) for p in params]
    totals, clipped = [], []
    for foreach in (False, True):
        ps = _clones(params)
        opt = AdamW(ps, fp32_grads=False, foreach=foreach)  # grads stay BF16 in p.grad
        _set_grads(ps, grads)
        totals.append(opt.clip_grad_norm_(0.1))
        clipped.append([p.grad for p in ps])
        assert all(p.grad.dtype == q.dtype for p, q in zip(ps, params))
        opt.zero_grad()
        assert float(opt.clip_grad_norm_(1.0)) == 0.0  # no grads at all
        ps[1].grad = torch.full(ps[1].shape, math.nan, dtype=ps[1].dtype)
        with pytest.raises(RuntimeError, match="non-finite"):
            opt.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert_bitwise_equal(totals[1], totals[0], name="total norm of BF16 grads")
    for i, (a, b) in enumerate(zip(*clipped)):
        assert_bitwise_equal(b, a, name=f"clipped BF16 grad {i}")


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("config", list(CONFIGS))
def test_foreach_step_matches_per_tensor_on_cuda(config):
    # Same op order and scalars as the per-tensor path (the bias correction 1/√(1-β2^t) is the
    # reciprocal CUDA's per-tensor division uses); the fused kernels still round a few
    # intermediates differently, hence _CUDA_TOL.
    dtypes, kwargs = CONFIGS[config]
    _run_pair(dtypes, device="cuda", seed=20 + len(config), **kwargs)
    _run_pair(dtypes, device="cuda", skip=True, groups=True, chunk_numel=100, seed=21, **kwargs)


@pytest.mark.gpu
def test_foreach_is_the_default_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(AdamW, "_update_one", lambda *a: calls.append("one"))
    params = _leaves(22, [torch.bfloat16, torch.float32], device="cuda")
    opt = AdamW(params)
    _set_grads(params, [torch.randn_like(p) for p in params])
    opt.step()
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_foreach_clip_grad_norm_on_cuda(norm_type):
    (t_ref, g_ref), (t_fe, g_fe) = _clip_pair(norm_type, device="cuda")
    if norm_type == math.inf:  # a max: order-free, so bitwise
        assert_bitwise_equal(t_fe, t_ref, name="total inf-norm")
        for i, (a, b) in enumerate(zip(g_ref, g_fe)):
            assert_bitwise_equal(b, a, name=f"clipped grad {i}")
    else:
        # CUDA's _foreach_norm sums squares in another order than vector_norm: a few FP32 ulps
        # (rtol 1e-6 ≈ 8 ulps) on the norm and on the scale applied to the grads.
        torch.testing.assert_close(t_fe, t_ref, rtol=1e-6, atol=0)
        for i, (a, b) in enumerate(zip(g_ref, g_fe)):  # FP32 / FP64 grads
            torch.testing.assert_close(b, a, rtol=1e-6, atol=0, msg=f"clipped grad {i}")
