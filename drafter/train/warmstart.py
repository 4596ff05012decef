"""Offline warm start: generate with the policy, harvest, train a draft head, measure acceptance."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleHead, head_config, new_head
from drafter.model.causal_lm import CausalLM
from drafter.model.config import TrainConfig
from drafter.train.buffer import RolloutBuffer
from drafter.train.checkpoint import DraftMeta, draft_path, save_draft
from drafter.train.evaluate import acceptance_by_position, calibrate_draft_temperature
from drafter.train.trainer import DraftTrainer

Progress = Callable[[str], None]


def stderr_progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class HarvestConfig:
    batch_size: int = 16  # rollouts generated together; CPU throughput flattens beyond this
    max_new_tokens: int = 128
    temperature: float = 0.7  # sampled like RL rollouts, a little cooler so a small model stays on topic
    top_p: float = 0.95
    seed: int = 0


def harvest(engine: Engine, prompts: list[list[int]], buffer: RolloutBuffer, policy_version: int = 0,
            cfg: HarvestConfig | None = None, progress: Progress | None = None) -> int:
    """Generate rollouts for `prompts` and add them, with the policy's hidden states, to `buffer`.
    Returns the number of generated tokens."""
    cfg = cfg or HarvestConfig()
    total, start = 0, time.perf_counter()
    for i in range(0, len(prompts), cfg.batch_size):
        chunk = prompts[i : i + cfg.batch_size]
        reqs = [Request(p, SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                                          max_new_tokens=cfg.max_new_tokens, seed=cfg.seed + i + j))
                for j, p in enumerate(chunk)]
        outs = engine.generate(reqs, record_hidden=True)
        buffer.add_outputs(outs, policy_version)
        total += sum(len(o.token_ids) for o in outs)
        if progress:
            done = min(i + cfg.batch_size, len(prompts))
            rate = total / (time.perf_counter() - start)
            progress(f"harvest {bar(done, len(prompts))} {done}/{len(prompts)} prompts, {total} tokens, "
                     f"{rate:.0f} tok/s")
    return total


def bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def calibrate_on_prompts(engine: Engine, head: EagleHead, prompts: list[list[int]], k: int,
                         max_new_tokens: int, batch_size: int = 16,
                         held_out: RolloutBuffer | None = None) -> tuple[float, dict[float, float]]:
    """Sample held-out rollouts of `prompts` at temperature 1 (as RL samples), pick the draft
    temperature with the most expected tokens per step on them at k, and set it on the head.
    Returns it and every candidate's score. held_out: where the rollouts are kept (for more measures on them)."""
    held_out = RolloutBuffer(max_bytes=1 << 30) if held_out is None else held_out
    harvest(engine, prompts, held_out, 0, HarvestConfig(batch_size=batch_size, temperature=1.0, top_p=1.0,
                                                        max_new_tokens=max_new_tokens))
    tau, scores = calibrate_draft_temperature(head, engine.model, held_out.rollouts, k)
    head.cfg.draft_temperature = tau
    return tau, scores


def by_position(head: EagleHead, policy: CausalLM, held_out: RolloutBuffer, k: int) -> dict[str, list[float]]:
    """drafter.train.evaluate.acceptance_by_position on held-out rollouts, greedy and sampled at T=1 (with the
    head's draft temperature), rounded: where the head's accepted runs end."""
    return {name: [round(a, 3) for a in acceptance_by_position(head, policy, held_out.rollouts, k, greedy)]
            for name, greedy in (("greedy", True), ("t1", False))}


@dataclass
class Acceptance:
    k: int
    mean_accepted_length: float
    tokens_per_s: float
    acceptance_rate: float
    seconds: float
    token_ids: list[list[int]] = field(default_factory=list)  # per prompt, what was generated


def measure(engine: Engine, prompts: list[list[int]], k: int, drafter, temperature: float = 0.0,
            max_new_tokens: int = 96, seed: int = 0) -> Acceptance:
    """Batch-1 generation over `prompts` (one at a time, like a tail request); fixed length."""
    tokens = steps = drafted = accepted = 0
    generated = []
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        req = Request(p, SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, ignore_eos=True,
                                        seed=seed + i))
        out = engine.generate([req], k=k, drafter=drafter if k else None)[0]
        tokens, steps = tokens + len(out.token_ids), steps + out.num_steps
        generated.append(out.token_ids)
        drafted, accepted = drafted + out.num_draft_tokens, accepted + out.num_accepted
    dt = time.perf_counter() - start
    return Acceptance(k, tokens / max(steps, 1), tokens / dt, accepted / max(drafted, 1), dt, generated)


@dataclass
class WarmStartReport:
    num_prompts: int = 0
    num_harvested_tokens: int = 0
    harvest_seconds: float = 0.0
    train_steps: int = 0
    train_seconds: float = 0.0
    train_tokens_per_s: float = 0.0
    final_loss: float = 0.0
    path: str = ""
    acceptance: dict = field(default_factory=dict)  # k -> mean accepted length on held-out prompts
    draft_temperature: float = 1.0  # calibrated on held-out prompts when there are some
    draft_temperature_scores: dict = field(default_factory=dict)  # candidate -> expected tokens per step
    # "greedy" and "t1" -> per draft position j, P(j accepted | j-1 accepted) on the held-out rollouts
    acceptance_by_position: dict = field(default_factory=dict)


