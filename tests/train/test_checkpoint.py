"""Sharded checkpoints in one process: exact round trip, expert keys and resharding, atomic
replacement under simulated crashes and SIGKILL, asynchronous saves, corruption checks."""

import json
import multiprocessing as mp
import os
import signal

import pytest
import torch
from torch import nn

from ptxtrain.moe import Experts
from ptxtrain.optim import AdamW
from ptxtrain.testing import assert_bitwise_equal
from ptxtrain.train import checkpoint as ck
from ptxtrain.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    load_checkpoint,
    read_checkpoint_meta,
    read_checkpoint_state,
    save_checkpoint,
)
from ptxtrain.train.state_layout import StateLayout

N_EXPERTS = 4


class _Net(nn.Module):
    """Dense layers, a buffer and stacked experts ([E, I, D]) like the MoE layers'."""

    def __init__(self, extra: bool = False, experts: bool = True):
        super().__init__()
        self.a = nn.Linear(12, 20)
        self.b = nn.Linear(20, 6, bias=False)
        self.register_buffer("bias_buf", torch.zeros(6, dtype=torch.float32))
        if experts:
            self.experts = Experts(N_EXPERTS, 6, 8)
        if extra:
            self.c = nn.Linear(6, 6)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x))) + self.bias_buf
        if hasattr(self, "experts"):  # every expert on every row: a dense stand-in for routing
            h = h + torch.einsum("bd,eid,eki->bk", h, self.experts.w1, self.experts.w2)
        return h


def _trained(seed: int, steps: int = 2, **kw):
    torch.manual_seed(seed)
    net = _Net(**kw).to(torch.bfloat16)
    opt = AdamW(net.parameters(), lr=1e-2)
    _steps(net, opt, steps)
    with torch.no_grad():
        net.bias_buf.copy_(torch.randn(6))
    return net, opt


def _steps(net, opt, n: int) -> None:
    for _ in range(n):
        x = torch.randn(5, 12, dtype=torch.bfloat16)
        net(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _fresh(**kw):
    net = _Net(**kw).to(torch.bfloat16)
    return net, AdamW(net.parameters(), lr=1e-2)


CONFIG = {"model": {"dim": 12, "layers": [1, 2]}, "train": {"lr": 0.003, "seed": 1}}
FILES = [".metadata", "__0_0.distcp", "__0_1.distcp", "meta.json"]


def _assert_same_state(net_a, opt_a, net_b, opt_b):
    for (k, v), (k2, v2) in zip(net_a.state_dict().items(), net_b.state_dict().items()):
        assert k == k2
        assert_bitwise_equal(v2, v, name=k)
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for pid, entry in sa["state"].items():
        assert entry.keys() == sb["state"][pid].keys()
        for key, val in entry.items():
            assert_bitwise_equal(sb["state"][pid][key], val, name=f"optimizer {pid}.{key}")


def test_round_trip_is_exact(tmp_path):
    net, opt = _trained(0)
    path = save_checkpoint(tmp_path, model=net, optimizer=opt, step=7, config=CONFIG,
                           extra={"note": "x"})  # fmt: skip
    assert path == tmp_path / "checkpoint"
    assert sorted(p.name for p in path.iterdir()) == FILES
    net2, opt2 = _fresh()
    meta = load_checkpoint(tmp_path, model=net2, optimizer=opt2, expected_config=CONFIG)
    assert meta["step"] == 7 and meta["extra"] == {"note": "x"} and meta["ranks"] == 1
    _assert_same_state(net, opt, net2, opt2)
    # Both continue identically.
    for n, o in ((net, opt), (net2, opt2)):
        torch.manual_seed(3)
        _steps(n, o, 1)
    _assert_same_state(net, opt, net2, opt2)


def test_layout_independent_keys(tmp_path):
    net, opt = _trained(1)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=1, config=CONFIG)
    state = read_checkpoint_state(tmp_path)
    # One key per expert (global index), optimizer state under the parameter's name.
    w1 = net.experts.w1.detach()
    for e in range(N_EXPERTS):
        assert_bitwise_equal(state[f"model.experts.w1.{e}"], w1[e], name=f"expert {e}")
        master = opt.state[net.experts.w1]["master"][e]
        assert_bitwise_equal(state[f"optim.experts.w1.{e}.master"], master, name="master")
    assert "model.experts.w1" not in state
    assert state["optim.experts.w1.step"].shape == ()  # one step count per parameter
    assert state["optim.a.weight.exp_avg"].dtype == torch.bfloat16  # moments keep their dtype
    assert state["optim.a.weight.master"].dtype == torch.float32
    assert_bitwise_equal(state["model.bias_buf"], net.bias_buf, name="buffer")
    groups = read_checkpoint_meta(tmp_path)["optimizer"]
    assert groups["groups"][groups["group_of"]["a.weight"]]["lr"] == 1e-2


