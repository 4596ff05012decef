"""The Ray actor that runs one job: its driver (the RL loop, workers.driver.Driver), which records how the run
ended. Torch-free at import: the scheduler starts drivers without loading torch; workers.driver is imported inside
the actor. A driver is found by name in RAY_NAMESPACE (protocol.keys.driver_actor_name). Its rollout workers are
workers.actors.RolloutWorker, which the driver starts.
"""

from __future__ import annotations

import logging
import threading
import time

import ray

from workers.errors import job_error, where_in_job
from workers.protocol.client import connect
from workers.protocol.keys import RAY_NAMESPACE, check_id, driver_actor_name, job_phase_key, job_result_key
from workers.protocol.messages import JobResult, PhaseRecord
from workers.protocol.states import Phase
from workers.spec import JobSpec

log = logging.getLogger(__name__)


def write_end(redis, job_id: str, result: JobResult) -> None:
    """The run's one JobResult, and phase DONE, in one MULTI/EXEC."""
    with redis.pipeline(transaction=True) as pipe:
        pipe.set(job_phase_key(job_id), PhaseRecord(Phase.DONE, result.steps, result.finished_at).to_json())
        pipe.set(job_result_key(job_id), result.to_json())
        pipe.execute()


def ensure_record(driver) -> None:
    """The job's record written back if Redis lost it (workers.job_records), before its end is written; a failure
    here is logged, and the end is written all the same."""
    try:
        driver.records.ensure(driver.rl_step or 0)
    except Exception:  # the job boundary: whatever it is, the JobResult still goes out
        log.exception("job %s: could not write its record back", driver.job_id)


@ray.remote(num_cpus=0)
class JobDriver:
    """Runs one job's GRPO steps (workers.driver.Driver). Start it with `start_driver`; `run` builds the
    driver (model, workers) and runs every step, so whatever fails, setup included, ends in the JobResult
    that `run` writes to job_result_key before it returns (or raises)."""

    def __init__(self, job_id: str, spec: JobSpec, redis_url: str, store_dir: str, placement_group=None) -> None:
        self.job_id = check_id("job_id", job_id)  # every key of the job is built from it
        self.spec, self.redis_url, self.store_dir = spec, redis_url, store_dir
        self.placement_group = placement_group  # the job's rollout GPUs (scheduler.queue), None outside the queue
        self._result: dict | None = None
        self._finished = threading.Event()
        self._lock = threading.Lock()
        self._is_started = False
        self._driver = None  # kept: its worker handles keep the workers alive until this actor ends

    def run(self) -> dict:
        """Every RL step; returns the JobResult dict (raises the error on failure, after recording it)."""
        with self._lock:
            if self._is_started:
                raise RuntimeError(f"job {self.job_id}: run was already called")
            self._is_started = True
        redis = connect(self.redis_url, patient=True)  # a Redis that blinks mid-job must not end the job
        driver, result = None, None
        try:
            from workers.driver import Driver  # torch, here only

            driver = self._driver = Driver(self.job_id, self.spec, redis, self.redis_url, self.store_dir,
                                           placement_group=self.placement_group)
            driver.run()
            ensure_record(driver)  # so that its warning says so if Redis came back empty since the last phase
            result = JobResult(ok=True, steps=driver.num_steps_done, finished_at=time.time(),
                               warning=driver.degraded_summary())
            return result.to_dict()
        except BaseException as exc:
            where = "start" if driver is None or driver.rl_step is None else where_in_job(
                driver.rl_step, driver.phase, getattr(exc, "workers", ()))
            log.exception("job %s failed at %s", self.job_id, where)
            result = JobResult(ok=False, steps=driver.num_steps_done if driver else 0, finished_at=time.time(),
                               error=job_error(exc, where))
            raise
        finally:
            try:
                if driver is not None:  # a Redis emptied since its last phase: the launcher settles from the record
                    ensure_record(driver)
                write_end(redis, self.job_id, result)
            finally:
                self._result = result.to_dict()
                self._finished.set()

    def learner_device(self) -> str | None:
        """Where the job's policy and GRPO learner are (JobSpec.device resolved here); None before they load."""
        return str(self._driver.device) if self._driver is not None else None

    def wait(self, timeout_s: float | None = None) -> dict | None:
        """The JobResult dict once `run` has ended (a restarted scheduler reattaches with this), or None
        if it is still running after timeout_s."""
        return self._result if self._finished.wait(timeout_s) else None


def start_driver(job_id: str, spec: JobSpec, redis_url: str, store_dir: str, is_detached: bool = True,
                 placement_group=None):
    """A job's driver as a named actor in RAY_NAMESPACE; detached, it outlives the process that started it.
    `store_dir` is the root of every job's draft stores (the job's own are under store_dir/job_id);
    `placement_group` holds its rollout workers' GPUs (the scheduler's queue placed it); the driver itself asks
    for no resource and runs outside it. The typed spec goes as it is (Ray pickles it to the job's own actor)."""
    options = {"name": driver_actor_name(job_id), "namespace": RAY_NAMESPACE, "max_concurrency": 4}
    if is_detached:
        options["lifetime"] = "detached"
    return JobDriver.options(**options).remote(job_id, spec, redis_url, store_dir, placement_group)
