"""ptxtrain.optim.AdamW's fused path: flat buffers, hooks, lazy clipping, state dicts, kernels.

On the CPU ``fused=True`` runs the torch reference of the fused update (the per-tensor update on
the flat buffers' views, driven by the device tables' step counts, gradient flags, FP64
learning rates and clip coefficient): every comparison with the per-tensor path is bit for
bit. The Triton kernels run under the interpreter (64-element programs, so parameters span
several full blocks and a tail) and on the GPU, compared within ``KERNEL_TOL``. The GPU tests
also capture clip + step in a CUDA graph and check that neither synchronizes with the host.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import ptxtrain.optim.adamw as adamw_mod
import ptxtrain.optim.fused as fused_mod
from ptxtrain.optim import AdamW, GradInBuffer, grad_ready, mark_grad_ready
from ptxtrain.optim.fused import ALIGN
from ptxtrain.testing.numeric import assert_bitwise_equal
from ptxtrain.train.checkpoint import load_checkpoint, save_checkpoint
from tests.optim.test_adamw import (
    _assert_state_dicts_bitwise,
    _linear,
    _microbatch,
    _mixed_setup,
    _train_mixed,
)
from tests.optim.test_adamw_foreach import _CUDA_TOL, CONFIGS, _gen, _leaves, _run_pair

# The fused path reads FP32 gradient buffers: every config but the one without them.
FUSED_CONFIGS = {k: v for k, v in CONFIGS.items() if v[1].get("fp32_grads", True)}
# Max norms per step: inactive (the random gradients' norm is ~10), then active twice.
CLIP = (100.0, 0.5, 0.3)
# Kernels against the per-tensor path, per dtype (rtol, atol). FP32 / BF16 / FP16 as for the
# foreach path on CUDA (_CUDA_TOL): contracted FMAs, the reciprocal of √(1-β2^t) and the order
# of m/denom·step_size move a result by a few FP32 ulps per step, and a BF16 moment then lands
# on the neighbouring value now and then (one BF16 ulp, 2^-8 relative), which changes the
# next update by ~2^-9 of its size (lr ≤ 1.1e-2: ~2e-7 absolute). Measured under the
# interpreter over 6 seeds x 7 configs x 2 weight decays x 4 steps: masters within 2.4e-7,
# moments within 3e-8 (FP32) or one BF16 ulp, BF16/FP16 weights equal. FP64 parameters are not
# fused, but their gradients are scaled by the clip coefficient, an FP32 value computed from a
# norm that the kernel sums in another order (1 FP32 ulp, ~1e-7 relative): their updates then
# differ by ~1e-7 of an update (measured 5.5e-10), hence atol 1e-8.
KERNEL_TOL = {**_CUDA_TOL, torch.float64: (2.0**-49, 1e-8)}


def _interpreted() -> bool:
    """The kernels were decorated under ``TRITON_INTERPRET=1`` with the exact-cast patch."""
    if not adamw_mod._triton_ok():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    from ptxtrain.optim import triton as kernels
    from ptxtrain.testing.triton_interp import patch_applied

    return isinstance(kernels._adamw_update_kernel, InterpretedFunction) and patch_applied()


def _fused_count(opt: AdamW) -> int:
    return len(opt._slots)


def _fused_pair(config: str, *, steps: int, seed: int, tol=None, device="cpu", **extra):
    """``_run_pair`` of the per-tensor path against ``fused=True`` on ``FUSED_CONFIGS[config]``:
    two groups (lr, betas, eps, decay differ), an lr schedule, clipping off then on (``CLIP``),
    and a third of the parameters without a gradient every other step."""
    dtypes, kwargs = FUSED_CONFIGS[config]
    return _run_pair(
        dtypes,
        device=device,
        steps=steps,
        seed=seed,
        skip=True,
        groups=True,
        other={"fused": True},
        clip=CLIP,
        tol=tol,
        **kwargs,
        **extra,
    )


def _per_tensor_and_fused(seed: int, middle: torch.dtype):
    """Identical BF16 / ``middle`` / BF16 leaves under a per-tensor and a fused AdamW."""
    params_a = _leaves(seed, [torch.bfloat16, middle, torch.bfloat16])
    params_b = [p.detach().clone().requires_grad_() for p in params_a]
    return params_a, params_b, AdamW(params_a, fused=False), AdamW(params_b, fused=True)


# --------------------------------------------------------------------------- the update, CPU
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("config", list(FUSED_CONFIGS))
def test_fused_reference_is_bitwise_the_per_tensor_step(config, weight_decay):
    dtypes = FUSED_CONFIGS[config][0]
    ref, fu, params_ref, params_fu = _fused_pair(
        config, steps=5, seed=len(config), weight_decay=weight_decay
    )
    assert _fused_count(fu) == sum(d != torch.float64 for d in dtypes)  # FP64 stays per-tensor
    counts = [int(fu.state[p]["step"]) for p in params_fu]
    assert counts == [int(ref.state[p]["step"]) for p in params_ref]
    assert counts == [3 if i % 3 == 0 else 5 for i in range(len(dtypes))]  # skipped: no advance


def test_fused_parameters_become_views_of_aligned_flat_buffers():
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
    params = _leaves(30, [*dtypes, torch.float64])  # params[0] is a transposed leaf
    frozen = torch.randn(5, generator=_gen(31)).bfloat16()  # requires no grad
    before = [p.detach().clone() for p in params]
    strides = [p.stride() for p in params]
    opt = AdamW([*params, frozen], fused=True)
    assert params[5] not in opt._slots and frozen not in opt._slots  # FP64, frozen: per-tensor
    assert sorted(str(b.dtype) for b in opt._buckets) == [
        "torch.bfloat16",
        "torch.float16",
        "torch.float32",
    ]
    for i, p in enumerate(params[:5]):
        assert_bitwise_equal(p.detach(), before[i], name=f"param {i} after the move")
        assert p.stride() == strides[i], f"param {i} kept its layout"
        bucket = opt._slots[p].bucket
        assert p.untyped_storage().data_ptr() == bucket.param.untyped_storage().data_ptr()
        assert p.storage_offset() % ALIGN == 0
        g = p.main_grad
        assert g.dtype == torch.float32 and g.shape == p.shape and g.stride() == p.stride()
        assert g.untyped_storage().data_ptr() == bucket.grad.untyped_storage().data_ptr()
        assert g.storage_offset() == p.storage_offset()
        assert not opt.grad_ready(p) and opt.grad_for(p) is None  # no gradient yet
    assert not params[0].is_contiguous()
    assert not hasattr(params[5], "main_grad")


def test_fused_microbatches_and_hooks_match_per_tensor():
    # A BF16 Linear and an FP32 LayerNorm in two groups, 2 micro-batches per step, clipping,
    # a cosine lr: the hooks fill the flat FP32 buffers (first copy, then add).
    model_a, groups_a = _mixed_setup(40)
    model_b, groups_b = _mixed_setup(40)
    opt_a, opt_b = AdamW(groups_a, lr=1e-2, fused=False), AdamW(groups_b, lr=1e-2, fused=True)
    assert _fused_count(opt_b) == 4
    _train_mixed(model_a, opt_a, range(4))
    _train_mixed(model_b, opt_b, range(4))
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert_bitwise_equal(pb.detach(), pa.detach(), name=name)
    _assert_state_dicts_bitwise(opt_a.state_dict(), opt_b.state_dict())
    x, y = _microbatch(41)
    for model in (model_a, model_b):
        (model(x.bfloat16()).float() - y).pow(2).mean().backward()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert isinstance(pb.grad, GradInBuffer), "the hook moves every fused gradient, FP32 too"
        assert opt_b.grad_for(pb) is pb.main_grad
        assert_bitwise_equal(pb.main_grad, opt_a.grad_for(pa).float(), name="FP32 gradient")


def test_fused_zero_grad_to_zeros_and_to_none():
    model_a, groups_a = _mixed_setup(42)
    model_b, groups_b = _mixed_setup(42)
    opt_a, opt_b = AdamW(groups_a, lr=1e-2, fused=False), AdamW(groups_b, lr=1e-2, fused=True)
    pairs = ((model_a, opt_a), (model_b, opt_b))

    def backward(seed):
        x, y = _microbatch(seed)
        for model, _ in pairs:
            (model(x.bfloat16()).float() - y).pow(2).mean().backward()

    def same(where):
        for pa, pb in zip(model_a.parameters(), model_b.parameters()):
            assert_bitwise_equal(pb.detach(), pa.detach(), name=f"{where}: param")
        _assert_state_dicts_bitwise(opt_a.state_dict(), opt_b.state_dict())

    backward(420)
    for _, opt in pairs:
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients exist and are zero
    for pb in model_b.parameters():
        assert opt_b.grad_ready(pb) and torch.count_nonzero(opt_b.grad_for(pb)) == 0
    for _, opt in pairs:
        opt.step()  # a step on zero gradients still moves the moments and the weights
    same("zero gradients")
    backward(421)  # adds into the zeroed buffers
    for _, opt in pairs:
        opt.step()
        opt.zero_grad(set_to_none=True)
    stale = [pb.main_grad.clone() for pb in model_b.parameters()]
    for pb, s in zip(model_b.parameters(), stale):
        assert opt_b.grad_for(pb) is None and not opt_b.grad_ready(pb)
        assert torch.count_nonzero(s) > 0  # not zeroed: the next gradient overwrites it
    assert opt_b.state_bytes()["grad"] == 4 * sum(p.numel() for p in model_b.parameters())
    backward(422)
    for _, opt in pairs:
        opt.step()
    same("after set_to_none")


def test_fused_clip_is_lazy_and_grad_for_applies_it():
    # Low-precision parameters: a second p.grad set by hand is added into the FP32 buffer on
    # both paths (an unhooked FP32 parameter's p.grad would just be replaced on the other).
    params_a, params_b, opt_a, opt_b = _per_tensor_and_fused(43, torch.float16)
    g = _gen(44)
    grads = [torch.randn(p.shape, generator=g).to(p.dtype) * 3 for p in params_a]
    more = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params_a]
    for ps in (params_a, params_b):
        for p, grad in zip(ps, grads):
            p.grad = grad.clone()
    totals = [opt.clip_grad_norm_(0.5) for opt in (opt_a, opt_b)]
    assert float(totals[0]) > 0.5  # clipping is active
    assert_bitwise_equal(totals[1], totals[0], name="total norm")
    for p, grad in zip(params_b, grads):  # nothing multiplied yet: one pass saved
        assert_bitwise_equal(p.main_grad, grad.float(), name="raw buffer")
    assert opt_b._scale_pending
    # A later gradient (another backward) is added after the pending coefficient is applied.
    for ps in (params_a, params_b):
        for p, grad in zip(ps, more):
            p.grad = grad.clone()
    for pa, pb in zip(params_a, params_b):
        assert_bitwise_equal(opt_b.grad_for(pb), opt_a.grad_for(pa).float(), name="clipped")
    assert not opt_b._scale_pending
    for opt in (opt_a, opt_b):
        opt.clip_grad_norm_(0.1)
        opt.step()
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        assert_bitwise_equal(pb.detach(), pa.detach(), name=f"param {i}")
        for key, value in opt_a.state[pa].items():
            assert_bitwise_equal(opt_b.state[pb][key], value, name=f"{key} of param {i}")


def test_main_grad_written_by_a_layer_and_mark_grad_ready():
    params_a, params_b, opt_a, opt_b = _per_tensor_and_fused(45, torch.float32)
    g = _gen(46)
    for step in range(3):
        for micro in range(2):
            grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params_a]
            for i, (pa, pb, grad) in enumerate(zip(params_a, params_b, grads)):
                if i == 1 and step == 1:
                    continue  # no gradient for this parameter in this step: skipped
                # Accumulated as autograd would: hooked BF16 p.grad is folded (and freed) by
                # grad_for, the unhooked FP32 p.grad sums in place.
                held = pa.grad is None or isinstance(pa.grad, GradInBuffer)
                pa.grad = grad.clone() if held else pa.grad + grad
                opt_a.grad_for(pa)
                # What a wgrad GEMM with D = beta·D + dW does (beta 0 on fresh buffers).
                assert grad_ready(pb) == (micro == 1)
                if grad_ready(pb):
                    pb.main_grad.add_(grad)
                else:
                    pb.main_grad.copy_(grad)  # over stale values after zero_grad
                mark_grad_ready(pb)
        for opt in (opt_a, opt_b):
            opt.step()
            opt.zero_grad()
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        assert_bitwise_equal(pb.detach(), pa.detach(), name=f"param {i}")
        assert int(opt_b.state[pb]["step"]) == (2 if i == 1 else 3)
    stray = torch.randn(3, generator=g).requires_grad_()
    with pytest.raises(ValueError, match="mark_grad_ready"):
        opt_b.mark_grad_ready(stray)
    with pytest.raises(ValueError, match="grad_ready"):
        grad_ready(stray)
    with pytest.raises(ValueError, match="mark_grad_ready"):
        mark_grad_ready(params_a[0])  # held by an AdamW, but not in flat buffers


def test_set_lr_writes_the_groups_and_the_device_copy():
    params = _leaves(47, [torch.bfloat16, torch.float32, torch.bfloat16])
    opt = AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-4}], fused=True)
    (table,) = opt._tables.values()
    opt.set_lr(0.25)
    assert [g["lr"] for g in opt.param_groups] == [0.25, 0.25]
    assert table.hyper[:, 0].tolist() == [0.25, 0.25]
    opt.set_lr(1e-3 / 3, group=1)  # FP64 on the device: the very Python float
    assert table.hyper[:, 0].tolist() == [0.25, 1e-3 / 3]
    for lr, group, exc in ((-1.0, None, ValueError), ("1", None, TypeError)):
        with pytest.raises(exc, match="lr"):
            opt.set_lr(lr, group)
    for group, exc in ((2, ValueError), ("0", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="group"):
            opt.set_lr(0.1, group)


def test_fused_state_dict_round_trip_and_cross_loading():
    model_a, groups_a = _mixed_setup(48)
    opt_a = AdamW(groups_a, lr=1e-2, fused=True)
    _train_mixed(model_a, opt_a, range(3))
    saved = copy.deepcopy(opt_a.state_dict())

    def resumed(fused: bool):
        model, groups = _mixed_setup(999)  # another init: all must come from the state dicts
        model.load_state_dict(model_a.state_dict())
        opt = AdamW(groups, lr=5.0, fused=fused)
        opt.load_state_dict(saved)
        return model, opt

    model_b, opt_b = resumed(True)
    _assert_state_dicts_bitwise(saved, opt_b.state_dict())
    for p in model_b.parameters():  # the loaded state lives in the flat buffers
        views = opt_b._slots[p].bucket.views[opt_b._slots[p].index]
        assert opt_b.state[p]["exp_avg"] is views["exp_avg"]
    model_c, opt_c = resumed(False)  # the per-tensor path reads the same state dict
    for model, opt in ((model_a, opt_a), (model_b, opt_b), (model_c, opt_c)):
        _train_mixed(model, opt, range(3, 5))
    model_d, groups_d = _mixed_setup(998)
    model_d.load_state_dict(model_c.state_dict())
    opt_d = AdamW(groups_d, lr=1e-2, fused=True)
    opt_d.load_state_dict(opt_c.state_dict())  # and back into the fused path
    for model, opt in ((model_a, opt_a), (model_b, opt_b), (model_d, opt_d)):
        _train_mixed(model, opt, range(5, 6))
    _assert_state_dicts_bitwise(opt_a.state_dict(), opt_b.state_dict())
    _assert_state_dicts_bitwise(opt_a.state_dict(), opt_d.state_dict())
    for (name, pa), pb, pd in zip(
        model_a.named_parameters(), model_b.parameters(), model_d.parameters()
    ):
        assert_bitwise_equal(pb.detach(), pa.detach(), name=name)
        assert_bitwise_equal(pd.detach(), pa.detach(), name=name)
    _assert_state_dicts_bitwise(saved, copy.deepcopy(saved))  # saved was never aliased


def test_fused_checkpoint_save_and_resume(tmp_path):
    # Six steps straight, against three + checkpoint + three through ptxtrain.train.checkpoint
    # (the flat-buffer views are written as their own tensors).
    model_a, groups_a = _mixed_setup(49)
    opt_a = AdamW(groups_a, lr=1e-2, fused=True)
    _train_mixed(model_a, opt_a, range(6))
    for writer_fused in (True, False):
        run = tmp_path / f"run_{writer_fused}"
        model_w, groups_w = _mixed_setup(49)
        opt_w = AdamW(groups_w, lr=1e-2, fused=writer_fused)
        _train_mixed(model_w, opt_w, range(3))
        save_checkpoint(run, model=model_w, optimizer=opt_w, step=3, config={"n": 1})
        for reader_fused in (True, False):
            model_r, groups_r = _mixed_setup(7)
            opt_r = AdamW(groups_r, lr=1e-2, fused=reader_fused)
            load_checkpoint(run, model=model_r, optimizer=opt_r, restore_rng=False)
            _train_mixed(model_r, opt_r, range(3, 6))
            tag = f"written fused={writer_fused}, read fused={reader_fused}"
            for (name, pa), pr in zip(model_a.named_parameters(), model_r.parameters()):
                assert_bitwise_equal(pr.detach(), pa.detach(), name=f"{tag}: {name}")
            _assert_state_dicts_bitwise(opt_a.state_dict(), opt_r.state_dict())


def test_fused_state_bytes_and_add_param_group_after_steps():
    model = _linear(50, torch.bfloat16)
    head = _linear(51, torch.bfloat16, d_in=10, d_out=3)
    ref_model, ref_head = _linear(50, torch.bfloat16), _linear(51, torch.bfloat16, 10, 3)
    opt = AdamW(model.parameters(), lr=1e-2, fused=True)
    ref = AdamW(ref_model.parameters(), lr=1e-2, fused=False)
    n = sum(p.numel() for p in model.parameters())

    def train(seed, with_head: bool):
        x, y = _microbatch(seed, d_out=3 if with_head else 10)
        for m, h, o in ((model, head, opt), (ref_model, ref_head, ref)):
            out = m(x.bfloat16())
            (h(out) if with_head else out).float().sub(y).pow(2).mean().backward()
            o.step()
            o.zero_grad()

    train(52, with_head=False)
    got = opt.state_bytes()
    assert (got["param"], got["grad"], got["master"]) == (2 * n, 4 * n, 4 * n)
    assert (got["exp_avg"], got["exp_avg_sq"], got["other"]) == (2 * n, 2 * n, 4 * 2)
    assert got["total"] - got["other"] == 14 * n  # 2 + 4 + 4 + 2 + 2, as the per-tensor path
    # A second group on the same device grows the device table: the step views move with it.
    opt.add_param_group({"params": head.parameters(), "lr": 3e-3})
    ref.add_param_group({"params": ref_head.parameters(), "lr": 3e-3})
    (table,) = opt._tables.values()
    for p in model.parameters():
        assert opt.state[p]["step"].untyped_storage().data_ptr() == (
            table.steps.untyped_storage().data_ptr()
        )
    for seed in (53, 54):
        train(seed, with_head=True)
    for pa, pb in zip((*ref_model.parameters(), *ref_head.parameters()), opt._slots):
        assert_bitwise_equal(pb.detach(), pa.detach(), name="param")
    assert [int(opt.state[p]["step"]) for p in opt._slots] == [3, 3, 2, 2]


@pytest.mark.parametrize("fused", ["yes", 1, 0.0])
def test_fused_must_be_none_or_bool(fused):
    with pytest.raises(TypeError, match="fused"):
        AdamW([torch.randn(3, generator=_gen(55)).requires_grad_()], fused=fused)


def test_fused_needs_fp32_grads_and_is_off_by_default_on_cpu():
    p = torch.randn(3, generator=_gen(56)).bfloat16().requires_grad_()
    with pytest.raises(ValueError, match="fp32_grads"):
        AdamW([p], fused=True, fp32_grads=False)
    opt = AdamW([p])  # fused=None: the fused path is for CUDA parameters
    assert not opt._buckets and not hasattr(p, "main_grad")


# --------------------------------------------------------------------------- Triton kernels
interpreted_only = pytest.mark.skipif(
    not _interpreted(),
    reason="needs the Triton interpreter (TRITON_INTERPRET=1, set by tests/conftest.py)",
)
KERNEL_CONFIGS = [c for c in FUSED_CONFIGS if c not in ("fp64_params",)]


@interpreted_only
@pytest.mark.parametrize("config", KERNEL_CONFIGS)
def test_triton_kernels_match_per_tensor_under_interpreter(config, monkeypatch):
    monkeypatch.setattr(fused_mod, "default_impl", lambda device: "triton")
    monkeypatch.setattr(adamw_mod, "_FUSED_BLOCK", 64)  # full blocks and tails at test sizes
    dtypes = FUSED_CONFIGS[config][0]
    _, fu, _, params = _fused_pair(config, steps=4, seed=60 + len(config), tol=KERNEL_TOL)
    assert {b.table.impl for b in fu._buckets} == {"triton"}
    assert [int(fu.state[p]["step"]) for p in params] == [
        2 if i % 3 == 0 else 4 for i in range(len(dtypes))
    ]


@interpreted_only
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_triton_norm_is_nan_when_a_gradient_is(norm_type, monkeypatch):
    monkeypatch.setattr(fused_mod, "default_impl", lambda device: "triton")
    monkeypatch.setattr(adamw_mod, "_FUSED_BLOCK", 64)
    params = _leaves(70, [torch.bfloat16, torch.bfloat16])
    opt = AdamW(params, fused=True)
    grads = [torch.randn(p.shape, generator=_gen(71)).to(p.dtype) for p in params]
    grads[1].view(-1)[0] = math.nan
    for p, g in zip(params, grads):
        p.grad = g
    assert math.isnan(float(opt.clip_grad_norm_(1.0, norm_type)))
    with pytest.raises(RuntimeError, match="non-finite"):
        opt.clip_grad_norm_(1.0, norm_type, error_if_nonfinite=True)


_COMPILE_SCRIPT = """
import ptxtrain.optim.triton as ot

