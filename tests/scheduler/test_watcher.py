"""A short job through the REST API where an idle worker in the long tail gets a drafter-training
lease, and the merged draft is published and served."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import pytest
import ray
from fastapi.testclient import TestClient

from drafter.model.config import PRESETS
from drafter.model.loading import random_model, save_hf_dir
from drafter.train.evaluate import DRAFT_TEMPERATURES
from scheduler.app import Settings, create_app
from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.watcher import Watcher
from tests.scheduler.running import running_job
from workers.engines import Speculation
from workers.pinning import IDLE_PRIORITY_ENV
from workers.protocol.keys import TltField, job_key, job_tlt_key
from workers.protocol.states import Phase, WorkerState
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec
from workers.store import DraftStore

# A tiny model with an EOS token: sampled responses end at random lengths (geometric, mean ~256), so
# one worker finishes its share well before the other and waits at the barrier: a real long tail. Tails here
# last about a second, and a lease often ends before its first micro-step (its parent still loading): 10 steps
# (6 before) so that some lease trains a copy; with 6, every lease of a run came out empty about 1 run in 6.
SPEC = {"num_steps": 10, "num_prompts_per_step": 3, "group_size": 4, "max_new_tokens": 900, "num_workers": 2,
        "draft_k": 2}
# tiny-model steps are seconds long: allow short leases and small buffers
POLICY = PolicySettings(min_lease_s=0.05, min_buffer_tokens=16)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # Ray starts its workers at nice 15 (raylet's worker_niceness), and a CPU job's leases and scoring run at idle
    # priority: beside CI's other test process, at nice 0, this job's workers got about 3% of a core and its
    # second-long tails' leases and scoring next to nothing (no round was scored in one CI run in two). What these
    # tests check is the watcher's flow, so the workers run at nice 0 and their background work at their own
    # priority (tests/workers/test_pinning.py checks idle priority and its starvation guard)
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True,
             _system_config={"worker_niceness": 0}, runtime_env={"env_vars": {IDLE_PRIORITY_ENV: "0"}})
    store_dir = str(tmp_path_factory.mktemp("drafts"))
    cfg = dataclasses.replace(PRESETS["tiny"], eos_token_ids=(0,), vocab_size=256, max_position=1024)
    model_dir = tmp_path_factory.mktemp("models") / "tiny-eos"
    save_hf_dir(random_model(cfg, init_seed=0), None, model_dir)
    with PrivateRedis() as server:
        app = create_app(Settings(redis_url=server.url, store_dir=store_dir, start_ray=False, policy=POLICY,
                                  watch_tick_s=0.05, model_roots=(str(model_dir.parent),)))
        with TestClient(app) as c:
            c.redis, c.store_dir, c.model = server.client(), store_dir, str(model_dir)
            yield c
    ray.shutdown()


def test_idle_worker_trains_and_the_merged_draft_is_served(client):
    job_id = client.post("/v1/jobs", json=SPEC | {"model": client.model}).json()["job_id"]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        record = client.get(f"/v1/jobs/{job_id}").json()
        if record["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
            break
        time.sleep(0.5)
    assert record["state"] == "SUCCEEDED", record
    drafts = client.get(f"/v1/jobs/{job_id}/drafts").json()
    assert drafts["num_leases"] >= 1 and drafts["reclaimed_worker_s"] > 0, drafts
    scored = [d for d in drafts["decisions"] if d["candidate_accepted_length"] is not None]
    assert scored, drafts["decisions"]
    assert all(1.0 <= d["candidate_accepted_length"] <= 1 + SPEC["draft_k"] for d in scored)
    # the first scored candidate has nothing to beat; later ones were compared with the serving draft
    assert scored[0]["published_version"] == 1 and drafts["serving_version"] >= 1
    assert [v["version"] for v in drafts["versions"]][0] == 1
    # each scored candidate was calibrated, and a published one serves at the temperature it scored at
    assert all(d["candidate_draft_temperature"] in DRAFT_TEMPERATURES for d in scored)
    tau = {d["published_version"]: d["candidate_draft_temperature"] for d in scored}
    assert all(v["draft_temperature"] == tau[v["version"]] for v in drafts["versions"])
    assert all(d["serving_accepted_length"] is not None for d in scored[1:])
    assert all((d["published_version"] is not None)
               == (d["candidate_accepted_length"] >= d["serving_accepted_length"]) for d in scored[1:])
    # each decided round's copies and candidate were deleted from the copies store, files and index
    copies = DraftStore(client.redis, Path(client.store_dir) / job_id / "copies", f"{job_id}:copies")
    left = {e["version"] for e in copies.versions()}
    for d in drafts["decisions"]:
        assert not left & {d["candidate"], *d["merged"], *d["dropped"]}, (d, left)
    assert len(list(copies.directory.glob("draft-v*.safetensors"))) == len(left)
    # served: a worker switched to a published version between decode steps (its last progress record says so)
    assert max(w["draft_version"] for w in client.get(f"/v1/jobs/{job_id}/workers").json()) >= 1
    metrics = client.get("/metrics").text
    assert f'tlt_reclaimed_worker_seconds_total{{job="{job_id}"}}' in metrics
    for name in ("tlt_dispatch_latency_seconds", "tlt_swap_latency_seconds"):
        count = next(line for line in metrics.splitlines() if line.startswith(f'{name}_count{{job="{job_id}"}}'))
        assert float(count.split()[-1]) >= 1, count
    # the per-GPU timeline and the step records behind `tlt report`
    steps = client.get(f"/v1/jobs/{job_id}/steps").json()
    assert [s["rl_step"] for s in steps] == list(range(SPEC["num_steps"]))
    assert all(s["num_tokens"] > 0 and s["mean_accepted_length"] >= 1.0 for s in steps)
    events = client.get(f"/v1/jobs/{job_id}/events").json()
    assert {"ROLLING_OUT", "IDLE", "TRAINING"} <= {e["to"] for e in events}
    ids = [tuple(map(int, e["id"].split("-"))) for e in events]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)  # stream order, oldest first
    # timestamps are taken when a record is made, by the worker's generate or lease thread, just
    # before it is written: stream order may invert two of them by a moment, never by more
    assert all(b["ts"] > a["ts"] - 0.5 for a, b in zip(events, events[1:]))
    assert client.get("/v1/jobs/nope/events").status_code == 404
    # pollers fetch only what is new
    assert client.get(f"/v1/jobs/{job_id}/events", params={"after": events[2]["id"]}).json() == events[3:]
    assert client.get(f"/v1/jobs/{job_id}/steps", params={"start": 4}).json() == steps[4:]
    r = client.get(f"/v1/jobs/{job_id}/events", params={"after": "yesterday"})
    assert r.status_code == 422 and "after" in r.text
    # running totals kept beside the step records: what /metrics reads instead of every record
    idle = next(line for line in client.get("/metrics").text.splitlines()
                if line.startswith(f'tlt_idle_worker_seconds_total{{job="{job_id}"}}'))
    assert float(idle.split()[-1]) == pytest.approx(sum(s["idle_worker_s"] for s in steps))


def test_a_stored_spec_reads_back_as_the_submitted_one():
    spec = JobSpec(model="tiny", draft_k=3, speculation="always", temperature=1, drafter={"lr": 1e-3})
    with PrivateRedis() as server:
        store = JobStore(server.client())
        job_id = store.create(spec)[0]["job_id"]
        stored = store.get(job_id)["spec"]  # the record's JSON, as every reader finds it
        assert JobSpec.from_stored(stored) == spec and JobSpec.from_stored(json.dumps(stored)) == spec
        assert JobSpec.from_stored(stored).speculation is Speculation.ALWAYS
    assert JobSpec.from_stored({}) == JobSpec()  # a field not stored: its one default
    with pytest.raises(ValueError, match="draft_k"):  # a field stored wrong is named (strict: no "2" for 2)
        JobSpec.from_stored(stored | {"draft_k": "2"})


def test_only_running_jobs_whose_spec_trains_the_drafter_are_watched(tmp_path, caplog):
    """The watcher reads each RUNNING job's stored spec back (JobSpec.from_stored) and watches those that train the
    drafter (tlt and idle_training on); a spec that no longer reads is logged with its job's id, the others are
    still watched. In the update phase with every worker idle: nothing is sent to a worker, no Ray needed."""
    with PrivateRedis() as server:
        redis = server.client()
        store = JobStore(redis)
        ids = {name: running_job(store, Phase.UPDATE, {"w0": (WorkerState.IDLE, 4)})[0]
               for name in ("trains", "tlt_off", "frozen", "damaged")}
        for name, change in (("tlt_off", {"tlt": False}), ("frozen", {"idle_training": False}),
                             ("damaged", {"num_workers": 0})):
            record = store.get(ids[name])
            record["spec"] |= change
            redis.set(job_key(ids[name]), json.dumps(record))
        watcher = Watcher(store, str(tmp_path), PolicySettings())
        with caplog.at_level(logging.ERROR, logger="scheduler"):
            watcher.tick()
        assert set(watcher.jobs) == {ids["trains"]}
        assert {job_id for job_id in ids.values() if redis.hget(job_tlt_key(job_id), TltField.CLASSES)} \
            == {ids["trains"]}
        [line] = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert line.getMessage() == f"job {ids['damaged']}: watcher step failed" and "num_workers" in line.exc_text
