"""`tlt bench gpu` (g): one rollout batch of the longtail task (workers.tasks: groups of responses per prompt, T=1,
up to 512 tokens, the short answers stopping at their line's end), decoded by each arm in turn:
    plain; EAGLE alone (the frozen warm draft) at a fixed k ("kK") and adaptively ("adaptive"); history alone
    (drafter.draft.history: the group's own text, siblings streaming in; no earlier step's responses) at k
    ("history"); both per row (drafter.draft.combined, choosing its source by what it measures) at k
    ("combined") and adaptively ("combined_adaptive", its own tuner from the prior, as a worker with
    history_drafts serves).
Each row's length is plain decoding's sample's (length_matched: at T=1 each arm samples other responses, and their
lengths, not the arms' speeds, decided the rollout times). First every shape the arms may meet is captured, as a
worker's warm-up does (gpu_cells.warm_shapes); then each arm runs once untimed on the same requests (the tuners'
forced tries, the combined drafter's first measurements), then `repeats` timed runs in rotating order. Per arm: the
rollout's time and its tail's (after TAIL_FRACTION of the responses finished) with the tail's accepted length; on all
rows and on tail rows (the last 25% of each group to finish, bench.drafter_history.tail_rows) the accepted length and
tokens/s (the rows' tokens over the rollout's seconds, and over the rows' own lifetimes); the history drafter's own
host ms per step; for the combined arms, per live-batch bucket, which source drafted how many rows and what it had
accepted (the chooser's bucket_sources). Then greedy, up to GREEDY_TOKENS: history and combined outputs against plain
decoding's.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from bench.drafter_history import TAIL_FRACTION as TAIL_ROWS_FRACTION
from bench.drafter_history import TimedHistory, tail_rows
from bench.gpu_cells import timed, warm_shapes
from bench.gpu_decode import cell_of, rotated
from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.adaptive import DraftLengthTuner, StepCostPrior
from drafter.draft.combined import CombinedDrafter
from drafter.draft.eagle import EagleDrafter
from drafter.draft.meter import FixedDraftLength
from drafter.model.loading import encode_prompt
from workers.tasks import make_task

LONGTAIL_SEED = 7  # the rollout batch's prompts: neither the warm start's seed nor its held-out one
TAIL_FRACTION = 0.9  # the tail: what runs after this share of the responses finished
MIN_TAIL_SHARE = 0.05  # a tail shorter than this share of plain's rollout is too short to time
GREEDY_TOKENS = 128  # the greedy identity check's cap: every arm's shapes, at a fraction of a rollout's time
HISTORY_ARMS = ("history", "combined", "combined_adaptive")


def longtail_requests(tok, num_prompts: int, group: int, new_tokens: int, temperature: float = 1.0
                      ) -> list[Request]:
    """One rollout batch of the longtail task: each prompt `group` times in a row (a group), with the task's stop
    strings, seeded per row."""
    problems = make_task("longtail", LONGTAIL_SEED).sample(num_prompts)
    return [Request(encode_prompt(tok, p.prompt), SamplingParams(temperature=temperature, max_new_tokens=new_tokens,
                                                                 stop_strings=p.stop_strings, seed=1000 * i + j))
            for i, p in enumerate(problems) for j in range(group)]


def length_matched(engine: Engine, reqs: list[Request]) -> list[Request]:
    """`reqs` with each row's length fixed to what plain decoding sampled for it (EOS and stop strings ignored, as
    many tokens as plain's response had). At T=1 every arm samples other responses: on an H200, plain's 64 came to
    6,736 tokens and k=4's to 4,731, so rollout times compared the sampling's luck. With the lengths matched every
    arm decodes the same length profile, and its time is its speed; plain's matched run is its natural one."""
    lengths = [max(1, len(o.token_ids)) for o in engine.generate(reqs)]
    return [Request(r.prompt_ids, dataclasses.replace(r.params, max_new_tokens=n, ignore_eos=True, stop_strings=(),
                                                      stop_token_ids=()))
            for r, n in zip(reqs, lengths)]


def _rows(runs: list[dict], rows_of: Callable[[dict], list[int]]) -> dict:
    """Accepted length and tokens/s of some rows of each run (rows_of(run)), summed over the runs."""
    tokens = sum(r["tokens"][i] for r in runs for i in rows_of(r))
    steps = sum(r["steps"][i] for r in runs for i in rows_of(r))
    lifetimes = sum(r["lifetimes"][i] for r in runs for i in rows_of(r))
    seconds = sum(r["cost"].seconds for r in runs)
    return {"accepted_length": round(tokens / max(steps, 1), 3), "tokens_per_s": round(tokens / seconds, 2),
            "row_tokens_per_s": round(tokens / lifetimes, 2) if lifetimes > 0 else None,
            "rows": sum(len(rows_of(r)) for r in runs)}


