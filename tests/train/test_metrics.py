"""metrics.jsonl writing and truncation on resume, the loss-curve PNG, the summary table."""

import json
import math

import torch

from ptxtrain.train.metrics import (
    MetricsWriter,
    format_summary,
    json_ready,
    plot_loss_curve,
    read_metrics,
)


def _records(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise = torch.rand(n, generator=g).tolist()
    return [
        {"step": i + 1, "loss": 5.0 / (1 + 0.1 * i) + 0.1 * noise[i]}
        | ({"val_loss": 4.0 / (1 + 0.1 * i)} if (i + 1) % 5 == 0 else {})
        for i in range(n)
    ]


def test_writer_fresh_and_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = _records(8)
    with MetricsWriter(path) as w:
        for r in recs:
            w.write(r)
    assert read_metrics(path) == recs
    path.write_text(path.read_text() + '{"step": 9, "lo')  # torn last line of a crash
    assert read_metrics(path) == recs
    with MetricsWriter(path, keep_until=5) as w:  # resume from the step-5 checkpoint
        w.write({"step": 6, "loss": 1.5})
    assert read_metrics(path) == [*recs[:5], {"step": 6, "loss": 1.5}]
    with MetricsWriter(path):  # a fresh run empties the file
        pass
    assert read_metrics(path) == []


def test_json_ready_converts_tensors_and_keeps_nan():
    obj = {"a": torch.tensor(2.5), "b": torch.arange(3), 1: (torch.tensor(7),), "n": math.nan}
    out = json.loads(json.dumps(json_ready(obj)))
    assert out["a"] == 2.5 and out["b"] == [0, 1, 2] and out["1"] == [7]
    assert math.isnan(out["n"])


def test_plot_writes_png(tmp_path):
    path = plot_loss_curve(_records(40), tmp_path / "loss.png", entropy=3.3, title="t")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    # Works without val points or entropy too (e.g. --eval-every 0).
    plot_loss_curve([{"step": 1, "loss": 5.0}], tmp_path / "one.png")
    assert (tmp_path / "one.png").stat().st_size > 0


def test_summary_table_lists_the_numbers():
    s = {
        "preset": "tiny", "precision": "fp8", "out": "runs/tiny-fp8", "step": 300,
        "steps_run": 300, "tokens_run": 614400, "tokens_per_step": 2048, "time_s": 123.4,
        "tokens_per_s": 4979.0, "first_loss": 5.55, "last_loss": 1.9, "best_val_loss": 1.85,
        "last_val_loss": 1.87, "unigram_entropy": 3.3028, "optimizer_bytes_per_param": 8.01,
        "training_bytes_per_param": 14.01, "peak_memory_bytes": None,
    }  # fmt: skip
    text = format_summary(s)
    for needle in ("300 run", "614,400", "123.4 s", "4,979 tokens/s", "5.5500", "1.8500",
                   "3.3028", "8.01 B/param", "14.01", "runs/tiny-fp8"):  # fmt: skip
        assert needle in text, needle
    assert "CUDA" not in text
    assert "MiB" in format_summary({**s, "peak_memory_bytes": 3 * 2**20})
    steady = format_summary({**s, "steady_tokens_per_s": 9100.0, "first_step_s": 41.25})
    assert "4,979 tokens/s (9,100 after the first step, which took 41.2 s)" in steady
    ranks = format_summary({**s, "steady_tokens_per_s": 9100.0, "first_step_s": 41.25, "ranks": 4})
    assert "; 2,275 per rank over 4 ranks" in ranks  # steady figure / ranks
    per_rank = format_summary(
        {**s, "peak_memory_bytes": 3 * 2**20, "peak_memory_bytes_per_rank": [3 * 2**20, 5 * 2**20]}
    )
    assert "max 5.0 MiB (per rank: 3, 5)" in per_rank
