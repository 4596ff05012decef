"""`tlt bench gpu` (c), (d): speculative decoding against plain decoding on the device, side by side.

(c) batch 1, greedy and T=1, at each k (bench.drafter.sweep: prompt by prompt, the arms interleaved);
(d) fixed batch sizes (every row runs the same number of tokens, so the batch never shrinks): plain, a
    fixed k and the adaptive tuner (drafter.draft.adaptive, from a prior of the draft's measured acceptance),
    each once untimed on the same requests, then repeated in rotating order; per cell ms per step and what the
    timed runs captured or rebuilt (bench.gpu_cells); greedy outputs are compared with plain decoding's;
(g), the long-tail rollout, is bench.gpu_longtail's.
"""

from __future__ import annotations

from collections.abc import Callable

from bench.drafter import calibrate, sweep
from bench.gpu_cells import RunCost, timed, warm_shapes
from bench.prompts import PROMPTS, synthetic_prompts
from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.adaptive import DraftLengthTuner, StepCostPrior
from drafter.draft.eagle import EagleDrafter
from drafter.model.loading import encode_prompt, encode_text


class ByteTokenizer:
    """The tokenizer of a tokenizer-less preset (tests only): a prompt's first bytes folded into the
    vocabulary, as a job encodes text for one (drafter.model.loading.encode_text); ids decode to characters,
    so stop strings such as the longtail task's "\\n" work."""

    chat_template = None

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return encode_text(None, text, self.vocab_size)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def rotated(names: list[str], r: int) -> list[str]:
    """`names` turned round by r: each arm runs first, second, ... in turn."""
    r %= max(len(names), 1)
    return names[r:] + names[:r]


def sweep_b1(engine: Engine, tok, head, ks: tuple[int, ...], k: int, num_prompts: int, new_tokens: int,
             num_calib_prompts: int, draft_dtype) -> dict:
    """(c): the draft temperature calibrated at T=1 first, then the interleaved batch-1 sweep."""
    calib = calibrate(engine, tok, head, k=k, num_prompts=num_calib_prompts)
    prompts = [encode_prompt(tok, PROMPTS[i % len(PROMPTS)]) for i in range(num_prompts)]  # held out
    res = sweep(engine, prompts, ks, {"warm": EagleDrafter(engine.model, head, draft_dtype)}, new_tokens)
    greedy, temp1 = res["greedy"], res["temp1"]
    best_greedy = max(ks, key=lambda kk: greedy[f"warm_k{kk}"]["speedup"])
    best_t1 = max(ks, key=lambda kk: temp1[f"warm_k{kk}"]["speedup"])
    return {**calib, "sweep": res, "best_k_greedy": best_greedy, "best_k_t1": best_t1,
            "speedup_greedy_b1": greedy[f"warm_k{best_greedy}"]["speedup"],
            "speedup_t1_b1": temp1[f"warm_k{best_t1}"]["speedup"],
            # issue 39: the longest accepted runs at any k swept (the draft's, whatever the engine makes of them)
            "accepted_greedy_best": max(greedy[f"warm_k{kk}"]["mean_accepted_length"] for kk in ks),
            "accepted_t1_best": max(temp1[f"warm_k{kk}"]["mean_accepted_length"] for kk in ks),
            "greedy_identical_fraction_b1": round(res["greedy_identical"] / max(res["greedy_compared"], 1), 4)}


def prior_from(sweep: dict | None, k: int, knee_tokens: float | None = None) -> StepCostPrior:
    """The adaptive tuner's prior: the warm draft's accepted length at k as (c) measured it at batch 1, T=1 (the
    RL setting; greedy where T=1 was not run), and the step costs (a) measured; the defaults where a part did
    not run."""
    costs = {} if knee_tokens is None else {"knee_tokens": knee_tokens}
    cell = ((sweep or {}).get("sweep") or {})
    for temp in ("temp1", "greedy"):
        accepted = (cell.get(temp) or {}).get(f"warm_k{k}", {}).get("mean_accepted_length")
        if accepted:
            return StepCostPrior.from_accepted_length(min(max(accepted, 1.0), k + 1.0), k, **costs)
    return StepCostPrior(**costs)


def cell_of(runs: dict[str, list[RunCost]], name: str) -> dict:
    rs = runs[name]
    seconds = sum(r.seconds for r in rs)
    return {"tokens_per_s": round(sum(r.num_tokens for r in rs) / seconds, 2),
            "ms_per_step": round(1000 * seconds / max(sum(r.num_steps for r in rs), 1), 3),
            "mean_accepted_length": round(sum(r.num_tokens for r in rs) / max(sum(r.num_seq_steps for r in rs), 1), 3),
            "graph_captures_timed": sum(r.captures for r in rs), "cache_rebuilds_timed": sum(r.rebuilds for r in rs),
            "host_reads_per_step": round(sum(r.host_reads for r in rs) / max(sum(r.num_steps for r in rs), 1), 3)}


