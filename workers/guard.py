"""The acceptance-collapse guard's decision: after a draft swap, is the engine accepting what the draft
scored when it was published, or has acceptance collapsed toward 1.0 (plain decoding)?

Pure: plain numbers in, a Judgement out; no Redis, no torch, no engine. workers.swap.Swapper takes the
engine's counters (drafter.decode.engine.EngineStats, or anything with the same three fields) when it installs
a version and again on each listener tick, and rolls back on COLLAPSED. Every engine counts the same
three things (vLLM and SGLang included), so every engine gets the guard.

What is compared. A draft is published with its expected accepted length L at the job's draft_k
(tokens per verify step: 1 + accepted drafts). An adaptive engine drafts fewer tokens where that pays,
so the measured length is judged against L carried over to the draft length actually served, with
the usual model of a draft whose every position is accepted with probability a, chained:
    L(a, k) = 1 + a + a^2 + ... + a^k
a is solved from the published (L, draft_k), and the expectation is L(a, m) at the measured mean
draft length m. A collapse is a measured gain over plain decoding (length - 1) below
collapse_fraction of the expected gain.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

BISECTION_STEPS = 60  # a in [0, 1] to 1e-18: far below any difference an accepted length can show


class Verdict(StrEnum):
    PENDING = "PENDING"  # fewer verify steps than the guard counts since the swap
    KEPT = "KEPT"  # accepts near what it scored: it stays
    COLLAPSED = "COLLAPSED"  # accepts almost nothing of what it scored: roll back
    UNJUDGED = "UNJUDGED"  # no score worth comparing with (none, too near 1.0, or the guard is off)


class Counters(Protocol):
    """What the guard reads of an engine's cumulative counters (drafter.decode.engine.EngineStats)."""

    num_verify_steps: int
    num_draft_tokens: int
    num_accepted: int


class GuardSettings(Protocol):
    """The guard's thresholds: workers.spec.SwapGuardSpec, where their defaults and reasons live."""

    num_verify_steps: int
    collapse_fraction: float
    min_published_gain: float


@dataclass(frozen=True)
class Acceptance:
    """What an engine drafted and accepted since a swap."""

    num_verify_steps: int  # sequence-steps that verified at least one drafted token
    num_draft_tokens: int
    num_accepted: int

    @classmethod
    def since(cls, before: Counters, after: Counters) -> Acceptance:
        return cls(after.num_verify_steps - before.num_verify_steps,
                   after.num_draft_tokens - before.num_draft_tokens, after.num_accepted - before.num_accepted)

    @property
    def accepted_length(self) -> float:
        """Tokens per verify step: the accepted drafts and the policy's own token."""
        return 1.0 + self.num_accepted / self.num_verify_steps if self.num_verify_steps else 1.0

    @property
    def mean_draft_length(self) -> float:
        return self.num_draft_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    acceptance: Acceptance
    expected_length: float = 1.0  # the published score carried over to the mean draft length served


def chain_length(a: float, k: float) -> float:
    """L(a, k) = 1 + a + ... + a^k, for a real k >= 0 (a mean draft length)."""
    return 1.0 + k if a >= 1.0 else (1.0 - a ** (k + 1.0)) / (1.0 - a)


def acceptance_rate(length: float, k: int) -> float:
    """The per-position acceptance a with L(a, k) = length (clamped to [0, 1]): L is increasing in a."""
    if length <= 1.0:
        return 0.0
    if length >= 1.0 + k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chain_length(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


def expected_length(published_length: float, published_k: int, draft_length: float) -> float:
    """The published accepted length (at draft length `published_k`) carried over to `draft_length`."""
    return chain_length(acceptance_rate(published_length, published_k), draft_length)


def judge(published_length: float, published_k: int, acceptance: Acceptance, settings: GuardSettings) -> Judgement:
    """The verdict on a swapped-in draft published at `published_length` (measured at draft length
    `published_k`; 0 or less: never measured) from what the engine accepted since the swap."""
    if published_k < 1:
        raise ValueError(f"published_k must be >= 1, got {published_k}")
    if (settings.collapse_fraction <= 0 or published_length - 1.0 < settings.min_published_gain):
        return Judgement(Verdict.UNJUDGED, acceptance)
    if acceptance.num_verify_steps < settings.num_verify_steps:
        return Judgement(Verdict.PENDING, acceptance)
    expected = expected_length(published_length, published_k, acceptance.mean_draft_length)
    is_collapsed = acceptance.accepted_length - 1.0 < settings.collapse_fraction * (expected - 1.0)
    return Judgement(Verdict.COLLAPSED if is_collapsed else Verdict.KEPT, acceptance, expected)
