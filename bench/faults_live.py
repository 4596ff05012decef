"""The live parts of `tlt bench faults` (bench/faults.py) against one running scheduler on a local Ray:
hostile inputs, Redis killed mid-job, a driver killed mid-step, concurrent submits with one Idempotency-Key,
and a last sweep of every answer a client can read."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.faults_count import AUTH, NUM_CLUSTER_GPUS, is_accepted, leak_markers, resumed_after_step, steps_lost
from bench.faults_count import duplicates as count_duplicates
from bench.faults_queue import wait_for
from workers.protocol.keys import RAY_NAMESPACE, driver_actor_name, job_phase_key, job_steps_key, jobs_index_key
from workers.protocol.messages import PhaseRecord
from workers.protocol.states import TERMINAL_JOB_STATES, Phase

CONFIG = {"outage_s": 3.0, "checkpoint_every": 2, "num_concurrent_submits": 20}
TINY = {"model": "tiny", "num_prompts_per_step": 2, "group_size": 2, "max_new_tokens": 24,
        "num_workers": NUM_CLUSTER_GPUS}
OUTAGE_SPEC = TINY | {"num_steps": 5}
KILL_SPEC = TINY | {"num_steps": 6, "checkpoint_every": CONFIG["checkpoint_every"]}
IDEMPOTENT_SPEC = TINY | {"num_steps": 500, "max_new_tokens": 16}  # runs until cancelled: the fuzzed reads' job
REFUSE, ANSWER = "refused", "answered"  # must be a 4xx and create nothing / may be answered (clamped), not a 5xx


@dataclass
class Live:
    url: str
    redis_server: object  # workers.redis_server.PrivateRedis (persistent)
    work_dir: Path
    markers: tuple[str, ...]
    session: requests.Session = field(default_factory=requests.Session)

    def __post_init__(self) -> None:
        self.probe = self.redis_server.client()

    def num_jobs(self) -> int:
        return self.probe.zcard(jobs_index_key())

    def call(self, method: str, path: str, body: bytes | object = None, headers: dict | None = None,
             auth: bool = True) -> tuple[int | None, str]:
        """(status, body text) of one request; status None when the server closed the connection mid-request."""
        h = (AUTH if auth else {}) | {"Content-Type": "application/json"} | (headers or {})
        try:
            r = self.session.request(method, self.url + path, data=body, headers=h, timeout=60)
        except requests.exceptions.ConnectionError as exc:
            return None, f"connection closed: {type(exc).__name__}"
        return r.status_code, r.text

    def get(self, path: str) -> dict | list | None:
        r = self.session.get(self.url + path, headers=AUTH, timeout=30)
        return r.json() if r.status_code == 200 else None

    def submit(self, spec: dict) -> str:
        r = self.session.post(self.url + "/v1/jobs", json=spec, headers=AUTH, timeout=30)
        if r.status_code != 201:
            raise RuntimeError(f"submit {spec}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()["job_id"]

    def until(self, condition, timeout_s: float, what: str, poll_s: float = 0.05):
        return wait_for(condition, timeout_s, what, poll_s)

    def wait_end(self, job_id: str, timeout_s: float = 240.0) -> dict:
        return self.until(lambda: (j := self.get(f"/v1/jobs/{job_id}")) and j["state"] in TERMINAL_JOB_STATES and j,
                          timeout_s, f"job {job_id} to end", poll_s=0.2)

    def phase(self, job_id: str) -> PhaseRecord | None:
        raw = self.probe.get(job_phase_key(job_id))
        return PhaseRecord.from_json(raw) if raw else None

    def mid_step(self, job_id: str, min_recorded: int) -> int:
        """Wait until at least `min_recorded` steps are recorded and the next one's rollout is under way."""
        def ready() -> int:
            n, p = self.probe.llen(job_steps_key(job_id)), self.phase(job_id)
            return n if n >= min_recorded and p is not None and p.phase == Phase.ROLLOUT and p.rl_step == n else 0

        return self.until(ready, 180, f"job {job_id} mid-step after {min_recorded} steps", poll_s=0.01)


