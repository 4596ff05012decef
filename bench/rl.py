"""`tlt bench rl --json`: the same seeded RL job three ways, on this machine, through the scheduler's REST API.

    a  plain decoding (tlt off)
    b  speculative decoding with the frozen warm draft (tlt on, idle_training off: no leases, no swaps)
    c  TLT: the warm draft, adaptive speculation, idle-time drafter training and hot swap

Each repeat runs the three jobs one after the other on a private Redis, local Ray and the scheduler app;
the order turns round on every repeat (abc, cba, abc, ...) so that drift in the machine's speed falls on
all three alike, and a repeat draws its prompts with its own seed. Nothing else may run on the machine.

Per step and arm it records rollout, tail and step seconds, response-length percentiles, the accepted
length, the draft version served, idle and reclaimed worker-seconds and the mean reward; the figures
(JSON keys) are ratios of sums over every step and repeat, and the last step's means. The JSON object
is printed last and written to docs/bench/rl.json by the registry (bench/cli.py); with --device cuda the jobs
run on the machine's GPUs (JobSpec.device; workers share a GPU when they outnumber them) and the result, with
`device` and the GPU's name, goes to docs/bench/rl_gpu.json instead. --size smallest proves the path in about
a minute (the tiny preset, one step, its own small warm draft built first).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ARMS = {"a": "plain", "b": "frozen", "c": "tlt"}
ARM_SPEC = {"a": {"tlt": False}, "b": {"tlt": True, "idle_training": False}, "c": {"tlt": True}}
# a bucket counts in min_bucket_ratio_vs_plain once both arms decoded in it this long (seconds, all steps)
MIN_BUCKET_SECONDS = 2.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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


def bucket_rates(steps: list[dict]) -> dict[str, tuple[float, float]]:
    """{live-batch bucket: (tokens/s, seconds decoded)} over `steps`."""
    acc: dict[str, list[float]] = {}
    for s in steps:
        for name, (tokens, seconds) in s.get("bucket_throughput", {}).items():
            a = acc.setdefault(name, [0.0, 0.0])
            a[0], a[1] = a[0] + tokens, a[1] + seconds
    return {name: (t / s, s) for name, (t, s) in acc.items() if s > 0}


def bucket_ratios(arm: list[dict], plain: list[dict]) -> dict[str, float]:
    """{bucket: the arm's tokens/s over plain's} for the buckets both decoded in for MIN_BUCKET_SECONDS."""
    mine, theirs = bucket_rates(arm), bucket_rates(plain)
    return {name: mine[name][0] / theirs[name][0] for name in sorted(mine)
            if name in theirs and min(mine[name][1], theirs[name][1]) >= MIN_BUCKET_SECONDS}


def per_step_means(runs: list[list[dict]], key) -> list[float]:
    """Step i's mean of key(step) over the repeats that reached step i."""
    num_steps = max((len(r) for r in runs), default=0)
    return [statistics.fmean(key(r[i]) for r in runs if len(r) > i) for i in range(num_steps)]


