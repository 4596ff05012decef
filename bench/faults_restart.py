"""The restart case of `tlt bench faults` (issue 42; tests/scheduler/test_serve.py runs it): a real `tlt serve` with a
private Ray of one GPU, on a Redis that outlives it. Job A runs (checkpoint_every 1) and B and D wait QUEUED behind
it, one GPU each; the scheduler gets SIGTERM and a new one starts on the same Redis. Its new private Ray has no
driver and no placement group: A must get its GPU back before B or D is admitted.

Counted from the new scheduler's start until A has finished a new step and WATCH_AFTER_S more:
- `restart_gpus_overcommitted`: the most GPUs the RUNNING jobs ask (JobSpec: num_workers x gpus_per_worker) beyond
  the cluster's, sampled every POLL_S from the API (the issue's run had A and B RUNNING on one GPU);
- `restart_resumed_progress_s`: the seconds from the new scheduler's start until A has finished a new step;
- the states B and D were seen in (QUEUED only is the promise).
Then the new scheduler's whole process group gets SIGTERM with A running (what systemd and a terminal send):
bench.faults_service.sigterm counts the exit code, seconds and processes left.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx

from bench.faults_service import SIGNAL_SPEC, read_job, running_job, served, sigterm
from scheduler.jobs import JobStore
from workers.protocol.client import connect
from workers.protocol.states import JobState

NUM_GPUS = 1
QUEUED_SPEC = SIGNAL_SPEC | {"checkpoint_every": 10}  # B and D: one GPU each, long enough to hold it if admitted
POLL_S = 0.2
WATCH_AFTER_S = 5.0  # sampled this long after A's new step too: a queued job admitted then would still be seen
MAX_PROGRESS_WAIT_S = 300.0  # how long the probe waits for A's new step before it gives up (the goal is 60 s)


def gpus_asked(record: dict) -> float:
    """The GPUs a job's record asks for while it is RUNNING (its placement group's), else 0."""
    if record["state"] != JobState.RUNNING:
        return 0.0
    spec = record["spec"]
    return spec["num_workers"] * spec["gpus_per_worker"]


def watch_resume(url: str, job_id: str, queued: list[str], steps_at_stop: int, t0: float) -> dict:
    """Sample A, B and D from the API until A has a step more than `steps_at_stop` (and WATCH_AFTER_S after):
    the most GPUs asked by RUNNING jobs over the cluster's, the seconds from `t0` to A's new step, B's and D's
    states seen."""
    over, progress_s, seen = 0.0, None, {job: set() for job in queued}
    deadline = t0 + MAX_PROGRESS_WAIT_S
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline:
            records = [read_job(client, job) for job in (job_id, *queued)]
            over = max(over, sum(gpus_asked(r) for r in records) - NUM_GPUS)
            for r in records[1:]:
                seen[r["job_id"]].add(r["state"])
            if records[0]["state"] != JobState.RUNNING:  # failed or requeued: no progress to wait for
                break
            if progress_s is None and records[0]["steps"] > steps_at_stop:
                progress_s = time.monotonic() - t0
                deadline = time.monotonic() + WATCH_AFTER_S
            time.sleep(POLL_S)
    return {"gpus_overcommitted": round(over, 4), "resumed_progress_s": None if progress_s is None else
            round(progress_s, 1), "queued_states_seen": {job: sorted(states) for job, states in seen.items()},
            "resumed_job": records[0]}


def restart_with_queue(work_dir: Path, redis_url: str) -> dict:
    """The whole case: A running and B, D queued; SIGTERM; a new scheduler on the same Redis; A's resume watched;
    then SIGTERM to the new scheduler's process group. Every figure with its evidence."""
    with served(work_dir, gpus=NUM_GPUS, redis_url=redis_url) as (proc, _, url, _):
        job = running_job(url)  # A: RUNNING, a step done, checkpointed after each
        with httpx.Client(base_url=url, timeout=30) as client:
            queued = [client.post("/v1/jobs", json=QUEUED_SPEC).json()["job_id"] for _ in range(2)]
            states_before = [read_job(client, j)["state"] for j in queued]
        first = sigterm(proc, url, job=job, num_pollers=1, before_s=0.5)
    steps_at_stop = JobStore(connect(redis_url)).num_steps([job["job_id"]])[0]  # its driver went with the Ray
    t0 = time.monotonic()
    with served(work_dir, gpus=NUM_GPUS, redis_url=redis_url) as (proc, _, url, _):
        ready_s = time.monotonic() - t0
        watched = watch_resume(url, job["job_id"], queued, steps_at_stop, t0)
        resumed = watched.pop("resumed_job")
        group = (sigterm(proc, url, job=resumed, before_s=1.0, is_group=True)
                 if resumed["state"] == JobState.RUNNING else None)
        if group is None:  # nothing running to stop with: stop it all the same, gracefully
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return {"first_exit_code": first["sigterm_exit_code"], "queued_before": states_before,
            "steps_at_stop": steps_at_stop, "ready_s": round(ready_s, 1), **watched,
            "resumed_state": resumed["state"], "resumed_warning": resumed.get("warning"),
            "resumed_error": resumed.get("error"), "group_sigterm": group}
