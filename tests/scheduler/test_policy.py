"""The scheduler's pure policy on constructed progress snapshots and copy index entries: no Redis, Ray or torch."""

from __future__ import annotations

import dataclasses

import pytest

from scheduler.policy import (
    CLASSES,
    CopyView,
    PolicySettings,
    RolloutWindow,
    WorkerView,
    choose_scorer,
    classify,
    completed_rollout_s,
    decide,
    group_copies,
    overlap_s,
    reclaimed_by_step,
    remaining_from,
    rollout_under_way,
    scoring_fits,
    should_publish,
    track_rollouts,
)
from workers.protocol.states import Phase, WorkerState

NOW = 1000.0
S = PolicySettings()
ROLLING_OUT, STRAGGLER, IDLE, TRAINING, FAILED, STALE = (
    WorkerState.ROLLING_OUT, WorkerState.STRAGGLER, WorkerState.IDLE, WorkerState.TRAINING, WorkerState.FAILED,
    WorkerState.STALE)


def view(wid, state=ROLLING_OUT, done=2, total=8, age=0.5, buffer=4096, step=-1):
    return WorkerView(wid, WorkerState(state), done, total, NOW - age, buffer, step)


def test_early_rollout_everyone_rolls_out_and_nothing_is_granted():
    views = [view(f"w{i}", done=3) for i in range(4)]
    d = decide(views, NOW, Phase.ROLLOUT, 20.0, 1, S)
    assert set(d.classes.values()) == {ROLLING_OUT}
    assert not d.long_tail and d.grants == [] and d.preempt == []


def test_idle_workers_in_the_long_tail_get_leases_with_a_deadline_before_rollout_ends():
    views = [view("w0", IDLE, 8), view("w1", IDLE, 8), view("w2", done=4), view("w3", done=6)]
    d = decide(views, NOW, Phase.ROLLOUT, 60.0, 3, S)
    assert d.classes["w0"] == d.classes["w1"] == IDLE
    assert d.classes["w2"] == STRAGGLER  # half the workers are done
    assert d.long_tail
    assert [g.worker_id for g in d.grants] == ["w0", "w1"]
    # slowest is half done after 60 s: ~60 s left; leases stop at 80% of it, on the serving version
    assert all(g.deadline_s == pytest.approx(48.0) and g.parent_version == 3 for g in d.grants)


def test_a_record_of_the_last_step_is_of_a_worker_about_to_generate_not_an_idle_one():
    """At a rollout's start, w1 already reports step 5 and w0's record is still its step-4 IDLE (its generate call
    in flight): w0 gets no lease and does not score. Past first_report_s it got no work this step: idle."""
    views = [view("w0", IDLE, 8, step=4), view("w1", done=0, step=5), view("w2", IDLE, 8, step=5)]
    s = dataclasses.replace(S, min_lease_s=0.01)  # any rollout time left is enough for a lease here
    early = decide(views, NOW, Phase.ROLLOUT, 1.0, 2, s, rl_step=5)
    assert early.classes == {"w0": ROLLING_OUT, "w1": ROLLING_OUT, "w2": IDLE}
    assert [g.worker_id for g in early.grants] == ["w2"]
    assert choose_scorer(early.classes, Phase.ROLLOUT, trained=()) == ("w2", True)
    later = decide(views, NOW, Phase.ROLLOUT, s.first_report_s + 0.1, 2, s, rl_step=5)
    assert later.classes["w0"] == IDLE and [g.worker_id for g in later.grants] == ["w0", "w2"]
    # records of the current step, or of no known step, are taken as they are
    assert decide(views, NOW, Phase.ROLLOUT, 1.0, 2, s).classes["w0"] == IDLE  # no step given
    assert classify([view("w0", IDLE, 8)], NOW, S, rl_step=5, rollout_elapsed_s=1.0) == {"w0": IDLE}
    assert classify([view("w0", TRAINING, 8, step=4)], NOW, S, rl_step=5, rollout_elapsed_s=1.0) == {"w0": TRAINING}
    with pytest.raises(ValueError, match="first_report_s"):
        PolicySettings(first_report_s=-1.0)


