"""Job records and the running set in a real redis-server, and the watcher following every RUNNING
job however many jobs the store holds (the 100-newest bug)."""

from __future__ import annotations

import time

import pytest

from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.state import JobTLT, read_classes
from scheduler.watcher import Watcher
from tests.scheduler.running import running_job
from workers.protocol.keys import (
    job_key,
    job_leases_key,
    job_steps_key,
    job_tlt_key,
    jobs_index_key,
    queued_jobs_key,
    running_jobs_key,
)
from workers.protocol.messages import LeaseOutcome
from workers.protocol.states import JobState, LeaseState, Phase, WorkerState
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec


@pytest.fixture
def redis():
    with PrivateRedis() as server:
        yield server.client()


def test_the_running_set_changes_with_the_record(redis):
    store = JobStore(redis)
    job_id = store.create(JobSpec(model="tiny"))[0]["job_id"]
    assert store.running_ids() == []
    assert store.transition(job_id, JobState.RUNNING, {JobState.PENDING})["state"] == "RUNNING"
    assert store.running_ids() == [job_id]
    assert store.transition(job_id, JobState.RUNNING, {JobState.PENDING}) is None  # not from RUNNING
    assert store.running_ids() == [job_id]
    assert store.transition(job_id, JobState.CANCELLED, {JobState.RUNNING})["state"] == "CANCELLED"
    assert store.running_ids() == [] and redis.scard(running_jobs_key()) == 0
    assert store.transition("nosuchjob", JobState.RUNNING, {JobState.PENDING}) is None
    assert store.running_ids() == []


def test_steps_are_the_length_of_the_step_records_not_a_field(redis):
    store = JobStore(redis)
    record, _ = store.create(JobSpec(model="tiny"))
    assert "steps" not in record and "steps" not in store.get(record["job_id"])
    redis.rpush(job_steps_key(record["job_id"]), "{}", "{}")
    assert store.num_steps([record["job_id"], "other"]) == [2, 0]


def test_every_job_is_walked_in_batches(redis, monkeypatch):
    monkeypatch.setattr("scheduler.jobs.SCAN_BATCH", 7)
    store = JobStore(redis)
    ids = [store.create(JobSpec(model="tiny"))[0]["job_id"] for _ in range(22)]
    assert sorted(store.all_ids()) == sorted(ids) and len(list(store.all_ids())) == 22


def test_an_old_running_job_among_many_is_watched_and_keeps_its_leases(redis, tmp_path):
    store = JobStore(redis)
    # the driver is in its rollout; w0 trains on a lease it accepted, w1 still generates
    old, lease_id = running_job(store, Phase.ROLLOUT, {"w0": (WorkerState.TRAINING, 4),
                                                       "w1": (WorkerState.ROLLING_OUT, 1)}, leased="w0", phase_age_s=5)
    for _ in range(120):
        store.create(JobSpec(model="tiny"))
    assert old not in [j["job_id"] for j in store.list()]  # not among the newest 100

    watcher = Watcher(store, str(tmp_path), PolicySettings())
    watcher.tick()
    assert read_classes(redis.hget(job_tlt_key(old), "classes")) == {"w0": "TRAINING", "w1": "STRAGGLER"}
    assert JobTLT.load(redis, old).leases["w0"]["lease_id"] == lease_id  # still open, not dropped
    # the worker writes the lease's end (within the rollout, begun 5 s ago): the next tick collects it
    ended_at = time.time() - 0.5
    redis.hset(job_leases_key(old), lease_id, LeaseOutcome(lease_id, "w0", LeaseState.DONE, steps=3, tokens=300,
                                                           seconds=1.5, version=7, started_at=ended_at - 1.5,
                                                           ended_at=ended_at).to_json())
    watcher.tick()
    st = JobTLT.load(redis, old)
    assert st.leases == {} and st.reclaimed_worker_s == pytest.approx(1.5) and st.trained == ["w0"] and st.copies == [7]
    # once the job ends it is no longer watched, and its record is untouched by the watcher
    store.transition(old, JobState.SUCCEEDED, {JobState.RUNNING})
    before = redis.get(job_key(old))
    watcher.tick()
    assert old not in watcher.jobs and redis.get(job_key(old)) == before


