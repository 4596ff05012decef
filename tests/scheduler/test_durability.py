"""Nothing lost, nothing leaked (issue 23), against real parts: a real local Ray (logical GPUs on CPU), real
redis-servers, tiny preset models.
- a driver that dies between a step's record and its checkpoint loses no step's record;
- a worker lost between steps is started again for the next step's rollout;
- workers Ray cannot place are waited for a bounded time, then dropped: the job runs degraded and says so, and
  a job none of whose workers starts fails at its start in one line;
- Redis coming back EMPTY mid-job (FLUSHALL): the driver writes the job back and it finishes, visible;
- a failed job's `error` says what failed and where (start; step, phase and worker).

Where a fault must land between two lines of the driver, the driver runs in this process (as
tests/workers/test_learner_pairs_job.py runs it) and the function it calls there raises: the product path
is the same, only that call fails.
"""

from __future__ import annotations

import re
import shutil
import time

import pytest
import ray
import torch
from fastapi.testclient import TestClient

import workers.driver as driver_module
from drafter.model.config import PRESETS
from drafter.model.loading import random_model, save_hf_dir
from scheduler.app import Settings, create_app
from tests.waiting import until
from workers.actors import get_worker
from workers.driver import Driver
from workers.errors import job_error
from workers.policy_checkpoint import has_policy_checkpoint, load_policy, policy_checkpoint_path
from workers.progress import read_json_list
from workers.protocol.keys import RAY_NAMESPACE, job_steps_key, jobs_index_key, worker_actor_name
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec
from workers.store import job_stores

