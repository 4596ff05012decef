"""/v1/jobs/{id}/workers: every live worker's latest progress and the watcher's class for it. The token:
create_app."""

from __future__ import annotations

import json

from fastapi import APIRouter, Response

from scheduler.deps import Job, Redis
from scheduler.schemas import WorkerOut
from scheduler.state import read_classes
from workers.progress import read_progress
from workers.protocol.keys import (
    TltField,
    job_tlt_key,
)

router = APIRouter(prefix="/v1/jobs", tags=["workers"])


@router.get("/{job_id}/workers", response_model=list[WorkerOut])
def workers(job: Job, redis: Redis) -> Response:
    """Serialized here, in WorkerOut's shape, not through it: the records are validated on read, and
    256 response models per status-page refresh were most of this route's cost (bench observability)."""
    job_id = job["job_id"]
    classes = read_classes(redis.hget(job_tlt_key(job_id), TltField.CLASSES))
    body = [{k: v for k, v in r.to_dict().items() if k != "job_id"} | {"scheduler_class": classes.get(r.worker_id)}
            for r in read_progress(redis, job_id)]
    return Response(json.dumps(body, allow_nan=False), media_type="application/json")
