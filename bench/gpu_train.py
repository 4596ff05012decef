"""`tlt bench gpu` (b), (e), (f): the warm start, drafter training throughput and stops, drift.

(b) the warm draft: harvest the policy's rollouts and train a head from scratch on the device
    (drafter.train.warmstart.warm_start with bench.drafter's recipe), cached under $TLT_CACHE_DIR/drafters/ with
    the timings it was built in, keyed by the model, the device type and every size;
(e) micro-steps per second in float32 and under bf16 autocast (TrainConfig's defaults otherwise), in
    alternating slices, and stop-request-to-stopped latency (bench.drafter.stop_latencies);
(f) bench.drafter's drift part: the policy moves, the frozen draft loses acceptance, an online adaptation
    within a fixed budget wins some back.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable

import torch

from bench.drafter import _drift_part, _key, stop_latencies, warm_train_config
from bench.prompts import PROMPTS, synthetic_prompts
from drafter.decode.engine import Engine
from drafter.draft.head import EagleHead, head_from_state
from drafter.model.config import DRAFT_FORMAT, TrainConfig
from drafter.model.loading import default_cache_dir, encode_prompt
from drafter.train.buffer import RolloutBuffer
from drafter.train.checkpoint import load_draft
from drafter.train.trainer import DraftTrainer
from drafter.train.warmstart import HarvestConfig, harvest, warm_start
from workers.warm import WARM_TRAIN_SEED, task_prompts

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
              harvest_batch: int, num_steps: int, draft_vocab: int = 8192, num_unroll: int = 4,
              fresh: bool = False, progress: Callable[[str], None] = print) -> tuple[EagleHead, dict]:
    """The warm draft on the policy's device and what building it took: trained now, or read from the
    cache with the timings recorded when it was built (`cached`: true)."""
    policy = loaded.model
    parts = (loaded.name, torch.device(device).type, num_prompts, num_task_prompts, new_tokens, harvest_batch,
             num_steps, draft_vocab, num_unroll, DRAFT_FORMAT)
    out = default_cache_dir().parent / "drafters" / f"gpu-bench-{_key(*parts)}"
    path, timings = out / "draft-v000001.safetensors", out / TIMINGS_FILE
    if path.is_file() and timings.is_file() and not fresh:
        state, meta = load_draft(path)
        head = head_from_state(meta.head_config, state).to(policy.device)
        progress(f"reusing the warm draft {path} (built in {json.loads(timings.read_text())['warm_start_s']} s)")
        return head.eval().requires_grad_(False), {**json.loads(timings.read_text()), "cached": True,
                                                   "path": str(path)}
    texts = synthetic_prompts(num_prompts, seed=1)
    if num_task_prompts:
        texts += task_prompts("longtail", WARM_TRAIN_SEED, num_task_prompts, WARM_TAIL_FRACTION)
    prompts = [encode_prompt(tok, t) for t in texts]
    progress(f"warm start: {len(prompts)} prompts x {new_tokens} tokens at batch {harvest_batch}, {num_steps} steps")
    head, rep = warm_start(policy, tok, prompts, out, max_steps=num_steps,
                           train_cfg=warm_train_config(num_steps, num_unroll),
                           harvest_cfg=HarvestConfig(batch_size=harvest_batch, max_new_tokens=new_tokens),
                           draft_vocab_size=draft_vocab, progress=throttled(progress))
    info = {"harvest_s": round(rep.harvest_seconds, 2), "harvested_tokens": rep.num_harvested_tokens,
            "harvest_tokens_per_s": round(rep.num_harvested_tokens / max(rep.harvest_seconds, 1e-9), 1),
            "train_steps": rep.train_steps, "train_s": round(rep.train_seconds, 2),
            "train_steps_per_s": round(rep.train_steps / max(rep.train_seconds, 1e-9), 2),
            "train_tokens_per_s": round(rep.train_tokens_per_s, 1), "final_loss": round(rep.final_loss, 4),
            "warm_start_s": round(rep.harvest_seconds + rep.train_seconds, 2), "num_prompts": len(prompts),
            "new_tokens": new_tokens, "harvest_batch": harvest_batch, "device": device_name(device)}
    timings.write_text(json.dumps(info, indent=1) + "\n")
    return head.eval().requires_grad_(False), {**info, "cached": False, "path": rep.path}


def device_name(device: str) -> str:
    """The GPU's name on CUDA; "cpu: <model>" otherwise."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    from workers.results import cpu_model

    return f"cpu: {cpu_model()}"


