"""The scheduler's REST API: `create_app(settings)` assembles the routers (scheduler/routes/); Redis,
Ray, the launcher and the watcher start in the lifespan, never at import. Imports no torch."""

from __future__ import annotations

import logging
import os
import socket
from contextlib import asynccontextmanager
from pathlib import Path

import ray
from fastapi import Depends, FastAPI
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

from scheduler import http_errors
from scheduler.deps import require_token
from scheduler.jobs import JobStore
from scheduler.launcher import Launcher
from scheduler.metrics import Latencies, RedisCollector
from scheduler.routes import drafts, jobs, ops, workers
from scheduler.settings import Settings
from scheduler.watcher import Watcher
from workers.protocol.client import connect
from workers.protocol.keys import RAY_NAMESPACE

__all__ = ["Settings", "create_app"]
log = logging.getLogger(__name__)


AUTH_HINT = ("Ray token authentication: give the scheduler the cluster's token (RAY_AUTH_MODE=token and "
             "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, as the Ray nodes have)")


def join_hint(address: str, env: dict[str, str] | None = None, timeout_s: float = 2.0) -> str:
    """What a failed join of `address` most likely means. Ray says "Failed to connect" both when nothing listens
    there and when its GCS refuses this process's token; a plain TCP connect tells the two apart."""
    env = os.environ if env is None else env
    has_token = env.get("RAY_AUTH_MODE", "").lower() == "token"
    host, sep, port = address.rpartition(":")
    if address == "auto" or "://" in address or not sep or not port.isdigit():
        return f"is the cluster up at that address? If it uses {AUTH_HINT}"
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return f"nothing accepts connections at {host}:{port} ({exc.strerror or exc}): is this the head's GCS port?"
    if has_token:
        return ("a Ray GCS answers there but refused this process: is RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) the "
                "cluster's token, and is Ray the cluster's version?")
    return (f"a Ray GCS answers there but refused this process, which has no Ray token: the cluster likely uses "
            f"{AUTH_HINT}")


def init_ray(settings: Settings) -> None:
    """Join settings.ray_address, or start a private local Ray advertising settings.ray_node_ip (the address the
    API serves on: loopback by default) with no dashboard; nothing if Ray is up already."""
    if ray.is_initialized():
        return
    if settings.ray_address:
        try:
            ray.init(address=settings.ray_address, namespace=RAY_NAMESPACE, log_to_driver=False)
        except ConnectionError as exc:
            raise RuntimeError(f"cannot join the Ray cluster at {settings.ray_address!r}: {exc}; "
                               f"{join_hint(settings.ray_address)}") from None
        except (RuntimeError, ValueError) as exc:
            raise RuntimeError(f"cannot join the Ray cluster at {settings.ray_address!r}: {exc}") from None
    elif settings.start_ray:
        ray.init(num_gpus=settings.ray_num_gpus, namespace=RAY_NAMESPACE, include_dashboard=False,
                 log_to_driver=False, _node_ip_address=settings.ray_node_ip)


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings: Settings = app.state.settings
    app.state.redis = connect(settings.redis_url)
    init_ray(settings)
    app.state.store = store = JobStore(app.state.redis)
    app.state.registry = CollectorRegistry()
    app.state.collector = RedisCollector(store)
    app.state.registry.register(app.state.collector)
    # the launcher records how jobs end: its own client waits out a Redis outage instead of losing the record
    app.state.launcher = Launcher(JobStore(connect(settings.redis_url, patient=True)), settings, reader=store)
    if ray.is_initialized():
        app.state.launcher.reattach()
    else:  # never let a lookup start a Ray of its own and settle live jobs as lost
        log.warning("Ray is not initialised: running jobs are not reattached, new jobs cannot start")
    app.state.watcher = watcher = Watcher(store, settings.store_dir, settings.policy, settings.watch_tick_s,
                                          Latencies(app.state.registry))
    if settings.watch:
        watcher.start()
    yield
    app.state.launcher.stop()  # before Ray goes: a driver call failing now is no job's end
    watcher.stop(join_s=10.0)
    app.state.redis.close()


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="tlt-scheduler", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    http_errors.install(app)  # 4xx naming the field, inputs never echoed, bodies size-limited
    # the auth rule, in one place: /v1/jobs and everything under it needs the token when one is set (it is
    # checked before anything else, so an unknown job id gets the 401 too); metrics and health stay open
    for module in (jobs, workers, drafts):
        app.include_router(module.router, dependencies=[Depends(require_token)],
                           responses=http_errors.JOB_ROUTE_ERRORS)
    app.include_router(ops.router, responses=http_errors.OPS_ROUTE_ERRORS)
    # the status page: static files shipped in the package, no build step (scheduler/ui/)
    app.mount("/ui", StaticFiles(directory=Path(__file__).with_name("ui"), html=True), name="ui")
    return app