def step_row(step: dict, reclaimed: float) -> dict:
    t = step["timings"]
    return {"rl_step": step["rl_step"], "rollout_s": t.get("rollout", 0.0), "tail_s": step["tail_s"],
            "step_s": step_seconds(step), "timings": t, "response_lengths": step["response_lengths"],
            "accepted_length": step["mean_accepted_length"], "draft_versions": step["draft_versions"],
            "idle_worker_s": step["idle_worker_s"], "reclaimed_worker_s": reclaimed,
            "mean_reward": step["mean_reward"], "speculation": step.get("speculation", {}),
            "bucket_throughput": step.get("bucket_throughput", {}), "grpo": step.get("grpo", {})}


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
    return {
        "rollout_speedup": total("a", rollout) / total("c", rollout),
        "step_speedup": total("a", step_seconds) / total("c", step_seconds),
        "frozen_rollout_speedup": total("a", rollout) / total("b", rollout),
        "frozen_step_speedup": total("a", step_seconds) / total("b", step_seconds),
        "tlt_vs_frozen_rollout_speedup": total("b", rollout) / total("c", rollout),
        "tlt_vs_frozen_rollout_speedup_last_step": (sum(rollout(s) for s in last["b"])
                                                     / sum(rollout(s) for s in last["c"])),
        "accepted_length_last_step_tlt": statistics.fmean(s["mean_accepted_length"] for s in last["c"]),
        "accepted_length_last_step_frozen": statistics.fmean(s["mean_accepted_length"] for s in last["b"]),
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
        "rollout_share_of_step": {ARMS[arm]: total(arm, rollout) / total(arm, step_seconds) for arm in runs},
        "per_step_mean": {ARMS[arm]: {
            "rollout_s": per_step_means(by_run[arm], rollout),
            "tail_s": per_step_means(by_run[arm], lambda s: s["tail_s"]),
            "step_s": per_step_means(by_run[arm], step_seconds),
            "accepted_length": per_step_means(by_run[arm], lambda s: s["mean_accepted_length"]),
            "mean_reward": per_step_means(by_run[arm], lambda s: s["mean_reward"]),
        } for arm in runs},
    }