def hostile_probes(work_dir: Path, job_id: str) -> list[tuple[str, str, str, object, dict, bool, str]]:
    """(name, method, path, body, headers, with the token, expectation) for each hostile request."""
    big = 2 << 20  # over the 1 MiB body limit
    data, models = work_dir / "data", work_dir / "models"
    bodies = {
        "lr Infinity": '{"lr": Infinity}', "temperature NaN": '{"temperature": NaN}',
        "drafter.lr NaN": '{"drafter": {"lr": NaN}}', "kl_coef Infinity": '{"kl_coef": Infinity}',
        "kl_coef 1e400": '{"kl_coef": 1e400}', "num_steps 1e400": '{"num_steps": 1e400}',
        "seed 10**40": f'{{"seed": {10**40}}}', "seed -1": '{"seed": -1}',
        "model traversal": '{"model": "../../../../etc/passwd"}', "model /etc/passwd": '{"model": "/etc/passwd"}',
        "model traversal from a root": f'{{"model": "{models}/../../../etc/passwd"}}',
        "warm_draft /etc/passwd": '{"warm_draft": "/etc/passwd"}',
        "dataset_path /etc/shadow": '{"task": "dataset", "dataset_path": "/etc/shadow"}',
        "dataset_path traversal from a root": f'{{"task": "dataset", "dataset_path": "{data}/../../../etc/passwd"}}',
        "model with an escaped NUL": '{"model": "/models/a\\u0000b"}', "raw NUL byte": '{"model": "a\x00b"}',
        "model lone surrogate": '{"model": "\\ud800"}',
        "dataset_path lone surrogate": '{"task": "dataset", "dataset_path": "\\udfff.jsonl"}',
        "num_workers above the cluster": f'{{"model": "tiny", "num_workers": {NUM_CLUSTER_GPUS + 62}}}',
        "num_gpus (no such field)": '{"model": "tiny", "num_gpus": 64}',
        "deeply nested list": "[" * 100_000 + "]" * 100_000,
        "deeply nested object": '{"a":' * 20_000 + "1" + "}" * 20_000,
        "malformed JSON": "{", "not UTF-8": b"\xff\xfe",
        "huge body (Content-Length)": b'{"model": "' + b"x" * big + b'"}',
    }
    probes = [(name, "POST", "/v1/jobs", body.encode() if isinstance(body, str) else body, {}, True, REFUSE)
              for name, body in bodies.items()]

    def chunks():  # no Content-Length: the limit is counted as the body arrives
        yield b'{"model": "'
        for _ in range(big // 65536):
            yield b"x" * 65536
        yield b'"}'

    probes.append(("huge body (chunked)", "POST", "/v1/jobs", chunks(), {}, True, REFUSE))
    valid = b'{"model": "tiny", "num_steps": 1}'
    probes += [("submit without a token", "POST", "/v1/jobs", valid, {}, False, REFUSE),
               ("submit with a wrong token", "POST", "/v1/jobs", valid, {"Authorization": "Bearer wrong"}, False,
                REFUSE),
               ("submit with an empty bearer", "POST", "/v1/jobs", valid, {"Authorization": "Bearer "}, False, REFUSE),
               ("cancel without a token", "POST", f"/v1/jobs/{job_id}/cancel", None, {}, False, REFUSE)]
    probes += [(f"read {p or 'job'} without a token", "GET", f"/v1/jobs/{job_id}{p}", None, {}, False, REFUSE)
               for p in ("", "/steps", "/events", "/workers", "/drafts")]
    probes.append(("list without a token", "GET", "/v1/jobs", None, {}, False, REFUSE))
    base = f"/v1/jobs/{job_id}"
    probes += [(f"query {q}", "GET", q, None, {}, True, REFUSE) for q in (
        f"{base}/steps?start={2 ** 63}", f"{base}/steps?start=-1", f"{base}/steps?start=1e400",
        f"{base}/events?after=99999999999999999999-0", f"{base}/events?after=..%2F..", f"{base}/steps?start=%00")]
    probes += [(f"query {q} (clamped)", "GET", q, None, {}, True, ANSWER) for q in (
        f"/v1/jobs?limit={10 ** 30}", "/v1/jobs?limit=-5", f"{base}/events?limit=-1", f"{base}/events?limit={2 ** 70}")]
    probes += [(f"id {i[:40]}", "GET", f"/v1/jobs/{i}", None, {}, True, REFUSE) for i in (
        "..%2F..%2Fetc%2Fpasswd", "..%2F..%2Fetc%2Fpasswd/steps", "%00", "%ED%A0%80", "%2e%2e", "a" * 5000)]
    probes.append(("cancel a traversal id", "POST", "/v1/jobs/..%2F..%2Fx/cancel", None, {}, True, REFUSE))
    return probes


def failing_jobs(ctx: Live) -> dict:
    """Two jobs that fail for real, inside the roots: a dataset that is not JSONL, a model file that is not a
    model. Their `error` must be one line naming what failed, with no traceback or server path."""
    (ctx.work_dir / "data" / "bad.jsonl").write_bytes(b"not json at all\n\x00\xff{\n")
    (ctx.work_dir / "models" / "broken.gguf").write_bytes(b"GGUF" + b"\x00\xff" * 512)
    specs = {"bad dataset": TINY | {"num_steps": 1, "task": "dataset",
                                    "dataset_path": str(ctx.work_dir / "data" / "bad.jsonl")},
             "bad model file": TINY | {"num_steps": 1, "model": str(ctx.work_dir / "models" / "broken.gguf")}}
    out = {}
    for name, spec in specs.items():
        job = ctx.wait_end(ctx.submit(spec), 180)
        error = job.get("error") or ""
        out[name] = {"job_id": job["job_id"], "state": job["state"], "error": error, "is_one_line": "\n" not in error,
                     "markers": leak_markers(error, ctx.markers)}
    return out


def hostile(ctx: Live) -> dict:
    failed = failing_jobs(ctx)
    rows, num_accepted, num_server_errors, num_leaks = [], 0, 0, 0
    probes = hostile_probes(ctx.work_dir, failed["bad dataset"]["job_id"])
    for name, method, path, body, headers, auth, expect in probes:
        before = ctx.num_jobs()
        status, text = ctx.call(method, path, body, headers, auth)
        created = ctx.num_jobs() - before
        accepted = expect == REFUSE and is_accepted(status, created)
        leaks = leak_markers(text, ctx.markers)
        num_accepted += accepted
        num_server_errors += status is not None and status >= 500
        num_leaks += bool(leaks)
        rows.append({"name": name, "method": method, "status": status, "expect": expect, "jobs_created": created,
                     "accepted": accepted, "markers": leaks, "answer": text[:160]})
    num_leaks += sum(bool(f["markers"]) or not f["is_one_line"] for f in failed.values())
    return {"num_probes": len(rows), "num_accepted": num_accepted, "num_server_errors": num_server_errors,
            "num_leaks": num_leaks, "statuses": dict(Counter(str(r["status"]) for r in rows)),
            "failing_jobs": failed, "probes": rows}


def idempotency(ctx: Live, fuzz_reads) -> dict:
    """20 threads submit one body with one Idempotency-Key at once; then, while that job runs and its workers
    report, `fuzz_reads(job_id)` fuzzes its reads; then it is cancelled."""
    n, key = CONFIG["num_concurrent_submits"], f"bench-faults-{uuid.uuid4().hex}"
    barrier, before = threading.Barrier(n), ctx.num_jobs()

    def submit(_: int) -> tuple[int, str | None]:
        barrier.wait(30)
        r = requests.post(ctx.url + "/v1/jobs", json=IDEMPOTENT_SPEC, headers=AUTH | {"Idempotency-Key": key},
                          timeout=60)
        return r.status_code, (r.json().get("job_id") if r.headers.get("content-type") == "application/json" else None)

    with ThreadPoolExecutor(n) as pool:
        answers = list(pool.map(submit, range(n)))
    num_created = ctx.num_jobs() - before
    ids = [j for _, j in answers if j]
    job_id = ids[0]
    replay = ctx.call("POST", "/v1/jobs", json.dumps(IDEMPOTENT_SPEC).encode(), {"Idempotency-Key": key})
    other = ctx.call("POST", "/v1/jobs", b'{"model": "tiny", "num_steps": 3}', {"Idempotency-Key": key})
    ctx.until(lambda: ctx.get(f"/v1/jobs/{job_id}/workers"), 180, "the job's workers reporting")
    t0 = time.monotonic()
    fuzz_reads(job_id)
    fuzz_s = time.monotonic() - t0
    cancel = ctx.call("POST", f"/v1/jobs/{job_id}/cancel")
    record = ctx.wait_end(job_id, 60)
    _driver_gone(job_id)
    return {"num_submits": n, "statuses": dict(Counter(str(s) for s, _ in answers)), "num_job_ids": len(set(ids)),
            "num_jobs_created": num_created, "duplicates": max(count_duplicates(ids), num_created - 1),
            "replay_status": replay[0], "replay_same_job": job_id in replay[1],
            "other_body_same_key_status": other[0], "reads_fuzzed_s": fuzz_s, "cancel_status": cancel[0],
            "state_after_cancel": record["state"]}


def _driver_gone(job_id: str, timeout_s: float = 60.0) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE)
        except ValueError:
            return
        time.sleep(0.2)