def _sources(after: dict, before: dict) -> dict:
    """bucket_sources' difference: {bucket: {source: {rows, drafted, accepted, accepted_length}}}."""
    out: dict = {}
    for name, by_source in after.items():
        for source, cell in by_source.items():
            rows, drafted, accepted = (a - b for a, b in zip(cell, before.get(name, {}).get(source, (0, 0, 0))))
            if rows:
                out.setdefault(name, {})[source] = {"rows": rows, "drafted": drafted, "accepted": accepted,
                                                    "accepted_length": round(1 + accepted / rows, 3)}
    return out


def longtail(engine: Engine, tok, head, num_prompts: int, group: int, new_tokens: int, k: int, repeats: int,
             draft_dtype, progress: Callable[[str], None], tuner: DraftLengthTuner | None = None,
             prior: StepCostPrior | None = None) -> dict:
    """(g) (see the module). tuner: EAGLE's adaptive arm's, e.g. (d)'s at T=1 (a worker's, which has seen every
    batch size), else a fresh one from `prior` (a worker's first rollout); the combined adaptive arm's tuner is
    fresh from `prior`, taught by its untimed run."""
    reqs = length_matched(engine, longtail_requests(tok, num_prompts, group, new_tokens))
    eagle = EagleDrafter(engine.model, head, draft_dtype)
    history, combined = TimedHistory(), CombinedDrafter(eagle, TimedHistory())
    tuner_from = "fresh, from the prior" if tuner is None else "the batch sweep's, T=1"
    tuner = tuner or DraftLengthTuner(k, prior=prior)
    # name -> (k, drafter, chooser, the history drafter it times); the fixed combined arm's chooser only counts
    arms = {"plain": (0, None, None, None), f"k{k}": (k, eagle, None, None), "adaptive": (k, eagle, tuner, None),
            "history": (k, history, None, history),
            "combined": (k, combined, FixedDraftLength(k), combined.history),
            "combined_adaptive": (k, combined, DraftLengthTuner(k, prior=prior), combined.history)}
    num_before_tail = max(1, int(TAIL_FRACTION * len(reqs)))  # the tail: the last 10% of the responses
    stats = engine.stats
    warm_captures = sum(warm_shapes(engine, reqs, k, d) for d in (eagle, history, combined))  # as a worker would
    for kk, drafter, chooser, _ in arms.values():
        timed(engine, reqs, kk, drafter, chooser)
    sources_before = {name: arm[2].bucket_sources() for name, arm in arms.items() if name.startswith("combined")}
    runs: dict = {name: [] for name in arms}
    for r in range(repeats):
        for name in rotated(list(arms), r):
            marks: dict = {}
            step_ends: list[float] = []

            def on_step(num_finished: int, num_generated: int, marks=marks, step_ends=step_ends) -> None:
                step_ends.append(time.perf_counter())
                if num_finished >= num_before_tail and "tail" not in marks:
                    marks["tail"] = (time.perf_counter(), stats.num_generated, stats.num_seq_steps)

            kk, drafter, chooser, timed_history = arms[name]
            history_s = timed_history.seconds if timed_history is not None else 0.0
            start = time.perf_counter()
            cost = timed(engine, reqs, kk, drafter, chooser, on_step)
            end = (time.perf_counter(), stats.num_generated, stats.num_seq_steps)
            tail = marks.get("tail", end)
            steps = [o.num_steps for o in cost.outputs]  # a row finished at the end of its num_steps-th step
            runs[name].append({"cost": cost, "tail_s": end[0] - tail[0], "tail_tokens": end[1] - tail[1],
                               "tail_seq_steps": end[2] - tail[2], "steps": steps,
                               "tokens": [len(o.token_ids) for o in cost.outputs],
                               "lifetimes": [step_ends[n - 1] - start if n else 0.0 for n in steps],
                               "tail_rows": tail_rows(steps, group),
                               "history_s": timed_history.seconds - history_s if timed_history is not None else 0.0})
            progress(f"long tail {name}: {cost.seconds:.1f} s, {cost.num_tokens} tokens, tail {end[0] - tail[0]:.1f} s")
    table = {name: _arm_cell(name, rs) for name, rs in runs.items()}
    table["adaptive"]["k_served"] = tuner.summary()
    table["combined_adaptive"]["k_served"] = arms["combined_adaptive"][2].summary()
    for name, before in sources_before.items():
        table[name]["sources"] = _sources(arms[name][2].bucket_sources(), before)
    for name in HISTORY_ARMS:
        table[name]["history_step_fraction"] = round(table[name]["history_ms_per_step"]
                                                     / table["plain"]["ms_per_step"], 4)
    plain = table["plain"]["rollout_s"]

    def tail_speedup(name: str) -> float | None:
        # None where there is no tail to speak of (plain's under MIN_TAIL_SHARE of its rollout: the responses ran
        # to the cap together, as in the CPU form's short rollouts)
        return (round(table["plain"]["tail_s"] / table[name]["tail_s"], 3)
                if table[name]["tail_s"] > 0 and table["plain"]["tail_s"] >= MIN_TAIL_SHARE * plain else None)

    greedy = greedy_identity(engine, tok, num_prompts, group, min(new_tokens, GREEDY_TOKENS), k, history, combined)
    return {"table": table, "num_responses": len(reqs), "group": group, "max_new_tokens": new_tokens, "k": k,
            "lengths": "matched to plain's sample", "num_tokens": sum(r.params.max_new_tokens for r in reqs),
            "repeats": repeats, "tuner": tuner_from, "tail_rows_fraction": TAIL_ROWS_FRACTION, "greedy": greedy,
            "longtail_rollout_speedup": round(plain / table["adaptive"]["rollout_s"], 3),
            "longtail_rollout_speedup_fixed_k": round(plain / table[f"k{k}"]["rollout_s"], 3),
            "longtail_tail_speedup": tail_speedup("adaptive"),
            "longtail_tail_accepted_length": table["adaptive"]["tail_accepted_length"],
            # issue 41: the combined drafter served adaptively, against plain
            "longtail_rollout_speedup_history": round(plain / table["combined_adaptive"]["rollout_s"], 3),
            "longtail_tail_speedup_history": tail_speedup("combined_adaptive"),
            "longtail_rollout_speedup_history_only": round(plain / table["history"]["rollout_s"], 3),
            "longtail_rollout_speedup_combined_fixed_k": round(plain / table["combined"]["rollout_s"], 3),
            "longtail_tail_rows_accepted_history": table["combined_adaptive"]["rows"]["tail"]["accepted_length"],
            "longtail_history_step_fraction": table["combined_adaptive"]["history_step_fraction"],
            "longtail_greedy_identical_fraction_history": greedy["identical_fraction"],
            "graph_captures_warm_up": warm_captures,
            "graph_captures_timed": sum(c["graph_captures_timed"] for c in table.values()),
            "cache_rebuilds_timed": sum(c["cache_rebuilds_timed"] for c in table.values())}


