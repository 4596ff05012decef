"""`tlt bench gpu` (also `python3 -m bench.gpu`): the product on one GPU, measured in one run.

(h) the CUDA test set, first; (a) the physics of one policy forward (wall vs kernel time, kernels per
forward, verify cost); (b) the warm start on the device; (c) the batch-1 sweep at each k, greedy and T=1;
(d) the batch sweep: plain, fixed k and adaptive, with greedy identity; (g) one longtail rollout batch (EAGLE,
history and both per row, against plain);
(f) drift and online adaptation; (e) drafter training in fp32 and bf16, and stop latency. Speculative
and plain arms run interleaved in the same run and are reported as ratios.

The registry (bench/cli.py) writes docs/bench/gpu.json on CUDA and gpu_cpu.json with --device cpu (small sizes: the CPU
form keeps the path from rotting; a CPU run never overwrites the GPU's file). Imports nothing a bare GPU
node lacks (no Ray, Redis, FastAPI, pydantic...): torch, transformers (GGUF only), safetensors, numpy.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys
import time
import traceback
from collections.abc import Callable

import torch

from bench.gpu_args import PARTS, SHAPE_ONLY, Settings, settings_from_args
from bench.gpu_args import add_arguments as add_arguments  # this bench's options, for the registry (bench/cli.py)
from bench.gpu_cells import profile_step
from bench.gpu_decode import ByteTokenizer, batch_sweep, prior_from, sweep_b1, sweep_requests
from bench.gpu_longtail import longtail
from bench.gpu_physics import aten_ops_per_forward, forward_path, physics, smollm2_layout
from bench.gpu_tests import cuda_tests
from bench.gpu_train import device_name, drift, fresh_buffer, training, warm_head
from drafter.decode.engine import Engine
from drafter.draft.eagle import EagleDrafter
from drafter.model.config import ModelConfig
from drafter.model.loading import LoadedModel, load_model, random_model

# the result's headline keys and their goals (docs/benchmarks.md, "GPU"); None: no goal, reported
GOALS: dict[str, tuple[str, float] | None] = {
    "forward_ms_b1_fp32": ("<=", 2.0), "forward_ms_b1_bf16": ("<=", 1.5),
    "wall_over_kernel_b1": ("<=", 1.5), "wall_over_kernel_b64": ("<=", 1.5), "verify_cost_k3_b1": ("<=", 1.1),
    "kernels_per_forward_b1_fp32": None, "aten_ops_per_forward_b1": ("<=", 600),
    # issue 39: the warm start (within 5 minutes, reaching these accepted lengths at the best k), its harvest
    "warm_start_s": ("<=", 300), "accepted_greedy_best": (">=", 3.0), "accepted_t1_best": (">=", 2.5),
    "harvest_tokens_per_s": (">=", 15_000), "speedup_greedy_b1": (">=", 1.8), "speedup_t1_b1": (">=", 1.4),
    # (d), issue 38: fixed k=4 against plain per batch size (fp32; the same goals with _bf16), a speculative
    # step's ms over a plain one's, and adaptive over the better of plain and fixed k in every cell
    **{f"spec_step_cost_k4_b{b}{x}": ("<=", c) for b, c in ((1, 1.5), (4, 1.5), (16, 1.6), (64, 1.8))
       for x in ("", "_bf16")},
    **{f"speedup_k4_greedy_b{b}{x}": (">=", g) for b, g in ((1, 1.5), (4, 1.2), (16, 1.1), (64, 1.0))
       for x in ("", "_bf16")},
    **{f"speedup_k4_t1_b{b}{x}": (">=", g) for b, g in ((1, 1.2), (4, 1.2), (16, 1.0), (64, 1.0))
       for x in ("", "_bf16")},
    "adaptive_min_ratio": (">=", 0.97), "greedy_identical_fraction": ("==", 1.0),
    "greedy_identical_fraction_bf16": ("==", 1.0), "graph_captures_timed": ("==", 0),
    "cache_rebuilds_timed": ("==", 0),
    "train_fp32_tokens_per_s": (">=", 100_000), "train_bf16_tokens_per_s": None, "train_bf16_over_fp32": (">=", 1.2),
    "stop_p50_s": None, "stop_max_s": ("<=", 0.05),
    "drift_recovered_fraction": (">=", 0.5), "drift_recovered_se": ("<=", 0.1),  # issue 39: 30 s of adaptation
    "longtail_rollout_speedup": (">=", 1.25), "longtail_tail_speedup": (">=", 1.5),
    "longtail_tail_accepted_length": (">", 1.3),
    # (g), issue 41: history and EAGLE drafts per row (the combined drafter), adaptive, T=1, against plain
    "longtail_rollout_speedup_history": (">=", 1.6), "longtail_tail_speedup_history": (">=", 2.0),
    "longtail_greedy_identical_fraction_history": ("==", 1.0), "longtail_tail_rows_accepted_history": None,
    "longtail_history_step_fraction": None,
    "cuda_tests_passed": (">", 0), "cuda_tests_failed": ("==", 0),
}
# the CPU form's own goals where they differ (issue 38: the path proven on a CPU, whose verify is nearly free
# at batch 1 but whose drafting is not); keys of a CPU run that are not listed here keep the GPU's goals
CPU_GOALS: dict[str, tuple[str, float]] = {"spec_step_cost_k4_b1": ("<=", 1.6), "spec_step_cost_k4_b4": ("<=", 2.0)}
# each part's nested results, and the headline keys each nested result gives the top level (Run.take; merge)
PART_RESULTS = {"h": ("cuda_tests",), "a": ("physics",), "b": ("warm_start",), "c": ("sweep_b1",),
                "d": ("batch_sweep", "batch_sweep_bf16", "profile_b4"), "g": ("longtail",), "f": ("drift",),
                "e": ("training",)}
HEADLINES = {
    "physics": ("forward_ms_b1_fp32", "forward_ms_b1_bf16", "wall_over_kernel_b1", "wall_over_kernel_b64",
                "verify_cost_k3_b1", "kernels_per_forward_b1_fp32", "aten_ops_per_forward_b1"),
    "warm_start": ("warm_start_s", "harvest_tokens_per_s"),
    "sweep_b1": ("speedup_greedy_b1", "speedup_t1_b1", "accepted_greedy_best", "accepted_t1_best"),
    "longtail": ("longtail_rollout_speedup", "longtail_tail_speedup", "longtail_tail_accepted_length",
                 "longtail_rollout_speedup_history", "longtail_tail_speedup_history",
                 "longtail_greedy_identical_fraction_history", "longtail_tail_rows_accepted_history",
                 "longtail_history_step_fraction"),
    "drift": ("drift_recovered_fraction", "drift_recovered_se", "drift_recovered_fraction_t1", "drift_recovered_t1_se"),
    "training": ("train_fp32_tokens_per_s", "train_bf16_tokens_per_s", "train_bf16_over_fp32", "stop_p50_s",
                 "stop_max_s"),
}
PART_NAMES = {"h": "CUDA tests", "a": "physics", "b": "warm start", "c": "batch-1 sweep", "d": "batch sweep",
              "g": "long-tail rollout", "f": "drift and adaptation", "e": "training throughput and stops"}


def log(msg: str) -> None:
    print(f"[bench gpu] {msg}", file=sys.stderr, flush=True)


def met(value, goal: tuple[str, float] | None) -> bool | None:
    if goal is None or value is None:
        return None
    op, target = goal
    return {"<=": value <= target, ">=": value >= target, ">": value > target, "==": value == target}[op]


class Run:
    """The result being built: each part is timed and is the run's error boundary (a part that fails is
    recorded, with its traceback on stderr, and the others still run: GPU time is scarce)."""

    def __init__(self, result: dict) -> None:
        self.result = result

    def part(self, letter: str, fn: Callable[[], object]):
        log(f"({letter}) {PART_NAMES[letter]} ...")
        start = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 (the part boundary: recorded in the result, run goes on)
            traceback.print_exc()
            self.result["errors"][letter] = f"{type(exc).__name__}: {exc}"
            out = None
        seconds = round(time.perf_counter() - start, 1)
        self.result["part_seconds"][letter] = seconds
        log(f"({letter}) {PART_NAMES[letter]}: {seconds} s" + (" FAILED" if letter in self.result["errors"] else ""))
        return out

    def take(self, nested: str, out: dict | None, headlines: bool = True) -> None:
        """Store a part's output under `nested` and copy its headline keys (HEADLINES) to the top level."""
        if out is None:
            return
        self.result[nested] = out
        for key in HEADLINES.get(nested, ()) if headlines else ():
            self.result[key] = out.get(key)


