"""The REST API's output models (the input model is workers.spec.JobSpec) and the publish decision
record the watcher writes to job_drafts_key and GET /v1/jobs/{id}/drafts returns."""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, create_model
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only from Python 3.12

from workers.protocol.messages import CollapseEvent, ProgressRecord, StepRecord
from workers.protocol.states import JobState, WorkerState

log = logging.getLogger(__name__)
T = TypeVar("T")


class Out(BaseModel):
    """Base of the output models: a field with a default is still in every answer, and the schema says so."""

    model_config = ConfigDict(json_schema_serialization_defaults_required=True)


class JobOut(Out):
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


def _fields_of(message: type, *, exclude: tuple[str, ...] = ()) -> dict:
    """A message dataclass's fields as pydantic field definitions (type, default): an output model built
    from the message type cannot drift apart from it."""
    hints = typing.get_type_hints(message)

    def default(f: dataclasses.Field):
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return ... if f.default is dataclasses.MISSING else f.default

    return {f.name: (hints[f.name], default(f)) for f in dataclasses.fields(message) if f.name not in exclude}


# A worker's latest ProgressRecord (every field but job_id) and the watcher's class for it
WorkerOut = create_model(
    "WorkerOut", __base__=Out, **_fields_of(ProgressRecord, exclude=("job_id",)),
    scheduler_class=(WorkerState | None, None),  # the watcher's view: ROLLING_OUT, STRAGGLER, IDLE, ...
)

# A draft version a worker's swap guard rolled back (the CollapseEvent it recorded)
CollapseOut = create_model("CollapseOut", __base__=Out, **_fields_of(CollapseEvent))

# One finished RL step (the StepRecord the driver appended)
StepOut = create_model("StepOut", __base__=Out, **_fields_of(StepRecord))

# One worker state transition (workers.progress.read_events). A TypedDict, not a model: its key "from" is a
# Python keyword, and a page of 100,000 is checked and written in ~0.15 s this way, ~0.4 s as models.
EventOut = TypedDict("EventOut", {
    "id": str,  # the Redis stream id: pass the last one as `after` to read on
    "worker": str,
    "from": Literal[("", *(s.value for s in WorkerState))],  # the state before ("" for a worker's first report)
    "to": Literal[tuple(s.value for s in WorkerState)],  # the state entered (a Literal: 3x faster than the Enum)
    "ts": float,  # wall clock of the transition
    "rl_step": int,
})


class PublishDecision(Out):
    """One round: the copies merged into a candidate, how it and the serving draft scored on the
    scorer's recent rollouts, and whether it was published (or why not)."""

    round_id: str | None = None
    candidate: int | None = None  # the merged version in the copies store (None: never merged)
    merged: list[int]
    dropped: list[int] = []  # copies that could not be averaged with the merged ones
    parent_version: int
    evaluated_by: str
    held_out: bool  # the scorer's recent rollouts are unseen by the copies (choose_scorer names no other scorer)
    at: float  # wall clock the round was asked to be scored
    candidate_accepted_length: float | None = None
    serving_accepted_length: float | None = None
    candidate_draft_temperature: float | None = None
    eval_tokens: int | None = None  # recorded pairs the scores were measured on
    published_version: int | None = None
    reason: str | None = None  # why not published


class DraftVersionOut(Out):
    version: int
    parent_version: int | None
    policy_version: int
    num_steps: int
    num_tokens: int
    created_at: float
    accepted_length: float | None = None  # measured when it was published
    serving_accepted_length: float | None = None  # the draft it replaced, on the same rollouts
    draft_temperature: float | None = None  # the temperature it drafts at


class DraftsOut(Out):
    job_id: str
    serving_version: int | None
    versions: list[DraftVersionOut]
    decisions: list[PublishDecision]
    reclaimed_worker_s: float
    num_leases: int
    num_published: int
    num_rejected: int
    num_requeued: int = 0  # rounds whose scoring the scorer's own rollouts stopped: scored again, not decided
    idle_worker_s: float = 0.0  # the driver's running total over the steps (its step records have each step's)
    # rl_step -> reclaimed worker-seconds within that step's rollout (the newest 1000 steps)
    reclaimed_by_step: dict[int, float] = {}
    num_collapses: int = 0  # draft versions the workers' swap guards rolled back (acceptance collapsed)
    collapses: list[CollapseOut] = []  # the newest of them, oldest first


class HealthOut(Out):
    status: str


def each_valid(entries: Iterable[Any], parse: Callable[[Any], T], where: str) -> list[T]:
    """`parse` of each entry read back from Redis; one it refuses (a ProtocolError or a pydantic ValidationError:
    both ValueErrors) is logged with `where` and skipped, so one damaged record never turns an answer into a 500."""
    out = []
    for entry in entries:
        try:
            out.append(parse(entry))
        except ValueError as exc:
            log.error("%s: skipping a malformed entry: %s", where,
                      exc.errors()[0] if isinstance(exc, ValidationError) else exc)
    return out
