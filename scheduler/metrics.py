"""Prometheus metrics, computed at scrape time from what Redis holds (no state in the scheduler)."""

from __future__ import annotations

import json
import logging

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler.jobs import JobState, JobStore
from scheduler.policy import WorkerClass
from scheduler.watcher import read_classes
from workers.protocol import (
    WorkerState,
    drafts_latest_key,
    job_steps_key,
    job_tlt_key,
    job_totals_key,
    read_progress,
)

log = logging.getLogger(__name__)
CLASSES = [c.value for c in WorkerClass]
MAX_JOBS_SCRAPED = 200  # newest jobs only: a scrape must stay cheap however long the history


class RedisCollector(Collector):
    def __init__(self, store: JobStore) -> None:
        self.store = store

    def collect(self):
        jobs = self.store.list(MAX_JOBS_SCRAPED)
        by_state = GaugeMetricFamily("tlt_jobs", "Jobs by state (newest jobs)", labels=["state"])
        for state in JobState:
            by_state.add_metric([state.value], sum(j["state"] == state.value for j in jobs))
        yield by_state
        state = GaugeMetricFamily("tlt_worker_state", "1 for the worker's current state", labels=["job", "worker",
                                                                                                  "state"])
        tps = GaugeMetricFamily("tlt_worker_tokens_per_second", "Rollout tokens/s", labels=["job", "worker"])
        acc = GaugeMetricFamily("tlt_worker_mean_accepted_length", "Tokens per policy forward",
                                labels=["job", "worker"])
        ver = GaugeMetricFamily("tlt_worker_draft_version", "Draft version serving", labels=["job", "worker"])
        phase = GaugeMetricFamily("tlt_step_phase_seconds", "Last RL step's time by phase", labels=["job", "phase"])
        idle = CounterMetricFamily("tlt_idle_worker_seconds", "Worker-seconds idle at the step barrier",
                                   labels=["job"])
        reclaimed = CounterMetricFamily("tlt_reclaimed_worker_seconds", "Worker-seconds spent training drafters "
                                        "on otherwise idle GPUs", labels=["job"])
        info = GaugeMetricFamily("tlt_job_info", "1 per job, its labels describe it (the job table)",
                                 labels=["job", "state", "model", "tlt", "num_gpus"])
        steps_done = GaugeMetricFamily("tlt_job_steps_done", "RL steps finished", labels=["job"])
        serving = GaugeMetricFamily("tlt_job_draft_version_served", "Newest published draft version",
                                    labels=["job"])
        klass = GaugeMetricFamily("tlt_worker_class", "1 for the scheduler's view of the worker: ROLLING_OUT, "
                                  "STRAGGLER, IDLE, TRAINING or STALE", labels=["job", "worker", "class"])
        for job in jobs:
            spec = job.get("spec", {})
            info.add_metric([job["job_id"], job["state"], str(spec.get("model", "")),
                             str(spec.get("tlt", True)).lower(), str(spec.get("num_gpus", ""))], 1.0)
            # two fields, not the whole hash: it also holds the watcher's state
            reclaimed_s, classes_raw = self.store.redis.hmget(job_tlt_key(job["job_id"]), "reclaimed_worker_s",
                                                              "classes")
            if reclaimed_s is not None or classes_raw is not None:
                reclaimed.add_metric([job["job_id"]], float(reclaimed_s or 0.0))
                if job["state"] == JobState.RUNNING.value:
                    for wid, c in read_classes(classes_raw).items():
                        for name in CLASSES:
                            klass.add_metric([job["job_id"], wid, name], float(c == name))
            latest = self.store.redis.get(drafts_latest_key(job["job_id"]))
            if latest is not None:
                serving.add_metric([job["job_id"]], float(latest))
            if job["state"] not in (JobState.RUNNING.value, JobState.PENDING.value) and job["steps"] == 0:
                continue
            jid = job["job_id"]
            for r in read_progress(self.store.redis, jid):
                for s in WorkerState:
                    state.add_metric([jid, r.worker_id, s.value], float(r.state == s))
                tps.add_metric([jid, r.worker_id], r.tokens_per_s)
                acc.add_metric([jid, r.worker_id], r.mean_accepted_length)
                ver.add_metric([jid, r.worker_id], r.draft_version)
            redis = self.store.redis
            num_steps, last = redis.llen(job_steps_key(jid)), redis.lindex(job_steps_key(jid), -1)
            if last is not None:
                try:
                    for name, seconds in json.loads(last).get("timings", {}).items():
                        phase.add_metric([jid, name], float(seconds))
                except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
                    log.error("job %s: unreadable last step record", jid)
                idle.add_metric([jid], float(redis.hget(job_totals_key(jid), "idle_worker_s") or 0.0))
            steps_done.add_metric([jid], num_steps)
        yield from (state, tps, acc, ver, phase, idle, reclaimed, info, steps_done, serving, klass)
