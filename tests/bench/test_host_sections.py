"""benchmarks/host_sections.py: the timers (wrap, recursion guard, restore) and a CPU smoke run."""

from __future__ import annotations

import json
import sys
import types

import pytest

from benchmarks import host_sections as hs


def test_sections_wrap_count_once_and_restore(monkeypatch):
    mod = types.ModuleType("hs_fake")

    def fib(n):
        return n if n < 2 else mod.fib(n - 1) + mod.fib(n - 2)

    class Box:
        @staticmethod
        def twice(x):
            return 2 * x

    mod.fib, mod.Box = fib, Box
    monkeypatch.setitem(sys.modules, "hs_fake", mod)
    sections = hs.Sections()
    done = sections.install(["hs_fake:fib", "hs_fake:Box.twice", "hs_fake:missing", "nope:x"])
    assert done == ["hs_fake:fib", "hs_fake:Box.twice"]  # missing targets are skipped
    assert mod.fib(10) == 55 and Box.twice(4) == 8
    # The recursion guard counts the outermost call only.
    assert sections.calls == {"hs_fake:fib": 1, "hs_fake:Box.twice": 1}
    rows = sections.table(per=1)
    assert {r["name"] for r in rows} == set(done) and all(r["ms"] >= 0 for r in rows)
    sections.uninstall()
    assert mod.fib is fib and Box.__dict__["twice"].__func__(3) == 6
    mod.fib(5)
    assert sections.calls["hs_fake:fib"] == 1  # no longer timed


@pytest.mark.slow
def test_host_sections_cpu_smoke(tmp_path, monkeypatch, capsys):
    out = tmp_path / "hs.json"
    argv = ["host_sections", "--device", "cpu", "--preset", "tiny", "--batch", "1", "--seq",
            "8", "--warmup", "1", "--steps", "1", "--linear", "16", "32", "32", "--reps", "1",
            "--json", str(out)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    hs.main()
    record = json.loads(out.read_text())
    assert [c["precision"] for c in record["cases"]] == ["bf16", "fp8"]
    names = {r["name"] for r in record["cases"][1]["sections"]}
    assert "ptxtrain.nn.fp8_linear:_Fp8LinearFunction.forward" in names
    assert record["linear"]["fp8"]["fwd_us"] > 0
    assert "Linear 16x32x32" in capsys.readouterr().out
