"""The API's dependencies, as Annotated aliases: what a handler needs is in its signature, and no handler
reads app.state itself. The token is not one of them: create_app puts `require_token` on every /v1 router as
it mounts them (one place, so no route under /v1 can forget it; tests/scheduler/test_routes.py checks)."""

from __future__ import annotations

import hmac
from typing import Annotated

import redis as redis_lib
from fastapi import Depends, HTTPException, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry

from scheduler.jobs import JobStore
from scheduler.launcher import Launcher
from scheduler.metrics import RedisCollector
from scheduler.settings import Settings

_bearer = HTTPBearer(auto_error=False)


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _store(request: Request) -> JobStore:
    return request.app.state.store


def _redis(request: Request) -> redis_lib.Redis:
    return request.app.state.redis


def _launcher(request: Request) -> Launcher:
    return request.app.state.launcher


def _registry(request: Request) -> CollectorRegistry:
    return request.app.state.registry


def _collector(request: Request) -> RedisCollector:
    return request.app.state.collector


def token_matches(authorization: str | None, token: str) -> bool:
    """Whether an Authorization header is exactly "Bearer <token>" (the scheme in any case), compared in
    constant time and never stripped: HTTPBearer strips the credentials, which made "token\u00a0" a match.
    Starlette decodes headers as latin-1, so encoding back gives the bytes the client sent."""
    scheme, sep, given = (authorization or "").partition(" ")
    is_bearer = sep == " " and scheme.lower() == "bearer"
    return hmac.compare_digest(given.encode("latin-1", "replace"), token.encode("utf-8")) and is_bearer


def require_token(request: Request, settings: Annotated[Settings, Depends(_settings)],
                  _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    """With a token configured, every route that changes a job or reads its details needs it (docs/api.md).
    HTTPBearer stays a dependency so that the OpenAPI schema declares the scheme; the raw header decides."""
    if settings.api_token is None:
        return
    if not token_matches(request.headers.get("authorization"), settings.api_token):
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


def _job(job_id: str, store: Annotated[JobStore, Depends(_store)]) -> dict:
    """The job record the path names; 404 if there is none (or the id cannot be one)."""
    try:
        record = store.get(job_id)
    except ValueError:
        record = None
    if record is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "job not found")  # the id is the client's: not echoed
    return record


AppSettings = Annotated[Settings, Depends(_settings)]
Store = Annotated[JobStore, Depends(_store)]
Redis = Annotated[redis_lib.Redis, Depends(_redis)]
Launch = Annotated[Launcher, Depends(_launcher)]
Registry = Annotated[CollectorRegistry, Depends(_registry)]  # the app's own Prometheus registry
Collector = Annotated[RedisCollector, Depends(_collector)]  # the job and worker gauges, read from Redis per scrape
Job = Annotated[dict, Depends(_job)]  # the record of the job in the path