def bench_gpu(settings: Settings) -> dict:
    s, device, parts = settings.sizes, settings.device, settings.parts
    if settings.threads is not None:
        torch.set_num_threads(settings.threads)
    torch.manual_seed(0)
    cpu_threads = torch.get_num_threads()
    draft_dtype = None if settings.draft_dtype == "policy" else settings.draft_dtype
    result: dict = {"device": device_name(device), "device_type": device, "model": settings.model, "parts": parts,
                    "forward_path": forward_path(device), "engine_path": None, **dict.fromkeys(GOALS),
                    "settings": dataclasses.asdict(s), "cpu_threads": cpu_threads, "part_seconds": {}, "errors": {}}
    run = Run(result)
    started = time.perf_counter()
    # first, before the model takes the GPU's memory (not run on a CPU or without h: a note says so)
    tests = run.part("h", lambda: cuda_tests(device, "h" not in parts, settings.tests_junit, settings.tests_timeout))
    if tests is not None:
        take_tests(result, tests)
    if settings.model == SHAPE_ONLY:  # physics without the model file: the same shapes, random weights
        loaded = LoadedModel(random_model(ModelConfig(), 0, torch.float32, device), None, SHAPE_ONLY)
    else:
        loaded = load_model(settings.model, dtype=torch.float32, device=device)
    policy = loaded.model
    tok = loaded.tokenizer or ByteTokenizer(policy.cfg.vocab_size)
    engine = Engine(policy, tok)  # the static path (CUDA graphs on a GPU; on a CPU, eager for draft trees)
    result["model"] = loaded.name
    result["engine_path"] = ("static+graphs" if device == "cuda" else "static") if engine.static else "eager"
    log(f"{loaded.name} on {result['device']}; forward path {result['forward_path']}, engine {result['engine_path']}; "
        f"parts {parts}")
    if "a" in parts:
        out = run.part("a", lambda: {**physics(policy, device, s.physics_batches, s.physics_tokens, s.physics_dtypes,
                                               s.physics_context, s.physics_iters, s.profile_iters, log),
                                     "aten_ops_per_forward_b1": aten_ops_per_forward(smollm2_layout(),
                                                                                     s.physics_context),
                                     "aten_ops_model": "SmolLM2-135M layout, narrow widths, CPU, batch 1, 1 token"})
        run.take("physics", out)
        if device == "cuda":
            torch.cuda.empty_cache()
    if not set(parts) & set("bcdefg"):
        return finish(result, started)
    warm = run.part("b", lambda: warm_head(loaded, tok, device, s.warm_prompts, s.warm_task_prompts,
                                           s.warm_new_tokens, s.harvest_batch, s.warm_steps,
                                           fresh=settings.fresh_warm, progress=log))
    if warm is None:
        return finish(result, started)  # every later part needs the draft
    head, info = warm
    run.take("warm_start", info, headlines="b" in parts)
    if "c" in parts:
        run.take("sweep_b1", run.part("c", lambda: sweep_b1(engine, tok, head, s.ks, s.k, s.sweep_prompts,
                                                            s.sweep_new_tokens, s.calib_prompts, draft_dtype)))
    # the adaptive tuner's prior: (c)'s accepted length at k, (a)'s verify cost (1 + 3 / knee at batch 1)
    verify_cost = result.get("verify_cost_k3_b1")
    knee = min(max(3 / (verify_cost - 1), 4.0), 256.0) if verify_cost and verify_cost > 1 else None
    prior = prior_from(result.get("sweep_b1"), s.k, knee)
    result["tuner_prior"] = vars(prior)
    tuners: dict = {}  # (d)'s adaptive tuners, per temperature: (g) starts from the T=1 one, as a worker would
    if "d" in parts:
        def decode_part() -> tuple[dict, dict, dict]:  # fp32, bf16, and one speculative step at b4 profiled
            fp32 = batch_sweep(engine, tok, head, s.batch_sizes, s.k, s.batch_new_tokens, s.repeats, draft_dtype,
                               log, tuners, prior)
            bf16 = bf16_sweep(policy, tok, head, s, draft_dtype, prior)
            reqs = sweep_requests(tok, 4, 1.0, s.batch_new_tokens)
            return fp32, bf16, profile_step(engine, reqs, s.k, EagleDrafter(policy, head, draft_dtype))

        decoded = run.part("d", decode_part)
        for name, out in zip(("batch_sweep", "batch_sweep_bf16", "profile_b4"), decoded or ()):
            run.take(name, out)
    if "g" in parts:
        run.take("longtail", run.part("g", lambda: longtail(engine, tok, head, s.longtail_prompts, s.longtail_group,
                                                            s.longtail_new_tokens, s.k, s.longtail_repeats,
                                                            draft_dtype, log, tuners.get(1.0), prior)))
    headline_decode(result)
    trained = None
    if "f" in parts:
        trained = run.part("f", lambda: drift(engine, tok, head, s.k, s.drift_eval_prompts, s.sweep_new_tokens,
                                              s.drift_steps, s.adapt_prompts, s.adapt_seconds, draft_dtype))
        if trained is not None:
            run.take("drift", trained[0])
    if "e" in parts:
        def train_part() -> dict:  # on (f)'s moved policy, adapted head and harvest, as a lease would train
            policy_e, head_e, buffer = trained[1:] if trained is not None else (policy, head, fresh_buffer(engine, tok))
            return training(policy_e, head_e, buffer, s.train_seconds, s.stop_trials)

        run.take("training", run.part("e", train_part))
    return finish(result, started)


