"""The simulator against what was measured, before it projects anything.

1. This machine (`tlt bench rl`, docs/bench/rl.json): mean rollout and step seconds per RL step of the plain
   (TLT off), frozen-draft and TLT arms, simulated over many seeds with the CPU profile; bound: 15%. The
   plain arm's decode rates, lengths and learner times are calibration inputs, so its check is of the
   model's structure (prefill, the shrinking batch, the barrier); the frozen and TLT arms are predictions.
2. NeMo RL's 8B run: its step speed-up with EAGLE-3 (1.41x) from its own inputs (the 100 s generation and
   51.2 s rest of a step, accepted length 2.47 at k=3 throughout, 32 GPUs); bound: 10%.
3. The GPU length model's shape against the published figures it was not fitted to (reported, no bound).
Errors are reported as they come out: nothing here is tuned to meet a bound.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from scheduler.simulate.cpu import cpu_profile, load_bench
from scheduler.simulate.gpu import (
    NEMO_8B,
    SEER_LAST10_SHARE,
    SEER_ROLLOUT_SHARE,
    VERL_7412,
    VERL_BATCH,
    VERL_UTILISATION,
    nemo_8b_profile,
    request_seconds,
)
from scheduler.simulate.model import simulate
from scheduler.simulate.profiles import Profile

CPU_BOUND = 0.15
NEMO_BOUND = 0.10
BENCH_ARMS = {"plain": "plain", "frozen": "frozen", "tlt": "tlt"}  # rl.json arm -> simulated arm


def relative_error(simulated: float, measured: float) -> float:
    return (simulated - measured) / measured


def _check(name: str, measured: float, simulated: float, bound: float | None, **extra) -> dict:
    error = relative_error(simulated, measured)
    row = {"figure": name, "measured": measured, "simulated": simulated, "error": error, **extra}
    if bound is not None:
        row.update(bound=bound, within_bound=abs(error) <= bound)
    return row


def measured_cpu(rl: dict) -> dict[str, dict[str, float]]:
    """Per arm of rl.json: mean rollout, step and idle seconds per RL step, their standard errors, and the rest."""
    out = {}
    for arm, runs in rl["steps"].items():
        steps = [s for r in runs for s in r]
        se = {k: statistics.stdev(s[k] for s in steps) / len(steps) ** 0.5 for k in ("rollout_s", "step_s")}
        idle = sum(s["idle_worker_s"] for s in steps)
        out[arm] = {"rollout_s": statistics.fmean(s["rollout_s"] for s in steps),
                    "step_s": statistics.fmean(s["step_s"] for s in steps),
                    "idle_worker_s": idle / len(steps), "rollout_s_se": se["rollout_s"], "step_s_se": se["step_s"],
                    "accepted_length": statistics.fmean(s["accepted_length"] for s in steps),
                    "reclaimed_ratio": sum(s["reclaimed_worker_s"] for s in steps) / idle if idle else 0.0,
                    "num_steps": len(steps)}
    return out


def simulated_arm(profile: Profile, num_workers: int, arm: str, num_seeds: int, num_steps: int) -> dict[str, float]:
    runs = [simulate(profile, num_workers, arm, seed, num_steps) for seed in range(num_seeds)]
    steps = [s for r in runs for s in r.steps]
    idle = sum(s.idle_worker_s for s in steps)
    return {"rollout_s": statistics.fmean(s.rollout_s for s in steps),
            "step_s": statistics.fmean(s.step_s for s in steps),
            "idle_worker_s": idle / len(steps),
            "accepted_length": statistics.fmean(s.accepted_length for s in steps),
            "reclaimed_ratio": sum(s.reclaimed_worker_s for s in steps) / idle if idle else 0.0,
            "busy_fraction": statistics.fmean(s.busy_fraction for s in steps),
            "last10_share": statistics.fmean(s.last10_share for s in steps),
            "num_published": statistics.fmean(r.num_published for r in runs)}


def validate_cpu(num_seeds: int = 40, directory: Path | None = None) -> dict:
    rl = load_bench("rl", directory)
    profile = cpu_profile(directory)
    cfg = rl["config"]
    measured = measured_cpu(rl)
    checks, simulated = [], {}
    for arm, sim_arm in BENCH_ARMS.items():
        if arm not in measured:
            continue
        got = simulated[arm] = simulated_arm(profile, cfg["num_workers"], sim_arm, num_seeds, cfg["num_steps"])
        m = measured[arm]
        for key in ("rollout_s", "step_s"):
            checks.append(_check(f"{arm} {key}", m[key], got[key], CPU_BOUND, measured_se=m[f"{key}_se"]))
        checks.append(_check(f"{arm} idle_worker_s", m["idle_worker_s"], got["idle_worker_s"], None))
    if "tlt" in simulated:
        checks.append(_check("tlt reclaimed_ratio", measured["tlt"]["reclaimed_ratio"],
                             simulated["tlt"]["reclaimed_ratio"], None))
        for key, a, b in (("rollout_speedup", "plain", "tlt"), ("step_speedup", "plain", "tlt")):
            metric = key.split("_")[0] + "_s"
            checks.append(_check(key, measured[a][metric] / measured[b][metric],
                                 simulated[a][metric] / simulated[b][metric], None))
    bounded = [c for c in checks if "bound" in c]
    return {"profile": profile.name, "num_seeds": num_seeds, "num_steps": cfg["num_steps"], "checks": checks,
            "measured": measured, "simulated": simulated, "all_within_bound": all(c["within_bound"] for c in bounded),
            "max_abs_error": max(abs(c["error"]) for c in bounded)}


def validate_nemo(base: Profile, num_seeds: int = 3) -> dict:
    """NeMo RL's 8B step and generation speed-ups from its inputs (the 8B profile anchored on its times)."""
    profile = nemo_8b_profile(base)
    workers = NEMO_8B["num_gpus"] // profile.workload.gpus_per_worker
    plain = simulated_arm(profile, workers, "plain", num_seeds, 1)
    spec = simulated_arm(profile, workers, "frozen", num_seeds, 1)
    step = plain["step_s"] / spec["step_s"]
    gen = plain["rollout_s"] / spec["rollout_s"]
    return {"checks": [
        _check("nemo step_speedup", NEMO_8B["step_s"] / NEMO_8B["step_spec_s"], step, NEMO_BOUND),
        _check("nemo generation_speedup", NEMO_8B["gen_s"] / NEMO_8B["gen_spec_s"], gen, None),
        _check("nemo accepted_length", NEMO_8B["accepted_length"], spec["accepted_length"], None)],
        "num_gpus": NEMO_8B["num_gpus"], "num_seeds": num_seeds,
        "inputs": {"generation_s": NEMO_8B["gen_s"], "rest_of_step_s": NEMO_8B["step_s"] - NEMO_8B["gen_s"],
                   "accepted_length": NEMO_8B["accepted_length"], "k": NEMO_8B["k"], "speculation": "always"}}


