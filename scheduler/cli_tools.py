"""The `tlt` commands that are not the scheduler's: benchmarks (`tlt bench ...`), the offline drafter
warm start (`tlt drafter train`) and `tlt generate`. Each imports what it runs (torch included) only
when it runs, so the scheduler's own commands stay torch-free."""

from __future__ import annotations

import argparse
import json
import sys

from bench.gpu_args import add_arguments as add_gpu_arguments
from drafter.config import SMOLLM2_SPEC, TrainConfig
from workers.spec import JobSpec
from workers.tasks import TASKS
from workers.warm import WarmRecipe

_RECIPE = WarmRecipe()  # `tlt drafter train --task`'s defaults


def _bench_engine(args: argparse.Namespace) -> int:
    import importlib.util
    import os
    from pathlib import Path

    if importlib.util.find_spec("vllm") is None:  # vLLM lives in the engines venv: run there if it is built
        from bench.record import ROOT

        engines_venv = ROOT / ".venv-engines"
        engines_python = engines_venv / "bin" / "python"
        if engines_python.is_file() and Path(sys.prefix).resolve() != engines_venv.resolve():
            print(f"[bench engine] vllm is not installed here; running in {engines_venv}",
                  file=sys.stderr, flush=True)
            os.execv(str(engines_python), [str(engines_python), "-m", "scheduler.cli", *sys.argv[1:]])
    from bench.engine import bench_engine
    from bench.record import write_result

    threads = tuple(int(n) for n in args.threads.split(",") if n.strip())
    result = bench_engine(model_spec=args.model, draft=args.draft, num_prompts=args.prompts,
                          new_tokens=args.new_tokens, draft_k=args.k, threads=threads, num_swaps=args.swaps)
    result["path"] = str(write_result("engine", result, Path(args.out_dir) if args.out_dir else None))
    if not args.json:
        for n, phase in result["phases"].items():
            for batch, configs in phase.items():
                print(f"{n} thread(s), {batch}:")
                for name, rep in configs.items():
                    print(f"  {name:12s} {rep['tokens_per_s']:8.2f} tok/s  accepted length "
                          f"{rep['mean_accepted_length']:.2f}")
    print(json.dumps(result))
    return 0


