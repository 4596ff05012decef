"""`tlt demo` / `make demo`: what the system does today, on the embedded defaults.

1. The rollout engine: SmolLM2-135M-Instruct on CPU generates a batch of rollouts with plain and
   with speculative decoding; the outputs are identical, and it shows what the drafter saved.
2. The data plane: a private redis-server, local Ray with 4 logical GPUs, and one GRPO step of an
   arithmetic-task job on 4 rollout workers, with live progress from Redis and the step's phases,
   including the worker-seconds left idle at the barrier (what the scheduler will reclaim).
The REST scheduler joins this demo as it lands.
"""

from __future__ import annotations

import sys
import time

import torch

from drafter.drafters import NgramDrafter
from drafter.engine import Engine, Request
from drafter.loading import encode_prompt, load_model
from drafter.sampling import SamplingParams
from scheduler.bench.prompts import MATH

NUM_PROMPTS = 4
NEW_TOKENS = 96
K = 2  # verifying 3 tokens costs about 1.1x one token on CPU; 5 tokens cost 1.65x (docs/benchmarks.md)


def say(msg: str = "") -> None:
    print(msg, flush=True)


def run_demo() -> int:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    say("tlt-scheduler demo: the lossless speculative rollout engine on CPU")
    t0 = time.perf_counter()
    say("loading SmolLM2-135M-Instruct (the first run converts the packaged GGUF, ~20 s; later runs reuse it)...")
    loaded = load_model("smollm2-135m")
    say(f"  loaded in {time.perf_counter() - t0:.1f} s: {loaded.model.cfg.num_layers} layers, "
        f"vocab {loaded.model.cfg.vocab_size}")
    engine = Engine(loaded.model, loaded.tokenizer)
    prompts = MATH[:NUM_PROMPTS]
    reqs = [Request(encode_prompt(loaded.tokenizer, p), SamplingParams(max_new_tokens=NEW_TOKENS)) for p in prompts]
    results = {}
    for label, k, drafter in (("plain", 0, None), (f"n-gram k={K}", K, NgramDrafter())):
        say(f"generating {len(reqs)} rollouts as one batch, {label}...")
        t = time.perf_counter()
        outs = engine.generate(reqs, k=k, drafter=drafter)
        dt = time.perf_counter() - t
        tokens = sum(len(o.token_ids) for o in outs)
        steps = sum(o.num_steps for o in outs)
        results[label] = (outs, dt)
        say(f"  {tokens} tokens in {dt:.1f} s ({tokens / dt:.1f} tok/s), {steps} sequence-steps, "
            f"{tokens / steps:.2f} tokens per policy forward")
    (plain, t_plain), (spec, t_spec) = results.values()
    say()
    for prompt, out in zip(prompts, plain):
        say(f"Q: {prompt}")
        say(f"A: {out.text.strip()[:400]}")
        say()
    identical = sum(a.token_ids == b.token_ids for a, b in zip(plain, spec))
    say(f"speculative outputs identical to plain greedy: {identical}/{len(plain)}")
    say(f"speculative vs plain wall time: {t_plain / t_spec:.2f}x (a batch of 4 is compute-bound on 2 CPU cores; "
        "drafting pays in the batch-1 tail: docs/benchmarks.md)")
    ok = identical == len(plain)
    say()
    run_job_demo()
    say(f"total demo time {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


def run_job_demo() -> None:
    import tempfile

    import ray

    from workers.driver import JobConfig, JobDriver
    from workers.grpo import GRPOConfig
    from workers.protocol import read_progress
    from workers.redis_server import PrivateRedis
    from workers.rollout import WorkerConfig

    say("data plane: private redis-server, local Ray with 4 logical GPUs, one GRPO step on SmolLM2")
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        with PrivateRedis() as server:
            client = server.client()
            cfg = JobConfig(job_id="demo", model="smollm2-135m", num_steps=1, num_prompts_per_step=4,
                            max_new_tokens=64, num_workers=4, store_dir=tempfile.mkdtemp(prefix="tlt-demo-"),
                            worker=WorkerConfig(model="smollm2-135m", k=2), grpo=GRPOConfig(group_size=2))
            driver = JobDriver.remote(cfg, server.url)
            run = driver.run.remote()
            last = ""
            while True:
                done, _ = ray.wait([run], timeout=2.0)
                rows = read_progress(client, "demo")
                line = "  ".join(f"{r.worker_id}:{r.state.value[:4]} {r.num_finished}/{r.num_total}" for r in rows)
                if line and line != last:
                    say(f"  progress  {line}")
                    last = line
                if done:
                    break
            (step,) = ray.get(run)
            total = sum(step["timings"].values())
            say(f"  step 0 took {total:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in step["timings"].items()))
            say(f"  rollout share {step['timings']['rollout'] / total:.0%}; per-worker rollout "
                + ", ".join(f"{w} {s:.1f} s" for w, s in sorted(step["worker_rollout_s"].items())))
            say(f"  idle worker-seconds at the barrier: {step['idle_worker_s']:.1f} (to be reclaimed by the scheduler)")
            say(f"  {step['num_rollouts']} rollouts, mean reward {step['mean_reward']:.2f}, "
                f"policy version now {step['policy_version']}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(run_demo())
