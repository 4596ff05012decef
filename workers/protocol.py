"""The Redis key schema and the message types: the one module where a key string is built.

Every key starts with PREFIX. Clients are made with decode_responses=True (`connect`), so values
come back as str; the readers here and in workers/store.py also accept bytes, because Ray actors
may build plain clients. Every value is JSON: no pickle crosses Redis.

    tlt:job:{job}                              job record (owned by the scheduler)
    tlt:job:{job}:workers                      set of worker ids that ever reported
    tlt:job:{job}:worker:{worker}:progress     ProgressRecord JSON, expires after PROGRESS_TTL_S
    tlt:job:{job}:events                       stream of state transitions (worker, from, to, ts, rl_step)
    tlt:job:{job}:steps                        list of per-step timing JSON, one per RL step
    tlt:job:{job}:commands                     pub/sub channel: scheduler -> the job's workers
    tlt:drafts:{ns}:index                      hash version -> draft index entry JSON
    tlt:drafts:{ns}:latest                     newest published version (only moves forward)
    tlt:drafts:{ns}:next_version               INCR counter that allocates versions
    tlt:drafts:{ns}:published                  pub/sub channel: {version, sha256, path, published_at}

Job and worker ids are [A-Za-z0-9_.-]; a namespace may also hold ':' (e.g. "job1:copies"), which is
safe because every draft key ends in a fixed colon-free suffix. No id can hold a glob character, so
the SCAN patterns below match exactly what they say (never KEYS).
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

import redis as redis_lib

log = logging.getLogger(__name__)

PREFIX = "tlt:"
DECODE_RESPONSES = True  # values are JSON text; str in, str out
MAX_PROGRESS_UPDATES_PER_S = 10  # enough for a live view; 256 workers stay under 3k writes/s
PROGRESS_TTL_S = 15  # a worker silent this long is gone: 150 missed updates, far past any GC pause
EVENTS_MAXLEN = 10_000  # state transitions kept per job (approximate trim): hours of a busy job

_ID = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_NAMESPACE = re.compile(r"[A-Za-z0-9_.\-:]{1,200}")


class ProtocolError(ValueError):
    """A message or key part that does not follow the protocol; `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class WorkerState(StrEnum):  # a (str, Enum): compares and serializes as its value
    ROLLING_OUT = "ROLLING_OUT"
    IDLE = "IDLE"  # done with its share, waiting at the step barrier
    TRAINING = "TRAINING"  # holds a drafter-training lease
    SWAPPING = "SWAPPING"  # loading a new draft version
    FAILED = "FAILED"


def connect(url: str) -> redis_lib.Redis:
    """A client with this protocol's decoding choice."""
    return redis_lib.Redis.from_url(url, decode_responses=DECODE_RESPONSES)


def text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def check_id(field: str, value: Any) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ProtocolError(field, f"must be 1-128 characters of [A-Za-z0-9_.-], got {value!r}")
    return value


def check_namespace(value: Any) -> str:
    if not isinstance(value, str) or not _NAMESPACE.fullmatch(value):
        raise ProtocolError("namespace", f"must be 1-200 characters of [A-Za-z0-9_.:-], got {value!r}")
    return value


# ----- keys ---------------------------------------------------------------------------------------
def job_key(job_id: str) -> str:
    return f"{PREFIX}job:{check_id('job_id', job_id)}"


def jobs_index_key() -> str:
    """Sorted set of job ids, scored by submission time."""
    return f"{PREFIX}jobs"


def idempotency_key(key: str) -> str:
    return f"{PREFIX}idempotency:{check_id('idempotency_key', key)}"


def job_workers_key(job_id: str) -> str:
    return f"{job_key(job_id)}:workers"


def progress_key(job_id: str, worker_id: str) -> str:
    return f"{job_key(job_id)}:worker:{check_id('worker_id', worker_id)}:progress"


def job_events_key(job_id: str) -> str:
    return f"{job_key(job_id)}:events"


def job_steps_key(job_id: str) -> str:
    return f"{job_key(job_id)}:steps"


def job_totals_key(job_id: str) -> str:
    """Hash of running totals over the job's steps (idle_worker_s), kept by the driver beside each
    step record, so a scrape reads a number instead of every step record."""
    return f"{job_key(job_id)}:totals"


def job_tlt_key(job_id: str) -> str:
    """Hash of the scheduler's TLT counters for a job: reclaimed worker-seconds, versions published."""
    return f"{job_key(job_id)}:tlt"


def job_phase_key(job_id: str) -> str:
    """JSON {phase: SYNC | ROLLOUT | UPDATE, rl_step, since}: where the driver is in its step."""
    return f"{job_key(job_id)}:phase"


def job_result_key(job_id: str) -> str:
    """JSON {ok, steps | error, finished_at}, written by the job driver when its run ends: how a job
    ended is known even if no scheduler was up to see it."""
    return f"{job_key(job_id)}:result"


def job_drafts_key(job_id: str) -> str:
    """List of JSON publish decisions: candidate, merged copies, accepted lengths, published version."""
    return f"{job_key(job_id)}:drafts"


def job_commands_channel(job_id: str) -> str:
    return f"{job_key(job_id)}:commands"


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


# ----- progress -----------------------------------------------------------------------------------
_INTS = ("num_running", "num_finished", "num_total", "num_tokens", "draft_version", "policy_version", "rl_step")
_FLOATS = ("tokens_per_s", "mean_accepted_length", "timestamp")


def _check_int(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ProtocolError(field, f"must be an int >= 0, got {value!r}")


def _check_float(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ProtocolError(field, f"must be a finite number >= 0, got {value!r}")


@dataclass
class ProgressRecord:
    """One worker's latest progress; validated on construction, so a bad record is never written."""

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

    def __post_init__(self) -> None:
        check_id("job_id", self.job_id)
        check_id("worker_id", self.worker_id)
        try:
            self.state = WorkerState(self.state)
        except ValueError:
            raise ProtocolError("state", f"must be one of {[s.value for s in WorkerState]}, "
                                         f"got {self.state!r}") from None
        for name in _INTS:
            _check_int(name, getattr(self, name))
        for name in _FLOATS:
            _check_float(name, getattr(self, name))
        if self.num_finished > self.num_total:
            raise ProtocolError("num_finished", f"{self.num_finished} exceeds num_total {self.num_total}")
        if self.num_running > self.num_total - self.num_finished:
            raise ProtocolError("num_running", f"{self.num_running} exceeds num_total - num_finished "
                                               f"({self.num_total - self.num_finished})")

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"state": self.state.value}, allow_nan=False)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ProgressRecord:
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ProtocolError("record", f"not JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ProtocolError("record", f"must be a JSON object, got {type(d).__name__}")
        if d.keys() != _RECORD_FIELDS:
            missing = next((name for name in _RECORD_NAMES if name not in d), None)
            if missing is not None:
                raise ProtocolError(missing, "missing")
            unknown = sorted(set(d) - _RECORD_FIELDS)
            raise ProtocolError(unknown[0], f"unknown field (all unknown: {unknown})")
        return cls(**d)


_RECORD_NAMES = tuple(f.name for f in fields(ProgressRecord))
_RECORD_FIELDS = frozenset(_RECORD_NAMES)


def read_progress(redis: redis_lib.Redis, job_id: str) -> list[ProgressRecord]:
    """Every live worker's latest record, by worker id. Expired workers are skipped; a malformed
    record is logged with its key and field and skipped: a bad writer never crashes the reader."""
    worker_ids = sorted(text(w) for w in redis.smembers(job_workers_key(job_id)))
    keys = []
    for w in worker_ids:
        try:
            keys.append((w, progress_key(job_id, w)))
        except ProtocolError as exc:
            log.error("skipping worker id in %s: %s", job_workers_key(job_id), exc)
    if not keys:
        return []
    values = redis.mget([k for _, k in keys])
    records = []
    for (worker_id, key), value in zip(keys, values):
        if value is None:
            continue
        try:
            rec = ProgressRecord.from_json(value)
            if rec.job_id != job_id:
                raise ProtocolError("job_id", f"{rec.job_id!r} does not match the key's {job_id!r}")
            if rec.worker_id != worker_id:
                raise ProtocolError("worker_id", f"{rec.worker_id!r} does not match the key's {worker_id!r}")
        except ProtocolError as exc:
            log.error("skipping progress record %s: bad field %s (%s)", key, exc.field, exc)
            continue
        records.append(rec)
    return records


def read_json_list(redis: redis_lib.Redis, key: str, start: int = 0) -> list:
    """The JSON entries of a Redis list from index `start`; an unreadable entry is logged with its key
    and skipped (step records, publish decisions)."""
    out = []
    for raw in redis.lrange(key, max(start, 0), -1):
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            log.error("skipping unreadable entry in %s: %r", key, raw[:200])
    return out


# ----- events -------------------------------------------------------------------------------------
def event_fields(worker_id: str, from_state: WorkerState | None, to_state: WorkerState, ts: float,
                 rl_step: int) -> dict[str, str]:
    """A state-transition stream entry; from is "" for a worker's first report."""
    return {"worker": check_id("worker_id", worker_id), "from": from_state.value if from_state else "",
            "to": WorkerState(to_state).value, "ts": repr(float(ts)), "rl_step": str(int(rl_step))}


_STREAM_ID = re.compile(r"\d{1,20}-\d{1,20}")


def read_events(redis: redis_lib.Redis, job_id: str, count: int = 100, after: str | None = None) -> list[dict]:
    """The newest `count` state transitions of a job, oldest first:
    {"id", "worker", "from", "to", "ts": float, "rl_step": int}. With `after` (a stream id from an
    earlier read) only later ones: a poller reads each event once. Malformed entries are logged and skipped."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    if after is not None and not _STREAM_ID.fullmatch(after):
        raise ValueError(f"after must be a stream id like 1700000000000-0, got {after!r}")
    key = job_events_key(job_id)
    events = []
    entries = redis.xrevrange(key, min=f"({after}" if after else "-", count=count)
    for entry_id, raw in reversed(entries):
        d = {text(k): text(v) for k, v in raw.items()}
        try:
            events.append({"id": text(entry_id), "worker": d["worker"], "from": d["from"],
                           "to": WorkerState(d["to"]).value, "ts": float(d["ts"]), "rl_step": int(d["rl_step"])})
        except (KeyError, ValueError) as exc:
            log.error("skipping event %s in %s: %r", text(entry_id), key, exc)
    return events


# ----- draft announcements ------------------------------------------------------------------------
def announcement(version: int, sha256: str, path: str, published_at: float) -> str:
    """The JSON published on drafts_channel when a version lands in the index."""
    return json.dumps({"version": version, "sha256": sha256, "path": path, "published_at": published_at})


def parse_announcement(raw: str | bytes) -> dict:
    try:
        d = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError("announcement", f"not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise ProtocolError("announcement", "must be a JSON object")
    for name, kind in (("version", int), ("sha256", str), ("path", str), ("published_at", int | float)):
        if name not in d:
            raise ProtocolError(name, "missing")
        if isinstance(d[name], bool) or not isinstance(d[name], kind):
            raise ProtocolError(name, f"has the wrong type: {d[name]!r}")
    if d["version"] < 1:
        raise ProtocolError("version", f"must be >= 1, got {d['version']}")
    return d