def bf16_sweep(policy, tok, head, s, draft_dtype, prior) -> dict:
    """(d) again with the policy in bf16 (the usual RL setting), on its own engine: keys suffixed _bf16, greedy
    identity against bf16 plain decoding."""
    engine = Engine(copy.deepcopy(policy).to(torch.bfloat16), tok)
    return batch_sweep(engine, tok, head, s.batch_sizes, s.k, s.batch_new_tokens, s.repeats, draft_dtype, log,
                       None, prior, suffix="_bf16")


def headline_decode(result: dict) -> None:
    """(d)'s and (g)'s flat keys at the top level: the per-cell figures of both dtypes, the worst adaptive
    ratio over both, and the captures and rebuilds of every timed run."""
    parts = [result.get(n) for n in ("batch_sweep", "batch_sweep_bf16", "longtail")]
    for out in parts[:2]:
        for key, value in (out or {}).items():
            if key.startswith(("spec_step_cost_", "speedup_k", "greedy_identical_fraction")):
                result[key] = value
    ratios = [out.get(key) for out in parts[:2] if out for key in ("adaptive_min_ratio", "adaptive_min_ratio_bf16")
              if out.get(key) is not None]
    result["adaptive_min_ratio"] = min(ratios) if ratios else None
    measured = [out for out in parts if out]
    result["graph_captures_timed"] = sum(out["graph_captures_timed"] for out in measured) if measured else None
    result["cache_rebuilds_timed"] = sum(out["cache_rebuilds_timed"] for out in measured) if measured else None