def test_reshard_to_an_expert_parallel_rank_and_back(tmp_path):
    # The full model's checkpoint read by an "EP rank 1 of 2" (experts 2, 3), which writes its
    # own view back; each side gets exactly its slice.
    net, opt = _trained(2)
    save_checkpoint(tmp_path / "full", model=net, optimizer=opt, step=2, config=CONFIG)
    part = _Net().to(torch.bfloat16)
    part.experts.keep_experts_(2, 2)
    part_opt = AdamW(part.parameters(), lr=1e-2)
    load_checkpoint(tmp_path / "full", model=part, optimizer=part_opt)
    full_state, part_state = opt.state[net.experts.w2], part_opt.state[part.experts.w2]
    assert_bitwise_equal(part.experts.w2.detach(), net.experts.w2.detach()[2:], name="w2")
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert_bitwise_equal(part_state[key], full_state[key][2:], name=key)
    assert_bitwise_equal(part_state["step"], full_state["step"], name="step")
    assert_bitwise_equal(part.a.weight.detach(), net.a.weight.detach(), name="a.weight")
    # The rank writes experts 2 and 3 only: the full model cannot load that (missing keys).
    save_checkpoint(tmp_path / "part", model=part, optimizer=part_opt, step=2, config=CONFIG)
    keys = read_checkpoint_state(tmp_path / "part").keys()
    assert {k for k in keys if k.startswith("model.experts.w2.")} == {
        "model.experts.w2.2",
        "model.experts.w2.3",
    }
    with pytest.raises(CheckpointError, match=r"do not fit.*Missing keys.*experts\.w1\.0"):
        _load(tmp_path / "part")


def test_rng_state_restored(tmp_path):
    net, opt = _trained(1)
    torch.manual_seed(99)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=1, config=CONFIG)
    want = torch.rand(8)
    torch.manual_seed(5)
    _load(tmp_path, restore_rng=True)
    assert torch.equal(torch.rand(8), want)


def test_tied_weights_save(tmp_path):
    net, _ = _trained(2)
    tied = nn.Module()
    tied.x = net.a
    tied.y = net.a  # the same tensors under two names
    save_checkpoint(tmp_path, model=tied, optimizer=AdamW(tied.parameters()), step=1, config={})
    state = read_checkpoint_state(tmp_path)
    assert torch.equal(state["model.x.weight"], state["model.y.weight"])


