"""Leases, merging and scoring on a worker, without Ray: lease outcomes in Redis, merge keys, the
scoring result (and its error), and publishing a candidate (real Redis, real tiny model, real store)."""

from __future__ import annotations

import threading
import time

import pytest

from drafter.train.evaluate import DRAFT_TEMPERATURES, EvaluationStoppedError, calibrate_draft_temperature
from workers.protocol.keys import job_leases_key, job_scoring_key
from workers.protocol.messages import LeaseOutcome, ScoringResult
from workers.protocol.states import LeaseState, WorkerState
from workers.rollout import RolloutRunner
from workers.scoring import recent_rollouts
from workers.spec import JobSpec
from workers.store import merge_key

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]


def sampled(seed: int, max_new_tokens: int = 40) -> list[dict]:
    return [{"max_new_tokens": max_new_tokens, "temperature": 1.0, "seed": seed + i} for i in range(2)]


def runner(device: str, redis_client, tmp_path, worker_id: str = "w0", seed: int = 1) -> RolloutRunner:
    """A worker with some harvested rollouts; a draft vocabulary of half the tiny model's 64 tokens, so
    workers with other rollouts pick other vocabularies."""
    spec = JobSpec(model="tiny", draft_k=2, draft_vocab_size=32, device=device)
    r = RolloutRunner("job1", worker_id, spec, redis_client, str(tmp_path))
    r.generate(PROMPTS, sampled(seed), rl_step=0)
    return r


def outcomes(redis_client) -> dict[str, LeaseOutcome]:
    return {k: LeaseOutcome.from_json(v) for k, v in redis_client.hgetall(job_leases_key("job1")).items()}


def lease(r: RolloutRunner, lease_id: str, deadline_s: float = 0.5, parent_version: int = 0) -> LeaseOutcome:
    return r.leases.run(r.leases.accept({"lease_id": lease_id, "parent_version": parent_version,
                                         "deadline_s": deadline_s}))