def test_far_behind_the_median_is_a_straggler_even_early():
    views = [view("w0", done=6), view("w1", done=6), view("w2", done=5), view("w3", done=1)]
    classes = classify(views, NOW, S)
    assert classes["w3"] == STRAGGLER and classes["w0"] == ROLLING_OUT


def test_a_swapping_worker_counts_as_generating():
    classes = classify([view("w0", WorkerState.SWAPPING, 3), view("w1", done=3)], NOW, S)
    assert classes == {"w0": ROLLING_OUT, "w1": ROLLING_OUT}


@pytest.mark.parametrize("phase", [Phase.SYNC, Phase.UPDATE, Phase.DONE])
def test_outside_the_rollout_trainers_are_preempted_and_nothing_is_granted(phase):
    views = [view("w0", TRAINING, 8), view("w1", TRAINING, 8), view("w2", IDLE, 8), view("w3", IDLE, 8)]
    d = decide(views, NOW, phase, 60.0, 3, S)
    assert sorted(d.preempt) == ["w0", "w1"] and d.grants == [] and not d.long_tail


def test_only_the_rollout_phase_lets_idle_workers_train():
    assert [p for p in Phase if rollout_under_way(p)] == [Phase.ROLLOUT]


def test_leases_not_progress_records_decide_preemption():
    # w0's record lags (IDLE) and w1 already rolls out the next step: both still hold leases
    views = [view("w0", IDLE, 8), view("w1", done=1), view("w2", IDLE, 8), view("w3", IDLE, 8)]
    assert decide(views, NOW, Phase.UPDATE, 60.0, 3, S, leased=frozenset({"w0", "w1"})).preempt == ["w0", "w1"]
    d = decide(views, NOW, Phase.ROLLOUT, 60.0, 3, S, leased=frozenset({"w0", "w1"}))
    assert d.preempt == ["w1"]  # given rollouts again: its GPU is needed
    assert "w0" not in [g.worker_id for g in d.grants]  # never two leases on one worker
    assert sorted(g.worker_id for g in d.grants) == ["w2", "w3"]


def test_the_scorer_gets_no_lease():
    views = [view("w0", IDLE, 8), view("w1", IDLE, 8), view("w2", done=2)]
    d = decide(views, NOW, Phase.ROLLOUT, 60.0, 3, S, busy=frozenset({"w0"}))
    assert d.long_tail and [g.worker_id for g in d.grants] == ["w1"]


def test_stale_and_failed_records_are_neither_counted_nor_given_work():
    views = [view("w0", IDLE, 8, age=30), view("w1", FAILED, 0), view("w2", done=4), view("w3", done=4)]
    d = decide(views, NOW, Phase.ROLLOUT, 60.0, 1, S)
    assert d.classes["w0"] == STALE and d.classes["w1"] == FAILED
    assert not d.long_tail and d.grants == []
    # a failed worker's record may be old too: it still says FAILED, the more useful of the two
    assert classify([view("w1", FAILED, 0, age=30)], NOW, S) == {"w1": FAILED}
    assert set(classify(views, NOW, S).values()) <= set(CLASSES)


def test_no_lease_when_too_little_time_or_data_is_left():
    views = [view("w0", IDLE, 8), view("w1", IDLE, 8, buffer=10), view("w2", done=7)]
    assert decide(views, NOW, Phase.ROLLOUT, 20.0, 1, S).grants == []  # 7/8 done: ~2.9 s left
    d = decide([view("w0", IDLE, 8), view("w1", IDLE, 8, buffer=10), view("w2", done=2)],
               NOW, Phase.ROLLOUT, 20.0, 1, S)
    assert [g.worker_id for g in d.grants] == ["w0"]  # w1's buffer is too small


