"""`tlt bench faults`: the service under fuzzing, hostile input and faults, as counts with their evidence.

Real parts only: private redis-servers, a local Ray (2 CPUs, 2 logical GPUs) and the scheduler's app under
uvicorn on loopback (scheduler.demo.start_server), with an API token.
(1) fuzz: schemathesis against the live OpenAPI schema (/openapi.json), positive and negative cases of every
    operation, with the token. First on a scheduler started before Ray (the jobs it creates fail at once,
    cheaply), then the job-detail reads on a real running job whose workers report (the `/workers` route once
    answered a body its schema did not describe). Counted: 5xx answers, and answers that do not conform to
    the schema (status code, content type, headers, body).
(2) hostile inputs (bench/faults_live.py): each must be refused and create no job; every answer, the failed
    jobs' errors, /ui and /metrics are scanned for tracebacks and server paths. Two jobs fail for real.
(3) Redis killed mid-job and revived (append-only file, as deploy/ configures it): the job must finish, and
    its steps or progress must move again soon after Redis is back.
(4) a job's driver killed mid-step: it resumes from its policy checkpoint, losing at most checkpoint_every steps.
(5) 20 concurrent submits of one body with one Idempotency-Key: one job.
(6) budget, cursors, protocol (bench/faults_budget.py): oversized jobs refused, the largest accepted job's driver
    memory at its first step; crafted cursors, ranges and malformed framing never a 5xx.
(7) queue (bench/faults_queue.py): N + 3 one-GPU jobs on N GPUs: N run, 3 wait QUEUED without a driver, all finish
    in order. Leaks (bench/faults_service.py): every anonymous route and error scanned.
    A 25 s submit-and-cancel storm from 4 clients: jobs that started before one submitted earlier.
(8) liveness: /healthz with Redis hung; a real `tlt serve`: clients that never finish their headers, a body that stops
    short of its Content-Length, both framings, SIGTERM with clients polling (exit code, 5xx, processes left), to
    the scheduler alone, then (another one) to its whole process group, its private redis-server and Ray's included.
(9) restart (bench/faults_restart.py): one GPU, a job running and two queued, SIGTERM and a new scheduler on the
    same Redis: GPUs over-committed, seconds until the resumed job steps again; then SIGTERM to its process group.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from bench.faults_count import (
    AUTH,
    GOALS,
    LEAK_MARKERS,
    NUM_CLUSTER_GPUS,
    NUM_EXTRA_JOBS,
    TOKEN,
    collect_figures,
    goals_met,
    is_server_error,
    leak_markers,
    server_markers,
)

MAX_EVIDENCE = 8  # failing cases kept in the JSON per kind
NUM_SLOW_CLIENTS = 200  # connections that never finish their headers (the issue held 2,000 for 60 s)


def log(msg: str) -> None:
    print(f"[bench faults] {msg}", file=sys.stderr, flush=True)


# ----- (1) fuzz ----------------------------------------------------------------------------------------------------
class FuzzTally:
    """What the fuzzed answers showed, per operation, with the first failing cases as evidence."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self.by_operation: Counter = Counter()
        self.statuses: Counter = Counter()
        self.num_requests = self.num_server_errors = self.num_schema_violations = self.num_leaks = 0
        self.num_unsendable = 0  # cases the HTTP client refused to send (e.g. a header it cannot encode)
        self.max_worker_records = 0  # the most worker records one conforming /workers answer held
        self.evidence: dict[str, list] = {"server_errors": [], "schema_violations": [], "leaks": []}

    def keep(self, kind: str, row: dict) -> None:
        if len(self.evidence[kind]) < MAX_EVIDENCE:
            self.evidence[kind].append(row)

    def add(self, case, response, violation: str | None) -> None:
        label = f"{case.method.upper()} {case.operation.path}"
        self.num_requests += 1
        self.by_operation[label] += 1
        self.statuses[str(response.status_code)] += 1
        row = {"operation": label, "path": case.formatted_path, "status": response.status_code}
        if is_server_error(case.method, case.operation.path, response.status_code):
            self.num_server_errors += 1
            self.keep("server_errors", row | {"body": response.text[:300]})
        if violation is not None:
            self.num_schema_violations += 1
            self.keep("schema_violations", row | {"failure": violation[:500]})
        if found := leak_markers(response.text, self.markers):
            self.num_leaks += 1
            self.keep("leaks", row | {"markers": found})
        if violation is None and response.status_code == 200 and case.operation.path.endswith("/workers"):
            self.max_worker_records = max(self.max_worker_records, len(response.json()))

    def to_dict(self) -> dict:
        return {"num_requests": self.num_requests, "num_server_errors": self.num_server_errors,
                "num_schema_violations": self.num_schema_violations, "num_leaks": self.num_leaks,
                "num_unsendable": self.num_unsendable, "max_worker_records": self.max_worker_records,
                "by_operation": dict(self.by_operation), "statuses": dict(self.statuses), "evidence": self.evidence}