def test_a_lease_is_running_then_done_in_redis_and_its_copy_carries_its_merge_key(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    before = time.time()
    accepted = r.leases.accept({"lease_id": "l1", "parent_version": 0, "deadline_s": 0.5})
    running = outcomes(redis_client)["l1"]
    assert before <= running.started_at <= time.time()  # the lease holds the worker from its acceptance
    assert running == LeaseOutcome("l1", "w0", LeaseState.RUNNING, started_at=running.started_at)
    with pytest.raises(ValueError, match="already holds lease l1"):  # one lease at a time
        r.leases.accept({"lease_id": "l2", "parent_version": 0, "deadline_s": 0.5})
    done = r.leases.run(accepted)
    assert outcomes(redis_client)["l1"] == done
    assert done.state == LeaseState.DONE and done.steps >= 1 and done.version == 1 and not done.stopped
    # ended: the trainer stopped, after its deadline's worth of training
    assert done.started_at == running.started_at and done.ended_at >= done.started_at + 0.5
    state, meta = r.copies.load(done.version)
    assert meta.parent_version == 0 and meta.extra["lease_id"] == "l1" and meta.extra["worker"] == "w0"
    assert meta.extra["merge_key"] == merge_key(0, meta.head_config, state)
    assert r.copies.entry(done.version)["extra"]["merge_key"] == meta.extra["merge_key"]  # in the index too
    assert r.status.state == WorkerState.IDLE
    with pytest.raises(ValueError, match="already used"):
        r.leases.accept({"lease_id": "l1", "parent_version": 0, "deadline_s": 0.5})


@pytest.mark.parametrize(("offer", "field"), [({"parent_version": 0, "deadline_s": 1}, "lease_id"),
                                              ({"lease_id": "x", "parent_version": 0, "deadline_s": 0}, "deadline_s"),
                                              ({"lease_id": "x", "parent_version": -1, "deadline_s": 1},
                                               "parent_version"),
                                              ({"lease_id": "x", "parent_version": 0, "deadline_s": 1, "k": 2}, "k")])
def test_a_bad_offer_is_refused_naming_the_field_and_leaves_no_trace(redis_client, tmp_path, offer, field):
    r = RolloutRunner("job1", "w0", JobSpec(model="tiny"), redis_client, str(tmp_path))
    with pytest.raises(ValueError, match=f"^{field}:"):
        r.leases.accept(offer)
    assert outcomes(redis_client) == {} and r.leases.running is None


def test_a_failed_lease_is_failed_in_redis(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    out = lease(r, "l1", parent_version=7)  # no such version in the served store
    assert out.state == LeaseState.FAILED and out.version is None and "not in draft store" in out.error
    assert "\n" not in out.error and outcomes(redis_client)["l1"] == out
    assert r.leases.running is None and r.status.state == WorkerState.IDLE  # free for the next lease


def test_a_worker_keeps_a_bounded_number_of_its_lease_outcomes(device, redis_client, tmp_path, monkeypatch):
    monkeypatch.setattr("workers.leases.MAX_LEASE_OUTCOMES", 3)
    other = LeaseOutcome("theirs", "w9", LeaseState.DONE)
    redis_client.hset(job_leases_key("job1"), "theirs", other.to_json())  # another worker's
    r = runner(device, redis_client, tmp_path)
    for i in range(5):
        lease(r, f"l{i}", deadline_s=0.05)
    assert sorted(outcomes(redis_client)) == ["l2", "l3", "l4", "theirs"]


def test_a_lease_yields_to_a_rollout_under_way(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    long = [{"max_new_tokens": 480, "temperature": 1.0, "ignore_eos": True, "seed": 2}] * 2
    rollout = threading.Thread(target=r.generate, args=(PROMPTS, long, 1))
    rollout.start()
    while not r.status.is_generating:
        time.sleep(0.001)
    out = lease(r, "late", deadline_s=60)
    still_generating, state = r.status.is_generating, r.status.state
    rollout.join()
    assert out.stopped and out.seconds < 10  # it gave the GPU back at once
    if still_generating:  # the lease ended mid-rollout: the worker still says what it does
        assert state == WorkerState.ROLLING_OUT
    assert r.status.state == WorkerState.IDLE


def test_a_stop_before_the_trainer_exists_still_stops_the_lease(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    accepted = r.leases.accept({"lease_id": "l1", "parent_version": 0, "deadline_s": 60})
    assert r.leases.stop()  # preempted while it would be loading its parent
    t0 = time.perf_counter()
    out = r.leases.run(accepted)
    assert out.stopped and out.steps == 0 and out.version is None and time.perf_counter() - t0 < 10
    assert not r.leases.stop()  # nothing runs any more


def test_merge_keys_are_equal_for_mergeable_copies_and_differ_otherwise(device, redis_client, tmp_path):
    r0, r1 = runner(device, redis_client, tmp_path), runner(device, redis_client, tmp_path, worker_id="w1", seed=50)
    a, b = lease(r0, "a"), lease(r0, "b")  # same parent, same rollouts: the same draft vocabulary
    c = lease(r1, "c")  # the first lease on another worker picks its vocabulary from its own rollouts
    key = {o.lease_id: r0.copies.entry(o.version)["extra"]["merge_key"] for o in (a, b, c)}
    assert key["a"] == key["b"] != key["c"]


def test_score_round_merges_exactly_the_copies_given_and_writes_the_result(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    a, b = lease(r, "a"), lease(r, "b")
    req = {"round_id": "r1", "copies": [a.version, b.version], "serving_version": None}
    # every rollout it holds is what its leases trained on: it refuses to score there (the score would flatter)
    res = r.scorer.run(r.scorer.accept(req))
    assert res.candidate is not None and res.error == ("ValueError: worker w0 has no rollouts its own leases did "
                                                       "not train on to score drafts on")
    trained_on = {id(x) for x in r.buffer.rollouts}
    r.generate(PROMPTS, sampled(7), rl_step=1)  # the next step's rollouts: unseen by the copies
    res = r.scorer.run(r.scorer.accept(req | {"round_id": "r1b"}))
    assert ScoringResult.from_json(redis_client.get(job_scoring_key("job1"))) == res
    assert res.error is None and res.worker_id == "w0" and res.serving_accepted_length is None
    _, meta = r.copies.load(res.candidate)
    assert meta.extra["merged_versions"] == [a.version, b.version]
    # scored at the draft temperature that accepts the most on this worker's newest rollouts
    recent, num_tokens = recent_rollouts(r.buffer)
    assert recent and not {id(x) for x in recent} & trained_on
    head, _ = r.copies.load_head(res.candidate, r.policy.dtype)
    tau, scores = calibrate_draft_temperature(head, r.policy, recent, r.spec.draft_k)  # the worker's own k
    assert res.num_tokens == num_tokens > 0 and res.candidate_draft_temperature == tau in DRAFT_TEMPERATURES
    assert res.candidate_accepted_length == pytest.approx(scores[tau]) and 1.0 <= scores[tau] <= 3.0
    # the serving version is scored too when there is one
    served = r.scorer.publish_candidate(res.candidate, tau, {"accepted_length": scores[tau]})
    res2 = r.scorer.run(r.scorer.accept(req | {"round_id": "r2", "serving_version": served}))
    assert res2.error is None and 1.0 <= res2.serving_accepted_length <= 3.0
    # both at their best draft temperature on the same rollouts: the same weights score the same either way
    assert res2.serving_accepted_length == pytest.approx(res2.candidate_accepted_length)


def test_score_round_writes_an_error_result_when_it_cannot_score(device, redis_client, tmp_path):
    r0, r1 = runner(device, redis_client, tmp_path), runner(device, redis_client, tmp_path, worker_id="w1", seed=50)
    a, c = lease(r0, "a"), lease(r1, "c")  # copies with different merge keys do not average
    res = r0.scorer.run(r0.scorer.accept({"round_id": "r1", "copies": [a.version, c.version],
                                          "serving_version": None}))
    assert res.candidate is None and res.error.startswith("ValueError: ") and "non-float tensor" in res.error
    assert ScoringResult.from_json(redis_client.get(job_scoring_key("job1"))) == res
    res = r0.scorer.run(r0.scorer.accept({"round_id": "r2", "copies": [99], "serving_version": None}))
    assert "version 99 is not in draft store" in res.error
    fresh = RolloutRunner("job1", "w2", JobSpec(model="tiny"), redis_client, str(tmp_path))  # no rollouts yet
    res = fresh.scorer.run(fresh.scorer.accept({"round_id": "r3", "copies": [a.version], "serving_version": None}))
    assert res.candidate is not None and "no rollouts" in res.error  # merged: the caller can prune it
    assert r0.scorer.scoring is None  # free for the next round


def test_rollouts_preempt_a_scoring_which_answers_preempted_and_frees_the_scorer(device, redis_client, tmp_path):
    """Scoring is idle-time work: rollouts arriving stop it at its next batch (a set stop event ends a calibration
    there), and its answer says preempted, so that the scheduler has the round scored again elsewhere."""
    r = runner(device, redis_client, tmp_path)
    a = lease(r, "a")
    r.generate(PROMPTS, sampled(7), rl_step=1)  # rollouts the copy did not train on
    recent, _ = recent_rollouts(r.buffer)
    head, _ = r.copies.load_head(a.version, r.policy.dtype)
    stop = threading.Event()
    stop.set()
    with pytest.raises(EvaluationStoppedError, match="rollouts came first"):
        calibrate_draft_temperature(head, r.policy, recent, r.spec.draft_k, stop=stop)
    assert not r.scorer.preempt()  # no round under scoring: nothing to stop
    req = r.scorer.accept({"round_id": "r1", "copies": [a.version], "serving_version": None})
    r.generate(PROMPTS, sampled(9), rl_step=2)  # the worker's next rollouts arrive: the round is stopped
    res = r.scorer.run(req)
    assert res.preempted and res.error.startswith("preempted: ") and res.candidate is None
    assert ScoringResult.from_json(redis_client.get(job_scoring_key("job1"))) == res and r.scorer.scoring is None
    res = r.scorer.run(r.scorer.accept({"round_id": "r2", "copies": [a.version], "serving_version": None}))
    assert res.error is None and not res.preempted and res.candidate is not None  # the next round scores


@pytest.mark.parametrize(("request_", "field"), [
    ({"copies": []}, "copies"), ({"copies": [0]}, "copies"), ({"copies": "1"}, "copies"), ({}, "copies"),
    # the draft length is the worker's own (its JobSpec): a request that carries one is refused
    ({"copies": [1], "draft_k": 2}, "draft_k")])
def test_a_bad_scoring_request_is_refused_naming_the_field(redis_client, tmp_path, request_, field):
    r = RolloutRunner("job1", "w0", JobSpec(model="tiny"), redis_client, str(tmp_path))
    with pytest.raises(ValueError, match=field):
        r.scorer.accept({"round_id": "r1", "serving_version": None} | request_)
    assert r.scorer.scoring is None and redis_client.get(job_scoring_key("job1")) is None


def test_one_round_at_a_time(redis_client, tmp_path):
    r = RolloutRunner("job1", "w0", JobSpec(model="tiny"), redis_client, str(tmp_path))
    r.scorer.accept({"round_id": "r1", "copies": [1], "serving_version": None})
    with pytest.raises(ValueError, match="scoring round r1"):
        r.scorer.accept({"round_id": "r2", "copies": [1], "serving_version": None})


def test_publish_candidate_serves_it_at_its_draft_temperature(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    a = lease(r, "a")
    candidate = r.copies.merge_and_publish([a.version])
    version = r.scorer.publish_candidate(candidate, 0.4, {"accepted_length": 1.7, "serving_accepted_length": None})
    assert version == 1 and r.served.latest_version() == 1
    state, meta = r.served.load(version)
    assert meta.head_config["eagle"]["draft_temperature"] == 0.4
    assert {k: meta.extra[k] for k in ("accepted_length", "candidate", "draft_temperature")} == {
        "accepted_length": 1.7, "candidate": candidate, "draft_temperature": 0.4}
    r.swapper.swap(version)  # the worker now speculates with it if it clears the bar
    assert r.swapper.draft_accepted_length == 1.7 and r.speculation == "adaptive"
    kept = r.scorer.publish_candidate(candidate, None, {})  # None: served at its own temperature
    assert r.served.load(kept)[1].head_config["eagle"]["draft_temperature"] == 1.0
    for args, field in (((0, 0.4, {}), "candidate"), ((candidate, -1.0, {}), "draft_temperature"),
                        ((candidate, 0.4, []), "extra"), ((99, 0.4, {}), "not in draft store")):
        with pytest.raises(ValueError, match=field):
            r.scorer.publish_candidate(*args)


def test_a_lease_trains_as_many_draft_positions_as_the_job_drafts_unless_told():
    assert JobSpec(model="tiny", draft_k=4).train_config().num_unroll == 4
    assert JobSpec(model="tiny").train_config().num_unroll == JobSpec(model="tiny").draft_k
    told = JobSpec.model_validate({"model": "tiny", "draft_k": 3, "drafter": {"num_unroll": 6}})
    assert told.train_config().num_unroll == 6 and told.drafter.num_unroll == 6
    with pytest.raises(ValueError, match="num_unroll"):
        JobSpec.model_validate({"model": "tiny", "drafter": {"num_unroll": 0}})