# ---------------------------------------------------------------------------- async
def test_async_save_snapshots_before_the_next_step(tmp_path):
    net, opt = _trained(3)
    saver = Checkpointer(StateLayout(net, opt), async_save=True)
    snapshot = _trained(3)  # the same state, kept aside
    saver.save(tmp_path, step=2, config=CONFIG)
    _steps(net, opt, 2)  # changes every tensor while the write may still run
    saver.save(tmp_path, step=4, config=CONFIG)  # waits for the first, then copies again
    assert saver.saves[0]["total_s"] is not None  # committed before the second began
    later = _fresh()
    saver.wait()
    load_checkpoint(tmp_path, model=later[0], optimizer=later[1])
    _assert_same_state(net, opt, *later)
    # The step-2 checkpoint held the state of step 2, not what the steps after it made.
    saver2 = Checkpointer(StateLayout(*snapshot), async_save=True)
    saver2.save(tmp_path / "two", step=2, config=CONFIG)
    _steps(*snapshot[:2], 1)
    saver2.wait()
    back = _fresh()
    load_checkpoint(tmp_path / "two", model=back[0], optimizer=back[1])
    _assert_same_state(*_trained(3), *back)
    rec = saver2.saves[0]
    assert rec["step"] == 2 and rec["blocking_s"] >= 0 and rec["total_s"] >= 0


def test_async_save_failure_is_raised_by_wait_and_keeps_the_old_one(tmp_path, monkeypatch):
    net, opt = _trained(4)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=1, config=CONFIG)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}

    def broken(*args, **kw):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(ck.dcp, "save", broken)
    saver = Checkpointer(StateLayout(net, opt), async_save=True)
    saver.save(tmp_path, step=2, config=CONFIG)  # returns; the failure comes at wait()
    with pytest.raises(OSError, match="disk full"):
        saver.wait()
    after = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}
    assert after == before and not list(tmp_path.glob(".checkpoint.tmp-*"))
    saver.wait()  # reported once


# ---------------------------------------------------------------------------- crash safety
def test_crash_mid_write_keeps_old_checkpoint(tmp_path, monkeypatch):
    net, opt = _trained(3)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=10, config=CONFIG)
    before = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint").iterdir()}
    real = ck.dcp.save

    def crash_after_write(state, storage_writer, **kw):
        real(state, storage_writer=storage_writer, **kw)
        data = storage_writer.path / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:100])  # half written, then the process dies
        raise OSError("simulated crash")

    monkeypatch.setattr(ck.dcp, "save", crash_after_write)
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
    (junk / "__0_0.distcp").write_bytes(b"\x00" * 10)
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


# Where the SIGKILL lands in a save: inside DCP's data write, after the data and before
# meta.json, between the two renames (checkpoint/ -> .prev/ done), and after the swap.
KILL_POINTS = ("data", "meta", "renames", "cleanup")


def _die(*args, **kw) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(point: str) -> None:
    """Make this process SIGKILL itself at ``point`` (of KILL_POINTS) of its next save."""
    import shutil as sh

    import torch.distributed.checkpoint.filesystem as dcp_fs

    calls = {"n": 0}

    def nth_call(real, n: int):
        def call(*args, **kw):
            calls["n"] += 1
            if calls["n"] == n:
                _die()
            return real(*args, **kw)

        return call

    if point == "data":  # some entries written by DCP, then killed
        dcp_fs._write_item = nth_call(dcp_fs._write_item, 3)
    elif point == "meta":
        ck._commit = _die
    elif point == "renames":  # checkpoint/ -> checkpoint.prev/ done, temp -> checkpoint/ not
        ck.os.replace = nth_call(os.replace, 2)
    else:
        real_rmtree = sh.rmtree
        ck.shutil.rmtree = lambda *a, **k: _die() if "prev" in str(a[0]) else real_rmtree(*a, **k)


def _kill_during_save(run_dir: str, point: str) -> None:
    """A fresh process: save step 1, then save step 2 and SIGKILL itself at ``point``."""
    torch.set_num_threads(1)
    net, opt = _trained(7)
    save_checkpoint(run_dir, model=net, optimizer=opt, step=1, config=CONFIG)
    _steps(net, opt, 1)
    kill_at(point)
    save_checkpoint(run_dir, model=net, optimizer=opt, step=2, config=CONFIG)