def sweep_requests(tok, batch_size: int, temperature: float, new_tokens: int) -> list[Request]:
    """(d)'s requests: batch_size synthetic prompts, each row run to new_tokens (EOS ignored: the batch never
    shrinks), seeded per row."""
    prompts = [encode_prompt(tok, t) for t in synthetic_prompts(batch_size, seed=21)]
    return [Request(p, SamplingParams(temperature=temperature, max_new_tokens=new_tokens, ignore_eos=True, seed=i))
            for i, p in enumerate(prompts)]


def batch_sweep(engine: Engine, tok, head, batch_sizes: tuple[int, ...], k: int, new_tokens: int, repeats: int,
                draft_dtype, progress: Callable[[str], None], tuners: dict | None = None,
                prior: StepCostPrior | None = None, suffix: str = "") -> dict:
    """(d): plain, fixed-k and adaptive decoding per batch size and temperature, the batch sizes from the smallest
    up. Every arm runs once untimed with the very requests it is then timed on (same shapes, same length: its
    captures, and the adaptive tuner's forced tries, happen there), then `repeats` timed runs in rotating order.
    Per cell: tokens/s, ms per decode step and their ratios to plain (`spec_step_cost`: a speculative step's ms
    over a plain one's), accepted length, captures and rebuilds inside the timed runs, host reads per step.
    tuners: filled with the tuner of each temperature ({0.0: ..., 1.0: ...}), for (g) to start from. suffix:
    appended to the flat keys (`_bf16` for the bf16 policy)."""
    drafter = EagleDrafter(engine.model, head, draft_dtype)
    table: dict = {}
    flat: dict = {}
    identical = compared = captures = rebuilds = warm_captures = 0
    for temp in (0.0, 1.0):
        tuner = DraftLengthTuner(k, prior=prior)  # one per temperature, kept over batch sizes, as a worker keeps it
        if tuners is not None:
            tuners[temp] = tuner
        arms = {"plain": (0, None), f"k{k}": (k, None), "adaptive": (k, tuner)}
        rows: dict = {}
        # as a worker before its first batch: every bucket up to the largest, at each k the tuner may serve
        warm_captures += warm_shapes(engine, sweep_requests(tok, max(batch_sizes), temp, new_tokens), k, drafter)
        for B in sorted(batch_sizes):
            reqs = sweep_requests(tok, B, temp, new_tokens)
            for kk, tn in arms.values():  # untimed, identical to the timed runs
                timed(engine, reqs, kk, drafter, tn)
            runs: dict = {name: [] for name in arms}
            for r in range(repeats):
                for name in rotated(list(arms), r):
                    kk, tn = arms[name]
                    runs[name].append(timed(engine, reqs, kk, drafter, tn))
            row = {name: cell_of(runs, name) for name in arms}
            plain = row["plain"]
            for name in arms:
                row[name]["ratio"] = round(row[name]["tokens_per_s"] / plain["tokens_per_s"], 3)
                row[name]["spec_step_cost"] = round(row[name]["ms_per_step"] / plain["ms_per_step"], 3)
                captures += row[name]["graph_captures_timed"]
                rebuilds += row[name]["cache_rebuilds_timed"]
                if temp == 0.0 and name != "plain":
                    want = [o.token_ids for o in runs["plain"][0].outputs]
                    for run_ in runs[name]:
                        compared += len(run_.outputs)
                        identical += sum(o.token_ids == p for o, p in zip(run_.outputs, want))
            row["adaptive"]["k_served"] = tuner.summary()
            row["adaptive"]["over_best"] = round(row["adaptive"]["tokens_per_s"]
                                                 / max(plain["tokens_per_s"], row[f"k{k}"]["tokens_per_s"]), 3)
            rows[f"b{B}"] = row
            mode = "greedy" if temp == 0.0 else "t1"
            flat[f"speedup_k{k}_{mode}_b{B}{suffix}"] = row[f"k{k}"]["ratio"]
            if temp == 0.0:
                flat[f"spec_step_cost_k{k}_b{B}{suffix}"] = row[f"k{k}"]["spec_step_cost"]
            progress(f"batch sweep{suffix} T={temp} b{B}: " + ", ".join(
                f"{n} {row[n]['ratio']:.2f}x ({row[n]['ms_per_step']:.1f} ms/step)" for n in arms))
        table["greedy" if temp == 0.0 else "temp1"] = rows
    return {"table": table, "k": k, "new_tokens": new_tokens, "repeats": repeats, **flat,
            "prior": None if prior is None else vars(prior),
            f"adaptive_min_ratio{suffix}": min(row["adaptive"]["over_best"] for t in table.values()
                                               for row in t.values()),
            f"greedy_identical_fraction{suffix}": round(identical / max(compared, 1), 4),
            "greedy_compared": compared, "graph_captures_warm_up": warm_captures,
            "graph_captures_timed": captures, "cache_rebuilds_timed": rebuilds}
