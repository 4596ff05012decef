"""Job records in Redis and their atomic state changes.

A record is {job_id, state, spec, created_at, updated_at, error}; the steps a job has finished are
the length of its steps list (job_steps_key, appended by the driver), never a copy in the record.
The set running_jobs_key() holds every RUNNING job, the sorted set queued_jobs_key() every QUEUED one by its
submission time (the queue: scheduler.queue admits its head; a submit enters it as it is stored, JobStore.create),
and owner_jobs_key(owner) the jobs an API token holds that have not ended (its quota): each changes in the same
MULTI/EXEC as the record, so the watcher follows each running job, and the queue and the quotas stay true,
however many jobs the store holds.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterable, Iterator

import redis as redis_lib

from workers.protocol.client import text
from workers.protocol.keys import (
    idempotency_key,
    job_key,
    job_steps_key,
    jobs_index_key,
    owner_jobs_key,
    queued_jobs_key,
    running_jobs_key,
)
from workers.protocol.states import TERMINAL_JOB_STATES, JobState
from workers.spec import JobSpec

IDEMPOTENCY_TTL_S = 24 * 3600  # a client retrying a submit does so within minutes; a day is generous
SCAN_BATCH = 1000  # job ids read per round trip when walking the whole index
# the least two submission times differ by: above a float's resolution at today's epoch seconds (2.4e-7)
MIN_SUBMISSION_STEP_S = 1e-6


def submission_time(latest: list[tuple[str, float]]) -> float:
    """A new job's created_at: now, and later than the newest job's (`latest`, the job index's last entry with its
    score), so the order of the times is the order the jobs were stored in, whatever the clock did."""
    now = time.time()
    return max(now, latest[0][1] + MIN_SUBMISSION_STEP_S) if latest else now


class IdempotencyKeyError(ValueError):
    """An idempotency key that cannot answer this submit; `reason` says why without the key (the API answers
    with it: input is never echoed)."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key!r} {reason}")
        self.reason = reason


class QuotaError(ValueError):
    """A submit over its token's quota of jobs not ended (QUEUED, RUNNING): nothing was stored."""

    def __init__(self, max_active: int) -> None:
        super().__init__(f"over the token's quota: max_jobs_per_token ({max_active}) jobs queued or running; "
                         f"submit again when one has ended")
        self.max_active = max_active


def token_owner(token: str | None) -> str:
    """Whose quota a job counts against: "anonymous" on a server without a token, else "token-" and 12 hex digits
    of the token's sha256 (stored on the job record and in a key name: never the token itself)."""
    if token is None:
        return "anonymous"
    return "token-" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:12]


