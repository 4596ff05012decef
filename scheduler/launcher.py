"""Queues each job, starts its driver on Ray once its rollout GPUs are placed, and records how the job ended.

A submitted job is QUEUED (scheduler.queue: first come, first served, one Ray placement group per job); the
Admitter starts its driver, with the group its workers go into, once Ray has placed it. No driver exists before.

A driver is a detached, named Ray actor (workers.job_actor.JobDriver, torch-free at import): it outlives
the scheduler process, and a restarted scheduler finds it again by name. How a job ended has ONE
record: the JobResult the driver writes to job_result_key before its run returns or raises. The
launcher reads it once the driver's `run` (or, after a restart, `wait`) call resolves or fails; a
driver that is gone without one failed, and the job says so in one line, with the step and phase it was in.
A job the cluster can no longer hold (fewer GPUs than its rollout workers ask, e.g. a node lost) and that
finishes no step for a grace period fails too; one that keeps finishing steps on the workers it has left runs
on degraded (its driver drops the workers Ray cannot place, and its warning names them).
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from scheduler.jobs import JobStore
from scheduler.queue import MAX_UNPLACEABLE_S, Admitter, cluster_gpus, job_gpus, release_group, sweep_groups
from scheduler.settings import Settings
from workers.errors import MAX_ERROR_CHARS, one_line
from workers.job_actor import start_driver
from workers.message import ProtocolError
from workers.policy_checkpoint import has_policy_checkpoint, remove_policy_checkpoints
from workers.protocol.keys import RAY_NAMESPACE, driver_actor_name, job_phase_key, job_result_key
from workers.protocol.messages import JobResult, PhaseRecord
from workers.protocol.states import TERMINAL_JOB_STATES, JobState
from workers.spec import JobSpec

log = logging.getLogger(__name__)
# a job whose driver died without a result is resumed from its policy checkpoint at most this many times (a driver
# that keeps dying, e.g. out of memory, would otherwise restart forever)
MAX_DRIVER_RESTARTS = 2
NAME_RELEASE_S = 30.0  # how long a new driver waits for a dead one's actor name to be released
__all__ = ["MAX_UNPLACEABLE_S", "Launcher", "StoppingError"]  # MAX_UNPLACEABLE_S: scheduler.queue's, the grace rule's
PLACEMENT_CHECK_S = 2.0  # how often a followed job's driver call is polled, and the cluster's GPUs counted
# how long a stopping scheduler waits for its job threads to let go of Ray (each looks every PLACEMENT_CHECK_S): a
# thread still calling Ray after ray.shutdown() makes Ray's core worker end the process with status 1
STOP_JOIN_S = 10.0


class StoppingError(Exception):
    """The scheduler is shutting down: a job's thread lets go of its driver, and the job stays as it is."""


