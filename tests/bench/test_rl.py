"""`tlt bench rl`'s figures from step records (pure arithmetic; the bench itself runs real jobs)."""

from __future__ import annotations

import math

import pytest

from bench.rl import bucket_ratios, figures, pooled_reward


def step(rl_step, rollout, update, reward, acc, buckets, n=4, std=0.5):
    return {"rl_step": rl_step, "timings": {"weight_sync": 1.0, "rollout": rollout, "update": update},
            "tail_s": rollout / 2, "mean_accepted_length": acc, "mean_reward": reward, "reward_std": std,
            "num_rollouts": n, "bucket_throughput": buckets, "idle_worker_s": 3.0, "response_lengths": {},
            "draft_versions": {}}


def test_figures_are_ratios_of_sums_and_last_step_means():
    plain = [step(0, 30.0, 5.0, 0.25, 1.0, {"1": [100, 10.0], "9-16": [400, 4.0]}),
             step(1, 30.0, 5.0, 0.25, 1.0, {"1": [100, 10.0]})]
    frozen = [step(0, 20.0, 5.0, 0.25, 2.0, {"1": [150, 10.0], "9-16": [396, 4.0]}),
              step(1, 20.0, 5.0, 0.25, 2.0, {"1": [150, 10.0]})]
    tlt = [step(0, 20.0, 5.0, 0.25, 2.0, {"1": [150, 10.0], "9-16": [392, 4.0]}),
           step(1, 10.0, 5.0, 0.25, 3.0, {"1": [200, 10.0]})]
    runs = {"a": [{"steps": plain, "drafts": {}}], "b": [{"steps": frozen, "drafts": {}}],
            "c": [{"steps": tlt, "drafts": {"idle_worker_s": 6.0, "reclaimed_worker_s": 5.4}}]}
    f = figures(runs)
    assert f["rollout_speedup"] == pytest.approx(60 / 30) and f["frozen_rollout_speedup"] == pytest.approx(60 / 40)
    assert f["step_speedup"] == pytest.approx((60 + 10 + 2) / (30 + 10 + 2))
    assert f["tlt_vs_frozen_rollout_speedup_last_step"] == pytest.approx(2.0)
    assert (f["accepted_length_last_step_tlt"], f["accepted_length_last_step_frozen"]) == (3.0, 2.0)
    assert f["reclaimed_ratio"] == pytest.approx(0.9) and f["reward_delta_se"] == 0.0
    assert f["bucket_ratio_vs_plain"]["tlt"] == pytest.approx({"1": 17.5 / 10, "9-16": 0.98})
    assert f["min_bucket_ratio_vs_plain"] == pytest.approx(0.98)
    assert f["min_bucket_ratio_vs_plain_frozen"] == pytest.approx(0.99)
    assert f["per_step_mean"]["tlt"]["rollout_s"] == [20.0, 10.0]


def test_pooled_reward_and_its_standard_error():
    mean, se, n = pooled_reward([step(0, 1, 1, 0.0, 1, {}, n=4, std=0.0), step(1, 1, 1, 1.0, 1, {}, n=4, std=0.0)])
    assert (mean, n) == (0.5, 8) and se == pytest.approx(math.sqrt(0.25 / 7))
    assert pooled_reward([]) == (0.0, 0.0, 0)


def test_a_bucket_counts_only_once_both_arms_decoded_in_it_long_enough():
    arm = [step(0, 1, 1, 0, 1, {"1": [10, 1.0], "2": [50, 5.0]})]
    plain = [step(0, 1, 1, 0, 1, {"1": [30, 1.0], "2": [40, 5.0]})]
    assert bucket_ratios(arm, plain) == {"2": pytest.approx(1.25)}  # bucket 1: a second each, too little
