"""Progress records, reporting, and the draft weight store against a real redis-server."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

from drafter.checkpoint import CheckpointError, DraftMeta
from drafter.eagle import EagleHead
from drafter.model import ModelConfig
from drafter.warmstart import head_config
from workers.progress import ProgressReporter
from workers.protocol import (
    ProgressRecord,
    ProtocolError,
    WorkerState,
    job_workers_key,
    progress_key,
    read_events,
    read_progress,
)
from workers.store import DraftStore

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position=256)


def record(worker="w0", state=WorkerState.ROLLING_OUT, **kw) -> ProgressRecord:
    base = dict(job_id="j1", worker_id=worker, state=state, num_running=3, num_finished=1, num_total=4,
                num_tokens=120, tokens_per_s=30.5, mean_accepted_length=1.8, draft_version=2, policy_version=1,
                rl_step=0, timestamp=time.time())
    return ProgressRecord(**(base | kw))


def test_record_round_trip():
    r = record()
    assert ProgressRecord.from_json(r.to_json()) == r


@pytest.mark.parametrize(("field", "value"), [
    ("state", "SLEEPING"), ("num_running", -1), ("num_tokens", 1.5), ("tokens_per_s", float("nan")),
    ("worker_id", ""), ("timestamp", "now"), ("num_finished", 99), ("rl_step", True)])
def test_bad_fields_are_rejected_by_name(field, value):
    d = json.loads(record().to_json()) | {field: value}
    with pytest.raises(ProtocolError, match=field if field != "num_finished" else "num_total"):
        ProgressRecord.from_json(json.dumps(d))


def test_reader_skips_a_corrupt_record_with_a_log_line(redis_client, caplog):
    ProgressReporter(redis_client, "j1", "w0").report(record("w0"))
    ProgressReporter(redis_client, "j1", "w1").report(record("w1"))
    redis_client.set(progress_key("j1", "w1"), json.dumps({"job_id": "j1", "state": 7}))
    redis_client.sadd(job_workers_key("j1"), "w2")  # registered, but its record expired
    with caplog.at_level(logging.ERROR):
        got = read_progress(redis_client, "j1")
    assert [r.worker_id for r in got] == ["w0"]
    assert "w1" in caplog.text


def test_progress_expires_after_its_ttl(redis_client):
    ProgressReporter(redis_client, "j1", "w0", ttl_s=0.2).report(record())
    assert len(read_progress(redis_client, "j1")) == 1
    time.sleep(0.4)
    assert read_progress(redis_client, "j1") == []


def test_rate_limit_and_state_changes(redis_client):
    now = [0.0]
    rep = ProgressReporter(redis_client, "j1", "w0", max_updates_per_s=10, clock=lambda: now[0])
    assert rep.report(record(num_tokens=1))
    now[0] = 0.05
    assert not rep.report(record(num_tokens=2))  # within 100 ms: held back
    assert rep.report(record(state=WorkerState.IDLE, num_running=0, num_tokens=3))  # state change: at once
    now[0] = 0.2
    assert rep.report(record(state=WorkerState.IDLE, num_running=0, num_tokens=4))
    assert (rep.num_writes, rep.num_skipped) == (3, 1)
    assert read_progress(redis_client, "j1")[0].num_tokens == 4
    events = read_events(redis_client, "j1")
    assert [(e["from"], e["to"]) for e in events] == [("", "ROLLING_OUT"), ("ROLLING_OUT", "IDLE")]


def head_state(seed):
    torch.manual_seed(seed)
    head = EagleHead(CFG)
    return head.state_dict(), head_config(head)


def test_publish_index_latest_and_announcement(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path, "job")
    sub = store.subscribe()
    state, cfg = head_state(0)
    v = store.publish(state, DraftMeta(version=0, parent_version=None, policy_version=3, num_steps=5,
                                       head_config=cfg))
    assert v == 1 and store.latest_version() == 1
    msg = None
    for _ in range(20):
        msg = msg or sub.get(timeout=0.1)
    assert msg["version"] == 1
    loaded, meta = store.load(1)
    assert meta.policy_version == 3 and all(torch.equal(loaded[k], state[k]) for k in state)


def test_latest_never_moves_backward(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path)
    store._record(5, {"sha256": "x", "path": "a"})
    store._record(3, {"sha256": "y", "path": "b"})  # a slower publisher finishing later
    assert store.latest_version() == 5


def test_failed_write_changes_nothing_in_redis(redis_client, tmp_path, monkeypatch):
    store = DraftStore(redis_client, tmp_path)
    state, cfg = head_state(0)
    store.publish(state, DraftMeta(version=0, parent_version=None, policy_version=0, head_config=cfg))
    monkeypatch.setattr("workers.store.save_draft", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError):
        store.publish(state, DraftMeta(version=0, parent_version=1, policy_version=0, head_config=cfg))
    assert store.latest_version() == 1 and len(store.versions()) == 1


def test_corrupt_version_is_rejected_and_the_previous_still_loads(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path)
    for seed in (0, 1):
        state, cfg = head_state(seed)
        store.publish(state, DraftMeta(version=0, parent_version=None, policy_version=0, head_config=cfg))
    path = tmp_path / store.entry(2)["path"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        store.load(2)
    store.load(1)
    assert [b["version"] for b in store.consistency_check()["bad"]] == [2]


def test_merge_and_publish_records_the_parent(redis_client, tmp_path):
    copies, served = DraftStore(redis_client, tmp_path / "c", "c"), DraftStore(redis_client, tmp_path / "s", "s")
    for seed, steps in ((0, 1), (1, 3)):
        state, cfg = head_state(seed)
        copies.publish(state, DraftMeta(version=0, parent_version=4, policy_version=2, num_steps=steps,
                                        head_config=cfg))
    v = copies.merge_and_publish([1, 2], into=served)
    state, meta = served.load(v)
    assert meta.parent_version == 4 and meta.num_steps == 4
    a, b = copies.load(1)[0], copies.load(2)[0]
    torch.testing.assert_close(state["fc.weight"], 0.25 * a["fc.weight"] + 0.75 * b["fc.weight"])
