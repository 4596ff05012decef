"""What one timed decode run measured, so a bench explains itself: per run its seconds, decode steps, tokens and
accepted length, and what it did that a steady decode should not (graph captures and cache rebuilds inside
it: drafter.decode.static.ShapeCounts) with its blocking host reads per step; and a torch.profiler attribution
of one speculative step (top kernels by device time, and the host's share of the step)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from drafter.decode.engine import Engine, GenerationOutput, Request
from drafter.decode.warmup import warm_up


@dataclass
class RunCost:
    seconds: float
    num_steps: int  # batched decode steps (policy forwards)
    num_tokens: int
    num_seq_steps: int  # sum over steps of the rows in them
    captures: int  # graphs captured inside the run
    rebuilds: int  # caches, buffers or graph sets made anew inside the run
    host_reads: int  # blocking device-to-host reads the decode loop did
    outputs: list[GenerationOutput]

    @property
    def ms_per_step(self) -> float:
        return 1000 * self.seconds / max(self.num_steps, 1)

    @property
    def accepted_length(self) -> float:
        return self.num_tokens / max(self.num_seq_steps, 1)


def _marks(engine: Engine, drafter) -> tuple[int, int, int]:
    theirs = drafter.shape_counts() if drafter is not None else None
    c, r = engine.shapes.num_captures, engine.shapes.num_rebuilds
    if theirs is not None:
        c, r = c + theirs.num_captures, r + theirs.num_rebuilds
    return c, r, engine.shapes.num_host_reads


def warm_shapes(engine: Engine, reqs: list[Request], k: int, drafter) -> int:
    """What a rollout worker does before its first batch (drafter.decode.warmup.warm_up): every shape `reqs` may
    meet captured, at each draft length an adaptive tuner may serve (0 to k), for every batch bucket up to theirs.
    Without it an adaptive arm met new shapes inside its timed runs (on an H200, 54 captures in (d)'s, at 0.3-0.4x
    plain in those cells). Returns the captures made (0 on a CPU)."""
    max_len = max(len(r.prompt_ids) + r.params.max_new_tokens for r in reqs) + 2 * k + 2
    return warm_up(engine, len(reqs), max_len, tuple(range(k + 1)), reqs[0].params, drafter if k else None)["captures"]


def timed(engine: Engine, reqs: list[Request], k: int, drafter, tuner=None, on_step=None) -> RunCost:
    """One generate, timed to the device's completion, with the counters' differences."""
    device = engine.model.device
    before, stats = _marks(engine, drafter if k else None), engine.stats
    steps0, seq0 = stats.num_forwards, stats.num_seq_steps
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    outs = engine.generate(reqs, k=k, drafter=drafter if k else None, tuner=tuner, on_step=on_step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    after = _marks(engine, drafter if k else None)
    return RunCost(seconds, stats.num_forwards - steps0, sum(len(o.token_ids) for o in outs),
                   stats.num_seq_steps - seq0, after[0] - before[0], after[1] - before[1], after[2] - before[2], outs)


def profile_step(engine: Engine, reqs: list[Request], k: int, drafter, top: int = 12) -> dict:
    """torch.profiler over a short speculative run (its warm-up untimed first), per decode step: wall ms, device
    busy ms (CUDA kernels; on a CPU the ops' own time), the host's share (wall minus device busy: launches,
    Python, reads back), and the ops that took the most time."""
    timed(engine, reqs, k, drafter)  # every shape met before the profile
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = engine.model.device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        run = timed(engine, reqs, k, drafter)
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy_us = sum(getattr(e, attr, 0.0) for e in events if not cuda or e.device_type == torch.autograd.DeviceType.CUDA)
    steps = max(run.num_steps, 1)
    ranked = sorted(events, key=lambda e: getattr(e, attr, 0.0), reverse=True)[:top]
    return {"batch": len(reqs), "k": k, "steps": run.num_steps, "wall_ms_per_step": round(run.ms_per_step, 3),
            "device_busy_ms_per_step": round(busy_us / 1000 / steps, 3),
            "host_gap_ms_per_step": round(max(run.ms_per_step - busy_us / 1000 / steps, 0.0), 3),
            "busy_is": "CUDA kernel time" if cuda else "CPU op self time (no separate device)",
            "top": [{"name": e.key, "ms_per_step": round(getattr(e, attr, 0.0) / 1000 / steps, 4),
                     "calls_per_step": round(e.count / steps, 2)} for e in ranked]}
