"""`tlt demo` / `make demo`: the whole system on the embedded defaults, on this machine's CPU.

A private redis-server, local Ray with 4 logical GPUs, and the scheduler's REST API on loopback.
Two RL jobs on SmolLM2-135M-Instruct with the built-in arithmetic task are submitted over REST,
the same job with TLT on and with TLT off, one after the other so they do not share the cores. The TLT-on
job starts from a warm draft (JobSpec.warm_draft) that `tlt drafter train --task` builds on the task's own
prompts the first time (cached under $TLT_CACHE_DIR, keyed by model, task and recipe).
While a job runs the demo prints each worker's live progress and the scheduler's view of it
(rolling out, straggler, idle at the barrier, training the drafter); at the end it prints per step
the time by phase, the idle and the reclaimed worker-seconds, the draft version served and the
accepted length, and the rollout time of the two jobs side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time

from scheduler.client import call
from scheduler.policy import PolicySettings
from workers.protocol import TERMINAL_JOB_STATES, JobState, WorkerState

NUM_STEPS = 3
REPORT_DIR = "artifacts/demo-report"
# one micro-step of 256 pairs takes ~1 s on a shared CPU core: leases of a few seconds still train
SPEC = {"model": "smollm2-135m", "task": "arithmetic", "num_steps": NUM_STEPS, "num_prompts_per_step": 4,
        "group_size": 2, "max_new_tokens": 64, "num_workers": 4, "draft_k": 2, "seed": 0,
        "drafter": {"num_rows": 1, "max_tokens_per_row": 256}}
# CPU steps are tens of seconds and a worker's share is 2 responses: accept shorter leases and smaller
# buffers than the GPU-sized defaults (5 s, 512 tokens), or nothing would be reclaimed here
DEMO_POLICY = PolicySettings(min_lease_s=2.0, min_buffer_tokens=128)
SHORT = {WorkerState.ROLLING_OUT: "gen", WorkerState.STRAGGLER: "STRAGGLER", WorkerState.IDLE: "idle",
         WorkerState.TRAINING: "TRAIN", WorkerState.STALE: "stale", WorkerState.SWAPPING: "swap",
         WorkerState.FAILED: "FAILED"}


def say(msg: str = "") -> None:
    print(msg, flush=True)


def ensure_warm_draft(model: str, task: str) -> str | None:
    """The warm draft the TLT-on job starts from: built once with `tlt drafter train --task` (its recipe's
    defaults, workers.warm.WarmRecipe), cached under $TLT_CACHE_DIR keyed by model, task and recipe.
    The build took about 30 minutes on 2 busy cores (docs/benchmarks.md), over the demo's 10: it runs
    only with TLT_DEMO_BUILD_WARM_DRAFT=1 (`make warm-draft`); without a cached draft the TLT-on job
    starts from an untrained head, and None is returned."""
    from workers.warm import WarmRecipe, warm_cache_dir

    out = warm_cache_dir(model, task, WarmRecipe())
    path, report_file = out / "draft-v000001.safetensors", out / "report.json"
    if path.is_file() and report_file.is_file():
        rep = json.loads(report_file.read_text())
        say(f"warm draft: reusing the cached {path} (accepted length at k=2,3,4 on held-out {task} prompts: "
            f"{_acceptance(rep)})")
        return str(path)
    if os.environ.get("TLT_DEMO_BUILD_WARM_DRAFT") != "1":
        say(f"warm draft: none cached in {out}; TLT on starts from an untrained head. Build one once with "
            "`make warm-draft` (about 30 minutes on 2 busy cores), then run the demo again")
        return None
    say(f"warm draft: building it once with `tlt drafter train --task {task}` (cached in {out}; a few minutes)")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "scheduler.cli", "drafter", "train", "--task", task, "--model", model,
           "--out", str(out), "--threads", "2"]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"building the warm draft failed (exit {proc.returncode}): {' '.join(cmd)}")
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    report_file.write_text(json.dumps(rep, indent=1))  # last: its presence marks a finished build
    say(f"warm draft: built in {time.perf_counter() - t0:.0f} s (harvest {rep['harvest_seconds']:.0f} s, "
        f"{rep['num_harvested_tokens']} tokens; training {rep['train_seconds']:.0f} s, {rep['train_steps']} steps); "
        f"accepted length at k=2,3,4 on held-out {task} prompts: {_acceptance(rep)}")
    return str(path)


def _acceptance(rep: dict) -> str:
    return ", ".join(f"{rep['acceptance'].get(k, float('nan')):.2f}" for k in ("2", "3", "4"))


def start_server(settings) -> tuple[str, object]:
    """The scheduler app under uvicorn in a thread, on a free loopback port."""
    import uvicorn

    from scheduler.app import create_app
    from workers.redis_server import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning"))
    server.thread = threading.Thread(target=server.run, daemon=True, name="tlt-scheduler")
    server.thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler did not start within 60 s")
        time.sleep(0.1)
    return f"http://127.0.0.1:{port}", server


def progress_line(workers: list[dict]) -> str:
    cells = []
    for w in workers:
        who = SHORT.get(w.get("scheduler_class") or w["state"], w["state"])
        if w["state"] == WorkerState.TRAINING:
            who = "TRAIN"
        cells.append(f"{w['worker_id']} {who:<9} {w['num_finished']}/{w['num_total']} v{w['draft_version']}")
    return " | ".join(cells)


def run_job(url: str, spec: dict, label: str) -> dict:
    job = call("POST", url, "/v1/jobs", spec)
    job_id = job["job_id"]
    say(f"[{label}] submitted job {job_id} over REST: POST {url}/v1/jobs")
    start, last = time.monotonic(), ""
    while True:
        job = call("GET", url, f"/v1/jobs/{job_id}")
        line = progress_line(call("GET", url, f"/v1/jobs/{job_id}/workers"))
        if line and line != last:
            say(f"[{label} {time.monotonic() - start:5.0f}s step {job['steps']}] {line}")
            last = line
        if job["state"] in TERMINAL_JOB_STATES:
            break
        time.sleep(1.0)
    say(f"[{label}] job {job_id} {job['state']} in {time.monotonic() - start:.0f} s"
        + (f": {job['error']}" if job.get("error") else ""))
    return job


def summarize(url: str, jobs: dict[str, dict]) -> bool:
    from scheduler.report import totals

    steps = {label: call("GET", url, f"/v1/jobs/{j['job_id']}/steps") for label, j in jobs.items()}
    on, off = jobs["TLT on"], jobs["TLT off"]
    drafts = call("GET", url, f"/v1/jobs/{on['job_id']}/drafts")
    t_on, t_off = totals(steps["TLT on"], drafts), totals(steps["TLT off"], {})
    say()
    say("per step, TLT on (seconds; idle = worker-seconds waiting at the barrier while others generate):")
    say(f"{'step':>4} {'sync':>6} {'rollout':>8} {'reward':>7} {'logprob':>8} {'update':>7} {'idle':>7} "
        f"{'acc.len':>8} {'drafts served':>14}")
    for s in steps["TLT on"]:
        t = s["timings"]
        versions = ",".join(f"v{v}" for v in sorted(set(s["draft_versions"].values()))) or "-"
        say(f"{s['rl_step']:>4} {t.get('weight_sync', 0):6.1f} {t.get('rollout', 0):8.1f} {t.get('reward', 0):7.1f} "
            f"{t.get('logprob', 0):8.1f} {t.get('update', 0):7.1f} {s['idle_worker_s']:7.1f} "
            f"{s['mean_accepted_length']:8.2f} {versions:>14}")
    idle, reclaimed = t_on["idle_worker_s"], t_on["reclaimed_worker_s"]
    say()
    say(f"idle worker-seconds (TLT on): {idle:.1f}; reclaimed for drafter training: {reclaimed:.1f} "
        f"({t_on['reclaimed_ratio']:.0%} of the idle time)" if idle else "no idle time: nothing to reclaim")
    say(f"drafter leases: {drafts['num_leases']}, draft versions published: {drafts['num_published']}, "
        f"candidates rejected as not better: {drafts['num_rejected']}")
    for d in drafts["decisions"]:
        cand, serv = d["candidate_accepted_length"], d["serving_accepted_length"]
        verdict = f"published as v{d['published_version']}" if d["published_version"] else d["reason"] or "kept back"
        tau = d.get("candidate_draft_temperature")
        say(f"  candidate from copies {d['merged']}: accepted length {cand if cand is None else round(cand, 2)}"
            f"{'' if tau is None else f' at draft temperature {tau}'} vs serving "
            f"{serv if serv is None else round(serv, 2)} -> {verdict}")
    r_on, r_off = t_on["rollout_s"], t_off["rollout_s"]
    say()
    say(f"rollout time over {NUM_STEPS} steps: TLT on {r_on:.1f} s, TLT off {r_off:.1f} s "
        f"(on/off {r_on / r_off:.2f}x)" if r_off else "TLT off recorded no rollout time")
    say("  Read this with the machine in mind: the 'GPUs' here share 2 CPU cores, so drafter training on an idle")
    say("  'GPU' takes cycles from the stragglers. TLT on starts from the warm draft (served as v1 from the first")
    say("  rollout) and adapts it online; TLT off decodes plainly.")
    say("  On real GPUs the idle ones are free; docs/benchmarks.md has the measured figures.")
    return on["state"] == off["state"] == JobState.SUCCEEDED


def run_demo() -> int:
    import ray

    from scheduler.app import Settings
    from workers.protocol import RAY_NAMESPACE
    from workers.redis_server import PrivateRedis

    t0 = time.perf_counter()
    say("tlt-scheduler demo: RL on SmolLM2-135M-Instruct (arithmetic task) through the scheduler's REST API, CPU")
    say("(the first run converts the packaged SmolLM2 GGUF once, ~20 s; later runs reuse it)")
    warm_draft = ensure_warm_draft(SPEC["model"], SPEC["task"])  # before Ray: the build has the cores to itself
    ray.init(num_cpus=2, num_gpus=4, namespace=RAY_NAMESPACE, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    try:
        with PrivateRedis() as redis_server:
            say(f"private redis-server at {redis_server.url}; local Ray with 4 logical GPUs")
            settings = Settings(redis_url=redis_server.url, store_dir=tempfile.mkdtemp(prefix="tlt-demo-"),
                                start_ray=False, policy=DEMO_POLICY, watch_tick_s=0.25)
            url, server = start_server(settings)
            say(f"scheduler at {url} (OpenAPI: {url}/docs, metrics: {url}/metrics)")
            say("legend: gen = generating, STRAGGLER = still generating in the long tail, idle = waiting at the "
                "barrier, TRAIN = training the drafter on an idle GPU, vN = draft version served")
            warm = {"TLT on": {"warm_draft": warm_draft} if warm_draft else {}, "TLT off": {}}
            jobs = {}
            for label, tlt in (("TLT on", True), ("TLT off", False)):
                say()
                jobs[label] = run_job(url, SPEC | {"tlt": tlt} | warm[label], label)
            ok = summarize(url, jobs)
            from scheduler.report import write_report

            paths = write_report(url, jobs["TLT on"]["job_id"], REPORT_DIR)
            say(f"report of the TLT-on job: {paths['summary']} (plots beside it; `tlt report JOB --out DIR` makes one)")
            server.should_exit = True  # its lifespan stops the watcher before Redis goes away
            server.thread.join(30)
    finally:
        ray.shutdown()
    say(f"total demo time {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo())