def test_concurrent_submits_with_one_idempotency_key_create_exactly_one_job(redis):
    """20 threads, one key, each on its own connection: one job, every caller answered with it."""
    import threading

    import redis as redis_lib

    kwargs = redis.connection_pool.connection_kwargs
    results, barrier = [], threading.Barrier(20)

    def submit() -> None:
        store = JobStore(redis_lib.Redis(host=kwargs["host"], port=kwargs["port"]))
        barrier.wait()
        results.append(store.create(JobSpec(model="tiny"), "the-same-key"))

    threads = [threading.Thread(target=submit) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 20 and redis.zcard(jobs_index_key()) == 1
    assert sum(created for _, created in results) == 1
    assert len({record["job_id"] for record, _ in results}) == 1


def test_an_idempotency_key_reused_for_another_spec_is_refused_and_creates_nothing(redis):
    store = JobStore(redis)
    first, created = store.create(JobSpec(model="tiny"), "k1")
    again, created_again = store.create(JobSpec(model="tiny"), "k1")
    assert created and not created_again and again["job_id"] == first["job_id"]
    with pytest.raises(ValueError, match="'k1' was already used for a different job spec"):
        store.create(JobSpec(model="tiny", num_steps=3), "k1")
    assert redis.zcard(jobs_index_key()) == 1


def test_a_degraded_run_succeeds_with_its_warning_on_the_job(redis):
    from scheduler.launcher import Launcher
    from scheduler.settings import Settings
    from workers.protocol.keys import job_result_key
    from workers.protocol.messages import JobResult

    store = JobStore(redis)
    job_id = store.create(JobSpec(model="tiny"))[0]["job_id"]
    store.transition(job_id, JobState.RUNNING, {JobState.PENDING})
    warning = "rollout workers lost: w1 at step 0; w1 not running at the end (1 of 2 workers)"
    redis.set(job_result_key(job_id), JobResult(ok=True, steps=2, finished_at=time.time(), warning=warning).to_json())
    Launcher(store, Settings(redis_url="redis://unused")).settle(job_id)
    record = store.get(job_id)
    assert record["state"] == JobState.SUCCEEDED and record["warning"] == warning and record["error"] is None


def test_a_submit_overtaken_between_its_stamp_and_its_write_is_stamped_again_after_the_other(redis, monkeypatch):
    """Issue 42, item 2: the queue's order is the order submits were stored in. Submit X stamps its time; submit Y
    is stored before X writes; X's write is refused (WATCH on the job index) and X is stamped again, after Y. The
    queue, the index and created_at agree, and X is in line, never behind a head that started first."""
    import scheduler.jobs as jobs

    kwargs = redis.connection_pool.connection_kwargs
    store, other = JobStore(redis), JobStore(redis.__class__(host=kwargs["host"], port=kwargs["port"]))
    stamp, overtaken, calls = jobs.submission_time, [], []

    def overtaking_stamp(latest):
        now = stamp(latest)
        calls.append(now)
        if len(calls) == 1:  # X's first stamp: Y is stamped and stored right after it
            overtaken.append(other.create(JobSpec(model="tiny", seed=1), is_queued=True)[0])
        return now

    monkeypatch.setattr(jobs, "submission_time", overtaking_stamp)
    x, _ = store.create(JobSpec(model="tiny"), is_queued=True)
    [y] = overtaken
    assert len(calls) == 3  # X, Y, X again
    assert x["state"] == y["state"] == JobState.QUEUED
    assert x["created_at"] > y["created_at"], (x["created_at"], y["created_at"])
    assert redis.zrange(queued_jobs_key(), 0, -1) == [y["job_id"], x["job_id"]]
    assert redis.zrange(jobs_index_key(), 0, -1) == [y["job_id"], x["job_id"]]
    assert store.queue_positions([y["job_id"], x["job_id"]]) == [1, 2]


def test_submission_times_increase_even_when_the_clock_steps_back(redis, monkeypatch):
    import scheduler.jobs as jobs

    store = JobStore(redis)
    first = store.create(JobSpec(model="tiny"), is_queued=True)[0]
    monkeypatch.setattr(jobs.time, "time", lambda: first["created_at"] - 30.0)  # NTP stepped the clock back
    second = store.create(JobSpec(model="tiny", seed=1), is_queued=True)[0]
    assert second["created_at"] == pytest.approx(first["created_at"] + jobs.MIN_SUBMISSION_STEP_S)
    assert second["created_at"] > first["created_at"] and store.queue_head() == first["job_id"]
