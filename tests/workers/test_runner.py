"""RolloutRunner without Ray: speculation only with a draft that pays, leases and their outcomes,
and offline scoring of draft versions (real Redis, real tiny model, real store)."""

from __future__ import annotations

import pytest

from drafter.checkpoint import DraftMeta
from drafter.engine import Request
from drafter.evaluate import DRAFT_TEMPERATURES, expected_accepted_length
from drafter.sampling import SamplingParams
from drafter.warmstart import head_config, new_head
from workers.rollout import RolloutRunner, WorkerConfig

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
GREEDY = [{"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}] * 2


def runner(redis_client, tmp_path, **kw) -> RolloutRunner:
    return RolloutRunner("job1", "w0", WorkerConfig(model="tiny", k=2, **kw), redis_client, str(tmp_path), "job1")


def publish(r: RolloutRunner, accepted_length: float | None) -> int:
    head = new_head(r.policy, None, r.cfg.draft_vocab_size, seed=3)
    meta = DraftMeta(version=0, parent_version=0, policy_version=0, num_steps=1, total_steps=1, num_tokens=1,
                     head_config=head_config(head),
                     extra={} if accepted_length is None else {"accepted_length": accepted_length})
    return r.served.publish(head.state_dict(), meta)


def test_speculates_only_once_a_draft_measured_to_pay_is_served(redis_client, tmp_path):
    r = runner(redis_client, tmp_path, min_accepted_length=1.5)
    plain = r.generate(PROMPTS, GREEDY, rl_step=0)
    assert not r.speculating() and all(o["num_steps"] == len(o["token_ids"]) for o in plain)
    v1 = publish(r, 1.2)  # measured below the bar: served (the record says so) but no drafting
    r.swap_draft(v1)
    again = r.generate(PROMPTS, GREEDY, rl_step=1)
    assert not r.speculating() and r.record().draft_version == v1
    assert [o["draft_version"] for o in again] == [v1, v1]
    v2 = publish(r, 1.8)
    r.swap_draft(v2)
    assert r.speculating()
    spec = r.generate(PROMPTS, GREEDY, rl_step=2)
    assert r.engine.stats.num_draft_tokens > 0  # it drafted
    assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]  # and stayed lossless
    assert r.record().draft_version == v2
    # TLT off never drafts, whatever is served; 0 means always draft
    assert not runner(redis_client, tmp_path / "off", tlt=False).speculating()
    assert runner(redis_client, tmp_path / "always", min_accepted_length=0.0).speculating()


def test_lease_outcomes_are_kept_for_collection_and_bad_leases_are_named(redis_client, tmp_path):
    r = runner(redis_client, tmp_path)
    r.generate(PROMPTS, [{"max_new_tokens": 40, "temperature": 1.0, "seed": 1}] * 2, rl_step=0)
    for lease, field in (({"parent_version": 0, "deadline_s": 1}, "lease_id"),
                         ({"lease_id": "x", "parent_version": 0, "deadline_s": 0}, "deadline_s"),
                         ({"lease_id": "x", "parent_version": -1, "deadline_s": 1}, "parent_version")):
        with pytest.raises(ValueError, match=field):
            r.check_lease(lease)
    assert r.lease_result("x") is None  # a rejected lease leaves no trace
    result = r.train_drafter({"lease_id": "l1", "parent_version": 0, "deadline_s": 0.5})
    outcome = r.lease_result("l1")
    assert outcome["state"] == "done" and outcome["result"] == result and result["steps"] >= 1
    copy = {"store": "copies", "version": result["version"]}
    scores = r.evaluate_drafts([copy, copy | {"calibrate": True}], k=2, greedy=False)
    own, best = scores["accepted_lengths"]
    assert 1.0 <= own <= 3.0 and scores["num_tokens"] > 0
    # calibrated: scored at the draft temperature that accepts the most, never below the head's own 1.0
    tau = scores["draft_temperatures"][1]
    assert scores["draft_temperatures"][0] is None and tau in DRAFT_TEMPERATURES and best >= own - 1e-9
    head, _ = r._load_head(r.copies, result["version"])
    assert best == pytest.approx(expected_accepted_length(head, r.policy, r.buffer.rollouts, 2, False, tau))
    with pytest.raises(ValueError, match="store must be"):
        r.evaluate_drafts([{"store": "elsewhere", "version": 1}], k=2, greedy=False)
    for bad, field in (({"calibrate": "yes"}, "calibrate must be a boolean"), ({"calibrate": True}, "sampled")):
        with pytest.raises(ValueError, match=field):
            r.evaluate_drafts([copy | bad], k=2, greedy=field == "sampled")


def test_a_second_lease_is_refused_while_one_runs(redis_client, tmp_path):
    r = runner(redis_client, tmp_path)
    r.check_lease({"lease_id": "a", "parent_version": 0, "deadline_s": 5})
    with pytest.raises(ValueError, match="already holds lease a"):
        r.check_lease({"lease_id": "b", "parent_version": 0, "deadline_s": 5})


def test_a_policy_update_never_drops_a_draft_version_waiting_to_be_served(redis_client, tmp_path):
    r = runner(redis_client, tmp_path, min_accepted_length=0.0)
    v1 = publish(r, 1.5)
    head, _ = r._head_and_meta(v1)
    r.drafter.request_swap(head, v1)  # as a rollout's last step leaves it: waiting for the next decode step
    r.load_policy({k: v.clone() for k, v in r.policy.state_dict().items()}, policy_version=1)
    r.generate(PROMPTS, GREEDY, rl_step=1)
    assert r.record().draft_version == v1 and r.record().policy_version == 1


def test_a_lease_yields_to_a_rollout_under_way_and_leaves_its_state_alone(redis_client, tmp_path):
    import threading
    import time

    r = runner(redis_client, tmp_path)
    r.generate(PROMPTS, [{"max_new_tokens": 40, "temperature": 1.0, "seed": 1}] * 2, rl_step=0)  # some data
    long = [{"max_new_tokens": 480, "temperature": 1.0, "ignore_eos": True, "seed": 2}] * 2
    rollout = threading.Thread(target=r.generate, args=(PROMPTS, long, 1))
    rollout.start()
    while not r._generating:
        time.sleep(0.001)
    result = r.train_drafter({"lease_id": "late", "parent_version": 0, "deadline_s": 60})
    still_generating = r._generating
    state = r.state
    rollout.join()
    assert result["stopped"] and result["seconds"] < 10  # it gave the GPU back at once
    if still_generating:  # the lease ended mid-rollout: the worker still says what it does
        assert state == "ROLLING_OUT"
    assert r.state == "IDLE"


def test_an_idle_worker_is_swapping_while_it_installs_a_new_version(redis_client, tmp_path):
    from workers.protocol import read_events

    r = runner(redis_client, tmp_path)
    r.generate(PROMPTS, GREEDY, rl_step=0)
    v1 = publish(r, 1.5)
    r.swap_draft(v1, published_at=123.0)
    # served at once (nothing is decoding), not at the next rollout
    assert r.drafter.version == v1 and r.record().draft_version == v1 and r.state == "IDLE"
    moves = [(e["from"], e["to"]) for e in read_events(redis_client, "job1", count=100)]
    assert moves[-2:] == [("IDLE", "SWAPPING"), ("SWAPPING", "IDLE")]
    entry = r.swap_log[-1]
    assert entry["version"] == v1 and entry["published_at"] == 123.0
    assert entry["received_at"] <= entry["loaded_at"]
    # while generating, the swap leaves the state alone (it installs between two decode-loop updates)
    v2 = publish(r, 1.5)
    r._generating = True
    r.state = "ROLLING_OUT"
    r.swap_draft(v2)
    assert r.state == "ROLLING_OUT" and r.drafter.version == v2
    assert moves == [(e["from"], e["to"]) for e in read_events(redis_client, "job1", count=100)]  # no event
    r._generating = False
    r.set_state("IDLE")
    out = r.generate(PROMPTS, GREEDY, rl_step=1)
    assert out[0]["draft_version"] == v2


def test_a_swap_from_another_thread_mid_generation_stays_lossless(redis_client, tmp_path):
    """The listener installs heads while the decode loop runs: outputs equal plain decoding, and the
    switches happened during the rollout."""
    import threading

    r = runner(redis_client, tmp_path, min_accepted_length=0.0)
    long = [{"max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}] * 2
    plain = r.engine.generate([Request(p, SamplingParams(**kw)) for p, kw in zip(PROMPTS, long)])
    versions = [publish(r, 1.5) for _ in range(4)]
    done = threading.Event()

    def swapper() -> None:
        for v in versions:
            while not r._generating and not done.is_set():
                pass
            r.swap_draft(v)

    t = threading.Thread(target=swapper)
    t.start()
    out = r.generate(PROMPTS, long, rl_step=0)
    done.set()
    t.join()
    assert [o["token_ids"] for o in out] == [p.token_ids for p in plain]
    assert r.drafter.num_swaps >= len(versions)
