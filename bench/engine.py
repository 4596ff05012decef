"""`tlt bench engine`: our engine (plain, n-gram) against transformers (plain, prompt lookup).

Configurations run interleaved, prompt by prompt, so machine noise spreads over all of them
alike; ratios from one run are the figures to quote. The JSON object is printed last.
"""

from __future__ import annotations

import platform
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from bench.prompts import PROMPTS
from drafter.drafters import NgramDrafter
from drafter.eagle import EagleDrafter
from drafter.engine import Engine, Request
from drafter.head import EagleHead
from drafter.loading import encode_prompt, load_model
from drafter.sampling import SamplingParams


@dataclass
class Tally:
    seconds: float = 0.0
    tokens: int = 0
    seq_steps: int = 0  # policy forwards per sequence, summed over sequences
    outputs: list[list[int]] = field(default_factory=list)

    def report(self) -> dict:
        return {"tokens_per_s": round(self.tokens / max(self.seconds, 1e-9), 2),
                "target_forwards_per_token": round(self.seq_steps / max(self.tokens, 1), 4),
                "mean_accepted_length": round(self.tokens / max(self.seq_steps, 1), 4),
                "seconds": round(self.seconds, 2), "tokens": self.tokens}


def log(msg: str) -> None:
    print(f"[bench engine] {msg}", file=sys.stderr, flush=True)


class HFRunner:
    """transformers `generate` on the same weights, plain or with prompt lookup decoding."""

    def __init__(self, hf_dir: str, dtype: torch.dtype, pad_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, local_files_only=True).eval()
        self.model.generation_config.eos_token_id = None  # fixed-length runs, like ignore_eos in ours
        self.model.generation_config.pad_token_id = pad_id
        self.pad_id = pad_id
        self.num_forwards = 0
        self.model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.num_forwards += 1

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, lookup: int = 0) -> tuple[list[list[int]], int]:
        L = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (L - len(p)) + p for p in prompts])  # left padding
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
        extra = {"prompt_lookup_num_tokens": lookup} if lookup else {}
        before = self.num_forwards
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                  min_new_tokens=max_new_tokens, do_sample=False, **extra)
        return out[:, L:].tolist(), self.num_forwards - before


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - t0


def run_ours(engine: Engine, prompts, new_tokens: int, k: int, drafter, tally: Tally) -> None:
    reqs = [Request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    outs, dt = timed(lambda: engine.generate(reqs, k=k, drafter=drafter))
    tally.seconds += dt
    tally.tokens += sum(len(o.token_ids) for o in outs)
    tally.seq_steps += sum(o.num_steps for o in outs)
    tally.outputs += [o.token_ids for o in outs]


def run_hf(hf: HFRunner, prompts, new_tokens: int, lookup: int, tally: Tally) -> None:
    (outs, forwards), dt = timed(lambda: hf.generate(prompts, new_tokens, lookup))
    tally.seconds += dt
    tally.tokens += sum(len(o) for o in outs)
    tally.seq_steps += forwards * len(prompts)  # every row takes part in every batched forward
    tally.outputs += outs


def verify_cost(model, context: int = 256, max_k: int = 8, reps: int = 15) -> dict[str, float]:
    """Median time of one policy forward over k new tokens, relative to one token."""
    cache = model.new_cache(1, context + max_k + 1)
    ids = torch.randint(0, model.cfg.vocab_size, (1, context + max_k))
    with torch.inference_mode():
        model(ids[:, :context], torch.arange(context).unsqueeze(0), cache, logits_for="none")
        times: dict[int, list[float]] = {k: [] for k in range(1, max_k + 1)}
        for _ in range(reps):
            for k in range(1, max_k + 1):  # interleaved, so drift hits every k alike
                pos = torch.arange(context, context + k).unsqueeze(0)
                _, dt = timed(lambda pos=pos, k=k: model(ids[:, context : context + k], pos, cache))
                times[k].append(dt)
    base = statistics.median(times[1])
    return {str(k): round(statistics.median(v) / base, 3) for k, v in times.items()}


def greedy_identity(engine: Engine, prompts, new_tokens: int, ks: list[int]) -> tuple[float, dict]:
    """Fraction of (prompt, drafter, k) whose speculative output equals plain greedy output."""
    reqs = [Request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)) for p in prompts]
    plain = [o.token_ids for o in engine.generate(reqs)]
    same, total, detail = 0, 0, {}
    drafters = {"ngram": NgramDrafter(), "eagle_untrained": EagleDrafter(engine.model, EagleHead(engine.model.cfg))}
    for name, drafter in drafters.items():
        for k in ks:
            outs = engine.generate(reqs, k=k, drafter=drafter)
            n = sum(o.token_ids == p for o, p in zip(outs, plain))
            detail[f"{name}_k{k}"] = n / len(prompts)
            same, total = same + n, total + len(prompts)
            log(f"greedy identity {name} k={k}: {n}/{len(prompts)}")
    return same / total, detail


