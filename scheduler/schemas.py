"""The REST API's output models (the input model is workers.spec.JobSpec) and the publish decision
record the watcher writes to job_drafts_key and GET /v1/jobs/{id}/drafts returns."""

from __future__ import annotations

import dataclasses
import typing

from pydantic import BaseModel, create_model

from workers.protocol.messages import CollapseEvent, ProgressRecord
from workers.protocol.states import JobState, WorkerState


class JobOut(BaseModel):
    job_id: str
    state: JobState
    spec: dict  # the JobSpec as submitted, every default filled in
    created_at: float
    updated_at: float
    error: str | None = None  # one line, when the job failed
    warning: str | None = None  # one line, when it succeeded degraded (a rollout worker lost; JobResult.warning)
    steps: int = 0  # RL steps finished: the length of the job's step records
    queue_position: int | None = None  # QUEUED: its place in line, 1 for the next to start (else null)
    started_at: float | None = None  # when it left the queue: Ray had placed its rollout GPUs


# A worker's latest ProgressRecord (every field but job_id) and the watcher's class for it: built
# from the message type, so the two cannot drift apart.
_PROGRESS_HINTS = typing.get_type_hints(ProgressRecord)
WorkerOut = create_model(
    "WorkerOut",
    **{f.name: (_PROGRESS_HINTS[f.name], ...) for f in dataclasses.fields(ProgressRecord) if f.name != "job_id"},
    scheduler_class=(WorkerState | None, None),  # the watcher's view: ROLLING_OUT, STRAGGLER, IDLE, ...
)


# A draft version a worker's swap guard rolled back (the CollapseEvent it recorded), built from the
# message type as WorkerOut is
_COLLAPSE_HINTS = typing.get_type_hints(CollapseEvent)
CollapseOut = create_model(
    "CollapseOut", **{f.name: (_COLLAPSE_HINTS[f.name], f.default if f.default is not dataclasses.MISSING else ...)
                      for f in dataclasses.fields(CollapseEvent)})


class PublishDecision(BaseModel):
    """One round: the copies merged into a candidate, how it and the serving draft scored on the
    scorer's recent rollouts, and whether it was published (or why not)."""

    round_id: str | None = None
    candidate: int | None = None  # the merged version in the copies store (None: never merged)
    merged: list[int]
    dropped: list[int] = []  # copies that could not be averaged with the merged ones
    parent_version: int
    evaluated_by: str
    held_out: bool  # the scorer did not train in the round: its rollouts are unseen by the copies
    at: float  # wall clock the round was asked to be scored
    candidate_accepted_length: float | None = None
    serving_accepted_length: float | None = None
    candidate_draft_temperature: float | None = None
    eval_tokens: int | None = None  # recorded pairs the scores were measured on
    published_version: int | None = None
    reason: str | None = None  # why not published


class DraftVersionOut(BaseModel):
    version: int
    parent_version: int | None
    policy_version: int
    num_steps: int
    num_tokens: int
    created_at: float
    accepted_length: float | None = None  # measured when it was published
    serving_accepted_length: float | None = None  # the draft it replaced, on the same rollouts
    draft_temperature: float | None = None  # the temperature it drafts at


class DraftsOut(BaseModel):
    job_id: str
    serving_version: int | None
    versions: list[DraftVersionOut]
    decisions: list[PublishDecision]
    reclaimed_worker_s: float
    num_leases: int
    num_published: int
    num_rejected: int
    idle_worker_s: float = 0.0  # the driver's running total over the steps (its step records have each step's)
    # rl_step -> reclaimed worker-seconds within that step's rollout (the newest 1000 steps)
    reclaimed_by_step: dict[int, float] = {}
    num_collapses: int = 0  # draft versions the workers' swap guards rolled back (acceptance collapsed)
    collapses: list[CollapseOut] = []  # the newest of them, oldest first


class HealthOut(BaseModel):
    status: str
