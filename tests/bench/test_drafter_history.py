"""bench/drafter_history.py's pieces that decide figures: the threshold rule, the recorded acceptance by match
length and the tail rows (a real tiny policy; the SmolLM2 run is `tlt bench drafter-history`)."""

from __future__ import annotations

from bench.drafter_history import RecordingHistory, run_arm, threshold_from
from drafter.decode.engine import Engine
from tests.conftest import random_prompts


def test_threshold_is_the_shortest_match_whose_steps_accept_what_the_head_did():
    by_match = {1: [0] * 30, 2: [0, 1] * 15, 4: [2] * 30, 9: [4] * 5}
    # at n, every step of a match >= n: 1.0 drafts on average from 1 on, 1.46 from 2, 2.29 from 3 (35 steps)
    assert threshold_from(by_match, eagle_accepted=0.5) == 1
    assert threshold_from(by_match, eagle_accepted=1.2) == 2
    assert threshold_from(by_match, eagle_accepted=2.0) == 3
    assert threshold_from(by_match, eagle_accepted=3.0) == 16  # never: too few steps (5) from 5 on to say


def test_recorded_acceptance_and_tail_rows(tiny):
    engine = Engine(tiny)
    history = RecordingHistory()
    prompts = random_prompts([5, 7], tiny.cfg.vocab_size)
    arm = run_arm(engine, prompts, group=4, k=3, drafter=history, temperature=1.0, new_tokens=24)
    assert sum(len(a) for a in history.by_match.values()) > 0
    assert all(0 <= x <= 3 for a in history.by_match.values() for x in a)
    assert arm["tail"]["tokens"] == 2 * 24 and arm["all"]["tokens"] == 8 * 24  # one tail row per group of 4
    assert arm["all"]["accepted_length"] >= 1.0 and len(arm["outputs"]) == 8
