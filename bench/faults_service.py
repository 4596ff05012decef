"""The service cases of `tlt bench faults`, each a probe that counts; the tests run the same probes and assert on
the counts (tests/scheduler/test_serve.py, test_anonymous.py, test_liveness.py):

- leaks: every route a client reaches without the token, and every error, scanned for paths, addresses,
  tracebacks, the token and echoes of what was sent (`anonymous_leaks`);
- liveness: /healthz latency while Redis hangs (SIGSTOP) and Redis-bound requests fill the thread pool;
- a real `tlt serve` subprocess (`served`, its own process group), and SIGTERM (or SIGINT) to it, or to its
  whole process group, with a job RUNNING mid-run and clients polling it (exit code, seconds to exit, 5xx,
  processes left: redis-server, Ray's servers, its workers and the driver). Its raw-socket probes (slow headers
  and bodies, both framings) are in bench/faults_sockets.py, the restart with a queue in bench/faults_restart.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ECHO = "EchoMarker7"  # sent in paths, queries, headers and bodies: never in an answer
SERVE_START_S = 180.0  # Ray's start on a loaded 2-core box
NUM_HUNG = 60  # Redis-bound requests held on a hung Redis: more than the thread pool's 40 workers
# a job still running when the signal comes: the run had one at step 100 (tiny model: a step is seconds)
SIGNAL_SPEC = {"model": "tiny", "num_prompts_per_step": 2, "group_size": 2, "max_new_tokens": 24, "num_workers": 1,
               "num_steps": 1000, "checkpoint_every": 1}
JOB_START_S = 120.0  # the driver loads torch and the model, its worker too, on a loaded 2-core box
MAX_EXIT_S = 60.0  # signal to exit: requests in flight (serve.GRACEFUL_SHUTDOWN_S at most) and Ray's shutdown


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# ----- leaks --------------------------------------------------------------------------------------------------------
def anonymous_requests(job_id: str, token: str) -> Iterator[tuple[str, str, dict]]:
    """(method, path, httpx keyword arguments): the open routes, unknown ones, every job route without the token
    and with a wrong one, unknown job ids with the token, and bad input of every kind with it."""
    from scheduler.routes.jobs import router as jobs_router

    yield "GET", "/healthz", {}
    yield "GET", "/readyz", {}
    yield "GET", "/metrics", {}
    yield "GET", "/ui/", {}
    yield "GET", "/openapi.json", {}
    yield "GET", f"/{ECHO}", {}
    yield "GET", f"/ui/{ECHO}", {}
    yield "DELETE", "/healthz", {}
    auth = {"Authorization": f"Bearer {token}"}
    for route in jobs_router.routes:  # every job route, without a token and with a wrong one
        for method in route.methods:
            path = route.path.replace("{job_id}", job_id)
            yield method, path, {}
            yield method, path, {"headers": {"Authorization": f"Bearer {ECHO}"}}
            if "{job_id}" in route.path:  # an id that is no job's: a 404 that does not echo it
                yield method, path.replace(job_id, ECHO), {"headers": auth}
    yield "POST", "/v1/jobs", {"headers": auth, "json": {"model": f"/{ECHO}/x"}}
    yield "POST", "/v1/jobs", {"headers": auth, "json": {ECHO: 1}}
    yield "POST", "/v1/jobs", {"headers": auth | {"Idempotency-Key": ECHO + "/!"}, "json": {}}
    yield "POST", "/v1/jobs", {"headers": auth | {"Content-Type": "application/json"}, "content": "{" + ECHO}
    yield "GET", f"/v1/jobs/{job_id}/events?after={ECHO}", {"headers": auth}
    yield "GET", f"/v1/jobs/{job_id}/steps?start={ECHO}", {"headers": auth}


def anonymous_leaks(client: httpx.Client, job_id: str, token: str, secrets: tuple[str, ...]) -> dict:
    """Every anonymous request's answer scanned for `secrets` (the server's paths and addresses), tracebacks, the
    token and ECHO; a 500, 502 or 504 counts as a server error (503 is readyz's documented answer)."""
    markers = (*secrets, "Traceback", 'File "', ECHO, token)
    rows, num_requests, num_server_errors = [], 0, 0
    for method, path, kwargs in anonymous_requests(job_id, token):
        r = client.request(method, path, **kwargs)
        num_requests += 1
        num_server_errors += r.status_code in (500, 502, 504)
        if found := [m for m in markers if m and m in r.text]:
            rows.append({"request": f"{method} {path}", "status": r.status_code, "markers": found})
    return {"num_requests": num_requests, "anonymous_leaks": len(rows), "server_errors": num_server_errors,
            "evidence": rows[:8]}


# ----- liveness -----------------------------------------------------------------------------------------------------
def healthz_with_redis_hung(store_dir: str, num_probes: int = 50) -> dict:
    """A scheduler under uvicorn on its own redis-server; the Redis is SIGSTOPped and NUM_HUNG requests wait on it;
    then /healthz is timed `num_probes` times. p99 in seconds."""
    from scheduler.app import Settings
    from scheduler.demo import start_server
    from workers.redis_server import PrivateRedis

    with PrivateRedis() as redis:
        url, server = start_server(Settings(redis_url=redis.url, store_dir=store_dir, start_ray=False, watch=False))
        os.kill(redis.proc.pid, signal.SIGSTOP)
        hung = [threading.Thread(target=lambda: httpx.get(f"{url}/v1/jobs", timeout=60), daemon=True)
                for _ in range(NUM_HUNG)]
        latencies, statuses = [], []
        try:
            for t in hung:
                t.start()
            time.sleep(1.0)  # every pool thread now waits on Redis
            with httpx.Client(base_url=url, timeout=5) as client:
                for _ in range(num_probes):
                    t0 = time.perf_counter()
                    try:
                        statuses.append(client.get("/healthz").status_code)
                    except httpx.TimeoutException:
                        statuses.append(None)
                    latencies.append(time.perf_counter() - t0)
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        for t in hung:
            t.join(timeout=60)
        server.should_exit = True
        server.thread.join(timeout=30)
    return {"healthz_p99_s_with_redis_hung": p99(latencies), "max_s": max(latencies),
            "num_ok": statuses.count(200), "num_probes": num_probes}


# ----- a real `tlt serve` -------------------------------------------------------------------------------------------
@contextmanager
def served(work_dir: Path, gpus: int = 1, redis_url: str | None = None
           ) -> Iterator[tuple[subprocess.Popen, int, str, object]]:
    """`tlt serve` on a free loopback port with its private Ray, and its private redis-server unless `redis_url`
    is given: (process, port, url, log file). Killed at the end if still running."""
    from workers.redis_server import free_port

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS", "TLT_API_TOKEN")}
    env |= {"REDIS_URL": redis_url} if redis_url else {}
    log = open(work_dir / "serve.log", "a+")  # noqa: SIM115 - closed below; a restart's lines follow
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--gpus", str(gpus), "--store-dir", str(work_dir / "drafts")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            log.seek(0)
            raise RuntimeError(f"tlt serve did not become ready: {log.read()[-3000:]}")
        yield proc, port, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()


def running_job(url: str, spec: dict = SIGNAL_SPEC, min_steps: int = 1, timeout_s: float = JOB_START_S) -> dict:
    """Submit `spec` and wait until the job is RUNNING with `min_steps` steps finished: its record."""
    r = httpx.post(f"{url}/v1/jobs", json=spec, timeout=30)
    if r.status_code != 201:
        raise RuntimeError(f"POST /v1/jobs: {r.status_code} {r.text[:300]}")
    return job_with_steps(url, r.json()["job_id"], min_steps, timeout_s)


def read_job(client: httpx.Client, job_id: str) -> dict:
    """GET the job's record; RuntimeError with the answer if it is not a 200."""
    r = client.get(f"/v1/jobs/{job_id}")
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/jobs/{job_id}: {r.status_code} {r.headers.get('content-type')} {r.text[:300]}")
    return r.json()


def job_with_steps(url: str, job_id: str, min_steps: int, timeout_s: float = JOB_START_S) -> dict:
    """The job's record once it is RUNNING with `min_steps` steps finished; RuntimeError if it ends first, or
    has not got there in `timeout_s`."""
    from workers.protocol.states import JobState

    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() < deadline:
            job = read_job(client, job_id)
            if job["state"] not in (JobState.QUEUED, JobState.RUNNING):
                raise RuntimeError(f"job {job_id} ended before the signal: {job}")
            if job["state"] == JobState.RUNNING and job["steps"] >= min_steps:
                return job
            time.sleep(0.5)
    raise RuntimeError(f"job {job_id} did not finish {min_steps} steps in {timeout_s:.0f} s: {job}")


def sigterm(proc: subprocess.Popen, url: str, sig: signal.Signals = signal.SIGTERM, job: dict | None = None,
            num_pollers: int = 4, before_s: float = 2.0, is_group: bool = False) -> dict:
    """`sig` while a job runs mid-run (SIGNAL_SPEC's, started here unless `job` is given) and `num_pollers`
    clients poll its record, its steps and the job list: the exit code, the seconds to exit, the 5xx answers,
    and the processes the server started (every descendant alive at the signal: redis-server, gcs_server,
    raylet, Ray's workers, the job's driver and rollout worker) still alive 10 s after it exited."""
    import psutil

    job = job or running_job(url)
    paths = ["/v1/jobs", f"/v1/jobs/{job['job_id']}", f"/v1/jobs/{job['job_id']}/steps"]
    statuses: list[int] = []
    stop = threading.Event()

    def poll(first: int) -> None:
        with httpx.Client(base_url=url, timeout=10) as client:
            for i in range(first, 1 << 30):
                if stop.is_set():
                    return
                try:
                    statuses.append(client.get(paths[i % len(paths)]).status_code)
                except httpx.TransportError:  # refused once it stopped listening: the client retries elsewhere
                    time.sleep(0.05)

    pollers = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(num_pollers)]
    for t in pollers:
        t.start()
    time.sleep(before_s)
    with httpx.Client(base_url=url, timeout=30) as client:
        steps_at_signal = read_job(client, job["job_id"])["steps"]
    tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)  # at the signal
    names = sorted({p.name() for p in tree[1:]})
    t0 = time.monotonic()
    if is_group:  # to every process of its group, as systemd and `docker stop` do (`served` starts it as a leader)
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    try:
        code = proc.wait(timeout=MAX_EXIT_S)
    except subprocess.TimeoutExpired:
        code = None  # counted as a failure; `served` kills it
    exit_s = time.monotonic() - t0
    stop.set()
    for t in pollers:
        t.join(timeout=15)

    def alive() -> list[str]:
        left = []
        for p in tree[1:]:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(" ".join(p.cmdline())[:80])
            except psutil.NoSuchProcess:
                pass
        return left

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive():
        time.sleep(0.2)
    left = alive()
    return {"signal": signal.Signals(sig).name, "sigterm_exit_code": code, "exit_s": round(exit_s, 2),
            "sigterm_5xx": sum(s >= 500 for s in statuses), "num_requests": len(statuses),
            "processes_left_after_exit": len(left), "left": left, "num_processes": len(tree),
            "process_names": names, "job_id": job["job_id"], "steps_at_signal": steps_at_signal}
