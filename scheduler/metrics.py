"""Prometheus metrics, computed at scrape time from what Redis holds (no state in the scheduler).

Job-level families go through prometheus_client. The per-worker families (13 samples per worker:
about 3,300 at 256 workers) are written as exposition text directly: the library validates and
escapes every label name of every sample, which made it most of a scrape's cost. `exposition()`
joins the two; tests/scheduler/test_metrics.py checks the text against the library's own parser.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from drafter.model.config import PRESETS, SMOLLM2_SPEC
from scheduler.jobs import JobStore
from scheduler.policy import CLASSES
from scheduler.state import read_classes
from workers.progress import read_progress
from workers.protocol.keys import (
    TltField,
    TotalsField,
    draft_namespaces,
    drafts_latest_key,
    job_steps_key,
    job_tlt_key,
    job_totals_key,
)
from workers.protocol.states import REPORTED_STATES, JobState, WorkerState
from workers.spec import JobSpec

log = logging.getLogger(__name__)
MAX_JOBS_SCRAPED = 200  # newest jobs only: a scrape must stay cheap however long the history
MAX_QUEUE_SCRAPED = 100  # the queue's head only: a bounded number of series however long the queue
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


# per-worker gauge families, written as text by RedisCollector.collect: (name, help)
WORKER_FAMILIES = (
    ("tlt_worker_state", "1 for the worker's current state"),
    ("tlt_worker_tokens_per_second", "Rollout tokens/s"),
    ("tlt_worker_mean_accepted_length", "Tokens per policy forward"),
    ("tlt_worker_draft_version", "Draft version serving"),
    ("tlt_worker_class", "1 for the scheduler's view of the worker: " + ", ".join(CLASSES)),
)
STATES = [s.value for s in WorkerState if s in REPORTED_STATES]  # what a worker reports of itself


class Latencies:
    """Latency histograms the watcher observes (the rest of /metrics is read from Redis)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw = {"registry": registry or CollectorRegistry(), "buckets": LATENCY_BUCKETS, "labelnames": ["job"]}
        self.dispatch = Histogram("tlt_dispatch_latency_seconds", "Lease decision to the worker accepting it", **kw)
        self.preempt = Histogram("tlt_preemption_latency_seconds", "Stop signal to the trainer having stopped", **kw)
        self.swap = Histogram("tlt_swap_latency_seconds", "Draft publish to a worker serving it", **kw)


