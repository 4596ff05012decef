"""A short GRPO job end to end with JobSpec.engine 'vllm': SmolLM2-135M served by vLLM in a rollout worker on
a real local Ray cluster, with a real redis-server; the policy is reloaded into the live engine every step,
EAGLE-3 speculation serves every rollout, and the drafter's training pairs come from the learner's forward (vLLM
harvests none)."""

from __future__ import annotations

import pytest
import ray

from workers.actors import get_worker
from workers.job_actor import start_driver
from workers.progress import read_json_list
from workers.protocol.keys import job_steps_key
from workers.protocol.messages import StepRecord
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_a_grpo_job_runs_on_vllm(ray_cluster, tmp_path):
    spec = JobSpec(model="smollm2-135m", engine="vllm", num_steps=2, num_prompts_per_step=2, group_size=2,
                   max_new_tokens=16, num_workers=1, speculation="always", idle_training=True, draft_k=2)
    with PrivateRedis() as server:
        client = server.client()
        driver = start_driver("v1", spec, server.url, str(tmp_path), is_detached=False)
        try:
            result = ray.get(driver.run.remote(), timeout=540)
            described = ray.get(get_worker("v1", "w0").describe.remote())
        finally:
            ray.kill(driver)
        assert result["ok"] and result["steps"] == 2 and result["error"] is None
        steps = [StepRecord.from_dict(d) for d in read_json_list(client, job_steps_key("v1"))]
    assert [s.policy_version for s in steps] == [1, 2]
    for s in steps:
        assert s.num_rollouts == 4 and not s.failures and 0 < s.num_tokens <= 4 * 16
        assert s.response_lengths["max"] <= 16
        assert s.speculation == {"w0": {bucket: 2 for bucket in s.speculation["w0"]}}  # draft_k every step
        assert sum(tokens for tokens, _ in s.bucket_throughput.values()) == s.num_tokens
        assert s.mean_accepted_length >= 1.0 and s.grpo["num_tokens"] == s.num_tokens
        assert "learner_pairs" in s.timings  # the learner recorded the pairs vLLM does not hand back
    assert described["num_draft_tokens"] > 0  # vLLM drafted (the untrained version 0: little is accepted)
    # both steps' rollouts, every position but each one's last (prompts are SmolLM2's chat-encoded problems)
    assert described["buffer_tokens"] > sum(s.num_tokens for s in steps)
