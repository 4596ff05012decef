"""Every message that crosses a process boundary (Redis values, Ray calls): validated JSON dataclasses
(workers.message.Message). Every value is JSON: no pickle crosses Redis."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from workers.message import Message, ProtocolError
from workers.protocol.keys import check_id
from workers.protocol.states import REPORTED_STATES, LeaseState, Phase, WorkerState


@dataclass
class ProgressRecord(Message):
    """One worker's latest progress: everything the scheduler's policy reads of a worker."""

    job_id: str
    worker_id: str
    state: WorkerState
    num_running: int  # requests still generating
    num_finished: int
    num_total: int  # requests assigned this RL step
    num_tokens: int  # tokens generated this RL step
    tokens_per_s: float
    mean_accepted_length: float  # tokens per speculative step (1.0 = plain decoding)
    draft_version: int
    policy_version: int
    rl_step: int
    timestamp: float  # wall clock (time.time()) of the measurement
    buffer_tokens: int = 0  # harvested training pairs held for drafter leases
    num_swaps: int = 0  # draft versions installed so far
    last_swap_version: int = 0  # the newest installed version (0: none yet)
    last_swap_at: float = 0.0  # wall clock its install began

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id("job_id", self.job_id)
        check_id("worker_id", self.worker_id)
        if self.state not in REPORTED_STATES:
            raise ProtocolError("state", f"a worker reports one of {sorted(REPORTED_STATES)}, got {self.state.value}")
        if self.num_finished > self.num_total:
            raise ProtocolError("num_finished", f"{self.num_finished} exceeds num_total {self.num_total}")
        if self.num_running > self.num_total - self.num_finished:
            raise ProtocolError("num_running", f"{self.num_running} exceeds num_total - num_finished "
                                               f"({self.num_total - self.num_finished})")


@dataclass
class PhaseRecord(Message):
    phase: Phase
    rl_step: int
    since: float  # wall clock the phase began


@dataclass
class JobResult(Message):
    """How a driver's run ended; written once, by the driver, before it returns."""

    ok: bool
    steps: int  # RL steps finished
    finished_at: float
    error: str | None = None  # one line for the user: no traceback, no host or path details
    # a run that succeeded with less than it was given (a rollout worker lost and not replaced, or replaced late):
    # one line saying which and when, so a degraded run never reads as a clean one
    warning: str | None = None


@dataclass
class StepRecord(Message):
    """One finished RL step, as the driver appends it to job_steps_key."""

    SIGNED: ClassVar[frozenset[str]] = frozenset({"mean_reward"})

    rl_step: int
    policy_version: int
    timings: dict  # phase -> seconds: weight_sync, rollout, reward, logprob, update
    worker_rollout_s: dict  # worker id -> seconds it spent generating
    idle_worker_s: float  # sum over workers of the time spent waiting at the barrier
    mean_reward: float
    num_rollouts: int
    failures: list = field(default_factory=list)  # {"worker", "error"} per worker lost this step
    num_tokens: int = 0  # generated this step
    mean_accepted_length: float = 1.0  # tokens per policy forward over the step's rollouts (1.0: plain)
    draft_versions: dict = field(default_factory=dict)  # worker id -> draft version serving when it finished
    grpo: dict = field(default_factory=dict)  # the update's statistics (loss, clip fraction, ...)
    response_lengths: dict = field(default_factory=dict)  # tokens per response: median, p90, p99, max
    tail_s: float = 0.0  # the long tail: from the first worker done generating to the last
    speculation: dict = field(default_factory=dict)  # worker id -> {live-batch bucket: draft k chosen (0: plain)}
    # live-batch bucket -> [tokens, seconds] decoded in it this step, summed over workers (whatever k served)
    bucket_throughput: dict = field(default_factory=dict)
    reward_std: float = 0.0  # of the step's rollouts' rewards (the reward's standard error is std / sqrt(n))
    # live-batch bucket -> {k served: [tokens, steps, rows, seconds]}, summed over workers: what each draft length
    # served there (rows: live rows summed over its steps; tokens / rows is the accepted length, 1.0 for plain;
    # seconds: worker-seconds, so tokens / seconds is a worker's rate at that k)
    bucket_served: dict = field(default_factory=dict)
    # draft versions that entered the job's served store since the previous step's record (the warm draft,
    # published before step 0, is not one of them)
    draft_versions_published: list = field(default_factory=list)


@dataclass
class LeaseOffer(Message):
    """The scheduler's grant: train a copy of `parent_version` for at most `deadline_s` seconds."""

    lease_id: str
    parent_version: int
    deadline_s: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.deadline_s <= 0:
            raise ProtocolError("deadline_s", f"must be > 0, got {self.deadline_s}")


@dataclass
class LeaseOutcome(Message):
    """A lease's state as its worker writes it to job_leases_key (RUNNING when accepted)."""

    lease_id: str
    worker_id: str
    state: LeaseState
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    stopped: bool = False  # preempted before its deadline
    version: int | None = None  # the trained copy in the copies store (None: no step was taken)
    error: str | None = None
    started_at: float = 0.0  # wall clock the lease was accepted (loading the parent counts as lease work)
    ended_at: float = 0.0  # wall clock it stopped (0: still running)


@dataclass
class ScoringRequest(Message):
    """Merge `copies` (the copies store) into a candidate, then score it (at its calibrated draft
    temperature) and the serving version on the scorer's recent rollouts, at the draft length of the job's
    spec, which the worker holds (workers.scoring.Scorer)."""

    round_id: str
    copies: list  # copy versions to average, weighted by their training steps
    serving_version: int | None


@dataclass
class ScoringResult(Message):
    """The scorer's answer, written to job_scoring_key; `error` set when it could not score."""

    round_id: str
    worker_id: str
    candidate: int | None = None  # merged version in the copies store
    candidate_accepted_length: float | None = None
    serving_accepted_length: float | None = None
    candidate_draft_temperature: float | None = None
    num_tokens: int = 0  # recorded pairs the scores were measured on
    error: str | None = None
    # the scorer's rollouts arrived and it stopped (error says so): the round is scored again later, not decided
    preempted: bool = False


@dataclass
class CollapseEvent(Message):
    """A worker's swap guard found a swapped-in draft accepting almost nothing of its published score
    (workers.guard), and rolled back; appended to job_collapses_key, counted in job_totals_key."""

    worker_id: str
    version: int  # the draft version that collapsed
    rolled_back_to: int | None  # the version reinstalled; None: none in the store to go back to, or it failed
    published_accepted_length: float  # its score when published, at the job's draft_k
    expected_accepted_length: float  # that score carried over to the draft lengths served
    measured_accepted_length: float  # tokens per verify step the engine gave since the swap
    num_verify_steps: int
    mean_draft_length: float
    rl_step: int
    at: float  # wall clock of the rollback
    error: str | None = None  # why the rollback failed (one line)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_id("worker_id", self.worker_id)


@dataclass
class Announcement(Message):
    """Published on drafts_channel when a version lands in the index."""

    version: int
    sha256: str
    path: str
    published_at: float

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.version < 1:
            raise ProtocolError("version", f"must be >= 1, got {self.version}")
