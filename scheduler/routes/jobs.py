"""/v1/jobs: submit, list, read and cancel jobs; a job's step records and worker events. The token: create_app."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Response, status

from scheduler.budget import budget_errors
from scheduler.deps import AppSettings, Job, Launch, Redis, Store
from scheduler.http_errors import ErrorOut, field_error
from scheduler.jobs import IdempotencyKeyError, QuotaError, token_owner
from scheduler.paths import job_roots, spec_path_errors
from scheduler.queue import job_gpus
from scheduler.schemas import EventOut, JobOut, StepOut, each_valid
from workers.progress import STREAM_ID_RULE, read_events, read_json_list
from workers.protocol.keys import ID_PATTERN, job_steps_key
from workers.protocol.messages import StepRecord
from workers.protocol.states import ACTIVE_JOB_STATES, TERMINAL_JOB_STATES, JobState
from workers.spec import JobSpec

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
MAX_JOBS_LISTED = 1000
MAX_EVENTS_READ = 100_000  # events per page: ~100 B each, and the stream keeps about EVENTS_MAXLEN anyway
MAX_STEPS_READ = 1000  # step records per page: ~700 B each (an 800-step job's were 548 KB in one answer)
QUOTA_RETRY_AFTER_S = 60  # a job of the token's ends in minutes at the least: a minute between retries is enough
MAX_STEP_INDEX = (1 << 62)  # Redis list indexes are signed 64-bit


def job_out(record: dict, num_steps: int, queue_position: int | None = None) -> JobOut:
    return JobOut(**{k: v for k, v in record.items() if k in JobOut.model_fields and k not in ("steps", "owner")},
                  steps=num_steps, queue_position=queue_position)


@router.post("", status_code=status.HTTP_201_CREATED,
             responses={200: {"model": JobOut,
                              "description": "a replay: the job an Idempotency-Key was first used for"},
                        429: {"model": ErrorOut, "description": "over the token's quota of jobs queued or running "
                              "(max_jobs_per_token); retry after Retry-After seconds. Nothing was stored"}})
def submit(spec: JobSpec, store: Store, launcher: Launch, settings: AppSettings, response: Response,
           idempotency_key: Annotated[str | None, Header(pattern=f"^{ID_PATTERN}$")] = None) -> JobOut:
    """Validate and queue a job (it starts in its turn, scheduler.queue). Paths it names must lie under the
    server's roots (scheduler.paths): checked here, before anything is stored, without opening them."""
    model_roots, data_roots = job_roots(settings.model_roots, settings.data_roots, settings.store_dir)
    errors = [(field, msg, "path_not_allowed") for field, msg in spec_path_errors(spec, model_roots, data_roots)]
    errors += [(field, msg, "over_budget") for field, msg in budget_errors(spec, settings.budget)]
    gpus, asked = launcher.cluster_gpus(), job_gpus(spec)
    if gpus is not None and asked > gpus:  # it could never be placed: QUEUED forever
        errors.append(("num_workers", f"num_workers: the job asks {asked:g} GPUs ({spec.num_workers} rollout workers "
                                      f"x gpus_per_worker {spec.gpus_per_worker:g}), more than the Ray cluster has "
                                      f"({gpus:g})", "not_placeable"))
    if errors:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            [d for field, msg, kind in errors for d in field_error(field, msg, kind)])
    try:
        record, created = store.create(spec, idempotency_key, token_owner(settings.api_token),
                                       settings.max_jobs_per_token, is_queued=True)  # in line as it is stored
    except QuotaError as exc:
        raise HTTPException(status.HTTP_429_TOO_MANY_REQUESTS, str(exc),
                            headers={"Retry-After": str(QUOTA_RETRY_AFTER_S)}) from None
    except IdempotencyKeyError as exc:  # its reason, not the key
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            field_error("idempotency-key", f"idempotency-key {exc.reason}", where="header")) from None
    job_id = record["job_id"]
    if created:
        launcher.start(record)  # the Admitter woken (or FAILED at once on a scheduler without Ray)
        record = store.get(job_id) or record
    else:
        response.status_code = status.HTTP_200_OK
    return job_out(record, 0 if created else store.num_steps([job_id])[0], store.queue_positions([job_id])[0])


@router.get("")
def list_jobs(store: Store, limit: int = 100) -> list[JobOut]:
    """The newest jobs first (at most 1000)."""
    records = store.list(max(1, min(limit, MAX_JOBS_LISTED)))
    ids = [r["job_id"] for r in records]
    return [job_out(r, n, q) for r, n, q in zip(records, store.num_steps(ids), store.queue_positions(ids))]


@router.get("/{job_id}")
def get_job(job: Job, store: Store) -> JobOut:
    return job_out(job, store.num_steps([job["job_id"]])[0], store.queue_positions([job["job_id"]])[0])


@router.post("/{job_id}/cancel")
def cancel(job: Job, store: Store, launcher: Launch) -> JobOut:  # 401 before 404: the token is checked first
    job_id = job["job_id"]
    if JobState(job["state"]) in TERMINAL_JOB_STATES:
        raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} already ended ({job['state']})")
    record = store.transition(job_id, JobState.CANCELLED, ACTIVE_JOB_STATES) or store.get(job_id)
    launcher.cancel(job_id)
    return job_out(record, store.num_steps([job_id])[0])


@router.get("/{job_id}/steps")
def steps(job: Job, redis: Redis, start: Annotated[int, Query(ge=0, le=MAX_STEP_INDEX)] = 0,
          limit: int = MAX_STEPS_READ) -> list[StepOut]:
    """One StepRecord (workers/protocol/messages.py) per finished RL step: timings by phase, per-worker rollout
    seconds, idle worker-seconds, tokens, accepted length, draft versions served, reward, failures.
    A page: `limit` records (at most MAX_STEPS_READ) from step index `start`; the next page starts at `start`
    plus the records returned (pollers fetch each record once). Validated when written, and again when read:
    a damaged record is logged and skipped."""
    job_id = job["job_id"]
    entries = read_json_list(redis, job_steps_key(job_id), start, max(1, min(limit, MAX_STEPS_READ)))
    return each_valid(entries, lambda d: StepOut(**StepRecord.from_dict(d).to_dict()), f"job {job_id} step records")


@router.get("/{job_id}/events")
def events(job: Job, redis: Redis, limit: int = 10_000, after: str | None = None) -> list[EventOut]:
    """Worker state transitions, oldest first: the per-GPU timeline, {id, worker, from, to, ts, rl_step}.
    A page of `limit` (at most MAX_EVENTS_READ): without `after` the newest, with it the first ones after that
    event id, so the last id returned continues with no gap (pollers fetch each event once). Checked on
    read; dicts typed by EventOut, not models: a page is up to 100k of them."""
    try:
        return read_events(redis, job["job_id"], count=max(1, min(limit, MAX_EVENTS_READ)), after=after)
    except ValueError:  # its message names the rule, never the value
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            field_error("after", f"after {STREAM_ID_RULE}", where="query")) from None
