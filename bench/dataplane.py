"""`tlt bench dataplane`: a GRPO job on local Ray with logical GPUs, then hot-swap and progress costs.

(1) one or more GRPO steps on `num_workers` rollout workers: per-phase timings, the rollout share
    of the step, and the worker-seconds spent idle at the step barrier (what the scheduler reclaims);
(2) hot swap: while every worker generates, a new draft version is published; the time from publish
    to each worker serving it, and the decode-loop time spent switching;
(3) progress reporting: the time the decode loop spends inside its progress reports, and (noisier) one
    worker generating the same requests with reporting on and off, alternately.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

import ray

from bench.prompts import PROMPTS
from bench.record import pct
from drafter.draft.head import head_config, new_head
from drafter.model.config import SMOLLM2_SPEC
from drafter.model.loading import encode_text, load_model
from drafter.train.checkpoint import DraftMeta
from workers.actors import get_worker
from workers.job_actor import start_driver
from workers.progress import read_json_list
from workers.protocol.keys import job_steps_key
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec
from workers.store import job_stores


def log(msg: str) -> None:
    print(f"[bench dataplane] {msg}", file=sys.stderr, flush=True)


def bench_dataplane(model: str = SMOLLM2_SPEC, num_workers: int = 4, num_steps: int = 1,
                    prompts_per_step: int = 4, group_size: int = 4, max_new_tokens: int = 96,
                    swap_trials: int = 3, overhead_reps: int = 4) -> dict:
    result: dict = {"model": model, "num_workers": num_workers, "num_steps": num_steps,
                    "prompts_per_step": prompts_per_step, "group_size": group_size, "max_new_tokens": max_new_tokens}
    ray.init(num_cpus=2, num_gpus=num_workers, include_dashboard=False, log_to_driver=False,
             ignore_reinit_error=True)
    store_dir = tempfile.mkdtemp(prefix="tlt-bench-dataplane-")
    try:
        with PrivateRedis() as redis_server:
            client = redis_server.client()
            # speculation "always": every worker drafts with whatever is served, so swaps land mid-draft
            spec = JobSpec(model=model, num_steps=num_steps, num_prompts_per_step=prompts_per_step,
                           group_size=group_size, max_new_tokens=max_new_tokens, num_workers=num_workers,
                           speculation="always")
            log(f"(1) GRPO job: {num_steps} step(s), {num_workers} workers, {prompts_per_step}x{group_size} rollouts")
            driver = start_driver("bench", spec, redis_server.url, store_dir, is_detached=False)
            outcome = ray.get(driver.run.remote())
            steps = read_json_list(client, job_steps_key("bench"))
            if not outcome["ok"]:
                raise RuntimeError(f"the benchmark's job failed: {outcome['error']}")
            fractions = [s["timings"]["rollout"] / sum(s["timings"].values()) for s in steps]
            result["steps"] = steps
            result["rollout_fraction"] = round(statistics.mean(fractions), 3)
            result["idle_worker_seconds_per_step"] = round(statistics.mean(s["idle_worker_s"] for s in steps), 2)
            result["step_seconds"] = round(statistics.mean(sum(s["timings"].values()) for s in steps), 2)
            workers = [get_worker("bench", f"w{i}") for i in range(num_workers)]

            loaded = load_model(model)
            prompts = [encode_text(loaded.tokenizer, t, loaded.model.cfg.vocab_size) for t in PROMPTS[:4]]
            params = [{"max_new_tokens": max_new_tokens, "ignore_eos": True}] * len(prompts)
            served, _ = job_stores(client, store_dir, "bench")
            log(f"(2) hot swap, {swap_trials} trials")
            latencies, loss_fractions = [], []
            parts: dict[str, list[float]] = {"delivery": [], "load": [], "install_wait": []}
            for trial in range(swap_trials):
                before = ray.get([w.describe.remote() for w in workers])
                t0 = time.perf_counter()
                runs = [w.generate.remote(prompts, params, 100 + trial) for w in workers]
                time.sleep(1.0)  # every worker is mid-generation (a 96-token rollout takes several seconds)
                head = new_head(loaded.model, None, spec.draft_vocab_size, seed=trial)
                published_at = time.time()
                version = served.publish(head.state_dict(), DraftMeta(version=0, parent_version=None, policy_version=0,
                                                                      head_config=head_config(head)))
                ray.get(runs)
                gen_s = time.perf_counter() - t0
                after = ray.get([w.describe.remote() for w in workers])
                for b, a in zip(before, after):
                    # publish -> message received -> loaded -> serving (installed between two decode steps)
                    entry = next((e for e in a["swap_log"] if e["version"] == version), None)
                    if entry:
                        latencies.append(entry["serving_at"] - published_at)
                        parts["delivery"].append(entry["received_at"] - published_at)
                        parts["load"].append(entry["loaded_at"] - entry["received_at"])
                        parts["install_wait"].append(entry["serving_at"] - entry["loaded_at"])
                    loss_fractions.append((a["swap_seconds"] - b["swap_seconds"]) / gen_s)
                log(f"  trial {trial}: {len(latencies)} swaps so far")
            result["swap_p50_s"] = round(statistics.median(latencies), 3) if latencies else None
            result["swap_p99_s"] = round(pct(latencies, 0.99), 3) if latencies else None
            result["swap_count"] = len(latencies)
            result["swap_expected"] = swap_trials * len(workers)
            result["swap_decode_loss_fraction"] = round(statistics.mean(loss_fractions), 5)
            result["swap_parts_p50_s"] = {k: round(statistics.median(v), 3) for k, v in parts.items() if v}
            result["swap_parts_max_s"] = {k: round(max(v), 3) for k, v in parts.items() if v}

            log(f"(3) progress reporting overhead, {overhead_reps} alternations on one worker")
            w = workers[0]
            times = {True: [], False: []}
            direct = []  # time inside the reports / run time, for the runs with reporting on
            for rep in range(overhead_reps):
                for enabled in (True, False) if rep % 2 == 0 else (False, True):
                    ray.get(w.set_reporting.remote(enabled))
                    before = ray.get(w.describe.remote())["report_seconds"]
                    t0 = time.perf_counter()
                    ray.get(w.generate.remote(prompts, params, 200 + rep))
                    times[enabled].append(time.perf_counter() - t0)
                    if enabled:
                        direct.append((ray.get(w.describe.remote())["report_seconds"] - before) / times[True][-1])
            ray.get(w.set_reporting.remote(True))
            on, off = statistics.median(times[True]), statistics.median(times[False])
            # the reports run in the decode loop's own thread: the time inside them is what it loses
            result["progress_overhead_fraction"] = round(statistics.mean(direct), 5)
            result["progress_ab_fraction"] = round(on / off - 1, 4)  # on vs off wall time: noisy on shared cores
            result["progress_seconds"] = {"on": [round(x, 2) for x in times[True]],
                                          "off": [round(x, 2) for x in times[False]]}
    finally:
        ray.shutdown()
    return result


def add_arguments(p) -> None:
    p.add_argument("--model", default=SMOLLM2_SPEC)
    p.add_argument("--workers", type=int, default=4, help="rollout workers (logical GPUs)")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--swap-trials", type=int, default=3)


def run(args) -> dict:
    return bench_dataplane(model=args.model, num_workers=args.workers, num_steps=args.steps,
                           prompts_per_step=args.prompts, group_size=args.group_size,
                           max_new_tokens=args.new_tokens, swap_trials=args.swap_trials)
