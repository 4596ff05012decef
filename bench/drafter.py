"""`tlt bench drafter`: acceptance and speed-up of trained drafters, drift, training throughput, stops.

(a) untrained head, warm-started head and n-gram drafter at k in {2,3,4,6}, batch 1, greedy and
    temperature 1.0, against plain decoding in the same run;
(b) drift: the policy is fine-tuned a few steps on another prompt distribution, then the frozen
    drafter is compared with a copy adapted for a fixed budget of training seconds;
(c) training throughput and stop-request-to-stopped latency;
(h) history drafts, the warm head and both per row on the long-tail task in groups at T=1
    (bench.drafter_history.history_part, the figures of `tlt bench drafter-history`).
The warm-started drafter is cached under $TLT_CACHE_DIR/drafters/ (keyed by model and settings).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import statistics
import sys
import threading
import time

import torch

from bench.drafter_history import history_part
from bench.drafter_warm import warm_drafter
from bench.drift import drift_part
from bench.drift import eval_prompts as drift_eval_prompts
from bench.prompts import PROMPTS, synthetic_prompts
from bench.record import pct
from drafter.decode.engine import Engine
from drafter.draft.drafters import NgramDrafter
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import new_head
from drafter.model.config import TrainConfig
from drafter.model.loading import encode_prompt, load_model
from drafter.train.buffer import RolloutBuffer
from drafter.train.trainer import DraftTrainer
from drafter.train.warmstart import HarvestConfig, by_position, calibrate_on_prompts, harvest, measure


def log(msg: str) -> None:
    print(f"[bench drafter] {msg}", file=sys.stderr, flush=True)


def calibrate(engine, tok, head, k: int = 4, num_prompts: int = 32, num_positions: int = 6) -> dict:
    """Pick the head's draft temperature on fresh rollouts sampled at temperature 1, of templated
    prompts drawn with a seed of their own (the warm start's are seed 1, the adaptation's seed 9), and measure
    on them, greedy and at T=1, the chance that each draft position 1..num_positions is accepted given the ones
    before it were (drafter.train.evaluate.acceptance_by_position): where accepted runs end."""
    prompts = [encode_prompt(tok, t) for t in synthetic_prompts(num_prompts, seed=11)]
    held_out = RolloutBuffer(max_bytes=1 << 30)
    tau, scores = calibrate_on_prompts(engine, head, prompts, k, max_new_tokens=96, held_out=held_out)
    log(f"draft temperature {tau}: expected tokens per step at T=1, k={k}: "
        + ", ".join(f"{t}: {v:.2f}" for t, v in scores.items()))
    positions = by_position(head, engine.model, held_out, num_positions)
    log(f"acceptance by position (given the ones before): {positions}")
    return {"draft_temperature": tau, "draft_temperature_scores": {str(t): round(v, 3) for t, v in scores.items()},
            "acceptance_by_position_greedy": positions["greedy"], "acceptance_by_position_t1": positions["t1"]}


def sweep(engine, prompts, ks, drafters: dict, new_tokens: int, sampled_only: tuple[str, ...] = (),
          only_ks: dict[str, tuple[int, ...]] | None = None) -> dict:
    """Per temperature and k: plain decoding and each drafter, interleaved prompt by prompt (plain,
    then the drafters in an order that rotates per prompt), so every configuration runs in the same
    windows of time: on a shared machine whose speed drifts by 10-20% over minutes, a plain run
    measured once before the drafters made single speed-ups off by as much. Every configuration first
    generates a few tokens untimed, so no one pays for a first call. Greedy speculative outputs are
    compared with plain decoding's, token for token (the lossless promise). only_ks: drafters measured
    at those k only (side-by-side controls)."""
    only_ks = only_ks or {}
    out: dict = {"greedy_identical": 0, "greedy_compared": 0}
    for temp in (0.0, 1.0):
        res: dict = {}
        plains = []
        for k in ks:
            names = [n for n in drafters if not (temp == 0.0 and n in sampled_only) and k in only_ks.get(n, ks)]
            configs = [("plain", 0, None)] + [(n, k, drafters[n]) for n in names]
            for _, kk, d in configs:
                measure(engine, prompts[:1], kk, d, temp, 8)
            runs: dict = {name: [] for name, _, _ in configs}
            for i, p in enumerate(prompts):
                rot = i % max(len(names), 1)
                for name, kk, d in configs[:1] + configs[1:][rot:] + configs[1:][:rot]:
                    runs[name].append(measure(engine, [p], kk, d, temp, new_tokens, seed=i))
            tokens = {n: sum(len(a.token_ids[0]) for a in r) for n, r in runs.items()}
            seconds = {n: sum(a.seconds for a in r) for n, r in runs.items()}
            plain_tps = tokens["plain"] / seconds["plain"]
            plains.append(plain_tps)
            res[f"plain_k{k}_tokens_per_s"] = round(plain_tps, 2)
            for name in names:
                steps = sum(len(a.token_ids[0]) / a.mean_accepted_length for a in runs[name])
                acc, tps = tokens[name] / steps, tokens[name] / seconds[name]
                if temp == 0.0:
                    out["greedy_compared"] += len(prompts)
                    same = (a.token_ids == b.token_ids for a, b in zip(runs[name], runs["plain"]))
                    out["greedy_identical"] += sum(same)
                res[f"{name}_k{k}"] = {"mean_accepted_length": round(acc, 3), "tokens_per_s": round(tps, 2),
                                       "speedup": round(tps / plain_tps, 3)}
                log(f"T={temp} {name} k={k}: accepted length {acc:.2f}, {tps / plain_tps:.2f}x plain "
                    f"({plain_tps:.1f} tok/s)")
        res["plain_tokens_per_s"] = round(statistics.mean(plains), 2)
        out["greedy" if temp == 0 else "temp1"] = res
    return out


def stop_latencies(policy, head, buffer, trials: int) -> list[float]:
    """Seconds from request_stop() to train() returning, with the stop at a random moment."""
    head = copy.deepcopy(head)
    trainer = DraftTrainer(policy, head, TrainConfig(anneal_to_budget=False, bf16_autocast=False))
    rng = random.Random(0)
    latencies = []
    for _ in range(trials):
        trainer.stop_event.clear()
        thread = threading.Thread(target=trainer.train, args=(buffer,), kwargs={"max_seconds": 60})
        thread.start()
        time.sleep(rng.uniform(0.3, 1.5))
        t0 = time.perf_counter()
        trainer.request_stop()
        thread.join()
        latencies.append(time.perf_counter() - t0)
    return latencies


def bench_drafter(model_spec: str = "smollm2-135m", threads: int = 2, num_eval_prompts: int = 6,
                  new_tokens: int = 96, ks: tuple[int, ...] = (2, 3, 4, 6), warm_prompts: int = 1536,
                  warm_steps: int = 2000, warm_unroll: int = 4, draft_vocab: int = 8192, drift_steps: int = 40,
                  drift_lr: float = 1e-4,
                  adapt_seconds: float = 30.0, adapt_lr: float = 3e-4, adapt_prompts: int = 256,
                  stop_trials: int = 20, parts: str = "abch", num_drift_eval_prompts: int = 32,
                  draft_dtype: str | None = "auto", tree: str = "", tree_side_depth: int = 1,
                  device: str = "cpu", history_groups: int = 2, history_new_tokens: int = 256) -> dict:
    """parts: any of "a" (sweep), "b" (drift), "c" (throughput, stops), "h" (history drafts: history_groups
    groups of 8 responses, up to history_new_tokens each, k=4). Without (a), the drift is
    measured at k=4; without (b), (c) trains the warm-started head on 64 fresh rollouts. draft_dtype:
    the precision the heads draft in (drafter.draft.eagle.serving_dtype), as the rollout workers serve them;
    tree, tree_side_depth: the warm head's draft tree in (a) (drafter.decode.tree; "" for a chain), with a
    chain of the same head beside it. The drift (b) is measured with chains: it is about the head.
    device: where the policy runs (every head and batch follows it)."""
    if not parts or set(parts) - set("abch"):
        raise ValueError(f"parts must be made of a, b, c and h, got {parts!r}")
    if "h" in parts and (history_groups < 1 or history_new_tokens < 2):
        raise ValueError(f"history_groups must be >= 1 and history_new_tokens >= 2, got {history_groups}, "
                         f"{history_new_tokens}")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    loaded = load_model(model_spec, device=device)
    policy, tok = loaded.model, loaded.tokenizer
    engine = Engine(policy, tok)
    eval_prompts = [encode_prompt(tok, t) for t in PROMPTS[:num_eval_prompts]]  # held out: not templated
    head, warm_info = warm_drafter(loaded, warm_prompts, warm_steps, draft_vocab, warm_unroll)
    result: dict = {"model": loaded.name, "threads": threads, "new_tokens": new_tokens, "ks": list(ks),
                    "num_eval_prompts": len(eval_prompts), "warm_start": warm_info}
    result["parts"] = parts
    if "a" in parts:
        result.update(calibrate(engine, tok, head))
    best_k = (_sweep_part(result, engine, eval_prompts, ks, policy, head, new_tokens, draft_dtype, tree,
                          tree_side_depth)
              if "a" in parts else 4)
    if "h" in parts:  # before (b), which fine-tunes a copy of the policy: the warm head's own policy here
        log("(h) history drafts, the head and both, long-tail groups at T=1")
        history_part(result, policy, tok, head, k=4, num_groups=history_groups, new_tokens=history_new_tokens,
                     draft_dtype=draft_dtype)
    train_policy, train_head, buffer = policy, head, None
    if "b" in parts:
        # the loss is a difference of two accepted lengths: measured on many held-out prompts, not (a)'s 6
        train_policy, train_head, buffer = drift_part(result, policy, tok, engine,
                                                      drift_eval_prompts(tok, num_drift_eval_prompts), head, best_k,
                                                      new_tokens, drift_steps, drift_lr, adapt_prompts, adapt_lr,
                                                      adapt_seconds, draft_dtype)
    if "c" in parts:
        log("(c) training throughput and stop latency")
        if buffer is None:
            buffer = RolloutBuffer(max_bytes=1 << 30)
            harvest(engine, [encode_prompt(tok, t) for t in synthetic_prompts(64, seed=9)], buffer, 0,
                    HarvestConfig(max_new_tokens=96))
        offline = TrainConfig(anneal_to_budget=False, bf16_autocast=False)
        rep = DraftTrainer(train_policy, copy.deepcopy(train_head), offline).train(buffer, max_seconds=30)
        latencies = sorted(stop_latencies(train_policy, train_head, buffer, stop_trials))
        result.update(train_tokens_per_s=round(rep.tokens_per_s, 1),
                      train_steps_per_s=round(rep.num_steps / max(rep.seconds, 1e-9), 3),
                      stop_p50_s=round(statistics.median(latencies), 3),
                      stop_p99_s=round(pct(latencies, 0.99), 3),
                      stop_trials=len(latencies))
    return result


def _sweep_part(result, engine, eval_prompts, ks, policy, head, new_tokens, draft_dtype, tree,
                tree_side_depth) -> int:
    log("(a) acceptance and speed-up, batch 1")
    served = {"tree": tree, "tree_side_depth": tree_side_depth}  # as the rollout workers serve heads

    def eagle(h, dtype=draft_dtype, **kw):
        return EagleDrafter(policy, h, dtype, **(served | kw))

    drafters = {"warm": eagle(head), "untrained": eagle(new_head(policy, None, None), tree=None),
                "ngram": NgramDrafter()}
    result["draft_dtype"] = drafters["warm"].precision
    result["draft_tree"] = ",".join(map(str, drafters["warm"].trees.widths))
    result["draft_tree_side_depth"] = tree_side_depth
    sampled_only: tuple[str, ...] = ()
    only_ks: dict[str, tuple[int, ...]] = {}
    if head.cfg.draft_temperature != 1.0:  # side by side: what the calibration bought at T=1
        own = copy.copy(head)  # shares the weights
        own.cfg = dataclasses.replace(head.cfg, draft_temperature=1.0)
        drafters["warm_draft_t1"], sampled_only = eagle(own), ("warm_draft_t1",)
    if drafters["warm"].tree_for(max(ks)) is not None:  # side by side: what the tree bought over a chain
        drafters["warm_chain"] = eagle(head, tree=None)
        only_ks["warm_chain"] = tuple(k for k in ks if k in (3, 4))
    else:  # side by side: what a draft tree would buy (three candidates, then two, side chains of 2)
        drafters["warm_tree"] = eagle(head, tree="3,2", tree_side_depth=2)
        only_ks["warm_tree"] = tuple(k for k in ks if k == 4)
    if drafters["warm"].int8 or drafters["warm"].dtype != policy.dtype:  # side by side: what bf16 or int8 bought
        drafters["warm_policy_dtype"] = eagle(head, None)
        only_ks["warm_policy_dtype"] = tuple(k for k in ks if k in (2, 3, 4))
    result["sweep"] = sweep(engine, eval_prompts, ks, drafters, new_tokens, sampled_only, only_ks)
    greedy, temp1 = result["sweep"]["greedy"], result["sweep"]["temp1"]
    best_k = max(ks, key=lambda k: greedy[f"warm_k{k}"]["speedup"])
    best_k_sampled = max(ks, key=lambda k: temp1[f"warm_k{k}"]["speedup"])  # sampling accepts less: its own k
    result.update(best_k=best_k, best_mean_accepted_length=max(greedy[f"warm_k{k}"]["mean_accepted_length"]
                                                               for k in ks),
                  speedup_greedy=greedy[f"warm_k{best_k}"]["speedup"],
                  best_k_sampled=best_k_sampled, speedup_sampled=temp1[f"warm_k{best_k_sampled}"]["speedup"],
                  greedy_identical_fraction=round(result["sweep"]["greedy_identical"]
                                                  / max(result["sweep"]["greedy_compared"], 1), 4))
    return best_k


def add_arguments(p) -> None:
    from drafter.model.config import SMOLLM2_SPEC

    p.add_argument("--model", default=SMOLLM2_SPEC)
    p.add_argument("--prompts", type=int, default=6, help="held-out evaluation prompts (of the 16 fixed ones)")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--k", default="2,3,4,6")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warm-prompts", type=int, default=1536)
    p.add_argument("--warm-steps", type=int, default=2000)
    p.add_argument("--warm-unroll", type=int, default=4, help="draft positions the warm start trains")
    p.add_argument("--parts", default="abch", help="a: acceptance sweep, b: drift, c: training throughput and "
                   "stops, h: history drafts (issue 41)")
    p.add_argument("--history-groups", type=int, default=2, help="(h): detailed long-tail prompts, 8 responses each")
    p.add_argument("--history-new-tokens", type=int, default=256, help="(h): tokens per response at most")
    p.add_argument("--adapt-seconds", type=float, default=30.0,
                   help="online training budget after the drift (30 s: a long-tail idle window)")
    p.add_argument("--drift-prompts", type=int, default=32,
                   help="held-out prompts the drift is measured on, greedy and at T=1")
    p.add_argument("--adapt-lr", type=float, default=3e-4, help="peak learning rate of the online adaptation")
    p.add_argument("--adapt-prompts", type=int, default=256, help="new-policy rollouts the adaptation trains on")
    p.add_argument("--stop-trials", type=int, default=20)
    p.add_argument("--draft-dtype", default="auto", choices=("auto", "policy", "float32", "bfloat16", "int8"),
                   help="precision the heads draft in; auto: bf16 where the device has bf16 units; int8: "
                        "int8 weights on a CPU")
    p.add_argument("--tree", default="",
                   help="draft tree served: candidates at the first depths, e.g. 3,2 ('': a chain)")
    p.add_argument("--tree-side-depth", type=int, default=1, help="depth of the chain under each extra candidate")


def run(args) -> dict:
    ks = tuple(int(k) for k in args.k.split(",") if k.strip())
    return bench_drafter(model_spec=args.model, threads=args.threads, num_eval_prompts=args.prompts,
                         new_tokens=args.new_tokens, ks=ks, warm_prompts=args.warm_prompts,
                         warm_steps=args.warm_steps, warm_unroll=args.warm_unroll, adapt_seconds=args.adapt_seconds,
                         adapt_lr=args.adapt_lr, adapt_prompts=args.adapt_prompts, stop_trials=args.stop_trials,
                         num_drift_eval_prompts=args.drift_prompts,
                         parts=args.parts, draft_dtype=None if args.draft_dtype == "policy" else args.draft_dtype,
                         tree=args.tree, tree_side_depth=args.tree_side_depth, history_groups=args.history_groups,
                         history_new_tokens=args.history_new_tokens)