def redis_outage(ctx: Live) -> dict:
    job_id = ctx.submit(OUTAGE_SPEC)
    recorded = ctx.mid_step(job_id, 1)
    ctx.redis_server.kill()
    t_kill = time.monotonic()
    during = {"get_job": ctx.call("GET", f"/v1/jobs/{job_id}")[0],
              "submit": ctx.call("POST", "/v1/jobs", b'{"model": "tiny"}')[0], "readyz": ctx.call("GET", "/readyz")[0]}
    time.sleep(max(0.0, CONFIG["outage_s"] - (time.monotonic() - t_kill)))
    ctx.redis_server.revive()
    t_revive, wall_revive = time.monotonic(), time.time()
    ctx.probe = ctx.redis_server.client()
    api_s = recovery_s = recovered_by = None
    while time.monotonic() - t_revive < 120 and recovery_s is None:  # until the job moves again (REST only)
        job = ctx.get(f"/v1/jobs/{job_id}")
        if job is not None:
            api_s = api_s if api_s is not None else time.monotonic() - t_revive
            workers = ctx.get(f"/v1/jobs/{job_id}/workers") or []
            recovered_by = ("a step recorded" if job["steps"] > recorded else "ended" if job["state"] in
                            TERMINAL_JOB_STATES else "progress reported" if any(w["timestamp"] > wall_revive
                                                                                 for w in workers) else None)
            recovery_s = time.monotonic() - t_revive if recovered_by else None
        time.sleep(0.05)
    job = ctx.wait_end(job_id)
    steps = ctx.get(f"/v1/jobs/{job_id}/steps") or []
    rl_steps = [s["rl_step"] for s in steps]
    intact = job["state"] == "SUCCEEDED" and rl_steps == list(range(OUTAGE_SPEC["num_steps"]))
    per_step = OUTAGE_SPEC["num_prompts_per_step"] * OUTAGE_SPEC["group_size"]
    return {"job_id": job_id, "spec": OUTAGE_SPEC, "steps_at_kill": recorded, "outage_s": t_revive - t_kill,
            "statuses_during_outage": during, "api_recovery_s": api_s, "recovery_s": recovery_s,
            "recovered_by": recovered_by, "state": job["state"], "error": job.get("error"),
            "warning": job.get("warning"), "rl_steps": rl_steps, "jobs_lost": int(not intact),
            "rollouts_lost": sum(per_step - s["num_rollouts"] for s in steps),
            "step_failures": {s["rl_step"]: s["failures"] for s in steps if s["failures"]}}


