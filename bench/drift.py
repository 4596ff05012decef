"""Drift and online adaptation, measured so that its effect shows: `tlt bench drafter` (b) and `tlt bench gpu` (f).

The policy is fine-tuned a few steps on another prompt distribution (a stand-in for RL updates); the frozen draft
loses accepted length; a copy adapted online for a fixed budget of training seconds, on the moved policy's own
rollouts sampled at T=1 (as RL samples), wins some back. Each accepted length is measured greedy and at T=1 on
held-out prompts (the 16 fixed ones, then templated prompts of a seed of their own), per prompt (batched), so that
each has a standard error, and the recovered fraction has one too (a paired bootstrap over the prompts: the three
drafts run the same prompts with the same seeds).
"""

from __future__ import annotations

import copy
import math
import random
import sys

import torch
import torch.nn.functional as F

from bench.prompts import PROMPTS, synthetic_prompts
from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import new_head
from drafter.model.config import TrainConfig
from drafter.model.loading import encode_prompt
from drafter.train.buffer import RolloutBuffer
from drafter.train.trainer import DraftTrainer
from drafter.train.warmstart import HarvestConfig, harvest

DRIFT_EVAL_SEED = 13  # templated held-out prompts (the warm start's are seed 1, the adaptation's 9, calibration's 11)
ADAPT_SEED = 9  # the moved policy's rollouts the adaptation trains on: the job's prompts, not the evaluation's
NUM_BOOTSTRAP = 2000  # resamples of the prompts for the recovered fraction's standard error
TEMPERATURES = {"greedy": 0.0, "t1": 1.0}  # the two ways the drafts are measured, and their keys' suffixes
EVAL_BATCH = 32  # prompts measured together


def log(msg: str) -> None:
    print(f"[bench drift] {msg}", file=sys.stderr, flush=True)


def eval_prompts(tok, num: int) -> list[list[int]]:
    """`num` held-out prompts: the 16 fixed ones first, then templated ones (DRIFT_EVAL_SEED)."""
    texts = PROMPTS[:num] + synthetic_prompts(max(0, num - len(PROMPTS)), seed=DRIFT_EVAL_SEED)
    return [encode_prompt(tok, t) for t in texts]


def per_prompt(engine: Engine, prompts: list[list[int]], k: int, drafter, temperature: float,
               new_tokens: int, batch_size: int = EVAL_BATCH) -> list[tuple[int, float]]:
    """(tokens, verify steps) of each prompt, generated new_tokens long (EOS ignored) with seed = its index, in
    batches of batch_size rows. A row's accepted length does not depend on the rows beside it (each drafts and
    is verified on its own, greedy outputs are plain decoding's), so batching changes its cost only: 256 prompts
    measure in the time 32 took one at a time."""
    out = []
    for start in range(0, len(prompts), batch_size):
        reqs = [Request(p, SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True,
                                          seed=start + i))
                for i, p in enumerate(prompts[start : start + batch_size])]
        outs = engine.generate(reqs, k=k, drafter=drafter if k else None)
        out += [(len(o.token_ids), float(o.num_steps)) for o in outs]
    return out


def ratio(runs: list[tuple[int, float]]) -> float:
    """The accepted length of `runs`: generated tokens over verify steps, summed over the prompts."""
    return sum(t for t, _ in runs) / max(sum(s for _, s in runs), 1e-9)


def ratio_se(runs: list[tuple[int, float]]) -> float:
    """Standard error of ratio(runs) over the prompts (the delta method for a ratio of sums)."""
    n = len(runs)
    if n < 2:
        return float("nan")
    r, mean_steps = ratio(runs), sum(s for _, s in runs) / n
    var = sum((t - r * s) ** 2 for t, s in runs) / (n - 1)
    return math.sqrt(var / n) / mean_steps


