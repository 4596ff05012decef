"""Reclaimed time ends at the barrier: the watcher, on a real Redis, counts a lease that ran past the
end of its step's rollout only up to that end, per step and in the job's total."""

from __future__ import annotations

import time

import pytest

from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.state import JobTLT
from scheduler.watcher import Watcher
from tests.scheduler.running import running_job
from workers.protocol.keys import job_leases_key, job_phase_key, job_tlt_key
from workers.protocol.messages import LeaseOutcome, PhaseRecord
from workers.protocol.states import LeaseState, Phase, WorkerState
from workers.redis_server import PrivateRedis


@pytest.fixture(scope="module")
def server():
    with PrivateRedis() as s:
        yield s


def test_a_lease_running_past_the_end_of_rollout_is_counted_only_up_to_it(server, tmp_path):
    redis = server.client()
    redis.flushall()
    store = JobStore(redis)
    # step 0's rollout began 10 s ago; w0 waits at the barrier holding a lease while w1 still generates
    job_id, lease_id = running_job(store, Phase.ROLLOUT, {"w0": (WorkerState.IDLE, 4),
                                                         "w1": (WorkerState.ROLLING_OUT, 1)},
                                   leased="w0", phase_age_s=10.0)
    rollout_start = PhaseRecord.from_json(redis.get(job_phase_key(job_id))).since
    watcher = Watcher(store, str(tmp_path), PolicySettings())
    watcher.tick()
    assert watcher.jobs[job_id].rollouts == [[0, rollout_start, None]]
    # the rollout ended 2 s ago (the driver moved to the update); the trainer stopped only now
    rollout_end = time.time() - 2.0
    redis.set(job_phase_key(job_id), PhaseRecord(Phase.UPDATE, 0, rollout_end).to_json())
    watcher.tick()
    assert watcher.jobs[job_id].rollouts == [[0, rollout_start, rollout_end]]
    started_at = rollout_start + 3.0
    redis.hset(job_leases_key(job_id), lease_id,
               LeaseOutcome(lease_id, "w0", LeaseState.DONE, steps=5, tokens=500, seconds=time.time() - started_at,
                            stopped=True, started_at=started_at, ended_at=time.time()).to_json())
    watcher.tick()
    st = JobTLT.load(redis, job_id)
    assert st.leases == {}  # collected
    within = rollout_end - started_at  # about 5 s of the lease's 7
    assert within == pytest.approx(5.0, abs=0.5)
    assert st.reclaimed_worker_s == pytest.approx(within)
    assert float(redis.hget(job_tlt_key(job_id), "reclaimed_worker_s")) == pytest.approx(within)
    assert JobTLT.read_reclaimed_by_step(redis, job_id) == {0: pytest.approx(within)}
