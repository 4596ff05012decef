"""A worker whose actor is dead (killed, its node lost) is dropped by the watcher at once, in one log line, not
asked again every tick until its progress record expires: the decision in pure parts (which answers say
"gone", which records are a dead worker's), then a tick over real local Ray with a killed actor."""

from __future__ import annotations

import logging
import time

import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayTaskError

from scheduler.commands import Commands, Reply, is_gone
from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.state import JobTLT, read_classes
from scheduler.watcher import Watcher, without_gone
from tests.scheduler.running import running_job
from workers.progress import ProgressReporter
from workers.protocol.keys import RAY_NAMESPACE, job_tlt_key, worker_actor_name
from workers.protocol.messages import ProgressRecord
from workers.protocol.states import Phase, WorkerState
from workers.redis_server import PrivateRedis


def record(worker_id: str, timestamp: float, state: WorkerState = WorkerState.IDLE, job_id: str = "j") \
        -> ProgressRecord:
    return ProgressRecord(job_id, worker_id, state, 0, 4, 4, 100, 20.0, 1.0, 0, 0, 0, timestamp)


def test_only_a_dead_actor_is_gone():
    assert is_gone(ActorDiedError())  # killed, its process or node lost, or its __init__ failed
    assert not is_gone(ActorUnavailableError("the connection was lost", None))  # may come back
    assert not is_gone(GetTimeoutError("no answer"))
    refused = RayTaskError("start_lease", "Traceback ...", ValueError("worker w0 already holds lease l1"),
                           proctitle="worker", pid=1, ip="127.0.0.1").as_instanceof_cause()
    assert isinstance(refused, ValueError) and not is_gone(refused)  # the worker's own refusal: it is alive


def test_a_dead_workers_last_record_is_left_out_until_a_newer_one_or_none():
    gone = {"w1": 100.0, "w2": 100.0, "w3": 100.0}
    records = [record("w0", 99.0), record("w1", 99.5, WorkerState.TRAINING), record("w2", 101.0)]
    kept, settled = without_gone(records, gone)
    # w0 was never gone; w1's record is the dead worker's; w2 has a new worker in its slot; w3's record expired
    assert [r.worker_id for r in kept] == ["w0", "w2"]
    assert sorted(settled) == ["w2", "w3"]
    assert without_gone(records, {}) == (records, [])


def test_commands_keep_gone_answers_for_the_watcher_to_take():
    commands = Commands()
    assert commands._noted(Reply("j", "w1", "stop_training", error="ActorDiedError: ...", is_gone=True)).is_gone
    commands._noted(Reply("j", "w2", "start_lease", error="ValueError: busy"))  # refused: alive, not kept
    commands._noted(Reply("k", "w0", "score_round", error="worker w0 has no actor", is_gone=True))
    assert commands.take_gone("j") == {"w1": "ActorDiedError: ..."}
    assert commands.take_gone("j") == {}  # taken once
    commands.forget("k")
    assert commands.take_gone("k") == {}


def test_an_unreachable_worker_is_warned_of_once_until_it_answers(caplog):
    """A dying node's worker: ActorUnavailableError (or no answer) at every tick until Ray says alive or dead."""
    commands = Commands()
    unreachable = [commands._noted(Reply("j", "w0", "stop_training", error="ActorUnavailableError: lost"),
                                   unanswered=True) for _ in range(3)]
    assert [r.quiet for r in unreachable] == [False, True, True]  # callers warn of the first only
    assert not commands._noted(Reply("j", "w1", "stop_training", error="no answer"), unanswered=True).quiet
    with caplog.at_level(logging.INFO, logger="scheduler.commands"):
        commands._noted(Reply("j", "w0", "start_lease", error="ValueError: busy"))  # a refusal is an answer
    assert "worker w0 answers again after" in caplog.text and "(3 commands unanswered)" in caplog.text
    assert not commands._noted(Reply("j", "w0", "stop_training", error="lost"), unanswered=True).quiet
    commands._noted(Reply("j", "w0", "stop_training", error="ActorDiedError: ...", is_gone=True))
    assert ("j", "w0") not in commands.unanswered  # gone: the watcher drops it in one line (take_gone)
    commands.forget("j")
    assert commands.unanswered == {}


@ray.remote(num_cpus=0)
class Trainer:
    """Stands in for a rollout worker holding a lease: it answers stop_training, and is then killed."""

    async def stop_training(self, wait_s: float) -> bool:
        return True


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_a_killed_worker_is_dropped_in_one_line_and_its_slot_watched_again(cluster, tmp_path, caplog):
    with PrivateRedis() as server:
        redis = server.client()
        store = JobStore(redis)
        # the update phase needs every GPU back: the watcher preempts w0's lease every tick until it is collected
        job_id, lease_id = running_job(store, Phase.UPDATE, {"w0": (WorkerState.TRAINING, 4),
                                                             "w1": (WorkerState.IDLE, 4)}, leased="w0")
        w0 = Trainer.options(name=worker_actor_name(job_id, "w0"), namespace=RAY_NAMESPACE).remote()
        ray.get(w0.__ray_ready__.remote())
        watcher = Watcher(store, str(tmp_path), PolicySettings())
        watcher.tick()  # asks w0 to stop (its handle is cached from here)
        ray.kill(w0)  # no restart: the worker is dead, its TRAINING record lives on in Redis for its TTL
        with caplog.at_level(logging.INFO, logger="scheduler"):
            for _ in range(40):  # 2 s of ticks at 0.05 s; before the fix, a warning per tick for 15 s
                watcher.tick()
                time.sleep(0.05)
        lines = [r for r in caplog.records if "w0" in r.getMessage() and r.levelno >= logging.WARNING]
        assert len(lines) == 1, [r.getMessage() for r in lines]
        assert lines[0].getMessage().startswith(f"job {job_id}: worker w0 is gone (ActorDiedError: ")
        assert lines[0].getMessage().endswith(f"; its lease {lease_id} is lost")
        assert JobTLT.load(redis, job_id).leases == {} and watcher.commands.pending == []
        assert read_classes(redis.hget(job_tlt_key(job_id), "classes")) == {"w1": "IDLE"}
        # the driver starts a new worker in the slot: its first record brings w0 back into the watcher's view
        ProgressReporter(redis, job_id, "w0").report(record("w0", time.time(), job_id=job_id), force=True)
        watcher.tick()
        assert read_classes(redis.hget(job_tlt_key(job_id), "classes")) == {"w0": "IDLE", "w1": "IDLE"}
        assert watcher.gone[job_id] == {}
