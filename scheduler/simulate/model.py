"""One simulated RL job: the driver's steps (sync, rollout, learner) on N rollout workers, in simpy.

Arms, as `tlt bench rl` runs them: "plain" (speculation off, no watcher), "frozen" (speculative decoding
from the warm draft, no leases) and "tlt" (the warm draft, and the watcher of scheduler/simulate/service.py
granting drafter-training leases on idle workers, scoring rounds and publishing drafts). Workers generate
their share of each step (prompt groups assigned round-robin, as workers/driver.py does); the learner waits
until every trainer and scorer has released its GPU. Drafts: `DraftBook` keeps each version's training
seconds; the acceptance rate follows from them and from the policy updates since (Acceptance).
"""

from __future__ import annotations

import random

import numpy as np
import simpy

from scheduler.simulate.cost import accepted_length
from scheduler.simulate.profiles import Profile
from scheduler.simulate.records import DraftBook, SimResult, StepStats
from scheduler.simulate.service import SimWatcher
from scheduler.simulate.worker import SimWorker, Timeline
from workers.engines import Speculation
from workers.protocol.states import LeaseState, Phase, WorkerState

ARMS = ("plain", "frozen", "tlt")
BUFFER_MAX_TOKENS = 1 << 22  # the rollout buffer is bounded (drafter/train/buffer.py); only the min matters here


