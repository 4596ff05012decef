"""Redis killed and restarted mid-job (persistent, as deploy/ configures it): the API answers 503 meanwhile,
the driver and the launcher wait it out, and the running job finishes with every step recorded."""

from __future__ import annotations

import time

import pytest
import ray
from fastapi.testclient import TestClient

from scheduler.app import Settings, create_app
from workers.protocol.keys import job_steps_key
from workers.redis_server import PrivateRedis

TOKEN = "t"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_a_job_outlives_a_redis_restart(ray_local, tmp_path):
    redis_server = PrivateRedis(persistent=True).start()
    try:
        app = create_app(Settings(redis_url=redis_server.url, api_token=TOKEN, store_dir=str(tmp_path),
                                  start_ray=False))
        with TestClient(app, raise_server_exceptions=False) as c:
            spec = {"model": "tiny", "num_steps": 4, "num_prompts_per_step": 2, "group_size": 2,
                    "max_new_tokens": 24, "num_workers": 2}
            job_id = c.post("/v1/jobs", json=spec, headers=AUTH).json()["job_id"]
            probe = redis_server.client()
            deadline = time.monotonic() + 120
            while probe.llen(job_steps_key(job_id)) < 1:
                assert time.monotonic() < deadline, "the first step never finished"
                time.sleep(0.1)
            redis_server.kill()
            assert c.get(f"/v1/jobs/{job_id}", headers=AUTH).status_code == 503
            time.sleep(3.0)  # the driver's next writes meet a dead Redis and wait
            redis_server.revive()
            deadline = time.monotonic() + 180
            while (record := c.get(f"/v1/jobs/{job_id}", headers=AUTH).json())["state"] not in ("SUCCEEDED",
                                                                                               "FAILED"):
                assert time.monotonic() < deadline, f"job stuck {record['state']}"
                time.sleep(0.2)
            assert record["state"] == "SUCCEEDED", record["error"]
            assert [s["rl_step"] for s in c.get(f"/v1/jobs/{job_id}/steps", headers=AUTH).json()] == [0, 1, 2, 3]
    finally:
        redis_server.stop()
