"""The job queue's admission: first come, first served, with Ray placing each job's rollout GPUs.

A submitted job waits QUEUED in Redis (JobStore: queued_jobs_key, by submission time) with no driver. The
Admitter asks Ray for one placement group per job, holding a bundle of spec.gpus_per_worker GPU for each rollout
worker, for the job first in line only: Ray reserves the whole group at once or nothing (a job never holds half
its GPUs), and places it when GPUs free up. Once Ray has placed it the job goes RUNNING and its driver starts
(Launcher.launch), its workers scheduled into the group's bundles. The group is removed when the job ends,
fails or is cancelled, and with it anything still scheduled in it. Strictly in order: a job that needs more GPUs
than are free holds the line (no backfill), as a FIFO queue of Slurm or Kueue does.

The group is detached and named (protocol.keys.placement_group_name): like the driver, it outlives a scheduler
restart, and the next scheduler finds it by name. A RUNNING job whose driver is gone (a restarted private Ray, a
driver killed) is resumed through the Admitter too, ahead of the queue: every such job gets its group back (asked
again where Ray lost it), oldest submission first, before any QUEUED job is admitted; one whose GPUs are not
placed within MAX_UNPLACEABLE_S is requeued at its place in line, or failed if the cluster has fewer GPUs than it
asks. Torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import PlacementGroup, get_placement_group, placement_group, remove_placement_group

from scheduler.jobs import JobStore
from workers.errors import one_line
from workers.protocol.keys import placement_group_job, placement_group_name
from workers.protocol.states import JobState
from workers.spec import JobSpec

log = logging.getLogger(__name__)
# a RUNNING job whose Ray cluster has had fewer GPUs than it asks for this long, without finishing a step meanwhile,
# fails (scheduler.launcher); a resumed job whose group Ray has not placed again by then leaves the head of the line
MAX_UNPLACEABLE_S = 60.0
GIVE_BACK_JOIN_S = 2.0  # how long a stopping Admitter waits for the head's pending group to be given back
ADMIT_WAIT_S = 1.0  # how long one look at the head waits for Ray to place its group; a submit or an end wakes it
# PACK: a job's bundles on as few nodes as fit (its workers talk to one driver), spread where one node cannot hold them
PLACEMENT_STRATEGY = "PACK"


def job_gpus(spec: JobSpec) -> float:
    """The GPUs a job asks for: a bundle of gpus_per_worker for each rollout worker (4 x 0.5 is 2)."""
    return round(spec.num_workers * spec.gpus_per_worker, 4)  # gpus_per_worker has at most 4 decimals


def cluster_gpus() -> float | None:
    """GPUs the Ray cluster has (logical ones on CPU), None when this process has no Ray to ask."""
    if not ray.is_initialized():
        return None
    return float(ray.cluster_resources().get("GPU", 0))


def job_group(job_id: str, spec: JobSpec | None, *, is_created: bool = True) -> PlacementGroup | None:
    """The job's placement group: the one already named for it, else (with is_created) a new one of num_workers
    bundles of gpus_per_worker GPU each (`spec`: the job's, read back with JobSpec.from_stored; None only without
    is_created). None when there is none and none was to be created."""
    name = placement_group_name(job_id)
    try:
        return get_placement_group(name)
    except ValueError:  # none by that name (never asked for, or removed)
        if not is_created:
            return None
    bundles = [{"GPU": spec.gpus_per_worker} for _ in range(spec.num_workers)]
    return placement_group(bundles, strategy=PLACEMENT_STRATEGY, name=name, lifetime="detached")


def resumed_group(job_id: str, spec: JobSpec) -> PlacementGroup | None:
    """The placement group a resumed driver's workers go in: the job's, if Ray still holds it whole (or is placing
    it), else a new one asked for where Ray has none by its name (a private Ray started again with the scheduler);
    the Admitter waits for it before any queued job. None where the group lost bundles with a node: it waits
    RESCHEDULING until the cluster has them again, so it is removed and the job runs degraded on what is left
    instead (its workers go where Ray has GPUs, and the driver drops those Ray cannot place: workers.worker_start),
    as a job that lost a node always has."""
    pg = job_group(job_id, None, is_created=False)
    if pg is None:
        return job_group(job_id, spec)
    state = ray.util.placement_group_table(pg).get("state")
    if state in ("CREATED", "PENDING", "PREPARED"):  # placed, or on its way to be
        return pg
    log.warning("job %s: its placement group is %s (a node lost?): the resumed driver runs on what Ray can place",
                job_id, state)
    release_group(job_id)
    return None


def release_group(job_id: str) -> None:
    """Remove the job's placement group, if it has one: its GPUs go to the next job in line."""
    if not ray.is_initialized():
        return
    try:
        pg = job_group(job_id, None, is_created=False)
        if pg is not None:
            remove_placement_group(pg)
            log.info("job %s: its placement group is removed", job_id)
    except (ValueError, ray.exceptions.RayError) as exc:
        log.warning("job %s: could not remove its placement group: %s", job_id, one_line(exc))