def bench_engine(model_spec: str = "smollm2-135m", num_prompts: int = 16, new_tokens: int = 128,
                 ks: tuple[int, ...] = (2, 4), threads: int = 2, dtype: str = "float32", with_hf: bool = True) -> dict:
    if not ks or min(ks) < 1:
        raise ValueError(f"ks must list draft lengths >= 1, got {ks!r}")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    torch_dtype = getattr(torch, dtype)
    loaded = load_model(model_spec, dtype=torch_dtype)
    engine = Engine(loaded.model, loaded.tokenizer)
    prompts = [encode_prompt(loaded.tokenizer, t) for t in PROMPTS[:num_prompts]]
    hf = HFRunner(str(loaded.path), torch_dtype, loaded.tokenizer.pad_token_id or 0) if with_hf else None
    result: dict = {"model": loaded.name, "dtype": dtype, "threads": threads, "num_prompts": len(prompts),
                    "new_tokens": new_tokens, "ks": list(ks), "machine": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "configs": {}}
    ngram = NgramDrafter()
    # warm-up: first calls pay allocator and kernel-selection costs
    run_ours(engine, prompts[:1], 8, 0, None, Tally())
    if hf:
        run_hf(hf, prompts[:1], 8, 0, Tally())
    for batch in (1, 8):
        tallies: dict[str, Tally] = {}
        for start in range(0, len(prompts), batch):
            chunk = prompts[start : start + batch]
            log(f"batch {batch}: prompts {start}..{start + len(chunk) - 1}")
            run_ours(engine, chunk, new_tokens, 0, None, tallies.setdefault("ours_plain", Tally()))
            if hf:
                run_hf(hf, chunk, new_tokens, 0, tallies.setdefault("hf_plain", Tally()))
            for k in ks:
                run_ours(engine, chunk, new_tokens, k, ngram, tallies.setdefault(f"ours_ngram_k{k}", Tally()))
                if hf and batch == 1:  # transformers' assisted generation supports batch size 1 only
                    run_hf(hf, chunk, new_tokens, k, tallies.setdefault(f"hf_prompt_lookup_k{k}", Tally()))
        reports = {n: t.report() for n, t in tallies.items()}
        for rep in reports.values():
            rep["vs_ours_plain"] = round(rep["tokens_per_s"] / reports["ours_plain"]["tokens_per_s"], 3)
            if "hf_plain" in reports:
                rep["vs_hf_plain"] = round(rep["tokens_per_s"] / reports["hf_plain"]["tokens_per_s"], 3)
        plain_out = tallies["ours_plain"].outputs
        for name, tally in tallies.items():
            reports[name]["identical_to_ours_plain"] = sum(
                a == b for a, b in zip(tally.outputs, plain_out)) / len(plain_out)
        result["configs"][f"batch{batch}"] = reports
        log(f"batch {batch}: " + ", ".join(f"{n} {r['tokens_per_s']} tok/s" for n, r in reports.items()))
    b1 = result["configs"]["batch1"]
    result["ngram_speedup_by_k"] = {str(k): b1[f"ours_ngram_k{k}"]["vs_ours_plain"] for k in ks}
    result["ngram_speedup"] = b1[f"ours_ngram_k{ks[0]}"]["vs_ours_plain"]
    result["ours_plain_vs_hf_plain"] = b1["ours_plain"].get("vs_hf_plain")
    log("verify-cost curve")
    result["verify_cost"] = verify_cost(loaded.model)
    result["greedy_identical_fraction"], result["greedy_identity"] = greedy_identity(
        engine, prompts, new_tokens, [1, 2, 4, 7])
    return result
