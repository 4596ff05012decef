"""`tlt bench observability`: what /metrics and the status page cost the scheduler at N workers.

A running job with `num_workers` workers, each with a live progress record written through the real
ProgressReporter, `num_steps` step records and a state-transition history of `events_per_worker`
events per worker, all in a private redis-server. The scheduler app runs in its own process (no
Ray: these routes read Redis only); its CPU seconds come from /proc, so the client's work and other
load on the machine do not count:
- one Prometheus scrape of /metrics;
- one open status page: what its script (scheduler/ui/app.js) fetches every REFRESH_MS (new events
  and the worker table) and every SLOW_EVERY-th refresh (job list, job, new steps, draft history).
The overhead figure is the CPU they add per wall-clock second at Prometheus's 5 s scrape interval
and one open status page, as a fraction of one core. The page's cadences are read from app.js.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SCRAPE_INTERVAL_S = 5.0  # deploy/prometheus/prometheus.yml


def page_cadence() -> tuple[float, int]:
    """(refresh seconds, slow-route period in refreshes) as the status page's script has them."""
    js = (Path(__file__).parents[1] / "scheduler" / "ui" / "app.js").read_text()
    refresh_ms = re.search(r"const REFRESH_MS = (\d+);", js)
    slow_every = re.search(r"const SLOW_EVERY = (\d+);", js)
    if not (refresh_ms and slow_every):
        raise RuntimeError("scheduler/ui/app.js no longer defines REFRESH_MS and SLOW_EVERY")
    return int(refresh_ms.group(1)) / 1000, int(slow_every.group(1))


def log(msg: str) -> None:
    print(f"[bench observability] {msg}", file=sys.stderr, flush=True)


