"""`tlt bench rl --json`: the same seeded RL job three ways, on this machine, through the scheduler's REST API.

    a  plain decoding (tlt off)
    b  speculative decoding with the frozen warm draft (tlt on, idle_training off: no leases, no swaps)
    c  TLT: the warm draft, adaptive speculation, idle-time drafter training and hot swap

Each repeat runs the three jobs one after the other on a private Redis, local Ray and the scheduler app;
the order turns round on every repeat (abc, cba, abc, ...) so that drift in the machine's speed falls on
all three alike, and a repeat draws its prompts with its own seed. Nothing else may run on the machine.
With a time budget (--max-seconds; the gpu size has one) a repeat starts only if the run would still end
within it, by the longest repeat so far: the arms stay balanced, and the result says what was left out.

Per step and arm it records rollout, tail and step seconds and the tail's share of the rollout, response-length
percentiles, the accepted length (over the step and per live-batch bucket), the k served per bucket, the draft
versions served and published, idle and reclaimed worker-seconds and the mean reward (bench.rl_figures); the
figures (JSON keys) are ratios of sums over every step and repeat, and the last step's means, with goals_met.
The JSON object is printed last and written to docs/bench/rl.json by the registry (bench/cli.py); with --device
cuda the jobs run on the machine's GPUs (JobSpec.device; workers share a GPU when they outnumber them) and the
result, with `device` and the GPU's name, goes to docs/bench/rl_gpu.json instead.

Sizes: full (this CPU's measurement); gpu (one H100, at most 8 minutes from a fresh node, warm start included:
SIZES' comment has the arithmetic; bench/gpu_rl.sh runs it on a node from the offline bundle's parts); smallest
(proves the path in about a minute on a 2-core CPU: the tiny preset, one step, its own small warm draft).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.rl_figures import (
    ARMS,
    figures,
    goals_met,
    paired_steps,
    partial_figures,
    reclaimed_of,
    step_row,
    step_seconds,
)
from workers.device import POLICY_DTYPES
from workers.device import policy_dtype as served_dtype

ARM_SPEC = {"a": {"tlt": False}, "b": {"tlt": True, "idle_training": False}, "c": {"tlt": True}}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bench_rl(*, num_steps: int = 3, num_repeats: int = 2, num_prompts_per_step: int = 10, group_size: int = 4,
             max_new_tokens: int = 512, num_workers: int = 2, draft_k: int = 4, task: str = "longtail",
             model: str = "smollm2-135m", warm_draft: str | None = None, seed: int = 0,
             arms: str = "abc", device: str = "cpu", warm_recipe=None, policy_dtype: str = "auto",
             micro_batch_size: int | None = None, max_seconds: float | None = None,
             progress_file: str | None = None, policy=None, coupled: bool = False) -> dict:
    """device "cuda": every job on this machine's GPUs (JobSpec.device), its workers sharing them when they
    outnumber them (JobSpec.gpus_per_worker), the warm draft built there if none is cached; "cpu": each worker
    pinned to its own cores. warm_recipe: the workers.warm.WarmRecipe of the warm draft (None: its defaults).
    policy_dtype, micro_batch_size: JobSpec's (None: its default). max_seconds: the time budget (None: none).
    progress_file: rewritten after every job with the finished jobs' step rows, for a run stopped from outside.
    policy: the scheduler's scheduler.policy.PolicySettings (None: scheduler.demo.DEMO_POLICY, sized for a CPU).
    coupled: every arm samples coupled (JobSpec.coupled_sampling), so a repeat's arms generate the same rollouts
    (paired_steps says in how many steps they did) and their ratios measure speed alone."""

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
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds must be > 0, got {max_seconds!r}")
    policy = policy or DEMO_POLICY
    t0 = time.perf_counter()
    if warm_draft is not None:
        warm_draft = named_draft(warm_draft)
    elif set(arms) & {"b", "c"}:
        warm_draft = warm_draft_for(model, task, device, warm_recipe)
    warm_start_s = time.perf_counter() - t0
    base = {"model": model, "task": task, "num_steps": num_steps, "num_prompts_per_step": num_prompts_per_step,
            "group_size": group_size, "max_new_tokens": max_new_tokens, "num_workers": num_workers,
            "draft_k": draft_k, "temperature": 1.0, "device": device, "policy_dtype": policy_dtype,
            "coupled_sampling": coupled}
    if micro_batch_size is not None:
        base["micro_batch_size"] = micro_batch_size
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    repeat_s: list[float] = []
    stopped_early = None
    # the jobs' draft stores and checkpoints (hundreds of MB): removed once Ray's workers are gone
    store_dir = tempfile.mkdtemp(prefix="tlt-bench-rl-")
    # on CUDA, Ray counts the machine's GPUs; on a CPU, a logical one per worker (each pinned to its own cores)
    ray.init(num_cpus=num_workers, num_gpus=num_workers if device == "cpu" else None, namespace=RAY_NAMESPACE,
             include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        base["gpus_per_worker"] = gpu_share(int(ray.cluster_resources().get("GPU", 0)), num_workers, device)
        with PrivateRedis() as redis_server:
            # the warm draft named on the command line is allowed wherever it is (the server's roots bound REST)
            roots = default_roots(store_dir) + ((str(Path(warm_draft).resolve().parent),) if warm_draft else ())
            settings = Settings(redis_url=redis_server.url, store_dir=store_dir, start_ray=False, policy=policy,
                                watch_tick_s=0.25, model_roots=roots)
            url, server = start_server(settings)
            for r in range(num_repeats):
                stopped_early = over_budget(r, num_repeats, time.perf_counter() - t0, repeat_s, max_seconds)
                if stopped_early:
                    log(stopped_early)
                    break
                started = time.perf_counter()
                order = arms if r % 2 == 0 else arms[::-1]
                for arm in order:
                    spec = base | ARM_SPEC[arm] | {"seed": seed + r}
                    if arm != "a":
                        spec["warm_draft"] = warm_draft
                    job_t0 = time.perf_counter()
                    with contextlib.redirect_stdout(sys.stderr):
                        job = run_job(url, spec, f"repeat {r + 1}/{num_repeats}, {arm} ({ARMS[arm]})")
                    if job["state"] != JobState.SUCCEEDED:
                        raise RuntimeError(f"arm {arm} ({ARMS[arm]}), repeat {r + 1}: job {job['job_id']} "
                                           f"{job['state']}: {job.get('error')}")
                    steps = call("GET", url, f"/v1/jobs/{job['job_id']}/steps")
                    drafts = call("GET", url, f"/v1/jobs/{job['job_id']}/drafts") if arm == "c" else {}
                    runs[arm].append({"job_id": job["job_id"], "steps": steps, "drafts": drafts,
                                      "seconds": time.perf_counter() - job_t0})
                    log(f"  {ARMS[arm]}: rollout {sum(s['timings'].get('rollout', 0) for s in steps):.1f} s, "
                        f"step {sum(step_seconds(s) for s in steps):.1f} s, accepted length per step "
                        f"{[round(s['mean_accepted_length'], 2) for s in steps]}; job {runs[arm][-1]['seconds']:.0f} s")
                    if progress_file:
                        write_progress(progress_file, base, runs, time.perf_counter() - t0)
                repeat_s.append(time.perf_counter() - started)
            server.should_exit = True
            server.thread.join(30)
    finally:
        ray.shutdown()
        shutil.rmtree(store_dir, ignore_errors=True)
    full = set(arms) == set(ARMS)
    result = {"bench": "rl", "device": device,
              "config": base | {"num_repeats": num_repeats, "arms": arms, "seed": seed, "warm_draft": warm_draft,
                                "max_seconds": max_seconds, "policy": dataclasses.asdict(policy),
                                # what the workers served (auto resolves per device and, for coupled jobs, per
                                # CPU kernel: workers.device.policy_dtype)
                                "policy_dtype_served": str(served_dtype(policy_dtype, device, coupled)).removeprefix(
                                    "torch.")},
              **(figures(runs) if full else partial_figures(runs)),
              "steps": {ARMS[arm]: [[step_row(s, reclaimed_of(r, s["rl_step"])) for s in r["steps"]] for r in rs]
                        for arm, rs in runs.items()},
              "paired_steps": paired_steps(runs), "num_repeats_done": len(repeat_s), "stopped_early": stopped_early,
              "warm_start_s": warm_start_s, "repeat_seconds": repeat_s,
              "job_seconds": {ARMS[arm]: [r["seconds"] for r in rs] for arm, rs in runs.items()},
              "seconds": time.perf_counter() - t0}
    result["goals_met"] = goals_met(result) if full else {}
    if device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name(0)
    return result


def write_progress(path: str, config: dict, runs: dict[str, list[dict]], seconds: float) -> None:
    """The finished jobs' step rows so far (rl.json's "steps" form), written whole (a temporary file renamed)."""
    import json

    rows = {ARMS[arm]: [[step_row(s, reclaimed_of(r, s["rl_step"])) for s in r["steps"]] for r in rs]
            for arm, rs in runs.items()}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps({"config": config, "seconds": seconds, "steps": rows,
                               "job_seconds": {ARMS[arm]: [r["seconds"] for r in rs] for arm, rs in runs.items()}}))
    tmp.replace(path)


def over_budget(r: int, num_repeats: int, elapsed: float, repeat_s: list[float],
                max_seconds: float | None) -> str | None:
    """Why repeat r (0-based) is not started, or None: the first always runs; a later one only if the run would
    still end within max_seconds, were it to take as long as the longest repeat so far."""
    if max_seconds is None or r == 0:
        return None
    projected = elapsed + max(repeat_s)
    if projected <= max_seconds:
        return None
    return (f"repeats {r + 1}..{num_repeats} not started: {elapsed:.0f} s spent, and one more repeat (up to "
            f"{max(repeat_s):.0f} s) would end past the budget of {max_seconds:.0f} s")


def gpu_share(num_gpus: int, num_workers: int, device: str) -> float:
    """JobSpec.gpus_per_worker for `num_workers` workers on `num_gpus` GPUs: a GPU each where there are enough,
    else an equal share of them, at Ray's resolution (4 decimals). 1.0 on the CPU (logical GPUs, one each)."""
    if device == "cpu":
        return 1.0
    if num_gpus < 1:
        raise ValueError("--device cuda: Ray finds no GPU on this machine")
    return min(1.0, math.floor(num_gpus / num_workers * 10_000) / 10_000)


