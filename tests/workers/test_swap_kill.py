"""Hot swaps interrupted.

A rollout worker killed while it installs a draft version (issue 23, "a rollout worker killed mid-swap"): a real
job (tiny preset, real local Ray, a private redis-server). Nothing finished is lost: the stored versions stay valid
(checksums) and the served index intact, the job's finished steps stay, the driver starts the worker again at a
later step, the job succeeds with a warning naming it, and the new worker serves the latest published version.
The window is made to last: the version's file arrives slowly. A FIFO stands at its path, so a worker loading it
blocks in open() with its progress record saying SWAPPING (an idle worker's swap) until the test writes to it.

A swap listener cut off from Redis (no Ray): it does not die, it subscribes again and catches up to the version
published while it was cut off.

Both run on the `device` fixture's device (JobSpec.device): on a GPU the job's two workers share the cluster's
first GPU (gpus_per_worker 0.25), as tests/workers/test_job.py's device test does."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from pathlib import Path

import pytest
import ray
import redis as redis_lib

from drafter.draft.head import head_config, new_head
from drafter.model.loading import load_model
from drafter.train.checkpoint import DraftMeta, draft_path, save_draft
from tests.waiting import until
from tests.workers.test_job import job
from workers.actors import get_worker
from workers.progress import read_events, read_json_list, read_progress
from workers.protocol.keys import drafts_counter_key, job_phase_key, job_steps_key
from workers.protocol.messages import PhaseRecord, StepRecord
from workers.protocol.states import Phase, WorkerState
from workers.rollout import RolloutRunner
from workers.spec import JobSpec
from workers.store import DraftStore, job_stores

JOB = "swapkill"
NUM_STEPS = 4  # the kill lands in step 0 or 1 (timing); the worker is back two steps later at most


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def draft(parent: int) -> tuple[dict, DraftMeta]:
    """An untrained draft head for the tiny preset (its weights do not matter here: no guard judges it)."""
    head = new_head(load_model("tiny").model, None, None)
    return head.state_dict(), DraftMeta(version=0, parent_version=parent, policy_version=0, num_steps=1,
                                        total_steps=parent + 1, head_config=head_config(head))


def publish_slowly(served: DraftStore, state: dict, meta: DraftMeta, scratch: Path) -> tuple[int, Path, Path]:
    """Publish as DraftStore.publish does (next version, its file, then the index, the latest pointer and the
    announcement in one MULTI/EXEC), except that a FIFO stands at the file's path. Returns (version, the FIFO's
    path, the real file, written aside, with the checksum the index records)."""
    version = int(served.redis.incr(drafts_counter_key(served.namespace)))
    meta.version = version
    real = scratch / f"v{version}.safetensors"
    sha = save_draft(real, state, meta)
    path = draft_path(served.directory, version)
    os.mkfifo(path)
    served._commit(version, served._entry_for(meta, path.name, sha))  # noqa: SLF001 (publish's own commit)
    return version, path, real


def finish_slow_file(path: Path, real: Path, scratch: Path) -> None:
    """Put the real file at the FIFO's path, and let any reader still blocked on the FIFO go (it reads nothing: its
    load fails as a truncated file does, and its engine keeps the draft it has)."""
    fifo = scratch / "fifo"
    os.link(path, fifo)  # the FIFO itself, for the readers that opened it before the file below replaces it
    os.replace(real, path)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader was blocked: it is let go
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # ENXIO: no reader now
                raise
        time.sleep(0.05)


def state_of(redis, worker_id: str) -> WorkerState | None:
    return next((p.state for p in read_progress(redis, JOB) if p.worker_id == worker_id), None)


def actor_id(worker_id: str) -> str | None:
    """The hex id of the job's actor for `worker_id` now (None: none by its name)."""
    with contextlib.suppress(ValueError):
        return get_worker(JOB, worker_id)._actor_id.hex()  # noqa: SLF001
    return None


