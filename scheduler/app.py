"""The scheduler's REST API: `create_app(settings)`; connections open in the lifespan, not at import."""

from __future__ import annotations

import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated

import ray
import redis as redis_lib
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request, status
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel

from scheduler.jobs import TERMINAL, JobSpec, JobState, JobStore
from scheduler.metrics import RedisCollector
from workers.driver import JobConfig, JobDriver
from workers.grpo import GRPOConfig
from workers.protocol import connect, read_progress
from workers.rollout import WorkerConfig

log = logging.getLogger(__name__)


@dataclass
class Settings:
    redis_url: str
    api_token: str | None = None  # when set, mutating routes need "Authorization: Bearer <token>"
    store_dir: str = "/tmp/tlt-drafts"
    ray_num_gpus: int = 4  # logical GPUs declared when this process starts a local Ray
    start_ray: bool = True


class JobOut(BaseModel):
    job_id: str
    state: JobState
    spec: dict
    created_at: float
    updated_at: float
    error: str | None = None
    steps: int = 0


class WorkerOut(BaseModel):
    worker_id: str
    state: str
    num_running: int
    num_finished: int
    num_total: int
    num_tokens: int
    tokens_per_s: float
    mean_accepted_length: float
    draft_version: int
    policy_version: int
    rl_step: int
    timestamp: float


class Launcher:
    """Runs each job's driver on Ray from a thread, and records how it ended."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self.store, self.settings = store, settings
        self.drivers: dict[str, object] = {}

    def start(self, record: dict) -> None:
        threading.Thread(target=self._run, args=(record,), daemon=True, name=f"job-{record['job_id']}").start()

    def _run(self, record: dict) -> None:
        job_id, spec = record["job_id"], JobSpec(**record["spec"])
        if self.store.transition(job_id, JobState.RUNNING, {JobState.PENDING}) is None:
            return  # cancelled before it started
        cfg = JobConfig(job_id=job_id, model=spec.model, task=spec.task, dataset_path=spec.dataset_path,
                        reward=spec.reward, num_steps=spec.num_steps, num_prompts_per_step=spec.num_prompts_per_step,
                        max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, num_workers=spec.num_gpus,
                        seed=spec.seed, store_dir=f"{self.settings.store_dir}/{job_id}",
                        worker=WorkerConfig(model=spec.model, k=spec.draft_k, tlt=spec.tlt),
                        grpo=GRPOConfig(group_size=spec.group_size, lr=spec.lr, clip_eps=spec.clip_eps,
                                        kl_coef=spec.kl_coef))
        driver = None
        try:  # the job boundary: anything that goes wrong is recorded on the job
            driver = JobDriver.options(name=f"tlt-driver-{job_id}", lifetime="detached").remote(
                cfg, self.settings.redis_url)
            self.drivers[job_id] = driver
            steps = ray.get(driver.run.remote())
            self.store.transition(job_id, JobState.SUCCEEDED, {JobState.RUNNING}, steps=len(steps))
        except SystemExit:  # Ray is shutting down under this scheduler: leave the detached driver running
            driver = None
            return
        except Exception as exc:
            log.exception("job %s failed", job_id)
            error = f"{type(exc).__name__}: {exc}"[:2000]
            self.store.transition(job_id, JobState.FAILED, {JobState.RUNNING}, error=error)
        finally:
            self.drivers.pop(job_id, None)
            if driver is not None and ray.is_initialized():
                try:
                    ray.kill(driver)  # a finished or failed job's driver (and its workers) go away
                except Exception:
                    log.warning("job %s: could not kill its driver", job_id)

    def cancel(self, job_id: str) -> None:
        driver = self.drivers.get(job_id)
        if driver is not None:
            ray.kill(driver)


_bearer = HTTPBearer(auto_error=False)


def _store(request: Request) -> JobStore:
    return request.app.state.store


def _require_token(request: Request,
                   creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
    token = request.app.state.settings.api_token
    if token is None:
        return
    if creds is None or creds.credentials != token:
        raise HTTPException(status.HTTP_401_UNAUTHORIZED, "missing or wrong bearer token",
                            headers={"WWW-Authenticate": "Bearer"})


Store = Annotated[JobStore, Depends(_store)]
Auth = Annotated[None, Depends(_require_token)]


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.redis = connect(settings.redis_url)
        if settings.start_ray and not ray.is_initialized():
            ray.init(num_gpus=settings.ray_num_gpus, include_dashboard=False, log_to_driver=False)
        app.state.store = JobStore(app.state.redis)
        app.state.registry = CollectorRegistry()
        app.state.registry.register(RedisCollector(app.state.store))
        app.state.launcher = Launcher(app.state.store, settings)
        yield
        app.state.redis.close()

    app = FastAPI(title="tlt-scheduler", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings
    jobs = APIRouter(prefix="/v1/jobs", tags=["jobs"])

    def found(s: JobStore, job_id: str) -> dict:
        try:
            record = s.get(job_id)
        except ValueError:
            record = None
        if record is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"job {job_id!r} not found")
        return record

    @jobs.post("", status_code=status.HTTP_201_CREATED, response_model=JobOut)
    def submit(spec: JobSpec, s: Store, _: Auth, request: Request,
               idempotency_key: Annotated[str | None, Header()] = None) -> JobOut:
        try:
            record, created = s.create(spec, idempotency_key)
        except ValueError as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, f"idempotency-key: {exc}") from None
        if created:
            request.app.state.launcher.start(record)
        return JobOut(**record)

    @jobs.get("", response_model=list[JobOut])
    def list_jobs(s: Store, limit: int = 100) -> list[JobOut]:
        return [JobOut(**r) for r in s.list(max(1, min(limit, 1000)))]

    @jobs.get("/{job_id}", response_model=JobOut)
    def get_job(job_id: str, s: Store) -> JobOut:
        return JobOut(**found(s, job_id))

    @jobs.post("/{job_id}/cancel", response_model=JobOut)
    def cancel(job_id: str, s: Store, _: Auth, request: Request) -> JobOut:
        record = found(s, job_id)
        if JobState(record["state"]) in TERMINAL:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} already ended ({record['state']})")
        record = s.transition(job_id, JobState.CANCELLED, {JobState.PENDING, JobState.RUNNING}) or found(s, job_id)
        request.app.state.launcher.cancel(job_id)
        return JobOut(**record)

    @jobs.get("/{job_id}/workers", response_model=list[WorkerOut])
    def workers(job_id: str, s: Store, request: Request) -> list[WorkerOut]:
        found(s, job_id)
        return [WorkerOut(**{**r.__dict__, "state": r.state.value})
                for r in read_progress(request.app.state.redis, job_id)]

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(generate_latest(request.app.state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz(request: Request) -> dict:
        problems = []
        try:
            request.app.state.redis.ping()
        except redis_lib.RedisError as exc:
            problems.append(f"redis: {exc}")
        if not ray.is_initialized():
            problems.append("ray: not initialised")
        if problems:
            raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, "; ".join(problems))
        return {"status": "ready"}

    app.include_router(jobs)
    return app
