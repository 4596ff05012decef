"""The swap guard on the built-in engine, real parts: a tiny policy with structure (trained on a pattern
corpus), a draft trained by a real lease and scored and published by the real scorer, the swap listener
on a private redis-server, the job's metrics and its REST route. A zeroed draft published with a good
score (weights that did not load, as engines' RL integrations have shipped) is rolled back; the trained
one is kept. Each test runs on the `device` fixture's device (JobSpec.device): the policy, the lease's training,
the scoring and the swaps there."""

from __future__ import annotations

import pytest
import torch
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from drafter.model.loading import save_hf_dir
from scheduler.app import Settings, create_app
from scheduler.jobs import JobStore
from scheduler.metrics import RedisCollector, exposition
from tests.waiting import until
from workers.guard import Verdict
from workers.progress import read_json_list, read_progress
from workers.protocol.keys import TotalsField, job_collapses_key, job_totals_key
from workers.protocol.messages import CollapseEvent
from workers.protocol.states import JobState
from workers.rollout import RolloutRunner
from workers.spec import JobSpec
from workers.swap import LISTEN_TIMEOUT_S

K = 2


def prompts(num: int, seed: int) -> list[list[int]]:
    from tests.conftest import pattern_corpus

    return [p[:6].tolist() for p in pattern_corpus(num, seed=seed)]


