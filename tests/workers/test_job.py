"""A GRPO job on a real local Ray cluster (logical GPUs on CPU) with a real redis-server."""

from __future__ import annotations

import json
import time

import pytest
import ray

from workers.driver import JobConfig, JobDriver
from workers.grpo import GRPOConfig
from workers.protocol import WorkerState, job_steps_key, read_events, read_progress
from workers.rollout import WorkerConfig
from workers.store import DraftStore


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def job(tmp_path, job_id="j1", **kw) -> JobConfig:
    args = dict(job_id=job_id, model="tiny", num_steps=2, num_prompts_per_step=4, max_new_tokens=12,
                num_workers=2, store_dir=str(tmp_path), worker=WorkerConfig(model="tiny", k=2),
                grpo=GRPOConfig(group_size=2, lr=1e-3))
    return JobConfig(**(args | kw))


def test_two_step_job_runs_end_to_end(ray_cluster, private_redis, redis_client, tmp_path):
    driver = JobDriver.remote(job(tmp_path), private_redis.url)
    steps = ray.get(driver.run.remote(), timeout=300)
    assert [s["rl_step"] for s in steps] == [0, 1]
    assert [s["policy_version"] for s in steps] == [1, 2]
    for s in steps:
        assert set(s["timings"]) == {"weight_sync", "rollout", "reward", "logprob", "update"}
        assert s["num_rollouts"] == 8 and not s["failures"] and s["idle_worker_s"] >= 0
    stored = [json.loads(x) for x in redis_client.lrange(job_steps_key("j1"), 0, -1)]
    assert [s["rl_step"] for s in stored] == [0, 1]
    progress = read_progress(redis_client, "j1")
    assert sorted(p.worker_id for p in progress) == ["w0", "w1"]
    assert all(p.policy_version == 1 and p.rl_step == 1 and p.num_finished == 4 for p in progress)
    assert {e["to"] for e in read_events(redis_client, "j1")} >= {"ROLLING_OUT", "IDLE"}


def test_lease_trains_merges_and_the_other_worker_swaps(ray_cluster, private_redis, redis_client, tmp_path):
    driver = JobDriver.remote(job(tmp_path, job_id="j2", num_steps=1), private_redis.url)
    ray.get(driver.run.remote(), timeout=300)
    w0, w1 = ray.get(driver.worker_handles.remote())
    result = ray.get(w0.train_drafter.remote({"lease_id": "l1", "parent_version": 0, "deadline_s": 2.0}))
    assert result["steps"] >= 1 and result["version"] == 1
    import redis as redis_lib

    client = redis_lib.Redis.from_url(private_redis.url, decode_responses=True)
    copies = DraftStore(client, tmp_path / "copies", "j2:copies")
    served = DraftStore(client, tmp_path / "served", "j2")
    version = copies.merge_and_publish([result["version"]], into=served)
    for _ in range(100):  # the workers' listeners load it and queue the swap
        if all(ray.get(w.swap_log.remote()) for w in (w0, w1)):
            break
        ray.get(w1.status.remote())
        time.sleep(0.1)
    assert ray.get(w1.swap_log.remote())[-1]["version"] == version
    assert served.load(version)[1].parent_version == 0


def test_stop_mid_lease_stops_fast_and_publishes_only_whole_copies(ray_cluster, private_redis, tmp_path):
    driver = JobDriver.remote(job(tmp_path, job_id="j3", num_steps=1), private_redis.url)
    ray.get(driver.run.remote(), timeout=300)
    w0, _ = ray.get(driver.worker_handles.remote())
    lease = w0.train_drafter.remote({"lease_id": "l2", "parent_version": 0, "deadline_s": 60.0})
    time.sleep(1.5)
    t0 = time.perf_counter()
    assert ray.get(w0.stop_training.remote())
    result = ray.get(lease, timeout=30)
    assert time.perf_counter() - t0 < 5.0 and result["stopped"]
    if result["version"] is not None:  # whatever was published loads cleanly
        import redis as redis_lib

        client = redis_lib.Redis.from_url(private_redis.url, decode_responses=True)
        DraftStore(client, tmp_path / "copies", "j3:copies").load(result["version"])


def test_worker_killed_mid_rollout_is_reported_and_others_results_kept(ray_cluster, private_redis, redis_client,
                                                                        tmp_path):
    driver = JobDriver.remote(job(tmp_path, job_id="j4", num_steps=1, max_new_tokens=400), private_redis.url)
    w0, w1 = ray.get(driver.worker_handles.remote())
    run = driver.run.remote()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # wait until w1 is generating, then kill it
        states = {p.worker_id: p.state for p in read_progress(redis_client, "j4")}
        if states.get("w1") == WorkerState.ROLLING_OUT:
            break
        time.sleep(0.02)
    ray.kill(w1)
    steps = ray.get(run, timeout=300)
    assert [f["worker"] for f in steps[0]["failures"]] == ["w1"]
    assert steps[0]["num_rollouts"] == 4  # w0's two groups of two are kept
    assert steps[0]["policy_version"] == 1  # and the update ran on them
    assert DraftStore(redis_client, tmp_path / "served", "j4").consistency_check() == {"bad": [], "orphans": []}