class JobStore:
    """Job records: one JSON string per job, an index sorted by submission time, the running set."""

    def __init__(self, redis: redis_lib.Redis) -> None:
        self.redis = redis

    def create(self, spec: JobSpec, idem_key: str | None = None, owner: str | None = None,
               max_active: int | None = None, *, is_queued: bool = False) -> tuple[dict, bool]:
        """Store a new PENDING job (with is_queued: QUEUED, in line); returns (record, created). With an
        idempotency key already used for the same spec, returns that job and creates nothing;
        IdempotencyKeyError (a ValueError) naming the key if it was used for another spec. With `owner`
        (token_owner) and `max_active`: QuotaError, and nothing stored, when the owner already has max_active jobs
        not ended (a replay is answered all the same). The key, the record, the index entry, the queue entry and
        the owner's set are written in one MULTI/EXEC under WATCH, so concurrent submits with one key create
        exactly one job, a quota is never exceeded, and a reader never sees the key without the job.
        The submission time (created_at) is stamped under WATCH of the job index, later than every job stored
        (submission_time): a submit that another one overtook is stamped again, so the index, the queue and
        created_at all hold the order the submits were stored in, and the queue's head is never a job submitted
        after one that is not in line yet (two submits 15 ms apart once started in the opposite order)."""
        job_id = uuid.uuid4().hex[:16]
        dumped = spec.model_dump()
        owned = owner_jobs_key(owner) if owner is not None else None
        digest = hashlib.sha256(json.dumps(dumped, sort_keys=True).encode()).hexdigest()
        idem = idempotency_key(idem_key) if idem_key is not None else None
        state = JobState.QUEUED if is_queued else JobState.PENDING
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    if idem is not None:
                        pipe.watch(idem)
                        claimed = pipe.get(idem)
                        if claimed is not None:
                            pipe.unwatch()
                            return self._replay(text(claimed), digest, idem_key), False
                    if owned is not None and max_active is not None:
                        pipe.watch(owned)
                        if pipe.scard(owned) >= max_active:
                            pipe.unwatch()
                            raise QuotaError(max_active)
                    pipe.watch(jobs_index_key())
                    now = submission_time(pipe.zrange(jobs_index_key(), -1, -1, withscores=True))
                    record = {"job_id": job_id, "state": state.value, "spec": dumped, "created_at": now,
                              "updated_at": now, "error": None, "owner": owner}
                    pipe.multi()
                    if idem is not None:
                        pipe.set(idem, json.dumps({"job_id": job_id, "spec_sha256": digest}), ex=IDEMPOTENCY_TTL_S)
                    pipe.set(job_key(job_id), json.dumps(record))
                    pipe.zadd(jobs_index_key(), {job_id: now})
                    if is_queued:
                        pipe.zadd(queued_jobs_key(), {job_id: now})
                    if owned is not None:
                        pipe.sadd(owned, job_id)
                    pipe.execute()
                    return record, True
                except redis_lib.WatchError:  # another submit was stored first: stamp again, after it
                    continue

    def _replay(self, claimed: str, digest: str, idem_key: str) -> dict:
        """The job an idempotency key was claimed for, if `digest` is its spec's."""
        try:
            claim = json.loads(claimed)
            job_id, spec_sha = claim["job_id"], claim["spec_sha256"]
            earlier = self.get(job_id) if spec_sha == digest else None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise IdempotencyKeyError(idem_key, "holds an unreadable claim") from None
        if spec_sha != digest:
            raise IdempotencyKeyError(idem_key, "was already used for a different job spec")
        if earlier is None:  # the job was deleted since: the key stays spent until it expires
            raise IdempotencyKeyError(idem_key, f"was used for job {job_id}, which no longer exists")
        return earlier

    def get(self, job_id: str) -> dict | None:
        """The record, or None; ValueError (naming job_id) for an id that cannot be one."""
        raw = self.redis.get(job_key(job_id))
        return json.loads(raw) if raw else None

    def get_many(self, job_ids: list[str]) -> list[dict]:
        """The records of `job_ids` that exist, in that order."""
        raws = self.redis.mget([job_key(i) for i in job_ids]) if job_ids else []
        return [json.loads(r) for r in raws if r]

    def list(self, limit: int = 100) -> list[dict]:
        """The newest `limit` jobs, newest first (pages of the API; never the watcher's list)."""
        return self.get_many([text(i) for i in self.redis.zrevrange(jobs_index_key(), 0, limit - 1)])

    def all_ids(self) -> Iterator[str]:
        """Every job id, oldest first, read SCAN_BATCH at a time."""
        start = 0
        while True:
            ids = self.redis.zrange(jobs_index_key(), start, start + SCAN_BATCH - 1)
            yield from (text(i) for i in ids)
            if len(ids) < SCAN_BATCH:
                return
            start += SCAN_BATCH

    def queue_head(self) -> str | None:
        """The QUEUED job first in line (the earliest submitted), None when the queue is empty."""
        head = self.redis.zrange(queued_jobs_key(), 0, 0)
        return text(head[0]) if head else None

    def queued_ids(self, limit: int) -> list[str]:
        """The first `limit` QUEUED jobs, first in line first."""
        return [text(i) for i in self.redis.zrange(queued_jobs_key(), 0, limit - 1)]

    def drop_from_queue(self, job_id: str) -> None:
        """Take an entry whose job is no longer QUEUED (its record lost with a Redis that came back empty)."""
        self.redis.zrem(queued_jobs_key(), job_id)

    def num_queued(self) -> int:
        return int(self.redis.zcard(queued_jobs_key()))

    def queue_positions(self, job_ids: Iterable[str]) -> list[int | None]:
        """Each job's place in the queue, 1 for the next to start; None for a job not QUEUED (one round trip)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.zrank(queued_jobs_key(), job_id)
            return [None if rank is None else int(rank) + 1 for rank in pipe.execute()]

    def running_ids(self) -> list[str]:
        """Every RUNNING job, whatever its age."""
        return sorted(text(i) for i in self.redis.smembers(running_jobs_key()))

    def num_steps(self, job_ids: Iterable[str]) -> list[int]:
        """RL steps each job has finished: the length of its steps list (one round trip)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.llen(job_steps_key(job_id))
            return [int(n) for n in pipe.execute()]

    def transition(self, job_id: str, to: JobState, allowed_from: set[JobState], **fields) -> dict | None:
        """Change state only from `allowed_from` (WATCH/MULTI), keeping the running set, the queue (a QUEUED job
        enters it at its submission time) and its owner's quota set in the same transaction; returns the new
        record, or None if the job is missing or in another state."""
        key = job_key(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        return None
                    record = json.loads(raw)
                    if JobState(record["state"]) not in allowed_from:
                        return None
                    record.update(fields, state=JobState(to).value, updated_at=time.time())
                    pipe.multi()
                    pipe.set(key, json.dumps(record))
                    if to == JobState.RUNNING:
                        pipe.sadd(running_jobs_key(), job_id)
                    else:
                        pipe.srem(running_jobs_key(), job_id)
                    if to == JobState.QUEUED:
                        pipe.zadd(queued_jobs_key(), {job_id: record["created_at"]})
                    else:
                        pipe.zrem(queued_jobs_key(), job_id)
                    if to in TERMINAL_JOB_STATES and record.get("owner"):
                        pipe.srem(owner_jobs_key(record["owner"]), job_id)
                    pipe.execute()
                    return record
                except redis_lib.WatchError:
                    continue
