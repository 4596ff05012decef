"""`tlt bench scheduler`: how fast the scheduler acts, on real parts.

(1) Dispatch and preemption on real workers: a real local Ray, two rollout worker actors serving a
    tiny random model, a private redis-server and the real Watcher (in its own thread, at its tick).
    The bench plays the driver: each trial writes the ROLLOUT phase and has one worker generate
    for about `short_s` and the other for about `long_s`. The first goes idle at the barrier while
    the other still generates, and the watcher leases it. Dispatch latency: from the worker's IDLE
    transition (its event's timestamp) to the lease accepted (the outcome's `started_at`). When the
    long rollout returns the bench writes the UPDATE phase, as the driver does; preemption latency:
    from that moment to the trainer having stopped (the outcome's `ended_at`).
(2) The full policy pass at `num_workers` simulated workers: a separate process writes every
    worker's progress record at the real rate (MAX_PROGRESS_UPDATES_PER_S each, with the reporter's
    SET PX + SADD), their states moving through a long-tailed rollout; the watcher's whole tick
    (read every record from Redis, decide, write the classes and its state) is timed over many ticks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.record import pct
from scheduler.jobs import JobStore
from scheduler.policy import PolicySettings
from scheduler.watcher import Watcher
from workers.protocol.keys import (
    MAX_PROGRESS_UPDATES_PER_S,
    PROGRESS_TTL_S,
    job_leases_key,
    job_phase_key,
    job_workers_key,
    progress_key,
)
from workers.protocol.messages import LeaseOutcome, PhaseRecord, ProgressRecord
from workers.protocol.states import JobState, LeaseState, Phase, WorkerState
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec

TICK_S = 0.1  # the watcher's tick in this bench (TLT_WATCH_TICK_S)
# unmeasured first trials, one per worker: a worker's first lease builds its draft head from nothing
# (imports, draft vocabulary, optimizer) before a stop can reach the trainer, seconds once per worker
NUM_WARMUP = 2
# tiny-model steps are short: leases of any length, and a buffer of a few pairs is enough to train on
# scoring_margin 0: between trials the bench opens a rollout phase where nobody generates (no time left by
# the estimate) for the round to be scored in
LEASE_POLICY = PolicySettings(min_lease_s=0.01, min_buffer_tokens=16, lease_margin=1.0, scoring_margin=0.0)


def log(msg: str) -> None:
    print(f"[bench scheduler] {msg}", file=sys.stderr, flush=True)


def summary(name: str, values: list[float]) -> dict:
    return {f"{name}_p50_s": pct(values, 0.5), f"{name}_p99_s": pct(values, 0.99),
            f"{name}_max_s": max(values, default=None), f"num_{name}_samples": len(values)}


def running_job(store: JobStore, num_workers: int, model: str = "tiny", **spec) -> str:
    job_id = store.create(JobSpec(model=model, num_workers=num_workers, **spec))[0]["job_id"]
    store.transition(job_id, JobState.RUNNING, {JobState.PENDING})
    return job_id


def set_phase(redis, job_id: str, phase: Phase, rl_step: int) -> float:
    now = time.time()
    redis.set(job_phase_key(job_id), PhaseRecord(phase, rl_step, now).to_json())
    return now


# ----- (1) dispatch and preemption on real workers ----------------------------------------------
def _model_dir(root: Path) -> str:
    """The tiny preset with room for long rollouts (random weights, no EOS: every rollout runs to its cap)."""
    from drafter.model.config import PRESETS
    from drafter.model.loading import random_model, save_hf_dir

    path = root / "tiny-long"
    save_hf_dir(random_model(dataclasses.replace(PRESETS["tiny"], max_position=4096), init_seed=0), None, path)
    return str(path)


def _outcome(redis, job_id: str, worker_id: str, after: float, is_ended: bool = False) -> LeaseOutcome | None:
    """The newest lease outcome of `worker_id` accepted after `after` (with is_ended: once it ended)."""
    outs = [LeaseOutcome.from_json(v) for v in redis.hgetall(job_leases_key(job_id)).values()]
    outs = [o for o in outs if o.worker_id == worker_id and o.started_at > after
            and not (is_ended and o.state == LeaseState.RUNNING)]
    return max(outs, key=lambda o: o.started_at, default=None)


def _wait(predicate, timeout_s: float, poll_s: float = 0.005):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return None


def bench_workers(num_trials: int = 60, short_s: float = 0.8, long_s: float = 1.4, tick_s: float = TICK_S) -> dict:
    import ray

    from workers.actors import start_worker
    from workers.progress import read_events

    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    root = Path(tempfile.mkdtemp(prefix="tlt-bench-scheduler-"))
    dispatch, preempt, missed = [], [], {"no_lease": 0, "ended_before_rollout": 0}
    warmup = {"dispatch_s": [], "preemption_s": []}  # each worker's first lease: one-time set-up, not counted
    try:
        with PrivateRedis() as server:
            redis, store = server.client(), JobStore(server.client())
            model = _model_dir(root)
            job_id = running_job(store, 2, model=model, max_new_tokens=4000)
            spec = JobSpec.from_stored(store.get(job_id)["spec"])
            workers = {w: start_worker(job_id, w, spec, server.url, str(root / "drafts")) for w in ("w0", "w1")}
            prompt = [[1, 2, 3, 4]]

            def generate(wid: str, num_tokens: int, rl_step: int):
                return workers[wid].generate.remote(prompt, [{"temperature": 1.0, "max_new_tokens": num_tokens,
                                                              "seed": rl_step}], rl_step)

            set_phase(redis, job_id, Phase.SYNC, 0)
            t0 = time.perf_counter()
            ray.get([generate(w, 200, 0) for w in workers])  # loads, warms up and fills the buffers
            per_token_s = (time.perf_counter() - t0) / 200
            t0 = time.perf_counter()
            ray.get([generate(w, 200, 0) for w in workers])
            per_token_s = (time.perf_counter() - t0) / 200
            num_short, num_long = (max(8, min(3900, round(s / per_token_s))) for s in (short_s, long_s))
            log(f"{per_token_s * 1e3:.2f} ms/token: rollouts of {num_short} and {num_long} tokens")
            watcher = Watcher(store, str(root / "drafts"), LEASE_POLICY, tick_s=tick_s)
            watcher.start()
            last_event = None
            for trial in range(1, num_trials + NUM_WARMUP + 1):
                short, long = ("w0", "w1") if trial % 2 else ("w1", "w0")
                if trial == NUM_WARMUP + 1:
                    dispatch, preempt = [], []
                    missed = {k: 0 for k in missed}
                trial_start = set_phase(redis, job_id, Phase.ROLLOUT, trial)
                long_ref = generate(long, num_long, trial)
                ray.get(generate(short, num_short, trial))
                events = read_events(redis, job_id, count=1000, after=last_event)
                last_event = events[-1]["id"] if events else last_event
                idle_at = next(e["ts"] for e in events if (e["worker"], e["to"], e["rl_step"])
                               == (short, WorkerState.IDLE, trial))
                lease = _wait(functools.partial(_outcome, redis, job_id, short, trial_start), long_s * 4)
                ray.get(long_ref)
                rollout_end = set_phase(redis, job_id, Phase.UPDATE, trial)
                if lease is None:
                    missed["no_lease"] += 1
                else:
                    dispatch.append(lease.started_at - idle_at)
                    done = _wait(functools.partial(_outcome, redis, job_id, short, trial_start, True), 30.0)
                    if done and done.ended_at > rollout_end:
                        preempt.append(done.ended_at - rollout_end)
                    else:
                        missed["ended_before_rollout"] += 1
                # the lease is collected, and the round its copy starts (merge, score, publish) finishes before
                # the next trial: rounds are scored only during a rollout, on an idle worker, so a rollout
                # phase where nobody generates (no time left to lease) is the window for it
                _wait(lambda: (st := watcher.jobs.get(job_id)) is not None and not st.leases, 30.0, 0.02)
                set_phase(redis, job_id, Phase.ROLLOUT, trial)
                _wait(lambda: not ((st := watcher.jobs.get(job_id)) and (st.leases or st.copies or st.scoring)),
                      60.0, 0.02)
                set_phase(redis, job_id, Phase.UPDATE, trial)
                if trial % 10 == 0:
                    log(f"trial {trial}: dispatch p50 {pct(dispatch, 0.5)}, preemption p50 {pct(preempt, 0.5)}")
                if trial == NUM_WARMUP:
                    warmup = {"dispatch_s": dispatch, "preemption_s": preempt}
            watcher.stop(join_s=5.0)
            st = watcher.jobs.get(job_id)
            result = {"num_trials": num_trials, "tick_s": tick_s, "rollout_tokens": [num_short, num_long],
                      "missed": missed, "warmup": warmup, "num_leases": st.num_leases if st else None,
                      "num_published": st.num_published if st else None,
                      "watcher_dispatch_rpc_p50_s": _hist_p50(watcher.metrics.dispatch),
                      **summary("dispatch", dispatch), **summary("preemption", preempt)}
            for w in workers.values():
                ray.kill(w)
            return result
    finally:
        ray.shutdown()


def _hist_p50(hist) -> float | None:
    """The median bucket's upper bound of a labelled prometheus Histogram (the RPC part of dispatch)."""
    for metric in hist.collect():
        buckets = [(float(s.labels["le"]), s.value) for s in metric.samples if s.name.endswith("_bucket")]
        total = max((v for _, v in buckets), default=0)
        return next((le for le, v in sorted(buckets) if v >= total / 2), None) if total else None
    return None


