"""The F&B overlap hook (``overlapped_forward_backward``) and the eager P2P connection set-up.

Oracles:
- toy float64 stages on CPU gloo: DualPipe / DualPipeV through a counting hook that delegates to
  the sequential reference must give the same losses (bitwise) and gradients (within 1e-13) as
  the same schedule without the hook and as the unpartitioned single-process model
  (``tests.parallel.test_schedules.reference``); the hook must be called once per F&B step of
  the schedule's phases (4) and (5), and never with ``overlap=False``;
- the model's own stages (:class:`DeepSeekV3Stage`, float64) through ``PipelineRunner``: hook
  on vs off vs one process;
- ``P2P.connect`` over every pair of 4 ranks finishes (a wrong order would deadlock: the spawn
  helper's timeout) and checks who answered; 0-element payloads round-trip;
- GPU only: the two-stream path of :meth:`DeepSeekV3Stage.overlapped_forward_backward` against
  the sequential reference on a copy of the model.
"""

from __future__ import annotations

import copy

import pytest
import torch

from ptxtrain.parallel import DualPipe, DualPipeV
from ptxtrain.parallel.p2p import P2P, sequential_forward_backward
from tests._spawn import run_gloo
from tests.parallel.test_schedules import (
    Block,
    assert_grads,
    criterion,
    make_batch,
    reference,
)


class HookBlock(Block):
    """The toy stage with an overlap hook that counts its calls and runs the reference."""

    calls = 0

    @classmethod
    def overlapped_forward_backward(cls, *args):
        cls.calls += 1
        return sequential_forward_backward(*args)


def make_stage(s: int, hook: bool) -> Block:
    torch.manual_seed(1000 + s)  # the seeds of test_schedules.make_stage: same weights
    return HookBlock() if hook else Block()


def dualpipe_fb_steps(rank: int, world: int, n: int) -> int:
    """F&B steps of one DualPipe rank: phase (4) pairs and phase (5) (dualpipe.py)."""
    half, k = world // 2, min(rank, world - 1 - rank)
    return 2 * (n - world + k + 1) + (half - k - 1)


def dualpipev_fb_steps(rank: int, world: int, n: int) -> int:
    return 2 * (n - 2 * world + rank + 1) + (world - rank - 1)


def run_dualpipe(rank: int, world: int, n_chunks: int, hook: bool, overlap: bool):
    last = world - 1
    m0, m1 = make_stage(rank, hook), make_stage(last - rank, hook)
    n = n_chunks // 2
    x0, y0 = make_batch(10 * n_chunks, n)
    x1, y1 = make_batch(10 * n_chunks + 1, n)
    labels = {0: (y1,), last: (y0,)}.get(rank, ())
    loss, _ = DualPipe((m0, m1), overlap=overlap).step(
        *{0: (x0,), last: (x1,)}.get(rank, ()),
        num_chunks=n_chunks,
        criterion=criterion if labels else None,
        labels=labels,
    )
    return loss, (m0, m1), reference(world, x0, y0, n), reference(world, x1, y1, n)


