"""A running job's Redis records as its driver holds them, so that the job survives a Redis that comes back
EMPTY (a FLUSHALL, a new instance without persistence), not only one that blinks.

The driver keeps the job's record as the scheduler wrote it (state RUNNING, spec, created_at) and every step
record it wrote or found at its start. Each phase change checks, in the same round trip as the phase write,
that the record is still there. If it is gone, one MULTI/EXEC (under WATCH of the record) writes back the
record, the job's entries in the jobs index and the running set, its step records and its idle total; then
the draft versions on disk in the job's two draft stores are indexed again, the latest pointer first, so that
nothing is announced (workers keep the draft they serve). The scheduler's launcher then settles the job from
its record as usual. What cannot be written back is listed in docs/operations.md ("Redis returning empty").
"""

from __future__ import annotations

import json
import logging
import time

import redis as redis_lib

from workers.protocol.client import text
from workers.protocol.keys import (
    TotalsField,
    drafts_latest_key,
    job_key,
    job_phase_key,
    job_steps_key,
    job_totals_key,
    jobs_index_key,
    running_jobs_key,
)
from workers.protocol.messages import PhaseRecord, StepRecord
from workers.protocol.states import JobState
from workers.store import job_stores

log = logging.getLogger(__name__)
DRAFT_GLOB = "draft-v*.safetensors"  # drafter.train.checkpoint.draft_path's names


class JobRecords:
    def __init__(self, redis: redis_lib.Redis, job_id: str, store_dir: str) -> None:
        """Read what there is to keep: the job's record (None for a driver started without a scheduler: then
        nothing is ever written back) and its step records (after a resume trimmed them)."""
        self.redis, self.job_id, self.store_dir = redis, job_id, store_dir
        raw = redis.get(job_key(job_id))
        self.record = json.loads(raw) if raw else None
        self.steps = [text(s) for s in redis.lrange(job_steps_key(job_id), 0, -1)]
        self.restored: list[str] = []  # "at step 3", each time Redis came back without the job

    def set_phase(self, phase: PhaseRecord) -> None:
        """The driver's phase, and the check that the job's record is still in Redis (one round trip)."""
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(job_phase_key(self.job_id), phase.to_json())
            pipe.exists(job_key(self.job_id))
            _, exists = pipe.execute()
        if not exists:
            self.restore(phase.rl_step)

    def append_step(self, record: StepRecord) -> None:
        """A finished step's record and the running idle total, in one MULTI/EXEC; kept here too."""
        line = record.to_json()
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(job_steps_key(self.job_id), line)
            pipe.hincrbyfloat(job_totals_key(self.job_id), TotalsField.IDLE_WORKER_S, record.idle_worker_s)
            pipe.execute()
        self.steps.append(line)

    def ensure(self, rl_step: int) -> None:
        """Write the job back if Redis lost it (before the run's end is recorded: the launcher settles the
        job from its record)."""
        if not self.redis.exists(job_key(self.job_id)):
            self.restore(rl_step)

    def restore(self, rl_step: int) -> bool:
        """Write back the job's record, index entries, step records and idle total if its record is gone, then
        index its draft files again. Returns whether it did (not when the driver holds no record, or when the
        scheduler wrote the record meanwhile)."""
        if self.record is None:
            return False
        key, now = job_key(self.job_id), time.time()
        record = {**self.record, "state": JobState.RUNNING.value, "updated_at": now}
        idle = sum(float(json.loads(s).get("idle_worker_s", 0.0)) for s in self.steps)
        with self.redis.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(key)
                if pipe.exists(key):
                    pipe.unwatch()
                    return False
                pipe.multi()
                pipe.set(key, json.dumps(record))
                pipe.zadd(jobs_index_key(), {self.job_id: float(record.get("created_at") or now)})
                pipe.sadd(running_jobs_key(), self.job_id)
                pipe.delete(job_steps_key(self.job_id))
                if self.steps:
                    pipe.rpush(job_steps_key(self.job_id), *self.steps)
                pipe.hset(job_totals_key(self.job_id), TotalsField.IDLE_WORKER_S, idle)
                pipe.execute()
            except redis_lib.WatchError:
                return False  # the scheduler wrote it in between: it is there
        adopted = self._reindex_drafts()
        self.restored.append(f"at step {rl_step}")
        log.warning("job %s: Redis came back without its records at step %d; wrote back the job, %d step records "
                    "and %d draft versions", self.job_id, rl_step, len(self.steps), adopted)
        return True

    def _reindex_drafts(self) -> int:
        """Index the job's draft files again (DraftStore.recover), with each store's latest pointer set first to
        its newest file, so that no adoption counts as newer and is announced. Returns the versions indexed."""
        adopted = 0
        for store in job_stores(self.redis, self.store_dir, self.job_id):
            names = [p.name for p in store.directory.glob(DRAFT_GLOB)]
            versions = [int(v) for n in names if (v := n[len("draft-v"):-len(".safetensors")]).isdigit()]
            if not versions:
                continue
            current = store.latest_version()
            if current is None or current < max(versions):
                self.redis.set(drafts_latest_key(store.namespace), max(versions))
            report = store.recover()
            adopted += len(report["adopted"])
            if report["rejected"]:
                log.error("job %s: draft files not indexed again: %s", self.job_id, report["rejected"])
        return adopted