def fuzz(base_url: str, num_requests: int, tally: FuzzTally, *, job_id: str | None = None, seed: int = 0,
         max_seconds: float = 150.0) -> None:
    """Schemathesis cases (positive and negative) of every operation of the live schema, sent with the token,
    until `num_requests` were answered or `max_seconds` passed. With `job_id`: only the GET routes of that job.
    Excluded checks, as in tests/scheduler/test_schema_fuzz.py: positive_data_acceptance (a JobSpec's
    cross-field rules are not in the JSON schema), negative_data_rejection (undeclared query parameters and
    headers are ignored), allow_header_conformance (Starlette's 405 names one route's methods)."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as fixed_seed
    from hypothesis import strategies as st
    from schemathesis.core.failures import Failure, FailureGroup
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    conformance = [status_code_conformance, content_type_conformance, response_headers_conformance,
                   response_schema_conformance]
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", headers=AUTH)
    ops = [r.ok() for r in schema.get_all_operations()]
    if job_id is not None:
        ops = [op for op in ops if op.method == "get" and "{job_id}" in op.path]
    path_parameters = {"job_id": job_id} if job_id is not None else None
    session, deadline, target = requests.Session(), time.monotonic() + max_seconds, tally.num_requests + num_requests

    def send(case) -> None:
        if time.monotonic() > deadline or tally.num_requests >= target:
            return
        try:
            response = case.call(base_url=base_url, headers=AUTH, session=session, timeout=30)
        except (requests.exceptions.InvalidHeader, UnicodeEncodeError, ValueError):
            tally.num_unsendable += 1
            return
        violation = None
        try:
            case.validate_response(response, checks=conformance, headers=AUTH)
        except FailureGroup as exc:
            violation = "; ".join(f"{f.title}: {f.message}" for f in exc.exceptions)
        except Failure as exc:
            violation = f"{exc.title}: {exc.message}"
        tally.add(case, response, violation)

    for round_no in range(10):  # rounds with new seeds until enough: small operations run out of new cases
        remaining = target - tally.num_requests
        if remaining <= 0 or time.monotonic() > deadline:
            break
        for op in ops:
            cases = st.one_of(*(op.as_strategy(generation_mode=mode, path_parameters=path_parameters)
                                for mode in schemathesis.GenerationMode))

            def run_case(case) -> None:  # a new function for each `given`
                send(case)

            run = given(case=cases)(run_case)
            run = settings(max_examples=math.ceil(remaining / len(ops)), deadline=None, database=None,
                           phases=[Phase.generate], suppress_health_check=list(HealthCheck))(run)
            fixed_seed(seed * 1000 + round_no)(run)()


def fuzz_without_ray(num_requests: int, markers: tuple[str, ...], work_dir: Path) -> FuzzTally:
    """Part (1a): every operation on a scheduler started before Ray, with its own Redis."""
    from scheduler.app import Settings
    from scheduler.demo import start_server
    from workers.redis_server import PrivateRedis

    tally = FuzzTally(markers)
    with PrivateRedis() as redis_server:
        settings = Settings(redis_url=redis_server.url, api_token=TOKEN, store_dir=str(work_dir / "fuzz-drafts"),
                            model_roots=(str(work_dir / "models"),), data_roots=(str(work_dir / "data"),),
                            start_ray=False, watch=False)
        url, server = start_server(settings)
        try:
            fuzz(url, num_requests, tally)
        finally:
            server.should_exit = True
            server.thread.join(30)
    return tally


def bench_faults(num_requests: int = 1200) -> dict:
    """Every part."""
    import httpx
    import ray

    from bench import faults_budget, faults_service
    from bench import faults_live as live
    from bench.faults_queue import queue_case, storm
    from bench.faults_restart import restart_with_queue
    from bench.faults_sockets import slow_clients, smuggling, stalled_body
    from scheduler.app import Settings
    from scheduler.demo import start_server
    from scheduler.serve import HEADER_TIMEOUT_S
    from workers.protocol.keys import RAY_NAMESPACE
    from workers.redis_server import PrivateRedis

    t0 = time.perf_counter()
    markers, work_dir = server_markers(), Path(tempfile.mkdtemp(prefix="tlt-bench-faults-"))
    for sub in ("models", "data"):
        (work_dir / sub).mkdir()
    result: dict = {"bench": "faults", "config": {"num_requests": num_requests, "num_cluster_gpus": NUM_CLUSTER_GPUS,
                                                   "leak_markers": list(LEAK_MARKERS) + ["<checkout>", "<sys.prefix>"],
                                                   **live.CONFIG}}
    with contextlib.redirect_stdout(sys.stderr):  # progress on stderr; the JSON object alone on stdout
        log(f"(1a) fuzz: {num_requests} schemathesis requests, scheduler without Ray")
        tally = fuzz_without_ray(num_requests, markers, work_dir)
        log(f"     {tally.num_requests} requests, {tally.num_server_errors} server errors, "
            f"{tally.num_schema_violations} schema violations")
        ray.init(num_cpus=2, num_gpus=NUM_CLUSTER_GPUS, namespace=RAY_NAMESPACE, include_dashboard=False,
                 log_to_driver=False, ignore_reinit_error=True)
        try:
            with PrivateRedis(persistent=True) as redis_server:
                settings = Settings(redis_url=redis_server.url, api_token=TOKEN, store_dir=str(work_dir / "drafts"),
                                    model_roots=(str(work_dir / "models"),), data_roots=(str(work_dir / "data"),),
                                    start_ray=False, watch_tick_s=0.25)
                url, server = start_server(settings)
                try:
                    ctx = live.Live(url, redis_server, work_dir, markers)
                    log("(2) hostile inputs and jobs that fail for real")
                    result["hostile"] = live.hostile(ctx)
                    log("(5) idempotency: 20 concurrent submits; (1b) fuzz of the running job's reads")
                    result["idempotency"] = live.idempotency(ctx, lambda job_id: fuzz(url, 150, tally, job_id=job_id,
                                                                                     seed=1, max_seconds=60))
                    log("(3) Redis killed and revived mid-job")
                    result["redis_outage"] = live.redis_outage(ctx)
                    log("(4) driver killed mid-step")
                    result["driver_kill"] = live.driver_kill(ctx)
                    log("(6) budget, cursors, protocol")
                    result["budget"] = faults_budget.budget(ctx)
                    some_job = ctx.get("/v1/jobs?limit=1")[0]["job_id"]
                    result["cursors"] = faults_budget.cursors(ctx, some_job)
                    result["protocol"] = faults_budget.protocol(url)
                    log(f"(7) queue: {NUM_CLUSTER_GPUS} GPUs, {NUM_CLUSTER_GPUS + NUM_EXTRA_JOBS} one-GPU jobs; leaks")
                    with httpx.Client(base_url=url, timeout=60) as client:
                        result["queue"] = queue_case(client, AUTH, NUM_CLUSTER_GPUS)
                        log("    a 25 s submit-and-cancel storm from 4 clients")
                        result["storm"] = storm(url, AUTH)
                        redis_port = redis_server.url.rsplit(":", 1)[1].split("/")[0]
                        result["leaks"] = faults_service.anonymous_leaks(
                            client, some_job, TOKEN, (*markers, str(work_dir), f"127.0.0.1:{redis_port}"))
                    result["sweep"] = live.sweep(ctx)
                finally:
                    server.should_exit = True
                    server.thread.join(30)
        finally:
            ray.shutdown()
        try:
            log("(8) liveness with Redis hung; a real tlt serve: slow clients, a stalled body, both framings, SIGTERM")
            result["liveness"] = faults_service.healthz_with_redis_hung(str(work_dir / "liveness"))
            (work_dir / "serve").mkdir()
            with faults_service.served(work_dir / "serve") as (proc, port, serve_url, _):
                result["slow_clients"] = slow_clients(port, NUM_SLOW_CLIENTS, HEADER_TIMEOUT_S + 3)
                result["stalled_body"] = stalled_body(port)
                result["smuggling"] = smuggling(port)
                result["shutdown"] = faults_service.sigterm(proc, serve_url)
            with faults_service.served(work_dir / "serve") as (proc, _, serve_url, _):  # its Redis in the group too
                result["shutdown_group"] = faults_service.sigterm(proc, serve_url, is_group=True)
            log("(9) a restart with a queue on one GPU, then SIGTERM to the process group")
            (work_dir / "restart").mkdir()
            with PrivateRedis() as redis_server:
                result["restart"] = restart_with_queue(work_dir / "restart", redis_server.url)
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
    result["fuzz"] = tally.to_dict()
    figures = collect_figures(result)
    result.update(figures)
    result["goals"] = GOALS
    result["met"] = goals_met(figures, live.CONFIG["checkpoint_every"])
    result["seconds"] = time.perf_counter() - t0
    log(f"{json.dumps(figures)} in {result['seconds']:.0f} s")
    return result


def add_arguments(p) -> None:
    p.add_argument("--requests", type=int, default=1200, help="schemathesis requests on the scheduler without Ray")


def run(args) -> dict:
    return bench_faults(num_requests=args.requests)
