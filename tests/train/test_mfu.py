"""MFU: the FLOP count by hand on the tiny preset, the peak table, the fields of a run's output."""

import dataclasses
import json
import re

import pytest
import torch

from ptxtrain.model import DeepSeekV3, DeepSeekV3Config, get_preset
from ptxtrain.train import loop as loop_mod
from ptxtrain.train import read_metrics, train
from ptxtrain.train.metrics import format_summary
from ptxtrain.train.mfu import (
    achieved_flops,
    flops_per_token_by_part,
    model_flops_per_token,
    peak_bf16_flops,
)
from tests.train.test_loop import SMALL, _args

TINY = get_preset("tiny")
# The tiny preset's activated parameters, counted by hand (dim 128, 4 heads, qk 32+16, v 32):
#   MLA: wq_a 128*96 + q_norm 96 + wq_b 96*4*48 + wkv_a 128*(64+16) + kv_norm 64
#        + wkv_b 64*4*(32+32) + wo 4*32*128                                    =  73,888
#   dense block: 2 norms 256 + MLA + MLP 3*128*384                             = 221,600
#   MoE block, activated: 256 + MLA + router 8*128 + shared 3*128*128
#        + 2 routed experts 2*3*128*128                                        = 222,624
#   main: embedding 256*128 + final norm 128 + head 128*256 + dense block
#        + 3 MoE blocks                                                        = 955,136
#   MTP: hnorm + enorm + norm 3*128 + proj 256*128 + one MoE block             = 255,776
TINY_ACTIVATED = 955_136 + 255_776
TINY_EMBEDDING = 256 * 128


def test_tiny_activated_count_is_the_models():
    with torch.device("meta"):
        n = DeepSeekV3(TINY).num_params()
    assert (n["activated"], n["embedding"]) == (TINY_ACTIVATED, TINY_EMBEDDING)


@pytest.mark.parametrize("seq_len", [1, 77, 128, 256])
def test_flops_per_token_of_tiny_by_hand(seq_len):
    # matmul parameters: activated - embedding (a lookup) + the head again (MTP reuses it)
    matmul = TINY_ACTIVATED - TINY_EMBEDDING + 256 * 128
    # attention: 6 x (4 layers + the MTP block) x T x 4 heads x (48 + 32) / 2
    attention = 6 * 5 * seq_len * 4 * 80 // 2
    assert model_flops_per_token(TINY, seq_len) == 6 * matmul + attention
    if seq_len == 128:
        assert model_flops_per_token(TINY, 128) == 7_879_872  # the docstring's example


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_of_tiny_by_part(tied):
    """Each part by hand (the block counts above), and the parts add up to the whole."""
    cfg = dataclasses.replace(TINY, tie_embeddings=tied)
    attention = 6 * 128 * 4 * 80 // 2  # one block at T = 128
    parts = flops_per_token_by_part(cfg, 128)
    assert parts.embed == 0  # a lookup, tied or not (the head's multiply is the head's)
    assert parts.layers == (6 * 221_600 + attention,) + (6 * 222_624 + attention,) * 3
    assert parts.head == 6 * (128 + 256 * 128)  # final norm + head
    assert parts.mtp == 6 * (255_776 + 256 * 128) + attention  # its block, then the head again
    assert parts.total == model_flops_per_token(cfg, 128) == 7_879_872
    assert flops_per_token_by_part(dataclasses.replace(TINY, mtp_depth=0), 128).mtp == 0


def test_flops_per_token_without_mtp_and_with_tied_embeddings():
    no_mtp = dataclasses.replace(TINY, mtp_depth=0)
    # main model only: 955,136 - embedding; 4 layers of attention
    want = 6 * (955_136 - TINY_EMBEDDING) + 6 * 4 * 128 * 4 * 80 // 2
    assert model_flops_per_token(no_mtp, 128) == want == 6_025_728
    # Tying shares the matrix but the head still multiplies by it: the same FLOPs.
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    assert model_flops_per_token(tied, 128) == model_flops_per_token(TINY, 128)
    # An odd qk + v (48 + 31) and odd lengths: the attention term, 6 x L x T x H x (qk + v) / 2
    # = 3 x 4 x T x 1 x 79, is exact in integers (the parameter term does not depend on T).
    odd = dataclasses.replace(TINY, mtp_depth=0, n_heads=1, v_head_dim=31)
    assert model_flops_per_token(odd, 3) - model_flops_per_token(odd, 1) == 3 * 4 * 79 * 2


def test_flops_per_token_bad_input():
    with pytest.raises(ValueError, match="seq_len must be > 0, got 0"):
        model_flops_per_token(TINY, 0)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        model_flops_per_token(TINY, 128.0)
    with pytest.raises(TypeError, match="seq_len must be an int"):
        model_flops_per_token(TINY, True)
    with pytest.raises(TypeError, match="config must be a DeepSeekV3Config"):
        model_flops_per_token(TINY.to_dict(), 128)


@pytest.mark.parametrize(
    ("name", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 SXM5 80GB", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H200", 989),
        ("NVIDIA H800", 989),
        ("nvidia h200", 989),  # case does not matter
        ("NVIDIA H100 NVL", None),  # other clocks and power: not guessed
        ("NVIDIA H200 NVL", None),
        ("NVIDIA H800 PCIe", None),
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA A100-SXM4-80GB", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
    ],
)
def test_peak_table_by_device_name(name, tflops):
    assert peak_bf16_flops(name) == (None if tflops is None else tflops * 1e12)


