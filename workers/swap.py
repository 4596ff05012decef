"""Hot swap: every draft version published to the job's served store is loaded and installed in the
worker's engine, between two decode steps of a batch under way, or at once when the worker is idle.

A listener thread follows the served store's announcements (Redis pub/sub); in its quiet seconds it
keeps the worker's progress record alive. Each swap is logged (bounded) with its times, and the
progress record carries the count and the latest one (the scheduler's swap latency metric).

The swap guard: a version published with a score (its expected accepted length) is watched after it is
installed. On every listener tick the engine's counters since the install are judged (workers.guard);
if acceptance collapsed, the worker reinstalls the version it served before (from the store, weights
checksum-checked), never installs the collapsed one again, appends a CollapseEvent to the job's
collapses list and counts it in the job's totals (the scheduler's tlt_draft_collapses_total). Rollouts,
harvested pairs and stored versions are untouched: only the engine's draft changes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import redis as redis_lib

from drafter.decode.engine import EngineStats
from workers.engine import RolloutEngine
from workers.errors import one_line
from workers.guard import Acceptance, Judgement, Verdict, judge
from workers.progress import read_json_list
from workers.protocol.keys import MAX_COLLAPSE_EVENTS, TotalsField, job_collapses_key, job_totals_key
from workers.protocol.messages import CollapseEvent
from workers.protocol.states import WorkerState
from workers.spec import JobSpec
from workers.status import WorkerStatus
from workers.store import DraftStore

log = logging.getLogger(__name__)
MAX_SWAP_LOG = 64  # swaps remembered with their times: one per published version; readers want the recent
LISTEN_TIMEOUT_S = 1.0  # a quiet second: heartbeat the progress record (its TTL is 15 s)
RESUBSCRIBE_S = 1.0  # after the listener lost Redis: how long it waits before it subscribes again
# what a version that cannot be served raises as it is loaded and installed: a missing, corrupt or mismatched file
# (CheckpointError is a ValueError; so is a version not in the index, and a head the engine refuses), the disk, the
# engine's runtime (torch, vLLM's or SGLang's calls)
BAD_VERSION_ERRORS = (ValueError, OSError, RuntimeError)
SWAP_ERRORS = (*BAD_VERSION_ERRORS, redis_lib.RedisError)  # and Redis, which the index and the file's entry are in


@dataclass(frozen=True)
class Watch:
    """A swapped-in version under the guard."""

    version: int
    previous: int  # the version to go back to on a collapse (0: none in the store)
    published_length: float  # its score when published, at the job's draft_k
    before: EngineStats  # the engine's counters when it was installed


class Swapper:
    def __init__(self, engine: RolloutEngine, served: DraftStore, status: WorkerStatus, spec: JobSpec) -> None:
        self.engine, self.served, self.status = engine, served, status
        self.draft_k, self.guard = spec.draft_k, spec.swap_guard
        # {version, published_at, received_at, loaded_at, serving_at} of the latest swaps
        self.log: deque[dict] = deque(maxlen=MAX_SWAP_LOG)
        self.num_swaps = 0
        self.last_version = 0
        self.last_at = 0.0  # wall clock the latest install began
        # the serving version's accepted length as measured when it was published (0: never measured)
        self.draft_accepted_length = 0.0
        self.watch: Watch | None = None  # the version the guard judges next
        self.fallback = 0  # the newest installed version the guard has not rejected and is not judging
        self.rejected: set[int] = set()  # versions that collapsed here: never installed again
        self.num_collapses = 0
        self._lock = threading.Lock()  # one swap at a time (the listener; tests and benchmarks call directly)
        self._stop = threading.Event()
        self._outage_since: float | None = None  # monotonic time the listener lost Redis (None: it has it)

    def record_fields(self) -> dict:
        """The swap fields of the worker's progress record."""
        return {"num_swaps": self.num_swaps, "last_swap_version": self.last_version, "last_swap_at": self.last_at}

    def swap(self, version: int, published_at: float | None = None) -> None:
        """Load `version` from the served store (checksum-checked) and install it. A generating worker
        switches drafts without pausing its batch; an idle one reports SWAPPING while it loads and installs."""
        received_at = time.time()
        with self._lock:
            if version in self.rejected:
                log.info("worker %s: not installing v%d: it collapsed here before", self.status.worker_id, version)
                return
            is_idle = not self.status.is_generating and self.status.set_state(WorkerState.SWAPPING,
                                                                                only_from=WorkerState.IDLE)
            try:
                state, meta = self.served.load(version)
                loaded_at = time.time()
                if self.watch is None and self.last_version not in self.rejected:
                    self.fallback = self.last_version  # judged (or unjudgeable) and kept: the one to go back to
                score = float(meta.extra.get("accepted_length") or 0.0)
                self.engine.install_draft(version, state, meta.head_config, score)
                self._arm(version, score)
                self.log.append({"version": version, "published_at": published_at, "received_at": received_at,
                                 "loaded_at": loaded_at, "serving_at": time.time()})
                self.draft_accepted_length = score
                self.last_version, self.last_at = version, loaded_at
                self.num_swaps += 1  # last: a record that counts this swap names its version
            finally:
                if is_idle:
                    self.status.set_state(WorkerState.IDLE, only_from=WorkerState.SWAPPING)
            if not is_idle:  # an idle worker's return to IDLE carried the new swap fields already
                self.status.report(force=True)

    def _arm(self, version: int, published_length: float) -> None:
        """Put a just-installed version under the guard (if its score can be judged at all)."""
        unjudged = judge(published_length, self.draft_k, Acceptance(0, 0, 0), self.guard).verdict == Verdict.UNJUDGED
        self.watch = None if unjudged else Watch(version, self.fallback, published_length, self.engine.stats())

    def check(self) -> Judgement | None:
        """Judge the version under the guard on what the engine accepted since its install, and roll it
        back if it collapsed. None when no version is under the guard. Called on every listener tick."""
        with self._lock:
            watch = self.watch
            if watch is None:
                return None
            judgement = judge(watch.published_length, self.draft_k,
                              Acceptance.since(watch.before, self.engine.stats()), self.guard)
            if judgement.verdict == Verdict.PENDING:
                return judgement
            self.watch = None
            if judgement.verdict == Verdict.COLLAPSED:
                self._roll_back(watch, judgement)
            else:
                log.info("worker %s: draft v%d kept: accepted length %.3f over %d verify steps, %.3f expected",
                         self.status.worker_id, watch.version, judgement.acceptance.accepted_length,
                         judgement.acceptance.num_verify_steps, judgement.expected_length)
        if judgement.verdict == Verdict.COLLAPSED:
            self.status.report(force=True)  # the record names the version serving now
        return judgement

    def _roll_back(self, watch: Watch, judgement: Judgement) -> None:
        """Reinstall watch.previous (under self._lock), and record the collapse in Redis."""
        self.rejected.add(watch.version)
        self.num_collapses += 1
        rolled_back_to, error = None, None
        if watch.previous >= 1:
            try:
                state, meta = self.served.load(watch.previous)
                score = float(meta.extra.get("accepted_length") or 0.0)
                self.engine.install_draft(watch.previous, state, meta.head_config, score)
                self.draft_accepted_length = score
                self.last_version, self.last_at = watch.previous, time.time()
                self.num_swaps += 1
                rolled_back_to = watch.previous
            except SWAP_ERRORS as exc:  # the engine keeps the collapsed draft: still lossless, only slower
                log.exception("job %s: worker %s: rolling back to v%d failed", self.status.job_id,
                              self.status.worker_id, watch.previous)
                error = one_line(exc)
        acc = judgement.acceptance
        log.warning("worker %s: draft v%d collapsed: accepted length %.3f over %d verify steps, %.3f expected from "
                    "its published %.3f; rolled back to %s", self.status.worker_id, watch.version, acc.accepted_length,
                    acc.num_verify_steps, judgement.expected_length, watch.published_length,
                    f"v{rolled_back_to}" if rolled_back_to else "nothing")
        event = CollapseEvent(worker_id=self.status.worker_id, version=watch.version, rolled_back_to=rolled_back_to,
                              published_accepted_length=watch.published_length,
                              expected_accepted_length=judgement.expected_length,
                              measured_accepted_length=acc.accepted_length, num_verify_steps=acc.num_verify_steps,
                              mean_draft_length=acc.mean_draft_length, rl_step=self.status.rl_step, at=time.time(),
                              error=error)
        job_id = self.status.job_id
        try:
            with self.served.redis.pipeline(transaction=True) as pipe:
                pipe.rpush(job_collapses_key(job_id), event.to_json())
                pipe.ltrim(job_collapses_key(job_id), -MAX_COLLAPSE_EVENTS, -1)
                pipe.hincrby(job_totals_key(job_id), TotalsField.NUM_DRAFT_COLLAPSES, 1)
                pipe.execute()
        except redis_lib.RedisError:  # the rollback stands; only its record is lost
            log.exception("job %s: worker %s: recording the collapse of v%d failed", job_id, self.status.worker_id,
                          watch.version)

    def catch_up(self) -> None:
        """Install the served store's latest version (the newest that did not collapse here) if it is newer than
        the one serving: a version published before this worker subscribed (a job's warm draft, published as the
        workers start; a restarted worker's; or one announced while the listener had lost Redis). A
        version that fails to load or install is logged and skipped: the engine keeps the draft it has."""
        latest = None
        try:
            latest = self.served.latest_version()
            if latest in self.rejected:  # the newest that did not collapse here (a restarted worker's case)
                latest = max((e["version"] for e in self.served.versions() if e["version"] not in self.rejected),
                             default=None)
            if latest is not None and latest > self.last_version:
                self.swap(latest)
        except SWAP_ERRORS:
            log.exception("job %s: worker %s: catching up to %s failed", self.status.job_id, self.status.worker_id,
                          f"v{latest}" if latest is not None else "the served store's latest version")

    def listen(self) -> None:
        """Swap in every announced version until `stop`; heartbeat the progress record when quiet. The listener
        thread's top-level loop: it must not die (the worker would swap and heartbeat no more), so a Redis outage
        is logged once and the listener subscribes again (and catches up) when Redis is back."""
        while not self._stop.is_set():
            try:
                self._follow()
            except redis_lib.RedisError as exc:
                if self._outage_since is None:
                    self._outage_since = time.monotonic()
                    log.warning("job %s: worker %s: the swap listener lost Redis (%s); subscribing again every "
                                "%.0f s", self.status.job_id, self.status.worker_id, one_line(exc), RESUBSCRIBE_S)
                self._stop.wait(RESUBSCRIBE_S)
            except Exception:  # the thread's top-level loop: logged, and the listener starts again
                log.exception("job %s: worker %s: the swap listener failed; starting it again", self.status.job_id,
                              self.status.worker_id)
                self._stop.wait(RESUBSCRIBE_S)

    def _follow(self) -> None:
        """Subscribe, catch up, then swap each announced version and judge the guard's, until `stop`. A Redis
        error ends it: `listen` subscribes again and catches up to the latest version, so none is missed."""
        sub = self.served.subscribe()
        if self._outage_since is not None:
            log.warning("job %s: worker %s: the swap listener is back after %.1f s", self.status.job_id,
                        self.status.worker_id, time.monotonic() - self._outage_since)
            self._outage_since = None
        try:
            self.catch_up()
            while not self._stop.is_set():
                try:
                    self.check()
                except BAD_VERSION_ERRORS:  # the guard never stops the listener (Redis: listen's outage)
                    log.exception("job %s: worker %s: the swap guard failed", self.status.job_id,
                                  self.status.worker_id)
                msg = sub.get(timeout=LISTEN_TIMEOUT_S)
                if msg is None:
                    self.status.heartbeat()
                    continue
                try:
                    self.swap(msg.version, msg.published_at)
                except BAD_VERSION_ERRORS:  # skipped: the engine keeps serving the draft it has
                    log.exception("job %s: worker %s: swap to v%d failed", self.status.job_id,
                                  self.status.worker_id, msg.version)
        finally:
            sub.close()

    def recall_rejected(self) -> None:
        """Take back the versions that collapsed on this worker before it was restarted (the job's collapse
        events name them), so a restart does not install them again. Redis unreachable: logged, none recalled."""
        try:
            events = read_json_list(self.served.redis, job_collapses_key(self.status.job_id))
        except redis_lib.RedisError as exc:
            log.warning("job %s: worker %s: could not read earlier collapses (%s); none recalled",
                        self.status.job_id, self.status.worker_id, one_line(exc))
            return
        with self._lock:
            self.rejected.update(int(e["version"]) for e in events
                                 if isinstance(e, dict) and e.get("worker_id") == self.status.worker_id
                                 and isinstance(e.get("version"), int))

    def start(self) -> threading.Thread:
        """Install the latest served version now (a job's warm draft: before the worker's first rollout),
        then follow the announcements in a thread."""
        self.recall_rejected()
        self.catch_up()
        thread = threading.Thread(target=self.listen, daemon=True, name=f"swap-{self.status.worker_id}")
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