# ----- (2) the policy pass at many workers ------------------------------------------------------
def _write_progress(url: str, job_id: str, num_workers: int, rate: float, stop, counter) -> None:
    """Every worker's record `rate` times a second, as the reporters write them, through a rollout
    whose lengths are long-tailed (most workers done early, a few late); a new rollout every 20 s."""
    import redis as redis_lib

    redis = redis_lib.Redis.from_url(url, decode_responses=True)
    ids = [f"w{i}" for i in range(num_workers)]
    keys = [progress_key(job_id, w) for w in ids]
    base = ProgressRecord(job_id, "w0", WorkerState.ROLLING_OUT, 8, 0, 8, 0, 0.0, 1.0, 0, 0, 0, time.time(),
                          buffer_tokens=0).to_dict()
    rng = random.Random(0)
    ends = [min(20.0, rng.paretovariate(1.5) * 3.0) for _ in ids]  # seconds each takes, long-tailed
    ttl_ms = PROGRESS_TTL_S * 1000
    while not stop.is_set():
        t0 = time.time()
        age = t0 % 20.0
        pipe = redis.pipeline(transaction=False)
        for w, key, end in zip(ids, keys, ends):
            done = min(8, int(8 * age / end))
            state = WorkerState.ROLLING_OUT if done < 8 else WorkerState.IDLE
            pipe.set(key, json.dumps(base | {"worker_id": w, "state": state.value, "num_running": 8 - done,
                                             "num_finished": done, "num_tokens": 40 * done, "timestamp": t0}),
                     px=ttl_ms)
        pipe.sadd(job_workers_key(job_id), *ids)
        pipe.execute()
        with counter.get_lock():
            counter.value += num_workers
        stop.wait(max(0.0, 1.0 / rate - (time.time() - t0)))