class Launcher:
    def __init__(self, store: JobStore, settings: Settings, reader: JobStore | None = None) -> None:
        """`store` records jobs' ends (a patient client: it waits out a Redis outage); `reader` (default `store`)
        serves the loops that only look and look again, the Admitter's and the GPU count's, on a client that
        fails at once: a thread caught in a patient client's minute of retries cannot let go at a shutdown."""
        self.store, self.settings = store, settings
        self.reader = reader if reader is not None else store
        self.drivers: dict[str, object] = {}
        self.driver_restarts: dict[str, int] = {}  # job id -> drivers started again from its policy checkpoint
        # a driver is registered and its job's state read under this lock, and a cancel looks for the driver
        # under it: a cancel that lands while a driver is being created kills it either way
        self._lock = threading.Lock()
        self.is_stopping = False  # the scheduler is shutting down: a driver call failing now ends no job
        self.admitter = Admitter(self.reader, self.launch, self._fail)
        self._threads: list[threading.Thread] = []  # each job's: starting, resuming or following its driver

    def stop(self, join_s: float = STOP_JOIN_S) -> None:
        """Stop admitting and recording jobs' ends: the scheduler is going, and Ray with it (a private one) or
        without it. A job whose driver call fails from now on stays as it is (RUNNING, no result): the next
        scheduler reattaches it or resumes it from its policy checkpoint; the queue stays in Redis for it.
        Returns once the job threads have stopped calling Ray (`join_s` at most), so Ray can go."""
        self.let_go()
        self.admitter.stop()
        deadline = time.monotonic() + join_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        if left := [t.name for t in self._threads if t.is_alive()]:
            log.warning("stopping: job threads still calling Ray after %.0f s: %s", join_s, left)

    def let_go(self) -> None:
        """The first half of stop(), at the signal (scheduler.serve): admit nothing more, and let each job's thread
        let go of its driver at its next look (every PLACEMENT_CHECK_S), before the requests in flight finish. With
        the whole process group signalled, Redis and Ray go meanwhile: a thread still following its driver then
        settled it in a patient client's minute of retries, and held the exit STOP_JOIN_S."""
        self.is_stopping = True
        self.admitter.stop(join_s=0.0)

    def _spawn(self, target, args: tuple, name: str) -> None:
        """A job's thread, kept so that stop() waits for it."""
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, args=args, daemon=True, name=name)
        self._threads.append(thread)
        thread.start()

    cluster_gpus = staticmethod(cluster_gpus)  # scheduler.queue's: the GPUs the Ray cluster has, None without Ray

    def start(self, record: dict) -> None:
        """Queue a PENDING job (a submit is stored QUEUED already: JobStore.create) and wake the Admitter: it starts
        the job in its turn. On a scheduler without Ray the job fails at once."""
        job_id, state = record["job_id"], JobState(record["state"])
        if not ray.is_initialized():  # never let a driver's creation start a Ray of its own inside this process
            self._fail(job_id, "the scheduler has no Ray cluster to run it on (started without Ray)", state)
        elif state == JobState.QUEUED or self.store.transition(job_id, JobState.QUEUED, {JobState.PENDING}):
            self.admitter.wake()

    def launch(self, job_id: str, spec: dict, group=None) -> None:
        """Start an admitted or resumed (RUNNING) job's driver in a thread of its own, its workers in placement
        group `group` (None: where Ray has GPUs, a resumed job whose group lost a node: queue.resumed_group)."""
        self._spawn(self._launch, (job_id, spec, group), f"job-{job_id}")

    def _launch(self, job_id: str, spec: dict, group=None) -> None:
        """Start a RUNNING job's driver (it resumes from the job's policy checkpoint if there is one) and follow
        it."""
        if not ray.is_initialized():  # never let a driver's creation start a Ray of its own inside this process
            self._fail(job_id, "the scheduler has no Ray cluster to run it on (started without Ray)")
            return
        if self.is_stopping:  # RUNNING, no driver: the next scheduler resumes it
            return
        try:
            job_spec = JobSpec.from_stored(spec)  # the record's JSON, read back once; typed from here down
            driver = self._start_driver(job_id, job_spec, group)
            ref = driver.run.remote()
        except Exception as exc:  # the job boundary: recorded on the job, logged with its id
            log.exception("job %s could not start", job_id)
            self._fail(job_id, f"its driver could not start: {one_line(exc)}")
            self._release_if_ended(job_id)
            return
        with self._lock:
            self.drivers[job_id] = driver
            current = self.store.get(job_id)
        if current is not None and current["state"] == JobState.CANCELLED:  # cancelled while its driver started
            log.info("job %s was cancelled as its driver started: killing it", job_id)
            ray.kill(driver)
        self._follow(job_id, driver, ref)

    def _start_driver(self, job_id: str, spec: JobSpec, group):
        """start_driver, waiting out a dead driver's name still being released (after a crash)."""
        deadline = time.monotonic() + NAME_RELEASE_S
        while True:
            try:
                return start_driver(job_id, spec, self.settings.redis_url, self.settings.store_dir,
                                    placement_group=group)
            except ValueError:
                if time.monotonic() > deadline or self.is_stopping:
                    raise
                time.sleep(0.2)

    def _resume(self, job_id: str) -> bool:
        """A RUNNING job whose driver is gone without a result starts a new driver, which resumes from the
        job's policy checkpoint: at most MAX_DRIVER_RESTARTS times, and only where there is a checkpoint. The
        Admitter starts it once the job's GPUs are placed again, before any queued job. Returns whether it will."""
        record = self.store.get(job_id)
        restarts = self.driver_restarts.get(job_id, 0)
        if (record is None or record["state"] != JobState.RUNNING or restarts >= MAX_DRIVER_RESTARTS
                or not has_policy_checkpoint(self.settings.store_dir, job_id)):
            return False
        self.driver_restarts[job_id] = restarts + 1
        log.warning("job %s: its driver is gone; starting a new one from its policy checkpoint (restart %d of %d)",
                    job_id, restarts + 1, MAX_DRIVER_RESTARTS)
        self.admitter.resume(job_id, record["created_at"])
        return True

    def _follow(self, job_id: str, driver, ref) -> None:
        """Wait for the driver's run (or wait) call, then record the job's end from its JobResult."""
        self.drivers[job_id] = driver
        cause, unplaceable = None, None
        try:
            while True:
                try:
                    unplaceable = self._wait(job_id, ref)
                    if unplaceable is None:
                        ray.get(ref)
                    break
                except ray.exceptions.ActorUnavailableError as exc:
                    # unreachable, not known dead (its node may be dying, or a network blink): a new driver now
                    # could land on that node and die with it. Ask again until Ray says alive or dead.
                    log.info("job %s: its driver is unreachable (%s); asking again", job_id, one_line(exc))
                    time.sleep(PLACEMENT_CHECK_S)
                    ref = driver.wait.remote(None)
        except (StoppingError, SystemExit):  # the scheduler (and a private Ray) is going: leave the driver as it is
            self.drivers.pop(job_id, None)
            return
        except Exception as exc:  # the driver raised or died: its JobResult (if any) says how the job ended
            cause = exc
            log.info("job %s: its driver's call ended with %s", job_id, one_line(exc))
        self.drivers.pop(job_id, None)
        if self.is_stopping:  # left as it is: the next scheduler settles it from its JobResult, or resumes it
            return
        if unplaceable is not None:
            self._fail(job_id, unplaceable)
        else:
            self.settle(job_id, cause)
        if ray.is_initialized():
            try:
                ray.kill(driver)  # a finished or failed job's driver (and its workers, placed or waiting) go away
            except (ValueError, ray.exceptions.RayError) as exc:
                log.warning("job %s: could not kill its driver: %s", job_id, one_line(exc))
        self._release_if_ended(job_id)

    def _release_if_ended(self, job_id: str) -> None:
        """An ended job's placement group goes (not a resumed one's), and the next job in line is looked at."""
        record = self.store.get(job_id)
        if record is None or JobState(record["state"]) in TERMINAL_JOB_STATES:
            release_group(job_id)
            self.admitter.wake()

    def _wait(self, job_id: str, ref) -> str | None:
        """Wait until the driver's call resolves (None), or until the cluster has had fewer GPUs than the job's
        rollout workers ask for MAX_UNPLACEABLE_S with no step finished nor the job ended: then the one line
        it fails with."""
        short = None
        while not ray.wait([ref], timeout=PLACEMENT_CHECK_S)[0]:
            if self.is_stopping:
                raise StoppingError
            try:
                short, line = self.check_placeable(job_id, short, time.monotonic())
            except Exception as exc:  # a GCS or Redis blink: count again at the next check, never fail the job
                log.warning("job %s: could not count the cluster's GPUs: %s", job_id, one_line(exc))
                continue
            if line is not None:
                return line
        return None

    def check_placeable(self, job_id: str, short: tuple[float, int] | None,
                         now: float) -> tuple[tuple[float, int] | None, str | None]:
        """(since when, on the clock of `now`, the cluster has had too few GPUs for the job without the job
        finishing a step, and its step count then; or None), and the line the job fails with once that is
        MAX_UNPLACEABLE_S ago and it has not ended, else None. A step finished restarts the clock: the job runs
        degraded on the workers it has left (its driver dropped those Ray cannot place)."""
        record = self.reader.get(job_id)
        if record is None or record["state"] != JobState.RUNNING or self.is_stopping:
            return None, None  # cancelled (its driver is being killed), gone from an emptied Redis, or stopping
        # Ray is asked last, and not once the scheduler stops: with the whole process group signalled its GCS goes
        # too, and Ray's global state accessor then aborts the process (a failed check, exit 1) instead of raising
        if (gpus := self.cluster_gpus()) is None:
            return None, None  # no Ray to ask
        spec = JobSpec.from_stored(record["spec"])
        asked = job_gpus(spec)
        if gpus >= asked:
            if short is not None:
                log.info("job %s: the Ray cluster has %g GPUs again", job_id, gpus)
            return None, None
        steps = self.reader.num_steps([job_id])[0]
        if short is None:
            log.warning("job %s: the Ray cluster has %g GPUs, fewer than the %g its rollout workers ask; it fails "
                        "unless they are back, or it finishes a step, within %.0f s", job_id, gpus, asked,
                        MAX_UNPLACEABLE_S)
            return (now, steps), None
        if steps > short[1]:  # it finishes steps on the workers it has: degraded, not stuck
            return (now, steps), None
        if now - short[0] < MAX_UNPLACEABLE_S or self.result(job_id) is not None:
            return short, None
        return short, (f"the Ray cluster has had {gpus:g} GPUs for {MAX_UNPLACEABLE_S:.0f} s, fewer than the "
                       f"{asked:g} its {spec.num_workers} rollout workers ask (a node lost?), and no step finished: "
                       f"stopped after {steps} step{'' if steps == 1 else 's'}, kept")

    def where(self, job_id: str) -> str:
        """Where a job's driver last was, from its phase record: " (at step 3, rollout)", " (at start)" if it
        began no step, "" if the record is unreadable."""
        raw = self.store.redis.get(job_phase_key(job_id))
        if raw is None:
            return " (at start)"
        try:
            phase = PhaseRecord.from_json(raw)
        except ProtocolError:
            return ""
        return f" (at step {phase.rl_step}, {phase.phase.lower()})"

    def result(self, job_id: str) -> JobResult | None:
        raw = self.store.redis.get(job_result_key(job_id))
        if raw is None:
            return None
        try:
            return JobResult.from_json(raw)
        except ProtocolError as exc:
            log.error("job %s: unreadable result record (%s)", job_id, exc)
            return None

    def settle(self, job_id: str, cause: BaseException | None = None) -> None:
        """Record a RUNNING job's end from its JobResult; none means the driver died without one."""
        result = self.result(job_id)
        if result is None and self._resume(job_id):
            return
        if result is None:
            why = f": {one_line(cause)}" if cause is not None else " (did the Ray cluster restart?)"
            self._fail(job_id, f"its driver is gone and recorded no result{self.where(job_id)}{why}")
        elif result.ok:
            fields = {"warning": result.warning} if result.warning else {}
            self.store.transition(job_id, JobState.SUCCEEDED, {JobState.RUNNING}, **fields)
            remove_policy_checkpoints(self.settings.store_dir, job_id)  # nothing will resume from it
        else:
            self._fail(job_id, result.error or "its driver reported a failure without a message")

    def _fail(self, job_id: str, error: str, was: JobState = JobState.RUNNING) -> None:
        line = " ".join(error.split())[:MAX_ERROR_CHARS]
        if self.store.transition(job_id, JobState.FAILED, {was}, error=line) is not None:
            log.error("job %s failed: %s", job_id, line)

    def reattach(self) -> dict[str, str]:
        """After a (re)start: follow every RUNNING job's driver again, settle those that ended while no
        scheduler was up (or resume them, ahead of the queue), queue the PENDING ones, remove the placement groups
        of jobs that ended, and start admitting the queue (kept in Redis: its order is the submissions').
        Returns job id -> what was done."""
        done = {}
        for job_id in self.store.running_ids():
            if job_id in self.drivers:
                continue
            try:
                driver = ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE)
            except ValueError:  # no such actor: it ended (or died) while we were away
                self.settle(job_id)  # resumed (first: the Admitter places its GPUs before the queue's) or ended
                is_resumed = (self.store.get(job_id) or {}).get("state") == JobState.RUNNING
                done[job_id] = "resumed ahead of the queue" if is_resumed else "settled"
                continue
            self.drivers[job_id] = driver
            self._spawn(self._follow, (job_id, driver, driver.wait.remote(None)), f"job-{job_id}")
            done[job_id] = "reattached"
        pending = [r for r in self.store.get_many(list(self.store.all_ids())) if r["state"] == JobState.PENDING]
        for record in pending:
            self.start(record)
            done[record["job_id"]] = "queued"
        for job_id in sweep_groups(self.store):
            done[job_id] = "placement group removed"
        self.admitter.start()
        if done:
            log.info("reattached: %s", done)
        return done

    def cancel(self, job_id: str) -> None:
        """Kill a cancelled job's driver (and with it its workers). Call it after the job's state changed to
        CANCELLED: a driver still being created then sees that state when it registers, and is killed there."""
        with self._lock:
            driver = self.drivers.get(job_id)
        if driver is None:
            try:
                driver = ray.get_actor(driver_actor_name(job_id), namespace=RAY_NAMESPACE)
            except ValueError:
                driver = None
        if driver is not None:
            ray.kill(driver)
        release_group(job_id)  # a queued job's group (asked for, or placed) or a running one's
        self.admitter.wake()
        remove_policy_checkpoints(self.settings.store_dir, job_id)
