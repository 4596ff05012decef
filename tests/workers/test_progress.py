"""ProgressReporter against a real redis-server: rate limit, TTL, event stream, one transaction."""

from __future__ import annotations

import time

import pytest
import redis as redis_lib

from tests.workers.test_protocol import record
from workers.progress import ProgressReporter, read_events, read_progress
from workers.protocol.keys import EVENTS_MAXLEN, PROGRESS_TTL_S, event_fields, job_events_key
from workers.protocol.states import WorkerState


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_record_is_written_with_the_default_ttl(redis_client):
    ProgressReporter(redis_client, "j1", "w0").report(record())
    ttl_ms = redis_client.pttl("tlt:job:j1:worker:w0:progress")
    assert PROGRESS_TTL_S * 1000 - 1000 < ttl_ms <= PROGRESS_TTL_S * 1000
    assert redis_client.smembers("tlt:job:j1:workers") == {"w0"}


def test_a_record_disappears_after_its_ttl(redis_client):
    ProgressReporter(redis_client, "j1", "w0", ttl_s=0.15).report(record())
    assert [r.worker_id for r in read_progress(redis_client, "j1")] == ["w0"]
    time.sleep(0.3)
    assert read_progress(redis_client, "j1") == []
    assert redis_client.sismember("tlt:job:j1:workers", "w0")  # still registered: the reader skips it


def test_rate_limit_with_a_fake_clock(redis_client):
    clock = FakeClock()
    rep = ProgressReporter(redis_client, "j1", "w0", max_updates_per_s=10, clock=clock)
    assert rep.report(record(num_tokens=1))
    for i, t in enumerate((0.02, 0.05, 0.09)):  # within 100 ms of the last write: held back
        clock.now = t
        assert not rep.report(record(num_tokens=2 + i))
    assert read_progress(redis_client, "j1")[0].num_tokens == 1
    clock.now = 0.1
    assert rep.report(record(num_tokens=10))
    clock.now = 0.15
    assert not rep.report(record(num_tokens=11))
    assert rep.report(record(num_tokens=12), force=True)  # forced: written at once
    assert (rep.num_writes, rep.num_skipped) == (3, 4)
    assert read_progress(redis_client, "j1")[0].num_tokens == 12


def test_state_change_is_written_at_once_and_flush_writes_the_held_record(redis_client):
    clock = FakeClock()
    rep = ProgressReporter(redis_client, "j1", "w0", clock=clock)
    rep.report(record(num_tokens=1))
    clock.now = 0.01
    assert not rep.report(record(num_tokens=2))
    assert rep.flush()  # the held record
    assert read_progress(redis_client, "j1")[0].num_tokens == 2
    assert not rep.flush()  # nothing held any more
    clock.now = 0.02
    assert rep.report(record(state=WorkerState.IDLE, num_running=0, num_finished=4, num_tokens=3))
    assert read_progress(redis_client, "j1")[0].state is WorkerState.IDLE
    assert rep.num_events == 2


def test_transitions_land_in_the_stream_in_order(redis_client):
    clock = FakeClock()
    rep = ProgressReporter(redis_client, "j1", "w0", clock=clock)
    states = [WorkerState.ROLLING_OUT, WorkerState.ROLLING_OUT, WorkerState.IDLE, WorkerState.TRAINING,
              WorkerState.IDLE, WorkerState.SWAPPING, WorkerState.ROLLING_OUT]
    for step, state in enumerate(states):
        clock.now = step * 0.001  # all within one rate-limit window: transitions still go through
        rep.report(record(state=state, num_running=0, rl_step=step, timestamp=100.0 + step))
    events = read_events(redis_client, "j1")
    assert [(e["from"], e["to"]) for e in events] == [
        ("", "ROLLING_OUT"), ("ROLLING_OUT", "IDLE"), ("IDLE", "TRAINING"), ("TRAINING", "IDLE"),
        ("IDLE", "SWAPPING"), ("SWAPPING", "ROLLING_OUT")]
    assert [e["rl_step"] for e in events] == [0, 2, 3, 4, 5, 6]
    assert [e["ts"] for e in events] == [100.0, 102.0, 103.0, 104.0, 105.0, 106.0]
    assert all(e["worker"] == "w0" for e in events)
    assert redis_client.xinfo_stream(job_events_key("j1"))["length"] == 6 <= EVENTS_MAXLEN


