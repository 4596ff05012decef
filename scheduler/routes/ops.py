"""Operations: Prometheus metrics, liveness and readiness. Open: no token (create_app mounts this router apart)."""

from __future__ import annotations

import logging

import ray
import redis as redis_lib
from fastapi import APIRouter, HTTPException, status
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST

from scheduler.deps import Collector, Redis, Registry
from scheduler.http_errors import RETRY_AFTER_S
from scheduler.metrics import exposition
from scheduler.schemas import HealthOut

router = APIRouter(tags=["ops"])
log = logging.getLogger(__name__)


@router.get("/metrics", response_class=PlainTextResponse)
def metrics(registry: Registry, collector: Collector) -> PlainTextResponse:
    """Prometheus text exposition (not JSON: no response model). No label carries a path or free text."""
    return PlainTextResponse(exposition(registry, collector), media_type=CONTENT_TYPE_LATEST)


@router.get("/healthz")
async def healthz() -> HealthOut:
    """Liveness: the process answers. No I/O, and async, so it runs on the event loop and never queues behind
    sync routes waiting on a hung Redis in the thread pool (it took 13.5 s with 120 of them, issue 34)."""
    return HealthOut(status="ok")


@router.get("/readyz")
def readyz(redis: Redis) -> HealthOut:
    """503 with Retry-After naming what is missing, in fixed words: an unauthenticated route, so the Redis
    error (its address, the exception text) goes to the log only."""
    problems = []
    try:
        redis.ping()
    except redis_lib.RedisError as exc:
        log.warning("readyz: Redis is unreachable (%s)", exc)
        problems.append("redis unavailable")
    if not ray.is_initialized():
        problems.append("ray not initialised")
    if problems:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "; ".join(problems),
                            headers={"Retry-After": str(RETRY_AFTER_S)})
    return HealthOut(status="ready")
