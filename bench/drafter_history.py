"""`tlt bench drafter-history`: history drafts (drafter.draft.history), the EAGLE head and both combined
(drafter.draft.combined) on the long-tail task's detailed prompts, groups of `group` responses at T=1.

(h1) per arm (plain, eagle, history, combined), one batch of num_groups groups: accepted length (tokens per
     sequence-step) and tokens/s, on all rows and on tail rows (per group, the last 25% to finish: the most
     steps); the history run also records, per match length, the mean accepted drafts of a step, and the
     combined arm starts from the shortest match whose history steps accept at least what EAGLE's steps did,
     then chooses by what it measures as it serves (drafter.draft.combined.SourceChooser);
     With `tree` (widths, e.g. '4,2,2'), a "history_tree" arm drafts history trees (drafter.draft.history's
     propose_tree: each node's candidates the distinct continuations of the suffix matches, best first) while at
     most tree_max_batch rows are live. With earlier_groups, the history arms start from a store holding that many
     earlier groups of responses to the same prompts (other seeds), as a worker's store does from a prompt's
     second visit on (a dataset's next epoch);
(h2) the history drafter's own cost per step (observe + propose) at batch 64 against a plain decode step there;
(h3) greedy: history and combined outputs compared with plain decoding's, token for token.
Part of issue 41; `tlt bench drafter` runs `history_part` as its part (h), with its model and warm head.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.combined import HISTORY_MIN_MATCH, CombinedDrafter
from drafter.draft.eagle import EagleDrafter
from drafter.draft.history import HistoryDrafter, ResponseStore
from drafter.model.loading import encode_prompt, load_model
from workers.tasks import make_task

TAIL_FRACTION = 0.25  # tail rows: the last quarter of a group to finish


def log(msg: str) -> None:
    print(f"[bench drafter-history] {msg}", file=sys.stderr, flush=True)


class RecordingHistory(HistoryDrafter):
    """A HistoryDrafter that records, per match length at draft time, the drafts its steps had accepted."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.by_match: dict[int, list[int]] = defaultdict(list)
        self._drafted: list[tuple[int, int]] = []

    def drafts(self, contexts, caps):
        out = super().drafts(contexts, caps)
        self._drafted = [(self.match_lens[b], len(d)) for b, d in enumerate(out)]
        return out

    def observe(self, new_tokens, hidden=None) -> None:
        for (match, num), toks in zip(self._drafted, new_tokens):
            if num and toks:
                self.by_match[match].append(len(toks) - 1)
        self._drafted = []
        super().observe(new_tokens, hidden)


