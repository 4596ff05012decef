"""The adaptive tuner's pooled acceptance counts the prior's in as min_row_samples rows, so a few unlucky first steps
do not outvote it. Pure logic: scripted acceptance and step costs, no model."""

from __future__ import annotations

import random

import pytest

from drafter.draft.adaptive import PRIOR_MARGIN, DraftLengthTuner, StepCostPrior
from tests.drafter.test_adaptive import COSTS, drive_drifting, run


def cpu_prior() -> StepCostPrior:
    """The shipped draft's score (2.12 at k=4) on a CPU's step costs."""
    return StepCostPrior.from_accepted_length(2.12, 4, **StepCostPrior.step_costs("cpu"))


@pytest.mark.parametrize("seed", range(6))
def test_an_unlucky_start_does_not_leave_a_paying_draft_plain(seed):
    """A draft that accepts 0.45 per position (k=2 emits 1.65 tokens a step at 1.2x a plain step's cost: 1.38x plain)
    accepts nothing in its first eight steps. Ranked by those steps' own tokens, k > 0 looked slower than plain after
    the forced tries and plain served most of the next 60 steps (seeds 0, 3 and 4: 47-48 of 60); with the prior's
    acceptance counted in as min_row_samples rows, plain serves only its re-measuring runs."""
    chosen, _ = drive_drifting(DraftLengthTuner(4, prior=cpu_prior()), lambda i: 0.0 if i < 8 else 0.45, 80,
                               random.Random(seed), rows=True)
    assert chosen[20:].count(0) <= 12, chosen


def test_the_pool_starts_at_the_prior_and_the_rows_outweigh_it():
    prior = cpu_prior()
    tuner = DraftLengthTuner(4, prior=prior, min_row_samples=16)
    tuner.choose(1)
    tuner.record(1, 2, 1, COSTS[2])  # one drafting row, nothing accepted: one row against the prior's 16
    bucket = tuner._buckets["1"]
    assert 0.9 * prior.acceptance < bucket.acceptance < prior.acceptance
    for _ in range(300):  # rows that accept nothing: the pool keeps about 128 of them, the prior's 16 fade beside
        tuner.record(1, 2, 1, COSTS[2])
    assert bucket.acceptance < 0.1
    tuner.new_draft()  # a new draft of unknown worth: its prior again
    assert tuner._buckets["1"].acceptance == pytest.approx(prior.acceptance, abs=1e-6)
    bare = DraftLengthTuner(4)  # no prior: nothing is assumed before min_row_samples rows
    bare.choose(1)
    bare.record(1, 2, 2, COSTS[2])
    assert bare._buckets["1"].acceptance is None


def test_what_a_smaller_bucket_measured_overrules_the_prior_in_a_larger_one():
    """A prior from a strong held-out score (2.83 at k=4, a CPU's knee of 8 tokens) expects k=1 to gain 1.1x at 9
    rows (PRIOR_MARGIN), so bucket 9-16 tries it before anything smaller is measured. Once bucket 5-8 measured k=1
    at 1.03x plain (expected at 12 rows: 1.03 x 1.45 / 1.62 = 0.92x), 9-16 serves plain only."""
    prior = StepCostPrior.from_accepted_length(2.83, 4, **StepCostPrior.step_costs("cpu"))
    assert prior.gain(9, 1) > PRIOR_MARGIN > prior.gain(9, 2)
    tuner, rng = DraftLengthTuner(4, prior=prior), random.Random(8)
    assert set(run(tuner, {0: 200, 1: 180, 2: 150, 4: 120}, 12, 20, rng)) == {0, 1}
    run(tuner, {0: 100, 1: 103, 2: 95, 4: 80}, 6, 300, rng)
    assert run(tuner, {0: 200, 1: 180, 2: 150, 4: 120}, 12, 100, rng) == [0] * 100


def test_a_large_bucket_tries_no_draft_length_the_prior_expects_to_break_even():
    """The shipped draft's prior (2.12 at k=4, a CPU's knee) expects k=1 at 1.00x plain at 9 rows: under PRIOR_MARGIN,
    so bucket 9-16, met before anything smaller is measured, decodes plainly (`tlt bench rl` run AY: tried there,
    k = 1 ran 0.69x plain), while the smallest bucket, which learns only by trying, tries every k the prior expects
    to pay at all."""
    prior = StepCostPrior.from_accepted_length(2.12, 4, **StepCostPrior.step_costs("cpu"))
    assert 1.0 < prior.gain(9, 1) < PRIOR_MARGIN and prior.gain(1, 1) > PRIOR_MARGIN
    tuner, rng = DraftLengthTuner(4, prior=prior), random.Random(2)
    assert run(tuner, {0: 200, 1: 140, 2: 110, 4: 80}, 12, 60, rng) == [0] * 60
    assert set(run(tuner, {0: 30, 1: 40, 2: 44, 4: 41}, 1, 60, rng)) == {0, 1, 2, 4}
