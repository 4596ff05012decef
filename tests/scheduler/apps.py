"""The REST app the API tests drive: a real app on a private redis-server, with a token and file roots."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi.testclient import TestClient

from scheduler.app import Settings, create_app
from scheduler.jobs import JobStore
from workers.protocol.messages import StepRecord
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec


@contextmanager
def token_app(roots: Path, token: str) -> Iterator[TestClient]:
    """A TestClient of an app that needs `token`, with its draft store and model/data roots under `roots`;
    `.redis` is its Redis, `.job_id` a job record to read (never launched)."""
    with PrivateRedis() as server:
        app = create_app(Settings(redis_url=server.url, api_token=token, store_dir=str(roots / "drafts"),
                                  model_roots=(str(roots / "models"),), data_roots=(str(roots / "data"),),
                                  start_ray=False, watch=False))
        with TestClient(app, raise_server_exceptions=False) as c:
            c.redis = server.client()
            c.job_id = JobStore(c.redis).create(JobSpec())[0]["job_id"]
            yield c


def step_record(rl_step: int) -> str:
    """A valid StepRecord's JSON, as the driver appends it to job_steps_key."""
    return StepRecord(rl_step=rl_step, policy_version=rl_step + 1, timings={"rollout": 1.5}, worker_rollout_s={},
                      idle_worker_s=0.5, mean_reward=-0.25, num_rollouts=4).to_json()