def named_draft(path: str) -> str:
    """--warm-draft's file as the job spec takes it: absolute (the server resolves no path against the bench's
    working directory); ValueError naming it where there is no such file."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise ValueError(f"--warm-draft {path}: no such file")
    return str(resolved)


def warm_draft_for(model: str, task: str, device: str, recipe) -> str:
    """The warm draft arms b and c start from: the one cached for `recipe` (workers.warm.WarmRecipe; None: its
    defaults), else built now on `device` when that is quick (a GPU, about 2 minutes; or a recipe other than the
    default, such as the smallest size's). On a CPU the default recipe's draft the checkout ships
    (workers.warm.shipped_warm_draft) stands in for a cached one; ValueError when there is neither (a build would
    take 27 minutes)."""
    from workers.warm import WarmRecipe, ensure_warm_draft, shipped_warm_draft, warm_cache_dir

    recipe = recipe or WarmRecipe()
    path = ensure_warm_draft(model, task, device, recipe, is_build_allowed=False)
    if path is not None:
        log(f"warm draft: reusing the cached {path}")
        return path
    if device == "cpu" and recipe == WarmRecipe():
        shipped = shipped_warm_draft(model, task)
        if shipped is not None:
            log(f"warm draft: the one the checkout ships, {shipped}")
            return str(shipped)
        raise ValueError("arms b and c start from a warm draft: build one with `make warm-draft` (about 27 minutes "
                         "on a 2-core CPU), pass --warm-draft, or run with --device cuda (built there)")
    log(f"warm draft: building it on {device} ({recipe.num_prompts} prompts, {recipe.num_steps} steps"
        f"{f' or {recipe.train_seconds:.0f} s' if recipe.train_seconds else ''}), cached in "
        f"{warm_cache_dir(model, task, recipe)}")
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):
        path = ensure_warm_draft(model, task, device, recipe)
    if device == "cuda":  # the build's model and features are gone: their cached blocks go back to the jobs
        import torch

        torch.cuda.empty_cache()
    log(f"warm draft: built in {time.perf_counter() - t0:.0f} s")
    return path


FULL = {"model": "smollm2-135m", "task": "longtail", "steps": 3, "repeats": 2, "prompts": 10, "group_size": 4,
        "new_tokens": 512, "workers": 2, "k": 4, "policy_dtype": "auto", "micro_batch": None, "max_seconds": None}
# --size gpu: one H100, within 8 minutes from a fresh node. Measured there (2026-11-27, docs/benchmarks.md, "The GPU
# run"): a warm start of 137 s with 1,024 prompts (the GGUF's conversion; 153k tokens harvested at 9.0k tokens/s in
# 17 s; 60 s of training, 470 micro-steps of 32k pairs, its loss flat after about 100 of them: about 100 passes over
# too little data; 16 held-out prompts scored), then per arm a job of 51 s (plain) or 90 s (the draft arms: their
# workers capture every graph before the first batch) with 4 steps of about 2 s of rollout (128 rollouts of up to
# 512 tokens, the longest setting it) and 0.6-1.4 s of sync and update: one repeat in 231 s, 375 s in all; the second
# does not fit. More prompts of the task's templates gave less each time on a CPU (benchmarks.md, "Levers tried":
# 85k -> 113k tokens, greedy 2.41 -> 2.44), so the data stays.
# That run's 32 prompts had no tail: the longtail task makes 1 prompt in 10 detailed (in blocks of 10), so 32 made
# about 3 detailed groups, dealt round-robin to both workers, and each worker's longest row ran to the 512-token cap
# (tails of 0.03-0.9 s, under a lease's 1 s: nothing reclaimed). FULL's 10 prompts make exactly one detailed group a
# step, on one worker, while the other idles: the tail TLT is for. Its length: SmolLM2 at T=1, bf16, 24 detailed
# rollouts capped at 2048 (2026-11-28, CPU) stopped at 87-421 tokens or ran away to the cap (4 of 24; 3 of 6 groups
# had one), so 1,024 tokens make a runaway group's tail about 3.5 s at plain's 3.4 ms a step on the H100.
SIZES = {"full": FULL,
         "gpu": FULL | {"steps": 4, "new_tokens": 1024, "policy_dtype": "bfloat16", "micro_batch": 16,
                        "max_seconds": 450.0},
         "smallest": FULL | {"model": "tiny", "task": "arithmetic", "steps": 1, "repeats": 1, "prompts": 2,
                             "group_size": 2, "new_tokens": 16, "k": 2}}
SMALLEST_RECIPE = {"num_prompts": 4, "max_new_tokens": 16, "num_steps": 4, "batch_size": 4, "num_eval_prompts": 0,
                   "train_seconds": None, "bf16_autocast": False}
# the gpu size's warm start: workers.warm.GPU_RECIPE shortened to fit the 8 minutes (GPU_RECIPE's own 3,072 prompts
# and 150 s of training come to about 5 minutes alone), trained on the positions k=4 drafts
GPU_WARM = {"num_prompts": 1024, "num_unroll": 4, "num_eval_prompts": 16, "train_seconds": 60.0}
# per size, what its warm recipe changes of a workers.warm recipe (SMALLEST_RECIPE of WarmRecipe(), GPU_WARM of
# GPU_RECIPE: run() reads which)
RECIPES = {"smallest": SMALLEST_RECIPE, "gpu": GPU_WARM}
# the scheduler's settings per size, over DEMO_POLICY's (min_lease_s 2, min_buffer_tokens 128): a GPU's tail lasts
# seconds, and a lease there loads its parent in a fraction of one and trains about 28 steps a second (tlt bench
# gpu), so leases of 1 s still train
POLICIES = {"gpu": {"min_lease_s": 1.0}}


def add_arguments(p) -> None:
    from workers.tasks import TASKS

    p.add_argument("--size", default="full", choices=sorted(SIZES), help="the defaults of the options below: full "
                   "(the CPU measurement), gpu (one H100 in at most 8 minutes, warm start included: bf16 policy, a "
                   "time budget; --device cuda only), smallest (the tiny preset, one step: proves the path in about a "
                   "minute)")
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
    p.add_argument("--policy-dtype", default=None, choices=POLICY_DTYPES, help="JobSpec.policy_dtype: the rollout "
                   "workers' policy precision (default auto: bf16 where the device has it natively; bfloat16 with "
                   "--size gpu)")
    p.add_argument("--micro-batch", type=int, default=None, help="JobSpec.micro_batch_size: sequences per backward "
                   "of the update (default JobSpec's; 16 with --size gpu)")
    p.add_argument("--max-seconds", type=float, default=None, help="time budget: a repeat starts only if the run "
                   "would still end within it (default none; 450 with --size gpu)")
    p.add_argument("--progress-file", default=None, help="rewritten after every job with the finished jobs' step "
                   "rows (for a run that may be stopped from outside, as on a lent GPU machine)")
    p.add_argument("--warm-draft", default=None, help="the draft b and c start from (default: the cached one "
                   "`make warm-draft` builds for the task; built here with --device cuda or --size smallest/gpu)")
    p.add_argument("--arms", default="abc", help="a plain, b frozen warm draft, c TLT (a and b or c)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--coupled", action="store_true", help="every arm samples coupled (JobSpec.coupled_sampling: "
                   "Gumbel-max keyed by seed and position), so the arms of a repeat generate the same rollouts and "
                   "the ratios compare speed on identical work; drafts are accepted less often than by default. "
                   "The policy serves bf16 only on a CPU whose bf16 GEMMs keep each row's bits in row blocks (float32 "
                   "elsewhere, where bf16 samples would part) unless --policy-dtype says otherwise")


def run(args) -> dict:
    from workers.warm import GPU_RECIPE, WarmRecipe

    if args.size == "gpu" and args.device != "cuda":
        raise ValueError("--size gpu is sized for one GPU (a bf16 policy, rollouts of up to 1,024 tokens): run it "
                         "with --device cuda; on a CPU, --size smallest --policy-dtype bfloat16 runs its path")
    size = SIZES[args.size]
    opt = {key: size[key] if getattr(args, key) is None else getattr(args, key) for key in FULL}
    if args.coupled and args.policy_dtype is None:  # auto, as coupled jobs resolve it: bf16 only where a verify's
        opt["policy_dtype"] = "auto"  # logits are plain decoding's to the bit (workers.device.policy_dtype)
    bases = {"smallest": WarmRecipe(), "gpu": GPU_RECIPE}
    recipe = dataclasses.replace(bases[args.size], **RECIPES[args.size]) if args.size in RECIPES else None
    policy = None
    if args.size in POLICIES:
        from scheduler.demo import DEMO_POLICY

        policy = dataclasses.replace(DEMO_POLICY, **POLICIES[args.size])
    result = bench_rl(num_steps=opt["steps"], num_repeats=opt["repeats"], num_prompts_per_step=opt["prompts"],
                      group_size=opt["group_size"], max_new_tokens=opt["new_tokens"], num_workers=opt["workers"],
                      draft_k=opt["k"], task=opt["task"], model=opt["model"], warm_draft=args.warm_draft,
                      seed=args.seed, arms=args.arms, device=args.device, warm_recipe=recipe,
                      policy_dtype=opt["policy_dtype"], micro_batch_size=opt["micro_batch"],
                      max_seconds=opt["max_seconds"], progress_file=args.progress_file, policy=policy,
                      coupled=args.coupled)
    result["config"]["size"] = args.size
    return result


def record_as(result: dict) -> tuple[str, str | None]:
    """rl_gpu.json, with the GPU named, for a CUDA run; rl.json for a CPU one (which never writes rl_gpu.json)."""
    return ("rl_gpu", result.get("gpu")) if result["device"] == "cuda" else ("rl", None)


def summary(result: dict) -> list[str]:
    """The headline figures and their goals, for a run without --json."""
    from bench.rl_figures import goals_for

    goals = goals_for(result["device"])
    lines = [f"{key:34s} {result.get(key)!s:>22s}  goal {' '.join(map(str, goals[key]))}: "
             f"{'-' if ok is None else 'met' if ok else 'NOT met'}" for key, ok in result["goals_met"].items()]
    if result.get("stopped_early"):
        lines.append(result["stopped_early"])
    return lines
