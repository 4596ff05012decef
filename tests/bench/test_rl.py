"""`tlt bench rl`'s figures from step records and its time budget (pure arithmetic; the bench itself runs real
jobs: test_rl_device.py, test_rl_gpu_path.py)."""

from __future__ import annotations

import math

import pytest

from bench.rl import over_budget
from bench.rl_figures import bucket_ratios, figures, goals_met, met, paired_steps, pooled_reward, step_row


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


def test_paired_steps_count_the_steps_whose_rollouts_every_arm_shared():
    def work(tokens, longest, reward):
        return {"num_tokens": tokens, "response_lengths": {"median": 20.0, "max": longest}, "mean_reward": reward}

    runs = {"a": [{"steps": [work(900, 300, 0.25), work(800, 200, 0.5)]}, {"steps": [work(700, 90, 0.0)]}],
            "b": [{"steps": [work(900, 300, 0.25), work(800, 201, 0.5)]}, {"steps": [work(700, 90, 0.0)]}],
            "c": [{"steps": [work(900, 300, 0.25), work(800, 200, 0.75)]}, {"steps": [work(700, 90, 0.0)]}]}
    assert paired_steps(runs) == {"paired": 2, "steps": 3}  # step 2 of repeat 1 differs in b's longest, c's reward
    assert paired_steps({"a": [], "b": []}) == {"paired": 0, "steps": 0}


def test_pooled_reward_and_its_standard_error():
    mean, se, n = pooled_reward([step(0, 1, 1, 0.0, 1, {}, n=4, std=0.0), step(1, 1, 1, 1.0, 1, {}, n=4, std=0.0)])
    assert (mean, n) == (0.5, 8) and se == pytest.approx(math.sqrt(0.25 / 7))
    assert pooled_reward([]) == (0.0, 0.0, 0)


def test_a_bucket_counts_only_once_both_arms_decoded_in_it_long_enough():
    arm = [step(0, 1, 1, 0, 1, {"1": [10, 1.0], "2": [50, 5.0]})]
    plain = [step(0, 1, 1, 0, 1, {"1": [30, 1.0], "2": [40, 5.0]})]
    assert bucket_ratios(arm, plain) == {"2": pytest.approx(1.25)}  # bucket 1: a second each, too little


def test_a_step_row_has_the_tail_share_and_per_bucket_acceptance_and_k():
    s = step(3, 20.0, 5.0, 0.5, 1.5, {"1": [90, 3.0], "5-8": [300, 2.0]})
    s["bucket_served"] = {"1": {"0": [10, 10, 10], "4": [80, 20, 20]}, "5-8": {"0": [300, 50, 300]}}
    s["draft_versions_published"] = [2, 3]
    s["worker_rollout_s"] = {"w0": 20.0, "w1": 17.0}
    row = step_row(s, reclaimed=2.5)
    assert row["worker_rollout_s"] == {"w0": 20.0, "w1": 17.0}
    assert row["tail_fraction"] == pytest.approx(0.5) and row["reclaimed_worker_s"] == 2.5
    assert row["idle_worker_s"] == 3.0 and row["draft_versions_published"] == [2, 3]
    assert row["accepted_length_by_bucket"] == {"1": pytest.approx(90 / 30), "5-8": 1.0}
    assert row["accepted_length_drafting_by_bucket"] == {"1": pytest.approx(4.0)}  # k > 0 only
    assert row["k_served_by_bucket"] == {"1": {"0": 10, "4": 20}, "5-8": {"0": 50}}
    old = step_row(step(0, 1.0, 1.0, 0, 1, {}), 0.0)  # a record from before bucket_served: empty, not an error
    assert old["accepted_length_by_bucket"] == {} and old["draft_versions_published"] == []
    assert old["worker_rollout_s"] == {}


