"""bench/drafter_history.py's pieces that decide figures: the threshold rule, the recorded acceptance by match
length and the tail rows (a real tiny policy; the SmolLM2 run is `tlt bench drafter-history`)."""

from __future__ import annotations

import pytest

from bench.drafter import bench_drafter
from bench.drafter_history import RecordingHistory, TimedHistory, run_arm, tail_rows, threshold_from
from drafter.decode.engine import Engine
from drafter.draft.history import HistoryDrafter
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


def test_tail_rows_are_the_last_quarter_of_each_group_to_finish():
    assert tail_rows([3, 9, 5, 7, 1, 1, 8, 2], group=4) == [1, 6]
    assert tail_rows(list(range(16)), group=8) == [6, 7, 14, 15]
    assert tail_rows([4, 2, 6, 1], group=2) == [0, 2]  # at least one row a group


def test_timed_history_drafts_as_history_does_and_counts_its_own_time(tiny):
    engine = Engine(tiny)
    prompts = random_prompts([5, 7], tiny.cfg.vocab_size)
    timed = TimedHistory()
    got = run_arm(engine, prompts, group=4, k=3, drafter=timed, temperature=0.0, new_tokens=24)
    want = run_arm(engine, prompts, group=4, k=3, drafter=HistoryDrafter(), temperature=0.0, new_tokens=24)
    assert got["outputs"] == want["outputs"]
    assert [got[s]["accepted_length"] for s in ("all", "tail")] == [want[s]["accepted_length"] for s in ("all", "tail")]
    assert timed.seconds > 0


def test_bench_drafter_names_a_bad_history_part_before_loading_anything():
    with pytest.raises(ValueError, match="parts must be made of a, b, c and h"):
        bench_drafter("no-such-model", parts="x")
    with pytest.raises(ValueError, match="history_groups must be >= 1"):
        bench_drafter("no-such-model", parts="h", history_groups=0)
