"""Commands to workers over real local Ray: sent without waiting, answered in a later poll, a slow
worker timed out and logged by name while the others' answers come through, and a watcher tick that
never waits for one."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import ray

from scheduler.commands import Commands, Reply
from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.state import JobTLT, read_classes
from scheduler.watcher import Watcher
from tests.scheduler.running import running_job
from workers.protocol.keys import RAY_NAMESPACE, job_tlt_key, worker_actor_name
from workers.protocol.states import Phase, WorkerState
from workers.redis_server import PrivateRedis

JOB = "job1"


@ray.remote(num_cpus=0)
class Worker:
    """Answers commands after `delay_s`; a malformed offer is refused, as a rollout worker does."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    async def stop_training(self, wait_s: float) -> bool:
        await asyncio.sleep(self.delay_s)
        return True

    async def start_lease(self, offer: dict) -> None:
        raise ValueError(f"deadline_s: must be > 0, got {offer['deadline_s']}")


@pytest.fixture(scope="module")
def workers():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    handles = [Worker.options(name=worker_actor_name(JOB, wid), namespace=RAY_NAMESPACE).remote(delay)
               for wid, delay in (("w0", 0.0), ("w1", 60.0))]
    ray.get([h.__ray_ready__.remote() for h in handles])
    yield
    ray.shutdown()


def poll_until(commands: Commands, replies: list, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(replies) < n and time.monotonic() < deadline:
        commands.poll()
        time.sleep(0.02)
    assert len(replies) >= n, replies


def test_a_slow_worker_is_timed_out_and_logged_while_the_others_answer(workers, caplog):
    commands, replies = Commands(), []
    start = time.perf_counter()
    for wid in ("w1", "w0"):  # the slow one first
        commands.send(JOB, wid, "stop_training", 5.0, on_reply=replies.append, timeout_s=1.5)
    assert time.perf_counter() - start < 1.0  # sending waits for no answer
    assert commands.is_pending(JOB, "w0", "stop_training") and commands.is_pending(JOB, "w1", "stop_training")
    poll_until(commands, replies, 1)
    [fast] = replies
    assert (fast.worker_id, fast.value, fast.error) == ("w0", True, None) and fast.seconds < 1.5
    assert commands.is_pending(JOB, "w1", "stop_training")
    with caplog.at_level(logging.WARNING, logger="scheduler.commands"):
        poll_until(commands, replies, 2)
    slow = replies[1]
    assert slow.worker_id == "w1" and slow.value is None and slow.error == "no answer within 1.5 s"
    assert slow.seconds >= 1.5
    assert "worker w1 did not answer stop_training within 1.5 s" in caplog.text
    assert commands.pending == []
    # asked again (as a watcher does every tick) and again no answer: quiet, not a second warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="scheduler.commands"):
        commands.send(JOB, "w1", "stop_training", 5.0, on_reply=replies.append, timeout_s=0.5)
        poll_until(commands, replies, 3)
    assert replies[2].error == "no answer within 0.5 s" and replies[2].quiet and not slow.quiet
    assert "did not answer" not in caplog.text


def test_refusals_and_missing_workers_come_back_as_errors(workers):
    commands, replies = Commands(), []
    commands.send(JOB, "w0", "start_lease", {"deadline_s": 0}, on_reply=replies.append)
    poll_until(commands, replies, 1)
    assert replies[0].error == "ValueError: deadline_s: must be > 0, got 0"
    commands.send(JOB, "w9", "stop_training", 1.0, on_reply=replies.append)  # no such actor: answered at once
    assert replies[1].error.startswith("worker w9 has no actor") and commands.pending == []


def test_a_reply_handler_may_send_the_next_command(workers):
    commands, replies = Commands(), []

    def again(reply: Reply) -> None:
        replies.append(reply)
        if len(replies) == 1:
            commands.send(JOB, "w0", "stop_training", 0.0, on_reply=again)

    commands.send(JOB, "w0", "stop_training", 0.0, on_reply=again)
    poll_until(commands, replies, 2)
    assert [r.value for r in replies] == [True, True]
    commands.forget(JOB)
    assert commands.handles == {} and commands.pending == []


def test_a_tick_never_waits_for_a_slow_worker(workers, tmp_path):
    with PrivateRedis() as server:
        redis = server.client()
        store = JobStore(redis)
        # the update phase needs w0's GPU back: the watcher asks it to stop its lease; it does not answer
        slow_job, lease_id = running_job(store, Phase.UPDATE, {"w0": (WorkerState.TRAINING, 3)}, leased="w0")
        other_job, _ = running_job(store, Phase.ROLLOUT, {"w0": (WorkerState.ROLLING_OUT, 3)})
        slow = Worker.options(name=worker_actor_name(slow_job, "w0"), namespace=RAY_NAMESPACE).remote(60.0)
        ray.get(slow.__ray_ready__.remote())
        watcher = Watcher(store, str(tmp_path), PolicySettings())
        for _ in range(3):
            start = time.perf_counter()
            watcher.tick()
            assert time.perf_counter() - start < 1.0
        assert read_classes(redis.hget(job_tlt_key(other_job), "classes")) == {"w0": "ROLLING_OUT"}
        assert [(p.job_id, p.method) for p in watcher.commands.pending] == [(slow_job, "stop_training")]  # once
        assert JobTLT.load(redis, slow_job).leases["w0"]["lease_id"] == lease_id  # not dropped for being slow
        ray.kill(slow)
