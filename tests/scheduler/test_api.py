"""The REST API against a running app, a real redis-server and a real local Ray."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import ray
from fastapi.testclient import TestClient

from scheduler.app import Settings, create_app
from workers.policy_checkpoint import has_policy_checkpoint
from workers.protocol.keys import (
    RAY_NAMESPACE,
    driver_actor_name,
    job_phase_key,
    job_result_key,
    job_steps_key,
    jobs_index_key,
)
from workers.protocol.messages import JobResult
from workers.protocol.states import JobState
from workers.redis_server import PrivateRedis

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TINY = {"model": "tiny", "num_steps": 1, "num_prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8,
        "num_workers": 2}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    data_root = tmp_path_factory.mktemp("data")
    with PrivateRedis() as server:
        app = create_app(Settings(redis_url=server.url, api_token=TOKEN, data_roots=(str(data_root),),
                                  store_dir=str(tmp_path_factory.mktemp("drafts")), start_ray=False))
        with TestClient(app) as c:
            c.redis, c.data_root = server.client(), data_root
            yield c
    ray.shutdown()


def wait_state(client, job_id, states, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()
        if record["state"] in states:
            return record
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} stuck in {record['state']}")


def test_submit_runs_a_job_to_completion(client):
    r = client.post("/v1/jobs", json=TINY, headers=AUTH)
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]
    record = wait_state(client, job_id, {"SUCCEEDED", "FAILED"})
    assert record["state"] == "SUCCEEDED", record["error"]
    assert record["steps"] == 1
    # how it ended has one record, the driver's JobResult; the job record holds no second step count
    result = JobResult.from_json(client.redis.get(job_result_key(job_id)))
    assert result.ok and result.steps == 1 and result.error is None
    assert "steps" not in json.loads(client.redis.get(f"tlt:job:{job_id}"))
    assert job_id in [j["job_id"] for j in client.get("/v1/jobs", headers=AUTH).json()]
    workers = client.get(f"/v1/jobs/{job_id}/workers", headers=AUTH).json()
    assert sorted(w["worker_id"] for w in workers) == ["w0", "w1"]
    metrics = client.get("/metrics").text
    assert 'tlt_jobs{state="SUCCEEDED"}' in metrics
    assert f'tlt_worker_state{{job="{job_id}",state="IDLE",worker="w0"}} 1.0' in metrics
    assert f'tlt_step_phase_seconds{{job="{job_id}",phase="rollout"}}' in metrics
    assert f'tlt_idle_worker_seconds_total{{job="{job_id}"}}' in metrics


@pytest.mark.parametrize(("field", "value"), [
    ("num_steps", 0), ("group_size", 1), ("temperature", -1), ("task", "chess"), ("reward", "os.system"),
    ("model", "gpt-99"), ("num_workers", 0), ("max_new_tokens", "many"), ("surprise", 1),
    ("drafter", {"num_rows": 0}), ("drafter", {"lr": 0}), ("drafter", {"typo": 1}),
    ("drafter", {"anneal_to_budget": "maybe"}), ("drafter", {"bf16_autocast": "fast"}),
    ("draft_dtype", "float64"), ("draft_tree", "3;2"), ("draft_tree", "0,2"), ("draft_tree", "17")])
def test_invalid_specs_get_422_naming_the_field_and_create_nothing(client, field, value):
    before = client.redis.zcard(jobs_index_key())
    r = client.post("/v1/jobs", json=TINY | {field: value}, headers=AUTH)
    assert r.status_code == 422
    if field == "surprise":  # an unknown field is located at its parent: its name is the client's, not echoed
        assert r.json()["detail"] == [{"loc": ["body"], "msg": "an unknown field (its name is not echoed; "
                                       "docs/api.md lists the fields)", "type": "extra_forbidden"}]
    else:
        assert field in r.text
    assert client.redis.zcard(jobs_index_key()) == before


def test_more_workers_than_the_cluster_has_gpus_is_a_422_not_a_job_stuck_running(client):
    before = client.redis.zcard(jobs_index_key())
    r = client.post("/v1/jobs", json=TINY | {"num_workers": 5}, headers=AUTH)  # the fixture's Ray has 4
    assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "num_workers"]
    assert r.json()["detail"][0]["msg"] == ("num_workers: the job asks 5 GPUs (5 rollout workers x gpus_per_worker "
                                            "1), more than the Ray cluster has (4)")
    assert client.redis.zcard(jobs_index_key()) == before


def test_dataset_task_needs_a_path(client):
    r = client.post("/v1/jobs", json=TINY | {"task": "dataset"}, headers=AUTH)
    assert r.status_code == 422 and "dataset_path" in r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}])
def test_missing_or_wrong_token_gets_401_and_changes_nothing(client, headers):
    before = client.redis.zcard(jobs_index_key())
    assert client.post("/v1/jobs", json=TINY, headers=headers).status_code == 401
    assert client.redis.zcard(jobs_index_key()) == before
    assert client.post("/v1/jobs/abc/cancel", headers=headers).status_code == 401


def test_idempotency_key_returns_the_same_job(client):
    h = AUTH | {"Idempotency-Key": "submit-42"}
    first = client.post("/v1/jobs", json=TINY | {"num_steps": 50, "max_new_tokens": 64}, headers=h)
    replay = client.post("/v1/jobs", json=TINY | {"num_steps": 50, "max_new_tokens": 64}, headers=h)
    a, b = first.json(), replay.json()
    assert (first.status_code, replay.status_code) == (201, 200) and a["job_id"] == b["job_id"]
    before = client.redis.zcard(jobs_index_key())
    other = client.post("/v1/jobs", json=TINY | {"num_steps": 51, "max_new_tokens": 64}, headers=h)
    assert other.status_code == 422 and other.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
    assert "different job spec" in other.text and client.redis.zcard(jobs_index_key()) == before
    r = client.post(f"/v1/jobs/{a['job_id']}/cancel", headers=AUTH)
    assert r.status_code == 200 and r.json()["state"] == "CANCELLED"
    assert client.post(f"/v1/jobs/{a['job_id']}/cancel", headers=AUTH).status_code == 409
    time.sleep(1.0)
    assert client.get(f"/v1/jobs/{a['job_id']}", headers=AUTH).json()["state"] == "CANCELLED"


def test_job_details_need_the_token_when_one_is_set(client):
    job_id = client.post("/v1/jobs", json=TINY | {"num_steps": 1}, headers=AUTH).json()["job_id"]
    for path in ("/v1/jobs", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/steps", f"/v1/jobs/{job_id}/events",
                 f"/v1/jobs/{job_id}/workers", f"/v1/jobs/{job_id}/drafts", "/v1/jobs/nope"):
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = client.get(path, headers=headers)
            assert r.status_code == 401 and job_id not in r.text, (path, r.text)
        assert client.get(path, headers=AUTH).status_code in (200, 404)
    wait_state(client, job_id, {"SUCCEEDED", "FAILED"})


def test_a_cancel_at_any_moment_leaves_no_live_driver(client):
    """Create and cancel at once, and after waits up to the moment the driver exists: the race where a cancel
    landed after RUNNING but before the driver was registered used to kill nothing."""
    ids = []
    for i in range(10):
        job_id = client.post("/v1/jobs", json=TINY | {"num_steps": 50}, headers=AUTH).json()["job_id"]
        time.sleep((i % 5) * 0.1)
        assert client.post(f"/v1/jobs/{job_id}/cancel", headers=AUTH).status_code == 200
        ids.append(job_id)
    deadline = time.monotonic() + 60
    for job_id in ids:
        while True:
            try:
                ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE)
            except ValueError:
                break  # no live driver by that name
            assert time.monotonic() < deadline, f"job {job_id}: its driver still lives after the cancel"
            time.sleep(0.2)
        assert client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()["state"] == "CANCELLED"


def test_a_cancel_landing_while_the_driver_is_created_kills_it(client, monkeypatch):
    """The race, made certain: the cancel lands after RUNNING, before the driver exists (so there is nothing to
    kill yet); the driver, once created, finds its job CANCELLED and is killed."""
    import scheduler.launcher as launcher_module

    real_start, started = launcher_module.start_driver, threading.Event()

    def cancel_first(job_id, *args, **kwargs):  # what POST /cancel does (this thread must not use the client)
        state = client.app.state
        assert state.store.transition(job_id, JobState.CANCELLED, {JobState.RUNNING}) is not None
        state.launcher.cancel(job_id)
        try:
            return real_start(job_id, *args, **kwargs)
        finally:
            started.set()

    monkeypatch.setattr(launcher_module, "start_driver", cancel_first)
    job_id = client.post("/v1/jobs", json=TINY | {"num_steps": 50}, headers=AUTH).json()["job_id"]
    assert started.wait(60)
    follower = next(t for t in threading.enumerate() if t.name == f"job-{job_id}")  # follows the driver to its end
    follower.join(60)
    assert not follower.is_alive(), "the driver created after the cancel still runs"
    with pytest.raises(ValueError):
        ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE)
    assert client.get(f"/v1/jobs/{job_id}", headers=AUTH).json()["state"] == "CANCELLED"
    assert client.redis.llen(job_steps_key(job_id)) == 0


def test_unknown_job_is_404_and_health(client):
    assert client.get("/v1/jobs/nope", headers=AUTH).status_code == 404
    assert client.get("/v1/jobs/bad id!", headers=AUTH).status_code == 404
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").status_code == 200


def test_a_failing_job_records_its_drivers_error_in_one_line(client):
    spec = TINY | {"task": "dataset", "dataset_path": str(client.data_root / "missing.jsonl")}  # under the roots
    job_id = client.post("/v1/jobs", json=spec, headers=AUTH).json()["job_id"]
    record = wait_state(client, job_id, {"SUCCEEDED", "FAILED"})
    assert record["state"] == "FAILED" and "missing.jsonl" in record["error"] and "\n" not in record["error"]
    result = JobResult.from_json(client.redis.get(job_result_key(job_id)))
    assert not result.ok and record["error"] == result.error  # the job says what its JobResult says


def test_a_driver_killed_mid_job_resumes_from_its_policy_checkpoint(client):
    """checkpoint_every 1: the driver is killed after its first step's checkpoint; a new driver resumes from it,
    the job finishes with one record per step, and says it was resumed."""
    spec = TINY | {"num_steps": 4, "checkpoint_every": 1, "max_new_tokens": 16}
    job_id = client.post("/v1/jobs", json=spec, headers=AUTH).json()["job_id"]
    deadline = time.monotonic() + 300  # a tiny step takes seconds; a busy CI box has taken over 120 s
    while client.redis.llen(job_steps_key(job_id)) < 1:  # step 0 recorded: its checkpoint is written
        assert time.monotonic() < deadline, "the first step never finished"
        time.sleep(0.1)
    ray.kill(ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE))
    record = wait_state(client, job_id, {"SUCCEEDED", "FAILED"}, timeout=240)
    assert record["state"] == "SUCCEEDED", record["error"]
    assert record["warning"].startswith("driver lost, resumed from its policy checkpoint after step ")
    steps = client.get(f"/v1/jobs/{job_id}/steps", headers=AUTH).json()
    assert [s["rl_step"] for s in steps] == [0, 1, 2, 3]  # a redone step is recorded once
    assert [s["policy_version"] for s in steps] == [1, 2, 3, 4]  # the policy carried on from the checkpoint
    store_dir = client.app.state.settings.store_dir
    assert not has_policy_checkpoint(store_dir, job_id)  # a finished job's checkpoint is removed


def test_a_driver_that_dies_without_a_result_fails_its_job_in_one_line(client):
    job_id = client.post("/v1/jobs", json=TINY | {"num_steps": 500}, headers=AUTH).json()["job_id"]
    deadline = time.monotonic() + 120
    while client.redis.get(job_phase_key(job_id)) is None:  # the driver is at work
        assert time.monotonic() < deadline, "the driver never began a step"
        time.sleep(0.2)
    ray.kill(ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE))
    record = wait_state(client, job_id, {"SUCCEEDED", "FAILED"})
    assert record["state"] == "FAILED" and client.redis.get(job_result_key(job_id)) is None
    # what failed and where: the step and phase its driver was in
    assert re.match(r"its driver is gone and recorded no result \(at step \d+, (sync|rollout|update)\): ",
                    record["error"]) and "\n" not in record["error"], record["error"]