class Simulation:
    def __init__(self, profile: Profile, num_workers: int, arm: str, seed: int = 0, num_steps: int = 3,
                 snapshot_every: int = 0) -> None:
        if arm not in ARMS:
            raise ValueError(f"arm must be one of {', '.join(ARMS)}, got {arm!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"num_steps must be an int >= 1, got {num_steps!r}")
        self.profile, self.arm, self.num_steps = profile, arm, num_steps
        self.env = simpy.Environment()
        self.rng = random.Random(seed)
        self.workers = [SimWorker(self.env, i, profile.phases.report_interval_s) for i in range(num_workers)]
        self._by_id = {w.worker_id: w for w in self.workers}
        for w in self.workers:
            w.served_version = 1 if arm != "plain" else 0
        self.book = DraftBook(profile)
        self.policy_version = 0
        self.phase = (Phase.SYNC, 0, 0.0)
        self.copies: dict[int, dict] = {}  # copies store: version -> parent, seconds, num_steps, merge_key
        self.scores: dict[str, dict] = {}  # round id -> its ScoringResult
        self.watcher = SimWatcher(self, snapshot_every) if arm == "tlt" else None
        self.speculation = Speculation.OFF if arm == "plain" else profile.workload.speculation
        self.result = SimResult(arm, num_workers, [])

    def worker(self, worker_id: str) -> SimWorker:
        return self._by_id[worker_id]

    def run(self) -> SimResult:
        done = self.env.process(self.driver())
        if self.watcher is not None:
            self.env.process(self.watcher.run())
        self.env.run(until=done)
        if self.watcher is not None:  # collect the last leases (their reclaimed time)
            while not self.watcher.is_idle and self.env.now < done.value + 120:
                self.env.run(until=self.env.now + self.profile.phases.tick_s)
            for s in self.result.steps:
                s.reclaimed_worker_s = self.watcher.reclaimed.get(s.rl_step, 0.0)
            w = self.watcher
            self.result.num_leases, self.result.num_rounds, self.result.num_published = (
                w.num_leases, w.num_rounds, w.num_published)
            self.result.tick_s, self.result.snapshots = w.tick_s, w.snapshots
        return self.result

    def set_phase(self, phase: Phase, rl_step: int) -> None:
        self.phase = (phase, rl_step, self.env.now)

    # ----- the driver ---------------------------------------------------------------------------------
    def driver(self):
        p, env = self.profile, self.env
        for rl_step in range(self.num_steps):
            step_start = env.now
            self.set_phase(Phase.SYNC, rl_step)
            yield env.timeout(p.phases.sync_s)
            self.set_phase(Phase.ROLLOUT, rl_step)
            start = env.now
            wl = p.workload
            groups = wl.lengths.sample_groups(self.rng, wl.prompts_per_worker * len(self.workers), wl.group_size)
            shares: list[list[int]] = [[] for _ in self.workers]
            for g, lengths in enumerate(groups):
                shares[g % len(self.workers)].extend(lengths)
            procs = []
            for w, share in zip(self.workers, shares):
                w.process = env.process(self.generate(w, share))
                procs.append(w.process)
            rate_start = self.served_rate()
            yield simpy.AllOf(env, procs)
            rollout_end = env.now
            self.set_phase(Phase.UPDATE, rl_step)
            while any(w.lease is not None or w.is_scoring for w in self.workers):  # the learner needs every GPU
                yield env.timeout(0.01)
            learner_wait = env.now - rollout_end
            yield env.timeout(p.phases.learner_at(rl_step))
            timelines = [w.timeline for w in self.workers]
            finish = np.sort(np.concatenate([t.finish for t in timelines]))
            row_steps = sum(t.row_steps for t in timelines)
            tokens = sum(t.num_tokens for t in timelines)
            rollout_s = rollout_end - start
            t90 = finish[int(0.9 * (len(finish) - 1))] - start
            self.result.steps.append(StepStats(
                rl_step, rollout_s, env.now - step_start, learner_wait, [proc.value for proc in procs], tokens,
                tokens / row_steps if row_steps else 1.0, (rollout_s - t90) / rollout_s if rollout_s else 0.0,
                rate_start, self.served_rate()))
            self.policy_version += 1
        self.set_phase(Phase.DONE, self.num_steps - 1)
        return env.now

    def served_rate(self) -> float:
        """The workers' mean acceptance rate of the drafts they serve (0 without speculation)."""
        if self.speculation == Speculation.OFF:
            return 0.0
        return float(np.mean([self.book.rate(w.served_version, self.policy_version) for w in self.workers]))

    def generate(self, w: SimWorker, lengths: list[int]):
        env, p = self.env, self.profile
        start = env.now  # the rollout's start: the driver times a worker from it
        if w.lease is not None:  # a worker given rollouts stops its trainer first: generation wins the GPU back
            self.stop_training(w)
            yield w.lease["released"]
        w.num_total = len(lengths)
        w.timeline = tl = Timeline(lengths, p.workload.prompt_tokens, p.cost, p.workload.draft_k, self.speculation)
        w.rate = 0.0 if self.speculation == Speculation.OFF else self.book.rate(w.served_version, self.policy_version)
        w.set_state(WorkerState.ROLLING_OUT)
        t0 = env.now + tl.prefill_s() * self.slowdown()
        tl.build(t0, 0.0, w.rate, self.slowdown())
        w.is_decoding = True
        while True:
            try:
                yield env.timeout(max(tl.end - env.now, 0.0))
                break
            except simpy.Interrupt:  # a new draft or a new speed: re-time the rest
                if tl.end <= env.now:
                    break
                if env.now < t0:
                    tl.build(t0, 0.0, w.rate, self.slowdown())
                else:
                    tl.retime(env.now, w.rate, self.slowdown())
        w.is_decoding = False
        tl.close()
        w.process = None
        w.buffer_tokens = min(w.buffer_tokens + int(tl.num_tokens), BUFFER_MAX_TOKENS)
        w.set_state(WorkerState.IDLE)
        return env.now - start

    def _nudge(self, w: SimWorker) -> None:
        if w.is_decoding and w.process is not None and w.process.is_alive:
            w.process.interrupt()

    def slowdown(self) -> float:
        factor = self.profile.phases.train_slowdown
        if factor == 1.0 or not any(w.lease is not None or w.is_scoring for w in self.workers):
            return 1.0
        return factor

    def _neighbours_changed(self) -> None:
        if self.profile.phases.train_slowdown != 1.0:
            for w in self.workers:
                self._nudge(w)

    # ----- commands from the watcher ----------------------------------------------------------------------
    def start_lease(self, w: SimWorker, lease_id: str, deadline_s: float, parent: int) -> None:
        self.env.process(self._lease(w, lease_id, deadline_s, parent))

    def _lease(self, w: SimWorker, lease_id: str, deadline_s: float, parent: int):
        env, ph, acc = self.env, self.profile.phases, self.profile.acceptance
        yield env.timeout(ph.dispatch_s)
        if w.is_generating or w.lease is not None or w.is_scoring or w.state != WorkerState.IDLE:
            w.outcomes[lease_id] = {"state": LeaseState.FAILED}  # refused: busy
            return
        started = env.now
        w.lease = {"lease_id": lease_id, "stop": env.event(), "released": env.event()}
        w.outcomes[lease_id] = {"state": LeaseState.RUNNING}
        w.set_state(WorkerState.TRAINING)
        self._neighbours_changed()
        stop = w.lease["stop"]
        yield env.timeout(deadline_s) | stop
        if stop.triggered:
            yield env.timeout(ph.preempt_s)  # the trainer stops within one micro-step
        ended = env.now
        trained = max(0.0, ended - started - ph.lease_setup_s)
        w.lease["released"].succeed()
        w.lease = None
        self._neighbours_changed()
        yield env.timeout(ph.copy_publish_s)
        version = max(self.copies, default=1000) + 1
        self.copies[version] = {"parent": parent, "seconds": trained, "num_steps": int(trained * acc.train_steps_per_s),
                                "merge_key": f"v{parent}"}
        w.outcomes[lease_id] = {"state": LeaseState.DONE, "started_at": started, "ended_at": ended, "version": version}
        if w.state == WorkerState.TRAINING:
            w.set_state(WorkerState.IDLE)

    def stop_training(self, w: SimWorker) -> None:
        if w.lease is not None and not w.lease["stop"].triggered:
            w.lease["stop"].succeed()

    def start_scoring(self, w: SimWorker, round_id: str, merged: list[int]) -> None:
        self.env.process(self._score(w, round_id, merged))

    def _score(self, w: SimWorker, round_id: str, merged: list[int]):
        acc, k = self.profile.acceptance, self.profile.workload.draft_k
        w.is_scoring = True
        self._neighbours_changed()
        yield self.env.timeout(self.profile.phases.scoring_s)
        w.is_scoring = False
        self._neighbours_changed()
        parent = self.copies[merged[0]]["parent"]
        candidate_s = self.book.seconds(parent, self.policy_version) + acc.merged_seconds(
            [self.copies[v]["seconds"] for v in merged])
        serving = self.book.latest

        def measured(seconds: float) -> float:
            return accepted_length(k, acc.rate(seconds)) + self.rng.gauss(0.0, acc.score_noise)

        self.scores[round_id] = {"candidate": measured(candidate_s), "candidate_seconds": candidate_s,
                                 "serving": measured(self.book.seconds(serving, self.policy_version))}

    def start_publish(self, round_id: str, seconds: float) -> None:
        self.env.process(self._publish(round_id, seconds))

    def _publish(self, round_id: str, seconds: float):
        yield self.env.timeout(self.profile.phases.publish_s)
        version = self.book.add(seconds, self.policy_version)
        for w in self.workers:
            self.env.process(self._install(w, version))
        self.watcher.published(round_id)

    def _install(self, w: SimWorker, version: int):
        is_swapping = w.state == WorkerState.IDLE and not w.is_generating
        if is_swapping:  # an idle worker reports SWAPPING while it loads and installs, then IDLE
            w.set_state(WorkerState.SWAPPING)
        yield self.env.timeout(self.profile.phases.swap_s)
        if version > w.served_version:
            w.served_version = version
            if w.is_decoding:
                w.rate = self.book.rate(version, self.policy_version)
                self._nudge(w)
        if is_swapping and w.state == WorkerState.SWAPPING:
            w.set_state(WorkerState.IDLE)


def simulate(profile: Profile, num_workers: int, arm: str, seed: int = 0, num_steps: int = 3,
             snapshot_every: int = 0) -> SimResult:
    """One job of `num_steps` RL steps on `num_workers` workers, arm plain, frozen or tlt (deterministic per seed)."""
    return Simulation(profile, num_workers, arm, seed, num_steps, snapshot_every).run()
