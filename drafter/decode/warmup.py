"""Preparing an Engine for a job before its first batch (`warm_up`): its static caches sized for the job's rows,
and on a GPU every CUDA graph its batches will replay captured, so that no rollout pays a capture or a rebuild.
The first RL run on an H100 met its shapes as it went: a draft arm's first step took 3.8x plain's."""

from __future__ import annotations

import time
from dataclasses import replace

from drafter.decode.coupled import warm_noise
from drafter.decode.engine import Engine, EngineStats, Request
from drafter.decode.sampling import SamplingParams
from drafter.decode.static import batch_bucket
from drafter.draft.drafters import Drafter

WARM_PROMPT = 8  # tokens of a warm-up row's prompt: more than k + 1, so its first draft step feeds a backlog


class Schedule:
    """A chooser serving the draft lengths of `ks` in turn, the last one after: warm_up's."""

    def __init__(self, ks: list[int]) -> None:
        self.ks, self.step = ks, 0

    def choose(self, batch_size: int) -> int:
        self.step += 1
        return self.ks[min(self.step, len(self.ks)) - 1]

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None:
        pass

    def record_rows(self, batch_size: int, k: int, rows: list[tuple[int, int]]) -> None:
        pass

    def record_sources(self, batch_size: int, sources: dict[str, tuple[int, int, int]]) -> None:
        pass


def warm_up(engine: Engine, max_batch: int, max_len: int, ks: tuple[int, ...], params: SamplingParams,
            drafter: Drafter | None = None, *, record_hidden: bool = False,
            aux_layers: tuple[int, ...] | None = None, force: bool = False) -> dict:
    """Meet, before a job's first batch, every shape its batches will: the policy's static cache sized for
    max_batch rows of max_len slots (and the drafter's with it), and on a GPU the CUDA graphs of each batch
    bucket up to max_batch at each draft length of `ks` (0: plain), with the backlog's catch-up feed, captured
    (every slot bucket of a shape at once). A rollout then pays no capture and no rebuild: a job that met them
    as it went paid them inside its first steps. It runs short batches of `params`'s sampling (greedy or not,
    top-k/top-p: the graphs differ), with record_hidden and aux_layers as the job's generate calls pass them;
    the engine's stats are left as they were. Where nothing is captured (a CPU) it only sizes the static cache
    (with it the runner's one-off probe of its row blocks, drafter.decode.projections: 2-4 s a job's first rollout
    paid on a 2-core CPU) and compiles coupled rows' noise kernel (coupled.warm_noise), unless `force` (tests).
    Returns {"seconds", "captures", "rebuilds", "batches"}."""
    if max_batch < 1 or max_len < WARM_PROMPT + 2:
        raise ValueError(f"warm_up needs max_batch >= 1 and max_len >= {WARM_PROMPT + 2}, got {max_batch}, "
                         f"{max_len}")
    if any(k < 0 for k in ks) or (any(ks) and drafter is None):
        raise ValueError(f"warm_up: draft lengths {tuple(ks)} must be >= 0, and k > 0 needs a drafter")
    max_len = min(max_len, engine.model.cfg.max_position)
    # coupled rows' noise kernel, compiled on every device (its first call in a process takes seconds)
    noise_s = warm_noise(engine.model.device) if params.coupled and params.temperature > 0 else 0.0
    captures = engine.model.device.type == "cuda" and engine.prefer_static is not False
    start, marks = time.perf_counter(), engine.shapes_seen(drafter)
    if engine.prefer_static is not False:
        engine.static_runner(max_batch, max_len)
    if not (captures or force):
        return {"seconds": round(time.perf_counter() - start + noise_s, 3), "captures": 0,
                "rebuilds": engine.shapes_seen(drafter)[1] - marks[1], "batches": 0}
    saved = engine.stats
    engine.stats = EngineStats()
    buckets, b = [], batch_bucket(max_batch)
    while b >= 1:  # the largest first: the drafter's cache is sized by its first batch
        buckets.append(b)
        b //= 2
    V = engine.model.cfg.vocab_size
    prompt = [1 + i % (V - 1) for i in range(WARM_PROMPT)]
    num_batches = 0
    try:
        for b in buckets:
            for k in sorted(set(ks)):
                # k, then plain steps, then k again: the draft after plain steps feeds a backlog (catch-up)
                steps = [k, k, 0, 0, k, k] if k else [0, 0]
                new = sum(steps) + len(steps) + 1  # room for the whole schedule: a step emits at most k + 1 tokens
                reqs = [Request(prompt, replace(params, max_new_tokens=new, ignore_eos=True, seed=i,
                                                stop_token_ids=(), stop_strings=()))
                        for i in range(min(b, max_batch))]
                engine.generate(reqs, k=k, drafter=drafter if k else None, record_hidden=record_hidden,
                                aux_layers=aux_layers, tuner=Schedule(steps) if k else None)
                num_batches += 1
    finally:
        engine.stats = saved
    after = engine.shapes_seen(drafter)
    return {"seconds": round(time.perf_counter() - start + noise_s, 3), "captures": after[0] - marks[0],
            "rebuilds": after[1] - marks[1], "batches": num_batches}

