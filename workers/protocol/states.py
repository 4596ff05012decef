"""The state vocabularies: one for the worker, the policy, the metrics, the status page and the report."""

from __future__ import annotations

from enum import StrEnum


class WorkerState(StrEnum):
    """A rollout worker's state: what it reports of itself, and how the scheduler classifies it.
    One vocabulary for the worker, the policy, the metrics, the status page and the report."""

    ROLLING_OUT = "ROLLING_OUT"  # generating its share of the step
    IDLE = "IDLE"  # done with its share, waiting at the step barrier
    TRAINING = "TRAINING"  # holds a drafter-training lease
    SWAPPING = "SWAPPING"  # loading a new draft version while idle
    FAILED = "FAILED"  # its rollout or its engine failed; it gets no work
    STRAGGLER = "STRAGGLER"  # scheduler's view only: still generating in the long tail
    STALE = "STALE"  # scheduler's view only: no fresh progress record, neither counted nor given work


REPORTED_STATES = frozenset({WorkerState.ROLLING_OUT, WorkerState.IDLE, WorkerState.TRAINING,
                             WorkerState.SWAPPING, WorkerState.FAILED})  # what a worker writes of itself
GENERATING_STATES = frozenset({WorkerState.ROLLING_OUT, WorkerState.SWAPPING, WorkerState.STRAGGLER})


class Phase(StrEnum):
    """Where a job's driver is in its RL step (PhaseRecord)."""

    SYNC = "SYNC"  # pushing policy weights to the workers
    ROLLOUT = "ROLLOUT"  # the step's generation is under way: idle workers may train drafters
    UPDATE = "UPDATE"  # rewards, log-probs, policy update: every GPU is needed
    DONE = "DONE"  # the run ended (JobResult says how)


class LeaseState(StrEnum):
    RUNNING = "RUNNING"
    DONE = "DONE"
    FAILED = "FAILED"


class JobState(StrEnum):
    PENDING = "PENDING"  # accepted and stored, not yet in the queue (a scheduler restart queues it)
    QUEUED = "QUEUED"  # waiting its turn (first come, first served) for Ray to place its rollout workers; no driver
    RUNNING = "RUNNING"  # placed: its driver runs
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE_JOB_STATES = frozenset({JobState.PENDING, JobState.QUEUED, JobState.RUNNING})  # what a token's quota counts
