"""The queue's case of `tlt bench faults` (and of tests/scheduler/test_queue.py, which runs it): on a Ray cluster
of N GPUs, N + 3 one-GPU jobs submitted at once. Exactly N run; the other 3 wait QUEUED, each with its place in
line and no driver actor; they all start in submission order and all finish.

Works on any httpx.Client of the scheduler: a live server's, or a FastAPI TestClient (one in this process). The
storm (`storm`, FCFS under racing submits and cancels) needs a live server's URL: its clients run in threads.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import httpx
import ray

from bench.faults_count import NUM_EXTRA_JOBS, fcfs_violations
from workers.protocol.keys import RAY_NAMESPACE, driver_actor_name
from workers.protocol.states import TERMINAL_JOB_STATES, JobState

QUEUE_SPEC = {"model": "tiny", "num_steps": 1, "num_prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8,
              "num_workers": 1, "tlt": False}
POLL_S = 0.2
# the submit-and-cancel storm (issue 42, item 2: two submits 15 ms apart started in the opposite order, 2 runs of 6)
STORM_S = 25.0
NUM_STORM_CLIENTS = 4
STORM_CANCEL_P = 0.4  # a client cancels one of its jobs after this share of its submits: GPUs free up as submits race
STORM_MAX_PAUSE_S = 0.3  # between a client's submits


def has_driver(job_id: str) -> bool:
    """Whether the job has a driver actor (alive, or still being created) in this process's Ray cluster."""
    try:
        ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    return True


def records(client: httpx.Client, job_ids: list[str], headers: dict) -> list[dict]:
    """The jobs' records, in the order of `job_ids`."""
    return [client.get(f"/v1/jobs/{job_id}", headers=headers).json() for job_id in job_ids]


def wait_for(check: Callable[[], object], timeout_s: float, what: str, poll_s: float = POLL_S):
    """Poll `check` until it returns a true value (returned), or fail saying `what` never happened."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def queue_case(client: httpx.Client, headers: dict, num_gpus: int, spec: dict | None = None,
               timeout_s: float = 600.0) -> dict:
    """Submit num_gpus + NUM_EXTRA_JOBS one-GPU jobs at once and follow them to their ends. Counted: the QUEUED
    jobs with a place in line and no driver once num_gpus run (`queued_jobs_without_driver`, all of the extra ones
    is the goal), the most RUNNING at once, the jobs that started out of submission order, those that succeeded."""
    t0 = time.perf_counter()
    body = (spec or QUEUE_SPEC) | {"num_workers": 1}
    job_ids = []
    for _ in range(num_gpus + NUM_EXTRA_JOBS):
        r = client.post("/v1/jobs", json=body, headers=headers)
        r.raise_for_status()
        job_ids.append(r.json()["job_id"])
    max_running = 0

    def running_now() -> list[dict] | None:
        nonlocal max_running
        now = records(client, job_ids, headers)
        max_running = max(max_running, sum(r["state"] == JobState.RUNNING for r in now))
        return now if sum(r["state"] != JobState.QUEUED for r in now) >= num_gpus else None

    at_full = wait_for(running_now, timeout_s, f"{num_gpus} of the jobs to leave the queue")
    queued = [r for r in at_full if r["state"] == JobState.QUEUED]
    positions = [r["queue_position"] for r in queued]
    without_driver = [r for r in queued if not has_driver(r["job_id"])]

    def ended() -> list[dict] | None:
        nonlocal max_running
        now = records(client, job_ids, headers)
        max_running = max(max_running, sum(r["state"] == JobState.RUNNING for r in now))
        return now if all(r["state"] in TERMINAL_JOB_STATES for r in now) else None

    final = wait_for(ended, timeout_s, "every job to end")
    return {"num_gpus": num_gpus, "num_jobs": len(job_ids), "num_queued": len(queued),
            "queue_positions": positions, "queued_jobs_without_driver": len(without_driver),
            "max_running": max_running, "fcfs_violations": fcfs_violations(final),
            "num_succeeded": sum(r["state"] == JobState.SUCCEEDED for r in final),
            "errors": [r["error"] for r in final if r["error"]][:3], "seconds": round(time.perf_counter() - t0, 1)}


def storm(url: str, headers: dict, seconds: float = STORM_S, num_clients: int = NUM_STORM_CLIENTS,
          seed: int = 0) -> dict:
    """`num_clients` threads, each on its own connection to a live server at `url`, for `seconds`: submit a one-GPU
    job that runs until cancelled, and now and then cancel one of its own not yet ended (QUEUED or RUNNING), so
    GPUs free up while submits race. Then every job is cancelled and read back: `fcfs_violations` counts the jobs
    that started before one submitted earlier (created_at, the documented order) that started too."""
    body = QUEUE_SPEC | {"num_steps": 200}
    job_ids: list[str] = []
    counts = {"num_refused": 0, "num_cancels": 0}
    lock, deadline = threading.Lock(), time.monotonic() + seconds

    def client_loop(i: int) -> None:
        rng, mine = random.Random(seed * 100 + i), []
        with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
            while time.monotonic() < deadline:
                r = client.post("/v1/jobs", json=body)
                if r.status_code == 201:
                    mine.append(r.json()["job_id"])
                    with lock:
                        job_ids.append(mine[-1])
                else:  # 429 over the quota: cancels below make room
                    with lock:
                        counts["num_refused"] += 1
                if mine and rng.random() < STORM_CANCEL_P:
                    client.post(f"/v1/jobs/{mine.pop(rng.randrange(len(mine)))}/cancel")
                    with lock:
                        counts["num_cancels"] += 1
                time.sleep(rng.uniform(0, STORM_MAX_PAUSE_S))
            for job_id in mine:
                client.post(f"/v1/jobs/{job_id}/cancel")

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        storm_jobs = records(client, job_ids, headers)
    started = [r for r in storm_jobs if r.get("started_at") is not None]
    return {"seconds": seconds, "num_clients": num_clients, "num_submitted": len(storm_jobs),
            "num_started": len(started), **counts, "fcfs_violations": fcfs_violations(storm_jobs),
            "min_submit_gap_s": min_gap([r["created_at"] for r in storm_jobs])}


def min_gap(times: list[float]) -> float | None:
    """The least time between two of `times` (how close the racing submits came), None for fewer than two."""
    ordered = sorted(times)
    return round(min(b - a for a, b in zip(ordered, ordered[1:])), 6) if len(ordered) > 1 else None
