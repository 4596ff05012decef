"""/metrics writes the per-worker families as text itself (scheduler/metrics.py): that text must be
exactly what prometheus_client would render for the same samples, and parse with its parser."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from scheduler.jobs import JobStore
from scheduler.metrics import STATES, WORKER_FAMILIES, RedisCollector, exposition
from scheduler.policy import CLASSES
from workers.progress import ProgressReporter
from workers.protocol.keys import job_key, job_tlt_key
from workers.protocol.messages import ProgressRecord
from workers.protocol.states import JobState, WorkerState
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec


@pytest.fixture(scope="module")
def redis():
    with PrivateRedis() as server:
        yield server.client()


def library_text(job_id: str, records: list[ProgressRecord], classes: dict[str, str]) -> str:
    """The per-worker families rendered by prometheus_client: the reference."""
    fams = {name: GaugeMetricFamily(name, help_, labels=["job", "worker"] + extra)
            for (name, help_), extra in zip(WORKER_FAMILIES, (["state"], [], [], [], ["class"]))}
    for r in records:
        for s in STATES:
            fams["tlt_worker_state"].add_metric([job_id, r.worker_id, s], float(r.state.value == s))
        fams["tlt_worker_tokens_per_second"].add_metric([job_id, r.worker_id], r.tokens_per_s)
        fams["tlt_worker_mean_accepted_length"].add_metric([job_id, r.worker_id], r.mean_accepted_length)
        fams["tlt_worker_draft_version"].add_metric([job_id, r.worker_id], r.draft_version)
    for wid, c in classes.items():
        for name in CLASSES:
            fams["tlt_worker_class"].add_metric([job_id, wid, name], float(c == name))

    class Fixed:
        def collect(self):
            yield from fams.values()

    registry = CollectorRegistry()
    registry.register(Fixed())
    return generate_latest(registry).decode()


def test_worker_text_is_what_the_library_renders(redis):
    store = JobStore(redis)
    job_id = store.create(JobSpec(model="tiny", num_workers=3))[0]["job_id"]
    store.transition(job_id, JobState.RUNNING, {JobState.PENDING})
    now = time.time()
    records = [ProgressRecord(job_id, "w0", WorkerState.ROLLING_OUT, 2, 1, 4, 123, 45.678901234, 1.75, 3, 2, 1, now),
               ProgressRecord(job_id, "w1", WorkerState.TRAINING, 0, 4, 4, 400, 0.0, 1.0, 0, 2, 1, now),
               ProgressRecord(job_id, "w.2-x", WorkerState.SWAPPING, 1, 3, 4, 10, 1e-7, 2.5, 12, 2, 1, now)]
    for r in records:
        ProgressReporter(redis, job_id, r.worker_id).report(r, force=True)
    # a corrupted classes field must be escaped, not break the text format
    classes = {"w0": "ROLLING_OUT", "w1": "TRAINING", 'evil"\\\nid': "IDLE", "w3": "FAILED", "w4": "STALE"}
    redis.hset(job_tlt_key(job_id), mapping={"classes": json.dumps(classes), "reclaimed_worker_s": 1.5})

    registry = CollectorRegistry()
    collector = RedisCollector(store)
    registry.register(collector)
    text = exposition(registry, collector).decode()

    ours = text[text.index("# HELP tlt_worker_state "):]
    expected = library_text(job_id, sorted(records, key=lambda r: r.worker_id), classes)
    assert ours == expected
    parsed = {f.name: f.samples for f in text_string_to_metric_families(text)}
    swapping = [s for s in parsed["tlt_worker_state"] if s.labels["worker"] == "w.2-x" and s.value == 1.0]
    assert [s.labels["state"] for s in swapping] == ["SWAPPING"]
    assert {s.labels["worker"] for s in parsed["tlt_worker_class"]} == set(classes)
    assert parsed["tlt_reclaimed_worker_seconds"][0].value == 1.5
    assert {s.labels["class"] for s in parsed["tlt_worker_class"] if s.value == 1.0} == {
        "ROLLING_OUT", "TRAINING", "IDLE", "FAILED", "STALE"}  # the policy's classes, WorkerState's names
    assert STATES == ["ROLLING_OUT", "IDLE", "TRAINING", "SWAPPING", "FAILED"]  # what workers report
    # job-level families still come from the library, in the same body
    [info] = parsed["tlt_job_info"]
    assert info.labels["job"] == job_id and info.labels["num_workers"] == "3"


def test_a_finished_job_without_steps_exports_no_worker_samples(redis):
    store = JobStore(redis)
    job_id = store.create(JobSpec(model="tiny", num_workers=1))[0]["job_id"]
    store.transition(job_id, JobState.CANCELLED, {JobState.PENDING})
    ProgressReporter(redis, job_id, "w0").report(
        ProgressRecord(job_id, "w0", WorkerState.IDLE, 0, 0, 0, 0, 0.0, 1.0, 0, 0, 0, time.time()), force=True)
    registry = CollectorRegistry()
    collector = RedisCollector(store)
    registry.register(collector)
    text = exposition(registry, collector).decode()
    assert f'job="{job_id}",worker="w0"' not in text
    assert f'tlt_job_info{{job="{job_id}",' in text


def test_a_job_whose_stored_spec_is_damaged_is_described_as_unknown_and_the_scrape_goes_on(redis, caplog):
    store = JobStore(redis)
    good = store.create(JobSpec(model="tiny", num_workers=2))[0]["job_id"]
    bad = store.create(JobSpec(model="tiny", num_workers=1))[0]["job_id"]
    record = json.loads(redis.get(job_key(bad)))
    record["spec"]["num_workers"] = "two"  # written wrong by hand, or by an older version
    redis.set(job_key(bad), json.dumps(record))
    registry = CollectorRegistry()
    collector = RedisCollector(store)
    registry.register(collector)
    text = exposition(registry, collector).decode()
    info = {s.labels["job"]: s.labels for f in text_string_to_metric_families(text) if f.name == "tlt_job_info"
            for s in f.samples}
    assert (info[good]["model"], info[good]["tlt"], info[good]["num_workers"]) == ("tiny", "true", "2")
    assert (info[bad]["model"], info[bad]["tlt"], info[bad]["num_workers"]) == ("", "", "")
    assert f"job {bad}: its stored spec does not read back" in caplog.text
