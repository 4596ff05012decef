"""The Redis key schema and the progress message type: the one place both sides build keys.

Clients are created with decode_responses=True: every value is a JSON string.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from enum import StrEnum

log = logging.getLogger(__name__)

PREFIX = "tlt:"
MAX_PROGRESS_UPDATES_PER_S = 10  # enough for a live view; 256 workers stay under 3k writes/s
PROGRESS_TTL_S = 15  # a worker silent this long is gone: 150 missed updates, far past any GC pause
EVENTS_MAXLEN = 10_000  # state transitions kept per job (approximate trim): hours of a busy job


class ProtocolError(ValueError):
    """A message that does not follow the protocol; the message names the field."""


class WorkerState(StrEnum):
    ROLLING_OUT = "ROLLING_OUT"
    IDLE = "IDLE"
    TRAINING = "TRAINING"
    SWAPPING = "SWAPPING"
    FAILED = "FAILED"


# ----- keys ---------------------------------------------------------------------------------------
def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}"


def job_workers_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:workers"


def progress_key(job_id: str, worker_id: str) -> str:
    return f"{PREFIX}job:{job_id}:worker:{worker_id}:progress"


def job_events_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:events"


def job_steps_key(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:steps"


def job_commands_channel(job_id: str) -> str:
    return f"{PREFIX}job:{job_id}:commands"


def drafts_index_key(namespace: str) -> str:
    return f"{PREFIX}drafts:{namespace}:index"


def drafts_latest_key(namespace: str) -> str:
    return f"{PREFIX}drafts:{namespace}:latest"


def drafts_counter_key(namespace: str) -> str:
    return f"{PREFIX}drafts:{namespace}:next_version"


def drafts_channel(namespace: str) -> str:
    return f"{PREFIX}drafts:{namespace}:published"


# ----- progress -----------------------------------------------------------------------------------
_INTS = ("num_running", "num_finished", "num_total", "num_tokens", "draft_version", "policy_version", "rl_step")
_FLOATS = ("tokens_per_s", "mean_accepted_length", "timestamp")


@dataclass
class ProgressRecord:
    job_id: str
    worker_id: str
    state: WorkerState
    num_running: int
    num_finished: int
    num_total: int
    num_tokens: int
    tokens_per_s: float
    mean_accepted_length: float
    draft_version: int
    policy_version: int
    rl_step: int
    timestamp: float

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("job_id", "worker_id"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ProtocolError(f"{name} must be a non-empty string, got {value!r}")
        try:
            self.state = WorkerState(self.state)
        except ValueError:
            raise ProtocolError(f"state must be one of {[s.value for s in WorkerState]}, got {self.state!r}") from None
        for name in _INTS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ProtocolError(f"{name} must be an int >= 0, got {value!r}")
        for name in _FLOATS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ProtocolError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.num_finished > self.num_total or self.num_running > self.num_total:
            raise ProtocolError(f"num_finished/num_running exceed num_total ({self.num_total})")

    def to_json(self) -> str:
        d = asdict(self)
        d["state"] = self.state.value
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str | bytes) -> ProgressRecord:
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError(f"progress record is not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ProtocolError("progress record must be a JSON object")
        names = {f.name for f in fields(cls)}
        missing, unknown = names - set(d), set(d) - names
        if missing:
            raise ProtocolError(f"progress record lacks fields {sorted(missing)}")
        if unknown:
            raise ProtocolError(f"progress record has unknown fields {sorted(unknown)}")
        return cls(**d)


def read_progress(redis, job_id: str) -> list[ProgressRecord]:
    """Every live worker's latest record. Expired workers are skipped; a malformed record is logged
    with its key and skipped: a bad writer never crashes the reader."""
    worker_ids = sorted(redis.smembers(job_workers_key(job_id)))
    if not worker_ids:
        return []
    values = redis.mget([progress_key(job_id, w) for w in worker_ids])
    records = []
    for worker_id, value in zip(worker_ids, values):
        if value is None:
            continue
        try:
            records.append(ProgressRecord.from_json(value))
        except ProtocolError as exc:
            log.error("ignoring progress record %s: %s", progress_key(job_id, worker_id), exc)
    return records


def read_events(redis, job_id: str, count: int = 100) -> list[dict]:
    """The newest `count` state transitions of a job, oldest first."""
    entries = redis.xrevrange(job_events_key(job_id), count=count)
    return [dict(fields_) | {"id": entry_id} for entry_id, fields_ in reversed(entries)]
