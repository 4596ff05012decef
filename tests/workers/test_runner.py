"""RolloutRunner without Ray: adaptive speculation reported per bucket, hot swap, the progress record's
fields, and FAILED when generation fails (real Redis, real tiny model, real store)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from drafter.decode.engine import Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.head import head_config, new_head
from drafter.train.checkpoint import DraftMeta
from workers.policy_sync import write_policy_file
from workers.progress import read_events, read_progress
from workers.protocol.states import LeaseState, WorkerState
from workers.rollout import RolloutRunner
from workers.spec import JobSpec
from workers.swap import MAX_SWAP_LOG

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7]]
GREEDY = [{"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True}] * 2
# one rollout, long enough for adaptive speculation's forced tries at batch 1 (16 per draft length)
ALONE, GREEDY_ALONE = PROMPTS[:1], [{"max_new_tokens": 80, "temperature": 0.0, "ignore_eos": True}]


def runner(device: str, redis_client, tmp_path, worker_id: str = "w0", **kw) -> RolloutRunner:
    spec = JobSpec(model="tiny", draft_k=2, device=device, **kw)
    return RolloutRunner("job1", worker_id, spec, redis_client, str(tmp_path))


def publish(r: RolloutRunner, accepted_length: float | None) -> int:
    head = new_head(r.policy, None, r.spec.draft_vocab_size, seed=3)
    meta = DraftMeta(version=0, parent_version=0, policy_version=0, num_steps=1, total_steps=1, num_tokens=1,
                     head_config=head_config(head),
                     extra={} if accepted_length is None else {"accepted_length": accepted_length})
    return r.served.publish(head.state_dict(), meta)


def stored(redis_client, worker_id: str = "w0"):
    return next(p for p in read_progress(redis_client, "job1") if p.worker_id == worker_id)


def test_speculation_is_adaptive_by_default_and_reported_per_bucket(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    assert r.speculation == "adaptive"
    r.generate(ALONE, GREEDY_ALONE, rl_step=0)
    assert r.engine.stats().num_draft_tokens == 0  # version 0 is untrained: its prior expects nothing, no draft
    v1 = publish(r, 2.5)  # published with a score that pays: drafted at once (forced tries at batch 1)
    r.swapper.swap(v1)
    r.generate(ALONE, GREEDY_ALONE, rl_step=0)
    assert r.engine.stats().num_draft_tokens > 0
    adaptive = r.generate(PROMPTS, GREEDY, rl_step=0)
    assert adaptive[0]["speculation"] == adaptive[1]["speculation"] == r.engine.tuner.summary()
    assert set(adaptive[0]["speculation"]) == {"1", "2"}  # both rollouts run to 24 tokens: 2 live throughout
    v2 = publish(r, 1.2)  # a weak score: its prior expects little, and the tuner measures it again
    r.swapper.swap(v2)
    again = r.generate(PROMPTS, GREEDY, rl_step=1)
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in adaptive]
    assert [o["draft_version"] for o in again] == [v2, v2]
    # TLT off never drafts; "always" drafts draft_k every step; "off" never
    assert runner(device, redis_client, tmp_path / "tltoff", tlt=False).speculation == "off"
    always = runner(device, redis_client, tmp_path / "always", speculation="always")
    out = always.generate(PROMPTS, GREEDY, rl_step=0)
    assert out[0]["speculation"] == {"2": 2}
    assert [o["token_ids"] for o in out] == [o["token_ids"] for o in adaptive]
    off = runner(device, redis_client, tmp_path / "off", speculation="off")
    assert all(o["num_steps"] == len(o["token_ids"]) for o in off.generate(PROMPTS, GREEDY, rl_step=0))
    assert off.engine.stats().num_draft_tokens == 0


def test_the_progress_record_carries_buffer_tokens_and_swaps(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    r.generate(PROMPTS, GREEDY, rl_step=0)
    rec = stored(redis_client)
    assert rec.state == WorkerState.IDLE and rec.num_finished == rec.num_total == 2
    assert rec.buffer_tokens == r.buffer.num_tokens > 0  # harvested: what a lease would train on
    assert (rec.num_swaps, rec.last_swap_version, rec.last_swap_at) == (0, 0, 0.0)
    v1 = publish(r, 1.5)
    before = time.time()
    r.swapper.swap(v1, published_at=before)
    rec = stored(redis_client)
    assert (rec.num_swaps, rec.last_swap_version, rec.draft_version) == (1, v1, v1)
    assert before <= rec.last_swap_at <= time.time()
    off = runner(device, redis_client, tmp_path / "off", worker_id="w1", tlt=False)
    off.generate(PROMPTS, GREEDY, rl_step=0)
    assert stored(redis_client, "w1").buffer_tokens == 0  # TLT off harvests nothing
    frozen = runner(device, redis_client, tmp_path / "frozen", worker_id="w2", idle_training=False)
    frozen.swapper.swap(publish(frozen, 2.5))  # a frozen job serves a scored draft (its warm one, say)
    frozen.generate(ALONE, GREEDY_ALONE, rl_step=0)
    assert frozen.speculation == "adaptive" and frozen.engine.stats().num_draft_tokens > 0  # it still drafts
    assert stored(redis_client, "w2").buffer_tokens == 0  # but nothing trains on its rollouts: no harvest
    out = frozen.generate(PROMPTS, GREEDY, rl_step=1)
    tokens, seconds = out[0]["bucket_throughput"]["2"]  # this batch's decoding per live-batch bucket
    assert tokens == sum(len(o["token_ids"]) for o in out) and seconds > 0


def test_a_failed_generation_reports_failed_and_raises(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    r.generate(PROMPTS, GREEDY, rl_step=0)
    with pytest.raises(ValueError, match="outside"):  # token ids the policy does not have: the engine fails
        r.generate([[1, 2, 999]], GREEDY[:1], rl_step=1)
    assert r.status.state == WorkerState.FAILED and stored(redis_client).state == WorkerState.FAILED
    moves = [(e["from"], e["to"]) for e in read_events(redis_client, "job1")]
    assert moves[-1] == ("ROLLING_OUT", "FAILED")
    with pytest.raises(RuntimeError, match="has failed"):  # and it stays failed: no more work
        r.generate(PROMPTS, GREEDY, rl_step=2)
    with pytest.raises(ValueError, match="has failed"):
        r.leases.accept({"lease_id": "l1", "parent_version": 0, "deadline_s": 1.0})
    r.swapper.swap(publish(r, 1.5))  # a swap does not move it out of FAILED either
    assert stored(redis_client).state == WorkerState.FAILED


def test_a_policy_update_never_drops_a_draft_version_waiting_to_be_served(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path, speculation="always")
    v1 = publish(r, 1.5)
    head, _ = r.served.load_head(v1, r.policy.dtype, r.policy.device)
    r.engine.drafter.request_swap(head, v1)  # as a rollout's last step leaves it: waiting for the next decode step
    r.load_policy({k: v.clone() for k, v in r.policy.state_dict().items()}, policy_version=1)
    r.generate(PROMPTS, GREEDY, rl_step=1)
    assert r.status.record().draft_version == v1 and stored(redis_client).policy_version == 1


def test_an_idle_worker_is_swapping_while_it_installs_a_new_version(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    r.generate(PROMPTS, GREEDY, rl_step=0)
    v1 = publish(r, 1.5)
    r.swapper.swap(v1, published_at=123.0)
    # served at once (nothing is decoding), not at the next rollout
    assert r.engine.draft_version == v1 and r.status.state == WorkerState.IDLE
    moves = [(e["from"], e["to"]) for e in read_events(redis_client, "job1", count=100)]
    assert moves[-2:] == [("IDLE", "SWAPPING"), ("SWAPPING", "IDLE")]
    entry = r.swapper.log[-1]
    assert entry["version"] == v1 and entry["published_at"] == 123.0
    assert entry["received_at"] <= entry["loaded_at"] <= entry["serving_at"]
    # while generating, the swap leaves the state alone (it installs between two decode-loop updates)
    v2 = publish(r, 1.5)
    r.status.is_generating = True
    r.status.set_state(WorkerState.ROLLING_OUT)
    r.swapper.swap(v2)
    assert r.status.state == WorkerState.ROLLING_OUT and r.engine.draft_version == v2
    later = [(e["from"], e["to"]) for e in read_events(redis_client, "job1", count=100)]
    assert later == moves + [("IDLE", "ROLLING_OUT")]  # no SWAPPING event
    r.status.is_generating = False
    r.status.set_state(WorkerState.IDLE)
    out = r.generate(PROMPTS, GREEDY, rl_step=1)
    assert out[0]["draft_version"] == v2


def test_the_swap_log_is_bounded(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    versions = [publish(r, 1.5) for _ in range(MAX_SWAP_LOG + 2)]
    for v in versions:
        r.swapper.swap(v)
    assert [e["version"] for e in r.swapper.log] == versions[-MAX_SWAP_LOG:]
    assert r.swapper.num_swaps == len(versions) == stored(redis_client).num_swaps


def test_a_swap_from_another_thread_mid_generation_stays_lossless(device, redis_client, tmp_path):
    """The listener installs drafts while the decode loop runs: outputs equal plain decoding, and the
    switches happened during the rollout."""
    r = runner(device, redis_client, tmp_path, speculation="always")
    long = [{"max_new_tokens": 160, "temperature": 0.0, "ignore_eos": True}] * 2
    plain = r.engine.engine.generate([Request(p, SamplingParams(**kw)) for p, kw in zip(PROMPTS, long)])
    versions = [publish(r, 1.5) for _ in range(4)]
    done = threading.Event()

    def swapper() -> None:
        for v in versions:
            while not r.status.is_generating and not done.is_set():
                pass
            r.swapper.swap(v)

    t = threading.Thread(target=swapper)
    t.start()
    out = r.generate(PROMPTS, long, rl_step=0)
    done.set()
    t.join()
    assert [o["token_ids"] for o in out] == [p.token_ids for p in plain]
    assert r.engine.stats().num_swaps == len(versions) and r.swapper.num_swaps == len(versions)


def test_the_listener_swaps_in_every_published_version(device, redis_client, tmp_path):
    r = runner(device, redis_client, tmp_path)
    thread = r.swapper.start()
    try:
        v1 = publish(r, 1.5)
        deadline = time.monotonic() + 10
        while r.engine.draft_version != v1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.engine.draft_version == v1 and r.swapper.log[-1]["published_at"] is not None
    finally:
        r.swapper.stop()
        thread.join(5)
    assert not thread.is_alive()


def test_a_worker_serves_trains_swaps_and_loads_policies_on_its_device(device, redis_client, tmp_path):
    """JobSpec.device: the policy, the engine's draft, a lease's training and a new policy version from the
    learner's sync file are all on the worker's device."""
    r = runner(device, redis_client, tmp_path, speculation="always")
    assert r.device.type == r.policy.device.type == torch.device(device).type
    plain = r.generate(PROMPTS, GREEDY, rl_step=0)
    lease = r.leases.run(r.leases.accept({"lease_id": "l1", "parent_version": 0, "deadline_s": 0.3}))
    assert lease.state == LeaseState.DONE and lease.steps >= 1  # the trainer refuses a head off the policy's device
    r.swapper.swap(publish(r, 1.5))
    assert r.engine.drafter.head.fc.weight.device == r.policy.device
    assert [o["token_ids"] for o in r.generate(PROMPTS, GREEDY, rl_step=0)] == [o["token_ids"] for o in plain]
    moved = {k: v * 1.5 for k, v in r.policy.state_dict().items()}
    r.load_policy(write_policy_file(moved, tmp_path / "sync" / "policy.safetensors"), policy_version=1)
    assert all(torch.equal(r.policy.state_dict()[k], v) for k, v in moved.items())
    assert r.status.policy_version == 1
