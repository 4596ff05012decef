"""`tlt bench gpu` (b), (e), (f): the warm start, drafter training throughput and stops, drift.

(b) the warm draft: harvest the policy's rollouts (templated and longtail task prompts, sampled at T=1) and train a
    head from scratch on the device by `tlt drafter train`'s recipe (workers.warm: on a GPU, a time budget), cached
    under $TLT_CACHE_DIR/drafters/ with the timings it was built in, keyed by the model, the device type, the recipe
    and every size;
(e) training tokens per second in float32 (TF32 matmuls on a GPU), under bf16 autocast and in pure bf16 with float32
    masters (TrainConfig's defaults otherwise: micro-steps sized by tokens on a GPU), in slices taken in turn, and
    stop-request-to-stopped latency (bench.drafter.stop_latencies);
(f) bench.drift: the policy moves, the frozen draft loses acceptance, an online adaptation within a fixed budget
    wins some back; greedy and T=1 on held-out prompts, each with its standard error.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable

import torch

from bench.drafter import stop_latencies
from bench.drafter_warm import _key
from bench.drift import drift_part, eval_prompts
from bench.prompts import synthetic_prompts
from drafter.decode.engine import Engine
from drafter.draft.head import EagleHead, head_from_state
from drafter.model.config import DRAFT_FORMAT, TrainConfig
from drafter.model.loading import default_cache_dir, encode_prompt
from drafter.train.buffer import RolloutBuffer
from drafter.train.checkpoint import load_draft
from drafter.train.trainer import DraftTrainer
from drafter.train.warmstart import HarvestConfig, harvest
from workers.warm import default_recipe, warm_start_by_recipe

WARM_TAIL_FRACTION = 0.75  # the longtail prompts of the warm start ask for detail (workers.warm.WarmRecipe's)
TIMINGS_FILE = "bench_gpu_warm.json"  # beside the cached draft: how long it took to build, on what


def throttled(progress: Callable[[str], None], every_s: float = 5.0) -> Callable[[str], None]:
    """`progress`, passing at most one message per `every_s` seconds (the warm start reports every step)."""
    last = [0.0]

    def say(msg: str) -> None:
        now = time.monotonic()
        if now - last[0] >= every_s:
            last[0] = now
            progress(msg)

    return say


def warm_head(loaded, tok, device: str, num_prompts: int, num_task_prompts: int, new_tokens: int,
              harvest_batch: int, num_steps: int, draft_vocab: int = 8192, num_unroll: int | None = None,
              fresh: bool = False, progress: Callable[[str], None] = print) -> tuple[EagleHead, dict]:
    """The warm draft on the policy's device and what building it took: trained now, or read from the
    cache with the timings recorded when it was built (`cached`: true). Built by `tlt drafter train`'s recipe
    (workers.warm.warm_start_by_recipe with the device's default_recipe), with the bench's sizes and its templated
    prompts besides the longtail task's; on a GPU the recipe's time budget binds before num_steps."""
    policy = loaded.model
    recipe = dataclasses.replace(default_recipe(device), num_prompts=num_task_prompts, max_new_tokens=new_tokens,
                                 batch_size=harvest_batch, num_steps=num_steps, draft_vocab_size=draft_vocab,
                                 num_eval_prompts=0, tail_fraction=WARM_TAIL_FRACTION,
                                 **({} if num_unroll is None else {"num_unroll": num_unroll}))
    parts = (loaded.name, torch.device(device).type, num_prompts, recipe.key(loaded.name, "longtail"), DRAFT_FORMAT)
    out = default_cache_dir().parent / "drafters" / f"gpu-bench-{_key(*parts)}"
    path, timings = out / "draft-v000001.safetensors", out / TIMINGS_FILE
    if path.is_file() and timings.is_file() and not fresh:
        state, meta = load_draft(path)
        head = head_from_state(meta.head_config, state).to(policy.device)
        progress(f"reusing the warm draft {path} (built in {json.loads(timings.read_text())['warm_start_s']} s)")
        return head.eval().requires_grad_(False), {**json.loads(timings.read_text()), "cached": True,
                                                   "path": str(path)}
    extra = tuple(synthetic_prompts(num_prompts, seed=1))
    progress(f"warm start: {num_task_prompts + len(extra)} prompts x {new_tokens} tokens at batch {harvest_batch}, "
             f"{num_steps} steps or {recipe.train_seconds} s, {recipe.num_unroll} positions by {recipe.position_loss}")
    rep = warm_start_by_recipe(loaded, "longtail", out, recipe, extra_prompts=extra, progress=throttled(progress))
    state, meta = load_draft(rep["path"])
    head = head_from_state(meta.head_config, state).to(policy.device)
    info = {"harvest_s": round(rep["harvest_seconds"], 2), "harvested_tokens": rep["num_harvested_tokens"],
            "harvest_tokens_per_s": round(rep["num_harvested_tokens"] / max(rep["harvest_seconds"], 1e-9), 1),
            "train_steps": rep["train_steps"], "train_s": round(rep["train_seconds"], 2),
            "train_steps_per_s": round(rep["train_steps"] / max(rep["train_seconds"], 1e-9), 2),
            "train_tokens_per_s": round(rep["train_tokens_per_s"], 1), "final_loss": round(rep["final_loss"], 4),
            "warm_start_s": round(rep["harvest_seconds"] + rep["train_seconds"], 2),
            "num_prompts": num_task_prompts + len(extra), "new_tokens": new_tokens, "harvest_batch": harvest_batch,
            "num_unroll": recipe.num_unroll, "position_loss": recipe.position_loss,
            "train_budget_s": recipe.train_seconds, "device": device_name(device)}
    timings.write_text(json.dumps(info, indent=1) + "\n")
    return head.eval().requires_grad_(False), {**info, "cached": False, "path": rep["path"]}


def device_name(device: str) -> str:
    """The GPU's name on CUDA; "cpu: <model>" otherwise."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    from workers.results import cpu_model

    return f"cpu: {cpu_model()}"


# the precisions (e) compares: float32 (TF32 matmuls on a GPU), bf16 autocast, pure bf16 with float32 masters
PRECISIONS = {"fp32": {"bf16_autocast": False}, "bf16": {"bf16_autocast": True},
              "bf16w": {"bf16_autocast": False, "bf16_weights": True}}


def train_throughput(policy, head: EagleHead, buffer: RolloutBuffer, seconds: float, num_slices: int = 4) -> dict:
    """Training tokens/s in each of PRECISIONS: one trainer each (a few untimed steps first), trained `seconds` each
    in slices taken in turn, the order rotating every round (num_slices // 2 rounds), so all see the same machine."""
    # TrainConfig's defaults otherwise: on a GPU, micro-steps of GPU_TOKENS_PER_STEP pairs
    trainers = {name: DraftTrainer(policy, copy.deepcopy(head), TrainConfig(**kwargs))
                for name, kwargs in PRECISIONS.items()}
    for trainer in trainers.values():
        trainer.train(buffer, max_steps=2)
    totals = {name: [0, 0, 0.0] for name in trainers}  # steps, tokens, seconds
    names, rounds = list(trainers), max(1, num_slices // 2)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # fp32 bf16 bf16w, bf16 bf16w fp32, ...
            rep = trainers[name].train(buffer, max_seconds=seconds / rounds)
            totals[name][0] += rep.num_steps
            totals[name][1] += rep.num_tokens
            totals[name][2] += rep.seconds
    out: dict = {}
    for name, (steps, tokens, secs) in totals.items():
        out[f"train_{name}_tokens_per_s"] = round(tokens / max(secs, 1e-9), 1)
        out[f"train_{name}_steps_per_s"] = round(steps / max(secs, 1e-9), 3)
    for name in ("bf16", "bf16w"):
        out[f"train_{name}_over_fp32"] = round(out[f"train_{name}_tokens_per_s"]
                                               / max(out["train_fp32_tokens_per_s"], 1e-9), 3)
    return out


def training(policy, head: EagleHead, buffer: RolloutBuffer, seconds: float, stop_trials: int) -> dict:
    """(e): throughput in each precision, then stop latencies."""
    out = train_throughput(policy, head, buffer, seconds)
    latencies = sorted(stop_latencies(policy, head, buffer, stop_trials))
    return {**out, "stop_p50_s": round(latencies[len(latencies) // 2], 3), "stop_max_s": round(latencies[-1], 3),
            "stop_trials": len(latencies)}


def drift(engine: Engine, tok, head: EagleHead, k: int, num_eval_prompts: int, new_tokens: int, num_steps: int,
          num_adapt_prompts: int, adapt_seconds: float, draft_dtype, drift_lr: float = 1e-4,
          adapt_lr: float = 3e-4, scratch_seconds: float = 0.0) -> tuple[dict, object, EagleHead, RolloutBuffer]:
    """(f): bench.drift at draft length k (greedy and T=1, with standard errors; with scratch_seconds, the anchor
    retrained from scratch on the same rollouts); returns its figures, the moved policy, the adapted head and the
    new policy's harvest (for (e))."""
    result: dict = {}
    new_policy, adapted, buffer = drift_part(result, engine.model, tok, engine, eval_prompts(tok, num_eval_prompts),
                                             head, k, new_tokens, num_steps, drift_lr, num_adapt_prompts, adapt_lr,
                                             adapt_seconds, draft_dtype, scratch_seconds)
    return result, new_policy, adapted, buffer


def fresh_buffer(engine: Engine, tok, num_prompts: int = 64, new_tokens: int = 96) -> RolloutBuffer:
    """Rollouts to train on when (f) did not run: the policy's own, of held-out templated prompts."""
    buffer = RolloutBuffer(max_bytes=1 << 30)
    harvest(engine, [encode_prompt(tok, t) for t in synthetic_prompts(num_prompts, seed=9)], buffer, 0,
            HarvestConfig(max_new_tokens=new_tokens))
    return buffer