def test_peak_of_a_device(monkeypatch):
    assert peak_bf16_flops(torch.device("cpu")) is None
    asked = []

    def name_of(device):
        asked.append(device)
        return "NVIDIA H200"

    monkeypatch.setattr(torch.cuda, "get_device_name", name_of)
    assert peak_bf16_flops(torch.device("cuda", 1)) == 989e12
    assert asked == [torch.device("cuda", 1)]
    with pytest.raises(TypeError, match=r"device must be a torch\.device or a device name"):
        peak_bf16_flops(0)


def test_achieved_flops():
    g = torch.Generator().manual_seed(3)
    per_token, tokens_per_s = (float(v) for v in torch.rand(2, generator=g) * 1e9 + 1e6)
    got = achieved_flops(per_token, tokens_per_s, 989e12, devices=4)
    assert got["model_tflops"] == pytest.approx(per_token * tokens_per_s / 4 / 1e12, rel=1e-12)
    assert got["mfu"] == pytest.approx(got["model_tflops"] / 989, rel=1e-12)
    assert achieved_flops(per_token, tokens_per_s, None)["mfu"] is None
    assert achieved_flops(per_token, None, 989e12) == {"model_tflops": None, "mfu": None}


def test_records_and_summary_carry_mfu(tmp_path, monkeypatch, capsys):
    config = DeepSeekV3Config.from_dict({**TINY.to_dict(), **SMALL})
    per_token = model_flops_per_token(config, 16)
    # On this CPU no peak is known: MFU is null, the model TFLOP/s are still reported.
    s = train(_args(tmp_path / "cpu", steps=3, eval_every=0, ckpt_every=0), model_overrides=SMALL)
    recs = read_metrics(tmp_path / "cpu" / "metrics.jsonl")
    assert s["flops_per_token"] == per_token and s["peak_tflops"] is None and s["mfu"] is None
    assert s["model_tflops"] == pytest.approx(per_token * s["steady_tokens_per_s"] / 1e12)
    for r in recs:
        assert r["mfu"] is None
        assert r["model_tflops"] == pytest.approx(per_token * r["tokens_per_s"] / 1e12)
    saved = json.loads((tmp_path / "cpu" / "summary.json").read_text())
    assert {k: saved[k] for k in ("mfu", "flops_per_token", "peak_tflops")} == {
        "mfu": None,
        "flops_per_token": per_token,
        "peak_tflops": None,
    }
    assert "MFU" in capsys.readouterr().out
    # As on an H200 (the table's peak): every record and the summary get a fraction.
    monkeypatch.setattr(loop_mod, "peak_bf16_flops", lambda device: 989e12)
    kw = dict(steps=3, eval_every=0, ckpt_every=0, grad_accum_steps=2)
    s = train(_args(tmp_path / "h200", **kw), model_overrides=SMALL)
    assert s["tokens_per_step"] == 2 * 4 * 16  # both micro-batches' tokens count
    assert s["peak_tflops"] == 989
    assert s["mfu"] == pytest.approx(per_token * s["steady_tokens_per_s"] / 989e12)
    for r in read_metrics(tmp_path / "h200" / "metrics.jsonl"):
        assert r["mfu"] == pytest.approx(per_token * r["tokens_per_s"] / 989e12)
        assert 0 < r["mfu"] < 1e-3  # a 2-core CPU against an H200's peak
    assert "% of the 989 TFLOPS dense BF16 peak" in format_summary(s)


def test_summary_mfu_row():
    s = {
        "preset": "medium", "precision": "bf16", "out": "runs/m", "step": 20, "steps_run": 20,
        "tokens_run": 1_310_720, "tokens_per_step": 65_536, "grad_accum_steps": 4,
        "time_s": 40.0, "tokens_per_s": 32_768.0, "first_loss": 5.5, "last_loss": 3.0,
        "flops_per_token": 4_899_852_288, "peak_tflops": 989.0, "model_tflops": 161.5,
        "mfu": 0.1633,
    }  # fmt: skip
    text = format_summary(s)
    assert "MFU" in text and "16.3% of the 989 TFLOPS dense BF16 peak" in text, text
    assert "162 model TFLOP/s per device" in text and "4.9 GFLOP/token" in text
    assert "(65,536/step in 4 micro-batches)" in text
    text = format_summary({**s, "mfu": None, "peak_tflops": None})
    assert "n/a (no dense BF16 peak known for this device" in text
    text = format_summary({**s, "mfu": None, "peak_tflops": None, "model_tflops": None})
    assert "n/a (needs 2 steps or more" in text


@pytest.mark.gpu
def test_mfu_on_this_gpu(tmp_path):
    # The table must know the GPUs it claims (a name format change would silently give "n/a").
    name = torch.cuda.get_device_name()
    peak = peak_bf16_flops(torch.device("cuda"))
    upper = name.upper()
    if re.search(r"\bH(100|200|800)\b", upper) and "NVL" not in upper and "H800 PCIE" not in upper:
        assert peak in (989e12, 756e12), name
    kw = dict(device="cuda", steps=4, eval_every=0, ckpt_every=0)
    s = train(_args(tmp_path / "run", **kw), model_overrides=SMALL)
    for r in read_metrics(tmp_path / "run" / "metrics.jsonl"):
        assert (r["mfu"] is None) == (peak is None) and r["model_tflops"] > 0
    if peak is not None:
        assert 0 < s["mfu"] < 1  # a fraction of the peak, not a percentage
        assert s["mfu"] == pytest.approx(s["model_tflops"] * 1e12 / peak)