def finish(result: dict, started: float) -> dict:
    result["total_s"] = round(time.perf_counter() - started, 1)
    return judge(result)


def judge(result: dict) -> dict:
    """`goals_met`: each goal of the result's device compared with its key."""
    goals = {**GOALS, **(CPU_GOALS if result.get("device_type") == "cpu" else {})}
    result["goals_met"] = {key: met(result.get(key), goal) for key, goal in goals.items() if goal is not None}
    return result


def take_tests(result: dict, tests: dict) -> None:
    """The CUDA test counts (h) into `result`: nested and as headline keys."""
    result["cuda_tests"] = tests
    result["cuda_tests_passed"], result["cuda_tests_failed"] = tests.get("passed"), tests.get("failed")


def merge(results: list[dict]) -> dict:
    """One result from runs of parts on the same machine (`--parts abcdgh`, then `--parts bef` with the warm draft
    cached: where one command may not run the whole bench): each part's nested results from the first run that
    has them (the warm start where it was built, not read from the cache), the headline keys and goals computed
    again from them, `merged_from` naming each run's parts and date. ValueError for results of another bench or
    device, or runs that together miss a part."""
    if not results or any(r.get("bench", "gpu") != "gpu" or "parts" not in r for r in results):
        raise ValueError("--merge takes results of `tlt bench gpu` (JSON files with their parts)")
    if len({r.get("device") for r in results}) > 1:
        devices = sorted({str(r.get("device")) for r in results})
        raise ValueError(f"--merge: the runs were on different devices: {devices}")
    ordered = sorted(results, key=lambda r: bool((r.get("warm_start") or {}).get("cached")))  # a built one first
    out = copy.deepcopy(ordered[0])
    out["part_seconds"], out["errors"] = {}, {}
    for r in ordered:
        for letter in r["parts"]:  # the first run that ran a part gives it (its results, or its error)
            failed = letter in r.get("errors", {})
            if letter in out["part_seconds"] or not (failed or any(r.get(n) is not None for n in PART_RESULTS[letter])):
                continue
            for n in PART_RESULTS[letter]:
                out[n] = copy.deepcopy(r.get(n))
            out["part_seconds"][letter] = r.get("part_seconds", {}).get(letter)
            if failed:
                out["errors"][letter] = r["errors"][letter]
    missing = set(PARTS) - set(out["part_seconds"])
    if missing:
        raise ValueError(f"--merge: no run has part(s) {''.join(sorted(missing))}")
    for name, keys in HEADLINES.items():
        for key in keys:
            out[key] = (out.get(name) or {}).get(key)
    take_tests(out, out.get("cuda_tests") or {})
    headline_decode(out)
    out["parts"] = PARTS
    out["merged_from"] = [{"parts": r["parts"], "date": r.get("date"), "total_s": r.get("total_s")} for r in results]
    out["total_s"] = round(sum(r.get("total_s") or 0.0 for r in results), 1)
    return judge(out)


