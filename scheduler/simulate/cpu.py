"""The CPU profile: this machine's `tlt bench rl` job (SmolLM2-135M, 2 workers each pinned to a core),
calibrated on its measured runs (docs/bench/rl.json, docs/bench/scheduler.json) and on the measurements
docs/benchmarks.md reports. What is calibrated on the plain arm: the decode cost per live batch (bucket
tokens/s), the response lengths (the percentiles of all arms: speculation is lossless, the lengths are the
policy's), the learner's phases. The TLT and frozen arms' times are not used: they are what the simulator
must predict (scheduler/simulate/validate.py).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from scheduler.demo import DEMO_POLICY
from scheduler.simulate.cost import Forward, StepCost, rate_for_length
from scheduler.simulate.lengths import LengthKind, LengthModel, fit
from scheduler.simulate.profiles import Acceptance, Phases, Profile, Workload

BENCH_DIR = Path(__file__).resolve().parents[2] / "docs" / "bench"
PROMPT_TOKENS = 92.0  # longtail prompts in SmolLM2's chat template: mean 91.8 / 91.4 (seeds 0, 1; 73-124)
DRAFT_RELATIVE_COST = 0.11  # a draft token costs about 0.11x a policy step (docs/benchmarks.md, RL section)
# a lease on the other core no longer slows decoding here (2026-11-27: plain at batch 1 17.8 tokens/s alone, 18.0
# beside a drafter training on the other core; before issue 38's static path the TLT arm decoded at 0.89x plain)
TRAIN_SLOWDOWN = 1.0
# the shipped warm draft at T=1 on this box, batch 1, bf16 policy, 6 detailed-reasoning prompts x 256 tokens, k ->
# accepted length (2026-11-27, the draft rebuilt in session 27; the one before: 1.50 / 1.57 / 1.64 / 1.82)
WARM_ACCEPTED = {1: 1.48, 2: 1.83, 3: 1.94, 4: 1.91}
BEST_T1_ACCEPTED = (4, 1.95)  # tlt bench drafter: the best warm head's accepted length at T=1, k=4
DRIFT_RECOVERED = (60.0, 0.534)  # tlt bench drafter (b): 60 s of adaptation recovered 53.4% of the drift's loss


def load_bench(name: str, directory: Path | None = None) -> dict:
    path = (directory or BENCH_DIR) / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"the CPU profile is calibrated on {path}: run `tlt bench {name} --json` first")
    return json.loads(path.read_text())


def bucket_batch(bucket: str, max_batch: int) -> float:
    """A live-batch bucket's representative batch size: the middle of its range, within the largest batch."""
    low, _, high = bucket.partition("-")
    lo = int(low.rstrip("+"))
    hi = max_batch if bucket.endswith("+") else int(high or low)
    return (lo + max(min(hi, max_batch), lo)) / 2


def fit_decode_cost(rl: dict) -> tuple[float, float]:
    """(t0, t1) of a decode step t(B) = t0 + t1 B, least squares over the plain arm's buckets (B / tokens/s),
    weighted by the seconds decoded in each bucket."""
    cfg = rl["config"]
    max_batch = cfg["num_prompts_per_step"] * cfg["group_size"] // cfg["num_workers"]
    seconds: dict[str, float] = {}
    for run in rl["steps"]["plain"]:
        for step in run:
            for bucket, (_tokens, s) in step["bucket_throughput"].items():
                seconds[bucket] = seconds.get(bucket, 0.0) + s
    points = [(bucket_batch(b, max_batch), bucket_batch(b, max_batch) / tps, seconds.get(b, 0.0))
              for b, tps in rl["bucket_tokens_per_s"]["plain"].items()]
    w = sum(p[2] for p in points)
    mx, my = sum(x * s for x, _, s in points) / w, sum(y * s for _, y, s in points) / w
    slope = sum(s * (x - mx) * (y - my) for x, y, s in points) / sum(s * (x - mx) ** 2 for x, _, s in points)
    return my - slope * mx, slope


def length_targets(rl: dict) -> dict[str, float]:
    """What every arm's steps measured of the responses (lossless: the lengths are the policy's)."""
    steps = [s for arm in rl["steps"].values() for run in arm for s in run]
    cfg = rl["config"]
    per_step = cfg["num_prompts_per_step"] * cfg["group_size"]
    cap = cfg["max_new_tokens"]
    return {"median": statistics.fmean(s["response_lengths"]["median"] for s in steps),
            "p90": statistics.fmean(s["response_lengths"]["p90"] for s in steps),
            "mean": statistics.fmean(sum(t for t, _ in s["bucket_throughput"].values()) / per_step for s in steps),
            "max_at_cap": sum(s["response_lengths"]["max"] >= cap for s in steps) / len(steps)}


