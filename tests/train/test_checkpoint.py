"""Checkpoints: exact round trip, atomic replacement under simulated crashes, corruption checks."""

import json
import os

import pytest
import torch
from torch import nn

from ptxtrain.optim import AdamW
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.train import checkpoint as ck
from ptxtrain.train.checkpoint import (
    CheckpointError,
    flatten_state,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
    unflatten_state,
)


class _Net(nn.Module):
    def __init__(self, extra: bool = False):
        super().__init__()
        self.a = nn.Linear(12, 20)
        self.b = nn.Linear(20, 6, bias=False)
        self.register_buffer("bias_buf", torch.zeros(6, dtype=torch.float32))
        if extra:
            self.c = nn.Linear(6, 6)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))) + self.bias_buf


def _trained(seed: int, steps: int = 2):
    torch.manual_seed(seed)
    net = _Net().to(torch.bfloat16)
    opt = AdamW(net.parameters(), lr=1e-2)
    for _ in range(steps):
        x = torch.randn(5, 12, dtype=torch.bfloat16)
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        net.bias_buf.copy_(torch.randn(6))
    return net, opt


def _fresh():
    net = _Net().to(torch.bfloat16)
    return net, AdamW(net.parameters(), lr=1e-2)


CONFIG = {"model": {"dim": 12, "layers": [1, 2]}, "train": {"lr": 0.003, "seed": 1}}


def _assert_same_state(net_a, opt_a, net_b, opt_b):
    for (k, v), (k2, v2) in zip(net_a.state_dict().items(), net_b.state_dict().items()):
        assert k == k2
        assert_bitwise_equal(v2, v, name=k)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid, entry in sa["state"].items():
        for key, val in entry.items():
            assert_bitwise_equal(sb["state"][pid][key], val, name=f"optimizer {pid}.{key}")


def test_round_trip_is_exact(tmp_path):
    net, opt = _trained(0)
    path = save_checkpoint(tmp_path, model=net, optimizer=opt, step=7, config=CONFIG,
                           extra={"note": "x"})  # fmt: skip
    assert path == tmp_path / "checkpoint"
    assert sorted(p.name for p in path.iterdir()) == [
        "meta.json", "model.safetensors", "optimizer.json", "optimizer.safetensors",
    ]  # fmt: skip
    net2, opt2 = _fresh()
    meta = load_checkpoint(tmp_path, model=net2, optimizer=opt2, expected_config=CONFIG)
    assert meta["step"] == 7 and meta["extra"] == {"note": "x"}
    _assert_same_state(net, opt, net2, opt2)
    # Both continue identically.
    x = torch.randn(5, 12, dtype=torch.bfloat16)
    for n, o in ((net, opt), (net2, opt2)):
        n(x).float().sum().backward()
        o.step()
    _assert_same_state(net, opt, net2, opt2)


def test_rng_state_restored(tmp_path):
    net, opt = _trained(1)
    torch.manual_seed(99)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=1, config=CONFIG)
    want = torch.rand(8)
    torch.manual_seed(5)
    load_checkpoint(tmp_path, model=_fresh()[0], optimizer=_fresh()[1], restore_rng=True)
    assert torch.equal(torch.rand(8), want)


def test_tied_weights_save(tmp_path):
    net, opt = _trained(2)
    net.b.weight = nn.Parameter(net.b.weight.detach())
    tied = nn.Module()
    tied.x = net.a
    tied.y = net.a  # the same tensors under two names: safetensors refuses shared storage
    save_checkpoint(tmp_path, model=tied, optimizer=opt, step=1, config=CONFIG)
    meta = read_checkpoint_meta(tmp_path)
    assert meta["step"] == 1


def test_flatten_round_trip_keeps_types():
    g = torch.Generator().manual_seed(0)
    state = {
        "state": {0: {"step": torch.tensor(3.0), "m": torch.randn(3, generator=g)}, 5: {}},
        "param_groups": [{"params": [0, 5], "betas": (0.9, 0.95), "lr": 1e-3, "x": None}],
        "dtype": torch.bfloat16,
    }
    tensors = {}
    enc = flatten_state(state, tensors)
    dec = unflatten_state(json.loads(json.dumps(enc)), tensors)
    assert set(dec["state"]) == {0, 5}
    assert dec["param_groups"][0]["betas"] == (0.9, 0.95)
    assert dec["dtype"] is torch.bfloat16
    assert torch.equal(dec["state"][0]["m"], state["state"][0]["m"])
    with pytest.raises(TypeError, match="at x"):
        flatten_state({"x": object()}, {})


# ---------------------------------------------------------------------------- crash safety
def test_crash_mid_write_keeps_old_checkpoint(tmp_path, monkeypatch):
    net, opt = _trained(3)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=10, config=CONFIG)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}

    calls = {"n": 0}
    real = ck._write_safetensors

    def crash_on_second(path, tensors):
        calls["n"] += 1
        if calls["n"] == 2:  # the optimizer file: write half of it, then die
            real(path, tensors)
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2])
            raise OSError("simulated crash")
        real(path, tensors)

    monkeypatch.setattr(ck, "_write_safetensors", crash_on_second)
    net2, opt2 = _trained(4, steps=3)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, model=net2, optimizer=opt2, step=20, config=CONFIG)
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}
    assert after == before
    assert not list(tmp_path.glob(".checkpoint.tmp-*"))
    net3, opt3 = _fresh()
    assert load_checkpoint(tmp_path, model=net3, optimizer=opt3)["step"] == 10
    _assert_same_state(net, opt, net3, opt3)


