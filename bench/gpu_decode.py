"""`tlt bench gpu` (c), (d), (g): speculative decoding against plain decoding on the device, side by side.

(c) batch 1, greedy and T=1, at each k (bench.drafter.sweep: prompt by prompt, the arms interleaved);
(d) fixed batch sizes (every row runs the same number of tokens, so the batch never shrinks): plain, a
    fixed k and the adaptive tuner (drafter.draft.adaptive), repeated in rotating order; greedy outputs are
    compared with plain decoding's, token for token;
(g) one rollout batch of the longtail task (workers.tasks: several responses per prompt, T=1, up to 512
    tokens, the short answers stopping at their line's end) decoded plain, with the frozen warm draft at a
    fixed k, and adaptively: the whole batch's time and its tail's (after 90% of the responses finished).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from bench.drafter import calibrate, sweep
from bench.prompts import PROMPTS, synthetic_prompts
from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.adaptive import DraftLengthTuner
from drafter.draft.eagle import EagleDrafter
from drafter.model.loading import encode_prompt, encode_text
from workers.tasks import make_task

LONGTAIL_SEED = 7  # the rollout batch's prompts: neither the warm start's seed nor its held-out one
TAIL_FRACTION = 0.9  # the tail: what runs after this share of the responses finished


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
            "greedy_identical_fraction_b1": round(res["greedy_identical"] / max(res["greedy_compared"], 1), 4)}


def _run(engine: Engine, reqs: list[Request], k: int, drafter, tuner=None, on_step=None):
    t0 = time.perf_counter()
    outs = engine.generate(reqs, k=k, drafter=drafter if k else None, tuner=tuner, on_step=on_step)
    return outs, time.perf_counter() - t0


def batch_sweep(engine: Engine, tok, head, batch_sizes: tuple[int, ...], k: int, new_tokens: int, repeats: int,
                draft_dtype, progress: Callable[[str], None], tuners: dict | None = None) -> dict:
    """(d): tokens/s of plain, fixed-k and adaptive decoding per batch size and temperature, the batch sizes
    from the smallest up (the tuner drafts at a batch size only where a smaller one found it paid). The
    adaptive arm is measured in steady state: one untimed run of full length at each batch size first does
    its forced tries there, as a worker's earlier rollouts would have. tuners: filled with the tuner of
    each temperature ({0.0: ..., 1.0: ...}), for (g) to start from."""
    prompts = [encode_prompt(tok, t) for t in synthetic_prompts(max(batch_sizes), seed=21)]
    drafter = EagleDrafter(engine.model, head, draft_dtype)
    table: dict = {}
    identical = compared = 0
    for temp in (0.0, 1.0):
        tuner = DraftLengthTuner(k)  # one per temperature, kept over batch sizes and repeats, as a worker keeps its own
        if tuners is not None:
            tuners[temp] = tuner
        arms = {"plain": (0, None), f"k{k}": (k, None), "adaptive": (k, tuner)}
        rows: dict = {}
        for B in sorted(batch_sizes):
            reqs = [Request(prompts[i], SamplingParams(temperature=temp, max_new_tokens=new_tokens, ignore_eos=True,
                                                       seed=i)) for i in range(B)]
            short = [Request(r.prompt_ids, SamplingParams(temperature=temp, max_new_tokens=8, ignore_eos=True, seed=0))
                     for r in reqs]
            for kk, tn in arms.values():  # untimed: no arm pays for a first call at this batch size
                _run(engine, short if tn is None else reqs, kk, drafter, tn)
            runs: dict = {name: [] for name in arms}
            for r in range(repeats):
                for name in rotated(list(arms), r):
                    kk, tn = arms[name]
                    runs[name].append(_run(engine, reqs, kk, drafter, tn))
            tps = {name: sum(len(o.token_ids) for outs, _ in rs for o in outs) / sum(dt for _, dt in rs)
                   for name, rs in runs.items()}
            row = {name: {"tokens_per_s": round(v, 2), "ratio": round(v / tps["plain"], 3)} for name, v in tps.items()}
            for name in arms:
                outs = [o for outs, _ in runs[name] for o in outs]
                row[name]["mean_accepted_length"] = round(sum(len(o.token_ids) for o in outs)
                                                          / max(sum(o.num_steps for o in outs), 1), 3)
                if temp == 0.0 and name != "plain":
                    plain = [o.token_ids for o in runs["plain"][0][0]]
                    for outs_r, _ in runs[name]:
                        compared += len(outs_r)
                        identical += sum(o.token_ids == p for o, p in zip(outs_r, plain))
            row["adaptive"]["k_served"] = tuner.summary()
            rows[f"b{B}"] = row
            progress(f"batch sweep T={temp} b{B}: " + ", ".join(f"{n} {row[n]['ratio']:.2f}x" for n in arms))
        table["greedy" if temp == 0.0 else "temp1"] = rows
    return {"table": table, "k": k, "new_tokens": new_tokens, "repeats": repeats,
            "adaptive_min_ratio": min(row["adaptive"]["ratio"] for row in table["temp1"].values()),
            "greedy_identical": identical == compared, "greedy_compared": compared,
            "greedy_identical_fraction": round(identical / max(compared, 1), 4)}


def longtail_requests(tok, num_prompts: int, group: int, new_tokens: int) -> list[Request]:
    """One rollout batch of the longtail task: each prompt `group` times, T=1, with the task's stop strings."""
    problems = make_task("longtail", LONGTAIL_SEED).sample(num_prompts)
    return [Request(encode_prompt(tok, p.prompt), SamplingParams(temperature=1.0, max_new_tokens=new_tokens,
                                                                 stop_strings=p.stop_strings, seed=1000 * i + j))
            for i, p in enumerate(problems) for j in range(group)]


