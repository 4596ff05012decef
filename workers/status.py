"""A rollout worker's view of itself: its state, its rollout counters, and the progress record they
make, reported to Redis through a rate-bounded ProgressReporter.

The rollout, lease and swap threads all change the state; every change goes through `set_state`,
which reports it at once. A worker whose rollout or engine failed stays FAILED: nothing moves it on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis as redis_lib

from workers.progress import ProgressReporter
from workers.protocol.messages import ProgressRecord
from workers.protocol.states import WorkerState

log = logging.getLogger(__name__)

# the rollout counters of a ProgressRecord, as they are when no rollout has run yet
IDLE_COUNTERS = {"num_running": 0, "num_finished": 0, "num_total": 0, "num_tokens": 0, "tokens_per_s": 0.0,
                 "mean_accepted_length": 1.0}


class WorkerStatus:
    """State, step, policy version and rollout counters of one worker; `facts` supplies the rest of
    its progress record (draft version, buffer tokens, swaps), read when a record is made."""

    def __init__(self, redis: redis_lib.Redis, job_id: str, worker_id: str, facts: Callable[[], dict]) -> None:
        self.job_id, self.worker_id, self.facts = job_id, worker_id, facts
        self.reporter = ProgressReporter(redis, job_id, worker_id)
        self.state = WorkerState.IDLE
        self.rl_step = 0
        self.policy_version = 0
        self.counters = dict(IDLE_COUNTERS)
        self.is_generating = False  # a rollout is under way: leases yield to it, swaps leave the state alone
        self.is_reporting = True  # benchmarks switch the decode loop's reports off to measure their cost
        self.report_seconds = 0.0  # time the decode loop spent in progress reports (their whole cost to it)
        self._lock = threading.Lock()  # state changes come from the rollout, lease and swap threads

    def record(self) -> ProgressRecord:
        return ProgressRecord(job_id=self.job_id, worker_id=self.worker_id, state=self.state,
                              policy_version=self.policy_version, rl_step=self.rl_step, timestamp=time.time(),
                              **self.counters, **self.facts())

    def report(self, force: bool = False) -> None:
        try:
            self.reporter.report(self.record(), force=force)
        except Exception:  # a best-effort report: never fail a rollout because Redis blinked
            log.exception("job %s: worker %s: progress report failed", self.job_id, self.worker_id)

    def flush(self) -> None:
        """Write the newest record now if the rate limit held it back; best effort, as every report (a finished
        batch is never lost because Redis blinked as it ended)."""
        try:
            self.reporter.flush()
        except Exception:  # a best-effort report, as above
            log.exception("job %s: worker %s: progress flush failed", self.job_id, self.worker_id)

    def set_state(self, state: WorkerState, only_from: WorkerState | None = None) -> bool:
        """Move to `state` (and report it); with `only_from`, only if the worker is in that state now.
        Nothing leaves FAILED. Returns whether the state was set."""
        with self._lock:
            if self.state == WorkerState.FAILED or (only_from is not None and self.state != only_from):
                return False
            self.state = state
            self.report(force=True)
            return True

    def fail(self) -> None:
        """The rollout or the engine failed: report FAILED (the scheduler gives this worker no more work)."""
        self.set_state(WorkerState.FAILED)

    def begin_rollout(self, rl_step: int, num_total: int) -> None:
        self.rl_step = rl_step
        self.counters = dict(IDLE_COUNTERS, num_running=num_total, num_total=num_total)
        self.set_state(WorkerState.ROLLING_OUT)

    def on_step(self, num_finished: int, num_tokens: int, seconds: float, mean_accepted_length: float) -> None:
        """The decode loop advanced: update the counters and report them (rate-limited by the reporter)."""
        self.counters.update(num_running=self.counters["num_total"] - num_finished, num_finished=num_finished,
                             num_tokens=num_tokens, tokens_per_s=num_tokens / max(seconds, 1e-9),
                             mean_accepted_length=mean_accepted_length)
        if self.is_reporting:
            t0 = time.perf_counter()
            self.report()
            self.report_seconds += time.perf_counter() - t0

    def heartbeat(self) -> None:
        """A quiet second: keep the record alive (workers waiting at the barrier outlive the TTL)."""
        try:
            self.reporter.heartbeat()
        except Exception:  # a best-effort heartbeat: the next quiet second tries again
            log.exception("job %s: worker %s: heartbeat failed", self.job_id, self.worker_id)
