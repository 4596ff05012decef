"""A GRPO job on a real local Ray cluster (logical GPUs on CPU) with a real redis-server: the driver's
records (phase, steps, the one JobResult), and the worker commands the scheduler sends by actor name."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import ray

from tests.waiting import until
from workers.actors import get_worker
from workers.job_actor import start_driver
from workers.progress import read_events, read_json_list, read_progress
from workers.protocol.keys import (
    job_leases_key,
    job_phase_key,
    job_result_key,
    job_scoring_key,
    job_steps_key,
    job_totals_key,
)
from workers.protocol.messages import JobResult, LeaseOutcome, PhaseRecord, ScoringResult, StepRecord
from workers.protocol.states import LeaseState, Phase, WorkerState
from workers.spec import JobSpec
from workers.store import job_stores


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def spec(**kw) -> JobSpec:
    return JobSpec(**({"model": "tiny", "num_steps": 2, "num_prompts_per_step": 4, "max_new_tokens": 12,
                       "num_workers": 2, "group_size": 2, "lr": 1e-3, "draft_k": 2} | kw))


@contextmanager
def job(job_id: str, redis_url: str, store_dir, **kw) -> Iterator:
    """A job's driver; killed at the end, and its workers with it (they are the driver's)."""
    driver = start_driver(job_id, spec(**kw), redis_url, str(store_dir), is_detached=False)
    try:
        yield driver
    finally:
        ray.kill(driver)


@contextmanager
def writes_to(redis_client, key: str) -> Iterator[list[str]]:
    """The commands that write `key` while the block runs (Redis keyspace notifications)."""
    redis_client.config_set("notify-keyspace-events", "K$")
    sub = redis_client.pubsub(ignore_subscribe_messages=True)
    sub.subscribe(f"__keyspace@0__:{key}")
    seen: list[str] = []
    try:
        yield seen
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            msg = sub.get_message(timeout=0.1)
            if msg is not None:
                seen.append(msg["data"])
    finally:
        sub.close()


def test_a_two_step_job_records_its_steps_and_one_result(ray_cluster, private_redis, redis_client, tmp_path):
    with writes_to(redis_client, job_result_key("j1")) as writes, \
            job("j1", private_redis.url, tmp_path, task="longtail") as driver:
        result = ray.get(driver.run.remote(), timeout=300)
        assert ray.get(driver.wait.remote(0)) == result
        placed = [ray.get(get_worker("j1", w).describe.remote()) for w in ("w0", "w1")]
    assert writes == ["set"]  # exactly once
    assert result["ok"] and result["steps"] == 2 and result["error"] is None
    assert JobResult.from_json(redis_client.get(job_result_key("j1"))).to_dict() == result
    phase = PhaseRecord.from_json(redis_client.get(job_phase_key("j1")))
    assert phase.phase == Phase.DONE and phase.rl_step == 2
    steps = [StepRecord.from_dict(d) for d in read_json_list(redis_client, job_steps_key("j1"))]
    assert [s.rl_step for s in steps] == [0, 1] and [s.policy_version for s in steps] == [1, 2]
    for s in steps:
        assert set(s.timings) == {"weight_sync", "rollout", "reward", "logprob", "update"}
        assert s.num_rollouts == 8 and not s.failures and s.num_tokens > 0 and set(s.draft_versions) == {"w0", "w1"}
        assert s.grpo["num_tokens"] == s.num_tokens
        lengths = s.response_lengths
        assert set(lengths) == {"median", "p90", "p99", "max"} and 1 <= lengths["median"] <= lengths["p90"]
        assert lengths["p90"] <= lengths["p99"] <= lengths["max"] <= 12  # max_new_tokens
        assert s.tail_s == pytest.approx(max(s.worker_rollout_s.values()) - min(s.worker_rollout_s.values()))
        assert s.grpo["mean_ratio"] == pytest.approx(1.0)  # one update per step: old_logp from its own forward
        assert set(s.speculation) == {"w0", "w1"} and all(s.speculation.values())  # k per live-batch bucket
        assert sum(tokens for tokens, _ in s.bucket_throughput.values()) == s.num_tokens
        assert 0.0 <= s.reward_std <= 1.0
        # per bucket and k served: the same tokens as bucket_throughput's, and 1..k+1 tokens per live row a step
        assert s.bucket_served.keys() == s.bucket_throughput.keys()
        for bucket, by_k in s.bucket_served.items():
            assert sum(c[0] for c in by_k.values()) == s.bucket_throughput[bucket][0]
            assert all(rows <= tokens <= rows * (int(k) + 1) and seconds > 0
                       for k, (tokens, _, rows, seconds) in by_k.items())
        assert s.draft_versions_published == []  # no scheduler here: nothing trains, nothing is published
    # each worker runs on its own cores (this box: one each), as many torch threads as cores
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        assert all(p["is_pinned"] and p["num_threads"] == len(p["cores"]) for p in placed)
        assert not set(placed[0]["cores"]) & set(placed[1]["cores"])
        assert set(placed[0]["cores"]) | set(placed[1]["cores"]) == set(cores)
    idle = float(redis_client.hget(job_totals_key("j1"), "idle_worker_s"))
    assert idle == pytest.approx(sum(s.idle_worker_s for s in steps))
    progress = read_progress(redis_client, "j1")
    assert sorted(p.worker_id for p in progress) == ["w0", "w1"]
    assert all(p.policy_version == 1 and p.rl_step == 1 and p.num_finished == 4 and p.buffer_tokens > 0
               for p in progress)
    assert {e["to"] for e in read_events(redis_client, "j1")} >= {"ROLLING_OUT", "IDLE"}


def test_shareable_state_puts_tied_weights_once():
    import pickle

    import torch

    from drafter.model.config import PRESETS
    from drafter.model.loading import random_model
    from workers.driver import shareable_state

    cfg = PRESETS["tiny"]
    model = random_model(cfg)
    state = shareable_state(model.state_dict())
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(torch.as_tensor(state[k]), v) for k, v in model.state_dict().items())
    buffers = []
    pickle.dumps(state, protocol=5, buffer_callback=buffers.append)
    distinct = {v.data_ptr(): v.numel() * v.element_size() for v in model.state_dict().values()}
    assert sum(memoryview(b).nbytes for b in buffers) == sum(distinct.values())


def test_a_failing_job_records_one_result_with_a_one_line_error(ray_cluster, private_redis, redis_client, tmp_path):
    missing = tmp_path / "missing.jsonl"
    with writes_to(redis_client, job_result_key("j2")) as writes, \
            job("j2", private_redis.url, tmp_path, task="dataset", dataset_path=str(missing)) as driver:
        with pytest.raises(ValueError, match="dataset_path"):
            ray.get(driver.run.remote(), timeout=300)
        waited = ray.get(driver.wait.remote(0))
    assert writes == ["set"]
    result = JobResult.from_json(redis_client.get(job_result_key("j2")))
    assert result.to_dict() == waited and not result.ok and result.steps == 0
    assert result.error == f"at start: ValueError: dataset_path: no such file {missing}"  # where, what; one line
    assert PhaseRecord.from_json(redis_client.get(job_phase_key("j2"))).phase == Phase.DONE


def test_worker_commands_lease_score_publish_and_every_worker_swaps(ray_cluster, private_redis, redis_client,
                                                                    tmp_path):
    with job("j3", private_redis.url, tmp_path, num_steps=1) as driver:
        ray.get(driver.run.remote(), timeout=300)
        w0, w1 = get_worker("j3", "w0"), get_worker("j3", "w1")

        def outcome(lease_id: str) -> LeaseOutcome | None:
            raw = redis_client.hget(job_leases_key("j3"), lease_id)
            return LeaseOutcome.from_json(raw) if raw else None

        assert ray.get(w0.start_lease.remote({"lease_id": "l1", "parent_version": 0, "deadline_s": 2.0})) is None
        assert outcome("l1").state == LeaseState.RUNNING  # accepted: written before the call returned
        with pytest.raises(ValueError, match="already holds lease l1"):
            ray.get(w0.start_lease.remote({"lease_id": "l2", "parent_version": 0, "deadline_s": 2.0}))
        with pytest.raises(ValueError, match="deadline_s"):
            ray.get(w1.start_lease.remote({"lease_id": "l3", "parent_version": 0, "deadline_s": 0}))
        done = until(lambda: (o := outcome("l1")) and o.state != LeaseState.RUNNING and o, what="lease l1")
        assert done.state == LeaseState.DONE and done.steps >= 1 and done.version == 1

        request = {"round_id": "r1", "copies": [done.version], "serving_version": None}
        assert ray.get(w1.score_round.remote(request)) is None  # w1 did not train on its rollouts: held out
        raw = until(lambda: redis_client.get(job_scoring_key("j3")), what="the scoring result")
        scored = ScoringResult.from_json(raw)
        assert scored.round_id == "r1" and scored.worker_id == "w1" and scored.error is None
        assert scored.candidate is not None and 1.0 <= scored.candidate_accepted_length <= 3.0

        version = ray.get(w1.publish_candidate.remote(scored.candidate, scored.candidate_draft_temperature,
                                                      {"accepted_length": scored.candidate_accepted_length}))
        served, _ = job_stores(redis_client, tmp_path, "j3")
        assert served.latest_version() == version == 1 and served.load(version)[1].parent_version == 0
        # both workers' listeners swap it in; their progress records say so
        def swapped() -> list:
            records = [p for p in read_progress(redis_client, "j3") if p.last_swap_version == version]
            return records if len(records) == 2 else []

        records = until(swapped, what="both workers swapping")
        assert all(p.num_swaps == 1 and p.draft_version == version and p.last_swap_at > 0 for p in records)
        assert [e["version"] for e in ray.get(w0.describe.remote())["swap_log"]] == [version]


def test_stop_training_stops_a_lease_fast_and_it_publishes_only_whole_copies(ray_cluster, private_redis,
                                                                                redis_client, tmp_path):
    with job("j4", private_redis.url, tmp_path, num_steps=1) as driver:
        ray.get(driver.run.remote(), timeout=300)
        w0 = get_worker("j4", "w0")
        ray.get(w0.start_lease.remote({"lease_id": "l1", "parent_version": 0, "deadline_s": 60.0}))
        until(lambda: any(p.worker_id == "w0" and p.state == WorkerState.TRAINING
                          for p in read_progress(redis_client, "j4")), what="w0 training")
        time.sleep(0.5)
        t0 = time.perf_counter()
        assert ray.get(w0.stop_training.remote(5.0))
        assert time.perf_counter() - t0 < 5.0
        raw = until(lambda: (r := redis_client.hget(job_leases_key("j4"), "l1")) and "RUNNING" not in r and r,
                    timeout_s=30, what="the lease's outcome")
        out = LeaseOutcome.from_json(raw)
        assert out.state == LeaseState.DONE and out.stopped
        if out.version is not None:  # whatever was published loads cleanly
            job_stores(redis_client, tmp_path, "j4")[1].load(out.version)
        assert not ray.get(w0.stop_training.remote(0.0))


def test_a_worker_killed_mid_rollout_is_reported_and_the_others_results_kept(ray_cluster, private_redis,
                                                                             redis_client, tmp_path):
    with writes_to(redis_client, job_result_key("j5")) as writes, \
            job("j5", private_redis.url, tmp_path, num_steps=2, max_new_tokens=400) as driver:
        run = driver.run.remote()
        until(lambda: any(p.worker_id == "w1" and p.state == WorkerState.ROLLING_OUT
                          for p in read_progress(redis_client, "j5")), timeout_s=120, what="w1 generating")
        ray.kill(get_worker("j5", "w1"))
        result = ray.get(run, timeout=300)
    assert result["ok"] and writes == ["set"]
    step, after = (StepRecord.from_dict(s) for s in read_json_list(redis_client, job_steps_key("j5")))
    assert [f["worker"] for f in step.failures] == ["w1"] and "\n" not in step.failures[0]["error"]
    assert step.num_rollouts == 4  # w0's two groups of two are kept
    assert step.policy_version == 1  # and the update ran on them
    # the lost worker is started again for the next step, and the run says it was degraded
    assert sorted(after.worker_rollout_s) == ["w0", "w1"] and after.num_rollouts == 8 and not after.failures
    assert result["warning"] == "rollout workers lost: w1 at step 0; each was started again"
    served, _ = job_stores(redis_client, tmp_path, "j5")
    assert served.consistency_check() == {"bad": [], "orphans": []}


def test_a_job_runs_its_learner_and_workers_on_the_device(device, ray_cluster, private_redis, redis_client, tmp_path):
    """JobSpec.device: the driver's learner and each worker resolve it; a GPU shared by both workers
    (gpus_per_worker 0.25: the cluster's first GPU), the new policy versions synced through a file on this node."""
    share = 0.25 if device == "cuda" else 1.0
    with job("jd", private_redis.url, tmp_path, num_steps=2, device=device, gpus_per_worker=share) as driver:
        result = ray.get(driver.run.remote(), timeout=300)
        assert ray.get(driver.learner_device.remote()).startswith(device)
        placed = [ray.get(get_worker("jd", w).describe.remote()) for w in ("w0", "w1")]
    assert result["ok"] and all(p["device"].startswith(device) and p["policy_version"] == 1 for p in placed)
    assert not list(tmp_path.glob("**/tlt-jd-policy-*")) and not list(Path("/dev/shm").glob("tlt-jd-policy-*"))
