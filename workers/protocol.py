"""The Redis key schema, the state vocabularies and every message that crosses a process boundary.

This is the one module where a key string is built and where a state name or a message type is
defined; the scheduler and the workers both import it. Clients are made with decode_responses=True
(`connect`), so values come back as str; readers also accept bytes, because Ray actors may build
plain clients. Every value is JSON: no pickle crosses Redis.

    tlt:jobs                                   sorted set: job id -> submission time
    tlt:jobs:running                           set of RUNNING job ids (the watcher follows each one)
    tlt:idempotency:{key}                      job id a submit's Idempotency-Key created (expires)
    tlt:job:{job}                              job record JSON (owned by the scheduler)
    tlt:job:{job}:phase                        PhaseRecord: where the driver is in its step
    tlt:job:{job}:result                       JobResult: how the driver's run ended (the one record of it)
    tlt:job:{job}:steps                        list of StepRecord JSON, one per finished RL step
    tlt:job:{job}:totals                       hash of running totals: idle_worker_s (the driver, per step),
                                               num_draft_collapses (the workers' swap guards)
    tlt:job:{job}:collapses                    list of CollapseEvent JSON (bounded): drafts the swap guard rolled back
    tlt:job:{job}:workers                      set of worker ids that ever reported
    tlt:job:{job}:worker:{worker}:progress     ProgressRecord JSON, expires after PROGRESS_TTL_S
    tlt:job:{job}:events                       stream of worker state transitions (event_fields)
    tlt:job:{job}:leases                       hash lease id -> LeaseOutcome JSON (written by the worker)
    tlt:job:{job}:scoring                      ScoringResult JSON of the round under scoring (by the worker)
    tlt:job:{job}:tlt                          hash: the watcher's state and counters, worker classes
    tlt:job:{job}:drafts                       list of publish decisions JSON (bounded)
    tlt:drafts:{ns}:index                      hash version -> draft index entry JSON
    tlt:drafts:{ns}:latest                     newest published version (only moves forward)
    tlt:drafts:{ns}:next_version               INCR counter that allocates versions
    tlt:drafts:{ns}:published                  pub/sub channel: announcement JSON

Job and worker ids are [A-Za-z0-9_.-]; a namespace may also hold ':' (e.g. "job1:copies"), which is
safe because every draft key ends in a fixed colon-free suffix. No id can hold a glob character, so
SCAN patterns match exactly what they say (never KEYS).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

import redis as redis_lib

from workers.message import Message, ProtocolError

PREFIX = "tlt:"
DECODE_RESPONSES = True  # values are JSON text; str in, str out
MAX_PROGRESS_UPDATES_PER_S = 10  # enough for a live view; 256 workers stay under 3k writes/s
PROGRESS_TTL_S = 15  # a worker silent this long is gone: 150 missed updates, far past any GC pause
EVENTS_MAXLEN = 10_000  # state transitions kept per job (approximate trim): hours of a busy job
MAX_LEASE_OUTCOMES = 64  # lease outcomes a worker keeps in the leases hash (collected within seconds)
MAX_COLLAPSE_EVENTS = 256  # collapse events kept per job: each is a draft version rolled back on one worker
TOTALS_DRAFT_COLLAPSES = "num_draft_collapses"  # job_totals_key field: collapses the workers' swap guards saw

ID_PATTERN = r"[A-Za-z0-9_.\-]{1,128}"  # job, worker, lease and idempotency ids (the API checks headers with it)
_ID = re.compile(ID_PATTERN)
_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-:]{1,200}")


# ----- vocabularies -------------------------------------------------------------------------------
class WorkerState(StrEnum):
    """A rollout worker's state: what it reports of itself, and how the scheduler classifies it.
    One vocabulary for the worker, the policy, the metrics, the status page and the report."""

    ROLLING_OUT = "ROLLING_OUT"  # generating its share of the step
    IDLE = "IDLE"  # done with its share, waiting at the step barrier
    TRAINING = "TRAINING"  # holds a drafter-training lease
    SWAPPING = "SWAPPING"  # loading a new draft version while idle
    FAILED = "FAILED"  # its rollout or its engine failed; it gets no work
    STRAGGLER = "STRAGGLER"  # scheduler's view only: still generating in the long tail
    STALE = "STALE"  # scheduler's view only: no fresh progress record, neither counted nor given work


REPORTED_STATES = frozenset({WorkerState.ROLLING_OUT, WorkerState.IDLE, WorkerState.TRAINING,
                             WorkerState.SWAPPING, WorkerState.FAILED})  # what a worker writes of itself
GENERATING_STATES = frozenset({WorkerState.ROLLING_OUT, WorkerState.SWAPPING, WorkerState.STRAGGLER})


class Phase(StrEnum):
    """Where a job's driver is in its RL step (PhaseRecord)."""

    SYNC = "SYNC"  # pushing policy weights to the workers
    ROLLOUT = "ROLLOUT"  # the step's generation is under way: idle workers may train drafters
    UPDATE = "UPDATE"  # rewards, log-probs, policy update: every GPU is needed
    DONE = "DONE"  # the run ended (JobResult says how)


class LeaseState(StrEnum):
    RUNNING = "RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})


# a patient client rides out a Redis that blinks (a restart, a failover): each command retries on connection
# errors and timeouts with exponential backoff capped at PATIENT_BACKOFF_CAP_S, about a minute in all. For the
# job's driver and the scheduler's launcher, whose writes must not be lost; never for a worker's decode loop
# (its progress reports are best effort) or the API (it answers 503 at once)
PATIENT_RETRIES = 35
PATIENT_BACKOFF_CAP_S = 2.0


