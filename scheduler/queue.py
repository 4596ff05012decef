"""The job queue's admission: first come, first served, with Ray placing each job's rollout GPUs.

A submitted job waits QUEUED in Redis (JobStore: queued_jobs_key, by submission time) with no driver. The
Admitter asks Ray for one placement group per job, holding a bundle of spec.gpus_per_worker GPU for each rollout
worker, for the job first in line only: Ray reserves the whole group at once or nothing (a job never holds half
its GPUs), and places it when GPUs free up. Once Ray has placed it the job goes RUNNING and its driver starts
(Launcher.launch), its workers scheduled into the group's bundles. The group is removed when the job ends,
fails or is cancelled, and with it anything still scheduled in it. Strictly in order: a job that needs more GPUs
than are free holds the line (no backfill), as a FIFO queue of Slurm or Kueue does.

The group is detached and named (protocol.keys.placement_group_name): like the driver, it outlives a scheduler
restart, and the next scheduler finds it by name. Torch-free.
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
ADMIT_WAIT_S = 1.0  # how long one look at the head waits for Ray to place its group; a submit or an end wakes it
# PACK: a job's bundles on as few nodes as fit (its workers talk to one driver), spread where one node cannot hold them
PLACEMENT_STRATEGY = "PACK"


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


def resumed_group(job_id: str) -> PlacementGroup | None:
    """The placement group a resumed driver's workers go in: the job's, if Ray still holds it whole, else None
    (the group removed). A group that lost bundles with a node waits RESCHEDULING until the cluster has them
    again; the job runs degraded on what is left instead: its workers go where Ray has GPUs, and the driver drops
    those Ray cannot place (workers.worker_start), as a job that lost a node always has."""
    pg = job_group(job_id, None, is_created=False)
    if pg is None:
        return None
    state = ray.util.placement_group_table(pg).get("state")
    if state == "CREATED":
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
    runs after the job went RUNNING (in the same MULTI/EXEC as it left the queue)."""

    def __init__(self, store: JobStore, launch: Callable[[str, dict, PlacementGroup], None]) -> None:
        self.store, self.launch = store, launch
        self._wake, self._stop = threading.Event(), threading.Event()
        self._asked: str | None = None  # the job whose group was last asked for (removed once it leaves the head)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True, name="admitter")
        self._thread.start()

    def wake(self) -> None:
        """Look at the head now: a job was queued, ended or cancelled."""
        self._wake.set()

    def stop(self, join_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(join_s)

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
        """Ask Ray to place the head's group and wait up to `wait_s`; once placed, start the job. Returns whether
        the queue moved (a job started, or a head that was no longer QUEUED left it)."""
        head = self.store.queue_head()
        if self._asked is not None and self._asked != head:  # cancelled while its group waited: give it back
            if (record := self.store.get(self._asked)) is None or record["state"] != JobState.RUNNING:
                release_group(self._asked)
            self._asked = None
        if head is None or not ray.is_initialized():
            return False
        record = self.store.get(head)
        if record is None or record["state"] != JobState.QUEUED:  # a stale entry (the record was lost): drop it
            self.store.drop_from_queue(head)
            return True
        spec = JobSpec.from_stored(record["spec"])
        pg = job_group(head, spec)
        self._asked = head
        if not pg.wait(wait_s):
            return False
        started = self.store.transition(head, JobState.RUNNING, {JobState.QUEUED}, started_at=time.time())
        self._asked = None
        if started is None:  # cancelled as Ray placed it
            release_group(head)
            return True
        log.info("job %s: admitted (its %d rollout GPUs are placed)", head, spec.num_workers)
        self.launch(head, started["spec"], pg)
        return True
