"""One job's scheduler-side TLT state, persisted in Redis (job_tlt_key) after every change, so a
restarted scheduler loses no lease, no unmerged copy and no round under scoring."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field

from workers.protocol import job_tlt_key

log = logging.getLogger(__name__)


@dataclass
class JobTLT:
    # worker id -> {lease_id, parent_version, deadline_s, offered_at}: offered, not collected yet
    leases: dict = field(default_factory=dict)
    copies: list = field(default_factory=list)  # finished copy versions not merged yet
    trained: list = field(default_factory=list)  # workers that trained in this round (their data is seen)
    reclaimed_worker_s: float = 0.0  # worker-seconds spent training drafters
    num_leases: int = 0
    num_rounds: int = 0
    num_published: int = 0
    num_rejected: int = 0
    swaps_seen: dict = field(default_factory=dict)  # worker id -> num_swaps last observed
    scoring: dict | None = None  # the round being scored or published (scheduler/rounds.py)

    def save(self, redis, job_id: str) -> None:
        redis.hset(job_tlt_key(job_id), mapping={
            "reclaimed_worker_s": self.reclaimed_worker_s, "num_published": self.num_published,
            "num_rejected": self.num_rejected, "num_leases": self.num_leases, "active_leases": len(self.leases),
            "state": json.dumps(asdict(self))})

    @classmethod
    def load(cls, redis, job_id: str) -> JobTLT:
        raw = redis.hget(job_tlt_key(job_id), "state")
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