def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path):
    # One process per kill point, run side by side (each imports torch: ~2 s).
    ctx = mp.get_context("spawn")
    procs = {}
    for point in KILL_POINTS:
        procs[point] = ctx.Process(target=_kill_during_save, args=(str(tmp_path / point), point))
        procs[point].start()
    for point, p in procs.items():
        p.join(timeout=120)
        assert p.exitcode == -signal.SIGKILL, f"{point}: exit code {p.exitcode}"
    want_step1, _ = _trained(7)
    for point in KILL_POINTS:
        net, opt = _fresh()
        meta = load_checkpoint(tmp_path / point, model=net, optimizer=opt)
        # Killed before the swap: the step-1 checkpoint (checkpoint/ or checkpoint.prev/);
        # killed after it: step 2. Never a mix: the weights are those of the step loaded.
        assert meta["step"] == (2 if point == "cleanup" else 1), point
        if meta["step"] == 1:
            assert_bitwise_equal(net.a.weight.detach(), want_step1.a.weight.detach(), name=point)
        assert (point == "renames") == meta["path"].endswith("checkpoint.prev")
        # The next save cleans up after the killed one.
        save_checkpoint(tmp_path / point, model=net, optimizer=opt, step=3, config=CONFIG)
        assert sorted(p.name for p in (tmp_path / point).iterdir()) == ["checkpoint"]


# ---------------------------------------------------------------------------- corruption
@pytest.fixture
def saved(tmp_path):
    net, opt = _trained(7)
    save_checkpoint(tmp_path, model=net, optimizer=opt, step=2, config=CONFIG)
    return tmp_path


def _load(run_dir, **kw):
    net, opt = _fresh()
    return load_checkpoint(run_dir, model=net, optimizer=opt, **kw)


@pytest.mark.parametrize("name", FILES)
def test_flipped_byte_detected(saved, name):
    path = saved / "checkpoint" / name
    data = bytearray(path.read_bytes())
    pos = len(data) // 2
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        _load(saved)


@pytest.mark.parametrize("name", FILES)
def test_truncated_file_detected(saved, name):
    path = saved / "checkpoint" / name
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        _load(saved)


@pytest.mark.parametrize("name", FILES)
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


def test_format_1_is_refused_clearly(saved):
    path = saved / "checkpoint" / "meta.json"
    body = {"format": 1, "step": 2, "config": {}, "rng": {}, "extra": {}, "files": {}}
    sha = ck.hashlib.sha256(ck._canonical(body)).hexdigest()
    path.write_text(json.dumps({"body": body, "sha256": sha}))
    with pytest.raises(CheckpointError, match=r"format 1 .*safetensors.*reads the sharded"):
        _load(saved)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint"):
        _load(tmp_path)


def test_missing_key_detected(saved):
    net = _Net(extra=True).to(torch.bfloat16)  # has c.weight / c.bias the checkpoint lacks
    opt = AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"do not fit.*Missing keys \[model\.c\.bias"):
        load_checkpoint(saved, model=net, optimizer=opt)


def test_unexpected_key_detected(saved):
    net = _Net(experts=False).to(torch.bfloat16)  # lacks the experts the checkpoint holds
    opt = AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"do not fit.*unexpected keys \[model\.experts"):
        load_checkpoint(saved, model=net, optimizer=opt)


def test_another_expert_count_detected(saved):
    net = _Net().to(torch.bfloat16)
    net.experts = Experts(2 * N_EXPERTS, 6, 8).to(torch.bfloat16)  # experts 4-7 are not stored
    opt = AdamW(net.parameters(), lr=1e-2)
    with pytest.raises(CheckpointError, match=r"Missing keys \[model\.experts\.w1\.4"):
        load_checkpoint(saved, model=net, optimizer=opt)


def test_config_mismatch_lists_differences(saved):
    other = {"model": {"dim": 16, "layers": [1, 2]}, "train": {"lr": 0.003, "seed": 1}}
    with pytest.raises(CheckpointError, match=r"model\.dim: checkpoint 12, now 16"):
        _load(saved, expected_config=other)
    _load(saved, expected_config=json.loads(json.dumps(CONFIG)))  # equal after JSON: fine