def _bench_drafter(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bench.drafter import bench_drafter
    from bench.record import write_result

    ks = tuple(int(k) for k in args.k.split(",") if k.strip())
    result = bench_drafter(model_spec=args.model, threads=args.threads, num_eval_prompts=args.prompts,
                           new_tokens=args.new_tokens, ks=ks, warm_prompts=args.warm_prompts,
                           warm_steps=args.warm_steps, warm_unroll=args.warm_unroll,
                           adapt_seconds=args.adapt_seconds, adapt_lr=args.adapt_lr,
                           adapt_prompts=args.adapt_prompts, stop_trials=args.stop_trials, parts=args.parts,
                           draft_dtype=None if args.draft_dtype == "policy" else args.draft_dtype,
                           tree=args.tree, tree_side_depth=args.tree_side_depth)
    result["path"] = str(write_result("drafter", result, Path(args.out_dir) if args.out_dir else None))
    print(json.dumps(result))
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from bench.gpu import run_args

    return run_args(args)


def _bench_dataplane(args: argparse.Namespace) -> int:
    from bench.dataplane import bench_dataplane

    result = bench_dataplane(model=args.model, num_workers=args.workers, num_steps=args.steps,
                             prompts_per_step=args.prompts, group_size=args.group_size,
                             max_new_tokens=args.new_tokens, swap_trials=args.swap_trials)
    print(json.dumps(result))
    return 0


def _bench_observability(args: argparse.Namespace) -> int:
    from bench.observability import bench_observability

    print(json.dumps(bench_observability(num_workers=args.workers, num_steps=args.steps,
                                         events_per_worker=args.events, repeats=args.repeats)))
    return 0


def _bench_scheduler(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bench.scheduler import bench_scheduler

    print(json.dumps(bench_scheduler(num_trials=args.trials, num_workers=args.workers, num_ticks=args.ticks,
                                     tick_s=args.tick_s, short_s=args.short_s, long_s=args.long_s,
                                     out_dir=Path(args.out_dir) if args.out_dir else None)))
    return 0


def _bench_rl(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bench.rl import bench_rl

    print(json.dumps(bench_rl(num_steps=args.steps, num_repeats=args.repeats, num_prompts_per_step=args.prompts,
                              group_size=args.group_size, max_new_tokens=args.new_tokens, num_workers=args.workers,
                              draft_k=args.k, task=args.task, model=args.model, warm_draft=args.warm_draft,
                              seed=args.seed, arms=args.arms, out_dir=Path(args.out_dir) if args.out_dir else None)))
    return 0


def _bench_faults(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bench.faults import bench_faults

    print(json.dumps(bench_faults(num_requests=args.requests, out_dir=Path(args.out_dir) if args.out_dir else None)))
    return 0


def _read_prompts(path: str) -> list[str]:
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--prompts: no such file {path}")
    prompts = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--prompts: line {n} of {path} is not JSON ({exc.msg})") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f'--prompts: line {n} of {path} needs a non-empty string field "prompt"')
        prompts.append(item["prompt"])
    if not prompts:
        raise ValueError(f"--prompts: {path} holds no prompts")
    return prompts


def _drafter_train(args: argparse.Namespace) -> int:
    import torch

    from drafter.loading import encode_prompt, load_model
    from drafter.warmstart import HarvestConfig, warm_start
    from workers.warm import WARM_EVAL_SEED, WARM_TRAIN_SEED, task_prompts

    if (args.prompts is None) == (args.task is None):
        raise ValueError("give --prompts FILE or --task NAME (one of them)")
    recipe = _RECIPE
    if args.task is not None:  # the task's own prompts; a held-out set drawn with another seed
        texts = task_prompts(args.task, WARM_TRAIN_SEED, args.num_prompts or recipe.num_prompts,
                             recipe.tail_fraction)
        eval_texts = task_prompts(args.task, WARM_EVAL_SEED, args.num_eval_prompts, recipe.tail_fraction)
        steps = args.steps if args.steps is not None or args.seconds is not None else recipe.num_steps
    else:
        texts = _read_prompts(args.prompts)
        if args.steps is None and args.seconds is None:
            raise ValueError("give --steps or --seconds")
        held = max(1, len(texts) // 10) if len(texts) > 1 else 0
        texts, eval_texts, steps = texts[held:] or texts, texts[:held][:8], args.steps
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    if args.task is not None:  # as the job encodes them (a tokenizer-less preset folds bytes: tests only)
        from workers.driver import encode_text

        prompts = [encode_text(loaded.tokenizer, t, loaded.model.cfg.vocab_size) for t in texts]
        eval_prompts = [encode_text(loaded.tokenizer, t, loaded.model.cfg.vocab_size) for t in eval_texts]
    else:
        prompts = [encode_prompt(loaded.tokenizer, t) for t in texts]
        eval_prompts = [encode_prompt(loaded.tokenizer, t) for t in eval_texts]
    _, report = warm_start(loaded.model, loaded.tokenizer, prompts, args.out,
                           train_cfg=TrainConfig(total_steps=steps or 1000, num_unroll=args.unroll,
                                                  anneal_to_budget=False, bf16_autocast=False),
                           harvest_cfg=HarvestConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                                     temperature=args.temperature, top_p=1.0),
                           max_steps=steps, max_seconds=args.seconds, draft_vocab_size=args.draft_vocab,
                           eval_prompts=eval_prompts, harvest_file=args.harvest_file)
    print(json.dumps({"model": loaded.name, "task": args.task, **report.__dict__}))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from drafter.drafters import NgramDrafter
    from drafter.engine import Engine, Request
    from drafter.loading import encode_prompt, load_model
    from drafter.sampling import SamplingParams

    loaded = load_model(args.model)
    engine = Engine(loaded.model, loaded.tokenizer)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
    reqs = [Request(encode_prompt(loaded.tokenizer, p), params) for p in args.prompt]
    drafter = NgramDrafter() if args.k else None
    for out in engine.generate(reqs, k=args.k, drafter=drafter):
        print(out.text)
        print(f"-- {len(out.token_ids)} tokens, {out.num_steps} policy forwards, "
              f"accepted length {out.mean_accepted_length:.2f}, finish: {out.finish_reason}", file=sys.stderr)
    return 0


def add_tool_commands(sub) -> None:
    """Add `bench`, `drafter` and `generate` to the `tlt` subcommands."""
    bench = sub.add_parser("bench", help="benchmarks; each prints a JSON object last")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    eng = bench_sub.add_parser("engine", help="our engine vs vLLM, plain and with the same trained EAGLE-3 draft")
    eng.add_argument("--model", default=SMOLLM2_SPEC, help="smollm2-135m, a .gguf file or an HF directory")
    eng.add_argument("--draft", default=None, help="a draft checkpoint (default: the longtail warm draft that "
                     "`make warm-draft` caches)")
    eng.add_argument("--prompts", type=int, default=8, help="held-out longtail prompts")
    eng.add_argument("--new-tokens", type=int, default=96)
    eng.add_argument("--k", type=int, default=3, help="draft length, the same in both engines")
    eng.add_argument("--threads", default="1,2", help="thread settings, one phase each; the first is the equal-"
                     "threads comparison")
    eng.add_argument("--swaps", type=int, default=20, help="draft swaps timed in the live vLLM engine")
    eng.add_argument("--out-dir", default=None, help="where engine.json goes (default docs/bench)")
    eng.add_argument("--json", action="store_true", help="print only the JSON object on stdout")
    eng.set_defaults(func=_bench_engine)

    drf = bench_sub.add_parser("drafter", help="trained drafters: acceptance, speed-up, drift, stops")
    drf.add_argument("--model", default=SMOLLM2_SPEC)
    drf.add_argument("--prompts", type=int, default=6, help="held-out evaluation prompts (of the 16 fixed ones)")
    drf.add_argument("--new-tokens", type=int, default=96)
    drf.add_argument("--k", default="2,3,4,6")
    drf.add_argument("--threads", type=int, default=2)
    drf.add_argument("--warm-prompts", type=int, default=1536)
    drf.add_argument("--warm-steps", type=int, default=2000)
    drf.add_argument("--warm-unroll", type=int, default=4, help="draft positions the warm start trains")
    drf.add_argument("--parts", default="abc", help="a: acceptance sweep, b: drift, c: training throughput and stops")
    drf.add_argument("--adapt-seconds", type=float, default=60.0, help="online training budget after the drift")
    drf.add_argument("--adapt-lr", type=float, default=3e-4, help="peak learning rate of the online adaptation")
    drf.add_argument("--adapt-prompts", type=int, default=256, help="new-policy rollouts the adaptation trains on")
    drf.add_argument("--stop-trials", type=int, default=20)
    drf.add_argument("--draft-dtype", default="auto", choices=("auto", "policy", "float32", "bfloat16", "int8"),
                     help="precision the heads draft in; auto: bf16 where the device has bf16 units; int8: "
                          "int8 weights on a CPU")
    drf.add_argument("--tree", default="",
                     help="draft tree served: candidates at the first depths, e.g. 3,2 ('': a chain)")
    drf.add_argument("--tree-side-depth", type=int, default=1, help="depth of the chain under each extra candidate")
    drf.add_argument("--out-dir", default=None, help="where drafter.json goes (default docs/bench)")
    drf.add_argument("--json", action="store_true", help="accepted for symmetry; the JSON object is always last")
    drf.set_defaults(func=_bench_drafter)

    gpu = bench_sub.add_parser("gpu", help="one GPU in one run: forward physics, warm start, speculation at batch 1 "
                               "and in batches, a long-tail rollout, drift, training, the CUDA tests")
    add_gpu_arguments(gpu)
    gpu.set_defaults(func=_bench_gpu)

    dp = bench_sub.add_parser("dataplane", help="GRPO job on local Ray: step breakdown, hot swap, progress cost")
    dp.add_argument("--model", default=SMOLLM2_SPEC)
    dp.add_argument("--workers", type=int, default=4, help="rollout workers (logical GPUs)")
    dp.add_argument("--steps", type=int, default=1)
    dp.add_argument("--prompts", type=int, default=4, help="prompts per step")
    dp.add_argument("--group-size", type=int, default=4)
    dp.add_argument("--new-tokens", type=int, default=96)
    dp.add_argument("--swap-trials", type=int, default=3)
    dp.add_argument("--json", action="store_true", help="accepted for symmetry; the JSON object is always last")
    dp.set_defaults(func=_bench_dataplane)
    ob = bench_sub.add_parser("observability", help="CPU cost of /metrics and the status page at N workers")
    ob.add_argument("--workers", type=int, default=256)
    ob.add_argument("--steps", type=int, default=50, help="step records of the job")
    ob.add_argument("--events", type=int, default=40, help="state transitions per worker")
    ob.add_argument("--repeats", type=int, default=20)
    ob.add_argument("--json", action="store_true", help="accepted for symmetry; the JSON object is always last")
    ob.set_defaults(func=_bench_observability)
    sc = bench_sub.add_parser("scheduler", help="dispatch and preemption latency on real workers; the policy pass "
                              "at N simulated workers")
    sc.add_argument("--trials", type=int, default=60, help="leases dispatched and preempted on the real workers")
    sc.add_argument("--workers", type=int, default=2048, help="simulated workers of the policy pass")
    sc.add_argument("--ticks", type=int, default=300, help="policy passes timed")
    sc.add_argument("--tick-s", type=float, default=0.1, help="the watcher's tick")
    sc.add_argument("--short-s", type=float, default=0.8, help="the rollout of the worker that goes idle first")
    sc.add_argument("--long-s", type=float, default=1.4, help="the straggler's rollout")
    sc.add_argument("--out-dir", default=None, help="where scheduler.json goes (default docs/bench)")
    sc.add_argument("--json", action="store_true", help="accepted for symmetry; the JSON object is always last")
    sc.set_defaults(func=_bench_scheduler)
    rl = bench_sub.add_parser("rl", help="the same RL job plain, with a frozen warm draft, and with TLT, side by side")
    rl.add_argument("--model", default="smollm2-135m")
    rl.add_argument("--task", default="longtail", choices=sorted(TASKS))
    rl.add_argument("--steps", type=int, default=3, help="RL steps per job")
    rl.add_argument("--repeats", type=int, default=2, help="runs of each arm; the order turns round each time")
    rl.add_argument("--prompts", type=int, default=10, help="prompts per step (longtail: 1 in 10 asks for detail)")
    rl.add_argument("--group-size", type=int, default=4)
    rl.add_argument("--new-tokens", type=int, default=512)
    rl.add_argument("--workers", type=int, default=2, help="rollout workers, each pinned to its own core here")
    rl.add_argument("--k", type=int, default=4, help="draft_k: the longest draft the adaptive choice may use")
    rl.add_argument("--warm-draft", default=None, help="the draft b and c start from (default: the cached one "
                    "`make warm-draft` builds for the task)")
    rl.add_argument("--arms", default="abc", help="a plain, b frozen warm draft, c TLT (a and b or c)")
    rl.add_argument("--seed", type=int, default=0)
    rl.add_argument("--out-dir", default=None, help="where rl.json goes (default docs/bench)")
    rl.add_argument("--json", action="store_true", help="accepted for symmetry; the JSON object is always last")
    rl.set_defaults(func=_bench_rl)
    flt = bench_sub.add_parser("faults", help="fuzz, hostile input, Redis outage, driver kill, idempotency: counts")
    flt.add_argument("--requests", type=int, default=1200, help="schemathesis requests on the scheduler without Ray")
    flt.add_argument("--out-dir", default=None, help="where faults.json goes (default docs/bench)")
    flt.add_argument("--json", action="store_true", help="accepted for symmetry; the JSON object is always last")
    flt.set_defaults(func=_bench_faults)

    dr = sub.add_parser("drafter", help="drafter tools")
    dr_sub = dr.add_subparsers(dest="drafter", required=True)
    tr = dr_sub.add_parser("train", help="offline warm start: generate, harvest, train a draft head")
    tr.add_argument("--model", default=SMOLLM2_SPEC)
    tr.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": "..."} per line')
    tr.add_argument("--task", default=None, help="a built-in task's own prompts (arithmetic, longtail), with "
                    "the recipe's defaults (workers.warm.WarmRecipe); held-out prompts of the task are evaluated")
    tr.add_argument("--num-prompts", type=int, default=None,
                    help=f"task prompts harvested (default {_RECIPE.num_prompts})")
    tr.add_argument("--num-eval-prompts", type=int, default=_RECIPE.num_eval_prompts,
                    help="held-out task prompts the accepted length is measured on")
    tr.add_argument("--out", required=True, help="directory for draft-v000001.safetensors")
    tr.add_argument("--steps", type=int, default=None,
                    help=f"training micro-steps (with --task, default {_RECIPE.num_steps})")
    tr.add_argument("--seconds", type=float, default=None, help="training time budget")
    tr.add_argument("--max-new-tokens", type=int, default=_RECIPE.max_new_tokens)
    tr.add_argument("--temperature", type=float, default=_RECIPE.temperature, help="harvest sampling temperature")
    tr.add_argument("--batch-size", type=int, default=_RECIPE.batch_size)
    tr.add_argument("--draft-vocab", type=int, default=JobSpec.model_fields["draft_vocab_size"].default,
                    help="draft vocabulary size (most frequent tokens)")
    tr.add_argument("--unroll", type=int, default=_RECIPE.num_unroll, help="training-time unrolled draft positions")
    tr.add_argument("--threads", type=int, default=2)
    tr.add_argument("--harvest-file", default=None,
                    help="keep the harvest here (safetensors); an existing file is read instead of generating")
    tr.set_defaults(func=_drafter_train)

    gen = sub.add_parser("generate", help="generate from prompts with the built-in engine")
    gen.add_argument("prompt", nargs="+")
    gen.add_argument("--model", default=SMOLLM2_SPEC)
    gen.add_argument("--k", type=int, default=0, help="n-gram draft length (0 = plain decoding)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)
