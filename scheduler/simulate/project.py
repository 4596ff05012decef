"""Projections: what TLT gives at 8 to 2,048 GPUs for the 8B and 235B-class profiles, and what the policy
costs per tick at 2,048 and 16,384 workers. `run_all` is what `tlt simulate` runs (validation first)."""

from __future__ import annotations

import gc
import statistics
import time

from scheduler.policy import WorkerView, choose_scorer, decide, group_copies, scoring_fits
from scheduler.simulate.gpu import gpu_8b_profile, gpu_235b_profile
from scheduler.simulate.model import ARMS, simulate
from scheduler.simulate.profiles import Profile
from scheduler.simulate.records import SimResult

PROFILES = {"gpu-8b": gpu_8b_profile, "gpu-235b": gpu_235b_profile}
DEFAULT_GPUS = (8, 64, 512, 2048)
DEFAULT_TICK_WORKERS = (2048, 16384)
GOAL_STEP_SPEEDUP, GOAL_TICK_P99_S = 2.0, 0.1
ASSUMPTIONS = [
    "synchronous GRPO: a step is weight sync, rollout (every worker to the barrier), then the learner",
    "weak scaling: prompts per GPU fixed, so the learner's seconds per step stay constant as GPUs grow",
    "a worker's share is one engine batch, all admitted at the start; KV-cache capacity never preempts a row",
    "every live row gains the expected accepted length per step (no per-row acceptance noise)",
    "adaptive speculation picks the best draft length per live batch as if measured (no exploration cost)",
    "acceptance follows training seconds and policy drift by Acceptance's curve; the GPU curve's ceiling "
    "(0.8 per position), time constant (1,800 s), drift (3% per step) and copy averaging (K^0.5) are assumptions",
    "a drafter lease and a scoring round take no time from generating GPUs (CPU profile: a measured slowdown)",
    "the learner waits for every trainer and scorer to release its GPU (preemption and scoring latencies count)",
    "the warm draft is NeMo RL's (accepted length 2.47 at k=3) for both GPU profiles",
]


def sums(runs: list[SimResult], key) -> float:
    return sum(key(s) for r in runs for s in r.steps)


