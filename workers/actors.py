"""The Ray actors of a job's rollout workers (one per GPU); its driver's actor is workers.job_actor.JobDriver.

Torch-free at import: the scheduler sends workers commands without loading torch; the torch-using
implementation (workers.rollout) is imported inside the actor. Found by name in RAY_NAMESPACE
(protocol.keys.worker_actor_name).

Worker commands return quickly; the work they start runs in the background and reports in Redis:
    start_lease(offer)            LeaseOutcome in job_leases_key: RUNNING now, DONE or FAILED at its end
    stop_training(wait_s)         whether a lease was training (it stops within one micro-step)
    score_round(request)          ScoringResult in job_scoring_key (with `error` if it could not score)
    publish_candidate(candidate, draft_temperature, extra)  the served version it became
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.pinning import pin_process, place_worker, run_at_idle_priority, usable_cores
from workers.protocol.client import connect
from workers.protocol.keys import (
    RAY_NAMESPACE,
    worker_actor_name,
)
from workers.spec import JobSpec

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0)
class RolloutWorker:
    """Ray actor around workers.rollout.RolloutRunner. Async: blocking work runs in threads, so commands
    answer while it generates, trains or scores."""

    def __init__(self, job_id: str, worker_id: str, spec: JobSpec, redis_url: str, store_dir: str,
                 index: int = 0, **runtime) -> None:
        from workers.rollout import RolloutRunner  # torch, here only

        self.placement = self._place(worker_id, index, spec)
        if self.placement is not None:
            runtime.setdefault("num_threads", self.placement.num_threads)
        self.runner = RolloutRunner(job_id, worker_id, spec, connect(redis_url), store_dir, **runtime)
        self.runner.swapper.start()
        self._tasks: set[asyncio.Task] = set()  # background leases and scoring (kept referenced until done)

    @staticmethod
    def _place(worker_id: str, index: int, spec: JobSpec):
        """On CPU, pin this process to worker `index`'s cores (workers.pinning); on GPU, nothing (its own GPU, or
        its share of one: JobSpec.gpus_per_worker). ValueError if the job's device cannot be had here."""
        from workers.device import job_device

        if job_device(spec.device).type != "cpu":
            return None
        num_workers = spec.num_workers
        placement = place_worker(index, num_workers, usable_cores())
        if placement.is_dedicated:
            pin_process(placement.cores)
            log.info("worker %s: pinned to cores %s, %d threads", worker_id, placement.cores, placement.num_threads)
        else:
            log.warning("worker %s: %d workers on %d cores: sharing them, %d threads each", worker_id, num_workers,
                        len(placement.cores), placement.num_threads)
        return placement

    def _background(self, fn, *args) -> None:
        """Idle-time work (a lease, a round's scoring); on a CPU at idle priority (workers.pinning)."""
        if self.placement is not None:
            fn, args = run_at_idle_priority, (fn, *args)
        task = asyncio.get_running_loop().create_task(asyncio.to_thread(fn, *args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- the driver's calls ------------------------------------------------------------------
    async def load_policy(self, source, policy_version: int) -> None:
        """A new policy version: a sync file's message (a worker on the driver's node), or the weights as arrays
        from Ray's object store (another node's); workers.policy_sync."""
        await asyncio.to_thread(self.runner.load_policy, source, policy_version)

    async def node_id(self) -> str:
        """The Ray node this worker runs on: on the driver's, it loads new policy versions from a file there."""
        return ray.get_runtime_context().get_node_id()

    async def generate(self, prompts: list[list[int]], params: list[dict], rl_step: int) -> list[dict]:
        return await asyncio.to_thread(self.runner.generate, prompts, params, rl_step)

    async def add_learner_pairs(self, message: dict) -> int:
        """The training pairs the learner recorded for this worker's rollouts (numpy arrays, mapped from Ray's
        object store; workers.learner_pairs), for an engine that does not harvest them."""
        return await asyncio.to_thread(self.runner.add_learner_pairs, message)

    # ----- the scheduler's commands -------------------------------------------------------------
    async def start_lease(self, offer: dict) -> None:
        """Accept a LeaseOffer and train in the background. ValueError naming the field if it is
        malformed, or saying why this worker cannot take it (it holds a lease, or it failed)."""
        lease = self.runner.leases.accept(offer)
        self._background(self.runner.leases.run, lease)

    async def stop_training(self, wait_s: float = 0.0) -> bool:
        return await asyncio.to_thread(self.runner.leases.stop, wait_s)

    async def score_round(self, request: dict) -> None:
        """Merge and score a ScoringRequest in the background. ValueError naming the field if it is
        malformed, or if this worker is scoring another round."""
        req = self.runner.scorer.accept(request)
        self._background(self.runner.scorer.run, req)

    async def publish_candidate(self, candidate: int, draft_temperature: float | None, extra: dict) -> int:
        return await asyncio.to_thread(self.runner.scorer.publish_candidate, candidate, draft_temperature, extra)

    # ----- tests and benchmarks -----------------------------------------------------------------
    async def describe(self) -> dict:
        """The runner's description, and where this process runs: its cores (affinity) and torch threads."""
        import os

        import torch

        return {**self.runner.describe(), "cores": sorted(os.sched_getaffinity(0)), "device": str(self.runner.device),
                "num_threads": torch.get_num_threads(),
                "is_pinned": bool(self.placement and self.placement.is_dedicated)}

    async def set_reporting(self, is_reporting: bool) -> None:
        self.runner.status.is_reporting = is_reporting


def start_worker(job_id: str, worker_id: str, spec: JobSpec, redis_url: str, store_dir: str, index: int = 0,
                 placement_group=None, **runtime):
    """A job's rollout worker as a named actor (owned by the caller, the driver: it dies with it). `index`
    (0..num_workers-1) picks its cores on CPU (workers.pinning) and its bundle of `placement_group` (the job's GPUs,
    placed by the scheduler's queue; None: wherever Ray finds a GPU); `runtime`: RolloutRunner's keyword settings.
    It asks Ray for spec.gpus_per_worker of a GPU: one each by default, a share of one on small nodes and benches.
    The typed spec goes as it is (Ray pickles it between the job's own actors: its driver and its workers)."""
    placed = {} if placement_group is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(
        placement_group, placement_group_bundle_index=index)}
    return RolloutWorker.options(name=worker_actor_name(job_id, worker_id), namespace=RAY_NAMESPACE,
                                 num_gpus=spec.gpus_per_worker, num_cpus=0, **placed).remote(
        job_id, worker_id, spec, redis_url, store_dir, index, **runtime)


def get_worker(job_id: str, worker_id: str):
    """A running job's worker by name; ValueError if there is none."""
    return ray.get_actor(worker_actor_name(job_id, worker_id), namespace=RAY_NAMESPACE)