def check_dualpipe_hook(rank: int, world: int) -> None:
    last, n_chunks = world - 1, 2 * world + 4
    base_loss, base_mods, _, _ = run_dualpipe(rank, world, n_chunks, hook=False, overlap=True)
    for overlap in (True, False):
        HookBlock.calls = 0
        loss, (m0, m1), ref0, ref1 = run_dualpipe(rank, world, n_chunks, True, overlap)
        what = f"DualPipe PP={world} rank={rank} overlap={overlap}"
        want = dualpipe_fb_steps(rank, world, n_chunks // 2) if overlap else 0
        assert HookBlock.calls == want, f"{what}: hook called {HookBlock.calls}x, want {want}"
        if rank in (0, last):
            ref = ref1 if rank == 0 else ref0
            assert torch.equal(loss, ref[0]) and torch.equal(loss, base_loss), what
        else:
            assert loss is None and base_loss is None, what
        assert_grads(m0, ref0[2][rank], what + " modules[0]")
        assert_grads(m1, ref1[2][last - rank], what + " modules[1]")
        for m, b in zip((m0, m1), base_mods, strict=True):  # hook vs the class without one
            assert_grads(m, [p.grad for p in b.parameters()], what + " vs no hook")


def check_dualpipev_hook(rank: int, world: int) -> None:
    n_chunks = 2 * world + 2
    HookBlock.calls = 0
    m0, m1 = make_stage(rank, True), make_stage(2 * world - 1 - rank, True)
    x, y = make_batch(77, n_chunks)
    loss, _ = DualPipeV((m0, m1)).step(
        *((x,) if rank == 0 else ()),
        num_chunks=n_chunks,
        criterion=criterion if rank == 0 else None,
        labels=(y,) if rank == 0 else (),
    )
    ref_loss, _, ref_grads = reference(2 * world, x, y, n_chunks)
    what = f"DualPipeV R={world} rank={rank}"
    want = dualpipev_fb_steps(rank, world, n_chunks)
    assert HookBlock.calls == want, f"{what}: hook called {HookBlock.calls}x, want {want}"
    if rank == 0:
        assert torch.equal(loss, ref_loss), f"{what}: loss {loss} != {ref_loss}"
    else:
        assert loss is None, what
    assert_grads(m0, ref_grads[rank], what + " modules[0]")
    assert_grads(m1, ref_grads[2 * world - 1 - rank], what + " modules[1]")


def check_connect_and_empty(rank: int, world: int) -> None:
    p2p = P2P(None, torch.device("cpu"))
    p2p.connect(range(world))  # every pair, both ways, in the agreed order
    if rank == 0:
        p2p.send([torch.empty(0, 3), torch.randn(2, dtype=torch.float64)], 1, tag=1)
    elif rank == 1:
        empty, full = p2p.recv(0, tag=1)
        assert empty.shape == (0, 3) and empty.dtype == torch.float32, empty
        assert full.shape == (2,) and full.dtype == torch.float64, full
    p2p.wait_all()


def worker_toy(rank: int, world: int) -> None:
    torch.set_num_threads(1)
    check_connect_and_empty(rank, world)
    check_dualpipe_hook(rank, world)
    check_dualpipev_hook(rank, world)


def test_overlap_hook_toy_stages_pp4():
    run_gloo(worker_toy, 4, timeout=120)


# ---------------------------------------------------------------- the model's stages (PP=2)
_CFG = {
    "dim": 16, "n_layers": 2, "n_dense_layers": 1, "dense_inter_dim": 32, "n_heads": 2,
    "q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
    "v_head_dim": 4, "moe_inter_dim": 8, "n_routed_experts": 4, "n_activated_experts": 2,
    "n_expert_groups": 2, "n_limited_groups": 1, "max_seq_len": 8, "mtp_depth": 0,
    "vocab_size": 64,
}  # fmt: skip
# Float64 stages; the pipeline averages micro-batch means and sums micro-batch gradients in
# another order than one whole-batch backward: differences at float64 rounding (~1e-16
# relative on O(1) values), so 1e-13 still catches a missed or doubled micro-batch (>= 1e-3).
MODEL_TOL = 1e-13


def _model():
    from ptxtrain.model import build_model
    from ptxtrain.model.config import DeepSeekV3Config

    cfg = DeepSeekV3Config.from_dict({**DeepSeekV3Config().to_dict(), **_CFG})
    return build_model(cfg, dtype=torch.float64, seed=3)


class _Grads:
    """The ``optimizer`` argument of ``PipelineRunner.reduce_grads``: plain ``.grad``."""

    @staticmethod
    def grad_for(p):
        return p.grad


def worker_model(rank: int, world: int) -> None:
    from ptxtrain.train.pipeline import PipelineRunner
    from ptxtrain.train.pipeline_stage import DeepSeekV3Stage

    torch.set_num_threads(1)
    calls = [0]
    orig = DeepSeekV3Stage.overlapped_forward_backward

    def counting(cls, *args):
        calls[0] += 1
        return orig(*args)

    DeepSeekV3Stage.overlapped_forward_backward = classmethod(counting)
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, _CFG["vocab_size"], (8, 8), generator=g)
    y = torch.randint(0, _CFG["vocab_size"], (8, 8), generator=g)
    n_chunks = 8
    ref = _model()
    out = ref(x, y)
    out.loss.backward()  # lm_loss + the MoE balance loss, as the pipeline's criterion
    ref_loss = out.lm_loss
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    for overlap in (True, False):
        calls[0] = 0
        model = _model()
        runner = PipelineRunner(model, "dualpipe", n_chunks, overlap=overlap)
        losses = runner.step(x, y)
        runner.reduce_grads(_Grads())
        what = f"PipelineRunner dualpipe rank={rank} overlap={overlap}"
        want = dualpipe_fb_steps(rank, world, n_chunks // 2) if overlap else 0
        assert calls[0] == want, f"{what}: hook called {calls[0]}x, want {want}"
        diff = abs(losses.lm_loss.item() - ref_loss.item())
        assert diff <= MODEL_TOL, f"{what}: lm loss differs by {diff:.2e}"
        mine = {id(p) for p in runner.module.parameters()}
        for name, p in model.named_parameters():
            if id(p) in mine and ref_grads[name] is not None:
                d = (p.grad - ref_grads[name]).abs().max().item()
                assert d <= MODEL_TOL, f"{what}: grad of {name} differs by {d:.2e}"
    # overlap=None: off unless PTXTRAIN_PP_OVERLAP=1 (it measured slower on GPUs, see the doc).
    import os

    for env, want in ((None, False), ("0", False), ("1", True)):
        if env is None:
            os.environ.pop("PTXTRAIN_PP_OVERLAP", None)
        else:
            os.environ["PTXTRAIN_PP_OVERLAP"] = env
        assert PipelineRunner(_model(), "dualpipe", n_chunks).overlap is want, env
    os.environ.pop("PTXTRAIN_PP_OVERLAP", None)
    # A model whose MoE layers share an nvlink EP buffer: DualPipe's two-stream overlap would
    # use it from two streams at once, so it is refused; without overlap, or under 1F1B (which
    # ignores overlap), it is not.
    from types import SimpleNamespace

    nvl = _model()
    nvl.ep_buffer = SimpleNamespace(backend="nvlink")
    with pytest.raises(ValueError, match="nvlink EP buffer"):
        PipelineRunner(nvl, "dualpipe", n_chunks, overlap=True)
    assert not PipelineRunner(nvl, "dualpipe", n_chunks, overlap=False).overlap
    assert PipelineRunner(nvl, "1f1b", n_chunks, overlap=True).overlap


def test_overlap_hook_model_stages_pp2():
    run_gloo(worker_model, 2, timeout=120)


# ---------------------------------------------------------------- single process
def test_malformed_hook_is_rejected():
    class Bad(Block):
        def overlapped_forward_backward(self, *args):  # an instance method: not the interface
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="classmethod or staticmethod"):
        DualPipe((Bad(), Bad()))
    with pytest.raises(TypeError, match="classmethod or staticmethod"):
        DualPipeV((Bad(), Bad()))