def test_killed_write_leaves_temp_dir_that_is_ignored(tmp_path):
    net, opt = _trained(5)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=4, config=CONFIG)
    # A process killed mid-write leaves a partial temp folder behind.
    junk = tmp_path / ".checkpoint.tmp-dead"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\x00" * 10)
    assert read_checkpoint_meta(tmp_path)["step"] == 4
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=5, config=CONFIG)
    assert not junk.exists()
    assert read_checkpoint_meta(tmp_path)["step"] == 5


def test_crash_between_renames_falls_back_to_prev(tmp_path, monkeypatch):
    net, opt = _trained(6)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=3, config=CONFIG)
    real_replace = os.replace
    calls = {"n": 0}

    def replace(src, dst):
        calls["n"] += 1
        if calls["n"] == 2:  # checkpoint -> checkpoint.prev done; temp -> checkpoint dies
            raise OSError("simulated crash")
        real_replace(src, dst)

    monkeypatch.setattr(ck.os, "replace", replace)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, model=net, optimizer=opt, step=6, config=CONFIG)
    monkeypatch.setattr(ck.os, "replace", real_replace)
    assert not (tmp_path / "checkpoint").exists() and (tmp_path / "checkpoint.prev").is_dir()
    net2, opt2 = _fresh()
    assert load_checkpoint(tmp_path, model=net2, optimizer=opt2)["step"] == 3
    _assert_same_state(net, opt, net2, opt2)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=6, config=CONFIG)
    assert not (tmp_path / "checkpoint.prev").exists()
    assert read_checkpoint_meta(tmp_path)["step"] == 6


# ---------------------------------------------------------------------------- corruption
@pytest.fixture
def saved(tmp_path):
    net, opt = _trained(7)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=2, config=CONFIG)
    return tmp_path


def _load(run_dir, **kw):
    net, opt = _fresh()
    return load_checkpoint(run_dir, model=net, optimizer=opt, **kw)


@pytest.mark.parametrize(
    "name", ["model.safetensors", "optimizer.safetensors", "optimizer.json", "meta.json"]
)
def test_flipped_byte_detected(saved, name):
    path = saved / "checkpoint" / name
    data = bytearray(path.read_bytes())
    pos = len(data) // 2
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        _load(saved)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors", "meta.json"])
def test_truncated_file_detected(saved, name):
    path = saved / "checkpoint" / name
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        _load(saved)


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.json", "meta.json"])
def test_missing_file_detected(saved, name):
    (saved / "checkpoint" / name).unlink()
    with pytest.raises(CheckpointError, match=f"{name} is missing"):
        _load(saved)


def test_edited_meta_detected(saved):
    path = saved / "checkpoint" / "meta.json"
    meta = json.loads(path.read_text())
    meta["body"]["step"] = 3  # valid JSON, wrong content
    path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="does not match its sha256"):
        _load(saved)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        _load(tmp_path)


def test_missing_key_detected(saved):
    net = _Net(extra=True).to(torch.bfloat16)  # has c.weight / c.bias the checkpoint lacks
    opt = AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"do not fit.*Missing key"):
        load_checkpoint(saved, model=net, optimizer=opt)


def test_config_mismatch_lists_differences(saved):
    other = {"model": {"dim": 16, "layers": [1, 2]}, "train": {"lr": 0.003, "seed": 1}}
    with pytest.raises(CheckpointError, match=r"model\.dim: checkpoint 12, now 16"):
        _load(saved, expected_config=other)
    _load(saved, expected_config=json.loads(json.dumps(CONFIG)))  # equal after JSON: fine


def test_given_state_dicts_and_state_transform(tmp_path):
    # Expert-parallel style: save state dicts the caller built (here: a larger "full" layer b)
    # and load them through a transform that keeps one slice.
    net, opt = _trained(7)
    full_b = torch.cat([net.b.weight.detach(), torch.randn(6, 20).to(torch.bfloat16)])  # [12, 20]
    model_state = {**net.state_dict(), "b.weight": full_b}
    b_index = [id(p) for p in net.parameters()].index(id(net.b.weight))
    opt_state = opt.state_dict()
    opt_state = {
        **opt_state,
        "state": {
            i: (
                {k: torch.cat([v, v + 1]) if v.dim() else v for k, v in st.items()}
                if i == b_index
                else st
            )
            for i, st in opt_state["state"].items()
        },
    }
    save_checkpoint(
        tmp_path, model=net, optimizer=opt, step=2, config=CONFIG,
        model_state=model_state, optimizer_state=opt_state,
    )  # fmt: skip

    def keep_first_half(m_sd, o_sd):
        m_sd = {**m_sd, "b.weight": m_sd["b.weight"][:6]}
        o_sd = {**o_sd, "state": dict(o_sd["state"])}
        o_sd["state"][b_index] = {
            k: v[:6] if v.dim() else v for k, v in o_sd["state"][b_index].items()
        }
        return m_sd, o_sd

    net2, opt2 = _fresh()
    load_checkpoint(tmp_path, model=net2, optimizer=opt2, state_transform=keep_first_half)
    _assert_same_state(net, opt, net2, opt2)
    # Without the transform the saved (full) layout does not fit: a clear CheckpointError.
    with pytest.raises(CheckpointError, match="model weights do not fit"):
        load_checkpoint(tmp_path, model=_fresh()[0], optimizer=_fresh()[1])

    def broken(m_sd, o_sd):
        raise KeyError("layers.1.ffn.experts.w1")

    with pytest.raises(CheckpointError, match=r"state does not fit this model.*experts"):
        load_checkpoint(tmp_path, model=net2, optimizer=opt2, state_transform=broken)
