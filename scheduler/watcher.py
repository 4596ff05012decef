"""The watcher: reads Redis, asks the pure policy, and sends the workers its decisions as commands.

Each `tick()`, for every RUNNING job (the running set: however many jobs the store holds) that trains
its drafter (its stored spec read back by JobSpec.from_stored: tlt and idle_training on), it reads the
driver's phase, the workers' progress records, the lease outcomes the workers write and the served
draft index; then it `decide`s, preempts trainers whose GPU is needed (the rollout
phase ended, or the worker got rollouts again), offers leases to idle workers in the long tail,
collects finished leases (reclaimed time: each lease's overlap with its step's rollout phase), and
once a round's leases have all come back hands the round to scheduler/rounds.py (merge, score,
publish: done by workers, never by this process). The tick reads Redis only; Ray carries commands,
sent without waiting (scheduler/commands.py).

A worker whose actor Ray says is dead (scheduler.commands.is_gone: killed, its node lost) is dropped at
the next tick, in one log line: its lease is closed (collected if it finished, else lost), and its last
progress record, which lives on in Redis until its TTL, is left out of every decision (`without_gone`)
until a new worker reports in its slot. Without this it would be asked again every tick until then.

Everything a restarted scheduler needs lives in Redis (job_tlt_key: open leases, unmerged copies,
the round under scoring, counters; job_leases_key: the workers' lease outcomes), so a restart loses
no lease and no draft version.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scheduler.commands import COMMAND_TIMEOUT_S, Commands, Reply
from scheduler.jobs import JobStore
from scheduler.metrics import Latencies
from scheduler.policy import (
    Lease,
    PolicySettings,
    WorkerView,
    completed_rollout_s,
    decide,
    reclaimed_by_step,
    scoring_fits,
    track_rollouts,
)
from scheduler.rounds import SCORING, Rounds
from scheduler.settings import TICK_S
from scheduler.state import JobTLT
from workers.draft_index import DraftIndex
from workers.message import ProtocolError
from workers.progress import read_progress
from workers.protocol.keys import (
    TltField,
    draft_namespaces,
    job_leases_key,
    job_phase_key,
    job_tlt_key,
)
from workers.protocol.messages import LeaseOffer, LeaseOutcome, PhaseRecord, ProgressRecord
from workers.protocol.states import JobState, LeaseState, WorkerState
from workers.spec import JobSpec

log = logging.getLogger(__name__)
PREEMPT_WAIT_S = 5.0  # how long a preemption waits for the trainer to confirm it stopped
MAX_OUTAGE_WAIT_S = 2.0  # longest pause between ticks while Redis is unreachable (the tick doubles up to it)


def without_gone(records: list[ProgressRecord], gone: dict[str, float]) -> tuple[list[ProgressRecord], list[str]]:
    """(kept, settled): the progress records of workers not found gone, and the gone workers there is nothing
    left to hide of. `gone`: worker id -> wall-clock time it was found gone. A dead worker's last record stays in
    Redis until its TTL, so every record written no later than that time is the dead worker's and is left out;
    a newer one comes from a new worker in the slot (the driver starts lost workers again), which is watched
    again, as a slot is once the dead worker's record expired."""
    latest = {r.worker_id: r.timestamp for r in records}
    settled = [w for w, at in gone.items() if w not in latest or latest[w] > at]
    kept = [r for r in records if r.worker_id not in gone or r.timestamp > gone[r.worker_id]]
    return kept, settled


