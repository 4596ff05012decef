"""bench/drift.py: the drift measure's statistics (pure logic) and one run of it end to end on a tiny policy."""

from __future__ import annotations

import math

import pytest

from bench.drift import drift_part, eval_prompts, per_prompt, ratio, ratio_se, recovered_fraction
from bench.gpu_decode import ByteTokenizer
from drafter.decode.engine import Engine
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import new_head
from tests.conftest import tiny_model


def test_the_accepted_length_is_a_ratio_of_sums_with_its_standard_error():
    assert ratio([(10, 5.0), (30, 10.0)]) == pytest.approx(40 / 15)
    assert ratio_se([(10, 5.0), (20, 10.0), (6, 3.0)]) == 0.0  # every prompt at 2.0: no spread
    # r = 40/15; residuals t - r s = -10/3, +10/3; sqrt(((10/3)^2 * 2 / 1) / 2) / mean steps 7.5 = 4/9
    assert ratio_se([(10, 5.0), (30, 10.0)]) == pytest.approx(4 / 9)
    spread = [(10, 5.0), (30, 10.0), (12, 12.0), (40, 10.0)]
    assert 0 < ratio_se(spread * 4) < 0.6 * ratio_se(spread)  # the same spread over more prompts: narrower
    assert math.isnan(ratio_se([(10, 5.0)]))


def test_the_recovered_fraction_and_its_paired_bootstrap_error():
    before, frozen = [(20, 10.0)] * 8, [(10, 10.0)] * 8  # 2.0 -> 1.0
    adapted = [(15, 10.0)] * 8  # 1.5: half recovered, on every prompt alike
    assert recovered_fraction(before, frozen, adapted) == (pytest.approx(0.5), pytest.approx(0.0, abs=1e-9))
    noisy = [(12, 10.0), (18, 10.0)] * 4  # 1.5 on average, prompts disagree
    frac, se = recovered_fraction(before, frozen, noisy)
    assert frac == pytest.approx(0.5) and se > 0.1
    assert recovered_fraction(before, before, adapted) == (None, None)  # no loss, nothing to recover


def test_the_drift_part_measures_each_draft_greedy_and_at_t1_with_errors():
    policy = tiny_model(vocab_size=64, seed=4)
    tok = ByteTokenizer(policy.cfg.vocab_size)
    result: dict = {}
    head = new_head(policy, None, None)
    prompts = eval_prompts(tok, 3)
    assert len(prompts) == 3 and len(eval_prompts(tok, 20)) == 20  # past the 16 fixed ones, templated
    new_policy, adapted, buffer = drift_part(result, policy, tok, Engine(policy, tok), prompts, head, 2, 8, 1, 1e-4,
                                             3, 3e-4, 0.3, None, scratch_seconds=0.3)
    assert new_policy is not policy and adapted is not head and len(buffer) == 3
    for suffix in ("", "_t1"):
        for stage in ("before", "frozen", "adapted", "scratch"):
            assert result[f"drift_{stage}_accepted_length{suffix}"] >= 1.0
            assert result[f"drift_{stage}_accepted_length{suffix}_se"] >= 0.0
        assert f"drift_recovered_fraction{suffix}" in result and f"drift_recovered{suffix}_se" in result
    assert result["drift_eval_prompts"] == 3 and result["drift_adapt_steps"] >= 1 and result["drift_adapt_epochs"] > 0


def test_prompts_measured_together_accept_what_they_accept_one_at_a_time():
    policy = tiny_model(vocab_size=64, seed=5)
    tok = ByteTokenizer(policy.cfg.vocab_size)
    engine, prompts = Engine(policy, tok), eval_prompts(tok, 5)
    drafter = EagleDrafter(policy, new_head(policy, None, None), None)
    for temperature in (0.0, 1.0):  # at T=1 with each prompt's seed: the same samples, the same verdicts
        alone = per_prompt(engine, prompts, 3, drafter, temperature, 12, batch_size=1)
        together = per_prompt(engine, prompts, 3, drafter, temperature, 12, batch_size=4)  # a batch of 4, then 1
        assert together == alone and all(t == 12 and 1 <= s <= 12 for t, s in alone)
    assert any(s < 12 for _, s in alone)  # some drafts accepted (the untrained head's, at T=1): steps vary
