"""`tlt bench rl`'s figures from the jobs' step records and TLT counters: pure arithmetic over the REST API's JSON
(GET /v1/jobs/{id}/steps and /drafts), no Ray, no Redis, no torch.

Per step (step_row): the phases' seconds, the tail and its share of the rollout, idle and reclaimed
worker-seconds, the accepted length and the k served per live-batch bucket, the draft versions served and
published. The headline figures (figures) are ratios of sums over every step and repeat, and the last step's
means; goals_met compares them with GOALS (the GPU's, issue 40) or CPU_GOALS.
"""

from __future__ import annotations

import math
import statistics

from scheduler.served import accepted_by_bucket, bucket_rates, by_edge, k_rates, step_work, tail_accepted_length

ARMS = {"a": "plain", "b": "frozen", "c": "tlt"}
# a bucket counts in min_bucket_ratio_vs_plain once both arms decoded in it this long (seconds, all steps)
MIN_BUCKET_SECONDS = 2.0

# the headline keys and their goals on a GPU (issue 40, one H100 or H200, SmolLM2-135M); None: reported only.
# ("in", (lo, hi)): lo <= value <= hi; ("abs<", x): |value| < x
GOALS: dict[str, tuple | None] = {
    "rollout_speedup": (">=", 1.5), "step_speedup": (">=", 1.25), "tlt_vs_frozen_rollout_speedup": (">=", 1.05),
    "reclaimed_ratio": ("in", (0.9, 1.0)), "reward_delta_se": ("abs<", 2.0),
    "accepted_length_last_step_gain": (">=", 0.1),  # tlt's last-step accepted length over frozen's
    "accepted_length_last_step_tlt": None, "accepted_length_last_step_frozen": None,
    "tail_accepted_length_tlt": None, "tail_accepted_length_frozen": None,
    "seconds": ("<=", 480.0),  # the whole run, warm start included, from a fresh node
}
# this 2-core CPU's (issue 40, quiet box, the full size): the draft arms against plain, and speculation in the tail
CPU_GOALS: dict[str, tuple | None] = {
    "frozen_rollout_speedup": (">=", 1.15), "rollout_speedup": (">=", 1.05),
    "tail_accepted_length_tlt": (">=", 1.3), "tail_accepted_length_frozen": (">=", 1.3),
}


def met(value, goal: tuple | None) -> bool | None:
    """Whether `value` meets `goal` (GOALS' forms); None where there is no goal or no value."""
    if goal is None or value is None:
        return None
    op, target = goal
    if op == "in":
        return target[0] <= value <= target[1]
    if op == "abs<":
        return abs(value) < target
    return {"<=": value <= target, ">=": value >= target}[op]


def goals_for(device: str) -> dict[str, tuple | None]:
    return GOALS if device == "cuda" else CPU_GOALS


def goals_met(result: dict) -> dict[str, bool | None]:
    """{key: met} for each goal of the result's device that has one."""
    return {key: met(result.get(key), goal) for key, goal in goals_for(result["device"]).items() if goal is not None}


def step_seconds(step: dict) -> float:
    return sum(step["timings"].values())


def pooled_reward(steps: list[dict]) -> tuple[float, float, int]:
    """(mean, standard error, n) of the rollouts' rewards over `steps`, from each step's mean, std and count."""
    n = sum(s["num_rollouts"] for s in steps)
    if n == 0:
        return 0.0, 0.0, 0
    mean = sum(s["mean_reward"] * s["num_rollouts"] for s in steps) / n
    var = sum(s["num_rollouts"] * (s.get("reward_std", 0.0) ** 2 + (s["mean_reward"] - mean) ** 2) for s in steps) / n
    return mean, math.sqrt(var / max(n - 1, 1)), n


def bucket_ratios(arm: list[dict], plain: list[dict]) -> dict[str, float]:
    """{bucket: the arm's tokens/s over plain's} for the buckets both decoded in for MIN_BUCKET_SECONDS."""
    mine, theirs = bucket_rates(arm), bucket_rates(plain)
    return {name: mine[name][0] / theirs[name][0] for name in sorted(mine)
            if name in theirs and min(mine[name][1], theirs[name][1]) >= MIN_BUCKET_SECONDS}


