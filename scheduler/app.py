"""The scheduler's REST API: `create_app(settings)` assembles the routers (scheduler/routes/); Redis,
Ray, the launcher and the watcher start in the lifespan, never at import. Imports no torch."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from pathlib import Path

import ray
from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from prometheus_client import CollectorRegistry

from scheduler import http_errors
from scheduler.jobs import JobStore
from scheduler.launcher import Launcher
from scheduler.metrics import Latencies, RedisCollector
from scheduler.routes import drafts, jobs, ops, workers
from scheduler.settings import Settings
from scheduler.watcher import Watcher
from workers.protocol import RAY_NAMESPACE, connect

__all__ = ["Settings", "create_app"]
log = logging.getLogger(__name__)


def _init_ray(settings: Settings) -> None:
    if ray.is_initialized():
        return
    if settings.ray_address:
        try:
            ray.init(address=settings.ray_address, namespace=RAY_NAMESPACE, log_to_driver=False)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RuntimeError(f"cannot join the Ray cluster at {settings.ray_address!r}: {exc}") from None
    elif settings.start_ray:
        ray.init(num_gpus=settings.ray_num_gpus, namespace=RAY_NAMESPACE, include_dashboard=False,
                 log_to_driver=False)


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings: Settings = app.state.settings
    app.state.redis = connect(settings.redis_url)
    _init_ray(settings)
    app.state.store = store = JobStore(app.state.redis)
    app.state.registry = CollectorRegistry()
    app.state.collector = RedisCollector(store)
    app.state.registry.register(app.state.collector)
    # the launcher records how jobs end: its own client waits out a Redis outage instead of losing the record
    app.state.launcher = Launcher(JobStore(connect(settings.redis_url, patient=True)), settings)
    if ray.is_initialized():
        app.state.launcher.reattach()
    else:  # never let a lookup start a Ray of its own and settle live jobs as lost
        log.warning("Ray is not initialised: running jobs are not reattached, new jobs cannot start")
    app.state.watcher = watcher = Watcher(store, settings.store_dir, settings.policy, settings.watch_tick_s,
                                          Latencies(app.state.registry))
    if settings.watch:
        watcher.start()
    yield
    watcher.stop(join_s=10.0)
    app.state.redis.close()


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(title="tlt-scheduler", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    http_errors.install(app)  # 4xx naming the field, inputs never echoed, bodies size-limited
    for module in (jobs, workers, drafts):
        app.include_router(module.router, responses=http_errors.JOB_ROUTE_ERRORS)
    app.include_router(ops.router, responses=http_errors.OPS_ROUTE_ERRORS)
    # the status page: static files shipped in the package, no build step (scheduler/ui/)
    app.mount("/ui", StaticFiles(directory=Path(__file__).with_name("ui"), html=True), name="ui")
    return app