@pytest.mark.gpu
def test_model_stage_hook_two_streams_cuda():
    """The CUDA path against the sequential reference, on two copies of one model: chunk A runs
    forward through the last stage (plain, on the current stream), then one F&B step runs the
    forward of chunk B through stage 0 and the backward of A. Same kernels on the same data, so
    outputs and gradients must agree to float32 rounding of reordered atomics (1e-6 relative)."""
    from ptxtrain.train.pipeline_layout import even_layout
    from ptxtrain.train.pipeline_stage import DeepSeekV3Stage, graph_stream, side_stream

    dev = torch.device("cuda")
    base = _model().float().to(dev)
    g = torch.Generator().manual_seed(9)
    ids_b = torch.randint(0, _CFG["vocab_size"], (2, 8), generator=g).to(dev)
    labels_a = torch.randint(0, _CFG["vocab_size"], (2, 8), generator=g).to(dev)
    h_a = torch.randn(2, 8, _CFG["dim"], generator=g).to(dev)
    results = []
    for use_hook in (True, False):
        model = copy.deepcopy(base)
        layout = even_layout(model.config.n_layers, 2)
        s0, s1 = DeepSeekV3Stage(model, 0, layout), DeepSeekV3Stage(model, 1, layout)
        inputs_a = (h_a.clone().requires_grad_(), torch.zeros((), device=dev, requires_grad=True))
        loss_a = s1.loss(*s1(*inputs_a), labels_a)[0]
        fn = DeepSeekV3Stage.overlapped_forward_backward if use_hook else None
        args = (s0, (ids_b,), None, (), s1, loss_a, [], [])
        outs, loss_f = fn(*args) if fn else sequential_forward_backward(*args)
        if use_hook:  # the forward went to the side stream (A's graph is on the current one)
            assert graph_stream(outs[0]) == side_stream(dev)
        torch.cuda.synchronize()
        assert loss_f is None
        grads = [p.grad.clone() for p in s1.parameters() if p.grad is not None]
        results.append((outs[0].detach().clone(), inputs_a[0].grad.clone(), grads))
    (o1, gi1, gp1), (o2, gi2, gp2) = results
    assert torch.allclose(o1, o2, rtol=1e-6, atol=0), "stage 0 outputs differ"
    assert torch.allclose(gi1, gi2, rtol=1e-6, atol=1e-9), "input grads differ"
    assert len(gp1) == len(gp2) > 0
    for a, b in zip(gp1, gp2, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-9), "parameter grads differ"