def k_served(step: dict) -> dict[str, dict[str, int]]:
    """{bucket: {k: steps it served}} of one step, summed over workers."""
    return {name: {k: int(c[1]) for k, c in sorted(by_k.items(), key=lambda kc: int(kc[0]))}
            for name, by_k in sorted(step.get("bucket_served", {}).items(), key=by_edge)}


def per_step_means(runs: list[list[dict]], key) -> list[float]:
    """Step i's mean of key(step) over the repeats that reached step i."""
    num_steps = max((len(r) for r in runs), default=0)
    return [statistics.fmean(key(r[i]) for r in runs if len(r) > i) for i in range(num_steps)]


def reclaimed_of(run: dict, rl_step: int) -> float:
    """Worker-seconds of drafter training inside step rl_step's rollout (GET /drafts' reclaimed_by_step)."""
    return float((run.get("drafts") or {}).get("reclaimed_by_step", {}).get(str(rl_step), 0.0))


def step_row(step: dict, reclaimed: float) -> dict:
    """One step of one job as rl.json records it."""
    t = step["timings"]
    rollout = t.get("rollout", 0.0)
    return {"rl_step": step["rl_step"], "rollout_s": rollout, "tail_s": step["tail_s"],
            "tail_fraction": step["tail_s"] / rollout if rollout > 0 else 0.0,
            "step_s": step_seconds(step), "timings": t, "response_lengths": step["response_lengths"],
            "accepted_length": step["mean_accepted_length"],
            "accepted_length_by_bucket": accepted_by_bucket([step]),
            "accepted_length_drafting_by_bucket": accepted_by_bucket([step], drafting_only=True),
            "k_served_by_bucket": k_served(step), "speculation": step.get("speculation", {}),
            "draft_versions": step["draft_versions"],
            "draft_versions_published": step.get("draft_versions_published", []),
            "idle_worker_s": step["idle_worker_s"], "reclaimed_worker_s": reclaimed,
            # each worker's rollout seconds: with bucket_throughput's decode seconds, what its prefill and swaps took
            "worker_rollout_s": step.get("worker_rollout_s", {}),
            "mean_reward": step["mean_reward"], "bucket_throughput": step.get("bucket_throughput", {}),
            "bucket_served": step.get("bucket_served", {}), "grpo": step.get("grpo", {})}