ptrs = {"w_ptr": "*fp32", "p_ptr": "*bf16", "g_ptr": "*fp32", "m_ptr": "*bf16", "v_ptr": "*bf16",
        "start_ptr": "*i64", "len_ptr": "*i32", "param_ptr": "*i32", "flag_ptr": "*i32",
        "scal_ptr": "*fp32", "scale_ptr": "*fp32"}
kernel = ot._adamw_update_kernel
consts = dict(MODE=1, BLOCK=2048, START_MULTIPLE=ot._START_MULTIPLE)
sig = {n: ptrs[n] for n in kernel.arg_names if n not in consts}
sig.update({n: "constexpr" for n in consts})
attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in ptrs}
compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=target,
                          options={"num_warps": 4})
ptx = compiled.asm["ptx"]
emit({
    "ld": re.findall(r"ld\\.global[.\\w:]*", ptx),
    "st": re.findall(r"st\\.global[.\\w:]*", ptx),
    "sqrt": sorted(set(re.findall(r"sqrt\\.[\\w.]+", ptx))),
    "div": sorted(set(re.findall(r"div\\.[\\w.]+", ptx))),
    "shared": len(re.findall(r"\\.shared", ptx)),
    **sass_info(compiled.asm["cubin"]),
})
"""


def test_update_kernel_compiles_to_vector_accesses_for_sm90(tmp_path):
    from tests._sm90 import run_sm90_script

    r = run_sm90_script(_COMPILE_SCRIPT, tmp_path)
    # Full blocks: master and gradient in 16-byte vectors (4 per thread each), BF16 weight
    # (first step) and moments in 8-byte vectors: 8 + 12 loads; stores 4 + 12.
    assert sum(".v4.b32" in op for op in r["ld"]) == 8, r["ld"]
    assert sum(".v2.b32" in op for op in r["ld"]) == 12, r["ld"]
    assert sum(".v4.b32" in op for op in r["st"]) == 4 and sum(".v2." in op for op in r["st"]) == 12
    # One layout for every tensor: no conversion through shared memory.
    assert r["shared"] == 0
    # IEEE square root and division only, never the approximate instructions.
    assert r["sqrt"] == ["sqrt.rn.f32"] and r["div"] == ["div.rn.f32"], r
    if "local" in r:
        assert r["local"] == 0 and r["stack"] == 0  # no spills


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("config", list(FUSED_CONFIGS))
def test_fused_kernels_match_per_tensor_on_cuda(config):
    _, fu, _, _ = _fused_pair(config, steps=5, seed=80 + len(config), tol=KERNEL_TOL, device="cuda")
    assert all(b.table.impl == "triton" for b in fu._buckets)


def _cuda_params(seed: int, shapes, dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = _gen(seed)
    return [
        (torch.randn(s, generator=g) * 0.1).to(device="cuda", dtype=dtype).requires_grad_()
        for s in shapes
    ]


# Many full 2048-element blocks and tails, a bucket per dtype.
BIG_SHAPES = [(1000, 1000), (4097,), (3, 2049), (7168,), (1,)]


@pytest.mark.gpu
def test_fused_kernels_on_large_tensors_on_cuda():
    params_a = _cuda_params(81, BIG_SHAPES) + _cuda_params(82, BIG_SHAPES[:2], torch.float32)
    params_b = [p.detach().clone().requires_grad_() for p in params_a]
    opt_a = AdamW(params_a, fused=False, foreach=False)  # the per-tensor path
    opt_b = AdamW(params_b)  # fused: the CUDA default
    g = _gen(83)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=g).to("cuda", p.dtype) for p in params_a]
        totals = []
        for ps, opt in ((params_a, opt_a), (params_b, opt_b)):
            for p, grad in zip(ps, grads):
                p.grad = grad.clone()
            totals.append(opt.clip_grad_norm_(100.0))
            opt.step()
            opt.zero_grad()
        # FP32 sums of up to 10^6 squares in two orders (torch's reductions per tensor; here
        # 2048-element blocks, then FP64 across blocks): each within ~log2(n)·2^-24 ≈ 1.2e-6
        # of the exact sum, the norms within half of that each: rtol 2e-6.
        torch.testing.assert_close(totals[1], totals[0], rtol=2e-6, atol=0)
    for i, (pa, pb) in enumerate(zip(params_a, params_b)):
        rtol, atol = KERNEL_TOL[pa.dtype]
        if pa.dtype == torch.float32:
            # The clip coefficients differ by ~1e-6 (the norms above); where an element's m is
            # near 0 (its gradients nearly cancelled) Adam's m/√v magnifies that: measured up to
            # 0.4% of one update on an H200. Bound: 1% of the 3 updates of size lr = 1e-3.
            atol = 3e-5
        where = f"param {i} ({pa.dtype}, {tuple(pa.shape)})"
        torch.testing.assert_close(pb, pa, rtol=rtol, atol=atol, msg=lambda m, w=where: f"{w}: {m}")
        for key, value in opt_a.state[pa].items():
            rtol, atol = (0, 0) if key == "step" else KERNEL_TOL[value.dtype]
            got = opt_b.state[pb][key]
            torch.testing.assert_close(got.cpu(), value.cpu(), rtol=rtol, atol=atol, msg=key)


@pytest.mark.gpu
def test_fused_is_the_default_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(AdamW, "_update_one", lambda *a: calls.append("one"))
    monkeypatch.setattr(AdamW, "_update_foreach", lambda *a: calls.append("foreach"))
    params = _cuda_params(84, [(64, 48), (48,)]) + _cuda_params(85, [(7,)], torch.float32)
    before = [p.detach().clone() for p in params]
    opt = AdamW(params)
    assert all(p in opt._slots for p in params)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert calls == []
    assert all(not torch.equal(p.detach(), b) for p, b in zip(params, before))


def _feed(opt: AdamW, params, grads) -> None:
    """What a backward pass leaves: fresh gradients in the flat buffers, flags set."""
    opt.zero_grad(set_to_none=True)
    for p, g in zip(params, grads):
        p.main_grad.copy_(g)
        opt.mark_grad_ready(p)


@pytest.mark.gpu
def test_cuda_graph_of_clip_and_step_replays_like_eager():
    shapes = [(300, 200), (4096,), (3, 5), ()]

    def build():
        params = _cuda_params(86, shapes) + _cuda_params(87, shapes[:2], torch.float32)
        groups = [{"params": params[::2]}, {"params": params[1::2], "weight_decay": 0.0}]
        return params, AdamW(groups, lr=1e-2)

    (pa, opt_a), (pb, opt_b) = build(), build()  # a: CUDA graph, b: eager
    g = _gen(88)
    grads = [[torch.randn(p.shape, generator=g).to("cuda") * (1 + k) for p in pa] for k in range(6)]
    lrs = [1e-2 * (0.5 + 0.5 * math.cos(k / 2)) for k in range(6)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, creates the state
        for k in range(2):
            for params, opt in ((pa, opt_a), (pb, opt_b)):
                _feed(opt, params, grads[k])
                opt.set_lr(lrs[k])
                opt.clip_grad_norm_(5.0)
                opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    _feed(opt_a, pa, grads[2])
    opt_a.set_lr(lrs[2])
    with torch.cuda.graph(graph):
        total_a = opt_a.clip_grad_norm_(5.0)
        opt_a.step()
    for k in range(2, 6):
        if k > 2:
            _feed(opt_a, pa, grads[k])
            opt_a.set_lr(lrs[k])  # outside the graph: the captured kernels read the device copy
        graph.replay()
        _feed(opt_b, pb, grads[k])
        opt_b.param_groups[0]["lr"] = lrs[k]  # eager: picked up by step itself
        opt_b.param_groups[1]["lr"] = lrs[k]
        total_b = opt_b.clip_grad_norm_(5.0)
        opt_b.step()
        # Same kernels on the same inputs: bit for bit.
        assert_bitwise_equal(total_a, total_b, name=f"replay {k}: total norm")
        assert float(total_b) > 5.0  # clipping is active
        for i, (p, q) in enumerate(zip(pa, pb)):
            assert_bitwise_equal(p.detach(), q.detach(), name=f"replay {k}: param {i}")
            for key, value in opt_b.state[q].items():
                assert_bitwise_equal(opt_a.state[p][key], value, name=f"replay {k}: {key} {i}")
    assert int(opt_a.state[pa[0]]["step"]) == 6


@pytest.mark.gpu
def test_clip_and_step_do_not_synchronize():
    lin = torch.nn.Linear(256, 512, device="cuda", dtype=torch.bfloat16)
    norm = torch.nn.LayerNorm(512, device="cuda")  # FP32 parameters: a second bucket
    opt = AdamW([*lin.parameters(), *norm.parameters()], lr=1e-3)
    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)

    def backward():
        norm(lin(x).float()).square().mean().backward()

    backward()
    opt.clip_grad_norm_(0.1)
    opt.step()  # compiles the kernels and creates the state first
    opt.zero_grad()
    backward()
    opt.param_groups[0]["lr"] = 2e-3  # picked up with a fill, not a copy
    torch.cuda.set_sync_debug_mode("error")
    try:
        total = opt.clip_grad_norm_(0.1)
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert total.device.type == "cuda" and total.dim() == 0
    assert len(opt._buckets) == 2 and int(opt.state[lin.weight]["step"]) == 2
