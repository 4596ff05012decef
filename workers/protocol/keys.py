"""The Redis key schema, the hash field names and the ids: the one module where a key string or a field name
is built. The scheduler and the workers both import it (workers.protocol: keys, states, messages, client).

    tlt:jobs                                   sorted set: job id -> submission time
    tlt:jobs:running                           set of RUNNING job ids (the watcher follows each one)
    tlt:jobs:queued                            sorted set: QUEUED job id -> submission time (the queue, FCFS)
    tlt:owner:{owner}:active                   set of an API token's PENDING, QUEUED and RUNNING jobs (its quota)
    tlt:idempotency:{key}                      job id a submit's Idempotency-Key created (expires)
    tlt:job:{job}                              job record JSON (owned by the scheduler)
    tlt:job:{job}:phase                        PhaseRecord: where the driver is in its step
    tlt:job:{job}:result                       JobResult: how the driver's run ended (the one record of it)
    tlt:job:{job}:steps                        list of StepRecord JSON, one per finished RL step
    tlt:job:{job}:totals                       hash of running totals (TotalsField)
    tlt:job:{job}:collapses                    list of CollapseEvent JSON (bounded): drafts the swap guard rolled back
    tlt:job:{job}:workers                      set of worker ids that ever reported
    tlt:job:{job}:worker:{worker}:progress     ProgressRecord JSON, expires after PROGRESS_TTL_S
    tlt:job:{job}:events                       stream of worker state transitions (event_fields)
    tlt:job:{job}:leases                       hash lease id -> LeaseOutcome JSON (written by the worker)
    tlt:job:{job}:scoring                      ScoringResult JSON of the round under scoring (by the worker)
    tlt:job:{job}:tlt                          hash: the watcher's state, counters and classes (TltField)
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
from enum import StrEnum
from typing import Any

from workers.message import ProtocolError
from workers.protocol.states import WorkerState

PREFIX = "tlt:"
MAX_PROGRESS_UPDATES_PER_S = 10  # enough for a live view; 256 workers stay under 3k writes/s
PROGRESS_TTL_S = 15  # a worker silent this long is gone: 150 missed updates, far past any GC pause
EVENTS_MAXLEN = 10_000  # state transitions kept per job (approximate trim): hours of a busy job
MAX_LEASE_OUTCOMES = 64  # lease outcomes a worker keeps in the leases hash (collected within seconds)
MAX_COLLAPSE_EVENTS = 256  # collapse events kept per job: each is a draft version rolled back on one worker

ID_PATTERN = r"[A-Za-z0-9_.\-]{1,128}"  # job, worker, lease and idempotency ids (the API checks headers with it)
_ID = re.compile(ID_PATTERN)
_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-:]{1,200}")


class TotalsField(StrEnum):
    """The fields of job_totals_key's hash: a job's running totals."""

    IDLE_WORKER_S = "idle_worker_s"  # worker-seconds idle at the step barrier, summed (the driver, per step)
    NUM_DRAFT_COLLAPSES = "num_draft_collapses"  # collapses the workers' swap guards saw


class TltField(StrEnum):
    """The fields of job_tlt_key's hash: what the watcher keeps of a job (scheduler.state.JobTLT, each tick)."""

    STATE = "state"  # JobTLT as JSON: the watcher's own state, read back after a restart
    RECLAIMED_WORKER_S = "reclaimed_worker_s"  # worker-seconds of drafter training within rollout phases
    NUM_LEASES = "num_leases"
    NUM_PUBLISHED = "num_published"
    NUM_REJECTED = "num_rejected"
    NUM_REQUEUED = "num_requeued"  # rounds whose scoring stopped for the scorer's rollouts, scored again later
    ACTIVE_LEASES = "active_leases"
    CLASSES = "classes"  # JSON: worker id -> the watcher's class of it (WorkerState)
    LONG_TAIL = "long_tail"  # 1 while the rollout is in its long tail


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


def queued_jobs_key() -> str:
    return f"{PREFIX}jobs:queued"


def owner_jobs_key(owner: str) -> str:
    """The active jobs of `owner` (scheduler.jobs.token_owner: a hash of the API token, never the token)."""
    return f"{PREFIX}owner:{check_id('owner', owner)}:active"


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


_PLACEMENT_GROUP = "tlt-pg-"


def placement_group_name(job_id: str) -> str:
    """The Ray placement group holding a job's rollout GPUs (detached: it outlives the scheduler process)."""
    return f"{_PLACEMENT_GROUP}{check_id('job_id', job_id)}"


def placement_group_job(name: str) -> str | None:
    """The job a placement group's name is of, None for a group that is not a job's."""
    job_id = name[len(_PLACEMENT_GROUP):] if name.startswith(_PLACEMENT_GROUP) else ""
    return job_id if _is_id(job_id) else None


def worker_actor_name(job_id: str, worker_id: str) -> str:
    """The Ray actor name of a job's rollout worker: the scheduler sends it commands by this name."""
    return f"tlt-worker-{check_id('job_id', job_id)}-{check_id('worker_id', worker_id)}"


def event_fields(worker_id: str, from_state: WorkerState | None, to_state: WorkerState, ts: float,
                 rl_step: int) -> dict[str, str]:
    """A state-transition stream entry (job_events_key); from is "" for a worker's first report."""
    return {"worker": check_id("worker_id", worker_id), "from": from_state.value if from_state else "",
            "to": WorkerState(to_state).value, "ts": repr(float(ts)), "rl_step": str(int(rl_step))}


def parse_event_fields(fields: dict[str, str]) -> dict:
    """A stream entry of event_fields read back: {"worker", "from" ("" or a state), "to", "ts": float,
    "rl_step": int}. KeyError or ValueError for an entry that is not one."""
    return {"worker": check_id("worker_id", fields["worker"]),
            "from": WorkerState(fields["from"]).value if fields["from"] else "",
            "to": WorkerState(fields["to"]).value, "ts": float(fields["ts"]), "rl_step": int(fields["rl_step"])}
