"""scheduler.served: what a job's steps served per live-batch bucket (pure arithmetic over step records)."""

from __future__ import annotations

import pytest

from scheduler.served import accepted_by_bucket, k_rates, tail_accepted_length, tail_tokens_per_s

STEPS = [{"bucket_served": {"1": {"0": [10, 10, 10], "2": [30, 10, 10]}, "17-32": {"0": [200, 10, 200]}},
          "bucket_throughput": {"1": [40, 8.0], "3-4": [60, 4.0], "17-32": [200, 2.0]}},
         {"bucket_served": {"3-4": {"4": [24, 4, 8]}}, "bucket_throughput": {"1": [20, 3.0]}}]


def test_accepted_length_per_bucket_and_in_the_tail():
    # bucket 1: 40 tokens over 20 row-forwards; drafting only: 30 over 10; the tail adds 3-4's 24 over 8
    assert accepted_by_bucket(STEPS) == {"1": 2.0, "3-4": 3.0, "17-32": 1.0}
    assert accepted_by_bucket(STEPS, drafting_only=True) == {"1": 3.0, "3-4": 3.0}
    assert tail_accepted_length(STEPS) == pytest.approx(64 / 28)
    assert tail_accepted_length([{"bucket_served": {"17-32": {"2": [50, 5, 20]}}}]) is None


def test_the_tails_decoding_rate_leaves_the_bulk_out():
    assert tail_tokens_per_s(STEPS) == pytest.approx(120 / 15.0)
    assert tail_tokens_per_s([{"bucket_throughput": {"9-16": [10, 1.0]}}]) is None
    assert tail_tokens_per_s([{}]) is None


def test_each_draft_lengths_own_rate_where_it_served():
    steps = [{"bucket_served": {"1": {"2": [30, 10, 10, 1.5], "0": [10, 10, 10, 1.0]}}},
             {"bucket_served": {"1": {"2": [15, 5, 5, 0.5]}, "9-16": {"0": [100, 10, 100, 2.0]}}},
             {"bucket_served": {"3-4": {"1": [24, 4, 8]}}}]  # a record from before seconds were kept: left out
    assert k_rates(steps) == {"1": {"0": [10.0, 10], "2": [22.5, 15]}, "9-16": {"0": [50.0, 10]}}
    assert k_rates([{}]) == {}
