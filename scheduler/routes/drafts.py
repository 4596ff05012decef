"""/v1/jobs/{id}/drafts: the served draft versions, the publish decisions and the TLT counters."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends
from pydantic import ValidationError

from scheduler.deps import Job, Redis, require_token
from scheduler.schemas import CollapseOut, DraftsOut, DraftVersionOut, PublishDecision
from scheduler.state import JobTLT
from workers.draft_index import DraftIndex
from workers.message import ProtocolError
from workers.progress import read_json_list
from workers.protocol.keys import (
    TltField,
    TotalsField,
    draft_namespaces,
    job_collapses_key,
    job_drafts_key,
    job_tlt_key,
    job_totals_key,
)
from workers.protocol.messages import CollapseEvent

router = APIRouter(prefix="/v1/jobs", tags=["drafts"],
                   dependencies=[Depends(require_token)])  # job details: the token when one is set
log = logging.getLogger(__name__)


def _decisions(redis, job_id: str) -> list[PublishDecision]:
    out = []
    for d in read_json_list(redis, job_drafts_key(job_id)):
        try:
            out.append(PublishDecision.model_validate(d))
        except ValidationError as exc:
            log.error("job %s: skipping a malformed publish decision: %s", job_id, exc.errors()[0])
    return out


def _collapses(redis, job_id: str) -> list[CollapseOut]:
    out = []
    for d in read_json_list(redis, job_collapses_key(job_id)):
        try:
            out.append(CollapseOut(**CollapseEvent.from_dict(d).to_dict()))
        except ProtocolError as exc:
            log.error("job %s: skipping a malformed collapse event: %s", job_id, exc)
    return out


@router.get("/{job_id}/drafts")
def drafts(job: Job, redis: Redis) -> DraftsOut:
    """Served versions (parent, policy version, acceptance when published), every publish decision
    with the accepted lengths it compared, the versions the swap guards rolled back, and the job's TLT
    counters."""
    job_id = job["job_id"]
    served = DraftIndex(redis, draft_namespaces(job_id)[0])
    versions = [DraftVersionOut(**{k: e[k] for k in DraftVersionOut.model_fields if k in e},
                                **{k: e["extra"].get(k) for k in ("accepted_length", "serving_accepted_length",
                                                                  "draft_temperature")})
                for e in served.versions()]
    reclaimed, leases, published, rejected = redis.hmget(
        job_tlt_key(job_id), TltField.RECLAIMED_WORKER_S, TltField.NUM_LEASES, TltField.NUM_PUBLISHED,
        TltField.NUM_REJECTED)
    idle, num_collapses = redis.hmget(job_totals_key(job_id), TotalsField.IDLE_WORKER_S,
                                      TotalsField.NUM_DRAFT_COLLAPSES)
    return DraftsOut(job_id=job_id, serving_version=served.latest_version(), versions=versions,
                     decisions=_decisions(redis, job_id), reclaimed_worker_s=float(reclaimed or 0.0),
                     num_leases=int(leases or 0), num_published=int(published or 0), num_rejected=int(rejected or 0),
                     idle_worker_s=float(idle or 0.0), reclaimed_by_step=JobTLT.read_reclaimed_by_step(redis, job_id),
                     num_collapses=int(num_collapses or 0), collapses=_collapses(redis, job_id))
