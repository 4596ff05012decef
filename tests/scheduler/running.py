"""A RUNNING job as the driver and its workers leave it in Redis, for watcher tests without a driver."""

from __future__ import annotations

import time

from scheduler.jobs import JobStore
from scheduler.state import JobTLT
from workers.progress import ProgressReporter
from workers.protocol.keys import job_leases_key, job_phase_key
from workers.protocol.messages import LeaseOutcome, PhaseRecord, ProgressRecord
from workers.protocol.states import JobState, LeaseState, Phase, WorkerState
from workers.spec import JobSpec


def running_job(store: JobStore, phase: Phase, workers: dict[str, tuple[WorkerState, int]],
                leased: str | None = None, phase_age_s: float = 0.0) -> tuple[str, str | None]:
    """(job id, lease id): a RUNNING job in `phase`, each worker's progress record (state, requests
    finished of 4), and an accepted lease on worker `leased` still training (RUNNING outcome, open in
    the watcher's saved state)."""
    redis, now = store.redis, time.time()
    job_id = store.create(JobSpec(model="tiny", num_workers=len(workers)))[0]["job_id"]
    store.transition(job_id, JobState.RUNNING, {JobState.PENDING})
    redis.set(job_phase_key(job_id), PhaseRecord(phase, 0, now - phase_age_s).to_json())
    for wid, (state, done) in workers.items():
        ProgressReporter(redis, job_id, wid).report(
            ProgressRecord(job_id, wid, state, 4 - done, done, 4, 100, 20.0, 1.0, 0, 0, 0, now, buffer_tokens=900),
            force=True)
    if leased is None:
        return job_id, None
    lease_id = f"{job_id}-{leased}-0"
    redis.hset(job_leases_key(job_id), lease_id, LeaseOutcome(lease_id, leased, LeaseState.RUNNING).to_json())
    JobTLT(leases={leased: {"lease_id": lease_id, "parent_version": 0, "deadline_s": 30.0, "offered_at": now}},
           num_leases=1).save(redis, job_id)
    return job_id, lease_id
