"""Pipeline-parallel training arguments: stage splitting, placement and clear errors (no spawn).

Every check here depends on the arguments only, so under torchrun every rank raises the same
error before any communication.
"""

from __future__ import annotations

import pytest

from ptxtrain.cli import _train_args_from as train_args_from
from ptxtrain.cli import build_parser, main
from ptxtrain.model import build_model, get_preset
from ptxtrain.parallel.stages import (
    check_pipeline,
    num_stages,
    owner_of_stage,
    stages_of_rank,
)
from ptxtrain.train import TrainArgs, TrainConfigError, train
from ptxtrain.train.pipeline_stage import DeepSeekV3Stage, split_layers


def test_split_layers_and_placement():
    assert split_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # Uneven: the first n_layers % n_stages stages take one more layer, so the two stages of a
    # DualPipe rank (r, PP-1-r) or a DualPipeV rank (r, 2PP-1-r) always sum to the same count.
    assert split_layers(6, 4) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    twelve = split_layers(12, 8)
    assert [len(r) for r in twelve] == [2, 2, 2, 2, 1, 1, 1, 1]
    assert [i for r in twelve for i in r] == list(range(12))
    assert {len(twelve[r]) + len(twelve[7 - r]) for r in range(4)} == {3}  # DualPipeV, PP=4
    assert {len(twelve[r]) + len(twelve[7 - r]) for r in range(8)} == {3}  # DualPipe, PP=8
    assert split_layers(5, 5) == [range(i, i + 1) for i in range(5)]
    with pytest.raises(ValueError, match="n_layers=3 cannot be split into 4"):
        split_layers(3, 4)
    with pytest.raises(ValueError, match="n_stages must be an int >= 1"):
        split_layers(3, 0)
    # 1F1B: rank r holds stage r; DualPipe: r and PP-1-r; DualPipeV: r and 2PP-1-r.
    assert [stages_of_rank("1f1b", r, 4) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert [stages_of_rank("dualpipe", r, 4) for r in range(4)] == [(0, 3), (1, 2), (2, 1), (3, 0)]
    assert [stages_of_rank("dualpipev", r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert num_stages("dualpipev", 2) == 4 and num_stages("dualpipe", 2) == 2
    # Every stage has exactly one owner, and the owner holds it.
    for sched, pp in (("1f1b", 4), ("dualpipe", 4), ("dualpipev", 3)):
        for s in range(num_stages(sched, pp)):
            assert s in stages_of_rank(sched, owner_of_stage(sched, s, pp), pp)


def test_stages_share_the_model_and_cover_it():
    cfg = type(get_preset("tiny")).from_dict({**get_preset("tiny").to_dict(), "mtp_depth": 0})
    model = build_model(cfg, seed=1)
    stages = [DeepSeekV3Stage(model, s, 4) for s in range(4)]
    ids = {id(p) for st in stages for p in st.parameters()}
    assert ids == {id(p) for p in model.parameters()}  # each parameter in exactly one stage
    assert sum(len(list(st.parameters())) for st in stages) == len(list(model.parameters()))
    assert stages[0].embed is model.embed and stages[-1].head is model.head


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(pp=3, schedule="dualpipe"), "even number of pipeline ranks"),
        (dict(pp=2, schedule="dualpipe", num_chunks=2), "num_chunks must be an int >= 4"),
        (dict(pp=2, schedule="dualpipe", num_chunks=5, batch_size=10), "must be even"),
        (dict(pp=2, schedule="dualpipev", num_chunks=3), "num_chunks must be an int >= 4"),
        (dict(pp=2, schedule="1f1b", num_chunks=3), "must be divisible by the 3"),
        (dict(pp=2, schedule="gpipe"), "--schedule must be one of"),
        (dict(pp=0), "--pp must be an integer >= 1"),
        (dict(pp=1, timeline=True), "--timeline .* needs --pp > 1"),
        (dict(pp=1, num_chunks=4), "--num-chunks .* needs --pp > 1"),
    ],
)
def test_bad_pipeline_arguments(kw, match):
    with pytest.raises(TrainConfigError, match=match):
        TrainArgs(**kw).validate()


