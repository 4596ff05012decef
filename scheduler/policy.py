"""The scheduler's decisions, as pure functions over plain records: no Redis, no Ray, no torch.

Given every worker's latest progress and the job's phase, `decide` says which workers are rolling
out, straggling, idle at the barrier or training; whether the long tail has begun; which idle
workers get a drafter-training lease and until when; which trainers to preempt; and
`should_publish` says whether a merged draft may replace the one being served.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from enum import StrEnum


class WorkerClass(StrEnum):
    ROLLING_OUT = "ROLLING_OUT"
    STRAGGLER = "STRAGGLER"
    IDLE = "IDLE"
    TRAINING = "TRAINING"
    STALE = "STALE"  # no fresh progress: neither counted nor given work


class Phase(StrEnum):
    ROLLOUT = "ROLLOUT"  # the step's generation is under way
    UPDATE = "UPDATE"  # no generation under way (weight sync, reward, update): every GPU is needed


@dataclass(frozen=True)
class WorkerView:
    """What the policy needs of a worker's progress record."""

    worker_id: str
    state: str  # the worker's own state: ROLLING_OUT, IDLE, TRAINING, SWAPPING, FAILED
    num_finished: int
    num_total: int
    timestamp: float
    buffer_tokens: int = 0

    @property
    def progress(self) -> float:
        return self.num_finished / self.num_total if self.num_total else 1.0


@dataclass(frozen=True)
class PolicySettings:
    stale_after_s: float = 5.0  # 50 missed reports at 10/s: the worker is gone or wedged
    straggler_done_fraction: float = 0.5  # still generating once half the workers are done
    straggler_progress_ratio: float = 0.5  # or below half the median progress of those still generating
    long_tail_idle_fraction: float = 0.25  # the tail begins when a quarter of the workers wait at the barrier
    min_lease_s: float = 5.0  # shorter leases do not pay for loading the parent and checkpointing
    max_lease_s: float = 600.0  # bounds the work a lost lease can waste
    lease_margin: float = 0.8  # stop before the estimated end of rollout, so preemption rarely waits
    min_buffer_tokens: int = 512  # a trainer needs data; fewer pairs than this overfit in seconds
    publish_tolerance: float = 0.0  # a merged draft may not accept fewer tokens per step than the served one
    # delete a round's copies and candidate file once it is decided (a published candidate lives on in the
    # served store): a long job makes a few copies per step, tens of MB each for an 8B policy's head
    prune_copies: bool = True

    def __post_init__(self) -> None:
        for name in ("straggler_done_fraction", "straggler_progress_ratio", "long_tail_idle_fraction",
                     "lease_margin"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.min_lease_s <= 0 or self.max_lease_s < self.min_lease_s:
            raise ValueError("need 0 < min_lease_s <= max_lease_s")


@dataclass(frozen=True)
class Lease:
    worker_id: str
    deadline_s: float
    parent_version: int


@dataclass
class Decision:
    classes: dict[str, WorkerClass]
    long_tail: bool
    grants: list[Lease] = field(default_factory=list)
    preempt: list[str] = field(default_factory=list)
    remaining_rollout_s: float | None = None


def classify(views: list[WorkerView], now: float, s: PolicySettings) -> dict[str, WorkerClass]:
    classes: dict[str, WorkerClass] = {}
    fresh = [v for v in views if now - v.timestamp <= s.stale_after_s and v.state != "FAILED"]
    for v in views:
        if v not in fresh:
            classes[v.worker_id] = WorkerClass.STALE
    generating = [v for v in fresh if v.state in ("ROLLING_OUT", "SWAPPING")]
    done_fraction = (len(fresh) - len(generating)) / len(fresh) if fresh else 0.0
    median = statistics.median(v.progress for v in generating) if generating else 0.0
    for v in fresh:
        if v.state == "TRAINING":
            classes[v.worker_id] = WorkerClass.TRAINING
        elif v not in generating:
            classes[v.worker_id] = WorkerClass.IDLE
        elif done_fraction >= s.straggler_done_fraction or v.progress < s.straggler_progress_ratio * median:
            classes[v.worker_id] = WorkerClass.STRAGGLER
        else:
            classes[v.worker_id] = WorkerClass.ROLLING_OUT
    return classes


def estimate_remaining_s(views: list[WorkerView], classes: dict[str, WorkerClass], rollout_elapsed_s: float) -> float:
    """Time until the slowest generating worker finishes, extrapolating its progress so far."""
    slowest = min((v.progress for v in views if classes[v.worker_id] in (WorkerClass.ROLLING_OUT,
                                                                         WorkerClass.STRAGGLER)), default=1.0)
    if slowest <= 0:
        return rollout_elapsed_s  # nothing finished yet: assume at least as long again
    return rollout_elapsed_s * (1 - slowest) / slowest


def decide(views: list[WorkerView], now: float, phase: Phase, rollout_elapsed_s: float, serving_version: int,
           s: PolicySettings, leased: frozenset[str] = frozenset()) -> Decision:
    """`leased`: workers holding a lease the scheduler has not collected yet. Their progress record
    may lag or say ROLLING_OUT (a new rollout began), so leases, not records, decide preemption."""
    classes = classify(views, now, s)
    counted = [v for v in views if classes[v.worker_id] != WorkerClass.STALE]
    idle = [v for v in counted if classes[v.worker_id] == WorkerClass.IDLE and v.worker_id not in leased]
    long_tail = phase == Phase.ROLLOUT and bool(counted) and len(idle) / len(counted) >= s.long_tail_idle_fraction
    decision = Decision(classes, long_tail)
    if phase == Phase.UPDATE:  # the policy update needs the GPUs back
        decision.preempt = sorted({v.worker_id for v in counted if classes[v.worker_id] == WorkerClass.TRAINING}
                                  | set(leased))
        return decision
    # a leased worker given rollouts again needs its GPU back
    decision.preempt = sorted(w for w in leased if classes.get(w) in (WorkerClass.ROLLING_OUT, WorkerClass.STRAGGLER))
    remaining = estimate_remaining_s(views, classes, rollout_elapsed_s)
    decision.remaining_rollout_s = remaining
    deadline = min(s.max_lease_s, s.lease_margin * remaining)
    if long_tail and deadline >= s.min_lease_s:
        decision.grants = [Lease(v.worker_id, deadline, serving_version) for v in idle
                           if v.buffer_tokens >= s.min_buffer_tokens]
    return decision


def should_publish(candidate_accepted_length: float, serving_accepted_length: float | None,
                   s: PolicySettings) -> bool:
    """Publish a merged draft only if, measured on the same recent rollouts, it is not worse."""
    if serving_accepted_length is None:
        return True
    return candidate_accepted_length >= serving_accepted_length - s.publish_tolerance