def run(args: argparse.Namespace) -> dict:
    """Run from parsed options (`tlt bench gpu`, `python3 -m bench.gpu`); the registry writes and prints."""
    if args.merge:
        import json
        from pathlib import Path

        return merge([json.loads(Path(path).read_text()) for path in args.merge])
    result = bench_gpu(settings_from_args(args, torch.cuda.is_available()))
    if result["errors"]:
        log(f"parts failed: {result['errors']}")
    return result


def record_as(result: dict) -> tuple[str, str | None]:
    """docs/bench/gpu.json, naming the GPU, on CUDA; gpu_cpu.json on a CPU: a CPU run never overwrites the GPU's."""
    return ("gpu", result["device"]) if result.get("device_type") == "cuda" else ("gpu_cpu", None)


def summary(result: dict) -> list[str]:
    goals = {**GOALS, **(CPU_GOALS if result.get("device_type") == "cpu" else {})}
    return [f"{key:30s} {result[key]!s:>12s}  goal {' '.join(map(str, goals[key]))}: "
            f"{'-' if ok is None else 'met' if ok else 'NOT met'}" for key, ok in result["goals_met"].items()]


def main(argv: list[str] | None = None) -> int:
    from bench.cli import main as bench_main

    return bench_main(["gpu", *(sys.argv[1:] if argv is None else argv)], prog="python3 -m bench.cli")


if __name__ == "__main__":
    sys.exit(main())
