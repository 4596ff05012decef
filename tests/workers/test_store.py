"""DraftStore (and the torch-free DraftIndex under it) against a real redis-server and a temp directory,
with a tiny EagleHead."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch

from drafter.draft.head import EagleHead, head_config
from drafter.model.config import ModelConfig
from drafter.train.checkpoint import CheckpointError, DraftMeta, draft_path, save_draft
from workers.draft_index import DraftIndex
from workers.message import ProtocolError
from workers.protocol.keys import drafts_channel, drafts_counter_key, drafts_index_key, drafts_latest_key
from workers.protocol.messages import Announcement
from workers.store import DraftStore, job_stores, merge_key

CFG = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position=256)


def head_state(seed: int) -> tuple[dict[str, torch.Tensor], dict]:
    torch.manual_seed(seed)
    head = EagleHead(CFG)
    return head.state_dict(), head_config(head)


def meta(cfg: dict, parent: int | None = None, **kw) -> DraftMeta:
    return DraftMeta(version=0, parent_version=parent, policy_version=kw.pop("policy_version", 0), head_config=cfg,
                     **kw)


def snapshot(redis) -> dict:
    return {k: redis.dump(k) for k in redis.scan_iter("tlt:drafts:*") if not k.endswith(":next_version")}


def drain(sub, timeout: float = 0.3) -> list[Announcement]:
    out = []
    while (msg := sub.get(timeout=timeout)) is not None:
        out.append(msg)
    return out


def test_publish_writes_index_latest_and_announces(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path, "job")
    sub = store.subscribe()
    state, cfg = head_state(0)
    m = meta(cfg, policy_version=3, num_steps=5, total_steps=7, num_tokens=99, extra={"worker": "w0"})
    v = store.publish(state, m)
    assert v == 1 and store.latest_version() == 1 and m.version == 0  # the caller's meta is not modified
    msg = sub.get(timeout=2.0)
    entry = store.entry(1)
    assert isinstance(msg, Announcement) and msg.version == 1 and msg.sha256 == entry["sha256"]
    assert msg.path == "draft-v000001.safetensors" and msg.published_at >= entry["created_at"]
    assert {k: entry[k] for k in ("version", "parent_version", "policy_version", "path", "num_steps", "total_steps",
                                  "num_tokens", "extra")} == {
        "version": 1, "parent_version": None, "policy_version": 3, "path": "draft-v000001.safetensors",
        "num_steps": 5, "total_steps": 7, "num_tokens": 99, "extra": {"worker": "w0"}}
    assert (tmp_path / entry["path"]).is_file() and len(entry["sha256"]) == 64
    loaded, lm = store.load(1)
    assert lm.version == 1 and lm.policy_version == 3 and all(torch.equal(loaded[k], state[k]) for k in state)
    assert store.publish(state, meta(cfg, parent=1)) == 2
    assert [e["version"] for e in store.versions()] == [1, 2] and store.latest_version() == 2
    sub.close()


def test_latest_never_moves_backward_and_old_versions_are_not_announced(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path)
    sub = store.subscribe()
    entry = {"sha256": "x", "path": "p"}
    assert store._commit(5, entry)
    assert not store._commit(3, entry)  # a slower publisher finishing later
    assert store.latest_version() == 5
    assert sorted(redis_client.hkeys(drafts_index_key("default"))) == ["3", "5"]
    assert [m.version for m in drain(sub)] == [5]


def test_commit_retries_when_latest_moves_under_its_watch(redis_client, private_redis, tmp_path):
    other = private_redis.client()

    class Racing(DraftStore):
        num_reads = 0

        def _latest_watched(self, pipe):
            self.num_reads += 1
            if self.num_reads == 1:
                other.set(drafts_latest_key(self.namespace), 6)  # another publisher commits v6 now
            return super()._latest_watched(pipe)

    store = Racing(redis_client, tmp_path)
    assert not store._commit(4, {"sha256": "x", "path": "p"})
    assert store.num_reads == 2 and store.latest_version() == 6
    other.close()


def test_concurrent_publishers_leave_latest_at_the_highest_version(redis_client, private_redis, tmp_path):
    state = {"w": torch.arange(4.0)}

    def publish_some() -> None:
        client = private_redis.client()
        store = DraftStore(client, tmp_path)
        for _ in range(4):
            store.publish(state, meta({}))
        client.close()

    threads = [threading.Thread(target=publish_some) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = DraftStore(redis_client, tmp_path)
    assert [e["version"] for e in store.versions()] == list(range(1, 9)) and store.latest_version() == 8


def test_failed_file_write_leaves_redis_unchanged(redis_client, tmp_path, monkeypatch):
    store = DraftStore(redis_client, tmp_path)
    state, cfg = head_state(0)
    store.publish(state, meta(cfg))
    sub = store.subscribe()
    before = snapshot(redis_client)

    def disk_full(*a, **kw):
        raise OSError("No space left on device")

    monkeypatch.setattr("drafter.train.checkpoint.save_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        store.publish(state, meta(cfg, parent=1))
    assert snapshot(redis_client) == before and drain(sub, 0.2) == []
    assert store.latest_version() == 1 and [e["version"] for e in store.versions()] == [1]
    assert sorted(os.listdir(tmp_path)) == ["draft-v000001.safetensors"]  # no temp file left behind
    monkeypatch.undo()
    assert store.publish(state, meta(cfg, parent=1)) == 3  # version 2 was allocated and stays unused


def test_corrupt_file_is_rejected_and_the_previous_version_still_loads(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path)
    for seed in (0, 1):
        state, cfg = head_state(seed)
        store.publish(state, meta(cfg))
    path = tmp_path / store.entry(2)["path"]
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        store.load(2)
    store.load(1)
    assert [b["version"] for b in store.consistency_check()["bad"]] == [2]


def test_a_valid_file_that_is_not_the_published_one_is_rejected(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path)
    state, cfg = head_state(0)
    store.publish(state, meta(cfg))
    other = DraftMeta(version=1, parent_version=None, policy_version=0, head_config=cfg)
    save_draft(draft_path(tmp_path, 1), head_state(1)[0], other)  # well-formed, but not what was published
    with pytest.raises(CheckpointError, match="expected"):
        store.load(1)


def test_consistency_check_and_recover_after_a_crash(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path)
    state, cfg = head_state(0)
    for _ in range(2):
        store.publish(state, meta(cfg))
    (tmp_path / store.entry(1)["path"]).unlink()  # missing file
    # a publisher that died after its file and before its commit, with a version the counter never gave
    save_draft(draft_path(tmp_path, 7), state, DraftMeta(version=7, parent_version=2, policy_version=0,
                                                         head_config=cfg))
    (tmp_path / "draft-v000009.safetensors").write_bytes(b"half a file")
    stale, fresh = tmp_path / ".draft-v000010.safetensors.abc.tmp", tmp_path / ".draft-v000011.safetensors.d.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    redis_client.hset(drafts_index_key("default"), "12", "{not json")
    report = store.consistency_check()
    assert [b["version"] for b in report["bad"]] == [1, 12]
    assert report["orphans"] == ["draft-v000007.safetensors", "draft-v000009.safetensors"]
    sub = store.subscribe()
    done = store.recover()
    assert done["adopted"] == [7] and [r["path"] for r in done["rejected"]] == ["draft-v000009.safetensors"]
    assert done["removed_temp"] == [stale.name] and fresh.exists() and not stale.exists()
    assert store.latest_version() == 7 and store.load(7)[1].parent_version == 2
    assert [m.version for m in drain(sub)] == [7]
    assert int(redis_client.get(drafts_counter_key("default"))) == 7
    assert store.publish(state, meta(cfg, parent=7)) == 8  # never reuses an existing file's version


def test_merge_and_publish_records_the_parent(redis_client, tmp_path):
    copies, served = DraftStore(redis_client, tmp_path / "c", "j:copies"), DraftStore(redis_client, tmp_path / "s", "j")
    for seed, steps in ((0, 1), (1, 3)):
        state, cfg = head_state(seed)
        copies.publish(state, meta(cfg, parent=4, policy_version=2, num_steps=steps, total_steps=10 + steps))
    state, cfg = head_state(2)
    served.publish(state, meta(cfg))  # served already holds v1
    v = copies.merge_and_publish([1, 2], policy_version=5, into=served)
    assert v == 2 and served.latest_version() == 2
    state, m = served.load(v)
    assert (m.parent_version, m.policy_version, m.num_steps, m.total_steps) == (4, 5, 4, 14)
    assert m.extra["merged_versions"] == [1, 2] and m.extra["merged_from"] == "j:copies"
    assert served.entry(v)["parent_version"] == 4
    a, b = copies.load(1)[0], copies.load(2)[0]
    for k in a:
        if a[k].is_floating_point():
            torch.testing.assert_close(state[k], 0.25 * a[k] + 0.75 * b[k])
    assert copies.merge_and_publish([1, 2]) == 3  # default: into the same store


def test_remove_deletes_index_entries_and_files_and_keeps_the_rest(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path, "j:copies")
    for seed in range(3):
        state, cfg = head_state(seed)
        store.publish(state, meta(cfg))
    files = {v: tmp_path / store.entry(v)["path"] for v in (1, 2, 3)}
    assert store.remove([1, 3, 3, 99]) == [1, 3]  # 99 was never here: skipped
    assert [e["version"] for e in store.versions()] == [2]
    assert not files[1].exists() and not files[3].exists() and files[2].exists()
    assert store.load(2)[1].version == 2
    assert store.latest_version() == 3  # versions are never reused: the counter and pointer stay
    state, cfg = head_state(4)
    assert store.publish(state, meta(cfg)) == 4
    assert store.remove([1]) == []  # removing twice is harmless
    assert store.consistency_check() == {"bad": [], "orphans": []}
    for bad in ("1", [0], [True]):
        with pytest.raises(ValueError, match="versions"):
            store.remove(bad)
    assert [e["version"] for e in store.versions()] == [2, 4]  # a rejected call removed nothing


@pytest.mark.parametrize(("versions", "field"), [([], "versions"), ([1, 1], "duplicates"), ([0], "versions"),
                                                 ("1", "versions")])
def test_merge_rejects_bad_versions(redis_client, tmp_path, versions, field):
    with pytest.raises(ValueError, match=field):
        DraftStore(redis_client, tmp_path).merge_and_publish(versions)


def test_reading_rejects_unknown_versions_and_bad_index_entries(redis_client, tmp_path, caplog):
    store = DraftStore(redis_client, tmp_path)
    assert store.latest_version() is None and store.versions() == []
    with pytest.raises(ValueError, match="not in draft store"):
        store.load(3)
    with pytest.raises(ValueError, match="version must be"):
        store.load(0)
    entry = {"version": 1, "parent_version": None, "policy_version": 0, "path": "../../etc/passwd", "sha256": "x",
             "num_steps": 0, "total_steps": 0, "num_tokens": 0, "created_at": 0.0, "extra": {}}
    redis_client.hset(drafts_index_key("default"), "1", json.dumps(entry))
    redis_client.hset(drafts_index_key("default"), "2", json.dumps(entry | {"path": "a", "num_steps": "1"}))
    with pytest.raises(ProtocolError, match="field path") as info:
        store.load(1)
    assert info.value.field == "path"
    with caplog.at_level(logging.ERROR, logger="workers.draft_index"):
        assert store.versions() == []
    assert "field path" in caplog.text and "field num_steps" in caplog.text
    with pytest.raises(ValueError, match="namespace"):
        DraftStore(redis_client, tmp_path, "a b")


def test_subscription_skips_malformed_announcements(redis_client, tmp_path, caplog):
    store = DraftStore(redis_client, tmp_path)
    with store.subscribe() as sub, caplog.at_level(logging.ERROR, logger="workers.draft_index"):
        redis_client.publish(drafts_channel("default"), "not json")
        redis_client.publish(drafts_channel("default"), json.dumps({"version": "2"}))
        store.publish({"w": torch.zeros(2)}, meta({}))
        msg = sub.get(timeout=2.0)
        assert msg.version == 1 and sub.get(timeout=0.05) is None
    assert caplog.text.count("ignoring malformed announcement") == 2


def test_the_index_reads_what_the_store_published(redis_client, tmp_path):
    store = DraftStore(redis_client, tmp_path, "j")
    state, cfg = head_state(0)
    v = store.publish(state, meta(cfg, extra={"merge_key": "ab"}))
    index = DraftIndex(redis_client, "j")  # no directory, no weights: what the scheduler reads
    assert index.latest_version() == v and index.entry(v) == store.entry(v)
    assert [e["extra"]["merge_key"] for e in index.versions()] == ["ab"]
    with index.subscribe() as sub:
        v2 = store.publish(state, meta(cfg, parent=v))
        assert sub.get(timeout=2.0).version == v2
    assert DraftIndex(redis_client, "other").latest_version() is None
    with pytest.raises(ValueError, match="namespace"):
        DraftIndex(redis_client, "a b")


def test_job_stores_keep_each_job_apart(redis_client, tmp_path):
    served, copies = job_stores(redis_client, tmp_path, "j1")
    other, _ = job_stores(redis_client, tmp_path, "j2")
    assert (served.namespace, copies.namespace) == ("j1", "j1:copies")
    assert served.directory == tmp_path / "j1" / "served" and copies.directory == tmp_path / "j1" / "copies"
    state, cfg = head_state(0)
    assert served.publish(state, meta(cfg)) == 1 and other.publish(state, meta(cfg)) == 1  # apart: no collision
    assert served.load(1)[1].version == other.load(1)[1].version == 1
    assert copies.latest_version() is None


def test_merge_key_is_equal_exactly_for_copies_that_merge(redis_client, tmp_path):
    torch.manual_seed(0)
    head = EagleHead(CFG)
    state, cfg = head.state_dict(), head_config(head)  # vocab_ids, the draft vocabulary, is an integer tensor
    key = merge_key(3, cfg, state)
    trained = {k: v + 1 if v.is_floating_point() else v.clone() for k, v in state.items()}  # other weights
    assert merge_key(3, cfg, trained) == key and len(key) == 64
    other_vocab = dict(state)
    other_vocab["vocab_ids"] = state["vocab_ids"].flip(0)
    changed = dict(cfg, eagle=dict(cfg["eagle"], draft_temperature=0.5))
    assert len({key, merge_key(4, cfg, state), merge_key(3, changed, state), merge_key(3, cfg, other_vocab)}) == 4
    store = DraftStore(redis_client, tmp_path)  # what the keys promise, merge_drafts keeps
    a = store.publish(state, meta(cfg, parent=3, num_steps=1))
    b = store.publish(trained, meta(cfg, parent=3, num_steps=1))
    c = store.publish(other_vocab, meta(cfg, parent=3, num_steps=1))
    store.merge_and_publish([a, b])
    with pytest.raises(ValueError, match="non-float tensor"):
        store.merge_and_publish([a, c])