class TimedHistory(HistoryDrafter):
    """A HistoryDrafter that adds up the host seconds it spends (begin, observe, drafts, keep_rows): its own cost,
    alone or inside a CombinedDrafter (which calls these, never its propose)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seconds = 0.0

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def begin(self, prompts, prefill_hidden=None, max_len: int = 0) -> None:
        self._timed(super().begin, prompts, prefill_hidden, max_len=max_len)

    def observe(self, new_tokens, hidden=None) -> None:
        self._timed(super().observe, new_tokens, hidden)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self._timed(super().keep_rows, rows)

    def drafts(self, contexts, caps):
        return self._timed(super().drafts, contexts, caps)


def tail_rows(num_steps: list[int], group: int) -> list[int]:
    """Tail rows: of each `group` consecutive rows (one prompt's responses), the last TAIL_FRACTION to finish (the
    most steps: a batch's rows all start at its first step)."""
    tail = []
    for g in range(len(num_steps) // group):
        rows = sorted(range(g * group, (g + 1) * group), key=lambda i: num_steps[i])
        tail += rows[len(rows) - max(1, round(TAIL_FRACTION * group)):]
    return tail


def detailed_prompts(tok, num_groups: int, seed: int) -> list[list[int]]:
    """The long-tail task's detailed prompts (the ones asking for step-by-step reasoning: its tail)."""
    task, found = make_task("longtail", seed), []
    while len(found) < num_groups:
        problem = task.one()
        if not problem.stop_strings:
            found.append(encode_prompt(tok, problem.prompt))
    return found


def run_arm(engine, prompts, group, k, drafter, temperature, new_tokens, seed=0) -> dict:
    reqs = [Request(p, SamplingParams(temperature=temperature, max_new_tokens=new_tokens, seed=seed + i))
            for i, p in enumerate(p for p in prompts for _ in range(group))]
    start = time.perf_counter()
    outs = engine.generate(reqs, k=k, drafter=drafter)
    seconds = time.perf_counter() - start
    tail = tail_rows([o.num_steps for o in outs], group)

    def stats(rows) -> dict:
        tokens = sum(len(outs[i].token_ids) for i in rows)
        steps = sum(outs[i].num_steps for i in rows)
        return {"accepted_length": round(tokens / max(steps, 1), 3), "tokens_per_s": round(tokens / seconds, 2),
                "tokens": tokens}

    return {"all": stats(range(len(outs))), "tail": stats(tail), "seconds": round(seconds, 2),
            "outputs": [o.token_ids for o in outs]}


def threshold_from(by_match: dict[int, list[int]], eagle_accepted: float, max_match: int = 16) -> int:
    """The shortest match length from which history steps accept, on average, at least eagle_accepted drafts."""
    for n in range(1, max_match + 1):
        steps = [a for m, acc in by_match.items() if m >= n for a in acc]
        if len(steps) >= 20 and sum(steps) / len(steps) >= eagle_accepted:
            return n
    return max_match


def propose_cost(engine, prompts, group: int, k: int, num_steps: int, streams: list[list[int]]) -> dict:
    """(h2) one plain step at batch 64 (the median steady step) against the history drafter's observe + propose
    at batch 64, fed `streams` (responses of the T=1 runs) 3 tokens per row per step."""
    batch = [p for p in prompts for _ in range(group)]
    batch = (batch * (64 // len(batch) + 1))[:64]
    reqs = [Request(p, SamplingParams(temperature=1.0, max_new_tokens=num_steps, ignore_eos=True, seed=i))
            for i, p in enumerate(batch)]
    marks: list[float] = []
    engine.generate(reqs, k=0, on_step=lambda *_: marks.append(time.perf_counter()))
    gaps = sorted(b - a for a, b in zip(marks[1:], marks[2:]))  # steady steps: the prefill and the first left out
    plain_ms = 1e3 * gaps[len(gaps) // 2]
    drafter = HistoryDrafter()
    drafter.begin(batch)
    ctx = [list(p) for p in batch]
    rows = [streams[i % len(streams)] for i in range(64)]
    seconds, num = 0.0, 0
    for step in range(0, max(len(r) for r in rows), 3):
        new = [r[step : step + 3] for r in rows]
        start = time.perf_counter()
        drafter.observe(new, None)
        for c, t in zip(ctx, new):
            c += t
        drafter.drafts(ctx, [k if step + 3 < len(r) else 0 for r in rows])
        seconds += time.perf_counter() - start
        num += 1
    ms = 1e3 * seconds / max(num, 1)
    return {"history_propose_ms_b64": round(ms, 3), "plain_step_ms_b64": round(plain_ms, 1),
            "history_propose_fraction_b64": round(ms / plain_ms, 4), "history_cost_steps": num}


def history_part(result: dict, policy, tok, head, k: int = 4, group: int = 8, num_groups: int = 2,
                 new_tokens: int = 256, greedy_tokens: int = 64, seed: int = 0, draft_dtype: str | None = "auto",
                 cost_steps: int = 8, tree: str = "", tree_side_depth: int = 4, tree_max_batch: int = 4,
                 earlier_groups: int = 0) -> None:
    """Fill `result` with the history arms' figures (see the module)."""
    engine = Engine(policy, tok)
    prompts = detailed_prompts(tok, num_groups, seed)
    res: dict = {"k": k, "group": group, "num_groups": num_groups, "new_tokens": new_tokens,
                 "tail_fraction": TAIL_FRACTION, "earlier_groups": earlier_groups}
    store = ResponseStore()
    for g in range(earlier_groups):  # earlier steps' responses, at seeds no arm uses
        outs = run_arm(engine, prompts, group, 0, None, 1.0, new_tokens, seed=(g + 1) * 100_000)["outputs"]
        for i, out in enumerate(outs):
            store.add(prompts[i // group], out)
    eagle = EagleDrafter(policy, head, draft_dtype)
    engine.generate([Request(prompts[0], SamplingParams(max_new_tokens=8))], k=k, drafter=eagle)  # warm
    arms = {}
    names = ("plain", "eagle", "history") + (("history_tree",) if tree else ())
    if tree:
        res["history_tree"] = {"widths": tree, "side_depth": tree_side_depth, "max_batch": tree_max_batch}
    for name in names:
        drafter = {"plain": None, "eagle": eagle, "history": RecordingHistory(store),
                   "history_tree": HistoryDrafter(store, tree=tree, tree_side_depth=tree_side_depth,
                                                  tree_max_batch=tree_max_batch) if tree else None}[name]
        arms[name] = run_arm(engine, prompts, group, k if drafter else 0, drafter, 1.0, new_tokens)
        if name == "history":
            by_match = drafter.by_match
        log(f"T=1 {name}: all {arms[name]['all']}, tail {arms[name]['tail']}, {arms[name]['seconds']} s")
    eagle_accepted = arms["eagle"]["all"]["accepted_length"] - 1  # drafts accepted per EAGLE step
    threshold = threshold_from(by_match, eagle_accepted)
    res["history_accepted_by_match"] = {str(m): [len(a), round(sum(a) / len(a), 3)]
                                        for m, a in sorted(by_match.items())}
    res["combined_min_match"] = threshold
    res["combined_min_match_default"] = HISTORY_MIN_MATCH
    combined = CombinedDrafter(EagleDrafter(policy, head, draft_dtype), HistoryDrafter(store), min_match=threshold)
    arms["combined"] = run_arm(engine, prompts, group, k, combined, 1.0, new_tokens)
    rule = combined.chooser  # what the combined drafter measured as it served (drafter.draft.combined)
    res["combined_measured_head"] = [rule.head[0], round(rule.head[1] / max(rule.head[0], 1), 3)]
    res["combined_measured_history_by_match"] = {str(m): [n, round(a / n, 3)] for m, (n, a) in
                                                 enumerate(rule.history) if n}
    res["combined_history_row_steps"] = combined.num_history_rows
    res["combined_eagle_row_steps"] = combined.num_eagle_rows
    log(f"T=1 combined (min_match {threshold}): all {arms['combined']['all']}, tail {arms['combined']['tail']}")
    streams = [o for a in arms.values() for o in a.pop("outputs")]
    for name, arm in arms.items():
        res[name] = arm
        result[f"{name}_accepted_t1"] = arm["all"]["accepted_length"]
        result[f"{name}_tail_accepted_t1"] = arm["tail"]["accepted_length"]
        result[f"{name}_tokens_per_s_t1"] = arm["all"]["tokens_per_s"]
    result["history_over_eagle_tail_t1"] = round(result["history_tail_accepted_t1"]
                                                 / max(result["eagle_tail_accepted_t1"], 1e-9), 3)
    log("(h2) the history drafter's cost at batch 64")
    res.update(propose_cost(engine, prompts, group, k, cost_steps, streams))
    result["history_propose_ms_b64"] = res["history_propose_ms_b64"]
    result["history_propose_fraction_b64"] = res["history_propose_fraction_b64"]
    log(f"(h2) {res['history_propose_ms_b64']} ms per step against a plain step of {res['plain_step_ms_b64']} ms")
    log("(h3) greedy: history and combined against plain")
    plain = run_arm(engine, prompts, group, 0, None, 0.0, greedy_tokens)["outputs"]
    same = compared = 0
    for drafter in (HistoryDrafter(), CombinedDrafter(EagleDrafter(policy, head, draft_dtype), HistoryDrafter(),
                                                      min_match=threshold)):
        outs = run_arm(engine, prompts, group, k, drafter, 0.0, greedy_tokens)["outputs"]
        same += sum(a == b for a, b in zip(outs, plain))
        compared += len(plain)
    result["history_greedy_identical_fraction"] = round(same / max(compared, 1), 4)
    result["history"] = res


def add_arguments(p) -> None:
    from drafter.model.config import SMOLLM2_SPEC

    p.add_argument("--model", default=SMOLLM2_SPEC)
    p.add_argument("--draft", default=None, help="an EAGLE-3 draft checkpoint (default: bench drafter's warm head)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (two on a loaded 2-core box are slower)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="responses per prompt")
    p.add_argument("--groups", type=int, default=2, help="detailed long-tail prompts, one group each, one batch")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--greedy-tokens", type=int, default=64)
    p.add_argument("--cost-steps", type=int, default=8, help="plain steps at batch 64 (the median of all but two)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--history-tree", default="", help="widths of a history_tree arm's trees, e.g. 4,2,2 (none: '')")
    p.add_argument("--history-tree-side-depth", type=int, default=4)
    p.add_argument("--history-tree-max-batch", type=int, default=4, help="live rows up to which it drafts trees")
    p.add_argument("--earlier-groups", type=int, default=0,
                   help="earlier groups of responses per prompt in the history arms' store")


def run(args) -> dict:
    from drafter.draft.head import head_from_state
    from drafter.train.checkpoint import load_draft

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    loaded = load_model(args.model)
    result: dict = {"model": loaded.name, "threads": args.threads}
    if args.draft:
        state, meta = load_draft(args.draft, loaded.model.device)
        head = head_from_state(meta.head_config, state).to(loaded.model.dtype).eval().requires_grad_(False)
        result["draft"] = {"path": args.draft, "train_steps": meta.num_steps}
    else:
        from bench.drafter_warm import warm_drafter

        head, result["draft"] = warm_drafter(loaded, 1536, 2000, 8192)
    history_part(result, loaded.model, loaded.tokenizer, head, k=args.k, group=args.group, num_groups=args.groups,
                 new_tokens=args.new_tokens, greedy_tokens=args.greedy_tokens, seed=args.seed,
                 cost_steps=args.cost_steps, tree=args.history_tree, tree_side_depth=args.history_tree_side_depth,
                 tree_max_batch=args.history_tree_max_batch, earlier_groups=args.earlier_groups)
    return result