def bench_policy_pass(num_workers: int = 2048, num_ticks: int = 300, tick_s: float = TICK_S,
                      rate: float = MAX_PROGRESS_UPDATES_PER_S) -> dict:
    ctx = multiprocessing.get_context("spawn")
    stop, counter = ctx.Event(), ctx.Value("q", 0)
    with PrivateRedis() as server, tempfile.TemporaryDirectory(prefix="tlt-bench-pass-") as store_dir:
        redis, store = server.client(), JobStore(server.client())
        job_id = running_job(store, num_workers)
        set_phase(redis, job_id, Phase.ROLLOUT, 0)
        writer = ctx.Process(target=_write_progress, args=(server.url, job_id, num_workers, rate, stop, counter),
                             daemon=True)
        writer.start()
        try:
            if not _wait(lambda: redis.scard(job_workers_key(job_id)) >= num_workers, 60.0, 0.05):
                raise RuntimeError("the progress writer did not start")
            watcher = Watcher(store, store_dir, PolicySettings(), tick_s=tick_s)
            watcher.tick()  # first sight: the job's state is loaded
            seconds, cpu, written_from, t_from = [], [], counter.value, time.monotonic()
            for _ in range(num_ticks):
                t0, c0 = time.perf_counter(), time.process_time()
                watcher.tick()
                seconds.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                time.sleep(max(0.0, tick_s - seconds[-1]))
            writes_per_s = (counter.value - written_from) / (time.monotonic() - t_from)
        finally:
            stop.set()
            writer.join(10)
    mean = statistics.mean(seconds)
    return {"num_workers": num_workers, "num_ticks": num_ticks, "tick_s": tick_s,
            "progress_writes_per_s": round(writes_per_s), "progress_writes_per_s_goal": num_workers * rate,
            "policy_pass_p50_s": pct(seconds, 0.5), "policy_pass_p99_s": pct(seconds, 0.99),
            "policy_pass_max_s": max(seconds), "policy_pass_cpu_p50_s": pct(cpu, 0.5),
            "policy_passes_per_s": 1.0 / mean, "worker_decisions_per_s": num_workers / mean}