def sweep_groups(store: JobStore) -> list[str]:
    """Remove the placement groups of jobs that are neither QUEUED nor RUNNING (they ended, or were cancelled,
    while no scheduler was up to remove them); returns those jobs' ids."""
    if not ray.is_initialized():
        return []
    named = {job_id: info for info in ray.util.placement_group_table().values()
             if info.get("state") != "REMOVED" and (job_id := placement_group_job(info.get("name") or ""))}
    records = {r["job_id"]: r for r in store.get_many(list(named))}
    gone = [job_id for job_id in named
            if records.get(job_id, {}).get("state") not in (JobState.QUEUED, JobState.RUNNING)]
    for job_id in gone:
        release_group(job_id)
    return gone


class Admitter:
    """The thread that starts the job first in line once Ray has placed its group: `launch(job_id, spec, pg)`
    runs after the job went RUNNING (in the same MULTI/EXEC as it left the queue). Jobs to resume (`resume`) come
    first: `launch` runs once their group is placed again (pg None: the job runs degraded, see resumed_group);
    `fail(job_id, line)` for one that cannot be placed on this cluster any more."""

    def __init__(self, store: JobStore, launch: Callable[[str, dict, PlacementGroup | None], None],
                 fail: Callable[[str, str], None]) -> None:
        self.store, self.launch, self.fail = store, launch, fail
        self._wake, self._stop = threading.Event(), threading.Event()
        self._asked: str | None = None  # the job whose group was last asked for (removed once it leaves the head)
        # RUNNING jobs whose driver is gone, to place again before the queue moves: job id -> (submission time,
        # when the Admitter began waiting for its group, on the monotonic clock, or None before it did)
        self._resuming: dict[str, tuple[float, float | None]] = {}
        self._lock = threading.Lock()  # _resuming is added to by the launcher's job threads
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="admitter")
        self._thread.start()

    def wake(self) -> None:
        """Look at the head now: a job was queued, ended or cancelled."""
        self._wake.set()

    def resume(self, job_id: str, created_at: float) -> None:
        """Start a new driver for a RUNNING job whose driver is gone, once its group is placed again: before any
        queued job is admitted, and after the resumed jobs submitted before it."""
        with self._lock:
            self._resuming.setdefault(job_id, (created_at, None))
        self.wake()

    def stop(self, join_s: float = 5.0) -> None:
        """Stop the thread (waiting `join_s` at most); once it has stopped, the group asked for the head goes back
        unless that job runs in it: a detached group left by a scheduler that stopped while Ray placed it (or whose
        job was cancelled meanwhile) would hold its GPUs until the next scheduler's sweep."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(join_s)
        if self._asked is not None and (self._thread is None or not self._thread.is_alive()):
            # on a thread of its own, waited for GIVE_BACK_JOIN_S at most: with the whole process group signalled,
            # Ray may be going too, and a call to it would hold the exit for a minute
            asked = self._asked
            giver = threading.Thread(target=self._give_back_quietly, args=(asked,), daemon=True, name="give-back")
            giver.start()
            giver.join(GIVE_BACK_JOIN_S)

    def _give_back_quietly(self, asked: str) -> None:
        try:
            self._give_back_asked()
        except Exception as exc:  # Redis or Ray already gone: the next scheduler's sweep_groups removes it
            log.warning("admission: the group asked for job %s was left: %s", asked, one_line(exc))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                is_admitted = self.admit_next()
            except Exception as exc:  # a Redis or GCS blink: look again at the next wake, the queue is in Redis
                log.warning("admission: %s", one_line(exc))
                is_admitted = False
            if not is_admitted:
                self._wake.wait(ADMIT_WAIT_S)
                self._wake.clear()

    def admit_next(self, wait_s: float = ADMIT_WAIT_S) -> bool:
        """Resume the first job to resume, else ask Ray to place the head's group and wait up to `wait_s`; once
        placed, start the job. Returns whether the queue moved (a job started, or one that was no longer QUEUED
        or RUNNING left it)."""
        with self._lock:
            first = min(self._resuming, key=lambda job_id: self._resuming[job_id][0], default=None)
        if first is not None and ray.is_initialized():
            return self._admit_resumed(first, wait_s)
        head = self.store.queue_head()
        if self._asked is not None and self._asked != head:  # cancelled while its group waited: give it back
            self._give_back_asked()
        if head is None or not ray.is_initialized():
            return False
        record = self.store.get(head)
        if record is None or record["state"] != JobState.QUEUED:  # a stale entry (the record was lost): drop it
            self.store.drop_from_queue(head)
            return True
        spec = JobSpec.from_stored(record["spec"])
        pg = job_group(head, spec)
        self._asked = head
        try:
            if not pg.wait(wait_s):
                return False
        except Exception:  # its group was removed while Ray placed it: the job was cancelled (the queue moved)
            if (now := self.store.get(head)) is not None and now["state"] == JobState.QUEUED:
                raise
            self._asked = None
            return True
        started = self.store.transition(head, JobState.RUNNING, {JobState.QUEUED}, started_at=time.time())
        self._asked = None
        if started is None:  # cancelled as Ray placed it
            release_group(head)
            return True
        log.info("job %s: admitted (its %g rollout GPUs are placed)", head, job_gpus(spec))
        self.launch(head, started["spec"], pg)
        return True

    def _give_back_asked(self) -> None:
        """Remove the group asked for the last head, unless that job runs in it."""
        if (record := self.store.get(self._asked)) is None or record["state"] != JobState.RUNNING:
            release_group(self._asked)
        self._asked = None

    def _admit_resumed(self, job_id: str, wait_s: float) -> bool:
        """Place a resumed job's group again and start its driver; requeue it (or fail it, where the cluster has
        fewer GPUs than it asks) if Ray has not placed it within MAX_UNPLACEABLE_S."""
        if self._asked is not None:  # a head's group waiting now would take the GPUs the resumed job had
            self._give_back_asked()
        record = self.store.get(job_id)
        if record is None or record["state"] != JobState.RUNNING:  # cancelled or ended meanwhile
            self._drop_resumed(job_id)
            release_group(job_id)
            return True
        spec = JobSpec.from_stored(record["spec"])
        pg = resumed_group(job_id, spec)
        if pg is not None and not pg.wait(wait_s):
            with self._lock:
                created_at, since = self._resuming[job_id]
                if since is None:
                    since = time.monotonic()
                    self._resuming[job_id] = (created_at, since)
            if time.monotonic() - since < MAX_UNPLACEABLE_S:
                return False
            self._drop_resumed(job_id)
            release_group(job_id)
            self._unplaced(job_id, spec)
            return True
        self._drop_resumed(job_id)
        if pg is not None:
            log.info("job %s: its %g rollout GPUs are placed again: its new driver starts", job_id, job_gpus(spec))
        self.launch(job_id, record["spec"], pg)
        return True

    def _drop_resumed(self, job_id: str) -> None:
        with self._lock:
            self._resuming.pop(job_id, None)

    def _unplaced(self, job_id: str, spec: JobSpec) -> None:
        """A resumed job whose group Ray did not place again in time: failed where the cluster has fewer GPUs than it
        asks (it could never be placed), else requeued at its place in line (its driver resumes in its turn)."""
        asked, gpus = job_gpus(spec), cluster_gpus()
        if gpus is not None and gpus < asked:
            self.fail(job_id, f"its {asked:g} rollout GPUs were not placed again after its driver was lost: the Ray "
                              f"cluster has {gpus:g}")
            return
        why = (f"requeued: its {asked:g} rollout GPUs were not free again within {MAX_UNPLACEABLE_S:.0f} s of its "
               f"driver's loss; it resumes from its policy checkpoint in its turn")
        if self.store.transition(job_id, JobState.QUEUED, {JobState.RUNNING}, warning=why) is not None:
            log.warning("job %s: %s", job_id, why)
