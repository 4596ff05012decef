"""A GRPO step whose rollout workers' engine harvests no training pairs: the driver's own forwards record them
and each worker's buffer fills from the learner (real local Ray with logical GPUs, real redis-server; the
built-in engine, told through the worker's harvest_in_engine not to harvest, stands in for vLLM here, whose job
tests/engines/test_vllm_job.py runs for real). On the `device` fixture's device (JobSpec.device): the driver's
learner and its recorded pairs there, the two workers sharing the cluster's first GPU on a GPU node."""

from __future__ import annotations

import pytest
import ray
import torch

import workers.driver as driver_module
from workers.actors import get_worker, start_worker
from workers.driver import Driver
from workers.progress import read_progress
from workers.spec import JobSpec


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def learner_fed_worker(*args, **kw):
    return start_worker(*args, **kw, harvest_in_engine=False)


@pytest.mark.parametrize("num_updates", [1, 2])  # old log-probs from the update's own forward, or a pass of their own
def test_the_workers_buffers_fill_from_the_learners_forward(device, ray_cluster, private_redis, redis_client,
                                                             tmp_path, monkeypatch, num_updates):
    monkeypatch.setattr(driver_module, "start_worker", learner_fed_worker)
    spec = JobSpec(model="tiny", num_steps=1, num_prompts_per_step=4, group_size=2, max_new_tokens=10, num_workers=2,
                   draft_k=2, num_updates_per_step=num_updates, device=device,
                   gpus_per_worker=0.25 if device == "cuda" else 1.0)
    job_id = f"lp{num_updates}"
    threads = torch.get_num_threads()
    driver = Driver(job_id, spec, redis_client, private_redis.url, str(tmp_path))
    assert driver.policy.device.type == device
    try:
        record = driver.step(0)
        assert record.policy_version == 1 and not record.failures and record.num_rollouts == 8
        assert "learner_pairs" in record.timings
        num_pairs = driver.shipments.settle()  # every worker has added its pairs once this returns
        described = {w: ray.get(get_worker(job_id, w).describe.remote()) for w in ("w0", "w1")}
        reported = sum(p.buffer_tokens for p in read_progress(redis_client, job_id))  # what the scheduler reads
    finally:
        for w in driver.workers.values():
            ray.kill(w)
        torch.set_num_threads(threads)
    # every position but each rollout's last, prompt and response: prompt lengths are the driver's encoding
    num_prompt_tokens = sum(len(driver_module.encode_text(None, p.prompt, driver.policy.cfg.vocab_size))
                            for p in driver.problems.step(0)) * spec.group_size
    assert num_pairs == num_prompt_tokens + record.num_tokens - record.num_rollouts
    # both workers generated (on the job's device), both were sent theirs
    assert all(d["buffer_tokens"] > 0 and d["device"].startswith(device) for d in described.values())
    assert sum(d["buffer_tokens"] for d in described.values()) == reported == num_pairs