def figures(runs: dict[str, list[dict]]) -> dict:
    """The JSON keys from each arm's runs: {arm: [{"steps": [...], "drafts": {...}}, ...]}."""
    steps = {arm: [s for r in rs for s in r["steps"]] for arm, rs in runs.items()}
    by_run = {arm: [r["steps"] for r in rs] for arm, rs in runs.items()}

    def total(arm: str, key) -> float:
        return sum(key(s) for s in steps[arm])

    def rollout(s):
        return s["timings"].get("rollout", 0.0)

    last = {arm: [r[-1] for r in by_run[arm] if r] for arm in runs}
    reward = {arm: pooled_reward(steps[arm]) for arm in runs}
    idle_c = sum(r["drafts"].get("idle_worker_s", 0.0) for r in runs["c"])
    reclaimed_c = sum(r["drafts"].get("reclaimed_worker_s", 0.0) for r in runs["c"])
    ratios = {arm: bucket_ratios(steps[arm], steps["a"]) for arm in ("b", "c")}
    accepted_last = {arm: statistics.fmean(s["mean_accepted_length"] for s in last[arm]) for arm in ("b", "c")}
    return {
        "rollout_speedup": total("a", rollout) / total("c", rollout),
        "step_speedup": total("a", step_seconds) / total("c", step_seconds),
        "frozen_rollout_speedup": total("a", rollout) / total("b", rollout),
        "frozen_step_speedup": total("a", step_seconds) / total("b", step_seconds),
        "tlt_vs_frozen_rollout_speedup": total("b", rollout) / total("c", rollout),
        "tlt_vs_frozen_rollout_speedup_last_step": (sum(rollout(s) for s in last["b"])
                                                     / sum(rollout(s) for s in last["c"])),
        "accepted_length_last_step_tlt": accepted_last["c"],
        "accepted_length_last_step_frozen": accepted_last["b"],
        "accepted_length_last_step_gain": accepted_last["c"] - accepted_last["b"],
        "tail_accepted_length_tlt": tail_accepted_length(steps["c"]),
        "tail_accepted_length_frozen": tail_accepted_length(steps["b"]),
        "reclaimed_ratio": reclaimed_c / idle_c if idle_c else 0.0,
        "reward_delta_se": ((reward["c"][0] - reward["a"][0])
                            / (math.hypot(reward["c"][1], reward["a"][1]) or float("inf"))),
        "frozen_reward_delta_se": ((reward["b"][0] - reward["a"][0])
                                   / (math.hypot(reward["b"][1], reward["a"][1]) or float("inf"))),
        "mean_reward": {ARMS[arm]: reward[arm][0] for arm in runs},
        "min_bucket_ratio_vs_plain": min(ratios["c"].values(), default=None),
        "min_bucket_ratio_vs_plain_frozen": min(ratios["b"].values(), default=None),
        "bucket_ratio_vs_plain": {ARMS[arm]: r for arm, r in ratios.items()},
        "bucket_tokens_per_s": {ARMS[arm]: {k: v[0] for k, v in bucket_rates(steps[arm]).items()} for arm in runs},
        "accepted_length_by_bucket": {ARMS[arm]: accepted_by_bucket(steps[arm]) for arm in runs},
        # each k's own tokens/s per worker where it served ({bucket: {k: [tokens/s, steps]}}): what the tuner chose from
        "k_tokens_per_s_by_bucket": {ARMS[arm]: k_rates(steps[arm]) for arm in runs},
        "rollout_share_of_step": {ARMS[arm]: total(arm, rollout) / total(arm, step_seconds) for arm in runs},
        "num_draft_versions_published": sum(len(s.get("draft_versions_published", [])) for s in steps["c"]),
        "per_step_mean": {ARMS[arm]: {
            "rollout_s": per_step_means(by_run[arm], rollout),
            "tail_s": per_step_means(by_run[arm], lambda s: s["tail_s"]),
            "step_s": per_step_means(by_run[arm], step_seconds),
            "accepted_length": per_step_means(by_run[arm], lambda s: s["mean_accepted_length"]),
            "mean_reward": per_step_means(by_run[arm], lambda s: s["mean_reward"]),
        } for arm in runs},
    }


def paired_steps(runs: dict[str, list[dict]]) -> dict[str, int]:
    """In how many (repeat, step) pairs every arm generated the same rollouts (scheduler.served.step_work), of how
    many: {"paired": n, "steps": m}."""
    num_repeats = min((len(rs) for rs in runs.values()), default=0)
    alike = [len({step_work(s) for s in steps}) == 1 for r in range(num_repeats)
             for steps in zip(*(rs[r]["steps"] for rs in runs.values()))]
    return {"paired": sum(alike), "steps": len(alike)}


def partial_figures(runs: dict[str, list[dict]]) -> dict:
    """With arm b or c left out: the ratios against plain that can be computed."""
    steps = {arm: [s for r in rs for s in r["steps"]] for arm, rs in runs.items()}
    out = {}
    for arm, prefix in (("c", ""), ("b", "frozen_")):
        if arm in runs:
            out[f"{prefix}rollout_speedup"] = (sum(s["timings"].get("rollout", 0.0) for s in steps["a"])
                                               / sum(s["timings"].get("rollout", 0.0) for s in steps[arm]))
            out[f"{prefix}step_speedup"] = sum(map(step_seconds, steps["a"])) / sum(map(step_seconds, steps[arm]))
            out[f"{prefix}bucket_ratio_vs_plain"] = bucket_ratios(steps[arm], steps["a"])
    return out