def shape_checks(profile: Profile, num_gpus: int, num_seeds: int = 2) -> dict:
    """The length model's plain rollouts against the published shape figures (verl's two ratios were fitted)."""
    workers = max(1, num_gpus // profile.workload.gpus_per_worker)
    got = simulated_arm(profile, workers, "plain", num_seeds, 1)
    t = request_seconds(profile, VERL_BATCH)
    return {"profile": profile.name, "num_gpus": num_gpus, "checks": [
        _check("verl request min/max (fitted)", VERL_7412["min_s"] / VERL_7412["max_s"], float(t.min() / t.max()),
               None),
        _check("verl request mean/max (fitted)", VERL_7412["mean_s"] / VERL_7412["max_s"], float(t.mean() / t.max()),
               None),
        {"figure": "Seer: last 10% of requests' share of the rollout (published: up to)",
         "measured": SEER_LAST10_SHARE, "simulated": got["last10_share"]},
        {"figure": "verl recipe: baseline GPU utilisation (published range)", "measured": list(VERL_UTILISATION),
         "simulated": got["busy_fraction"],
         "within_range": VERL_UTILISATION[0] <= got["busy_fraction"] <= VERL_UTILISATION[1]},
        {"figure": "rollout share of the step (anchored: 8B on NeMo RL's 0.66, 235B on Seer's 72B 0.63)",
         "measured": {"seer": SEER_ROLLOUT_SHARE, "nemo_rl_8b": NEMO_8B["gen_s"] / NEMO_8B["step_s"]},
         "simulated": got["rollout_s"] / got["step_s"]}]}
