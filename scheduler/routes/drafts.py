"""/v1/jobs/{id}/drafts: the served draft versions, the publish decisions and the TLT counters. The token:
create_app."""

from __future__ import annotations

from fastapi import APIRouter

from scheduler.deps import Job, Redis
from scheduler.schemas import CollapseOut, DraftsOut, DraftVersionOut, PublishDecision, each_valid
from scheduler.state import JobTLT
from workers.draft_index import DraftIndex
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

router = APIRouter(prefix="/v1/jobs", tags=["drafts"])


def _decisions(redis, job_id: str) -> list[PublishDecision]:
    return each_valid(read_json_list(redis, job_drafts_key(job_id)), PublishDecision.model_validate,
                      f"job {job_id} publish decisions")


def _collapses(redis, job_id: str) -> list[CollapseOut]:
    return each_valid(read_json_list(redis, job_collapses_key(job_id)),
                      lambda d: CollapseOut(**CollapseEvent.from_dict(d).to_dict()), f"job {job_id} collapse events")


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
    reclaimed, leases, published, rejected, requeued = redis.hmget(
        job_tlt_key(job_id), TltField.RECLAIMED_WORKER_S, TltField.NUM_LEASES, TltField.NUM_PUBLISHED,
        TltField.NUM_REJECTED, TltField.NUM_REQUEUED)
    idle, num_collapses = redis.hmget(job_totals_key(job_id), TotalsField.IDLE_WORKER_S,
                                      TotalsField.NUM_DRAFT_COLLAPSES)
    return DraftsOut(job_id=job_id, serving_version=served.latest_version(), versions=versions,
                     decisions=_decisions(redis, job_id), reclaimed_worker_s=float(reclaimed or 0.0),
                     num_leases=int(leases or 0), num_published=int(published or 0), num_rejected=int(rejected or 0),
                     num_requeued=int(requeued or 0),
                     idle_worker_s=float(idle or 0.0), reclaimed_by_step=JobTLT.read_reclaimed_by_step(redis, job_id),
                     num_collapses=int(num_collapses or 0), collapses=_collapses(redis, job_id))
