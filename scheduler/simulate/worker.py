"""A simulated rollout worker: its share of a rollout as a timeline, its progress record, its leases.

Every live row of a worker's batch gains the same expected tokens per step (accepted_length(k, a)), so
between two finishes (or two chunks of `CHUNK_TOKENS`, as the context grows) the live batch, the context and
the step's cost are constant, and the whole share's timeline is a few numpy operations. A new draft (a
hot swap changes a) or a change of speed (a neighbour training on a shared CPU bus) re-times the rest from
the moment it happens. The worker's progress record is what the real ProgressReporter writes: the state,
requests finished of its total, and a timestamp on the reporting grid (at most 10 writes/s), or the
moment of its last state change.
"""

from __future__ import annotations

import bisect
import math

import numpy as np
import simpy

from scheduler.policy import WorkerView
from scheduler.simulate.cost import StepCost, accepted_length, choose_k
from workers.engines import Speculation
from workers.protocol.states import WorkerState

CHUNK_TOKENS = 512  # re-evaluate the context-dependent step cost at least this often (tokens per row)


class Timeline:
    """One worker's share: rows of `lengths` tokens, all admitted at the start (one engine batch)."""

    def __init__(self, lengths: list[int], prompt_tokens: float, cost: StepCost, k_max: int,
                 speculation: Speculation) -> None:
        self.lengths = np.sort(np.asarray(lengths, dtype=float))
        self.prompt_tokens, self.cost, self.k_max, self.speculation = prompt_tokens, cost, k_max, speculation
        self.finish = np.zeros(len(self.lengths))
        self.finish_list: list[float] = []  # the same, for bisect (a progress record per worker per tick)
        self.num_tokens = float(self.lengths.sum())
        self.row_steps = 0.0  # sum over rows of the verify steps they took: tokens / row_steps = accepted length
        self.forwards = 0.0  # decode steps of the whole batch
        self.seg_g = np.zeros(1)
        self.seg_t = np.zeros(1)
        self._seg: tuple = ()

    def prefill_s(self) -> float:
        return self.cost.prefill_seconds(len(self.lengths), self.prompt_tokens)

    def build(self, t0: float, g0: float, rate: float, slowdown: float = 1.0) -> None:
        """The timeline from (time t0, g0 tokens generated per live row) on, at acceptance `rate`."""
        lengths = self.lengths
        top = lengths[-1] if len(lengths) else 0.0
        live = lengths[lengths > g0]
        if not len(live):
            self.seg_g, self.seg_t, self._seg = np.array([g0]), np.array([t0]), ()
            self.finish_list = self.finish.tolist()
            return
        grid = np.arange(g0 + CHUNK_TOKENS, top, CHUNK_TOKENS)
        bps = np.unique(np.concatenate(([g0], live, grid)))
        lo, hi = bps[:-1], bps[1:]
        rows = (len(lengths) - np.searchsorted(lengths, lo, side="right")).astype(float)
        ctx = self.prompt_tokens + (lo + hi) / 2
        ks = choose_k(self.cost, rows, ctx, rate, self.k_max, self.speculation)
        step_s = np.empty_like(lo)
        per_step = np.empty_like(lo)
        for k in np.unique(ks):
            mask = ks == k
            step_s[mask] = self.cost.seconds(rows[mask], int(k), ctx[mask])
            per_step[mask] = accepted_length(int(k), rate)
        steps = (hi - lo) / per_step
        dt = steps * step_s * slowdown
        self.seg_g = bps
        self.seg_t = t0 + np.concatenate(([0.0], np.cumsum(dt)))
        self._seg = (lo, hi, rows, steps)
        is_live = lengths > g0
        self.finish[is_live] = np.interp(lengths[is_live], self.seg_g, self.seg_t)
        self.finish_list = self.finish.tolist()

    def _commit(self, g: float) -> None:
        """Count the row-steps and forwards of the current timeline up to g tokens per row."""
        if not self._seg:
            return
        lo, hi, rows, steps = self._seg
        part = np.clip((g - lo) / (hi - lo), 0.0, 1.0)
        self.row_steps += float((rows * steps * part).sum())
        self.forwards += float((steps * part).sum())

    def retime(self, when: float, rate: float, slowdown: float = 1.0) -> None:
        """From `when` on, decode at a new acceptance rate or speed."""
        g = self.progress_at(when)
        self._commit(g)
        self.build(when, g, rate, slowdown)

    def close(self) -> None:
        self._commit(math.inf)
        self._seg = ()

    def progress_at(self, when: float) -> float:
        return float(np.interp(when, self.seg_t, self.seg_g))

    @property
    def end(self) -> float:
        return float(self.seg_t[-1])

    def num_finished(self, when: float) -> int:
        return bisect.bisect_right(self.finish_list, when)


class SimWorker:
    """A rollout worker's state, as its progress record and the scheduler's commands see it."""

    def __init__(self, env: simpy.Environment, index: int, report_interval_s: float) -> None:
        self.env, self.index, self.worker_id = env, index, f"w{index}"
        self.report_interval_s = report_interval_s
        self.state = WorkerState.IDLE
        self.changed_at = 0.0
        self.timeline: Timeline | None = None
        self.num_total = 0
        self.buffer_tokens = 0
        self.served_version = 0
        self.rate = 0.0
        self.process: simpy.Process | None = None  # the generation under way
        self.is_decoding = False  # its timeline runs (a new draft or speed re-times it)
        self.lease: dict | None = None  # the lease it trains under: lease_id, stop, released
        self.outcomes: dict[str, dict] = {}  # lease id -> its outcome (LeaseOutcome's fields that matter)
        self.is_scoring = False

    def set_state(self, state: WorkerState) -> None:
        if state != self.state:
            self.state, self.changed_at = state, self.env.now

    @property
    def is_generating(self) -> bool:
        return self.process is not None

    def view(self, now: float) -> WorkerView:
        """The latest progress record at `now`: written on the reporting grid, or at the last state change."""
        stamp = max(self.changed_at, math.floor(now / self.report_interval_s) * self.report_interval_s)
        finished = self.timeline.num_finished(stamp) if self.is_decoding else self.num_total
        return WorkerView(self.worker_id, self.state, finished, self.num_total, stamp, self.buffer_tokens)