def driver_kill(ctx: Live) -> dict:
    """Killed at the worst point: one finished step past its checkpoint, and the next step's rollout under way."""
    import ray

    every = CONFIG["checkpoint_every"]
    job_id = ctx.submit(KILL_SPEC)
    ctx.mid_step(job_id, every + 1)
    ray.kill(ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE))
    t_kill, wall_kill = time.monotonic(), time.time()
    recorded, phase = ctx.probe.llen(job_steps_key(job_id)), ctx.phase(job_id)
    is_mid_step = phase is not None and phase.phase != Phase.DONE and phase.rl_step == recorded
    resumed_s = None
    while (job := ctx.get(f"/v1/jobs/{job_id}")) is None or job["state"] not in TERMINAL_JOB_STATES:
        if resumed_s is None and (p := ctx.phase(job_id)) is not None and p.since > wall_kill:
            resumed_s = time.monotonic() - t_kill  # a new driver began a step
        if time.monotonic() - t_kill > 240:
            raise RuntimeError(f"job {job_id} did not end within 240 s of its driver's kill")
        time.sleep(0.05)
    steps = ctx.get(f"/v1/jobs/{job_id}/steps") or []
    checkpoint_step = resumed_after_step(job.get("warning"))
    lost = steps_lost(recorded, checkpoint_step, is_mid_step) if checkpoint_step is not None else None
    return {"job_id": job_id, "spec": KILL_SPEC, "steps_recorded_at_kill": recorded, "is_mid_step": is_mid_step,
            "resumed_after_step": checkpoint_step, "steps_lost": lost if job["state"] == "SUCCEEDED" else None,
            "resumed_s": resumed_s, "state": job["state"], "error": job.get("error"), "warning": job.get("warning"),
            "rl_steps": [s["rl_step"] for s in steps], "policy_versions": [s["policy_version"] for s in steps]}


def sweep(ctx: Live) -> dict:
    """Every answer a client can read at the end, with and without the token: the job list, each job and its
    details, the status page's files, /metrics. Answers holding a traceback or a server path are counted."""
    paths = ["/v1/jobs?limit=1000", "/ui/", "/ui/index.html", "/ui/app.js", "/metrics", "/healthz", "/readyz"]
    jobs = ctx.get("/v1/jobs?limit=1000") or []
    for job in jobs:
        paths += [f"/v1/jobs/{job['job_id']}{p}" for p in ("", "/steps", "/events", "/workers", "/drafts")]
    leaks, num_answers = [], 0
    for path in paths:
        for auth in (True, False):
            _, text = ctx.call("GET", path, auth=auth)
            num_answers += 1
            if found := leak_markers(text, ctx.markers):
                leaks.append({"path": path, "with_token": auth, "markers": found})
    errors = {j["job_id"]: j["error"] for j in jobs if j.get("error")}
    return {"num_answers": num_answers, "num_jobs": len(jobs), "num_leaks": len(leaks), "leaks": leaks[:8],
            "job_errors": errors}