def longtail(engine: Engine, tok, head, num_prompts: int, group: int, new_tokens: int, k: int, repeats: int,
             draft_dtype, progress: Callable[[str], None], tuner: DraftLengthTuner | None = None) -> dict:
    """(g): the batch decoded plain, with the frozen warm draft at k, and adaptively, in rotating order. tuner:
    the adaptive arm's, e.g. (d)'s at T=1 (a worker's, which has seen every batch size), else a fresh one
    (a worker's first rollout: it decodes plainly until its batch is small, as the responses of one batch
    that all run to the cap seldom let it become)."""
    reqs = longtail_requests(tok, num_prompts, group, new_tokens)
    drafter = EagleDrafter(engine.model, head, draft_dtype)
    tuner_from = "fresh" if tuner is None else "the batch sweep's, T=1"
    tuner = tuner or DraftLengthTuner(k)
    arms = {"plain": (0, None), f"k{k}": (k, None), "adaptive": (k, tuner)}
    num_before_tail = max(1, int(TAIL_FRACTION * len(reqs)))  # the tail: the last 10% of the responses
    runs: dict = {name: [] for name in arms}
    for r in range(repeats):
        for name in rotated(list(arms), r):
            marks: dict = {}

            def on_step(num_finished: int, num_generated: int, marks=marks) -> None:
                if num_finished >= num_before_tail and "tail" not in marks:
                    marks["tail"] = time.perf_counter()

            kk, tn = arms[name]
            outs, dt = _run(engine, reqs, kk, drafter, tn, on_step)
            end = time.perf_counter()
            tokens = sum(len(o.token_ids) for o in outs)
            lengths = sorted(len(o.token_ids) for o in outs)
            runs[name].append({"rollout_s": dt, "tail_s": end - marks.get("tail", end), "tokens": tokens,
                               "max_len": lengths[-1], "median_len": statistics.median(lengths),
                               "steps": sum(o.num_steps for o in outs)})
            progress(f"long tail {name}: {dt:.1f} s, {tokens} tokens, tail {end - marks.get('tail', end):.1f} s")
    table = {}
    for name, rs in runs.items():
        seconds = sum(x["rollout_s"] for x in rs)
        table[name] = {"rollout_s": round(seconds / len(rs), 3),
                       "tail_s": round(sum(x["tail_s"] for x in rs) / len(rs), 3),
                       "tokens_per_s": round(sum(x["tokens"] for x in rs) / seconds, 2),
                       "mean_tokens": round(sum(x["tokens"] for x in rs) / len(rs), 1),
                       "median_response_tokens": statistics.median(x["median_len"] for x in rs),
                       "max_response_tokens": max(x["max_len"] for x in rs),
                       "mean_accepted_length": round(sum(x["tokens"] for x in rs) / max(sum(x["steps"] for x in rs), 1),
                                                     3)}
    table["adaptive"]["k_served"] = tuner.summary()
    plain = table["plain"]["rollout_s"]
    return {"table": table, "num_responses": len(reqs), "max_new_tokens": new_tokens, "k": k, "repeats": repeats,
            "tuner": tuner_from,
            "longtail_rollout_speedup": round(plain / table["adaptive"]["rollout_s"], 3),
            "longtail_rollout_speedup_fixed_k": round(plain / table[f"k{k}"]["rollout_s"], 3),
            "longtail_tail_speedup": round(table["plain"]["tail_s"] / table["adaptive"]["tail_s"], 3)
            if table["adaptive"]["tail_s"] > 0 else None}