def bench_rl(*, num_steps: int = 3, num_repeats: int = 2, num_prompts_per_step: int = 10, group_size: int = 4,
             max_new_tokens: int = 512, num_workers: int = 2, draft_k: int = 4, task: str = "longtail",
             model: str = "smollm2-135m", warm_draft: str | None = None, seed: int = 0,
             arms: str = "abc", device: str = "cpu", warm_recipe=None) -> dict:
    """device "cuda": every job on this machine's GPUs (JobSpec.device), its workers sharing them when they
    outnumber them (JobSpec.gpus_per_worker), the warm draft built there if none is cached; "cpu": each worker
    pinned to its own cores. warm_recipe: the workers.warm.WarmRecipe of the warm draft (None: its defaults)."""
    import ray

    from scheduler.app import Settings
    from scheduler.client import call
    from scheduler.demo import DEMO_POLICY, run_job, start_server
    from scheduler.paths import default_roots
    from workers.protocol.keys import RAY_NAMESPACE
    from workers.protocol.states import JobState
    from workers.redis_server import PrivateRedis

    if not arms or set(arms) - set(ARMS) or len(set(arms)) != len(arms):
        raise ValueError(f"arms must name some of a, b, c once each, got {arms!r}")
    if "a" not in arms or not set(arms) & {"b", "c"}:
        raise ValueError(f"arms must hold a (plain: every ratio is against it) and b or c, got {arms!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    t0 = time.perf_counter()
    if warm_draft is None and set(arms) & {"b", "c"}:
        warm_draft = warm_draft_for(model, task, device, warm_recipe)
    base = {"model": model, "task": task, "num_steps": num_steps, "num_prompts_per_step": num_prompts_per_step,
            "group_size": group_size, "max_new_tokens": max_new_tokens, "num_workers": num_workers,
            "draft_k": draft_k, "temperature": 1.0, "device": device}
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    # on CUDA, Ray counts the machine's GPUs; on a CPU, a logical one per worker (each pinned to its own cores)
    ray.init(num_cpus=num_workers, num_gpus=num_workers if device == "cpu" else None, namespace=RAY_NAMESPACE,
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        base["gpus_per_worker"] = gpu_share(int(ray.cluster_resources().get("GPU", 0)), num_workers, device)
        with PrivateRedis() as redis_server:
            store_dir = tempfile.mkdtemp(prefix="tlt-bench-rl-")
            # the warm draft named on the command line is allowed wherever it is (the server's roots bound REST)
            roots = default_roots(store_dir) + ((str(Path(warm_draft).resolve().parent),) if warm_draft else ())
            settings = Settings(redis_url=redis_server.url, store_dir=store_dir, start_ray=False, policy=DEMO_POLICY,
                                watch_tick_s=0.25, model_roots=roots)
            url, server = start_server(settings)
            for r in range(num_repeats):
                order = arms if r % 2 == 0 else arms[::-1]
                for arm in order:
                    spec = base | ARM_SPEC[arm] | {"seed": seed + r}
                    if arm != "a":
                        spec["warm_draft"] = warm_draft
                    with contextlib.redirect_stdout(sys.stderr):
                        job = run_job(url, spec, f"repeat {r + 1}/{num_repeats}, {arm} ({ARMS[arm]})")
                    if job["state"] != JobState.SUCCEEDED:
                        raise RuntimeError(f"arm {arm} ({ARMS[arm]}), repeat {r + 1}: job {job['job_id']} "
                                           f"{job['state']}: {job.get('error')}")
                    steps = call("GET", url, f"/v1/jobs/{job['job_id']}/steps")
                    drafts = call("GET", url, f"/v1/jobs/{job['job_id']}/drafts") if arm == "c" else {}
                    runs[arm].append({"job_id": job["job_id"], "steps": steps, "drafts": drafts})
                    log(f"  {ARMS[arm]}: rollout {sum(s['timings'].get('rollout', 0) for s in steps):.1f} s, "
                        f"step {sum(step_seconds(s) for s in steps):.1f} s, accepted length per step "
                        f"{[round(s['mean_accepted_length'], 2) for s in steps]}")
            server.should_exit = True
            server.thread.join(30)
    finally:
        ray.shutdown()
    full = set(arms) == set(ARMS)
    result = {"bench": "rl", "device": device, "config": base | {"num_repeats": num_repeats, "arms": arms,
                                                                 "seed": seed, "warm_draft": warm_draft},
              **(figures(runs) if full else partial_figures(runs)),
              "steps": {ARMS[arm]: [[step_row(s, reclaimed_of(r, s["rl_step"])) for s in r["steps"]] for r in rs]
                        for arm, rs in runs.items()},
              "seconds": time.perf_counter() - t0}
    if device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
    return result


def reclaimed_of(run: dict, rl_step: int) -> float:
    """Worker-seconds of drafter training inside step rl_step's rollout (GET /drafts' reclaimed_by_step)."""
    return float((run.get("drafts") or {}).get("reclaimed_by_step", {}).get(str(rl_step), 0.0))


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


def gpu_share(num_gpus: int, num_workers: int, device: str) -> float:
    """JobSpec.gpus_per_worker for `num_workers` workers on `num_gpus` GPUs: a GPU each where there are enough,
    else an equal share of them, at Ray's resolution (4 decimals). 1.0 on the CPU (logical GPUs, one each)."""
    if device == "cpu":
        return 1.0
    if num_gpus < 1:
        raise ValueError("--device cuda: Ray finds no GPU on this machine")
    return min(1.0, math.floor(num_gpus / num_workers * 10_000) / 10_000)


def warm_draft_for(model: str, task: str, device: str, recipe) -> str:
    """The warm draft arms b and c start from: the one cached for `recipe` (workers.warm.WarmRecipe; None: its
    defaults), else built now on `device` when that is quick (a GPU, about 2 minutes; or a recipe other than the
    default, such as the smallest size's). ValueError when the default recipe would take 15 minutes on the CPU."""
    from workers.warm import WarmRecipe, ensure_warm_draft, warm_cache_dir

    recipe = recipe or WarmRecipe()
    path = ensure_warm_draft(model, task, device, recipe, is_build_allowed=False)
    if path is not None:
        log(f"warm draft: reusing the cached {path}")
        return path
    if device == "cpu" and recipe == WarmRecipe():
        raise ValueError("arms b and c start from a warm draft: build one with `make warm-draft` (about 15 minutes "
                         "on a 2-core CPU), pass --warm-draft, or run with --device cuda (built there)")
    log(f"warm draft: building it on {device} ({recipe.num_prompts} prompts, {recipe.num_steps} steps), cached in "
        f"{warm_cache_dir(model, task, recipe)}")
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        path = ensure_warm_draft(model, task, device, recipe)
    log(f"warm draft: built in {time.perf_counter() - t0:.0f} s")
    return path


FULL = {"model": "smollm2-135m", "task": "longtail", "steps": 3, "repeats": 2, "prompts": 10, "group_size": 4,
        "new_tokens": 512, "workers": 2, "k": 4}
# --size: "full" measures (on one GPU, with the warm draft cached, about 6 minutes: unmeasured yet); "smallest"
# proves the path in about a minute on a 2-core CPU: the tiny preset, one step, its own small warm draft
SIZES = {"full": FULL, "smallest": FULL | {"model": "tiny", "task": "arithmetic", "steps": 1, "repeats": 1,
                                             "prompts": 2, "group_size": 2, "new_tokens": 16, "k": 2}}
SMALLEST_RECIPE = {"num_prompts": 4, "max_new_tokens": 16, "num_steps": 4, "batch_size": 4, "num_eval_prompts": 0}


def add_arguments(p) -> None:
    from workers.tasks import TASKS

    p.add_argument("--size", default="full", choices=sorted(SIZES), help="the defaults of the options below: full "
                   "(the measurement), smallest (the tiny preset, one step: proves the path in about a minute)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the jobs run (JobSpec.device); "
                   "cuda writes rl_gpu.json, with the workers sharing the GPUs when they outnumber them")
    p.add_argument("--model", default=None, help=f"default {FULL['model']}")
    p.add_argument("--task", default=None, choices=sorted(TASKS), help=f"default {FULL['task']}")
    p.add_argument("--steps", type=int, default=None, help=f"RL steps per job (default {FULL['steps']})")
    p.add_argument("--repeats", type=int, default=None, help="runs of each arm; the order turns round each time "
                   f"(default {FULL['repeats']})")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (longtail: 1 in 10 asks for detail; "
                   f"default {FULL['prompts']})")
    p.add_argument("--group-size", type=int, default=None, help=f"default {FULL['group_size']}")
    p.add_argument("--new-tokens", type=int, default=None, help=f"default {FULL['new_tokens']}")
    p.add_argument("--workers", type=int, default=None, help="rollout workers, each pinned to its own core on a "
                   f"CPU (default {FULL['workers']})")
    p.add_argument("--k", type=int, default=None, help="draft_k: the longest draft the adaptive choice may use "
                   f"(default {FULL['k']})")
    p.add_argument("--warm-draft", default=None, help="the draft b and c start from (default: the cached one "
                   "`make warm-draft` builds for the task; built here with --device cuda or --size smallest)")
    p.add_argument("--arms", default="abc", help="a plain, b frozen warm draft, c TLT (a and b or c)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> dict:
    from workers.warm import WarmRecipe

    size = SIZES[args.size]
    opt = {key: size[key] if getattr(args, key) is None else getattr(args, key) for key in FULL}
    recipe = WarmRecipe(**SMALLEST_RECIPE) if args.size == "smallest" else None
    result = bench_rl(num_steps=opt["steps"], num_repeats=opt["repeats"], num_prompts_per_step=opt["prompts"],
                      group_size=opt["group_size"], max_new_tokens=opt["new_tokens"], num_workers=opt["workers"],
                      draft_k=opt["k"], task=opt["task"], model=opt["model"], warm_draft=args.warm_draft,
                      seed=args.seed, arms=args.arms, device=args.device, warm_recipe=recipe)
    result["config"]["size"] = args.size
    return result


def record_as(result: dict) -> tuple[str, str | None]:
    """rl_gpu.json, with the GPU named, for a CUDA run; rl.json for a CPU one (which never writes rl_gpu.json)."""
    return ("rl_gpu", result.get("gpu")) if result["device"] == "cuda" else ("rl", None)
