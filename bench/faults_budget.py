"""The budget and input cases of `tlt bench faults`, against a live scheduler on a local Ray (bench/faults.py):

- budget: oversized jobs (the issue's, and one over each limit of scheduler.budget.JobBudget) must all be refused;
  the largest job the default budget accepts is started, and its driver's resident memory measured when it begins
  its first step (its first phase record: step 0's prompts drawn, the model and workers up), then cancelled;
- cursors: crafted `after` and `start` values on a job's events and steps: each a 4xx or an answer, never a 5xx;
- protocol: malformed framing on raw sockets (bad Content-Length, both framings, a bad chunk, a huge header):
  never a 5xx.
"""

from __future__ import annotations

import json
import os
import socket
import time

import ray

from bench.faults_count import is_accepted
from bench.faults_sockets import SMUGGLED
from workers.protocol.keys import RAY_NAMESPACE, driver_actor_name, job_phase_key

TINY = {"model": "tiny", "num_workers": 1, "tlt": False}
OVERSIZED = {  # each over one limit of the default JobBudget; every field within its own bound
    "issue_34": {"model": "tiny", "num_steps": 100000, "num_prompts_per_step": 65536, "group_size": 256,
                 "max_new_tokens": 131072, "micro_batch_size": 4096},
    "tokens_per_step": TINY | {"num_prompts_per_step": 65536, "group_size": 16, "max_new_tokens": 128},
    "tokens_per_job": TINY | {"num_steps": 100000, "num_prompts_per_step": 4096, "group_size": 16,
                              "max_new_tokens": 1024},
    "step_memory": {"model": "smollm2-135m", "num_workers": 1, "num_prompts_per_step": 512, "group_size": 16,
                    "max_new_tokens": 8192, "micro_batch_size": 4096},
}
# the most prompts a step may hold (JobSpec's bound) at the budget's max_tokens_per_step (2**16 x 2 x 2**9 = 2**26),
# and the most steps max_tokens_per_job then allows: what once built 52 MB/s of prompts before its first step
LARGEST = TINY | {"num_steps": 14_901, "num_prompts_per_step": 65_536, "group_size": 2, "max_new_tokens": 512}
CURSORS = ["18446744073709551615-18446744073709551615", "18446744073709551616-0", "-1", "0-", "1-2-3", "+",
           "99999999999999999999999", "0-18446744073709551616", "%00", "1e9", "$"]
STARTS = ["-1", "4611686018427387905", "18446744073709551615", "1.5", "x", "", "0x10"]
LIMITS = ["0", "-1", "100000000000000000000", "nan", "1e3"]
RAW_REQUESTS = {
    "bad_content_length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    "negative_content_length": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}",
    "both_framings": SMUGGLED,
    "bad_chunk": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "huge_header": b"GET /v1/jobs HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
    "short_body": b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{}",
    "not_http": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64,
}


def driver_rss_bytes(job_id: str) -> int:
    """The resident memory of the job's driver process (asked of the actor itself)."""
    import psutil

    driver = ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE)
    pid = ray.get(driver.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
    return psutil.Process(pid).memory_info().rss


def budget(ctx) -> dict:
    """Oversized jobs refused (counted when accepted); the largest accepted job's driver memory at its first step."""
    from scheduler.budget import JobBudget, budget_errors
    from workers.spec import JobSpec

    refused = {}
    for name, spec in OVERSIZED.items():
        before = ctx.num_jobs()
        status, text = ctx.call("POST", "/v1/jobs", json.dumps(spec).encode())
        refused[name] = {"status": status, "created": ctx.num_jobs() - before,
                         "over_budget": "over_budget" in text}
    accepted = [n for n, r in refused.items() if is_accepted(r["status"], r["created"])]
    errors = budget_errors(JobSpec.model_validate(LARGEST), JobBudget())
    job_id = ctx.submit(LARGEST)
    t0 = time.monotonic()
    ctx.until(lambda: ctx.probe.get(job_phase_key(job_id)), 300, "the largest job's first phase", poll_s=0.05)
    rss = driver_rss_bytes(job_id)
    first_step_s = time.monotonic() - t0
    ctx.call("POST", f"/v1/jobs/{job_id}/cancel")
    ctx.wait_end(job_id, 120)
    return {"oversized": refused, "oversized_jobs_accepted": len(accepted), "accepted": accepted,
            "largest_spec": LARGEST, "largest_budget_errors": [msg for _, msg in errors],
            "driver_rss_mb_before_first_step": round(rss / 2**20, 1), "seconds_to_first_step": round(first_step_s, 1)}


def cursors(ctx, job_id: str) -> dict:
    """Crafted cursors and ranges on a job's events and steps, and crafted page sizes: 5xx answers counted."""
    paths = [f"/v1/jobs/{job_id}/events?after={c}" for c in CURSORS]
    paths += [f"/v1/jobs/{job_id}/steps?start={s}" for s in STARTS]
    paths += [f"/v1/jobs/{job_id}/{what}?limit={n}" for what in ("events", "steps") for n in LIMITS]
    paths += [f"/v1/jobs?limit={n}" for n in LIMITS]
    statuses = {path: ctx.call("GET", path)[0] for path in paths}
    bad = {p: s for p, s in statuses.items() if s is None or s >= 500}
    return {"num_requests": len(paths), "server_errors": len(bad), "evidence": dict(list(bad.items())[:8])}


def protocol(url: str) -> dict:
    """Malformed requests on raw sockets: the first status line of each answer; a 5xx is counted (a connection
    closed without an answer is not: that is how a server refuses what it cannot frame)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    statuses = {}
    for name, raw in RAW_REQUESTS.items():
        with socket.create_connection((host, int(port)), timeout=15) as s:
            try:
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                got = s.recv(200)
            except OSError:
                got = b""
        statuses[name] = int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else None
    return {"statuses": statuses, "server_errors": sum(s is not None and s >= 500 for s in statuses.values())}