def train_throughput(policy, head: EagleHead, buffer: RolloutBuffer, seconds: float, num_slices: int = 4) -> dict:
    """Training tokens/s in float32 and under bf16 autocast: one trainer each (a few untimed steps first),
    trained `seconds` each in alternating slices (num_slices in all), so both see the same machine."""
    trainers = {name: DraftTrainer(policy, copy.deepcopy(head), TrainConfig(bf16_autocast=bf16))
                for name, bf16 in (("fp32", False), ("bf16", True))}
    for trainer in trainers.values():
        trainer.train(buffer, max_steps=2)
    totals = {name: [0, 0, 0.0] for name in trainers}  # steps, tokens, seconds
    order = [n for r in range(num_slices // 2) for n in (("fp32", "bf16") if r % 2 == 0 else ("bf16", "fp32"))]
    for name in order:  # fp32 bf16 bf16 fp32 ...
        rep = trainers[name].train(buffer, max_seconds=seconds / (num_slices // 2))
        totals[name][0] += rep.num_steps
        totals[name][1] += rep.num_tokens
        totals[name][2] += rep.seconds
    out: dict = {}
    for name, (steps, tokens, secs) in totals.items():
        out[f"train_{name}_tokens_per_s"] = round(tokens / max(secs, 1e-9), 1)
        out[f"train_{name}_steps_per_s"] = round(steps / max(secs, 1e-9), 3)
    out["train_bf16_over_fp32"] = round(out["train_bf16_tokens_per_s"] / max(out["train_fp32_tokens_per_s"], 1e-9), 3)
    return out


def training(policy, head: EagleHead, buffer: RolloutBuffer, seconds: float, stop_trials: int) -> dict:
    """(e): throughput in both precisions, then stop latencies."""
    out = train_throughput(policy, head, buffer, seconds)
    latencies = sorted(stop_latencies(policy, head, buffer, stop_trials))
    return {**out, "stop_p50_s": round(latencies[len(latencies) // 2], 3), "stop_max_s": round(latencies[-1], 3),
            "stop_trials": len(latencies)}


def drift(engine: Engine, tok, head: EagleHead, k: int, num_eval_prompts: int, new_tokens: int, num_steps: int,
          num_adapt_prompts: int, adapt_seconds: float, draft_dtype, drift_lr: float = 1e-4,
          adapt_lr: float = 3e-4) -> tuple[dict, object, EagleHead, RolloutBuffer]:
    """(f): bench.drafter's drift part at draft length k; returns its figures, the moved policy, the adapted
    head and the new policy's harvest (for (e))."""
    result: dict = {}
    eval_prompts = [encode_prompt(tok, PROMPTS[i % len(PROMPTS)]) for i in range(num_eval_prompts)]
    new_policy, adapted, buffer = _drift_part(result, engine.model, tok, engine, eval_prompts, head, k, new_tokens,
                                              num_steps, drift_lr, num_adapt_prompts, adapt_lr, adapt_seconds,
                                              draft_dtype)
    return result, new_policy, adapted, buffer


def fresh_buffer(engine: Engine, tok, num_prompts: int = 64, new_tokens: int = 96) -> RolloutBuffer:
    """Rollouts to train on when (f) did not run: the policy's own, of held-out templated prompts."""
    buffer = RolloutBuffer(max_bytes=1 << 30)
    harvest(engine, [encode_prompt(tok, t) for t in synthetic_prompts(num_prompts, seed=9)], buffer, 0,
            HarvestConfig(max_new_tokens=new_tokens))
    return buffer

