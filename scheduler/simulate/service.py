"""The scheduler's watcher in the simulation: scheduler/watcher.py's tick, step for step, on simulated
progress records, with the same pure policy (scheduler/policy.py) deciding.

Each tick: track the rollout windows, collect finished leases (reclaimed time by `reclaimed_by_step`),
build every worker's view from its latest progress record, `decide`, preempt, then move the round on
(`should_publish` once scored) or start one (`scoring_fits`, `choose_scorer`, `group_copies`), and offer
the grants. Commands reach a worker after the latencies of Phases. The wall time of the policy's part of
each tick (views, decide and the round functions) is kept: what the real policy costs at this scale.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from scheduler.policy import (
    CopyView,
    RolloutWindow,
    choose_scorer,
    completed_rollout_s,
    decide,
    group_copies,
    reclaimed_by_step,
    scoring_fits,
    should_publish,
    track_rollouts,
)
from workers.protocol.states import LeaseState, Phase, WorkerState

if TYPE_CHECKING:
    import simpy

    from scheduler.simulate.profiles import Profile
    from scheduler.simulate.records import DraftBook
    from scheduler.simulate.worker import SimWorker

SCORING, PUBLISHING = "scoring", "publishing"


class SimulationPort(Protocol):
    """What the watcher reads of the simulation it runs in (scheduler.simulate.model.Simulation), and the commands
    it sends its workers: the watcher knows the simulation by this alone."""

    env: simpy.Environment
    profile: Profile
    phase: tuple[Phase, int, float]  # (phase, rl_step, since), as the driver's PhaseRecord
    workers: list[SimWorker]
    book: DraftBook
    copies: dict[int, dict]  # the copies store: version -> parent, seconds, num_steps, merge_key
    scores: dict[str, dict]  # round id -> its ScoringResult

    def worker(self, worker_id: str) -> SimWorker: ...

    def start_lease(self, w: SimWorker, lease_id: str, deadline_s: float, parent: int) -> None: ...

    def stop_training(self, w: SimWorker) -> None: ...

    def start_scoring(self, w: SimWorker, round_id: str, merged: list[int]) -> None: ...

    def start_publish(self, round_id: str, seconds: float) -> None: ...


class SimWatcher:
    def __init__(self, sim: SimulationPort, snapshot_every: int = 0) -> None:
        self.sim, self.snapshot_every = sim, snapshot_every
        self.snapshots: list[dict] = []
        self.windows: list[RolloutWindow] = []
        self.leases: dict[str, dict] = {}  # worker -> the open lease (JobTLT.leases)
        self.trained: list[str] = []
        self.copies: list[int] = []
        self.scoring: dict | None = None
        self.last_scoring_s: float | None = None
        self.num_leases = self.num_rounds = self.num_published = self.num_rejected = 0
        self.reclaimed: dict[int, float] = {}  # rl_step -> worker-seconds
        self.tick_s: list[float] = []  # wall seconds of the policy's part of each tick
        self.num_ticks = 0

    def run(self):
        while True:
            self.tick()
            yield self.sim.env.timeout(self.sim.profile.phases.tick_s)

    def tick(self) -> None:
        sim, settings = self.sim, self.sim.profile.policy
        now = sim.env.now
        phase, rl_step, since = sim.phase
        self.windows = track_rollouts(self.windows, phase, rl_step, since)
        self._collect()
        if (phase != Phase.ROLLOUT and self.is_idle
                and not any(w.state == WorkerState.TRAINING for w in sim.workers)):
            return  # nothing to decide: the real tick would grant, preempt and score nothing
        views = [w.view(now) for w in sim.workers]
        scorer = self.scoring["evaluated_by"] if self.scoring and self.scoring["stage"] == SCORING else None
        leased, busy = frozenset(self.leases), frozenset({scorer} - {None})
        wall = time.perf_counter()
        decision = decide(views, now, phase, now - since, sim.book.latest, settings, leased=leased, busy=busy,
                          recent_rollout_s=completed_rollout_s(self.windows))
        fits = scoring_fits(decision.remaining_rollout_s, self.last_scoring_s, settings)
        self.tick_s.append(time.perf_counter() - wall)
        self.num_ticks += 1
        if self.snapshot_every and self.num_ticks % self.snapshot_every == 0 and phase == Phase.ROLLOUT:
            self.snapshots.append({"views": views, "now": now, "phase": phase, "since": since, "leased": leased,
                                   "busy": busy, "serving": sim.book.latest, "trained": list(self.trained),
                                   "copies": [CopyView(v, sim.copies[v]["num_steps"], sim.copies[v]["merge_key"])
                                              for v in self.copies]})
        for worker_id in decision.preempt:
            self._preempt(worker_id)
        grants = decision.grants
        if self.scoring is not None:
            self._poll()
        elif self.copies and fits:
            scorer = self._start_round(decision.classes, phase)
            grants = [g for g in grants if g.worker_id != scorer]
        for lease in grants:
            self._offer(lease.worker_id, lease.deadline_s, lease.parent_version)

    @property
    def is_idle(self) -> bool:
        """Nothing left to collect or decide (the run may end)."""
        return not self.leases and self.scoring is None

    # ----- leases ----------------------------------------------------------------------------------
    def _offer(self, worker_id: str, deadline_s: float, parent: int) -> None:
        lease_id = f"{worker_id}-{self.num_leases}"
        self.num_leases += 1
        self.leases[worker_id] = {"lease_id": lease_id, "offered_at": self.sim.env.now}
        self.sim.start_lease(self.sim.worker(worker_id), lease_id, deadline_s, parent)

    def _preempt(self, worker_id: str) -> None:
        self.sim.stop_training(self.sim.worker(worker_id))

    def _collect(self) -> None:
        for worker_id, lease in list(self.leases.items()):
            outcome = self.sim.worker(worker_id).outcomes.get(lease["lease_id"])
            if outcome is None or outcome["state"] == LeaseState.RUNNING:
                continue  # on its way, or training
            del self.leases[worker_id]
            if outcome["state"] != LeaseState.DONE:
                continue  # refused: the worker was busy
            for step, seconds in reclaimed_by_step(outcome["started_at"], outcome["ended_at"], self.windows).items():
                self.reclaimed[step] = self.reclaimed.get(step, 0.0) + seconds
            if worker_id not in self.trained:
                self.trained.append(worker_id)
            self.copies.append(outcome["version"])

    # ----- rounds (scheduler/rounds.py) ---------------------------------------------------------------
    def _start_round(self, classes, phase) -> str | None:
        sim = self.sim
        wall = time.perf_counter()
        scorer, held_out = choose_scorer(classes, phase, self.trained, leased=self.leases)
        if scorer is None:
            self.tick_s[-1] += time.perf_counter() - wall
            return None
        merged, _dropped = group_copies([CopyView(v, sim.copies[v]["num_steps"], sim.copies[v]["merge_key"])
                                         for v in self.copies])
        self.tick_s[-1] += time.perf_counter() - wall
        self.copies, self.trained = [], []
        if not merged:
            return None
        self.num_rounds += 1
        round_id = f"r{self.num_rounds}"
        self.scoring = {"stage": SCORING, "round_id": round_id, "evaluated_by": scorer, "at": sim.env.now,
                        "serving_version": sim.book.latest, "held_out": held_out}
        sim.start_scoring(sim.worker(scorer), round_id, merged)
        return scorer

    def _poll(self) -> None:
        record, sim = self.scoring, self.sim
        if record["stage"] == PUBLISHING:
            return  # sim.published() finishes the round
        result = sim.scores.pop(record["round_id"], None)
        if result is None:
            return
        self.last_scoring_s = sim.env.now - record["at"]
        wall = time.perf_counter()
        publish = should_publish(result["candidate"], result["serving"], sim.profile.policy)
        self.tick_s[-1] += time.perf_counter() - wall
        if not publish:
            self.num_rejected += 1
            self.scoring = None
            return
        record["stage"] = PUBLISHING
        sim.start_publish(record["round_id"], result["candidate_seconds"])

    def published(self, round_id: str) -> None:
        if self.scoring is not None and self.scoring["round_id"] == round_id:
            self.num_published += 1
            self.scoring = None
