"""The scheduler's REST API: `create_app(settings)`; connections open in the lifespan, not at import."""

from __future__ import annotations

import json
import logging
import threading
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import ray
import redis as redis_lib
from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Request, Response, status
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from pydantic import BaseModel

from drafter.config import TrainConfig
from scheduler.jobs import RAY_NAMESPACE, TERMINAL, JobSpec, JobState, JobStore, driver_name
from scheduler.metrics import RedisCollector, exposition
from scheduler.policy import PolicySettings
from scheduler.watcher import TICK_S, Metrics, Watcher, read_classes
from workers.driver import JobConfig, JobDriver
from workers.grpo import GRPOConfig
from workers.protocol import (
    connect,
    job_drafts_key,
    job_result_key,
    job_steps_key,
    job_tlt_key,
    read_events,
    read_json_list,
    read_progress,
)
from workers.rollout import WorkerConfig
from workers.store import job_stores

log = logging.getLogger(__name__)


@dataclass
class Settings:
    redis_url: str
    api_token: str | None = None  # when set, mutating routes need "Authorization: Bearer <token>"
    store_dir: str = "/tmp/tlt-drafts"
    ray_num_gpus: int = 4  # logical GPUs declared when this process starts a local Ray
    start_ray: bool = True
    ray_address: str | None = None  # join this Ray cluster ("auto", "host:port"); jobs then outlive a restart
    policy: PolicySettings = field(default_factory=PolicySettings)
    watch: bool = True  # run the long-tail watcher (grants and preempts drafter-training leases)
    watch_tick_s: float = TICK_S


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
    scheduler_class: str | None = None  # the watcher's view: ROLLING_OUT, STRAGGLER, IDLE, TRAINING, STALE