def _populate(redis, job_id: str, num_workers: int, num_steps: int, events_per_worker: int) -> None:
    from workers.progress import ProgressReporter
    from workers.protocol.keys import (
        TltField,
        TotalsField,
        job_steps_key,
        job_tlt_key,
        job_totals_key,
    )
    from workers.protocol.messages import ProgressRecord
    from workers.protocol.states import WorkerState

    now = time.time()
    states = [WorkerState.ROLLING_OUT, WorkerState.IDLE, WorkerState.TRAINING, WorkerState.IDLE]
    for w in range(num_workers):
        wid = f"w{w}"
        reporter = ProgressReporter(redis, job_id, wid, ttl_s=3600)
        for e in range(events_per_worker):  # each report is a state change: one event each
            reporter.report(ProgressRecord(job_id, wid, states[e % len(states)], 4, 4, 8, 512, 300.0, 1.7, 3, 5,
                                           e // len(states), now), force=True)
    step = {"rl_step": 0, "policy_version": 1, "idle_worker_s": 3.0, "mean_reward": 0.5, "num_rollouts": 64,
            "failures": [], "num_tokens": 30_000, "mean_accepted_length": 1.8,
            "timings": {"weight_sync": 1.0, "rollout": 30.0, "reward": 0.1, "logprob": 5.0, "update": 10.0},
            "worker_rollout_s": {f"w{w}": 28.0 for w in range(num_workers)},
            "draft_versions": {f"w{w}": 3 for w in range(num_workers)}}
    # as the watcher leaves them every tick: its class for each worker, and the reclaimed time
    redis.hset(job_tlt_key(job_id), mapping={TltField.RECLAIMED_WORKER_S: 12.5, TltField.CLASSES: json.dumps(
        {f"w{w}": ["ROLLING_OUT", "STRAGGLER", "IDLE", "TRAINING"][w % 4] for w in range(num_workers)})})
    for s in range(num_steps):  # as the driver writes them: the record and the running totals
        redis.rpush(job_steps_key(job_id), json.dumps(step | {"rl_step": s}))
        redis.hincrbyfloat(job_totals_key(job_id), TotalsField.IDLE_WORKER_S, step["idle_worker_s"])


SERVER = """
import sys, uvicorn
from scheduler.app import Settings, create_app
app = create_app(Settings(redis_url=sys.argv[1], store_dir=sys.argv[2], start_ray=False, watch=False))
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[3]), log_level="warning")
"""


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (Linux)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def bench_observability(num_workers: int = 256, num_steps: int = 50, events_per_worker: int = 40,
                        repeats: int = 50) -> dict:
    """CPU of the scheduler process (a subprocess, measured from /proc) per scrape and per status-page
    refresh, with a job of `num_workers` live workers in Redis."""
    from scheduler.jobs import JobStore
    from scheduler.policy import CLASSES
    from workers.protocol.states import JobState
    from workers.redis_server import PrivateRedis, free_port
    from workers.spec import JobSpec

    with PrivateRedis() as server:
        store = JobStore(server.client())
        job_id = store.create(JobSpec(model="tiny", num_workers=num_workers))[0]["job_id"]
        store.transition(job_id, JobState.RUNNING, {JobState.PENDING})
        log(f"populating: {num_workers} workers, {num_steps} steps, {events_per_worker} events per worker")
        _populate(server.client(), job_id, num_workers, num_steps, events_per_worker)
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-c", SERVER, server.url, tempfile.mkdtemp(prefix="tlt-bench-"),
                                 str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    fetch(f"{base}/healthz")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the scheduler did not start") from None
                    time.sleep(0.2)
            workers = json.loads(fetch(f"{base}/v1/jobs/{job_id}/workers"))
            metrics = fetch(f"{base}/metrics").decode()
            events = json.loads(fetch(f"{base}/v1/jobs/{job_id}/events"))
            assert len(workers) == num_workers, f"expected {num_workers} live workers, got {len(workers)}"
            assert metrics.count("tlt_worker_tokens_per_second{") == num_workers
            assert metrics.count('tlt_worker_class{') == len(CLASSES) * num_workers
            # what one open page fetches once it has the history (new events and steps only)
            job = f"/v1/jobs/{job_id}"
            fast = [f"{job}/events?after={events[-1]['id']}", f"{job}/workers"]
            slow = ["/v1/jobs?limit=50", job, f"{job}/steps?start={num_steps}", f"{job}/drafts"]
            runs = {"idle": [], "scrape": [], "refresh": [], "slow_refresh": [], "first_load": []}
            for _ in range(repeats):
                for name, paths in (("scrape", ["/metrics"]), ("refresh", fast), ("slow_refresh", slow),
                                    ("first_load", [f"/v1/jobs/{job_id}/events"])):
                    before = cpu_seconds(proc.pid)
                    for path in paths:
                        fetch(base + path)
                    runs[name].append(cpu_seconds(proc.pid) - before)
                before = cpu_seconds(proc.pid)
                time.sleep(0.2)  # the server at rest, for scale
                runs["idle"].append((cpu_seconds(proc.pid) - before) / 0.2)
        finally:
            proc.terminate()
            proc.wait(30)
    # /proc counts in clock ticks (10 ms): means over the repeats, not medians
    scrape_s, refresh_s, slow_s, first_s = (statistics.mean(runs[k])
                                            for k in ("scrape", "refresh", "slow_refresh", "first_load"))
    refresh_every_s, slow_every = page_cadence()
    overhead = scrape_s / SCRAPE_INTERVAL_S + (refresh_s + slow_s / slow_every) / refresh_every_s
    result = {"num_workers": num_workers, "num_steps": num_steps, "events_per_worker": events_per_worker,
              "metrics_bytes": len(metrics), "scrape_cpu_s": round(scrape_s, 5),
              "page_refresh_cpu_s": round(refresh_s, 5), "page_slow_refresh_cpu_s": round(slow_s, 5),
              "page_first_load_events_cpu_s": round(first_s, 5),
              "idle_core_fraction": round(statistics.mean(runs["idle"]), 5),
              "scrape_interval_s": SCRAPE_INTERVAL_S, "page_refresh_s": refresh_every_s,
              "page_slow_every": slow_every, "overhead_core_fraction": round(overhead, 5)}
    log(f"scrape {scrape_s * 1e3:.1f} ms CPU, page refresh {refresh_s * 1e3:.1f} ms CPU every {refresh_every_s:g} s "
        f"+ {slow_s * 1e3:.1f} ms every {refresh_every_s * slow_every:g} s (first load of the event history "
        f"{first_s * 1e3:.0f} ms) -> {overhead:.2%} of a core")
    return result


def add_arguments(p) -> None:
    p.add_argument("--workers", type=int, default=256)
    p.add_argument("--steps", type=int, default=50, help="step records of the job")
    p.add_argument("--events", type=int, default=40, help="state transitions per worker")
    p.add_argument("--repeats", type=int, default=20)


def run(args) -> dict:
    return bench_observability(num_workers=args.workers, num_steps=args.steps, events_per_worker=args.events,
                               repeats=args.repeats)