def bench_scheduler(num_trials: int = 60, num_workers: int = 2048, num_ticks: int = 300, tick_s: float = TICK_S,
                    short_s: float = 0.8, long_s: float = 1.4) -> dict:
    """Both parts."""
    log(f"(2) policy pass: {num_workers} simulated workers writing progress, {num_ticks} ticks")
    result = {"policy_pass": bench_policy_pass(num_workers, num_ticks, tick_s)}
    log(f"    {result['policy_pass']}")
    log(f"(1) dispatch and preemption: {num_trials} trials on 2 real rollout workers")
    result["workers"] = bench_workers(num_trials, short_s, long_s, tick_s)
    w, p = result["workers"], result["policy_pass"]
    result["goals"] = {"dispatch_p99_s": 0.25, "preemption_p99_s": 1.0, "policy_pass_p99_s": 0.1}
    result["met"] = {"dispatch_p99_s": w["dispatch_p99_s"] is not None and w["dispatch_p99_s"] < 0.25,
                     "preemption_p99_s": w["preemption_p99_s"] is not None and w["preemption_p99_s"] < 1.0,
                     "policy_pass_p99_s": p["policy_pass_p99_s"] < 0.1}
    return result


def add_arguments(p) -> None:
    p.add_argument("--trials", type=int, default=60, help="leases dispatched and preempted on the real workers")
    p.add_argument("--workers", type=int, default=2048, help="simulated workers of the policy pass")
    p.add_argument("--ticks", type=int, default=300, help="policy passes timed")
    p.add_argument("--tick-s", type=float, default=TICK_S, help="the watcher's tick")
    p.add_argument("--short-s", type=float, default=0.8, help="the rollout of the worker that goes idle first")
    p.add_argument("--long-s", type=float, default=1.4, help="the straggler's rollout")


def run(args) -> dict:
    return bench_scheduler(num_trials=args.trials, num_workers=args.workers, num_ticks=args.ticks,
                           tick_s=args.tick_s, short_s=args.short_s, long_s=args.long_s)