def test_a_worker_killed_mid_swap_loses_nothing_and_serves_the_latest_draft_again(device, ray_cluster, private_redis,
                                                                                   redis_client, tmp_path):
    served, _ = job_stores(redis_client, tmp_path, JOB)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert served.publish(*draft(parent=0)) == 1  # the draft the workers start with
    # one prompt group per step: w0 generates it, w1 waits at the barrier (idle) for the whole step
    share = 0.25 if device == "cuda" else 1.0
    with job(JOB, private_redis.url, tmp_path, num_steps=NUM_STEPS, num_prompts_per_step=1, max_new_tokens=200,
             device=device, gpus_per_worker=share) as driver:
        run = driver.run.remote()
        until(lambda: (raw := redis_client.get(job_phase_key(JOB))) and PhaseRecord.from_json(raw).phase
              == Phase.ROLLOUT, what="step 0's rollout")
        killed_id = actor_id("w1")
        assert state_of(redis_client, "w1") == WorkerState.IDLE
        v2, path, real = publish_slowly(served, *draft(parent=1), scratch)
        until(lambda: state_of(redis_client, "w1") == WorkerState.SWAPPING, timeout_s=60, what="w1 swapping")
        ray.kill(get_worker(JOB, "w1"))  # no restart by Ray: that is the driver's to do
        until(lambda: actor_id("w1") != killed_id, timeout_s=60, what="w1 dead")
        v3 = served.publish(*draft(parent=v2))  # the latest from here on: what the new w1 is to serve
        finish_slow_file(path, real, scratch)
        result = ray.get(run, timeout=300)
        # the new w1 and w0 serve the latest version (w0 took v3 over pub/sub; w1 installed it as it started)
        w0, w1 = get_worker(JOB, "w0"), get_worker(JOB, "w1")
        assert actor_id("w1") not in (None, killed_id)  # a new actor in the slot
        until(lambda: ray.get(w0.describe.remote())["draft_version"] == v3, timeout_s=30, what="w0 serving v3")
        back = ray.get(w1.describe.remote())
    assert back["draft_version"] == v3 and back["swap_log"][-1]["version"] == v3
    assert back["device"].startswith(device)
    assert back["policy_version"] >= 2  # it joined the job: a later step's weight sync reached it
    # the job succeeded, its warning naming the lost worker, which was started again
    assert result["ok"] and result["steps"] == NUM_STEPS and result["error"] is None
    m = re.fullmatch(r"rollout workers lost: w1 at step (\d); each was started again", result["warning"] or "")
    assert m, result["warning"]
    lost_at = int(m.group(1))
    # every step is recorded once; the one that found w1 dead says so, and the others kept their rollouts
    steps = [StepRecord.from_dict(d) for d in read_json_list(redis_client, job_steps_key(JOB))]
    assert [s.rl_step for s in steps] == list(range(NUM_STEPS))
    assert [s.policy_version for s in steps] == list(range(1, NUM_STEPS + 1))
    assert lost_at in (1, 2) and lost_at + 1 < NUM_STEPS  # killed in step 0 or 1, found at the next weight sync
    for s in steps:
        assert s.num_rollouts == 2 and s.num_tokens > 0  # w0's group, every step
        assert [f["worker"] for f in s.failures] == (["w1"] if s.rl_step == lost_at else [])
    assert any(e["worker"] == "w1" and e["to"] == "SWAPPING" for e in read_events(redis_client, JOB, count=1000))
    # the stored versions are whole, checksums and all, and the served index names each of them
    assert served.consistency_check() == {"bad": [], "orphans": []}
    assert [e["version"] for e in served.versions()] == [1, v2, v3] == [1, 2, 3]
    assert served.latest_version() == v3
    assert all(served.load(v)[1].version == v for v in (1, v2, v3))



def test_the_swap_listener_outlives_losing_redis_and_catches_up(device, redis_client, tmp_path, caplog):
    r = RolloutRunner(JOB, "w0", JobSpec(model="tiny", draft_k=2, device=device), redis_client, str(tmp_path))
    subscribe, published = r.served.subscribe, []

    def cut_off(timeout: float = 1.0):
        published.append(r.served.publish(*draft(parent=0)))  # announced while this subscriber is cut off
        raise redis_lib.ConnectionError("Connection closed by server.")

    def first_cut_off():
        sub = subscribe()
        if not published:
            sub.get = cut_off
        return sub

    r.served.subscribe = first_cut_off
    with caplog.at_level(logging.WARNING, logger="workers.swap"):
        listener = r.swapper.start()
        try:
            until(lambda: published and r.engine.draft_version == published[0], timeout_s=30,
                  what="the version published while the listener was cut off")
            assert listener.is_alive()
        finally:
            r.swapper.stop()
            listener.join(5)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "workers.swap"]
    assert len(lines) == 2, lines  # one line as it lost Redis, one as it came back
    assert "the swap listener lost Redis (ConnectionError: Connection closed by server.)" in lines[0]
    assert "the swap listener is back after" in lines[1]
    assert [e["version"] for e in r.swapper.log] == published
    # the swap installed the draft beside the policy
    assert next(r.engine.drafter.head.parameters()).device.type == r.policy.device.type == device
