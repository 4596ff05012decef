"""The `tlt` commands that are not the scheduler's: the offline drafter warm start (`tlt drafter train`) and
`tlt generate`. Each imports what it runs (torch included) only when it runs, so the scheduler's own
commands stay torch-free. (`tlt bench` is the bench registry's, bench/cli.py, mounted by entry point.)"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

from drafter.model.config import SMOLLM2_SPEC, TrainConfig
from workers.warm import GPU_RECIPE, WarmRecipe, default_recipe

_RECIPE = WarmRecipe()  # `tlt drafter train --task`'s defaults


def _read_prompts(path: str) -> list[str]:
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

    if (args.prompts is None) == (args.task is None):
        raise ValueError("give --prompts FILE or --task NAME (one of them)")
    torch.set_num_threads(args.threads)
    report = _train_on_task(args) if args.task is not None else _train_on_prompts(args)
    print(json.dumps(report))
    return 0


# the options that set a WarmRecipe field; left out (None), the field keeps the device's recipe's value
_RECIPE_OPTIONS = {"num_prompts": "num_prompts", "num_eval_prompts": "num_eval_prompts", "steps": "num_steps",
                   "max_new_tokens": "max_new_tokens", "temperature": "temperature", "batch_size": "batch_size",
                   "draft_vocab": "draft_vocab_size", "unroll": "num_unroll", "seconds": "train_seconds"}


def _task_recipe(args: argparse.Namespace) -> WarmRecipe:
    """The recipe `--task` trains by: the device's (workers.warm.default_recipe: WarmRecipe() on a CPU, GPU_RECIPE
    on CUDA), with what the options change (all options left out on a CPU: WarmRecipe() itself, the recipe `tlt
    demo` and `tlt bench rl` key the warm-draft cache by)."""
    recipe = default_recipe(args.device)
    changed = {field: getattr(args, opt) for opt, field in _RECIPE_OPTIONS.items() if getattr(args, opt) is not None}
    return replace(recipe, **changed)


def _option(args: argparse.Namespace, opt: str):
    """An option's value, or the CPU recipe's where it was left out (--prompts)."""
    value = getattr(args, opt)
    return getattr(_RECIPE, _RECIPE_OPTIONS[opt]) if value is None else value


def _train_on_task(args: argparse.Namespace) -> dict:
    """workers.warm's build: into --out, or without it the warm-draft cache (workers.warm.ensure_warm_draft:
    a draft already cached for this model, task and recipe is reused, and its report printed)."""
    from workers.warm import WARM_REPORT, build_warm_draft, ensure_warm_draft

    recipe = _task_recipe(args)  # --seconds is its train_seconds: the budget it trains (and anneals) to
    if args.out is not None:
        return build_warm_draft(args.model, args.task, args.out, args.device, recipe, harvest_file=args.harvest_file)
    path = Path(ensure_warm_draft(args.model, args.task, args.device, recipe))
    return json.loads((path.parent / WARM_REPORT).read_text())


def _train_on_prompts(args: argparse.Namespace) -> dict:
    from drafter.model.loading import encode_prompt, load_model
    from drafter.train.warmstart import HarvestConfig, warm_start

    if args.out is None:
        raise ValueError("--prompts needs --out (the warm-draft cache holds the built-in tasks' drafts)")
    if args.steps is None and args.seconds is None:
        raise ValueError("give --steps or --seconds")
    texts = _read_prompts(args.prompts)
    held = max(1, len(texts) // 10) if len(texts) > 1 else 0
    texts, eval_texts = texts[held:] or texts, texts[:held][:8]
    loaded = load_model(args.model, device=args.device)
    _, report = warm_start(loaded.model, loaded.tokenizer, [encode_prompt(loaded.tokenizer, t) for t in texts],
                           args.out, train_cfg=TrainConfig(total_steps=args.steps or 1000,
                                                           num_unroll=_option(args, "unroll"),
                                                           anneal_to_budget=False, bf16_autocast=False),
                           harvest_cfg=HarvestConfig(max_new_tokens=_option(args, "max_new_tokens"),
                                                     batch_size=_option(args, "batch_size"),
                                                     temperature=_option(args, "temperature"), top_p=1.0),
                           max_steps=args.steps, max_seconds=args.seconds,
                           draft_vocab_size=_option(args, "draft_vocab"),
                           eval_prompts=[encode_prompt(loaded.tokenizer, t) for t in eval_texts],
                           harvest_file=args.harvest_file)
    return {"model": loaded.name, "task": None, "device": str(loaded.model.device), **asdict(report)}


def _generate(args: argparse.Namespace) -> int:
    from drafter.decode.engine import Engine, Request
    from drafter.decode.sampling import SamplingParams
    from drafter.draft.drafters import NgramDrafter
    from drafter.model.loading import encode_prompt, load_model

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
    """Add `drafter` and `generate` to the `tlt` subcommands."""
    dr = sub.add_parser("drafter", help="drafter tools")
    dr_sub = dr.add_subparsers(dest="drafter", required=True)
    tr = dr_sub.add_parser("train", help="offline warm start: generate, harvest, train a draft head")
    tr.add_argument("--model", default=SMOLLM2_SPEC)
    tr.add_argument("--prompts", default=None, help='JSONL file, one {"prompt": "..."} per line')
    tr.add_argument("--task", default=None, help="a built-in task's own prompts (arithmetic, longtail), with "
                    "the recipe's defaults (workers.warm.WarmRecipe); held-out prompts of the task are evaluated")
    tr.add_argument("--num-prompts", type=int, default=None,
                    help=f"task prompts harvested (default {_RECIPE.num_prompts}; on cuda {GPU_RECIPE.num_prompts})")
    tr.add_argument("--num-eval-prompts", type=int, default=None,
                    help="held-out task prompts the accepted length is measured on (default "
                         f"{_RECIPE.num_eval_prompts}; on cuda {GPU_RECIPE.num_eval_prompts})")
    tr.add_argument("--out", default=None, help="directory for draft-v000001.safetensors (with --task, default: "
                    "the warm-draft cache `tlt demo` and `tlt bench rl` read, workers.warm.warm_cache_dir; a draft "
                    "cached there for the same model, task and recipe is reused)")
    tr.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model harvests and the "
                    "head trains; cuda's recipe (workers.warm.GPU_RECIPE) trains "
                    f"{GPU_RECIPE.train_seconds:.0f} s, a warm start within 5 minutes")
    tr.add_argument("--steps", type=int, default=None,
                    help=f"training micro-steps (with --task a limit, default {_RECIPE.num_steps}: the recipe's "
                         f"time budget binds, {_RECIPE.train_seconds:.0f} s on a CPU, {GPU_RECIPE.train_seconds:.0f} s "
                         "on cuda)")
    tr.add_argument("--seconds", type=float, default=None, help="training time budget (with --task the recipe's, "
                    f"default {_RECIPE.train_seconds:.0f} s on a CPU, {GPU_RECIPE.train_seconds:.0f} s on cuda; the "
                    "steps stay a limit too)")
    tr.add_argument("--max-new-tokens", type=int, default=None, help=f"default {_RECIPE.max_new_tokens}")
    tr.add_argument("--temperature", type=float, default=None,
                    help=f"harvest sampling temperature (default {_RECIPE.temperature}, as RL samples)")
    tr.add_argument("--batch-size", type=int, default=None,
                    help=f"rollouts harvested together (default {_RECIPE.batch_size}; on cuda {GPU_RECIPE.batch_size})")
    tr.add_argument("--draft-vocab", type=int, default=None,
                    help=f"draft vocabulary size (most frequent tokens; default {_RECIPE.draft_vocab_size})")
    tr.add_argument("--unroll", type=int, default=None, help="training-time unrolled draft positions (default "
                    f"{_RECIPE.num_unroll}; on cuda {GPU_RECIPE.num_unroll})")
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