def fit_lengths(rl: dict) -> tuple[LengthModel, dict[str, float], dict[str, float]]:
    """The longtail task's mixture (1 detailed prompt in 10, workers.tasks.LONG_FRACTION) fitted to the runs."""
    cfg = rl["config"]
    cap, group = cfg["max_new_tokens"], cfg["group_size"]
    num_long = round(0.1 * cfg["num_prompts_per_step"]) * group
    num_short = cfg["num_prompts_per_step"] * group - num_long

    def build(x) -> LengthModel:
        return LengthModel((LengthKind(0.9, math.exp(x[0]), math.exp(x[1])),
                            LengthKind(0.1, math.exp(x[2]), math.exp(x[3]))), cap, exact_mix=True)

    def figures(m: LengthModel) -> dict[str, float]:
        short, long_ = m.kinds
        p_cap = 1 - (1 - long_.cap_probability(cap)) ** num_long * (1 - short.cap_probability(cap)) ** num_short
        return {"median": m.quantile(0.5), "p90": m.quantile(0.9), "mean": m.mean(), "max_at_cap": p_cap}

    targets = length_targets(rl)
    model, got = fit(build, figures, targets, [math.log(25), math.log(0.7), math.log(300), math.log(1.0)])
    return model, targets, got


def cpu_profile(directory: Path | None = None) -> Profile:
    rl, sched = load_bench("rl", directory), load_bench("scheduler", directory)
    cfg = rl["config"]
    t0, t1 = fit_decode_cost(rl)
    target = Forward(overhead_s=t0, per_token_s=t1)
    draft = Forward(overhead_s=DRAFT_RELATIVE_COST * t0, per_token_s=DRAFT_RELATIVE_COST * t1)
    lengths, _, _ = fit_lengths(rl)
    plain = rl["steps"]["plain"]
    num_steps = max(len(r) for r in plain)
    learner = tuple(statistics.fmean(sum(v for k, v in r[i]["timings"].items() if k not in ("rollout", "weight_sync"))
                                     for r in plain if len(r) > i) for i in range(num_steps))
    warm = statistics.fmean(rate_for_length(k, v) for k, v in WARM_ACCEPTED.items())
    budget, recovered = DRIFT_RECOVERED
    workers = sched["workers"]
    return Profile(
        name="cpu",
        description="this machine's tlt bench rl job: SmolLM2-135M on 2 workers (one core each), longtail task",
        workload=Workload(lengths=lengths, prompts_per_worker=cfg["num_prompts_per_step"] // cfg["num_workers"],
                          group_size=cfg["group_size"], prompt_tokens=PROMPT_TOKENS, draft_k=cfg["draft_k"]),
        cost=StepCost(target, draft),
        # the ceiling online training approaches: the best head measured, the drafter bench's or the shipped one
        acceptance=Acceptance(min_rate=0.05, max_rate=max(rate_for_length(*BEST_T1_ACCEPTED), warm), warm_rate=warm,
                              train_tau_s=-budget / math.log(1 - recovered), drift_retain=0.98,
                              train_steps_per_s=1.98, score_noise=0.05),
        phases=Phases(sync_s=statistics.fmean(s["timings"]["weight_sync"] for r in plain for s in r),
                      learner_s=learner, tick_s=0.25, dispatch_s=workers["dispatch_p50_s"],
                      preempt_s=workers["preemption_p50_s"], lease_setup_s=1.0, copy_publish_s=0.5,
                      scoring_s=10.0, publish_s=1.0, swap_s=0.16, train_slowdown=TRAIN_SLOWDOWN),
        policy=DEMO_POLICY,
        sources={
            "cost.target": f"fit t(B) = {t0:.4f} + {t1:.5f} B s to the plain arm's bucket tokens/s (rl.json); "
                           "prefill of B prompts of q tokens costs t0 + t1 B q (a forward over 5 tokens: "
                           f"{(t0 + 5 * t1) / (t0 + t1):.2f}x one, measured 1.33x)",
            "cost.draft": "a draft token 0.11x a policy step (docs/benchmarks.md, RL section)",
            "workload.prompt_tokens": "longtail prompts in SmolLM2's chat template, measured: mean 92 tokens",
            "workload.lengths": "two capped lognormals (1 detailed prompt in 10) fitted to every arm's median, "
                                "p90, mean tokens and share of steps whose longest response hit the cap",
            "acceptance.warm_rate": "the shipped warm draft at T=1 on this box: accepted 1.50/1.57/1.64/1.82 at k=1..4",
            "acceptance.max_rate": "tlt bench drafter: the best warm head accepts 1.95 at T=1, k=4",
            "acceptance.train_tau_s": "tlt bench drafter (b): 60 s of adaptation recover 53.4% of a drift's loss",
            "acceptance.drift_retain": "assumption: 2% of a draft's training lost per RL step",
            "acceptance.train_steps_per_s": "tlt bench drafter (c): 1.98 micro-steps/s",
            "phases.learner_s": "plain arm: reward + log-probs + update per step index (rl.json)",
            "phases.sync_s": "plain arm: mean weight sync (rl.json)",
            "phases.dispatch_s/preempt_s": "tlt bench scheduler p50 (scheduler.json)",
            "phases.swap_s": "tlt bench dataplane: swap p50 0.16 s",
            "phases.train_slowdown": "none: plain decoding at batch 1 beside a training drafter 18.0 vs 17.8 tokens/s",
            "phases.lease_setup_s/copy_publish_s/scoring_s/publish_s": "assumptions: seconds on a CPU",
            "policy": "scheduler.demo.DEMO_POLICY, as tlt bench rl runs it; tick 0.25 s",
        },
    )