def test_check_pipeline_layers():
    check_pipeline("dualpipev", 2, 4, n_layers=8)
    check_pipeline("dualpipev", 2, 4, n_layers=6)  # uneven: stages of 2, 2, 1, 1 layers
    with pytest.raises(ValueError, match="3 layers cannot be split into 4 pipeline stages"):
        check_pipeline("dualpipev", 2, 4, n_layers=3)


@pytest.mark.parametrize(
    ("kw", "overrides", "match"),
    [
        (dict(), {}, "multi-token prediction .* --no-mtp"),  # tiny has MTP on
        (dict(schedule="dualpipev", mtp=False), {"n_layers": 2}, "cannot be split into 4"),
        (dict(mtp=False), {"tie_embeddings": True}, "tie_embeddings"),
        (dict(mtp=False), {}, "needs 2 processes"),  # no torchrun, no process group
    ],
)
def test_train_refuses_before_any_communication(tmp_path, monkeypatch, kw, overrides, match):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = TrainArgs(pp=2, out=str(tmp_path), device="cpu", progress=False, **kw)
    with pytest.raises(TrainConfigError, match=match):
        train(args, model_overrides=overrides)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_pipeline_flags(capsys, monkeypatch):
    ns = build_parser().parse_args(
        ["train", "--pp", "2", "--schedule", "1f1b", "--num-chunks", "8", "--timeline", "--no-mtp"]
    )
    a = train_args_from(ns)
    assert (a.pp, a.schedule, a.num_chunks, a.timeline, a.mtp) == (2, "1f1b", 8, True, False)
    d = train_args_from(build_parser().parse_args(["train"]))
    assert (d.pp, d.num_chunks, d.timeline, d.mtp) == (1, None, False, True)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--pp", "2", "--no-mtp", "--device", "cpu"]) == 2
    assert "torchrun --nproc-per-node 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        # 12 sequences split over 2 pipelines of 4 micro-batches: 1.5 per micro-batch
        (dict(batch_size=12), "--batch-size 12 must be divisible by --ep 2 x the 4 micro-batches"),
        (dict(batch_size=8, num_chunks=8), "must be divisible by --ep 2 x the 8 micro-batches"),
    ],
)
def test_bad_pp_ep_arguments(kw, match):
    with pytest.raises(TrainConfigError, match=match):
        TrainArgs(pp=2, ep=2, mtp=False, **kw).validate()
    TrainArgs(pp=2, ep=2, mtp=False, batch_size=16).validate()  # 2 pipelines x 4 chunks x 2


@pytest.mark.parametrize(
    ("kw", "overrides", "match"),
    [
        (dict(ep=2), {}, "--pp 2 --ep 2 needs 4 processes"),  # this process is a world of 1
        (dict(ep=3, batch_size=24), {}, "n_routed_experts=8 must be divisible by --ep"),
        (dict(ep=2), {"n_layers": 1, "n_dense_layers": 0}, "cannot be split into 2"),
    ],
)
def test_train_pp_ep_refuses_before_any_communication(tmp_path, monkeypatch, kw, overrides, match):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = TrainArgs(pp=2, mtp=False, out=str(tmp_path), device="cpu", progress=False, **kw)
    with pytest.raises(TrainConfigError, match=match):
        train(args, model_overrides=overrides)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_pp_ep_flags(capsys, monkeypatch):
    a = train_args_from(build_parser().parse_args(["train", "--pp", "2", "--ep", "2"]))
    assert (a.pp, a.ep) == (2, 2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--pp", "2", "--ep", "2", "--no-mtp", "--device", "cpu"]) == 2
    assert "torchrun --nproc-per-node 4" in capsys.readouterr().err