def test_write_is_one_transaction(redis_client, monkeypatch):
    rep = ProgressReporter(redis_client, "j1", "w0")
    commands = []
    real = redis_lib.client.Pipeline.execute

    def spy(pipe, *a, **kw):
        commands.append((pipe.transaction, [c[0][0] for c in pipe.command_stack]))
        return real(pipe, *a, **kw)

    monkeypatch.setattr(redis_lib.client.Pipeline, "execute", spy)
    rep.report(record())
    assert commands == [(True, ["SET", "SADD", "XADD"])]


def test_failed_write_keeps_the_reporter_state(redis_client, monkeypatch):
    rep = ProgressReporter(redis_client, "j1", "w0")

    def boom(*a, **kw):
        raise redis_lib.ConnectionError("down")

    monkeypatch.setattr(redis_lib.client.Pipeline, "execute", boom)
    with pytest.raises(redis_lib.ConnectionError):
        rep.report(record())
    monkeypatch.undo()
    assert (rep.num_writes, rep.last_state) == (0, None)
    assert rep.report(record())  # retried as a transition, event included
    assert len(read_events(redis_client, "j1")) == 1


def test_heartbeat_refreshes_the_last_record(redis_client):
    rep = ProgressReporter(redis_client, "j1", "w0", ttl_s=5)
    assert not rep.heartbeat()
    rep.report(record(timestamp=1.0))
    assert rep.heartbeat(wall_clock=lambda: 50.0)
    assert read_progress(redis_client, "j1")[0].timestamp == 50.0
    assert len(read_events(redis_client, "j1")) == 1  # no new transition


@pytest.mark.parametrize(("kw", "field"), [({"max_updates_per_s": 0}, "max_updates_per_s"),
                                           ({"ttl_s": 0}, "ttl_s"), ({"job_id": "a b"}, "job_id"),
                                           ({"worker_id": ""}, "worker_id")])
def test_bad_arguments_are_named(redis_client, kw, field):
    args = {"job_id": "j1", "worker_id": "w0"} | kw
    with pytest.raises(ValueError, match=field):
        ProgressReporter(redis_client, **args)


def test_a_record_for_another_worker_is_refused(redis_client):
    rep = ProgressReporter(redis_client, "j1", "w0")
    with pytest.raises(ValueError, match="worker_id"):
        rep.report(record("w1"))
    with pytest.raises(ValueError, match="job_id"):
        rep.report(record(job_id="j2"))


def test_a_worker_status_survives_redis_being_unreachable(redis_client):
    """A rollout that ends while Redis is down loses nothing: the worker's reports and its end-of-batch flush
    of the record the rate limit held back are best effort (the flush used to raise, failing a finished
    batch), and the held record lands once Redis answers again."""
    from workers.redis_server import free_port
    from workers.status import WorkerStatus

    status = WorkerStatus(redis_client, "j1", "w0", lambda: {"draft_version": 0, "buffer_tokens": 0, "num_swaps": 0})
    status.begin_rollout(0, 4)
    status.on_step(1, 16, 0.5, 1.0)
    status.on_step(4, 64, 1.0, 1.0)  # within the rate limit: held back for the flush
    assert status.reporter.held is not None
    status.reporter.redis = redis_lib.Redis(port=free_port(), socket_connect_timeout=0.2)  # Redis goes away
    with pytest.raises(redis_lib.ConnectionError):
        status.reporter.flush()  # what the worker called before
    status.flush()  # must not raise
    assert status.state == WorkerState.ROLLING_OUT  # a failed write is not a failed worker
    status.reporter.redis = redis_client  # Redis is back
    status.set_state(WorkerState.IDLE)
    [got] = read_progress(redis_client, "j1")
    assert (got.state, got.num_finished, got.num_tokens) == (WorkerState.IDLE, 4, 64)


def test_events_that_do_not_follow_the_protocol_are_skipped_and_logged(redis_client, caplog):
    key = job_events_key("j1")
    good = event_fields("w0", None, WorkerState.ROLLING_OUT, 1.0, 0)
    redis_client.xadd(key, good)
    redis_client.xadd(key, {**good, "from": "NAPPING"})  # not a state
    redis_client.xadd(key, {**good, "worker": "w 0"})  # not an id
    redis_client.xadd(key, {k: v for k, v in good.items() if k != "ts"})
    redis_client.xadd(key, event_fields("w0", WorkerState.ROLLING_OUT, WorkerState.IDLE, 2.0, 0))
    events = read_events(redis_client, "j1")
    assert [(e["worker"], e["from"], e["to"], e["ts"]) for e in events] == [
        ("w0", "", "ROLLING_OUT", 1.0), ("w0", "ROLLING_OUT", "IDLE", 2.0)]
    assert caplog.text.count("skipping event") == 3
