"""`tlt demo` / `make demo`: the whole system on the embedded defaults, on this machine's CPU.

A private redis-server, local Ray with 2 logical GPUs (each rollout worker pinned to its own core), and the
scheduler's REST API on loopback. Two RL jobs on SmolLM2-135M-Instruct with the built-in longtail task (most
prompts ask for the answer alone, one in ten for detailed reasoning: a long tail in every step) are submitted
over REST, the same job with TLT off and with TLT on, one after the other so they do not share the cores, both
sampling coupled (JobSpec.coupled_sampling) so that they generate the same rollouts.
The TLT-on job starts from a warm draft (JobSpec.warm_draft) that `tlt drafter train --task` builds on the
task's own prompts: the one `make warm-draft` cached under $TLT_CACHE_DIR (keyed by model, task and recipe), else
the one the checkout ships (deploy/drafts/, `make ship-draft`).
While a job runs the demo prints each worker's live progress and the scheduler's view of it
(rolling out, straggler, idle at the barrier, training the drafter); at the end it prints per step
the time by phase, the idle and the reclaimed worker-seconds, the draft version served and the
accepted length, and the rollout time of the two jobs side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from drafter.draft.meter import bucket_low_edge
from scheduler.client import call
from scheduler.policy import PolicySettings
from scheduler.served import (
    MAX_TAIL_BUCKET,
    accepted_by_bucket,
    k_rates,
    step_work,
    tail_accepted_length,
    tail_tokens_per_s,
)
from workers.protocol.states import TERMINAL_JOB_STATES, JobState, WorkerState

NUM_STEPS = 2
NUM_WORKERS = 2  # one per core of this 2-core box: a lease on an idle worker takes no core from a straggler
REPORT_DIR = "artifacts/demo-report"
# one micro-step of 256 pairs takes ~1 s on a CPU core: leases of a few seconds still train.
# Coupled sampling (JobSpec.coupled_sampling): both jobs generate the same rollouts, so their rollout times differ
# by the drafter and the machine alone, not by how long two jobs' T=1 samples happened to be (the demo's claims
# before session 34 were judged against that spread). policy_dtype auto: for coupled jobs bf16 only where a
# verify's logits are plain decoding's to the bit (workers.device.policy_dtype; an AMX Xeon), float32 elsewhere
SPEC = {"model": "smollm2-135m", "task": "longtail", "num_steps": NUM_STEPS, "num_prompts_per_step": 10,
        "group_size": 4, "max_new_tokens": 512, "num_workers": NUM_WORKERS, "draft_k": 4, "seed": 0,
        "policy_dtype": "auto", "coupled_sampling": True, "drafter": {"num_rows": 1, "max_tokens_per_row": 256}}
# CPU steps are tens of seconds and a worker's share is 2 responses: accept shorter leases and smaller
# buffers than the GPU-sized defaults (5 s, 512 tokens), or nothing would be reclaimed here
DEMO_POLICY = PolicySettings(min_lease_s=2.0, min_buffer_tokens=128)
SHORT = {WorkerState.ROLLING_OUT: "gen", WorkerState.STRAGGLER: "STRAGGLER", WorkerState.IDLE: "idle",
         WorkerState.TRAINING: "TRAIN", WorkerState.STALE: "stale", WorkerState.SWAPPING: "swap",
         WorkerState.FAILED: "FAILED"}


def say(msg: str = "") -> None:
    print(msg, flush=True)


def ensure_warm_draft(model: str, task: str) -> str | None:
    """The warm draft the TLT-on job starts from, the first there is of:
    - workers.warm's, cached under $TLT_CACHE_DIR keyed by model, task and recipe (workers.warm.warm_cache_dir,
      WarmRecipe's defaults): `make warm-draft` builds it;
    - the one the checkout ships (workers.warm.shipped_warm_draft: deploy/drafts/, built by the same recipe), so
      that a fresh clone's demo starts from a draft that pays;
    - with TLT_DEMO_BUILD_WARM_DRAFT=1 (`make warm-draft`), one built now by `tlt drafter train --task`
      (workers.warm.build_warm_draft) in a process of its own (this one stays torch-free): about 27 minutes on a
      2-core box, over the demo's 10.
    None (the TLT-on job starts from an untrained head) when there is none of these."""
    from workers.warm import WARM_REPORT, WarmRecipe, shipped_warm_draft, warm_cache_dir
    from workers.warm import ensure_warm_draft as cached_warm_draft

    path = cached_warm_draft(model, task, is_build_allowed=False)
    out = warm_cache_dir(model, task, WarmRecipe())
    building = os.environ.get("TLT_DEMO_BUILD_WARM_DRAFT") == "1"
    shipped = shipped_warm_draft(model, task)
    if path is None and shipped is not None and not building:
        path, out = str(shipped), shipped.parent
    if path is not None:
        rep = json.loads((out / WARM_REPORT).read_text())
        say(f"warm draft: {path} (accepted length at k=2,3,4 on held-out {task} prompts: {_acceptance(rep)})")
        return path
    if not building:
        say(f"warm draft: none cached in {out} and none shipped; TLT on starts from an untrained head. Build one "
            "once with `make warm-draft` (about 27 minutes on a 2-core box), then run the demo again")
        return None
    say(f"warm draft: building it once with `tlt drafter train --task {task}` (cached in {out}; about 27 minutes)")
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "scheduler.cli", "drafter", "train", "--task", task, "--model", model,
           "--threads", "2"]  # no --out: into the cache, by WarmRecipe's defaults
    proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=None, check=False)
    path = cached_warm_draft(model, task, is_build_allowed=False)
    if proc.returncode != 0 or path is None:
        raise RuntimeError(f"building the warm draft failed (exit {proc.returncode}): {' '.join(cmd)}")
    rep = json.loads((out / WARM_REPORT).read_text())
    say(f"warm draft: built in {time.perf_counter() - t0:.0f} s (harvest {rep['harvest_seconds']:.0f} s, "
        f"{rep['num_harvested_tokens']} tokens; training {rep['train_seconds']:.0f} s, {rep['train_steps']} steps); "
        f"accepted length at k=2,3,4 on held-out {task} prompts: {_acceptance(rep)}")
    return path


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
    say("per step (seconds; tail = first worker done to last; idle = worker-seconds waiting at the barrier while "
        "another generates; lengths = response tokens median/p90/max):")
    say(f"{'job':>7} {'step':>4} {'sync':>5} {'rollout':>8} {'tail':>6} {'update':>7} {'step':>6} {'idle':>6} "
        f"{'lengths':>12} {'acc.len':>7} {'drafts':>7}  k per live-batch bucket")
    for label in ("TLT off", "TLT on"):
        for s in steps[label]:
            t, n = s["timings"], s["response_lengths"]
            lengths = f"{n.get('median', 0):.0f}/{n.get('p90', 0):.0f}/{n.get('max', 0):.0f}"
            served = sorted(set(s["draft_versions"].values())) if label == "TLT on" else []
            versions = ",".join(f"v{v}" for v in served) or "-"
            ks = "; ".join(f"{w}: " + " ".join(f"{b}->{c[b]}" for b in sorted(c, key=bucket_low_edge))
                           for w, c in sorted(s.get("speculation", {}).items())) if label == "TLT on" else ""
            say(f"{label:>7} {s['rl_step']:>4} {t.get('weight_sync', 0):5.1f} {t.get('rollout', 0):8.1f} "
                f"{s['tail_s']:6.1f} {t.get('update', 0):7.1f} {sum(t.values()):6.1f} {s['idle_worker_s']:6.1f} "
                f"{lengths:>12} {s['mean_accepted_length']:7.2f} "
                f"{versions:>7}  {ks}")
    idle, reclaimed = t_on["idle_worker_s"], t_on["reclaimed_worker_s"]
    by_bucket = accepted_by_bucket(steps["TLT on"])
    if by_bucket:
        tail = tail_accepted_length(steps["TLT on"])
        say("TLT on: accepted tokens per row-forward by live-batch bucket (plain steps count 1.0): "
            + ", ".join(f"{b}: {a:.2f}" for b, a in by_bucket.items())
            + (f"; in the tail (<= {MAX_TAIL_BUCKET} live rows): {tail:.2f}" if tail is not None else ""))
    say()
    say(f"TLT on: idle worker-seconds at the barrier {idle:.1f}; reclaimed for drafter training {reclaimed:.1f} "
        f"({t_on['reclaimed_ratio']:.0%} of the idle time)" if idle else "TLT on: no idle time: nothing to reclaim")
    say(f"drafter leases: {drafts['num_leases']}, draft versions published: {drafts['num_published']}, "
        f"candidates rejected as not better: {drafts['num_rejected']}")
    for d in drafts["decisions"]:
        cand, serv = d["candidate_accepted_length"], d["serving_accepted_length"]
        verdict = f"published as v{d['published_version']}" if d["published_version"] else d["reason"] or "kept back"
        say(f"  candidate from copies {d['merged']}: accepted length {cand if cand is None else round(cand, 2)} "
            f"vs serving {serv if serv is None else round(serv, 2)} -> {verdict}")
    say()
    rates = [tail_tokens_per_s(steps[label]) for label in ("TLT off", "TLT on")]
    if None not in rates:
        say(f"decoding in the tail (<= {MAX_TAIL_BUCKET} live rows), tokens/s per worker: TLT off {rates[0]:.1f}, "
            f"TLT on {rates[1]:.1f} (ratio {rates[1] / rates[0]:.2f}): a rate, which does not depend on how long the "
            "two jobs' samples happened to be")
    line = tail_k_line(steps["TLT on"])
    if line:
        say(line)
    paired = len(steps["TLT off"]) == len(steps["TLT on"]) and all(
        step_work(a) == step_work(b) for a, b in zip(steps["TLT off"], steps["TLT on"]))
    for line in rollout_verdict([s["timings"].get("rollout", 0.0) for s in steps["TLT off"]],
                                [s["timings"].get("rollout", 0.0) for s in steps["TLT on"]],
                                [s["mean_accepted_length"] for s in steps["TLT on"]],
                                None if None in rates else rates[1] / rates[0], paired):
        say(line)
    rest_off, rest_on = t_off["step_s"] - t_off["rollout_s"], t_on["step_s"] - t_on["rollout_s"]
    say(f"  (the steps' other phases, weight sync and the learner's update, took {rest_off:.1f} s and {rest_on:.1f} s: "
        "TLT does not speed them up, so no whole-step figure is given)")
    say("  One run of each on a shared machine: docs/benchmarks.md has `tlt bench rl`, which repeats the jobs in")
    say("  turned-round order and adds the frozen-draft arm.")
    return on["state"] == off["state"] == JobState.SUCCEEDED


# accepted tokens per policy forward below this: the drafter did not pay (plain decoding is 1.0)
MIN_PAYING_ACCEPTED_LENGTH = 1.05
# paired jobs (the same rollouts): a change claimed only where every step moved the same way and the total by more
# than this, the machine's own timing noise on the same work (run S of `tlt bench rl --coupled`: frozen-draft and
# plain steps on identical rollouts differed by -7% to +7% step by step)
PAIRED_MIN_CHANGE = 0.05


def rollout_verdict(off_s: list[float], on_s: list[float], accepted: list[float],
                    tail_rate_ratio: float | None = None, paired: bool = False) -> list[str]:
    """What the demo may say of its two jobs' rollout times (per step, TLT off and on), given the TLT-on job's
    accepted lengths and, where both decoded in the tail, the TLT-on job's tail decoding rate over the TLT-off
    job's (scheduler.served.tail_tokens_per_s): a speed-up only when the drafter paid (accepted length above
    MIN_PAYING_ACCEPTED_LENGTH), the difference is larger than the run-to-run noise, here the spread of the
    TLT-off job's own steps ((max - min) / mean; one step gives no estimate, and then no speed-up is claimed
    either), and the tail decoded faster too (speculative sampling draws other samples than plain decoding, from
    the same distribution: a shorter longest response shortens a rollout whatever the drafter did); a slow-down
    likewise only when the tail decoded slower (session 31: 0.85x from a TLT-on step that sampled longer
    responses, its tail at 1.02x the TLT-off job's rate). paired: the two jobs generated the same rollouts
    (coupled sampling; scheduler.served.step_work), so the difference is the drafter's and the machine's alone:
    claimed where every step moved the same way and the total by more than PAIRED_MIN_CHANGE."""
    r_off, r_on = sum(off_s), sum(on_s)
    if not (r_off > 0 and r_on > 0):
        return ["rollout: no timings to compare"]
    mean_acc = sum(accepted) / len(accepted) if accepted else 1.0
    noise = (max(off_s) - min(off_s)) / (r_off / len(off_s)) if len(off_s) > 1 else None
    lines = [f"rollout over {len(off_s)} steps: TLT off {r_off:.1f} s, TLT on {r_on:.1f} s (ratio {r_off / r_on:.2f}); "
             f"TLT on accepted {mean_acc:.2f} tokens per policy forward"]
    change, slower = abs(r_off / r_on - 1), r_on > r_off
    if mean_acc < MIN_PAYING_ACCEPTED_LENGTH:
        lines.append("  the drafter never paid (accepted length about 1.0): the difference is not TLT's doing")
    elif paired:
        lines.append(paired_line(off_s, on_s))
    elif noise is None:
        lines.append("  one step per job gives no noise estimate: no speed-up is claimed")
    elif change <= noise:
        lines.append(f"  the difference ({change:.0%}) lies within run-to-run noise (the TLT-off job's steps "
                     f"spread {noise:.0%}): no speed-up is claimed")
    elif tail_rate_ratio is not None and (tail_rate_ratio >= 1.0 if slower else tail_rate_ratio <= 1.0):
        lines.append(f"  not the drafter's doing: the tail decoded at {tail_rate_ratio:.2f}x the TLT-off job's rate, "
                     "so the rollouts differ by how long their samples were: no "
                     f"{'slow-down' if slower else 'speed-up'} is claimed")
    elif slower:
        lines.append(f"  rollout slow-down: TLT on took {r_on / r_off:.2f}x as long, beyond the run-to-run noise "
                     f"({noise:.0%} spread between the TLT-off job's steps)")
    else:
        lines.append(f"  rollout speed-up {r_off / r_on:.2f}x, beyond the run-to-run noise ({noise:.0%} spread "
                     "between the TLT-off job's steps)")
    return lines


def paired_line(off_s: list[float], on_s: list[float]) -> str:
    """rollout_verdict's claim for two jobs that generated the same rollouts."""
    ratios = [a / b for a, b in zip(off_s, on_s) if a > 0 and b > 0]
    total = sum(off_s) / sum(on_s)
    same = "both jobs generated the same rollouts (coupled sampling)"
    per_step = ", ".join(f"{r:.2f}x" for r in ratios)
    if total >= 1 + PAIRED_MIN_CHANGE and min(ratios) > 1:
        return f"  rollout speed-up {total:.2f}x on the same work: {same}; per step {per_step}"
    if total <= 1 - PAIRED_MIN_CHANGE and max(ratios) < 1:
        return (f"  rollout slow-down: TLT on took {1 / total:.2f}x as long on the same work: {same}; "
                f"per step {per_step}")
    return (f"  {same}, and the rollout ratio ({per_step} per step) lies within this machine's timing noise on the "
            f"same work (a change of {PAIRED_MIN_CHANGE:.0%} in every step's direction): no speed-up is claimed")


def tail_k_line(steps: list[dict]) -> str | None:
    """The TLT-on job's decoding rate per draft length in each tail bucket (scheduler.served.k_rates), or None
    where its records hold none: what the adaptive choice of k weighed there."""
    tail = {name: by_k for name, by_k in k_rates(steps).items() if bucket_low_edge(name) <= MAX_TAIL_BUCKET}
    if not tail:
        return None
    return ("  TLT on in the tail, tokens/s per worker by live-batch bucket and draft length k (steps): "
            + "; ".join(f"{name}: " + ", ".join(f"k={k} {rate:.1f} ({n})" for k, (rate, n) in by_k.items())
                        for name, by_k in tail.items())
            + ": what the adaptive choice of k weighed (k=0: plain steps of the same job)")


def run_demo() -> int:
    import ray

    from scheduler.app import Settings
    from scheduler.paths import default_roots
    from workers.protocol.keys import RAY_NAMESPACE
    from workers.redis_server import PrivateRedis
    from workers.warm import SHIPPED_DRAFTS

    t0 = time.perf_counter()
    say("tlt-scheduler demo: RL on SmolLM2-135M-Instruct (longtail task) through the scheduler's REST API, CPU")
    say("(the first run converts the packaged SmolLM2 GGUF once, ~20 s; later runs reuse it)")
    warm_draft = ensure_warm_draft(SPEC["model"], SPEC["task"])  # before Ray: the build has the cores to itself
    # the jobs' draft stores and checkpoints: removed once Ray's workers are gone
    store_dir = tempfile.mkdtemp(prefix="tlt-demo-")
    ray.init(num_cpus=NUM_WORKERS, num_gpus=NUM_WORKERS, namespace=RAY_NAMESPACE, include_dashboard=False,
             log_to_driver=False, ignore_reinit_error=True)
    try:
        with PrivateRedis() as redis_server:
            say(f"private redis-server at {redis_server.url}; local Ray with {NUM_WORKERS} logical GPUs, a core each")
            # the shipped drafts' folder is a model root too: the TLT-on job names its warm draft there
            settings = Settings(redis_url=redis_server.url, store_dir=store_dir, start_ray=False, policy=DEMO_POLICY,
                                watch_tick_s=0.25, model_roots=default_roots(store_dir) + (str(SHIPPED_DRAFTS),))
            url, server = start_server(settings)
            say(f"scheduler at {url} (OpenAPI: {url}/docs, metrics: {url}/metrics)")
            say("legend: gen = generating, STRAGGLER = still generating in the long tail, idle = waiting at the "
                "barrier, TRAIN = training the drafter on an idle GPU, vN = draft version served")
            warm = {"TLT on": {"warm_draft": warm_draft} if warm_draft else {}, "TLT off": {}}
            jobs = {}
            for label, tlt in (("TLT off", False), ("TLT on", True)):
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
        shutil.rmtree(store_dir, ignore_errors=True)
    say(f"total demo time {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_demo())