class Launcher:
    """Runs each job's driver on Ray (a detached, named actor) and records how it ended.

    A driver outlives the scheduler process: after a restart `reattach` finds every RUNNING job's
    driver by name and follows it again; a driver that ended while no scheduler was up left its
    outcome in Redis (job_result_key), and PENDING jobs that never started are started.
    """

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
                        worker=WorkerConfig(model=spec.model, k=spec.draft_k, draft_dtype=spec.draft_dtype,
                                            draft_tree=spec.draft_tree,
                                            tlt=spec.tlt, min_accepted_length=spec.min_accepted_length,
                                            train=TrainConfig(**spec.drafter.model_dump())),
                        grpo=GRPOConfig(group_size=spec.group_size, lr=spec.lr, clip_eps=spec.clip_eps,
                                        kl_coef=spec.kl_coef))
        try:
            driver = JobDriver.options(name=driver_name(job_id), lifetime="detached", max_concurrency=4).remote(
                cfg, self.settings.redis_url)
            run = driver.run.remote()
        except Exception as exc:
            log.exception("job %s could not start", job_id)
            self.store.transition(job_id, JobState.FAILED, {JobState.RUNNING}, error=f"{type(exc).__name__}: {exc}")
            return
        self._follow(job_id, driver, run)

    def _follow(self, job_id: str, driver, ref) -> None:
        """Wait for the driver's run (or, after a restart, its `wait`) and record the outcome."""
        self.drivers[job_id] = driver
        try:  # the job boundary: anything that goes wrong is recorded on the job
            outcome = ray.get(ref)
            if isinstance(outcome, list):  # run() returns its step records
                outcome = {"ok": True, "steps": len(outcome)}
            self._record(job_id, outcome)
        except SystemExit:  # Ray is shutting down under this scheduler: leave the detached driver running
            driver = None
            return
        except Exception as exc:
            log.exception("job %s failed", job_id)
            self._record(job_id, self._stored_outcome(job_id) or {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        finally:
            self.drivers.pop(job_id, None)
            if driver is not None and ray.is_initialized():
                try:
                    ray.kill(driver)  # a finished or failed job's driver (and its workers) go away
                except Exception:
                    log.warning("job %s: could not kill its driver", job_id)

    def _record(self, job_id: str, outcome: dict) -> None:
        if outcome.get("ok"):
            self.store.transition(job_id, JobState.SUCCEEDED, {JobState.RUNNING}, steps=int(outcome["steps"]))
        else:
            self.store.transition(job_id, JobState.FAILED, {JobState.RUNNING},
                                  error=str(outcome.get("error") or "unknown error")[:2000])

    def _stored_outcome(self, job_id: str) -> dict | None:
        raw = self.store.redis.get(job_result_key(job_id))
        try:
            return json.loads(raw) if raw else None
        except json.JSONDecodeError:
            log.error("job %s: unreadable result record %r", job_id, raw[:200])
            return None

    def reattach(self) -> dict[str, str]:
        """After a (re)start: follow every RUNNING job's driver again, settle those that ended while no
        scheduler was up, start the PENDING ones. Returns job id -> what was done."""
        done = {}
        for record in self.store.list(limit=100_000):
            job_id, state = record["job_id"], JobState(record["state"])
            if state == JobState.PENDING:
                self.start(record)
                done[job_id] = "started"
            elif state == JobState.RUNNING and job_id not in self.drivers:
                try:
                    driver = ray.get_actor(driver_name(job_id))
                except ValueError:  # no such actor: it ended (or died) while we were away
                    outcome = self._stored_outcome(job_id) or {
                        "ok": False, "error": "its driver is gone and left no result (did the Ray cluster restart?)"}
                    self._record(job_id, outcome)
                    done[job_id] = "settled"
                    continue
                self.drivers[job_id] = driver
                threading.Thread(target=self._follow, args=(job_id, driver, driver.wait.remote()), daemon=True,
                                 name=f"job-{job_id}").start()
                done[job_id] = "reattached"
        if done:
            log.info("reattached: %s", done)
        return done

    def cancel(self, job_id: str) -> None:
        driver = self.drivers.get(job_id)
        if driver is None:
            try:
                driver = ray.get_actor(driver_name(job_id))
            except ValueError:
                return
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
        if settings.ray_address and not ray.is_initialized():
            try:
                ray.init(address=settings.ray_address, namespace=RAY_NAMESPACE, log_to_driver=False)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise RuntimeError(f"cannot join the Ray cluster at {settings.ray_address!r}: {exc}") from None
        elif settings.start_ray and not ray.is_initialized():
            ray.init(num_gpus=settings.ray_num_gpus, namespace=RAY_NAMESPACE, include_dashboard=False,
                     log_to_driver=False)
        app.state.store = JobStore(app.state.redis)
        app.state.registry = CollectorRegistry()
        app.state.collector = RedisCollector(app.state.store)
        app.state.registry.register(app.state.collector)
        app.state.launcher = Launcher(app.state.store, settings)
        if ray.is_initialized():
            app.state.launcher.reattach()
        else:  # never let a lookup start a Ray of its own and settle live jobs as lost
            log.warning("Ray is not initialised: running jobs are not reattached, new jobs cannot start")
        watcher = Watcher(app.state.store, settings.store_dir, settings.policy, settings.watch_tick_s,
                          Metrics(app.state.registry))
        app.state.watcher = watcher
        if settings.watch:
            watcher.start()
        yield
        watcher.stop(join_s=10.0)
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
        records = s.list(max(1, min(limit, 1000)))
        with s.redis.pipeline(transaction=False) as pipe:  # steps done so far, one round trip
            for r in records:
                pipe.llen(job_steps_key(r["job_id"]))
            done = pipe.execute()
        return [JobOut(**{**r, "steps": max(r["steps"], n)}) for r, n in zip(records, done)]

    @jobs.get("/{job_id}", response_model=JobOut)
    def get_job(job_id: str, s: Store) -> JobOut:
        record = found(s, job_id)
        # steps done so far: the driver appends a record per finished step
        return JobOut(**{**record, "steps": max(record["steps"], s.redis.llen(job_steps_key(job_id)))})

    @jobs.post("/{job_id}/cancel", response_model=JobOut)
    def cancel(job_id: str, s: Store, _: Auth, request: Request) -> JobOut:
        record = found(s, job_id)
        if JobState(record["state"]) in TERMINAL:
            raise HTTPException(status.HTTP_409_CONFLICT, f"job {job_id} already ended ({record['state']})")
        record = s.transition(job_id, JobState.CANCELLED, {JobState.PENDING, JobState.RUNNING}) or found(s, job_id)
        request.app.state.launcher.cancel(job_id)
        return JobOut(**record)

    @jobs.get("/{job_id}/workers", response_model=list[WorkerOut])
    def workers(job_id: str, s: Store, request: Request) -> Response:
        """Every live worker's latest progress record and the watcher's class for it. Serialized
        here, not through WorkerOut (the documented shape): the records are validated on read, and
        256 response models per status-page refresh were most of this route's cost."""
        found(s, job_id)
        redis = request.app.state.redis
        classes = read_classes(redis.hget(job_tlt_key(job_id), "classes"))
        body = [r.__dict__ | {"state": r.state.value, "scheduler_class": classes.get(r.worker_id)}
                for r in read_progress(redis, job_id)]
        return Response(json.dumps(body, allow_nan=False), media_type="application/json")

    @jobs.get("/{job_id}/steps")
    def steps(job_id: str, s: Store, start: int = 0) -> list[dict]:
        """One record per finished RL step: timings by phase, per-worker rollout seconds, idle
        worker-seconds, tokens, accepted length, draft versions served, reward, failures. `start`:
        from that step index on (pollers fetch each record once)."""
        found(s, job_id)
        return read_json_list(s.redis, job_steps_key(job_id), start)

    @jobs.get("/{job_id}/events")
    def events(job_id: str, s: Store, limit: int = 10_000, after: str | None = None) -> list[dict]:
        """Worker state transitions, oldest first (the newest `limit`, at most 100000): the per-GPU
        timeline. `after`: only those after that event id (pollers fetch each event once)."""
        found(s, job_id)
        try:
            return read_events(s.redis, job_id, count=max(1, min(limit, 100_000)), after=after)
        except ValueError as exc:
            raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, str(exc)) from None

    @jobs.get("/{job_id}/drafts")
    def drafts(job_id: str, s: Store, request: Request) -> dict:
        """Served draft versions (parent, policy version, acceptance when published), every publish
        decision with the accepted lengths it compared, and the job's TLT counters."""
        found(s, job_id)
        redis = request.app.state.redis
        served, _ = job_stores(redis, f"{settings.store_dir}/{job_id}", job_id)
        versions = [{"version": e["version"], "parent_version": e["parent_version"],
                     "policy_version": e["policy_version"], "num_steps": e["num_steps"], "num_tokens": e["num_tokens"],
                     "created_at": e["created_at"], "accepted_length": e["extra"].get("accepted_length"),
                     "serving_accepted_length": e["extra"].get("serving_accepted_length"),
                     "draft_temperature": e["extra"].get("draft_temperature")}
                    for e in served.versions()]
        reclaimed, leases, published, rejected = redis.hmget(
            job_tlt_key(job_id), "reclaimed_worker_s", "num_leases", "num_published", "num_rejected")
        return {"job_id": job_id, "serving_version": served.latest_version(), "versions": versions,
                "decisions": read_json_list(redis, job_drafts_key(job_id)),
                "reclaimed_worker_s": float(reclaimed or 0.0), "num_leases": int(leases or 0),
                "num_published": int(published or 0), "num_rejected": int(rejected or 0)}

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics(request: Request) -> PlainTextResponse:
        return PlainTextResponse(exposition(request.app.state.registry, request.app.state.collector),
                                 media_type=CONTENT_TYPE_LATEST)

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
    # the status page: static files shipped in the package, no build step (scheduler/ui/)
    app.mount("/ui", StaticFiles(directory=Path(__file__).with_name("ui"), html=True), name="ui")
    return app
