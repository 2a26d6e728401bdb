"""One ``ptxtrain.ep.Buffer`` shared by every MoE layer of a model (CPU, gloo, 2 ranks).

Oracle: the same model with one Buffer per layer (the behaviour before sharing). A dispatch keeps
nothing on the Buffer (its layout lives in the handle), so sharing must not change a single bit:
losses and gradients are compared with ``torch.equal`` over two steps with fresh random tokens.
Also the argument errors of ``MoE.enable_expert_parallel`` / ``DeepSeekV3.enable_expert_parallel``
and the ``--ep-backend nvlink`` refusals of ``ptxtrain train`` (before any communication).
On 2 and 4 GPUs (``multigpu``): the model with one shared NVLink Buffer trains bit for bit like
the same model on the NCCL all_to_all backend, backward included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ptxtrain.cli import _train_args_from as train_args_from
from ptxtrain.cli import build_parser, main
from ptxtrain.ep import Buffer
from ptxtrain.model import build_model, get_preset
from ptxtrain.model.deepseek import ep_nvl_bytes
from ptxtrain.moe.layer import MoE
from ptxtrain.train import TrainArgs, TrainConfigError, train
from tests._spawn import run_dist, run_gloo

# tiny preset (8 routed experts top-2, 3 MoE layers + the MTP block's) at a small width: every
# rank holds 4 experts of each of the 4 MoE layers.
OVERRIDES = dict(dim=64, moe_inter_dim=32, dense_inter_dim=96, n_heads=2, vocab_size=64)
BATCH, SEQ = 2, 12


def _model(seed: int = 3):
    config = type(get_preset("tiny")).from_dict({**get_preset("tiny").to_dict(), **OVERRIDES})
    return build_model(config, dtype=torch.float32, seed=seed)


def _steps(
    model, rank: int, steps: int = 2, device: str = "cpu"
) -> list[tuple[torch.Tensor, dict]]:
    """Forward + backward + an SGD update per step on fresh random tokens of this rank; the
    loss and the gradients of every step."""
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1), generator=gen)
        ids = ids.to(device)
        res = model(ids[:, :-1], labels=ids[:, 1:])
        model.zero_grad(set_to_none=True)
        res.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.sub_(0.1 * p.grad)
        model.update_router_biases()  # collective: the global load on both models alike
        out.append((res.loss.detach(), grads))
    return out


def _shared_worker(rank: int, world: int) -> None:
    shared, per_layer = _model(), _model()
    shared.enable_expert_parallel()
    layers = shared.moe_layers()
    assert len(layers) == 4 and shared.mtp is not None  # 3 main MoE layers + the MTP block's
    assert isinstance(shared.ep_buffer, Buffer) and shared.ep_buffer.backend == "all_to_all"
    assert all(m.ep_buffer is shared.ep_buffer for m in layers)
    assert all(m.experts.expert_offset == rank * 4 for m in layers)

    # The reference: one Buffer per layer, as each layer made before sharing.
    for m in per_layer.moe_layers():
        m.enable_expert_parallel()
    per_layer.ep_group, per_layer.ep_size = dist.group.WORLD, world  # (what the model call sets)
    assert len({id(m.ep_buffer) for m in per_layer.moe_layers()}) == 4

    got, want = _steps(shared, rank), _steps(per_layer, rank)
    for step, ((loss_s, g_s), (loss_p, g_p)) in enumerate(zip(got, want, strict=True)):
        # Bitwise: the same ops in the same order; only which Buffer object carries them differs.
        assert torch.equal(loss_s, loss_p), f"{rank=} {step=}: {loss_s} != {loss_p}"
        assert g_s.keys() == g_p.keys()
        assert any(".experts.w1" in n for n in g_s)  # the routed experts got gradients
        for name in g_s:
            assert torch.equal(g_s[name], g_p[name]), f"{rank=} {step=} {name}"
    assert not torch.equal(got[0][0], got[1][0])  # the second step saw other tokens / weights

    _argument_errors(rank, world)


def _argument_errors(rank: int, world: int) -> None:
    sub = dist.new_group(list(range(world)))  # the same ranks, another group object
    buf = Buffer()
    # Layer level: a non-Buffer, a Buffer of another group (either way round).
    with pytest.raises(TypeError, match=r"buffer must be a ptxtrain\.ep\.Buffer or None, got dict"):
        MoE(32, 16, 8, 2).enable_expert_parallel(buffer={})
    with pytest.raises(ValueError, match=r"buffer\.group must be the expert-parallel group"):
        MoE(32, 16, 8, 2).enable_expert_parallel(sub, buffer=buf)
    with pytest.raises(ValueError, match=r"buffer\.group must be the expert-parallel group"):
        MoE(32, 16, 8, 2).enable_expert_parallel(buffer=Buffer(sub))
    with pytest.raises(ValueError, match="n_routed_experts=3 must be divisible"):
        MoE(32, 16, 3, 1).enable_expert_parallel(buffer=buf)
    # None and the world group name the same group; a failed call leaves the layer as it was.
    moe = MoE(32, 16, 8, 2)
    moe.enable_expert_parallel(dist.group.WORLD, buffer=buf)
    assert moe.ep_buffer is buf and moe.experts.num_local_experts == 8 // world
    moe2 = MoE(32, 16, 8, 2)
    moe2.enable_expert_parallel(sub, buffer=Buffer(sub))
    assert moe2.ep_size == world

    # Model level: unknown backend, bad max_tokens, nvlink on gloo; nothing changes on failure.
    model = _model()
    with pytest.raises(ValueError, match="backend must be one of"):
        model.enable_expert_parallel(backend="nccl")
    with pytest.raises(ValueError, match="max_tokens"):
        model.enable_expert_parallel(max_tokens=0)
    with pytest.raises(ValueError, match=r"backend='nvlink' needs an NCCL process group.*'gloo'"):
        model.enable_expert_parallel(backend="nvlink", max_tokens=64)
    assert model.ep_group is None and model.ep_buffer is None and model.ep_size == 1
    assert all(m.ep_buffer is None for m in model.moe_layers())
    model.enable_expert_parallel(sub)
    assert model.ep_buffer.group is sub and all(
        m.ep_buffer is model.ep_buffer for m in model.moe_layers()
    )


def test_moe_layers_share_one_buffer_bitwise_like_per_layer_buffers():
    run_gloo(_shared_worker, 2, timeout=120)


def _nvlink_worker(rank: int, world: int) -> None:
    """The model on GPUs with ONE shared NVLink Buffer for all its MoE layers (forward and the
    backward's dispatch/combine) against the same model on the NCCL all_to_all backend."""
    nvl, a2a = _model().cuda(), _model().cuda()
    nvl.enable_expert_parallel(backend="nvlink", max_tokens=BATCH * SEQ)
    a2a.enable_expert_parallel(backend="all_to_all")
    assert nvl.ep_buffer.backend == "nvlink"
    assert all(m.ep_buffer is nvl.ep_buffer for m in nvl.moe_layers())
    got = _steps(nvl, rank, steps=3, device="cuda")
    want = _steps(a2a, rank, steps=3, device="cuda")
    nvl.ep_buffer.check_errors()
    for step, ((loss_n, g_n), (loss_a, g_a)) in enumerate(zip(got, want, strict=True)):
        # Both backends deliver the same rows to the same slots and combine in the same order
        # (tests/ep/test_nvlink.py checks that bit for bit), and the rest of the step runs the
        # same kernels on the same inputs: equal to the last bit.
        assert torch.equal(loss_n, loss_a), f"{rank=} {step=}: {loss_n} != {loss_a}"
        assert g_n.keys() == g_a.keys() and any(".experts.w1" in n for n in g_n)
        for name in g_n:
            assert torch.equal(g_n[name], g_a[name]), f"{rank=} {step=} {name}"
    assert not torch.equal(got[0][0], got[1][0])
    dist.barrier()  # no rank frees the symmetric buffer while a peer may still write to it


@pytest.mark.multigpu
@pytest.mark.parametrize("world", [2, 4])
def test_shared_nvlink_buffer_trains_like_all_to_all(world):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    run_dist(_nvlink_worker, world, timeout=300.0, backend="nccl")


def test_ep_nvl_bytes_sizes_the_largest_row():
    config = get_preset("small")  # H = 768, k = 4
    h, k, default = config.dim, config.n_activated_experts, ep_nvl_bytes(config, 1, 2)
    assert default == 1 << 30  # the Buffer's default when the hint fits
    big = 1 << 20  # tokens per rank: far past the default
    got = ep_nvl_bytes(config, big, 4)
    # The row sizes of Buffer.nvl_bytes_hint's docstring: the BF16 dispatch row is the largest.
    bf16_dispatch = Buffer.nvl_bytes_hint(big, 2 * h + 12 * k + 8, 4)
    fp8_dispatch = Buffer.nvl_bytes_hint(big, h + 4 * -(-h // 128) + 12 * k + 8, 4)
    combine = Buffer.nvl_bytes_hint(big, 2 * h, 4)
    assert got == bf16_dispatch and got > fp8_dispatch and got > combine
    f64 = ep_nvl_bytes(config, big, 4, torch.float64)
    assert f64 == Buffer.nvl_bytes_hint(big, 8 * h + 16 * k + 8, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        ep_nvl_bytes(config, 0, 2)
    with pytest.raises(TypeError, match="dtype"):
        ep_nvl_bytes(config, 1, 2, torch.int32)


def test_cli_ep_backend_flag_and_refusals(tmp_path, capsys, monkeypatch):
    a = train_args_from(build_parser().parse_args(["train", "--ep", "2", "--ep-backend", "nvlink"]))
    assert (a.ep, a.ep_backend) == (2, "nvlink")
    assert train_args_from(build_parser().parse_args(["train"])).ep_backend == "all_to_all"
    with pytest.raises(TrainConfigError, match="--ep-backend must be one of"):
        TrainArgs(ep=2, ep_backend="nccl").validate()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = ["--out", str(tmp_path), "--device", "cpu", "--no-progress"]
    assert main(["train", "--ep-backend", "nvlink", *out]) == 2  # no expert parallelism
    assert "--ep-backend nvlink" in capsys.readouterr().err
    # CPU: refused before the process group (torchrun's variables, no group) or any step.
    for var, value in dict(RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, MASTER_PORT=29500).items():
        monkeypatch.setenv(var, str(value))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert main(["train", "--ep", "2", "--ep-backend", "nvlink", *out]) == 2
    err = capsys.readouterr().err
    assert "--ep-backend nvlink needs CUDA GPUs" in err and "got device 'cpu'" in err
    assert not dist.is_initialized() and not (tmp_path / "metrics.jsonl").exists()


def test_train_refuses_nvlink_with_pp_overlap(tmp_path, monkeypatch):
    # A CUDA device as far as the argument checks go (none is touched before the refusal).
    monkeypatch.setattr("ptxtrain.train.loop.resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setenv("PTXTRAIN_PP_OVERLAP", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kw = dict(pp=2, ep=2, mtp=False, ep_backend="nvlink", out=str(tmp_path), progress=False)
    for schedule in ("dualpipe", "dualpipev"):
        with pytest.raises(TrainConfigError, match="PTXTRAIN_PP_OVERLAP=1"):
            train(TrainArgs(schedule=schedule, **kw))
    # Without the overlap (or with 1F1B) the next check is the world size: past the refusal.
    with pytest.raises(TrainConfigError, match="needs 4 processes"):
        train(TrainArgs(schedule="1f1b", **kw))
    monkeypatch.setenv("PTXTRAIN_PP_OVERLAP", "0")
    with pytest.raises(TrainConfigError, match="needs 4 processes"):
        train(TrainArgs(schedule="dualpipe", **kw))
    assert not dist.is_initialized()


def test_nvlink_buffer_is_sized_for_training_and_sampling():
    # The nvlink Buffer is sized for the most tokens one rank's forward sees: an evaluation
    # batch (batch_size / ep sequences of seq_len) or an end-of-run sampling step (SAMPLE_COUNT
    # contexts of up to max_seq_len tokens, on every EP rank). Exact integers: no tolerance.
    from types import SimpleNamespace

    from ptxtrain.data import ByteTokenizer
    from ptxtrain.train import loop
    from ptxtrain.train.strategy import ParallelStrategy

    prompt = len(ByteTokenizer().encode(loop.SAMPLE_PROMPT))
    seen = []
    model = SimpleNamespace(
        config=SimpleNamespace(max_seq_len=512),
        enable_expert_parallel=lambda group, backend, max_tokens, timeout_s: seen.append(
            (max_tokens, timeout_s)
        ),
    )
    setup = ParallelStrategy.__new__(ParallelStrategy)
    setup.ep, setup.ep_group = 2, None
    for sample_tokens, batch, seq, want in (
        (0, 8, 64, 8 // 2 * 64),  # no samples: the batch
        (200, 8, 64, loop.SAMPLE_COUNT * (prompt + 200)),  # short samples: their contexts
        (5000, 8, 64, loop.SAMPLE_COUNT * 512),  # long samples: capped at max_seq_len
        (200, 64, 512, 64 // 2 * 512),  # a large batch dominates
    ):
        setup.args = SimpleNamespace(
            batch_size=batch, seq_len=seq, sample_tokens=sample_tokens, ep_backend="nvlink",
            collective_timeout=7.5,
        )  # fmt: skip
        setup.split_experts(model)
        # (the Buffer's waits are bounded by --collective-timeout)
        assert seen[-1] == (want, 7.5), (sample_tokens, batch, seq, seen[-1], want)