class Watcher:
    def __init__(self, store: JobStore, store_dir: str, settings: PolicySettings | None = None,
                 tick_s: float = TICK_S, metrics: Latencies | None = None) -> None:
        self.store, self.tick_s = store, tick_s
        self.settings = settings or PolicySettings()
        self.metrics = metrics or Latencies()
        self.jobs: dict[str, JobTLT] = {}
        self.gone: dict[str, dict[str, float]] = {}  # job id -> worker id -> when its actor was found dead
        self.commands = Commands()
        self.rounds = Rounds(store.redis, store_dir, self.commands, self.settings, self.jobs)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tlt-watcher")
        self._thread.start()
        return self._thread

    def stop(self, join_s: float = 0.0) -> None:
        """Stop ticking; with join_s, wait that long for a tick under way to finish."""
        self._stop.set()
        if join_s and self._thread is not None:
            self._thread.join(join_s)

    def _loop(self) -> None:
        wait_s, outage_since = self.tick_s, None
        while not self._stop.wait(wait_s):
            try:
                self.tick()
            except (RedisConnectionError, RedisTimeoutError) as exc:  # Redis blinked: one line, then back off
                if outage_since is None:
                    outage_since = time.monotonic()
                    log.warning("watcher: Redis unreachable (%s); retrying with back-off", type(exc).__name__)
                wait_s = min(MAX_OUTAGE_WAIT_S, wait_s * 2)
                continue
            except Exception:  # one bad tick must not stop watching
                log.exception("watcher tick failed")
            if outage_since is not None:
                log.warning("watcher: Redis is back after %.1f s", time.monotonic() - outage_since)
            wait_s, outage_since = self.tick_s, None

    def _state(self, job_id: str) -> JobTLT:
        if job_id not in self.jobs:  # first sight, or after a restart: pick up where Redis says
            self.jobs[job_id] = JobTLT.load(self.store.redis, job_id)
        return self.jobs[job_id]

    def tick(self) -> None:
        self.commands.poll()  # the answers that arrived since the last tick
        watched = set()
        for job in self.store.get_many(self.store.running_ids()):
            if job["state"] != JobState.RUNNING:
                continue
            try:
                if not JobSpec.from_stored(job["spec"]).trains_drafter:  # no leases, nothing to watch
                    continue
                watched.add(job["job_id"])
                self.watch_job(job["job_id"])
            except (RedisConnectionError, RedisTimeoutError):
                raise  # not this job's fault: the loop backs off
            except Exception:  # the job's boundary in a tick: logged with its id, the other jobs still watched
                log.exception("job %s: watcher step failed", job["job_id"])
        for job_id in set(self.jobs) - watched:  # ended: its workers are gone with its driver
            self._end(job_id)

    def _end(self, job_id: str) -> None:
        st = self.jobs.pop(job_id)
        self.commands.forget(job_id)
        self.gone.pop(job_id, None)
        if st.leases or st.copies or st.scoring:
            log.info("job %s ended with %d open leases, %d unmerged copies and %s (kept in the copies store)",
                     job_id, len(st.leases), len(st.copies),
                     f"round {st.scoring['round_id']} undecided" if st.scoring else "no round undecided")
            st.leases, st.copies, st.scoring = {}, [], None
            st.save(self.store.redis, job_id)

    def watch_job(self, job_id: str) -> None:
        redis = self.store.redis
        raw = redis.get(job_phase_key(job_id))
        if raw is None:
            return  # the driver has not begun its first step
        try:
            phase = PhaseRecord.from_json(raw)
        except ProtocolError as exc:
            log.error("job %s: unreadable phase record (%s)", job_id, exc)
            return
        st = self._state(job_id)
        st.set_windows(track_rollouts(st.windows(), phase.phase, phase.rl_step, phase.since))
        why = self._found_gone(job_id)
        gone = self.gone.get(job_id, {})
        records, settled = without_gone(read_progress(redis, job_id), gone)
        for worker_id in settled:
            del gone[worker_id]
        live = {r.worker_id: r for r in records}
        self._observe_swaps(job_id, st, records)
        self._collect(job_id, st, live, why)
        for worker_id, error in why.items():  # those whose lease's line did not say it
            log.warning("job %s: worker %s is gone (%s)", job_id, worker_id, error)
        views = [WorkerView(r.worker_id, r.state, r.num_finished, r.num_total, r.timestamp, r.buffer_tokens,
                            r.rl_step) for r in records]
        serving = DraftIndex(redis, draft_namespaces(job_id)[0]).latest_version() or 0
        scorer = st.scoring["evaluated_by"] if st.scoring and st.scoring["stage"] == SCORING else None
        now = time.time()
        decision = decide(views, now, phase.phase, now - phase.since, serving, self.settings,
                          leased=frozenset(st.leases), busy=frozenset({scorer} - {None}), rl_step=phase.rl_step,
                          recent_rollout_s=completed_rollout_s(st.windows()))
        redis.hset(job_tlt_key(job_id), mapping={TltField.CLASSES: json.dumps(decision.classes),
                                                 TltField.LONG_TAIL: int(decision.long_tail)})
        for worker_id in decision.preempt:
            self._preempt(job_id, worker_id)
        grants = decision.grants
        if st.scoring is not None:
            self.rounds.poll(job_id, st, live)
        elif st.copies and scoring_fits(decision.remaining_rollout_s, st.last_scoring_s, self.settings):
            # finished copies wait for a free worker to score them, ahead of another lease: a better draft
            # reaches the stragglers sooner; leases still running belong to the next round
            scorer = self.rounds.start(job_id, st, decision.classes, phase.phase,
                                       {r.worker_id: r.rl_step for r in records})
            grants = [g for g in grants if g.worker_id != scorer]
        for lease in grants:
            self._offer(job_id, st, lease, live[lease.worker_id].rl_step)
        st.save(redis, job_id)

    # ----- the steps of a tick ------------------------------------------------------------------
    def _found_gone(self, job_id: str) -> dict[str, str]:
        """The workers whose actor Ray said is dead since the last tick, not known gone before: worker id ->
        Ray's error. From now on they are left out of every decision (without_gone), and their leases are
        closed by this tick's _collect (a finished one is still collected)."""
        gone, found = self.gone.setdefault(job_id, {}), {}
        for worker_id, error in self.commands.take_gone(job_id).items():
            if worker_id not in gone:  # the first time: a new worker's records are newer than it
                gone[worker_id], found[worker_id] = time.time(), error
        return found

    def _observe_swaps(self, job_id: str, st: JobTLT, records: list[ProgressRecord]) -> None:
        """Swap latency: a served version's publish (its index entry's created_at) to a worker beginning
        to install it (the worker's record keeps its newest swap)."""
        served = DraftIndex(self.store.redis, draft_namespaces(job_id)[0])
        for r in records:
            if r.num_swaps > st.swaps_seen.get(r.worker_id, 0) and r.last_swap_version > 0:
                try:
                    published_at = float(served.entry(r.last_swap_version)["created_at"])
                except ValueError as exc:  # pruned or unreadable: nothing to measure against
                    log.info("job %s: no publish time for v%d: %s", job_id, r.last_swap_version, exc)
                else:
                    self.metrics.swap.labels(job_id).observe(max(r.last_swap_at - published_at, 0.0))
            st.swaps_seen[r.worker_id] = r.num_swaps

    def _preempt(self, job_id: str, worker_id: str) -> None:
        if self.commands.is_pending(job_id, worker_id, "stop_training"):
            return  # asked already: its answer comes in a later tick

        def stopped(reply: Reply) -> None:
            if reply.is_gone:
                return  # the next tick leaves the worker out and closes its lease, in one line (_found_gone)
            if reply.error is not None:
                (log.debug if reply.quiet else log.warning)("job %s: preempting %s failed: %s", job_id, worker_id,
                                                            reply.error)
            elif reply.value:
                self.metrics.preempt.labels(job_id).observe(reply.seconds)
                log.info("job %s: preempted the trainer on %s", job_id, worker_id)

        self.commands.send(job_id, worker_id, "stop_training", PREEMPT_WAIT_S, on_reply=stopped,
                           timeout_s=PREEMPT_WAIT_S + COMMAND_TIMEOUT_S)

    def _offer(self, job_id: str, st: JobTLT, lease: Lease, rl_step: int) -> None:
        """`rl_step`: the step of the worker's progress record now: the lease trains on rollouts up to it."""
        offer = LeaseOffer(f"{job_id}-{lease.worker_id}-{st.num_leases}", lease.parent_version, lease.deadline_s)
        st.num_leases += 1
        st.leases[lease.worker_id] = {**offer.to_dict(), "offered_at": time.time(), "rl_step": rl_step}

        def answered(reply: Reply) -> None:
            held = self.jobs.get(job_id)
            entry = held.leases.get(lease.worker_id) if held else None
            if entry is None or entry["lease_id"] != offer.lease_id:
                return  # collected already, or the job ended
            if reply.is_gone:
                return  # the next tick leaves the worker out and drops this lease, in one line (_found_gone)
            if reply.error is not None:
                (log.debug if reply.quiet else log.warning)("job %s: %s refused lease %s: %s", job_id,
                                                            lease.worker_id, offer.lease_id, reply.error)
                del held.leases[lease.worker_id]
                return
            self.metrics.dispatch.labels(job_id).observe(reply.seconds)
            log.info("job %s: lease %s to %s for %.1f s on v%d", job_id, offer.lease_id, lease.worker_id,
                     offer.deadline_s, offer.parent_version)

        self.commands.send(job_id, lease.worker_id, "start_lease", offer.to_dict(), on_reply=answered)

    def _collect(self, job_id: str, st: JobTLT, live: dict[str, ProgressRecord], why: dict[str, str]) -> None:
        """Close the leases whose outcome the worker wrote DONE or FAILED, and the lost ones. `why`: the workers
        just found gone (_found_gone), each with Ray's error; a lost lease's line says it, and takes it out."""
        outcomes = self.store.redis.hgetall(job_leases_key(job_id)) if st.leases else {}
        for worker_id, lease in list(st.leases.items()):
            lease_id = lease["lease_id"]
            raw = outcomes.get(lease_id)
            try:
                outcome = LeaseOutcome.from_json(raw) if raw is not None else None
            except ProtocolError as exc:
                log.error("job %s: unreadable outcome of lease %s (%s)", job_id, lease_id, exc)
                outcome = None
            is_gone = worker_id not in live or live[worker_id].state == WorkerState.FAILED
            if outcome is None:
                if self.commands.is_pending(job_id, worker_id, "start_lease"):
                    continue  # the offer is on its way
                if is_gone or time.time() - lease["offered_at"] > COMMAND_TIMEOUT_S:
                    reason = f"the worker is gone: {why.pop(worker_id)}" if worker_id in why else \
                        "never accepted, or the worker is gone"
                    log.warning("job %s: lease %s on %s has no outcome (%s); dropped", job_id, lease_id, worker_id,
                                reason)
                    del st.leases[worker_id]
                continue
            if outcome.state == LeaseState.RUNNING:
                if is_gone:
                    reason = f" ({why.pop(worker_id)})" if worker_id in why else ""
                    log.warning("job %s: worker %s is gone%s; its lease %s is lost", job_id, worker_id, reason,
                                lease_id)
                    del st.leases[worker_id]
                continue
            del st.leases[worker_id]
            if outcome.state == LeaseState.FAILED:
                log.error("job %s: lease %s on %s failed: %s", job_id, lease_id, worker_id, outcome.error)
                continue
            # reclaimed: only the part of the lease while the rollout was under way (some worker generating)
            by_step = reclaimed_by_step(outcome.started_at, outcome.ended_at or time.time(), st.windows()) \
                if outcome.started_at > 0 else {}
            st.add_reclaimed(by_step)
            if worker_id not in st.trained:
                st.trained.append(worker_id)
            if "rl_step" in lease:  # the step its data came from (a lease saved by an older scheduler has none)
                st.trained_steps[worker_id] = max(st.trained_steps.get(worker_id, -1), lease["rl_step"])
            if outcome.version is not None:
                st.copies.append(outcome.version)
            log.info("job %s: lease %s on %s done: %d steps in %.1f s (%.1f s within the rollout) -> copy %s",
                     job_id, lease_id, worker_id, outcome.steps, outcome.seconds, sum(by_step.values()),
                     outcome.version)