def test_tail_acceptance_and_the_goals():
    def arm(acc_tail):
        s = step(0, 10.0, 1.0, 0.25, 1.5, {})
        s["bucket_served"] = {"1": {"2": [acc_tail * 10, 10, 10]}, "3-4": {"2": [acc_tail * 30, 10, 30]},
                              "9-16": {"0": [160, 10, 160]}}
        return [{"steps": [s], "drafts": {"idle_worker_s": 4.0, "reclaimed_worker_s": 3.8}}]

    runs = {"a": [{"steps": [step(0, 16.0, 1.0, 0.25, 1.0, {})], "drafts": {}}], "b": arm(1.4), "c": arm(2.0)}
    f = figures(runs)
    assert f["tail_accepted_length_tlt"] == pytest.approx(2.0)
    assert f["tail_accepted_length_frozen"] == pytest.approx(1.4)
    assert f["accepted_length_by_bucket"]["tlt"] == {"1": 2.0, "3-4": 2.0, "9-16": 1.0}
    f |= {"device": "cuda", "seconds": 400.0}
    met_ = goals_met(f)
    assert met_["rollout_speedup"] and met_["reclaimed_ratio"] and met_["seconds"]  # 1.6, 0.95, 400 s
    assert met_["reward_delta_se"] and not met_["accepted_length_last_step_gain"]  # the same last-step length
    assert set(goals_met(f | {"device": "cpu"})) == {"frozen_rollout_speedup", "rollout_speedup",
                                                     "tail_accepted_length_tlt", "tail_accepted_length_frozen"}
    assert met(-1.9, ("abs<", 2.0)) and not met(2.0, ("abs<", 2.0)) and met(None, (">=", 1)) is None
    assert not met(1.01, ("in", (0.9, 1.0)))


def test_a_repeat_starts_only_if_the_run_still_ends_within_the_budget():
    assert over_budget(0, 2, 1000.0, [], 10.0) is None  # the first always runs
    assert over_budget(1, 2, 200.0, [100.0], 300.0) is None
    why = over_budget(1, 3, 250.0, [100.0, 60.0], 300.0)
    assert why.startswith("repeats 2..3 not started") and "300 s" in why
    assert over_budget(5, 9, 1e6, [1e6], None) is None  # no budget


def test_the_cpu_arms_start_from_the_cached_draft_else_the_shipped_one_else_a_clear_error(tmp_path, monkeypatch):
    """bench.rl.warm_draft_for on a CPU with the default recipe: the cached draft first, else the one the checkout
    ships (workers.warm.shipped_warm_draft), else ValueError naming the ways to get one (a build is 27 minutes)."""
    from bench.rl import warm_draft_for
    from workers import warm

    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(warm, "SHIPPED_DRAFTS", tmp_path / "shipped")
    with pytest.raises(ValueError, match="build one with `make warm-draft`.*pass --warm-draft"):
        warm_draft_for("smollm2-135m", "longtail", "cpu", None)
    for folder in (tmp_path / "shipped" / "smollm2-135m-longtail",
                   warm.warm_cache_dir("smollm2-135m", "longtail", warm.WarmRecipe())):
        folder.mkdir(parents=True)
        for name in ("draft-v000001.safetensors", warm.WARM_REPORT):
            (folder / name).write_text("{}")
        assert warm_draft_for("smollm2-135m", "longtail", "cpu", None) == str(folder / "draft-v000001.safetensors")


def test_a_named_warm_draft_goes_to_the_job_as_an_absolute_path(tmp_path, monkeypatch):
    """A relative --warm-draft (the shipped draft, named from the checkout) reaches the job spec absolute: the spec
    refuses a bare relative path (the H100 run's frozen arm got HTTP 422 for one)."""
    from bench.rl import named_draft

    draft = tmp_path / "drafts" / "draft-v000001.safetensors"
    draft.parent.mkdir()
    draft.write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert named_draft("drafts/draft-v000001.safetensors") == str(draft)
    with pytest.raises(ValueError, match="--warm-draft drafts/none.safetensors: no such file"):
        named_draft("drafts/none.safetensors")
