"""The demo's closing claim (pure logic): a rollout speed-up only when the drafter paid and beyond the noise."""

from __future__ import annotations

from scheduler.demo import rollout_verdict


def test_a_speed_up_the_drafter_caused_and_larger_than_the_noise_is_claimed():
    lines = rollout_verdict([30.0, 31.0], [20.0, 21.0], [1.8, 1.9])
    assert "rollout speed-up 1.49x" in lines[-1]


def test_no_speed_up_when_the_drafter_never_paid():
    lines = rollout_verdict([30.0, 31.0], [20.0, 21.0], [1.0, 1.01])
    assert "never paid" in lines[-1] and "speed-up" not in lines[-1]


def test_no_speed_up_within_the_noise():
    # the off job's steps spread 40%; a 10% difference is within it
    lines = rollout_verdict([25.0, 37.5], [28.0, 28.8], [1.6, 1.7])
    assert "within run-to-run noise" in lines[-1] and "no speed-up is claimed" in lines[-1]


def test_one_step_gives_no_noise_estimate_and_no_claim():
    assert "no speed-up is claimed" in rollout_verdict([30.0], [15.0], [2.0])[-1]
    assert rollout_verdict([], [], []) == ["rollout: no timings to compare"]