def recovered_fraction(before, frozen, adapted, seed: int = 0) -> tuple[float | None, float | None]:
    """(adapted - frozen) / (before - frozen) over the same prompts, and its paired-bootstrap standard error.
    None where the drift cost nothing (no loss to recover)."""
    def fraction(idx) -> float | None:
        b, f, a = (ratio([runs[i] for i in idx]) for runs in (before, frozen, adapted))
        return (a - f) / (b - f) if b - f > 1e-9 else None

    n = len(before)
    point = fraction(range(n))
    if point is None:
        return None, None
    rng = random.Random(seed)
    draws = [v for v in (fraction([rng.randrange(n) for _ in range(n)]) for _ in range(NUM_BOOTSTRAP)) if v is not None]
    mean = sum(draws) / len(draws)
    return point, math.sqrt(sum((v - mean) ** 2 for v in draws) / max(len(draws) - 1, 1))


def drift_policy(policy, tokenizer, steps: int, lr: float, seed: int = 0):
    """A stand-in for RL updates: fine-tune a copy of the policy on hotter samples of other prompts."""
    new = copy.deepcopy(policy).train().requires_grad_(True)
    engine = Engine(policy, tokenizer)
    prompts = [encode_prompt(tokenizer, t) for t in synthetic_prompts(32, seed=seed + 5, kind="drift")]
    reqs = [Request(p, SamplingParams(temperature=1.2, top_p=0.98, max_new_tokens=96, seed=seed + i))
            for i, p in enumerate(prompts)]
    seqs = [o.prompt_ids + o.token_ids for o in engine.generate(reqs)]
    opt = torch.optim.AdamW([p for p in new.parameters() if p.requires_grad], lr=lr)
    rng = random.Random(seed)
    device = new.device
    for _ in range(steps):
        batch = rng.sample(seqs, 8)
        L = max(len(s) for s in batch)
        ids = torch.tensor([s + [0] * (L - len(s)) for s in batch], device=device)  # (B, L), right-padded
        mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in batch], dtype=torch.bool, device=device)
        logits, _ = new(ids, torch.arange(L, device=device).expand(len(batch), L), None)
        loss = F.cross_entropy(logits[:, :-1][mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return new.eval().requires_grad_(False)


def adapt_config(lr: float, device_type: str = "cpu") -> TrainConfig:
    """Online adaptation of a trained head, as a lease runs it: a short warmup, then a cosine that reaches zero at
    the end of the time budget (anneal_to_budget), under bf16 autocast where the machine has native bf16.
    On a CPU, small micro-steps (2 rows of 256 pairs, 2 unrolled positions). Measured on SmolLM2 (docs/benchmarks.md,
    session 6 side runs, 60 s each): a flat 3e-4 in float32 recovered 0.29 of the drift's loss; bf16 doubled the
    steps (0.38); annealing to the budget took it to 0.51 (twice, two shuffles). Peaks of 2e-4 to 3e-4 did alike;
    6e-4 recovered 0.42, 4 rows 0.46, and one unrolled position 0.32, though it took the most steps.
    On a GPU, every position inference drafts (TrainConfig's num_unroll, weighed by reach) in micro-steps sized
    by tokens: 2 rows there ran launch-bound (584 steps of 2 rows in 15 s on an H100 recovered 0.055)."""
    if device_type == "cuda":
        return TrainConfig(lr=lr, warmup_steps=5, total_steps=10_000, anneal_to_budget=True, min_lr_ratio=0.0,
                           bf16_autocast=None, position_loss="reach")
    return TrainConfig(lr=lr, warmup_steps=5, total_steps=10_000, num_rows=2, num_unroll=2,
                       anneal_to_budget=True, min_lr_ratio=0.0, bf16_autocast=None)


def drift_part(result: dict, policy, tok, engine: Engine, prompts: list[list[int]], head, k: int, new_tokens: int,
               drift_steps: int, drift_lr: float, adapt_prompts: int, adapt_lr: float, adapt_seconds: float,
               draft_dtype, scratch_seconds: float = 0.0) -> tuple[object, object, RolloutBuffer]:
    """Measure the drift at draft length k on `prompts` (eval_prompts), greedy and at T=1; fill `result`; return
    the moved policy, the adapted head and the moved policy's rollouts. scratch_seconds > 0: the anchor too, a head
    trained from scratch on the same rollouts for that long by the warm start's settings (issue 39: an adapted draft
    should come within 0.1 accepted tokens of it), as drift_scratch_accepted_length(_t1)."""
    log(f"drift at k={k} on {len(prompts)} held-out prompts, greedy and T=1")
    runs: dict[str, dict[str, list]] = {name: {} for name in TEMPERATURES}

    def measure_all(stage: str, eng: Engine, pol, h) -> None:
        drafter = EagleDrafter(pol, h, draft_dtype)
        for name, temp in TEMPERATURES.items():
            runs[name][stage] = per_prompt(eng, prompts, k, drafter, temp, new_tokens)

    measure_all("before", engine, policy, head)
    new_policy = drift_policy(policy, tok, drift_steps, drift_lr)
    new_engine = Engine(new_policy, tok)
    measure_all("frozen", new_engine, new_policy, head)
    # the moved policy's rollouts of the job's prompts, sampled at T=1 as RL samples (generated by the rollout
    # anyway: not in the budget)
    buffer = RolloutBuffer(max_bytes=1 << 30)
    adapt_texts = synthetic_prompts(adapt_prompts, seed=ADAPT_SEED)
    num_tokens = harvest(new_engine, [encode_prompt(tok, t) for t in adapt_texts], buffer, 1,
                         HarvestConfig(max_new_tokens=new_tokens, temperature=1.0, top_p=1.0,
                                       batch_size=128 if new_policy.device.type == "cuda" else 16))
    adapted_head = copy.deepcopy(head)
    trainer = DraftTrainer(new_policy, adapted_head, adapt_config(adapt_lr, new_policy.device.type))
    rep = trainer.train(buffer, max_seconds=adapt_seconds)
    measure_all("adapted", new_engine, new_policy, adapted_head)
    if scratch_seconds > 0:
        scratch = new_head(new_policy, buffer, head.cfg.draft_vocab_size)
        scratch_cfg = TrainConfig(num_unroll=adapt_config(adapt_lr, new_policy.device.type).num_unroll,
                                  anneal_to_budget=True, bf16_autocast=False)
        DraftTrainer(new_policy, scratch, scratch_cfg).train(buffer, max_seconds=scratch_seconds)
        measure_all("scratch", new_engine, new_policy, scratch.eval().requires_grad_(False))
    result.update(drift_eval_prompts=len(prompts), drift_k=k, drift_adapt_train_seconds=round(rep.seconds, 1),
                  drift_adapt_steps=rep.num_steps, drift_adapt_bf16_autocast=trainer.bf16_autocast,
                  drift_adapt_tokens=num_tokens,
                  # passes over the moved policy's rollouts: many means the adaptation is short of data, not steps
                  drift_adapt_epochs=round(rep.num_tokens / max(sum(r.num_pairs for r in buffer.rollouts), 1), 2))
    for name, stages in runs.items():
        suffix = "" if name == "greedy" else "_t1"
        for stage, stage_runs in stages.items():
            result[f"drift_{stage}_accepted_length{suffix}"] = round(ratio(stage_runs), 3)
            result[f"drift_{stage}_accepted_length{suffix}_se"] = round(ratio_se(stage_runs), 3)
        frac, se = recovered_fraction(stages["before"], stages["frozen"], stages["adapted"])
        result[f"drift_recovered_fraction{suffix}"] = None if frac is None else round(frac, 3)
        result[f"drift_recovered{suffix}_se"] = None if se is None else round(se, 3)
        log(f"drift {name}: before {ratio(stages['before']):.3f}, frozen {ratio(stages['frozen']):.3f}, adapted "
            f"{ratio(stages['adapted']):.3f} (recovered {frac if frac is None else round(frac, 3)} +- {se})")
    return new_policy, adapted_head, buffer
