"""Pipeline-parallel training arguments: stage placement, cutting and clear errors (no spawn).

Every check here depends on the arguments only, so under torchrun every rank raises the same
error before any communication.
"""

from __future__ import annotations

import pytest

from ptxtrain.cli import _train_args_from as train_args_from
from ptxtrain.cli import build_parser, main
from ptxtrain.model import build_model, get_preset
from ptxtrain.parallel.stages import (
    num_stages,
    owner_of_stage,
    stages_of_rank,
)
from ptxtrain.train import TrainArgs, TrainConfigError, train
from ptxtrain.train.pipeline_layout import even_layout, layer_ranges
from ptxtrain.train.pipeline_stage import DeepSeekV3Stage


def test_even_layout_and_placement():
    assert layer_ranges(even_layout(8, 4)) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # Uneven: the first n_layers % n_stages stages take one more layer, so the two stages of a
    # DualPipe rank (r, PP-1-r) or a DualPipeV rank (r, 2PP-1-r) always sum to the same count.
    assert layer_ranges(even_layout(6, 4)) == [range(0, 2), range(2, 4), range(4, 5), range(5, 6)]
    twelve = even_layout(12, 8)
    assert twelve == (2, 2, 2, 2, 1, 1, 1, 1)
    assert [i for r in layer_ranges(twelve) for i in r] == list(range(12))
    assert {twelve[r] + twelve[7 - r] for r in range(4)} == {3}  # DualPipeV, PP=4
    assert {twelve[r] + twelve[7 - r] for r in range(8)} == {3}  # DualPipe, PP=8
    assert even_layout(5, 5) == (1,) * 5
    assert layer_ranges((0, 3, 0)) == [range(0, 0), range(0, 3), range(3, 3)]
    with pytest.raises(ValueError, match="n_layers=3 cannot be split evenly into 4"):
        even_layout(3, 4)
    with pytest.raises(ValueError, match="n_stages must be an int >= 1"):
        even_layout(3, 0)
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
    for layout in ((1, 1, 1, 1), (0, 1, 3, 0), (2, 1, 1, 0)):
        stages = [DeepSeekV3Stage(model, s, layout) for s in range(4)]
        ids = {id(p) for st in stages for p in st.parameters()}
        assert ids == {id(p) for p in model.parameters()}  # each parameter in exactly one stage
        assert sum(len(list(st.parameters())) for st in stages) == len(list(model.parameters()))
        assert stages[0].embed is model.embed and stages[-1].head is model.head
        assert [len(st.layers) for st in stages] == list(layout)
        assert stages[2].layers[0] is model.layers[layout[0] + layout[1]]
    for bad, err, match in (
        ((1, 0, 2, 1), ValueError, "stage 1 has 0 decoder layers, needs >= 1"),
        ((1, 1, 1), ValueError, "sums to 3 decoder layers, the model has n_layers=4"),
        ((2, 2.0), TypeError, "layout must be a list or tuple of ints"),
    ):
        with pytest.raises(err, match=match):
            DeepSeekV3Stage(model, 0, bad)
    with pytest.raises(ValueError, match=r"index must be an int in \[0, 2\)"):
        DeepSeekV3Stage(model, 2, (2, 2))


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


@pytest.mark.parametrize(
    ("kw", "overrides", "match"),
    [
        (dict(), {}, "multi-token prediction .* --no-mtp"),  # tiny has MTP on
        # 4 stages: the two between the first and the last need a layer each
        (dict(schedule="dualpipev", mtp=False), {"n_layers": 1}, "cannot be split into 4"),
        (dict(mtp=False, pp_layout=(1, 2)), {}, "--pp-layout 1,2: layout 1,2 sums to 3"),
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
        (
            dict(ep=2, schedule="dualpipev"),
            {"n_layers": 1, "n_dense_layers": 0},
            "cannot be split into 4",
        ),
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