def sampled(num: int, seed: int, max_new_tokens: int = 40) -> list[dict]:
    return [{"max_new_tokens": max_new_tokens, "temperature": 1.0, "seed": seed + i, "ignore_eos": True}
            for i in range(num)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.conftest import structured_model

    path = tmp_path_factory.mktemp("structured") / "model"
    save_hf_dir(structured_model(), None, path)
    return path


def zeroed(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every weight zero; the draft vocabulary (integer tensors) kept."""
    return {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in state.items()}


def trained_version(r: RolloutRunner) -> tuple[int, float]:
    """Harvest, train a copy in a real lease, merge and score it, publish it: (served version, its score)."""
    r.generate(prompts(24, seed=10_000), sampled(24, seed=0), rl_step=0)
    lease = r.leases.run(r.leases.accept({"lease_id": "l1", "parent_version": 0, "deadline_s": 4.0}))
    assert lease.version is not None, lease
    r.generate(prompts(12, seed=15_000), sampled(12, seed=50), rl_step=0)  # rollouts the copy never saw, to score on
    scored = r.scorer.run(r.scorer.accept({"round_id": "r1", "copies": [lease.version], "serving_version": None}))
    assert scored.error is None, scored.error
    score = scored.candidate_accepted_length
    return r.scorer.publish_candidate(scored.candidate, scored.candidate_draft_temperature,
                                      {"accepted_length": score}), score


def test_a_zeroed_draft_is_rolled_back_and_a_trained_one_kept(device, redis_client, tmp_path, model_dir):
    spec = JobSpec(model=str(model_dir), draft_k=K, speculation="always", draft_vocab_size=None, device=device)
    job_id = JobStore(redis_client).create(spec)[0]["job_id"]
    JobStore(redis_client).transition(job_id, JobState.RUNNING, {JobState.PENDING})
    r = RolloutRunner(job_id, "w0", spec, redis_client, str(tmp_path / "drafts"))
    assert r.policy.device.type == device
    good, score = trained_version(r)
    assert score > 1 + spec.swap_guard.min_published_gain  # a draft worth judging
    listener = r.swapper.start()  # installs `good` (the latest), then follows announcements
    try:
        assert r.engine.draft_version == good and r.swapper.watch is not None
        # the trained draft serves: after enough verify steps the guard keeps it
        r.generate(prompts(8, seed=20_000), sampled(8, seed=100), rl_step=1)
        assert r.engine.stats().num_verify_steps >= spec.swap_guard.num_verify_steps
        until(lambda: r.swapper.watch is None, 5 * LISTEN_TIMEOUT_S, "the guard to judge the trained draft")
        assert r.engine.draft_version == good and r.swapper.num_collapses == 0

        # the same draft with every weight zero, published with the trained one's score
        state, meta = r.served.load(good)
        meta.parent_version = good
        bad = r.served.publish(zeroed(state), meta)
        until(lambda: r.engine.draft_version == bad, 30.0, "the listener to install the zeroed draft")
        buffer_tokens = r.buffer.num_tokens
        outs = r.generate(prompts(8, seed=30_000), sampled(8, seed=200), rl_step=2)
        until(lambda: r.engine.draft_version == good, 5 * LISTEN_TIMEOUT_S,
              "the guard to roll the zeroed draft back")
    finally:
        r.swapper.stop()
        listener.join(timeout=5)

    # nothing finished is lost: the batch's rollouts, the harvested pairs, both stored versions
    assert len(outs) == 8 and all(len(o["token_ids"]) == 40 for o in outs)
    assert r.buffer.num_tokens >= buffer_tokens
    assert [e["version"] for e in r.served.versions()] == [good, bad]
    # the event and the counter
    events = [CollapseEvent.from_dict(d) for d in read_json_list(redis_client, job_collapses_key(job_id))]
    assert len(events) == 1 and r.swapper.num_collapses == 1 and r.swapper.rejected == {bad}
    e = events[0]
    assert (e.worker_id, e.version, e.rolled_back_to, e.rl_step, e.error) == ("w0", bad, good, 2, None)
    assert e.published_accepted_length == pytest.approx(score)
    assert e.num_verify_steps >= spec.swap_guard.num_verify_steps
    assert e.measured_accepted_length - 1 < spec.swap_guard.collapse_fraction * (e.expected_accepted_length - 1)
    assert int(redis_client.hget(job_totals_key(job_id), TotalsField.NUM_DRAFT_COLLAPSES)) == 1
    # the progress record names the version serving again; a catch-up never reinstalls the collapsed one
    assert next(p for p in read_progress(redis_client, job_id) if p.worker_id == "w0").draft_version == good
    r.swapper.catch_up()
    assert r.engine.draft_version == good
    # nor does the same worker started again (the driver restarts a lost worker under its id): it recalls the
    # collapse from the job's events; another worker never judged `bad` and installs it
    again = RolloutRunner(job_id, "w0", spec, redis_client, str(tmp_path / "drafts"))
    again.swapper.recall_rejected()
    again.swapper.catch_up()
    assert again.swapper.rejected == {bad} and again.engine.draft_version == good
    other = RolloutRunner(job_id, "w1", spec, redis_client, str(tmp_path / "drafts"))
    other.swapper.recall_rejected()
    other.swapper.catch_up()
    assert other.swapper.rejected == set() and other.engine.draft_version == bad
    # the metric the alert reads, and the REST route
    registry, collector = CollectorRegistry(), RedisCollector(JobStore(redis_client))
    registry.register(collector)
    fams = {f.name: f for f in text_string_to_metric_families(exposition(registry, collector).decode())}
    assert [(s.name, s.labels, s.value) for s in fams["tlt_draft_collapses"].samples] == [
        ("tlt_draft_collapses_total", {"job": job_id}, 1.0)]
    url = redis_client.connection_pool.connection_kwargs
    app = create_app(Settings(redis_url=f"redis://{url['host']}:{url['port']}", store_dir=str(tmp_path / "drafts"),
                              start_ray=False, watch=False))
    with TestClient(app) as client:
        drafts = client.get(f"/v1/jobs/{job_id}/drafts").json()
    assert drafts["num_collapses"] == 1 and drafts["collapses"] == [e.to_dict()]


def test_with_nothing_to_go_back_to_the_collapse_is_recorded_and_the_draft_stays(device, redis_client, tmp_path,
                                                                                 model_dir):
    spec = JobSpec(model=str(model_dir), draft_k=K, speculation="always", draft_vocab_size=None,
                   swap_guard={"num_verify_steps": 16}, device=device)
    r = RolloutRunner("job2", "w1", spec, redis_client, str(tmp_path / "drafts"))
    from drafter.draft.head import head_config, new_head
    from drafter.train.checkpoint import DraftMeta

    head = new_head(r.policy, None, None, seed=3)  # on the worker's device, as a lease's copy is
    meta = DraftMeta(version=0, parent_version=0, policy_version=0, num_steps=1, total_steps=1, num_tokens=1,
                     head_config=head_config(head), extra={"accepted_length": 2.5})
    v1 = r.served.publish(zeroed(head.state_dict()), meta)  # the job's first version: v0 was never stored
    r.swapper.swap(v1)
    r.generate(prompts(4, seed=40_000), sampled(4, seed=300, max_new_tokens=24), rl_step=0)
    judged = r.swapper.check()
    assert judged is not None and judged.verdict == Verdict.COLLAPSED
    assert r.engine.draft_version == v1 and r.swapper.rejected == {v1}  # still serving it: still lossless
    (e,) = [CollapseEvent.from_dict(d) for d in read_json_list(redis_client, job_collapses_key("job2"))]
    assert e.version == v1 and e.rolled_back_to is None and e.error is None
    assert r.swapper.check() is None  # judged once
    r.swapper.swap(v1)  # and never installed again
    assert r.swapper.num_swaps == 1
