"""The scheduler's pure policy on constructed progress snapshots."""

from __future__ import annotations

import pytest

from scheduler.policy import (
    Phase,
    PolicySettings,
    WorkerClass,
    WorkerView,
    classify,
    decide,
    should_publish,
)

NOW = 1000.0
S = PolicySettings()


def view(wid, state="ROLLING_OUT", done=2, total=8, age=0.5, buffer=4096):
    return WorkerView(wid, state, done, total, NOW - age, buffer)


def test_early_rollout_everyone_rolls_out_and_nothing_is_granted():
    views = [view(f"w{i}", done=3) for i in range(4)]
    d = decide(views, NOW, Phase.ROLLOUT, 20.0, 1, S)
    assert set(d.classes.values()) == {WorkerClass.ROLLING_OUT}
    assert not d.long_tail and d.grants == [] and d.preempt == []


def test_idle_workers_in_the_long_tail_get_leases_with_a_deadline_before_rollout_ends():
    views = [view("w0", "IDLE", 8), view("w1", "IDLE", 8), view("w2", done=4), view("w3", done=6)]
    d = decide(views, NOW, Phase.ROLLOUT, 60.0, 3, S)
    assert d.classes["w0"] == d.classes["w1"] == WorkerClass.IDLE
    assert d.classes["w2"] == WorkerClass.STRAGGLER  # half the workers are done
    assert d.long_tail
    assert [g.worker_id for g in d.grants] == ["w0", "w1"]
    # slowest is half done after 60 s: ~60 s left; leases stop at 80% of it, on the serving version
    assert all(g.deadline_s == pytest.approx(48.0) and g.parent_version == 3 for g in d.grants)


def test_far_behind_the_median_is_a_straggler_even_early():
    views = [view("w0", done=6), view("w1", done=6), view("w2", done=5), view("w3", done=1)]
    classes = classify(views, NOW, S)
    assert classes["w3"] == WorkerClass.STRAGGLER and classes["w0"] == WorkerClass.ROLLING_OUT


def test_end_of_rollout_preempts_trainers():
    views = [view("w0", "TRAINING", 8), view("w1", "TRAINING", 8), view("w2", "IDLE", 8), view("w3", "IDLE", 8)]
    d = decide(views, NOW, Phase.UPDATE, 60.0, 3, S)
    assert sorted(d.preempt) == ["w0", "w1"] and d.grants == []


def test_leases_not_progress_records_decide_preemption():
    # w0's record lags (IDLE) and w1 already rolls out the next step: both still hold leases
    views = [view("w0", "IDLE", 8), view("w1", done=1), view("w2", "IDLE", 8), view("w3", "IDLE", 8)]
    assert decide(views, NOW, Phase.UPDATE, 60.0, 3, S, leased=frozenset({"w0", "w1"})).preempt == ["w0", "w1"]
    d = decide(views, NOW, Phase.ROLLOUT, 60.0, 3, S, leased=frozenset({"w0", "w1"}))
    assert d.preempt == ["w1"]  # given rollouts again: its GPU is needed
    assert "w0" not in [g.worker_id for g in d.grants]  # never two leases on one worker
    assert sorted(g.worker_id for g in d.grants) == ["w2", "w3"]


def test_stale_and_failed_records_are_ignored():
    views = [view("w0", "IDLE", 8, age=30), view("w1", "FAILED", 0), view("w2", done=4), view("w3", done=4)]
    d = decide(views, NOW, Phase.ROLLOUT, 60.0, 1, S)
    assert d.classes["w0"] == d.classes["w1"] == WorkerClass.STALE
    assert not d.long_tail and d.grants == []


def test_no_lease_when_too_little_time_or_data_is_left():
    views = [view("w0", "IDLE", 8), view("w1", "IDLE", 8, buffer=10), view("w2", done=7)]
    assert decide(views, NOW, Phase.ROLLOUT, 20.0, 1, S).grants == []  # 7/8 done: ~2.9 s left
    d = decide([view("w0", "IDLE", 8), view("w1", "IDLE", 8, buffer=10), view("w2", done=2)],
               NOW, Phase.ROLLOUT, 20.0, 1, S)
    assert [g.worker_id for g in d.grants] == ["w0"]  # w1's buffer is too small


def test_publish_only_if_not_worse():
    assert should_publish(2.1, 2.0, S) and should_publish(2.0, 2.0, S) and should_publish(1.2, None, S)
    assert not should_publish(1.9, 2.0, S)


@pytest.mark.parametrize("kwargs", [{"lease_margin": 0}, {"straggler_done_fraction": 1.5},
                                    {"min_lease_s": 10, "max_lease_s": 5}])
def test_bad_settings_are_rejected(kwargs):
    with pytest.raises(ValueError):
        PolicySettings(**kwargs)