def connect(url: str, patient: bool = False) -> redis_lib.Redis:
    """A client with this protocol's decoding choice; `patient`: one that retries through a Redis outage."""
    if not patient:
        return redis_lib.Redis.from_url(url, decode_responses=DECODE_RESPONSES)
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=PATIENT_BACKOFF_CAP_S, base=0.05), PATIENT_RETRIES,
                  supported_errors=(redis_lib.ConnectionError, redis_lib.TimeoutError))
    return redis_lib.Redis.from_url(url, decode_responses=DECODE_RESPONSES, retry=retry,
                                    retry_on_error=[redis_lib.ConnectionError, redis_lib.TimeoutError])


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


@functools.lru_cache(maxsize=1 << 16)
def _is_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None  # remembered: the watcher reads the same ids every tick


def check_id(field: str, value: Any) -> str:
    if not isinstance(value, str) or not _is_id(value):
        raise ProtocolError(field, f"must be 1-128 characters of [A-Za-z0-9_.-], got {value!r}")
    return value


def check_namespace(value: Any) -> str:
    if not isinstance(value, str) or not _NAMESPACE.fullmatch(value):
        raise ProtocolError("namespace", f"must be 1-200 characters of [A-Za-z0-9_.:-], got {value!r}")
    return value


# ----- keys ---------------------------------------------------------------------------------------
def jobs_index_key() -> str:
    return f"{PREFIX}jobs"


def running_jobs_key() -> str:
    return f"{PREFIX}jobs:running"


def idempotency_key(key: str) -> str:
    return f"{PREFIX}idempotency:{check_id('idempotency_key', key)}"


def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{check_id('job_id', job_id)}"


def job_phase_key(job_id: str) -> str:
    return f"{job_key(job_id)}:phase"


def job_result_key(job_id: str) -> str:
    return f"{job_key(job_id)}:result"


def job_steps_key(job_id: str) -> str:
    return f"{job_key(job_id)}:steps"


def job_totals_key(job_id: str) -> str:
    return f"{job_key(job_id)}:totals"


def job_workers_key(job_id: str) -> str:
    return f"{job_key(job_id)}:workers"


def progress_key(job_id: str, worker_id: str) -> str:
    return f"{job_key(job_id)}:worker:{check_id('worker_id', worker_id)}:progress"


def job_events_key(job_id: str) -> str:
    return f"{job_key(job_id)}:events"


def job_collapses_key(job_id: str) -> str:
    return f"{job_key(job_id)}:collapses"


def job_leases_key(job_id: str) -> str:
    return f"{job_key(job_id)}:leases"


def job_scoring_key(job_id: str) -> str:
    return f"{job_key(job_id)}:scoring"


def job_tlt_key(job_id: str) -> str:
    return f"{job_key(job_id)}:tlt"


def job_drafts_key(job_id: str) -> str:
    return f"{job_key(job_id)}:drafts"


def job_scan_pattern(job_id: str) -> str:
    """SCAN MATCH pattern for every key under a job (the job record itself is job_key)."""
    return f"{job_key(job_id)}:*"


def _drafts(namespace: str) -> str:
    return f"{PREFIX}drafts:{check_namespace(namespace)}"


def drafts_index_key(namespace: str) -> str:
    return f"{_drafts(namespace)}:index"


def drafts_latest_key(namespace: str) -> str:
    return f"{_drafts(namespace)}:latest"


def drafts_counter_key(namespace: str) -> str:
    return f"{_drafts(namespace)}:next_version"


def drafts_channel(namespace: str) -> str:
    return f"{_drafts(namespace)}:published"


def draft_namespaces(job_id: str) -> tuple[str, str]:
    """A job's two draft stores: (served, copies). Served holds the versions workers swap in;
    copies holds each lease's trained copy and the merged candidates."""
    return check_id("job_id", job_id), f"{job_id}:copies"


# ----- Ray actor names ----------------------------------------------------------------------------
RAY_NAMESPACE = "tlt"  # named, detached job drivers are found again by a restarted scheduler here


def driver_actor_name(job_id: str) -> str:
    """The Ray actor name of a job's driver (detached: it outlives the scheduler process)."""
    return f"tlt-driver-{check_id('job_id', job_id)}"


def worker_actor_name(job_id: str, worker_id: str) -> str:
    """The Ray actor name of a job's rollout worker: the scheduler sends it commands by this name."""
    return f"tlt-worker-{check_id('job_id', job_id)}-{check_id('worker_id', worker_id)}"


# ----- messages -----------------------------------------------------------------------------------
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
    temperature) and the serving version on the scorer's recent rollouts."""

    round_id: str
    copies: list  # copy versions to average, weighted by their training steps
    serving_version: int | None
    draft_k: int  # draft length the accepted lengths are measured at


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


# ----- events -------------------------------------------------------------------------------------
def event_fields(worker_id: str, from_state: WorkerState | None, to_state: WorkerState, ts: float,
                 rl_step: int) -> dict[str, str]:
    """A state-transition stream entry; from is "" for a worker's first report."""
    return {"worker": check_id("worker_id", worker_id), "from": from_state.value if from_state else "",
            "to": WorkerState(to_state).value, "ts": repr(float(ts)), "rl_step": str(int(rl_step))}


# ----- draft announcements ------------------------------------------------------------------------
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
