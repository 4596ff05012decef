"""Per-worker progress reporting to Redis, at a bounded rate."""

from __future__ import annotations

import time
from collections.abc import Callable

from workers.protocol import (
    EVENTS_MAXLEN,
    MAX_PROGRESS_UPDATES_PER_S,
    PROGRESS_TTL_S,
    ProgressRecord,
    job_events_key,
    job_workers_key,
    progress_key,
)


class ProgressReporter:
    """Writes a worker's record at most `max_updates_per_s` times a second. Updates in between are
    held back (the newest is kept for `flush`); a state change is always written at once and also
    appended to the job's event stream. Each write is one MULTI/EXEC pipeline."""

    def __init__(self, redis, job_id: str, worker_id: str, max_updates_per_s: float = MAX_PROGRESS_UPDATES_PER_S,
                 ttl_s: float = PROGRESS_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if max_updates_per_s <= 0:
            raise ValueError(f"max_updates_per_s must be > 0, got {max_updates_per_s}")
        self.redis, self.job_id, self.worker_id = redis, job_id, worker_id
        self.min_interval = 1.0 / max_updates_per_s
        self.ttl_ms = int(ttl_s * 1000)
        self.clock = clock
        self.last_write: float | None = None
        self.last_state = None
        self.held: ProgressRecord | None = None
        self.num_writes = self.num_skipped = 0

    def report(self, record: ProgressRecord, force: bool = False) -> bool:
        now = self.clock()
        changed = record.state != self.last_state
        due = self.last_write is None or now - self.last_write >= self.min_interval
        if not (force or changed or due):
            self.held = record
            self.num_skipped += 1
            return False
        self._write(record, changed, now)
        return True

    def flush(self) -> bool:
        if self.held is None:
            return False
        self._write(self.held, self.held.state != self.last_state, self.clock())
        return True

    def _write(self, record: ProgressRecord, changed: bool, now: float) -> None:
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(progress_key(self.job_id, self.worker_id), record.to_json(), px=self.ttl_ms)
        pipe.sadd(job_workers_key(self.job_id), self.worker_id)
        if changed:
            prev = self.last_state.value if self.last_state is not None else ""
            pipe.xadd(job_events_key(self.job_id),
                      {"worker": self.worker_id, "from": prev, "to": record.state.value,
                       "ts": repr(record.timestamp), "rl_step": str(record.rl_step)},
                      maxlen=EVENTS_MAXLEN, approximate=True)
        pipe.execute()
        self.last_write, self.last_state, self.held = now, record.state, None
        self.num_writes += 1