def test_a_long_tail_is_estimated_from_the_jobs_recent_rollouts_not_only_its_finished_rows():
    """7 of 8 rows done after 20 s extrapolates to 2.9 s left, but the rows left are the long ones: where the
    job's last rollouts took 40 s, about 20 s is left, and the tail's idle worker gets a lease of 0.8 of it."""
    views = [view("w0", IDLE, 8), view("w2", done=7)]
    tight = dataclasses.replace(S, min_lease_s=5.0)
    assert decide(views, NOW, Phase.ROLLOUT, 20.0, 1, tight).grants == []
    d = decide(views, NOW, Phase.ROLLOUT, 20.0, 1, tight, recent_rollout_s=(38.0, 40.0, 45.0))
    assert d.remaining_rollout_s == pytest.approx(20.0)
    assert [(g.worker_id, g.deadline_s) for g in d.grants] == [("w0", pytest.approx(16.0))]
    # the longer of the two: a rollout already past its history extrapolates; nothing generating, nothing left
    assert remaining_from(0.5, 50.0, (40.0,)) == pytest.approx(50.0)
    assert remaining_from(0.25, 10.0, (12.0, 100.0)) == pytest.approx(46.0)  # the median of two: their mean
    assert remaining_from(1.0, 10.0, (40.0,)) == 0.0
    assert remaining_from(0.0, 3.0, ()) == 3.0  # nothing finished, no history: as long again


def test_the_recent_rollouts_are_the_finished_windows_latest_last():
    windows = [RolloutWindow(s, 10.0 * s, 10.0 * s + 1 + s) for s in range(5)] + [RolloutWindow(5, 50.0)]
    assert completed_rollout_s(windows) == (3.0, 4.0, 5.0)  # the last three finished; the open one is not
    assert completed_rollout_s(windows, max_kept=1) == (5.0,)
    assert completed_rollout_s([RolloutWindow(0, 1.0)]) == ()


def test_the_scorer_is_a_free_worker_that_did_not_train_in_the_round():
    classes = {"w0": IDLE, "w1": IDLE, "w2": STRAGGLER, "w3": TRAINING}
    assert choose_scorer(classes, Phase.ROLLOUT, trained=["w0"]) == ("w1", True)
    # every free worker's recent rollouts are what the copies trained on: none scores (a score there flatters them)
    assert choose_scorer(classes, Phase.ROLLOUT, trained=["w0", "w1"]) == (None, False)
    assert choose_scorer(classes, Phase.ROLLOUT, trained=[], leased=["w0", "w1"]) == (None, False)
    # the generating and the training are not free during a rollout
    assert choose_scorer({"w0": STRAGGLER, "w1": TRAINING}, Phase.ROLLOUT, trained=[]) == (None, False)
    # never a failed or stale one; and outside the rollout the learner has the machine: nobody scores
    assert choose_scorer({"w0": FAILED, "w1": STALE, "w2": IDLE}, Phase.ROLLOUT, trained=[]) == ("w2", True)
    for phase in (Phase.SYNC, Phase.UPDATE, Phase.DONE):
        assert choose_scorer({"w0": IDLE, "w1": IDLE}, phase, trained=["w0"]) == (None, False)


def test_a_round_is_scored_only_if_the_rest_of_the_rollout_fits_it():
    assert scoring_fits(1.0, None, S)  # nothing measured yet
    assert scoring_fits(30.0, 20.0, S) and not scoring_fits(29.0, 20.0, S)  # margin 1.5 x the last scoring
    assert not scoring_fits(None, None, S)  # no rollout under way
    assert scoring_fits(0.0, 20.0, dataclasses.replace(S, scoring_margin=0.0))
    with pytest.raises(ValueError, match="scoring_margin"):
        dataclasses.replace(S, scoring_margin=-1.0)


def test_copies_group_by_merge_key_and_the_largest_group_by_steps_is_merged():
    a, b, c = CopyView(1, 3, "k1"), CopyView(2, 4, "k1"), CopyView(3, 5, "k2")
    assert group_copies([a, b, c]) == ([1, 2], [3])  # 7 steps beat 5
    d = CopyView(4, 9, "k2")
    assert group_copies([a, b, c, d]) == ([3, 4], [1, 2])
    # on equal steps the larger group wins, then the first
    assert group_copies([CopyView(1, 4, "x"), CopyView(2, 2, "y"), CopyView(3, 2, "y")]) == ([2, 3], [1])
    assert group_copies([CopyView(1, 4, "x"), CopyView(2, 4, "y")]) == ([1], [2])
    # a copy with no key averages with nothing, not even another keyless one
    assert group_copies([CopyView(1, 3, None), CopyView(2, 3, None), CopyView(3, 1, "k")]) == ([1], [2, 3])
    assert group_copies([]) == ([], [])


