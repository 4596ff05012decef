"""`tlt demo` / `make demo`: what the system does today, on the embedded defaults.

Today that is the rollout engine: SmolLM2-135M-Instruct on CPU generates a batch of rollouts with
plain decoding and with speculative decoding, and shows that the outputs are identical and what the
drafter saved. The scheduler service (REST, Redis, Ray) joins this demo as it lands.
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
    say(f"speculative vs plain wall time: {t_plain / t_spec:.2f}x")
    say(f"total demo time {time.perf_counter() - t0:.1f} s")
    return 0 if identical == len(plain) else 1


if __name__ == "__main__":
    sys.exit(run_demo())
