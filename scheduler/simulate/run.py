"""`tlt simulate`: validate, then project; one JSON-ready dict (docs/bench/simulate.json)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from scheduler.simulate.cpu import load_bench
from scheduler.simulate.gpu import NEMO_8B
from scheduler.simulate.project import (
    ASSUMPTIONS,
    DEFAULT_GPUS,
    DEFAULT_TICK_WORKERS,
    GOAL_STEP_SPEEDUP,
    GOAL_TICK_P99_S,
    PROFILES,
    full_pass_estimate,
    project_point,
    seeds_for,
    tick_cost,
)
from scheduler.simulate.validate import shape_checks, validate_cpu, validate_nemo

PUBLISHED = {"tlt_paper_end_to_end": [1.7, 2.1], "nemo_rl_235b_projected_with_async": 2.5,
             "nemo_rl_8b_measured_step": round(NEMO_8B["step_s"] / NEMO_8B["step_spec_s"], 3)}
SNAPSHOTS_WANTED = 40  # tick inputs kept from the largest TLT run, to time the policy at other scales
SNAPSHOT_EVERY = 20  # of its ticks (an 8B rollout at 2,048 GPUs has a few hundred per step)


def run_all(profiles: Sequence[str] = tuple(PROFILES), gpus: Sequence[int] = DEFAULT_GPUS, num_steps: int = 5,
            tick_workers: Sequence[int] = DEFAULT_TICK_WORKERS, validation_seeds: int = 40,
            bench_dir: Path | None = None, log: Callable[[str], None] = lambda _msg: None) -> dict:
    unknown = [p for p in profiles if p not in PROFILES]
    if unknown or not profiles:
        raise ValueError(f"--profile must name some of {', '.join(PROFILES)}, got {', '.join(profiles) or 'none'}")
    if not gpus or any(not isinstance(n, int) or n < 1 for n in gpus):
        raise ValueError(f"--gpus must be GPU counts >= 1, got {list(gpus)}")
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"--steps must be >= 1, got {num_steps}")
    t0 = time.perf_counter()
    built = {name: PROFILES[name]() for name in profiles}
    log("validation: this machine's tlt bench rl (CPU profile)")
    validation = {"cpu": validate_cpu(validation_seeds, bench_dir)}
    if "gpu-8b" in built:
        log("validation: NeMo RL's 8B step speed-up")
        validation["nemo_rl_8b"] = validate_nemo(built["gpu-8b"])
    validation["shape"] = [shape_checks(p, 256) for p in built.values()]
    projections, snapshots = [], []
    for name, profile in built.items():
        for n in sorted(gpus):
            workers = max(1, n // profile.workload.gpus_per_worker)
            every = SNAPSHOT_EVERY if n == max(gpus) and name == profiles[0] else 0
            log(f"projection: {name} at {n} GPUs ({workers} workers)")
            row = project_point(profile, n, num_steps, seeds_for(workers), every)
            snapshots.extend(row.pop("_snapshots"))
            projections.append(row)
    ticks = {}
    if snapshots:
        policy_profile = built[profiles[0]]
        for n in tick_workers:
            log(f"policy tick at {n} simulated workers ({len(snapshots)} snapshots)")
            ticks[n] = tick_cost(snapshots[:SNAPSHOTS_WANTED], n, policy_profile)
    try:
        scheduler_bench = load_bench("scheduler", bench_dir)
    except ValueError:
        scheduler_bench = None
    goal_rows = [r for r in projections if r["profile"] == "gpu-8b" and r["num_gpus"] >= 64]
    largest = max(ticks) if ticks else None
    result = {
        "bench": "simulate",
        "config": {"profiles": list(profiles), "gpus": sorted(gpus), "num_steps": num_steps,
                   "tick_workers": list(tick_workers), "validation_seeds": validation_seeds},
        "validation": validation,
        "projections": projections,
        "policy_tick": {"pure_policy": {str(n): t for n, t in ticks.items()},
                        "full_pass_estimate": full_pass_estimate(ticks, scheduler_bench)},
        "goals": {"step_speedup_8b_64plus": GOAL_STEP_SPEEDUP, "tick_p99_s_at_largest": GOAL_TICK_P99_S},
        "met": {"step_speedup_8b_64plus": bool(goal_rows) and all(r["step_speedup"] >= GOAL_STEP_SPEEDUP
                                                                  for r in goal_rows),
                "tick_p99_s_at_largest": largest is not None and ticks[largest]["p99_s"] < GOAL_TICK_P99_S,
                "cpu_validation_within_15pct": validation["cpu"]["all_within_bound"],
                "nemo_validation_within_10pct": all(c.get("within_bound", True)
                                                    for c in validation.get("nemo_rl_8b", {}).get("checks", []))},
        "published": PUBLISHED,
        "assumptions": ASSUMPTIONS,
        "profiles": {name: {"description": p.description, "sources": p.sources, "parameters": p.summary()}
                     for name, p in built.items()},
        "seconds": time.perf_counter() - t0,
    }
    return result


def summary_lines(result: dict) -> list[str]:
    lines = ["validation:"]
    checks = result["validation"]["cpu"]["checks"] + result["validation"].get("nemo_rl_8b", {}).get("checks", [])
    for c in checks:
        bound = f"  (bound {c['bound']:.0%}: {'ok' if c['within_bound'] else 'OUTSIDE'})" if "bound" in c else ""
        lines.append(f"  {c['figure']:<28} measured {c['measured']:9.3f}  simulated {c['simulated']:9.3f}  "
                     f"error {c['error']:+.1%}{bound}")
    lines.append("projections (TLT over plain):")
    for r in result["projections"]:
        lines.append(f"  {r['profile']:<9} {r['num_gpus']:>5} GPUs  step x{r['step_speedup']:.2f}  rollout "
                     f"x{r['rollout_speedup']:.2f}  (frozen draft: step x{r['frozen_step_speedup']:.2f})  idle "
                     f"{r['idle_fraction_plain']:.0%}  reclaimed {r['reclaimed_ratio']:.0%}  bound if rollout free "
                     f"x{r['max_step_speedup_if_rollout_free']:.2f}")
    for n, t in result["policy_tick"]["pure_policy"].items():
        lines.append(f"policy tick at {n} workers: p50 {t['p50_s'] * 1e3:.1f} ms, p99 {t['p99_s'] * 1e3:.1f} ms")
    return lines
