"""DeepSeekV3Config, presets and the DeepSeek-V3-style model on the tiny preset (CPU)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

from ptxtrain.model import (
    PRESETS,
    DeepSeekV3,
    DeepSeekV3Config,
    ModelOutput,
    build_model,
    fp8_module_filter,
    generate,
    get_preset,
)
from ptxtrain.model.deepseek import RMSNorm, rope_freqs
from ptxtrain.moe import MoE, Router
from ptxtrain.moe.experts import Experts
from ptxtrain.nn.functional import apply_rope_ref

TINY = get_preset("tiny")


def _tiny(**kw) -> DeepSeekV3Config:
    return dataclasses.replace(TINY, **kw)


def _ids(b, t, seed, vocab=256):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- config
def expected_params(c: DeepSeekV3Config) -> dict[str, int]:
    """Parameter counts derived by hand from the architecture (independent of the module code)."""
    d = c.dim
    qk = c.qk_nope_head_dim + c.qk_rope_head_dim
    if c.q_lora_rank:
        q = d * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.n_heads * qk
    else:
        q = d * c.n_heads * qk
    attn = (
        q
        + d * (c.kv_lora_rank + c.qk_rope_head_dim)
        + c.kv_lora_rank
        + c.kv_lora_rank * c.n_heads * (c.qk_nope_head_dim + c.v_head_dim)
        + c.n_heads * c.v_head_dim * d
    )
    expert = 3 * d * c.moe_inter_dim
    shared = c.n_shared_experts * expert
    router = c.n_routed_experts * d
    dense_block = 2 * d + attn + 3 * d * c.dense_inter_dim
    moe_block = 2 * d + attn + router + shared + c.n_routed_experts * expert
    moe_block_act = 2 * d + attn + router + shared + c.n_activated_experts * expert
    n_moe = c.n_layers - c.n_dense_layers
    embed = c.vocab_size * d
    outer = embed + d + (0 if c.tie_embeddings else embed)  # embedding, final norm, head
    mtp_moe = c.n_dense_layers < c.n_layers
    mtp, mtp_act = 0, 0
    if c.mtp_depth:
        mtp = 3 * d + 2 * d * d + (moe_block if mtp_moe else dense_block)
        mtp_act = 3 * d + 2 * d * d + (moe_block_act if mtp_moe else dense_block)
    total = outer + c.n_dense_layers * (dense_block) + n_moe * moe_block + mtp
    activated = outer + c.n_dense_layers * dense_block + n_moe * moe_block_act + mtp_act
    return {
        "total": total,
        "activated": activated,
        "mtp_total": mtp,
        "mtp_activated": mtp_act,
        "embedding": embed,
    }


def test_defaults_are_the_tiny_preset_and_presets_are_listed():
    assert get_preset("tiny") == DeepSeekV3Config()
    assert set(PRESETS) == {"tiny", "small", "medium", "v3-layer"}
    with pytest.raises(ValueError, match="v3-layer"):  # the message lists the valid names
        get_preset("huge")


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(n_activated_experts=9), "n_activated_experts"),
        (dict(n_activated_experts=5), "n_activated_experts"),  # > 2 groups x 2 experts
        (dict(n_expert_groups=3), "n_expert_groups"),
        (dict(n_limited_groups=5), "n_limited_groups"),
        (dict(mtp_depth=2), "mtp_depth"),
        (dict(n_dense_layers=5), "n_dense_layers"),
        (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
        (dict(q_lora_rank=-1), "q_lora_rank"),
        (dict(dim=0), "dim"),
        (dict(seq_aux_loss_alpha=-0.1), "seq_aux_loss_alpha"),
        (dict(norm_eps=0.0), "norm_eps"),
        (dict(rope_theta=math.inf), "rope_theta"),
    ],
)
def test_config_rejects_bad_values(fields, name):
    with pytest.raises(ValueError, match=name):
        _tiny(**fields)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        (dict(dim=128.0), "dim"),
        (dict(n_layers=True), "n_layers"),
        (dict(route_scale="1"), "route_scale"),
        (dict(tie_embeddings=1), "tie_embeddings"),
    ],
)
def test_config_rejects_bad_types(fields, name):
    with pytest.raises(TypeError, match=name):
        _tiny(**fields)


@pytest.mark.parametrize("name", PRESETS)
def test_config_dict_round_trip(name):
    cfg = get_preset(name)
    d = json.loads(json.dumps(cfg.to_dict()))
    assert DeepSeekV3Config.from_dict(d) == cfg
    with pytest.raises(ValueError, match="dims"):
        DeepSeekV3Config.from_dict({**d, "dims": 3})
    with pytest.raises(TypeError):
        DeepSeekV3Config.from_dict([("dim", 3)])
    # JSON writes 1.0 as 1 in some tools: int values for float fields become floats.
    cfg2 = DeepSeekV3Config.from_dict({**d, "route_scale": 2})
    assert cfg2.route_scale == 2.0 and isinstance(cfg2.route_scale, float)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_param_counts_on_meta(name):
    cfg = get_preset(name)
    with torch.device("meta"):
        model = DeepSeekV3(cfg)
    assert model.num_params() == expected_params(cfg)
    if name == "small":
        assert 80e6 <= model.num_params()["total"] <= 120e6  # "~100 M parameters"


def test_medium_preset_is_deepseek_v2_lite_at_8_layers():
    cfg = get_preset("medium")
    want = dict(
        vocab_size=256, dim=2048, n_layers=8, n_dense_layers=1, dense_inter_dim=10944,
        n_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, moe_inter_dim=1408, n_routed_experts=64,
        n_shared_experts=2, n_activated_experts=6, n_expert_groups=8, n_limited_groups=4,
        route_scale=1.0, max_seq_len=2048, mtp_depth=1,
    )  # fmt: skip
    assert {k: getattr(cfg, k) for k in want} == want
    with torch.device("meta"):  # 4.8 G parameters: never materialized in the CPU suite
        n = DeepSeekV3(cfg).num_params()
    # The sizes are the main model's (the report's convention: MTP left out).
    assert round((n["total"] - n["mtp_total"]) / 1e9, 2) == 4.19
    assert round((n["activated"] - n["mtp_activated"]) / 1e9, 2) == 0.68


def test_v3_layer_shapes_on_meta():
    cfg = get_preset("v3-layer")
    with torch.device("meta"):
        model = DeepSeekV3(cfg)
    model.to(torch.bfloat16)
    layer = model.layers[0]
    attn, moe = layer.attn, layer.ffn
    assert isinstance(moe, MoE) and len(model.layers) == 1 and model.mtp is None
    shapes = {
        "wq_a": (1536, 7168),
        "wq_b": (128 * 192, 1536),
        "wkv_a": (512 + 64, 7168),
        "wkv_b": (128 * (128 + 128), 512),
        "wo": (7168, 128 * 128),
    }
    for attr, shape in shapes.items():
        assert tuple(getattr(attn, attr).weight.shape) == shape, attr
    assert moe.experts.num_experts == 256 and tuple(moe.experts.w1.shape) == (256, 2048, 7168)
    assert tuple(moe.experts.w3.shape) == (256, 2048, 7168)
    assert tuple(moe.experts.w2.shape) == (256, 7168, 2048)
    assert tuple(moe.shared_experts.w1.weight.shape) == (2048, 7168)
    assert (
        tuple(moe.router.weight.shape) == (256, 7168) and moe.router.weight.dtype == torch.bfloat16
    )
    assert moe.router.bias.dtype == torch.float32
    assert (moe.router.top_k, moe.router.n_groups, moe.router.n_limited_groups) == (8, 8, 4)
    assert moe.router.route_scale == 2.5
    # Attention and the shared expert run shape-only on meta.
    x = torch.empty(2, 5, 7168, device="meta", dtype=torch.bfloat16)
    freqs = rope_freqs(5, 64, cfg.rope_theta, torch.device("meta"))
    assert attn(x, freqs).shape == (2, 5, 7168)
    assert moe.shared_experts(x).shape == (2, 5, 7168)


# ---------------------------------------------------------------------------- building
def test_build_model_dtype_seed_and_fp32_bias():
    a = build_model(TINY, seed=3)
    b = build_model(TINY, seed=3)
    c = build_model(TINY, seed=4)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert pa.dtype == torch.bfloat16, name
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.embed.weight, c.embed.weight)
    routers = a.routers()
    assert len(routers) == TINY.n_moe_layers + 1  # + the MTP block
    for r in routers:
        assert r.bias.dtype == torch.float32 and r.expert_counts.dtype == torch.int64
    # init: normal(0, init_std) weights (std of 32k samples within 3%), unit norms, zero bias.
    assert abs(float(a.embed.weight.detach().float().std()) - TINY.init_std) < 0.03 * TINY.init_std
    assert bool((a.norm.weight == 1).all()) and bool((routers[0].bias == 0).all())
    # A user cast cannot demote the bias; the checkpoint holds it, not the counters.
    with torch.no_grad():
        routers[0].bias.fill_(1.0 + 2**-20)
    a.to(torch.float16)
    assert routers[0].bias.dtype == torch.float32 and float(routers[0].bias[0]) == 1.0 + 2**-20
    state = a.state_dict()
    assert "layers.1.ffn.router.bias" in state and "mtp.block.ffn.router.bias" in state
    assert not any("expert_counts" in k for k in state)
    # No seed: deterministic under the global RNG.
    torch.manual_seed(9)
    d = build_model(TINY, dtype=torch.float32)
    torch.manual_seed(9)
    e = build_model(TINY, dtype=torch.float32)
    assert d.embed.weight.dtype == torch.float32 and torch.equal(d.head.weight, e.head.weight)
    with pytest.raises(TypeError, match="dtype"):
        build_model(TINY, dtype=torch.int32)
    with pytest.raises(TypeError, match="config"):
        build_model(TINY.to_dict())
    # A seed torch.Generator cannot take is a ValueError naming it, not torch's overflow error.
    with pytest.raises(ValueError, match="seed must lie in"):
        build_model(TINY, seed=2**64)


def test_tied_embeddings_and_plain_query_projection():
    cfg = _tiny(tie_embeddings=True, q_lora_rank=0, mtp_depth=0)
    model = build_model(cfg, seed=0, dtype=torch.float32)
    assert model.head.weight is model.embed.weight
    assert hasattr(model.layers[0].attn, "wq") and not hasattr(model.layers[0].attn, "wq_a")
    assert model.num_params() == expected_params(cfg)
    out = model(_ids(2, 8, 0), _ids(2, 8, 1))
    out.loss.backward()
    assert model.embed.weight.grad is not None


# ---------------------------------------------------------------------------- building blocks
def test_rope_rotates_interleaved_pairs_and_is_relative():
    gen = torch.Generator().manual_seed(12)
    t, h, r, theta = 9, 3, 8, 50.0
    x = torch.randn(2, t, h, r, generator=gen)
    got = apply_rope_ref(x, rope_freqs(t, r, theta, x.device))
    want = torch.empty_like(x, dtype=torch.float64)
    for pos in range(t):
        for j in range(r // 2):
            angle = pos * theta ** (-2 * j / r)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[:, pos, :, 2 * j].double(), x[:, pos, :, 2 * j + 1].double()
            want[:, pos, :, 2 * j] = a * c - b * s
            want[:, pos, :, 2 * j + 1] = a * s + b * c
    # complex64 rotation vs float64 loop: fp32 rounding of angles up to 8 rad.
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    # <rope(q, m), rope(k, n)> depends on m - n only: shift both positions by 3.
    q, k = torch.randn(r, generator=gen), torch.randn(r, generator=gen)
    seq_q = q.expand(1, t, 1, r).clone()
    seq_k = k.expand(1, t, 1, r).clone()
    rq, rk = (apply_rope_ref(z, rope_freqs(t, r, theta, x.device))[0, :, 0] for z in (seq_q, seq_k))
    torch.testing.assert_close(rq[5] @ rk[2], rq[8] @ rk[5], rtol=1e-5, atol=1e-5)  # fp32 dots


def test_rmsnorm_matches_formula_in_fp32():
    norm = RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    x = torch.randn(5, 64, dtype=torch.bfloat16) * 7
    x64 = x.double()
    want = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    got = norm(x)
    assert got.dtype == torch.bfloat16
    # fp32 maths then one bf16 rounding: within bf16's half-ulp (2^-8 relative).
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-6)


# ---------------------------------------------------------------------------- forward
def test_forward_backward_tiny_bf16():
    model = build_model(TINY, seed=0).train()
    ids, labels = _ids(2, 64, 1), _ids(2, 64, 2)
    out = model(ids, labels)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 64, 256) and out.logits.dtype == torch.bfloat16
    for name in ("loss", "lm_loss", "mtp_loss", "aux_loss"):
        value = getattr(out, name)
        assert value.dtype == torch.float32 and value.dim() == 0, name
        assert math.isfinite(float(value.detach())), name
    # At init the logits are ~N(0, 0.02²·dim) = N(0, 0.23²): cross-entropy ≈ ln 256 + σ²/2 ≈
    # 5.57 for both heads; 0.15 leaves room for bf16 and finite-sample spread.
    assert abs(float(out.lm_loss.detach()) - math.log(256)) < 0.15
    assert abs(float(out.mtp_loss.detach()) - math.log(256)) < 0.15
    want = out.lm_loss + TINY.mtp_loss_weight * out.mtp_loss + out.aux_loss
    assert torch.equal(out.loss, want)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert bool(torch.isfinite(p.grad).all()) and bool(p.grad.abs().sum() > 0), name


def test_causality_future_tokens_do_not_change_past_logits():
    model = build_model(TINY, seed=1, dtype=torch.float32).eval()
    ids = _ids(2, 48, 3)
    changed = ids.clone()
    changed[:, 30:] = _ids(2, 18, 4)
    with torch.no_grad():
        a, b = model(ids).logits, model(changed).logits
    # Exact maths would give equal rows; the expert slices change size (future tokens route
    # elsewhere), which changes fp32 matmul blocking: allow a few ulp of O(1) logits.
    torch.testing.assert_close(a[:, :30], b[:, :30], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 30:], b[:, 30:])  # the change itself is visible


def test_mtp_loss_wiring_and_mtp_off():
    model = build_model(TINY, seed=2, dtype=torch.float32).eval()
    ids, labels = _ids(2, 32, 5), _ids(2, 32, 6)
    captured = {}
    model.norm.register_forward_hook(lambda mod, inp, out: captured.__setitem__("h", inp[0]))
    with torch.no_grad():
        out = model(ids, labels)
        h = captured["h"]  # [B, T, D], the main model's last hidden state before its norm
        mtp = model.mtp
        x = mtp.proj(torch.cat((mtp.hnorm(h[:, :-1]), mtp.enorm(model.embed(ids[:, 1:]))), -1))
        freqs = rope_freqs(31, TINY.qk_rope_head_dim, TINY.rope_theta, ids.device)
        x, _ = mtp.block(x, freqs)
        logits = model.head(mtp.norm(x))  # predicts labels[:, t+1] at position t
        want = nn.functional.cross_entropy(logits.reshape(-1, 256), labels[:, 1:].reshape(-1))
    # Same fp32 ops in the same order, only the call path differs.
    torch.testing.assert_close(out.mtp_loss, want, rtol=1e-6, atol=1e-6)
    assert out.aux_loss is None  # eval mode: no balance loss
    torch.testing.assert_close(out.loss, out.lm_loss + TINY.mtp_loss_weight * out.mtp_loss)
    assert model(ids[:, :1], labels[:, :1]).mtp_loss is None  # T = 1: nothing to predict

    off = build_model(_tiny(mtp_depth=0, seq_aux_loss_alpha=0.0), seed=2, dtype=torch.float32)
    assert off.mtp is None and not any(n.startswith("mtp.") for n, _ in off.named_parameters())
    out = off.train()(ids, labels)
    assert out.mtp_loss is None and out.aux_loss is None and torch.equal(out.loss, out.lm_loss)


def test_ignored_labels():
    model = build_model(TINY, seed=0, dtype=torch.float32).eval()
    ids, labels = _ids(1, 16, 7), _ids(1, 16, 8)
    labels[:, 10:] = -100
    with torch.no_grad():
        out = model(ids, labels)
        want = nn.functional.cross_entropy(out.logits[0, :10], labels[0, :10])
    torch.testing.assert_close(out.lm_loss, want, rtol=1e-6, atol=1e-6)  # same fp32 maths


def test_router_bias_update_through_the_model():
    model = build_model(TINY, seed=0, dtype=torch.float32).train()
    b, t = 2, 32
    model(_ids(b, t, 9), _ids(b, t, 10))
    k = TINY.n_activated_experts
    before = [r.bias.clone() for r in model.routers()]
    peek = model.moe_load_stats()
    assert all(torch.equal(r.bias, p) for r, p in zip(model.routers(), before))  # no update
    assert peek["tokens"] == (TINY.n_moe_layers * b * t + b * (t - 1)) * k  # + MTP's T-1
    stats = model.update_router_biases()
    assert stats["n_moe_layers"] == TINY.n_moe_layers + 1
    assert {k: stats[k] for k in peek if k != "bias_abs_max"} == {
        k: peek[k] for k in peek if k != "bias_abs_max"
    }
    assert stats["max_load_ratio"] >= 1 >= stats["min_load_ratio"] and stats["cv"] > 0
    assert stats["bias_abs_max"] == pytest.approx(TINY.bias_update_speed)
    for r, old in zip(model.routers(), before):
        step = (r.bias - old) / TINY.bias_update_speed
        assert bool(torch.isin(step.round(), torch.tensor([-1.0, 0.0, 1.0])).all())
        assert bool((step != 0).any())
        assert int(r.expert_counts.sum()) == 0


# ---------------------------------------------------------------------------- input checks
def test_bad_inputs_raise():
    model = build_model(TINY, seed=0, dtype=torch.float32)
    ids = _ids(2, 8, 0)
    with pytest.raises(TypeError, match="input_ids"):
        model(ids.int())
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[0])
    with pytest.raises(ValueError, match="max_seq_len"):
        model(_ids(1, TINY.max_seq_len + 1, 0))
    with pytest.raises(ValueError, match="input_ids"):
        model(ids[:, :0])
    with pytest.raises(ValueError, match="256"):
        model(torch.full((1, 4), 256))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.full((1, 4), -1))
    with pytest.raises(ValueError, match="labels"):
        model(ids, ids[:, :4])
    with pytest.raises(TypeError, match="labels"):
        model(ids, ids.float())
    with pytest.raises(ValueError, match="labels"):
        model(ids, torch.full_like(ids, 300))


# ---------------------------------------------------------------------------- generate, FP8 filter
def test_generate_shape_determinism_and_cropping():
    cfg = _tiny(max_seq_len=12)
    model = build_model(cfg, seed=0, dtype=torch.float32).train()
    prompt = _ids(2, 15, 11)  # longer than max_seq_len: the context is cropped
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    a = generate(model, prompt, 5, temperature=0.8, top_k=20, generator=g1)
    b = generate(model, prompt, 5, temperature=0.8, top_k=20, generator=g2)
    assert a.shape == (2, 20) and a.dtype == torch.int64
    assert torch.equal(a[:, :15], prompt) and torch.equal(a, b)
    assert model.training  # mode restored
    assert sum(int(r.expert_counts.sum()) for r in model.routers()) == 0  # eval: no counting
    c = generate(model, prompt, 5, generator=torch.Generator().manual_seed(1))
    d = generate(model, prompt, 5, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(c, d)  # sampling really uses the generator
    greedy = generate(model, prompt, 3, temperature=0)
    assert torch.equal(greedy, generate(model, prompt, 3, top_k=1))
    assert generate(model, prompt, 0).shape == prompt.shape
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 1, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 1, top_k=0)
    with pytest.raises(TypeError, match="prompt_ids"):
        generate(model, prompt.float(), 1)


def test_fp8_module_filter_selects_the_projection_linears():
    with torch.device("meta"):
        model = DeepSeekV3(TINY)
    chosen = {fqn for fqn, m in model.named_modules() if fp8_module_filter(m, fqn)}
    linears = {fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
    experts = {fqn for fqn, m in model.named_modules() if isinstance(m, Experts)}
    assert experts and chosen == (linears - {"head"}) | experts  # experts: their enable_fp8
    for fqn in (
        "layers.0.attn.wq_a",
        "layers.0.attn.wkv_b",
        "layers.0.ffn.w2",
        "layers.1.ffn.shared_experts.w1",
        "mtp.proj",
        "mtp.block.attn.wo",
    ):
        assert fqn in chosen, fqn
    modules = dict(model.named_modules())
    for fqn in (
        "head",
        "embed",
        "norm",
        "layers.1.ffn.router",
        "layers.1.attn.kv_norm",
    ):
        assert not fp8_module_filter(modules[fqn], fqn), fqn
    assert isinstance(modules["layers.1.ffn.router"], Router)
    assert not fp8_module_filter(nn.Linear(4, 4), "layers.1.ffn.router.proj")


def test_tiny_model_fits_one_batch():
    model = build_model(TINY, seed=5, dtype=torch.float32).train()
    ids = _ids(2, 32, 13)
    labels = torch.roll(ids, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        out = model(ids, labels)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.update_router_biases()
        losses.append(float(out.lm_loss.detach()))
    # Memorizing 64 tokens: the loss leaves ln 256 ≈ 5.5 fast; a broken gradient path stalls.
    assert losses[-1] < losses[0] - 1.0, losses


def test_fp8_model_quantizes_each_shared_projection_input_once(ref_gemms):
    # MLA's two down-projections (wq_a, wkv_a) and every MLP's gate / up (w1, w3) read one x:
    # the second of each pair gets the first's quantization of it instead of making its own.
    from ptxtrain.model.deepseek import convert_model_to_fp8_training
    from ptxtrain.nn import Fp8Linear

    model = build_model(get_preset("tiny"), dtype=torch.bfloat16, device="cpu", seed=0)
    convert_model_to_fp8_training(model)
    shared = {}

    def record(name):
        def hook(module, args, kwargs):
            shared[name] = kwargs.get("input_q") is not None

        return hook

    for name, m in model.named_modules():
        if isinstance(m, Fp8Linear) and name.rsplit(".", 1)[-1] in ("wq_a", "wkv_a", "w1", "w3"):
            m.register_forward_pre_hook(record(name), with_kwargs=True)
    x = torch.randint(0, 256, (2, 16))
    model(x, x)
    assert shared and all(shared.values()), {n: s for n, s in shared.items() if not s}
    kinds = {n.rsplit(".", 1)[-1] for n in shared}
    assert kinds == {"wq_a", "wkv_a", "w1", "w3"}, kinds


def test_fp8_model_keeps_the_experts_swiglu_input_in_fp8(ref_gemms):
    # What one FP8 forward keeps for backward: with save_swiglu_input_fp8 each MoE layer's
    # [w1 x | w3 x] (the routed experts' padded rows, [R, 2I]) is kept as e4m3 plus fp32 scales
    # [R, 2I/128]; without it, in bf16 (the reference SwiGLU keeps its two [R, I] halves).
    import dataclasses as dc

    from ptxtrain.model.deepseek import convert_model_to_fp8_training
    from ptxtrain.nn import Fp8LinearConfig

    cfg, width = TINY, 2 * TINY.moe_inter_dim
    x = torch.randint(0, 256, (2, 16))
    n_moe = sum(isinstance(m, Experts) for m in build_model(cfg, device="meta").modules())

    def saved(save_fp8):
        model = build_model(cfg, dtype=torch.bfloat16, device="cpu", seed=0)
        recipe = Fp8LinearConfig.from_recipe_name("deepseek")
        convert_model_to_fp8_training(model, dc.replace(recipe, save_swiglu_input_fp8=save_fp8))
        weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
        shapes = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in weights:  # activations, not weight views
                shapes.append((t.dtype, tuple(t.shape)))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x)
        return shapes

    on = saved(True)
    # (Other FP8 tensors of that width are cached weight blocks of 64 rows: the routed rows
    # are padded to multiples of 128.)
    h13 = [s for d, s in on if d == torch.float8_e4m3fn and s[1] == width and s[0] % 128 == 0]
    assert len(h13) == n_moe, on
    rows = {s[0] for s in h13}  # R, the same for every MoE layer
    assert len(rows) == 1
    r = rows.pop()
    assert on.count((torch.float32, (r, width // 128))) == n_moe  # their scales
    off = saved(False)
    assert (torch.float8_e4m3fn, (r, width)) not in off

    # Without it the SwiGLU keeps its input in 16 bits or wider (the CPU reference keeps the
    # fp32 halves it computes in): at least 2 - 1 - 4/128 bytes more per element of [R, 2I].
    def nbytes(shapes):
        return sum(math.prod(s) * torch.empty((), dtype=d).element_size() for d, s in shapes)

    assert nbytes(off) - nbytes(on) >= n_moe * r * width * (2 - 1 - 4 / 128)