def _label(value: str) -> str:
    """A label value escaped for the text format (ids are [A-Za-z0-9_.-] already; this is the guard)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def model_label(model: str) -> str:
    """A job's model as a public label: a preset's name (or the packaged SmolLM2's), a path as "sha256:" and its
    digest's first 12 hex digits: /metrics needs no token, and a path says where the server keeps its files."""
    if model in PRESETS or model == SMOLLM2_SPEC:
        return model
    return "sha256:" + hashlib.sha256(model.encode("utf-8", "backslashreplace")).hexdigest()[:12]


def _num(value: float) -> str:
    return repr(float(value))  # finite, validated on read; same digits as the library's floatToGoString


class RedisCollector(Collector):
    """Job-level families for the registry; `collect` also leaves the per-worker text of the same
    read in `self.local.worker_text` for `exposition` (one Redis read per scrape, per thread)."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.local = threading.local()

    def collect(self):
        jobs = self.store.list(MAX_JOBS_SCRAPED)
        by_state = GaugeMetricFamily("tlt_jobs", "Jobs by state (newest jobs)", labels=["state"])
        for state in JobState:
            by_state.add_metric([state.value], sum(j["state"] == state.value for j in jobs))
        yield by_state
        queued = self.store.queued_ids(MAX_QUEUE_SCRAPED)
        yield GaugeMetricFamily("tlt_queue_length", "Jobs QUEUED for their rollout GPUs", value=self.store.num_queued())
        position = GaugeMetricFamily("tlt_job_queue_position", "A QUEUED job's place in line, 1 for the next to "
                                     f"start (the first {MAX_QUEUE_SCRAPED} in line)", labels=["job"])
        for place, jid in enumerate(queued, start=1):
            position.add_metric([jid], place)
        yield position
        phase = GaugeMetricFamily("tlt_step_phase_seconds", "Last RL step's time by phase", labels=["job", "phase"])
        idle = CounterMetricFamily("tlt_idle_worker_seconds", "Worker-seconds idle at the step barrier",
                                   labels=["job"])
        reclaimed = CounterMetricFamily("tlt_reclaimed_worker_seconds", "Worker-seconds spent training drafters "
                                        "on otherwise idle GPUs", labels=["job"])
        info = GaugeMetricFamily("tlt_job_info", "1 per job, its labels describe it (the job table)",
                                 labels=["job", "state", "model", "tlt", "num_workers"])
        collapses = CounterMetricFamily("tlt_draft_collapses", "Draft versions a worker's swap guard rolled back: "
                                        "acceptance collapsed after the swap", labels=["job"])
        steps_done = GaugeMetricFamily("tlt_job_steps_done", "RL steps finished", labels=["job"])
        serving = GaugeMetricFamily("tlt_job_draft_version_served", "Newest published draft version",
                                    labels=["job"])
        lines: dict[str, list[str]] = {name: [] for name, _ in WORKER_FAMILIES}
        redis = self.store.redis
        for job in jobs:
            jid = job["job_id"]
            try:
                spec = JobSpec.from_stored(job.get("spec", {}))
                described = [model_label(spec.model), str(spec.tlt).lower(), str(spec.num_workers)]
            except ValueError:  # a record damaged in Redis: described as unknown; the scrape goes on
                log.warning("job %s: its stored spec does not read back; tlt_job_info describes it as unknown", jid)
                described = ["", "", ""]
            info.add_metric([jid, job["state"], *described], 1.0)
            # two fields, not the whole hash: it also holds the watcher's state
            reclaimed_s, classes_raw = redis.hmget(job_tlt_key(jid), TltField.RECLAIMED_WORKER_S, TltField.CLASSES)
            if reclaimed_s is not None or classes_raw is not None:
                reclaimed.add_metric([jid], float(reclaimed_s or 0.0))
                if job["state"] == JobState.RUNNING.value:
                    for wid, c in read_classes(classes_raw).items():  # labels in name order, as the library
                        tail = f'",job="{_label(jid)}",worker="{_label(str(wid))}"}}'
                        lines["tlt_worker_class"] += [f'tlt_worker_class{{class="{name}{tail} '
                                                      f'{1.0 if c == name else 0.0}\n' for name in CLASSES]
            latest = redis.get(drafts_latest_key(draft_namespaces(jid)[0]))
            if latest is not None:
                serving.add_metric([jid], float(latest))
            num_steps = redis.llen(job_steps_key(jid))
            if job["state"] not in (JobState.RUNNING.value, JobState.PENDING.value) and num_steps == 0:
                continue
            for r in read_progress(redis, jid):
                job_l, worker_l = f'job="{_label(jid)}"', f'worker="{_label(r.worker_id)}"'
                labels = f"{job_l},{worker_l}"
                lines["tlt_worker_state"] += [f'tlt_worker_state{{{job_l},state="{s}",{worker_l}}} '
                                              f'{1.0 if r.state.value == s else 0.0}\n' for s in STATES]
                lines["tlt_worker_tokens_per_second"].append(
                    f"tlt_worker_tokens_per_second{{{labels}}} {_num(r.tokens_per_s)}\n")
                lines["tlt_worker_mean_accepted_length"].append(
                    f"tlt_worker_mean_accepted_length{{{labels}}} {_num(r.mean_accepted_length)}\n")
                lines["tlt_worker_draft_version"].append(f"tlt_worker_draft_version{{{labels}}} "
                                                         f"{_num(r.draft_version)}\n")
            # one read of the totals; collapses from 0 on, so the alert's increase() sees the first one
            idle_s, num_collapses = redis.hmget(job_totals_key(jid), TotalsField.IDLE_WORKER_S,
                                                TotalsField.NUM_DRAFT_COLLAPSES)
            collapses.add_metric([jid], float(num_collapses or 0))
            last = redis.lindex(job_steps_key(jid), -1)
            if last is not None:
                try:
                    for name, seconds in json.loads(last).get("timings", {}).items():
                        phase.add_metric([jid, name], float(seconds))
                except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                    log.error("job %s: unreadable last step record", jid)
                idle.add_metric([jid], float(idle_s or 0.0))
            steps_done.add_metric([jid], num_steps)
        self.local.worker_text = "".join(
            f"# HELP {name} {help_}\n# TYPE {name} gauge\n{''.join(lines[name])}"
            for name, help_ in WORKER_FAMILIES)
        yield from (phase, idle, reclaimed, info, steps_done, serving, collapses)


def exposition(registry: CollectorRegistry, collector: RedisCollector) -> bytes:
    """The /metrics body: the registry (which runs `collector`), then the per-worker text that this
    thread's collect() just wrote."""
    collector.local.worker_text = ""
    head = generate_latest(registry)
    return head + collector.local.worker_text.encode()
