"""One job's scheduler-side TLT state, persisted in Redis (job_tlt_key) after every change, so a
restarted scheduler loses no lease, no unmerged copy and no round under scoring."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields

from scheduler.policy import RolloutWindow
from workers.protocol.keys import (
    TltField,
    job_tlt_key,
)

log = logging.getLogger(__name__)
MAX_STEPS_KEPT = 1000  # per-step reclaimed counters kept (GET /v1/jobs/{id}/drafts: reclaimed_by_step)


@dataclass
class JobTLT:
    # worker id -> {lease_id, parent_version, deadline_s, offered_at, rl_step}: offered, not collected yet
    leases: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)  # finished copy versions not merged yet
    trained: list = field(default_factory=list)  # workers that trained in this round (their data is seen)
    # worker id -> the rl_step of its progress record when its latest lease of the round was offered (the lease
    # trains on rollouts up to that step): once its record is of a later step, it has rollouts the round's copies
    # never saw (Rounds.start)
    trained_steps: dict = field(default_factory=dict)
    reclaimed_worker_s: float = 0.0  # worker-seconds spent training drafters
    num_leases: int = 0
    num_rounds: int = 0
    num_published: int = 0
    num_rejected: int = 0
    num_requeued: int = 0  # rounds whose scorer's rollouts stopped their scoring (Rounds.requeue)
    swaps_seen: dict = field(default_factory=dict)  # worker id -> num_swaps last observed
    scoring: dict | None = None  # the round being scored or published (scheduler/rounds.py)
    last_scoring_s: float | None = None  # how long the last round took to score, ask to result (None: none yet)
    rollouts: list = field(default_factory=list)  # recent steps' rollout windows [rl_step, start, end or None]
    # rl_step (str, JSON keys) -> worker-seconds of leases within that step's rollout, the newest MAX_STEPS_KEPT
    reclaimed_by_step: dict = field(default_factory=dict)

    def windows(self) -> list[RolloutWindow]:
        return [RolloutWindow(*w) for w in self.rollouts]

    def set_windows(self, windows: list[RolloutWindow]) -> None:
        self.rollouts = [[w.rl_step, w.start, w.end] for w in windows]

    def add_reclaimed(self, by_step: dict[int, float]) -> None:
        for step, seconds in by_step.items():
            self.reclaimed_by_step[str(step)] = self.reclaimed_by_step.get(str(step), 0.0) + seconds
            self.reclaimed_worker_s += seconds
        for step in sorted(self.reclaimed_by_step, key=int)[:-MAX_STEPS_KEPT]:
            del self.reclaimed_by_step[step]

    def save(self, redis, job_id: str) -> None:
        redis.hset(job_tlt_key(job_id), mapping={
            TltField.RECLAIMED_WORKER_S: self.reclaimed_worker_s, TltField.NUM_PUBLISHED: self.num_published,
            TltField.NUM_REJECTED: self.num_rejected, TltField.NUM_REQUEUED: self.num_requeued,
            TltField.NUM_LEASES: self.num_leases,
            TltField.ACTIVE_LEASES: len(self.leases),
            TltField.STATE: json.dumps({f.name: getattr(self, f.name) for f in fields(self)})})  # plain JSON already

    @staticmethod
    def read_reclaimed_by_step(redis, job_id: str) -> dict[int, float]:
        """rl_step -> reclaimed worker-seconds of that step's rollout, from the saved state ({} if none)."""
        raw = redis.hget(job_tlt_key(job_id), TltField.STATE)
        try:
            return {int(k): float(v) for k, v in json.loads(raw or "{}").get("reclaimed_by_step", {}).items()}
        except (json.JSONDecodeError, TypeError, ValueError, AttributeError):
            log.error("job %s: unreadable per-step reclaimed counters", job_id)
            return {}

    @classmethod
    def load(cls, redis, job_id: str) -> JobTLT:
        raw = redis.hget(job_tlt_key(job_id), TltField.STATE)
        if not raw:
            return cls()
        try:
            return cls(**json.loads(raw))
        except (json.JSONDecodeError, TypeError) as exc:
            log.error("job %s: unreadable TLT state, starting afresh: %s", job_id, exc)
            return cls()


def read_classes(raw: str | None) -> dict[str, str]:
    """The watcher's last worker classes (job_tlt_key field "classes"); {} if none or unreadable."""
    try:
        return json.loads(raw or "{}")
    except json.JSONDecodeError:
        log.error("unreadable worker classes %r", raw[:200])
        return {}
