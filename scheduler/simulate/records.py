"""What a simulation keeps: the served drafts (DraftBook), each RL step's figures, the run's result."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.simulate.profiles import Profile


class DraftBook:
    """Served draft versions: version -> (training seconds, policy version it was trained on)."""

    def __init__(self, profile: Profile) -> None:
        self.acceptance = profile.acceptance
        self.versions = {1: (self.acceptance.warm_seconds(), 0)}  # version 1: the warm draft
        self.latest = 1

    def seconds(self, version: int, policy_version: int) -> float:
        trained, since = self.versions[version]
        return trained * self.acceptance.drift_retain ** (policy_version - since)

    def rate(self, version: int, policy_version: int) -> float:
        return self.acceptance.rate(self.seconds(version, policy_version))

    def add(self, seconds: float, policy_version: int) -> int:
        self.latest += 1
        self.versions[self.latest] = (seconds, policy_version)
        return self.latest


@dataclass
class StepStats:
    rl_step: int
    rollout_s: float
    step_s: float
    learner_wait_s: float  # rollout end to the learner having every GPU (preemptions, a scoring round)
    worker_s: list[float]
    num_tokens: float
    accepted_length: float  # tokens per verify step, all rows
    last10_share: float  # share of the rollout after 90% of its requests had finished (Seer's figure)
    rate_start: float  # served acceptance rate at the rollout's start (worker mean)
    rate_end: float
    reclaimed_worker_s: float = 0.0

    @property
    def idle_worker_s(self) -> float:
        return sum(max(self.worker_s) - s for s in self.worker_s)

    @property
    def busy_fraction(self) -> float:
        return sum(self.worker_s) / (len(self.worker_s) * max(self.worker_s))


@dataclass
class SimResult:
    arm: str
    num_workers: int
    steps: list[StepStats]
    num_leases: int = 0
    num_rounds: int = 0
    num_published: int = 0
    tick_s: list[float] = field(default_factory=list)  # wall seconds of the policy functions per tick
    snapshots: list[dict] = field(default_factory=list)  # kept tick inputs (SimWatcher.snapshots)
