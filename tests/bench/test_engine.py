"""`tlt bench engine`'s pure logic: the headline keys it derives from one run's phases (no engine runs here;
the bench itself needs vLLM, in .venv-engines)."""

from __future__ import annotations

from bench.engine import Tally, identical, summarize
from bench.record import pct


def rep(tps: float, acc: float = 1.0) -> dict:
    return {"tokens_per_s": tps, "mean_accepted_length": acc, "seconds": 1.0, "tokens": 1}


def phase(ours: float, vllm: float, ours_spec: float, vllm_spec: float) -> dict:
    return {f"batch{b}": {"ours_plain": rep(ours * b), "vllm_plain": rep(vllm * b),
                          "ours_spec": rep(ours_spec * b, 2.2), "vllm_spec": rep(vllm_spec * b, 2.0)} for b in (1, 4)}


def test_headline_ratios_come_from_the_equal_threads_phase_and_best_from_all():
    result = summarize({"phases": {"1": phase(10, 8, 14, 12), "2": phase(12, 16, 15, 20)}}, (1, 2))
    assert result["equal_threads"] == 1
    assert result["ours_plain_vs_vllm_plain_b1"] == 1.25  # 10 / 8, not the 2-thread phase's 12 / 16
    assert result["ours_plain_vs_vllm_plain_b4"] == 1.25
    assert result["vllm_spec_speedup_b1"] == 1.5  # 12 / 8
    assert result["ours_spec_speedup_b1"] == 1.4
    assert result["accepted_length_vllm_vs_ours_b1"] == round(2.0 / 2.2, 3)
    assert result["best"]["ours_plain_b1"] == {"tokens_per_s": 12, "threads": 2}
    assert result["best"]["vllm_plain_b4"] == {"tokens_per_s": 64, "threads": 2}
    assert result["ours_best_vs_vllm_best_plain_b1"] == 0.75  # 12 / 16


def test_percentile_and_identity():
    values = [0.1] * 19 + [1.2]
    assert pct(values, 0.99) == 1.2 and pct(values, 0.5) == 0.1 and pct([], 0.5) is None
    a, b = Tally(outputs=[[1, 2], [3]]), Tally(outputs=[[1, 2], [4]])
    assert identical(a, b) == 0.5
    assert Tally(seconds=2.0, tokens=10, seq_steps=5).report()["mean_accepted_length"] == 2.0
