"""Per-worker progress in Redis: the rate-bounded writer, and the readers of records and events."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import threading
import time
from collections.abc import Callable

import redis as redis_lib

from workers.message import ProtocolError
from workers.protocol.client import text
from workers.protocol.keys import (
    EVENTS_MAXLEN,
    MAX_PROGRESS_UPDATES_PER_S,
    PROGRESS_TTL_S,
    check_id,
    event_fields,
    job_events_key,
    job_workers_key,
    parse_event_fields,
    progress_key,
)
from workers.protocol.messages import ProgressRecord
from workers.protocol.states import WorkerState

log = logging.getLogger(__name__)


class ProgressReporter:
    """Writes one worker's record at most `max_updates_per_s` times a second.

    Updates in between are skipped (the newest is held for `flush`); a state change, or `force`,
    is written at once and a state change is also appended to the job's event stream. Each write is
    one MULTI/EXEC: SET the record with a TTL (PX, so tests can pass a sub-second `ttl_s`), SADD the
    worker to the job's set, and XADD the transition if there is one. Thread-safe.
    """

    def __init__(self, redis: redis_lib.Redis, job_id: str, worker_id: str,
                 max_updates_per_s: float = MAX_PROGRESS_UPDATES_PER_S, clock: Callable[[], float] = time.monotonic,
                 ttl_s: float = PROGRESS_TTL_S) -> None:
        if isinstance(max_updates_per_s, bool) or not isinstance(max_updates_per_s, int | float) \
                or not max_updates_per_s > 0:
            raise ValueError(f"max_updates_per_s must be a number > 0, got {max_updates_per_s!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, int | float) or ttl_s < 0.001:
            raise ValueError(f"ttl_s must be a number >= 0.001, got {ttl_s!r}")
        self.redis = redis
        self.job_id, self.worker_id = check_id("job_id", job_id), check_id("worker_id", worker_id)
        self.min_interval_s = 1.0 / max_updates_per_s
        self.ttl_ms = max(1, round(ttl_s * 1000))
        self.clock = clock
        self.key = progress_key(job_id, worker_id)
        self.last_write_at: float | None = None  # clock() of the last write
        self.last_state: WorkerState | None = None  # state last written
        self.last_record: ProgressRecord | None = None
        self.held: ProgressRecord | None = None  # newest skipped record, written by flush()
        self.num_writes = 0
        self.num_skipped = 0
        self.num_events = 0
        self._lock = threading.Lock()

    def report(self, record: ProgressRecord, force: bool = False) -> bool:
        """Write `record` if due, forced, or a state change; otherwise hold it. True if written."""
        self._check(record)
        with self._lock:
            now = self.clock()
            is_changed = record.state != self.last_state
            is_due = self.last_write_at is None or now - self.last_write_at >= self.min_interval_s
            if not (force or is_changed or is_due):
                self.held = record
                self.num_skipped += 1
                return False
            self._write(record, now)
            return True

    def flush(self) -> bool:
        """Write the newest skipped record, if any (e.g. at the end of a rollout). True if written."""
        with self._lock:
            if self.held is None:
                return False
            self._write(self.held, self.clock())
            return True

    def heartbeat(self, wall_clock: Callable[[], float] = time.time) -> bool:
        """Rewrite the last record with a fresh timestamp, so a worker that is alive but has nothing
        new to say (waiting at the barrier longer than the TTL) does not look gone. True if written."""
        with self._lock:
            if self.last_record is None:
                return False
            self._write(dataclasses.replace(self.held or self.last_record, timestamp=wall_clock()), self.clock())
            return True

    def _check(self, record: ProgressRecord) -> None:
        if not isinstance(record, ProgressRecord):
            raise ValueError(f"record must be a ProgressRecord, got {type(record).__name__}")
        if record.job_id != self.job_id:
            raise ValueError(f"record.job_id {record.job_id!r} is not this reporter's {self.job_id!r}")
        if record.worker_id != self.worker_id:
            raise ValueError(f"record.worker_id {record.worker_id!r} is not this reporter's {self.worker_id!r}")

    def _write(self, record: ProgressRecord, now: float) -> None:
        is_changed = record.state != self.last_state
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.key, record.to_json(), px=self.ttl_ms)
        pipe.sadd(job_workers_key(self.job_id), self.worker_id)
        if is_changed:
            pipe.xadd(job_events_key(self.job_id),
                      event_fields(self.worker_id, self.last_state, record.state, record.timestamp, record.rl_step),
                      maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.execute()  # only after it succeeded does the reporter's view move on
        self.last_write_at, self.last_state, self.last_record, self.held = now, record.state, record, None
        self.num_writes += 1
        self.num_events += is_changed


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


def read_json_list(redis: redis_lib.Redis, key: str, start: int = 0, count: int | None = None) -> list:
    """The JSON entries of a Redis list from index `start` (`count` of them, None: to the end); an unreadable
    entry is logged with its key and skipped (step records, publish decisions)."""
    out = []
    start = max(start, 0)
    for raw in redis.lrange(key, start, -1 if count is None else start + max(count, 1) - 1):
        try:
            out.append(json.loads(raw))
        except json.JSONDecodeError:
            log.error("skipping unreadable entry in %s: %r", key, raw[:200])
    return out


_STREAM_ID = re.compile(r"([0-9]{1,20})-([0-9]{1,20})")  # ASCII digits only: \d takes any script's
MAX_STREAM_ID_PART = (1 << 64) - 1  # each part of a Redis stream id is an unsigned 64-bit integer
STREAM_ID_RULE = "must be a stream id like 1700000000000-0: two integers, each below 2**64"


def stream_id_after(after: str) -> str | None:
    """The smallest stream id greater than `after` (None: nothing can follow it); ValueError (STREAM_ID_RULE,
    the value not echoed) for anything else. Reads then ask for an inclusive range from it: Redis refuses an
    exclusive one from the largest id, which a crafted cursor turned into a 500."""
    match = _STREAM_ID.fullmatch(after) if isinstance(after, str) else None
    if match is None or any(int(part) > MAX_STREAM_ID_PART for part in match.groups()):
        raise ValueError(f"after {STREAM_ID_RULE}")
    ms, seq = (int(part) for part in match.groups())
    if seq < MAX_STREAM_ID_PART:
        return f"{ms}-{seq + 1}"
    return f"{ms + 1}-0" if ms < MAX_STREAM_ID_PART else None


def read_events(redis: redis_lib.Redis, job_id: str, count: int = 100, after: str | None = None) -> list[dict]:
    """State transitions of a job, oldest first: {"id", "worker", "from", "to", "ts": float, "rl_step": int}.
    Without `after` the newest `count`; with it (a stream id from an earlier read) the first `count` after it,
    so a poller that continues from the last id it got reads every event once, with no gap. Malformed
    entries are logged and skipped."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count must be an int >= 1, got {count!r}")
    key = job_events_key(job_id)
    if after is None:
        entries = redis.xrevrange(key, count=count)[::-1]
    else:
        first = stream_id_after(after)
        entries = redis.xrange(key, min=first, count=count) if first is not None else []
    events = []
    for entry_id, raw in entries:
        d = {text(k): text(v) for k, v in raw.items()}
        try:
            events.append({"id": text(entry_id), **parse_event_fields(d)})
        except (KeyError, ValueError) as exc:
            log.error("skipping event %s in %s: %r", text(entry_id), key, exc)
    return events