TOKEN = "t"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NUM_GPUS = 2
TINY = {"model": "tiny", "num_prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8, "num_workers": 1}


class DriverDiedError(Exception):
    """The driver's death, at the point a test chooses."""


@ray.remote(num_gpus=1, num_cpus=0)
class Blocker:
    """Holds a GPU, as another job's worker would."""

    def ready(self) -> bool:
        return True


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, num_gpus=NUM_GPUS, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


@pytest.fixture
def redis_server():
    with PrivateRedis() as server:
        yield server


@pytest.fixture
def threads():
    """Driver.__init__ sets this process's torch threads (in an actor, its own): put them back."""
    num = torch.get_num_threads()
    yield
    torch.set_num_threads(num)


def is_gone(name: str) -> bool:
    try:
        ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return True
    return False


def kill_workers(job_id: str, driver: Driver) -> None:
    """A dead driver's workers die with it (they are its actors); here, by hand, names released."""
    for w in driver.workers.values():
        ray.kill(w)
    for wid in driver.worker_ids:
        until(lambda wid=wid: is_gone(worker_actor_name(job_id, wid)), 30, f"{wid}'s name released")


def rl_steps(redis, job_id: str) -> list[int]:
    return [s["rl_step"] for s in read_json_list(redis, job_steps_key(job_id))]


def test_a_driver_dying_between_a_steps_record_and_its_checkpoint_loses_no_record(ray_local, redis_server, threads,
                                                                                  tmp_path, monkeypatch):
    """checkpoint_every 1. The driver dies after step 1's record landed, before step 1's checkpoint became the
    resume point (before the fix, the checkpoint came first and step 1 was resumed past with no record). A new
    driver resumes after step 0, redoes step 1, and the job ends with one record per step."""
    spec, job_id, r = JobSpec(**TINY, num_steps=4, checkpoint_every=1), "ck1", redis_server.client()
    commit, commits = driver_module.commit_policy, []

    def dying_commit(path) -> None:
        commits.append(path)
        if len(commits) == 2:  # step 1's: its record is in Redis, its checkpoint staged
            raise DriverDiedError
        commit(path)

    monkeypatch.setattr(driver_module, "commit_policy", dying_commit)
    driver = Driver(job_id, spec, r, redis_server.url, str(tmp_path))
    with pytest.raises(DriverDiedError):
        driver.run()
    assert rl_steps(r, job_id) == [0, 1]  # step 1's record is not lost
    assert load_policy(policy_checkpoint_path(tmp_path, job_id), driver.policy, driver.optimizer)[0] == 0
    kill_workers(job_id, driver)
    monkeypatch.setattr(driver_module, "commit_policy", commit)
    resumed = Driver(job_id, spec, r, redis_server.url, str(tmp_path))  # as the launcher starts one
    resumed.run()
    kill_workers(job_id, resumed)
    steps = read_json_list(r, job_steps_key(job_id))
    assert [s["rl_step"] for s in steps] == [0, 1, 2, 3] and [s["policy_version"] for s in steps] == [1, 2, 3, 4]
    assert resumed.degraded_summary() == "driver lost, resumed from its policy checkpoint after step 0 (steps 1..1 " \
                                         "redone)"
    assert has_policy_checkpoint(tmp_path, job_id)


def test_a_worker_lost_between_steps_is_started_again_for_the_next_rollout(ray_local, redis_server, threads,
                                                                           tmp_path):
    """A worker that dies while idle (after its rollout, e.g. training a lease) is found at the next step's
    weight sync and started again at once: that step's rollout runs on every worker, not at half capacity."""
    spec, job_id, r = JobSpec(**(TINY | {"num_workers": 2}), num_steps=2), "ls1", redis_server.client()
    driver = Driver(job_id, spec, r, redis_server.url, str(tmp_path))
    try:
        first = driver.step(0)
        ray.kill(driver.workers["w1"])
        until(lambda: is_gone(worker_actor_name(job_id, "w1")), 30, "w1's name released")
        second = driver.step(1)
    finally:
        kill_workers(job_id, driver)
    assert not first.failures and first.num_rollouts == 4
    assert [f["worker"] for f in second.failures] == ["w1"]  # found at the sync ...
    assert sorted(second.worker_rollout_s) == ["w0", "w1"] and second.num_rollouts == 4  # ... and back for the rollout
    assert driver.restarts == {"w1": 1}
    assert driver.degraded_summary() == "rollout workers lost: w1 at step 1; each was started again"


def test_a_worker_ray_cannot_place_is_given_up_after_a_bounded_wait(ray_local, redis_server, threads, tmp_path,
                                                                     monkeypatch):
    """w1 is killed and another actor takes its GPU: the driver starts w1 again at each next step (twice), waits
    MAX_WORKER_START_S for it each time instead of forever, kills it, and the job runs on w0, saying so."""
    spec, job_id, r = JobSpec(**(TINY | {"num_workers": 2}), num_steps=3), "bw1", redis_server.client()
    driver = Driver(job_id, spec, r, redis_server.url, str(tmp_path))
    monkeypatch.setattr(driver_module, "MAX_WORKER_START_S", 4.0)  # after the first start (seconds on 2 cores)
    ray.kill(driver.workers["w1"])
    blocker = Blocker.remote()
    try:
        ray.get(blocker.ready.remote(), timeout=60)  # w1's GPU, now held by another
        until(lambda: is_gone(worker_actor_name(job_id, "w1")), 30, "w1's name released")
        t0 = time.monotonic()
        driver.run()
        elapsed = time.monotonic() - t0
    finally:
        ray.kill(blocker)
        kill_workers(job_id, driver)
    steps = read_json_list(r, job_steps_key(job_id))
    assert [s["rl_step"] for s in steps] == [0, 1, 2]
    assert [f["worker"] for f in steps[0]["failures"]] == ["w1"]  # lost at step 0's sync
    assert all(sorted(s["worker_rollout_s"]) == ["w0"] for s in steps)  # the job ran on w0
    assert elapsed >= 2 * 4.0 - 0.5, elapsed  # steps 1 and 2 each waited for w1 (and not forever)
    assert driver.restarts == {"w1": 2} and sorted(driver.workers) == ["w0"]
    assert driver.degraded_summary() == "rollout workers lost: w1 at step 0; w1 not running at the end (1 of 2 " \
                                        "workers)"


def test_a_job_none_of_whose_workers_starts_fails_at_start_in_one_line(ray_local, redis_server, threads, tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(driver_module, "MAX_WORKER_START_S", 3.0)
    blockers = [Blocker.remote() for _ in range(NUM_GPUS)]  # every GPU held by others
    try:
        ray.get([b.ready.remote() for b in blockers], timeout=60)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as caught:
            Driver("bw2", JobSpec(**TINY, num_steps=1), redis_server.client(), redis_server.url, str(tmp_path))
        assert 2.9 <= time.monotonic() - t0 < 60
    finally:
        for b in blockers:
            ray.kill(b)
    assert job_error(caught.value, "start") == (f"at start: RuntimeError: no rollout worker started: w0 at start (not "
                                                f"placed); the Ray cluster has {NUM_GPUS} GPUs, the job asks 1 per "
                                                f"worker")
    until(lambda: is_gone(worker_actor_name("bw2", "w0")), 30, "the unplaced worker killed")


@pytest.fixture
def app(ray_local, redis_server, tmp_path):
    """The scheduler (REST API, launcher, watcher) on this module's Ray, with data and model roots under tmp."""
    (tmp_path / "data").mkdir()
    (tmp_path / "models").mkdir()
    settings = Settings(redis_url=redis_server.url, api_token=TOKEN, store_dir=str(tmp_path / "drafts"),
                        data_roots=(str(tmp_path / "data"),), model_roots=(str(tmp_path / "models"),),
                        start_ray=False, watch_tick_s=0.05)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        c.redis, c.root = redis_server.client(), tmp_path
        yield c


def wait_end(c, job_id: str, timeout_s: float = 180) -> dict:
    """The job once it has ended; a 404 (Redis emptied, its driver not yet writing it back) is waited out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = c.get(f"/v1/jobs/{job_id}", headers=AUTH)
        if r.status_code == 200 and r.json()["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            return r.json()
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not end: {r.status_code} {r.text}")


def test_a_job_survives_redis_coming_back_empty(app):
    """FLUSHALL mid-job (what a Redis restarted without persistence, or a wrong failover, leaves): the driver
    writes the job's record, index entries and step records back, and the job finishes, visible as before."""
    spec = TINY | {"num_steps": 6, "num_workers": 2, "max_new_tokens": 48}
    before = app.post("/v1/jobs", json=spec, headers=AUTH).json()
    job_id = before["job_id"]
    until(lambda: app.redis.llen(job_steps_key(job_id)) >= 2, 180, "two steps")
    app.redis.flushall()
    job = wait_end(app, job_id)
    assert job["state"] == "SUCCEEDED", job
    assert job["created_at"] == before["created_at"] and job["spec"] == before["spec"]
    assert job["steps"] == 6 and rl_steps(app.redis, job_id) == [0, 1, 2, 3, 4, 5]  # those before it too
    assert re.match(r"Redis came back empty at step \d: the driver wrote the job back", job["warning"]), job
    assert job_id in [j["job_id"] for j in app.get("/v1/jobs", headers=AUTH).json()]
    assert app.redis.zscore(jobs_index_key(), job_id) == before["created_at"]
    served, _ = job_stores(app.redis, app.root / "drafts", job_id)
    assert served.consistency_check()["orphans"] == []  # every draft version on disk is indexed again


def test_a_job_that_fails_at_start_says_so(app):
    """Bad dataset content under the allowed roots: accepted at submit (the file is never opened there), fails
    when its driver reads it, and the error says it was at the start, and what."""
    path = app.root / "data" / "bad.jsonl"
    path.write_text('{"prompt": "1+1", "answer": 2}\n{"prompt": "2+2"}\n')
    spec = TINY | {"num_steps": 1, "task": "dataset", "dataset_path": str(path)}
    job = wait_end(app, app.post("/v1/jobs", json=spec, headers=AUTH).json()["job_id"])
    assert job["state"] == "FAILED"
    assert job["error"].startswith("at start: ValueError: dataset line 2: "), job["error"]
    assert "\n" not in job["error"] and "Traceback" not in job["error"]


def test_a_job_whose_workers_all_fail_says_at_which_step_and_worker(app):
    """The job's one worker is killed mid-job after its model directory was removed: the worker started again
    at the next step cannot load the model, so no worker is left, and the error names the step and the worker."""
    model = app.root / "models" / "tiny-hf"
    save_hf_dir(random_model(PRESETS["tiny"], init_seed=0), None, model)
    spec = TINY | {"model": str(model), "num_steps": 6, "max_new_tokens": 64}
    job_id = app.post("/v1/jobs", json=spec, headers=AUTH).json()["job_id"]
    until(lambda: app.redis.llen(job_steps_key(job_id)) >= 1, 180, "the first step")
    shutil.rmtree(model)
    ray.kill(get_worker(job_id, "w0"))
    job = wait_end(app, job_id)
    assert job["state"] == "FAILED", job
    assert re.match(r"at step [1-5] \(sync\), worker w0: WorkerError: every rollout worker failed: w0: ",
                    job["error"]), job["error"]
    assert "\n" not in job["error"] and len(job["error"]) <= 500
    assert 'File "' not in job["error"] and "Traceback" not in job["error"]  # the worker's traceback stays in logs
