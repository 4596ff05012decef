"""The swap guard's decision (workers.guard), pure: no Redis, no torch, no engine."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from workers.guard import Acceptance, Verdict, acceptance_rate, chain_length, expected_length, judge
from workers.spec import JobSpec, SwapGuardSpec

GUARD = SwapGuardSpec()  # the defaults, from their one definition
N = GUARD.num_verify_steps


def accepting(gain: float, draft_length: float = 2.0, num_verify_steps: int = N) -> Acceptance:
    """What an engine reports after `num_verify_steps` verify steps accepting `gain` drafts per step."""
    return Acceptance(num_verify_steps, round(draft_length * num_verify_steps), round(gain * num_verify_steps))


@pytest.mark.parametrize("k", [1, 2, 3, 5])
@pytest.mark.parametrize("a", [0.0, 0.2, 0.55, 0.9, 1.0])
def test_the_acceptance_rate_inverts_the_chain_length(a, k):
    assert acceptance_rate(chain_length(a, k), k) == pytest.approx(a, abs=1e-9)
    assert expected_length(chain_length(a, k), k, k) == pytest.approx(chain_length(a, k))


def test_chain_length_edges():
    assert chain_length(0.0, 3) == 1.0 and chain_length(1.0, 3) == 4.0 and chain_length(0.5, 0) == 1.0
    assert chain_length(0.5, 1.5) == pytest.approx((1 - 0.5 ** 2.5) / 0.5)  # a mean draft length may be fractional
    assert acceptance_rate(0.0, 2) == 0.0 and acceptance_rate(9.0, 2) == 1.0  # clamped: scores out of range


def test_acceptance_since_a_swap_is_the_counters_difference():
    before, after = Acceptance(10, 20, 5), Acceptance(74, 148, 69)
    acc = Acceptance.since(before, after)
    assert acc == Acceptance(64, 128, 64) and acc.accepted_length == 2.0 and acc.mean_draft_length == 2.0
    assert Acceptance(0, 0, 0).accepted_length == 1.0 and Acceptance(0, 0, 0).mean_draft_length == 0.0


def test_a_collapsed_draft_is_rolled_back_and_a_good_one_kept():
    # published at 2.2 tokens per verify step with k=2: a zeroed or unloaded draft accepts next to nothing
    collapsed = judge(2.2, 2, accepting(0.02), GUARD)
    assert collapsed.verdict == Verdict.COLLAPSED and collapsed.expected_length == pytest.approx(2.2)
    assert collapsed.acceptance.accepted_length == pytest.approx(1.02, abs=0.01)
    # the same draft accepting a little below its offline score is kept
    assert judge(2.2, 2, accepting(0.9), GUARD).verdict == Verdict.KEPT
    # the line: below collapse_fraction of the expected gain
    line = GUARD.collapse_fraction * 1.2
    assert judge(2.2, 2, accepting(line - 0.02, num_verify_steps=10_000), GUARD).verdict == Verdict.COLLAPSED
    assert judge(2.2, 2, accepting(line + 0.02, num_verify_steps=10_000), GUARD).verdict == Verdict.KEPT


def test_nothing_is_judged_before_enough_verify_steps():
    assert judge(2.2, 2, accepting(0.0, num_verify_steps=N - 1), GUARD).verdict == Verdict.PENDING
    assert judge(2.2, 2, accepting(0.0, num_verify_steps=0), GUARD).verdict == Verdict.PENDING
    assert judge(2.2, 2, accepting(0.0, num_verify_steps=N), GUARD).verdict == Verdict.COLLAPSED


@pytest.mark.parametrize("published", [0.0, 1.0, 1.0 + GUARD.min_published_gain - 0.01])
def test_a_draft_without_a_score_worth_comparing_is_not_judged(published):
    assert judge(published, 2, accepting(0.0), GUARD).verdict == Verdict.UNJUDGED


def test_collapse_fraction_zero_turns_the_guard_off():
    off = SwapGuardSpec(collapse_fraction=0)
    assert judge(3.0, 2, accepting(0.0), off).verdict == Verdict.UNJUDGED


def test_shorter_drafts_served_than_scored_are_judged_at_their_own_length():
    """An adaptive engine drafting 1 token where the score was taken at 8: a good draft accepts less per
    verify step than its published length, and must not look collapsed."""
    published, k = 3.0, 8
    a = acceptance_rate(published, k)
    good_at_1 = accepting(a * 0.5, draft_length=1.0)  # half the score's own acceptance rate: worse, not collapsed
    judged = judge(published, k, good_at_1, GUARD)
    assert judged.verdict == Verdict.KEPT and judged.expected_length == pytest.approx(1 + a)
    # compared with the published gain as it stands, the same draft would have been rolled back
    assert good_at_1.accepted_length - 1 < GUARD.collapse_fraction * (published - 1)
    assert judge(published, k, accepting(0.01, draft_length=1.0), GUARD).verdict == Verdict.COLLAPSED


def test_a_bad_draft_length_is_refused():
    with pytest.raises(ValueError, match="published_k"):
        judge(2.0, 0, accepting(0.0), GUARD)


def test_the_thresholds_are_the_job_specs_and_are_validated():
    assert JobSpec().swap_guard == SwapGuardSpec()
    custom = JobSpec(swap_guard={"num_verify_steps": 16, "collapse_fraction": 0.5})
    assert custom.swap_guard.num_verify_steps == 16 and custom.swap_guard.min_published_gain == GUARD.min_published_gain
    for bad in ({"collapse_fraction": 1.0}, {"num_verify_steps": 0}, {"min_published_gain": 0}, {"typo": 1}):
        with pytest.raises(ValidationError, match="swap_guard"):
            JobSpec(swap_guard=bad)