def _arm_cell(name: str, rs: list[dict]) -> dict:
    cell = cell_of({name: [x["cost"] for x in rs]}, name)
    tail_steps = sum(x["tail_seq_steps"] for x in rs)
    return {**cell, "rollout_s": round(sum(x["cost"].seconds for x in rs) / len(rs), 3),
            "tail_s": round(sum(x["tail_s"] for x in rs) / len(rs), 3),
            "tail_accepted_length": round(sum(x["tail_tokens"] for x in rs) / tail_steps, 3)
            if tail_steps else None,  # None: the tail ran no step
            "rows": {"all": _rows(rs, lambda x: range(len(x["steps"]))), "tail": _rows(rs, lambda x: x["tail_rows"])},
            "history_ms_per_step": round(1000 * sum(x["history_s"] for x in rs)
                                         / max(sum(x["cost"].num_steps for x in rs), 1), 3),
            "mean_tokens": round(sum(x["cost"].num_tokens for x in rs) / len(rs), 1),
            "median_response_tokens": statistics.median(statistics.median(x["tokens"]) for x in rs),
            "max_response_tokens": max(max(x["tokens"]) for x in rs)}


def greedy_identity(engine: Engine, tok, num_prompts: int, group: int, new_tokens: int, k: int, history,
                    combined: CombinedDrafter) -> dict:
    """The rollout's requests greedy, up to new_tokens: history and combined outputs against plain's, row by row."""
    reqs = longtail_requests(tok, num_prompts, group, new_tokens, temperature=0.0)
    want = [o.token_ids for o in engine.generate(reqs)]
    same = compared = 0
    for drafter in (history, combined):
        outs = engine.generate(reqs, k=k, drafter=drafter)
        same += sum(o.token_ids == w for o, w in zip(outs, want))
        compared += len(want)
    return {"new_tokens": new_tokens, "compared": compared, "identical": same,
            "identical_fraction": round(same / max(compared, 1), 4)}