def project_point(profile: Profile, num_gpus: int, num_steps: int, num_seeds: int, snapshot_every: int = 0) -> dict:
    workers = max(1, num_gpus // profile.workload.gpus_per_worker)
    wall = time.perf_counter()
    runs = {arm: [simulate(profile, workers, arm, seed, num_steps, snapshot_every if arm == "tlt" else 0)
                  for seed in range(num_seeds)] for arm in ARMS}
    plain, frozen, tlt = runs["plain"], runs["frozen"], runs["tlt"]

    def step(rs):
        return sums(rs, lambda s: s.step_s)

    def rollout(rs):
        return sums(rs, lambda s: s.rollout_s)

    def idle_fraction(rs):
        return sums(rs, lambda s: s.idle_worker_s) / sums(rs, lambda s: len(s.worker_s) * s.rollout_s)

    rest_tlt = step(tlt) - rollout(tlt)
    idle_tlt = sums(tlt, lambda s: s.idle_worker_s)
    half = step(plain) / 2 - rest_tlt
    last = [r.steps[-1] for r in tlt], [r.steps[-1] for r in plain]
    ticks = [t for r in tlt for t in r.tick_s]
    return {
        "profile": profile.name, "num_gpus": num_gpus, "num_workers": workers, "num_steps": num_steps,
        "num_seeds": num_seeds,
        "step_speedup": step(plain) / step(tlt), "rollout_speedup": rollout(plain) / rollout(tlt),
        "frozen_step_speedup": step(plain) / step(frozen), "frozen_rollout_speedup": rollout(plain) / rollout(frozen),
        "tlt_vs_frozen_step_speedup": step(frozen) / step(tlt),
        "last_step_speedup": sum(s.step_s for s in last[1]) / sum(s.step_s for s in last[0]),
        "idle_fraction_plain": idle_fraction(plain), "idle_fraction_tlt": idle_fraction(tlt),
        "reclaimed_ratio": sums(tlt, lambda s: s.reclaimed_worker_s) / idle_tlt if idle_tlt else 0.0,
        "accepted_length_tlt": statistics.fmean(s.accepted_length for r in tlt for s in r.steps),
        "accepted_length_frozen": statistics.fmean(s.accepted_length for r in frozen for s in r.steps),
        "acceptance_rate_first_last_tlt": [statistics.fmean(r.steps[0].rate_start for r in tlt),
                                           statistics.fmean(r.steps[-1].rate_end for r in tlt)],
        "plain_step_s": step(plain) / (num_steps * num_seeds), "tlt_step_s": step(tlt) / (num_steps * num_seeds),
        "plain_rollout_s": rollout(plain) / (num_steps * num_seeds),
        "tlt_rollout_s": rollout(tlt) / (num_steps * num_seeds),
        "rollout_share_plain": rollout(plain) / step(plain),
        # the step speed-up if the rollout took no time at all (the learner's phases bound it: Amdahl)
        "max_step_speedup_if_rollout_free": step(plain) / rest_tlt,
        "rollout_speedup_needed_for_2x": rollout(plain) / half if half > 0 else None,
        "num_leases": statistics.fmean(r.num_leases for r in tlt),
        "num_rounds": statistics.fmean(r.num_rounds for r in tlt),
        "num_published": statistics.fmean(r.num_published for r in tlt),
        "sim_tick_policy_p50_s": statistics.median(ticks) if ticks else None,
        "sim_tick_policy_p99_s": percentile(ticks, 0.99) if ticks else None,
        "wall_s": time.perf_counter() - wall,
        "_snapshots": [s for r in tlt for s in r.snapshots],
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def tiled(snapshot: dict, num_workers: int) -> dict:
    """A snapshot grown (or cut) to num_workers views: the worker views repeated under new ids."""
    views = snapshot["views"]
    copies = -(-num_workers // len(views))
    out = [v if i == 0 else v._replace(worker_id=f"{v.worker_id}.{i}") for i in range(copies) for v in views]
    leased = {f"{w}.{i}" if i else w for i in range(copies) for w in snapshot["leased"]}
    return {**snapshot, "views": out[:num_workers], "leased": frozenset(leased)}


def tick_cost(snapshots: list[dict], num_workers: int, profile: Profile, repeats: int = 3) -> dict:
    """Wall (and CPU) seconds of the watcher's policy work per tick on simulated records of num_workers workers: the
    records made into WorkerViews, decide and scoring_fits (what every tick runs; no Redis). A round's start
    (choose_scorer, group_copies: once per round, not per tick) is timed apart."""
    times, cpu_times, round_times = [], [], []
    for snap in snapshots:
        snap = tiled(snap, num_workers)
        records = [(v.worker_id, v.state, v.num_finished, v.num_total, v.timestamp, v.buffer_tokens)
                   for v in snap["views"]]
        del snap["views"]
        gc.collect()  # the simulation's own garbage is not the scheduler's
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.thread_time()
            views = [WorkerView(*r) for r in records]
            d = decide(views, snap["now"], snap["phase"], snap["now"] - snap["since"], snap["serving"], profile.policy,
                       leased=snap["leased"], busy=snap["busy"])
            scoring_fits(d.remaining_rollout_s, profile.phases.scoring_s, profile.policy)
            times.append(time.perf_counter() - wall)
            cpu_times.append(time.thread_time() - cpu)
            wall = time.perf_counter()
            choose_scorer(d.classes, snap["phase"], snap["trained"], snap["leased"])
            group_copies(snap["copies"])
            round_times.append(time.perf_counter() - wall)
    return {"num_workers": num_workers, "num_ticks": len(times), "p50_s": statistics.median(times),
            "p99_s": percentile(times, 0.99), "max_s": max(times),
            # CPU seconds of the tick's thread: what the box's other load does not add
            "cpu_p50_s": statistics.median(cpu_times), "cpu_p99_s": percentile(cpu_times, 0.99),
            "round_start_p50_s": statistics.median(round_times), "round_start_max_s": max(round_times)}


def full_pass_estimate(ticks: dict[int, dict], scheduler_bench: dict | None) -> dict | None:
    """The whole policy pass (Redis reads, parsing, the policy) at each scale: tlt bench scheduler's measured
    pass at 2,048 workers, its non-policy part scaled linearly in workers (an estimate, not a measurement)."""
    if not scheduler_bench or 2048 not in ticks:
        return None
    measured = scheduler_bench["policy_pass"]
    out = {}
    for q in ("p50", "p99"):
        io_per_worker = max(measured[f"policy_pass_{q}_s"] - ticks[2048][f"{q}_s"], 0.0) / measured["num_workers"]
        out[q] = {n: io_per_worker * n + t[f"{q}_s"] for n, t in ticks.items()}
    return {"measured_2048": {k: measured[k] for k in ("policy_pass_p50_s", "policy_pass_p99_s")},
            "estimated_p50_s": out["p50"], "estimated_p99_s": out["p99"]}


def seeds_for(num_workers: int) -> int:
    """Few workers: one seed's rollout is noisy, so average more (a fixed budget of simulated workers)."""
    return 4 if num_workers <= 16 else 2 if num_workers <= 128 else 1