def test_publish_only_if_scored_and_not_worse():
    assert should_publish(2.1, 2.0, S) and should_publish(2.0, 2.0, S) and should_publish(1.2, None, S)
    assert not should_publish(1.9, 2.0, S)
    assert not should_publish(None, None, S) and not should_publish(None, 1.0, S)
    assert should_publish(1.9, 2.0, PolicySettings(publish_tolerance=0.1))


@pytest.mark.parametrize(("kwargs", "field"), [({"lease_margin": 0}, "lease_margin"),
                                               ({"straggler_done_fraction": 1.5}, "straggler_done_fraction"),
                                               ({"min_lease_s": 10, "max_lease_s": 5}, "min_lease_s")])
def test_bad_settings_are_rejected_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PolicySettings(**kwargs)


def test_overlap_of_an_interval_with_a_window():
    assert overlap_s(2.0, 8.0, 0.0, 10.0) == 6.0  # inside
    assert overlap_s(2.0, 15.0, 0.0, 10.0) == 8.0  # runs past the window's end: counted up to it
    assert overlap_s(-3.0, 4.0, 0.0, 10.0) == 4.0  # began before it
    assert overlap_s(11.0, 15.0, 0.0, 10.0) == 0.0 and overlap_s(-5.0, -1.0, 0.0, 10.0) == 0.0  # disjoint
    assert overlap_s(12.0, 20.0, 10.0, None) == 8.0  # the window is still open


def test_a_lease_is_reclaimed_only_within_its_steps_rollout():
    windows = [RolloutWindow(0, 0.0, 10.0), RolloutWindow(1, 40.0, 55.0), RolloutWindow(2, 90.0)]
    assert reclaimed_by_step(4.0, 30.0, windows) == {0: 6.0}  # ran into the update: 20 s not reclaimed
    assert reclaimed_by_step(50.0, 95.0, windows) == {1: 5.0, 2: 5.0}
    assert reclaimed_by_step(12.0, 39.0, windows) == {}  # wholly in the learner phase
    assert reclaimed_by_step(91.0, 93.5, windows) == {2: 2.5}  # ended by its deadline, rollout under way
    # a step's reclaimed time never exceeds its window, whatever the lease's interval
    assert sum(reclaimed_by_step(-100.0, 1000.0, windows[:2]).values()) == 25.0


def test_rollout_windows_follow_the_phase_records():
    w = track_rollouts([], Phase.SYNC, 0, 1.0)
    assert w == []
    w = track_rollouts(w, Phase.ROLLOUT, 0, 2.0)
    assert w == [RolloutWindow(0, 2.0)]
    assert track_rollouts(w, Phase.ROLLOUT, 0, 2.0) == w  # seen again on the next tick
    w = track_rollouts(w, Phase.UPDATE, 0, 9.0)
    assert w == [RolloutWindow(0, 2.0, 9.0)]
    assert track_rollouts(w, Phase.SYNC, 1, 20.0) == w  # a closed window stays as it was
    # the next rollout's record comes before its predecessor's end was seen: closed there (an upper bound)
    w = track_rollouts(track_rollouts(w, Phase.ROLLOUT, 1, 21.0), Phase.ROLLOUT, 2, 40.0)
    assert w[1:] == [RolloutWindow(1, 21.0, 40.0), RolloutWindow(2, 40.0)]
    many = [RolloutWindow(i, 10.0 * i, 10.0 * i + 5) for i in range(20)]
    assert [x.rl_step for x in track_rollouts(many, Phase.ROLLOUT, 20, 300.0, max_kept=3)] == [18, 19, 20]