def warm_start(policy: CausalLM, tokenizer, prompts: list[list[int]], out_dir: str | Path,
               train_cfg: TrainConfig | None = None, harvest_cfg: HarvestConfig | None = None,
               max_steps: int | None = None, max_seconds: float | None = None, draft_vocab_size: int | None = 8192,
               eval_prompts: list[list[int]] | None = None, eval_ks: tuple[int, ...] = (2, 3, 4),
               progress: Progress | None = stderr_progress,
               harvest_file: str | Path | None = None) -> tuple[EagleHead, WarmStartReport]:
    """Train draft version 1 from scratch on the policy's own rollouts and save it in out_dir.
    With harvest_file: the rollouts are read from it when it exists (written by an earlier run with the
    same prompts and harvest settings: the caller keys it), else harvested and saved there."""
    if not prompts:
        raise ValueError("prompts must not be empty")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = Engine(policy, tokenizer)
    report = WarmStartReport(num_prompts=len(prompts))
    buffer = RolloutBuffer(max_bytes=4 << 30)
    t0 = time.perf_counter()
    if harvest_file is not None and Path(harvest_file).is_file():
        buffer.load(harvest_file)
        report.num_harvested_tokens = sum(r.num_pairs - r.num_prompt + 1 for r in buffer.rollouts)
        if progress:
            progress(f"harvest: {len(buffer)} rollouts read from {harvest_file}")
    else:
        report.num_harvested_tokens = harvest(engine, prompts, buffer, 0, harvest_cfg, progress)
        if harvest_file is not None:
            buffer.save(harvest_file)
    report.harvest_seconds = time.perf_counter() - t0
    # float32 whatever the policy's dtype: its weights are the optimizer's masters (AdamW's small steps would round
    # away in bf16 weights; the trainer's bf16 autocast, where native, gives bf16's speed)
    head = new_head(policy, buffer, draft_vocab_size).float()
    trainer = DraftTrainer(policy, head, train_cfg or TrainConfig(total_steps=max_steps or 1000, anneal_to_budget=False,
                                                                     bf16_autocast=False))
    steps_goal = max_steps or 0

    def on_step(step: int, stats: dict) -> None:
        if progress and (step % 10 == 0 or step == steps_goal):
            goal = f"/{steps_goal}" if steps_goal else ""
            progress(f"train {bar(step, steps_goal) if steps_goal else ''} step {step}{goal} loss {stats['loss']:.3f}"
                     f" draft acc@0 {stats.get('acc_0', 0):.2f}")

    rep = trainer.train(buffer, max_steps=max_steps, max_seconds=max_seconds, on_step=on_step)
    report.train_steps, report.train_seconds = rep.num_steps, rep.seconds
    report.train_tokens_per_s, report.final_loss = rep.tokens_per_s, rep.losses[-1] if rep.losses else 0.0
    head.eval().requires_grad_(False)
    if eval_prompts:
        hcfg = harvest_cfg or HarvestConfig()
        held_out = RolloutBuffer(max_bytes=1 << 30)
        tau, scores = calibrate_on_prompts(engine, head, eval_prompts, max(eval_ks), hcfg.max_new_tokens,
                                           hcfg.batch_size, held_out)
        report.acceptance_by_position = by_position(head, policy, held_out, max(eval_ks))
        report.draft_temperature = tau
        report.draft_temperature_scores = {str(t): round(v, 3) for t, v in scores.items()}
        if progress:
            progress(f"draft temperature {tau} (expected tokens per step at T=1, k={max(eval_ks)}: "
                     f"{scores[tau]:.2f}; at 1.0: {scores.get(1.0, float('nan')):.2f})")
    if eval_prompts:
        drafter = EagleDrafter(policy, head)
        for k in eval_ks:
            acc = measure(engine, eval_prompts, k, drafter)
            report.acceptance[str(k)] = round(acc.mean_accepted_length, 3)
            if progress:
                progress(f"acceptance k={k}: mean accepted length {acc.mean_accepted_length:.2f}, "
                         f"draft acceptance {acc.acceptance_rate:.0%}")
    # the file describes what was measured: greedy accepted length per k on the held-out prompts, and the
    # expected tokens per step at T=1 (k = the largest evaluated) that the draft temperature was picked by
    extra = {"warm_start": True, "num_prompts": len(prompts), "acceptance": dict(report.acceptance)}
    if report.draft_temperature_scores:
        extra["expected_accepted_length_t1"] = report.draft_temperature_scores[str(report.draft_temperature)]
    meta = DraftMeta(version=1, parent_version=0, policy_version=0, num_steps=rep.num_steps,
                     total_steps=rep.num_steps, num_tokens=rep.num_tokens, head_config=head_config(head),
                     created_at=time.time(), extra=extra)
    path = draft_path(out_dir, 1)
    save_draft(path, head.state_dict(), meta)
    report.path = str(path)
    return head, report
