"""Rollout worker: one engine on one GPU, the rollouts it generates, and the drafter work it does while
idle. `RolloutRunner` is the plain-Python worker (testable without Ray); workers.actors.RolloutWorker
is the Ray actor around it.

Its parts, by concern:
    engine    the RolloutEngine it drives (workers.engine; JobSpec.engine picks it, the built-in one by default)
    policy    the learner-side policy module the drafter trains and is scored against
    buffer    (token, policy hidden state) pairs for drafter training: harvested by the engine, or, where it
              cannot (RolloutEngine.harvests_pairs), sent by the learner (workers.learner_pairs)
    stores    the job's served and copies draft stores
    status    its state and rollout counters, reported to Redis (workers.status)
    swapper   hot swap of published draft versions (workers.swap)
    leases    drafter-training leases (workers.leases)
    scorer    merging and scoring copies, publishing candidates (workers.scoring)
"""

from __future__ import annotations

import logging
import time

import redis as redis_lib
import torch

from drafter.model.config import NUM_AUX_LAYERS
from drafter.model.loading import LoadedModel, load_model
from drafter.train.buffer import RolloutBuffer
from workers.device import job_device, policy_dtype
from workers.engine import RolloutEngine, as_tensors
from workers.engines import Speculation, engine_class
from workers.learner_pairs import add_pairs
from workers.leases import LeaseRunner
from workers.policy_sync import is_sync_message, read_policy_file
from workers.protocol.states import WorkerState
from workers.scoring import Scorer
from workers.spec import JobSpec
from workers.status import WorkerStatus
from workers.step_data import assign
from workers.store import job_stores
from workers.swap import Swapper

log = logging.getLogger(__name__)
NUM_THREADS = 1  # torch threads per worker: several workers share a CPU box, each pinned to its own cores
# how long arriving rollouts wait for a lease's trainer or a round's scoring to stop (within a micro-step or a batch:
# about a second on a CPU, less on a GPU); past it they start anyway
ROLLOUT_PREEMPT_WAIT_S = 3.0
BUFFER_BYTES = 256 << 20  # harvested pairs kept per worker: ~2 steps of SmolLM2 rollouts in bf16
BUFFER_DTYPE = torch.bfloat16  # the features' dtype in the buffer: half float32's bytes, what the trainer reads
# the prompt tokens a worker's engine is prepared for, beside JobSpec.max_new_tokens (RolloutEngine.warm_up): a
# longer prompt only costs its batch a larger cache (and, on a GPU, captures again)
WARM_PROMPT_TOKENS = 256


def build_engine(spec: JobSpec, loaded: LoadedModel, num_threads: int) -> RolloutEngine:
    """The RolloutEngine JobSpec.engine names (workers.engines.ENGINES, its class imported only when chosen),
    serving `loaded` (the worker's own policy copy, shared with it); ValueError if it cannot run here."""
    return engine_class(spec.engine).build(loaded, spec, num_threads)


class RolloutRunner:
    """One worker's state and work; every public method is safe to call from another thread."""

    def __init__(self, job_id: str, worker_id: str, spec: JobSpec, redis: redis_lib.Redis, store_dir: str,
                 num_threads: int = NUM_THREADS, buffer_bytes: int = BUFFER_BYTES,
                 harvest_in_engine: bool = True) -> None:
        """harvest_in_engine=False: take the training pairs from the learner even where the engine could harvest
        them (tests and benchmarks of the learner's path on the built-in engine)."""
        self.job_id, self.worker_id, self.spec = job_id, worker_id, spec
        torch.set_num_threads(num_threads)
        self.device = job_device(spec.device)  # its GPU under Ray (num_gpus), where the engine and leases run
        # the policy copy it serves, in JobSpec.policy_dtype (the driver's learner keeps float32)
        loaded = load_model(spec.model, dtype=policy_dtype(spec.policy_dtype, self.device, spec.coupled_sampling),
                            device=self.device)
        self.policy = loaded.model
        self.engine = build_engine(spec, loaded, num_threads)
        self.harvests = harvest_in_engine and self.engine.harvests_pairs
        self.buffer = RolloutBuffer(max_bytes=buffer_bytes, hidden_dtype=BUFFER_DTYPE)
        self.served, self.copies = job_stores(redis, store_dir, job_id)
        self.status = WorkerStatus(redis, job_id, worker_id, self._facts)
        self.swapper = Swapper(self.engine, self.served, self.status, spec)
        self.leases = LeaseRunner(spec, redis, self.policy, self.buffer, self.served, self.copies, self.status)
        self.scorer = Scorer(spec, redis, self.policy, self.buffer, self.served, self.copies, self.status)
        self.warm_up = self._warm_up()

    def _warm_up(self) -> dict:
        """The engine prepared for the job's batches (its static cache sized; on a GPU its CUDA graphs captured)
        before the first rollout, so that no RL step pays for it: this worker's rows (its share of a step's groups, as
        workers.step_data.assign deals them) of up to WARM_PROMPT_TOKENS + max_new_tokens tokens."""
        spec = self.spec
        rows = max(len(groups) for groups in assign(spec.num_prompts_per_step, spec.num_workers)) * spec.group_size
        harvest = spec.trains_drafter and self.harvests
        try:
            params = {"temperature": spec.temperature, "coupled": spec.coupled_sampling}
            out = self.engine.warm_up(rows, WARM_PROMPT_TOKENS + spec.max_new_tokens, params, self.speculation, harvest)
        except Exception as exc:  # a speed-up only: the batches then meet their shapes as they come
            log.exception("job %s: worker %s: the engine's warm-up failed; going on without it", self.job_id,
                          self.worker_id)
            return {"seconds": 0.0, "error": f"{type(exc).__name__}: {exc}"}
        if out.get("seconds"):
            log.info("job %s: worker %s: engine warmed up for %d rows in %.1f s (%s)", self.job_id, self.worker_id,
                     rows, out["seconds"], out)
        return out

    def _facts(self) -> dict:
        """The progress record's fields that the status does not keep itself."""
        return {"draft_version": self.engine.draft_version, "buffer_tokens": self.buffer.num_tokens,
                **self.swapper.record_fields()}

    # ----- policy -------------------------------------------------------------------------
    def load_policy(self, source: dict, policy_version: int) -> None:
        """Serve a new policy version: `source` is a sync file's message (workers.policy_sync: mapped, copied onto
        the policy's device), or its state (torch tensors, or read-only numpy arrays mapped from Ray's object
        store)."""
        try:
            state = read_policy_file(source) if is_sync_message(source) else as_tensors(source)
            self.engine.load_policy(state, policy_version)
        except Exception:  # re-raised: the driver records it on the step, and the worker takes no more work
            log.exception("job %s: worker %s: loading policy v%d failed", self.job_id, self.worker_id, policy_version)
            self.status.fail()
            raise
        self.status.policy_version = policy_version

    # ----- rollouts -----------------------------------------------------------------------
    @property
    def speculation(self) -> Speculation:
        """How the next rollouts draft (workers.engine.Speculation): JobSpec.speculation with TLT on,
        else plain. Adaptive by default: the engine measures what drafting gains per live-batch bucket."""
        return self.spec.speculation if self.spec.tlt else Speculation.OFF

    @property
    def takes_learner_pairs(self) -> bool:
        """Whether its drafter-training pairs come from the learner's forward: it trains the drafter, and its
        engine does not harvest them."""
        return self.spec.trains_drafter and not self.harvests

    def add_learner_pairs(self, message: dict) -> int:
        """Add the pairs the learner recorded for this worker's rollouts (workers.learner_pairs.LearnerPairs's
        message); returns how many. ValueError if it takes its pairs from its engine (they would count twice)."""
        if not self.takes_learner_pairs:
            raise ValueError(f"worker {self.worker_id} takes no training pairs from the learner")
        num_pairs = add_pairs(self.buffer, message, (NUM_AUX_LAYERS + 1) * self.policy.cfg.hidden_size)
        self.status.report(force=True)  # buffer_tokens: what the scheduler grants leases on (a heartbeat keeps it)
        return num_pairs

    def generate(self, prompts: list[list[int]], params: list[dict], rl_step: int) -> list[dict]:
        """One rollout per prompt; plain dicts (workers.engine.Completion; each one's "speculation" is the
        draft length per live-batch bucket, the step record's for this worker; "learner_pairs": whether the
        driver is to send this batch's training pairs, takes_learner_pairs). A failure of the engine
        leaves the worker FAILED (reported), and is raised."""
        if self.status.state == WorkerState.FAILED:
            raise RuntimeError(f"worker {self.worker_id} has failed: it generates no more")
        self.status.is_generating = True
        # rollouts come first: a lease still running here is preempted now, and a round's scoring (the scheduler has
        # it scored again elsewhere); waited for, within its next micro-step or batch: on a CPU that work runs at
        # idle priority (workers.pinning) and would otherwise crawl on beside the rollouts
        if self.leases.stop(wait_s=ROLLOUT_PREEMPT_WAIT_S):
            log.warning("worker %s: a drafter lease was still training when rollouts arrived; stopped it",
                        self.worker_id)
        if self.scorer.preempt(wait_s=ROLLOUT_PREEMPT_WAIT_S):
            log.warning("worker %s: a round was still being scored when rollouts arrived; stopped it", self.worker_id)
        self.status.begin_rollout(rl_step, len(prompts))
        start = time.perf_counter()

        def on_progress(num_finished: int, num_tokens: int) -> None:
            self.status.on_step(num_finished, num_tokens, time.perf_counter() - start,
                                self.engine.stats().mean_accepted_length)

        try:
            # only leases train on the buffer; an engine that does not harvest is not asked to
            harvest_into = self.buffer if self.spec.trains_drafter and self.harvests else None
            outs = self.engine.generate(prompts, params, speculation=self.speculation, harvest_into=harvest_into,
                                        on_progress=on_progress)
        except Exception:  # re-raised: the driver records it on the step, and the worker takes no more work
            log.exception("job %s: worker %s: generation failed", self.job_id, self.worker_id)
            self.status.fail()
            raise
        finally:
            self.status.is_generating = False
        self.status.flush()
        self.status.set_state(WorkerState.IDLE)
        return [{**o.to_dict(), "learner_pairs": self.takes_learner_pairs} for o in outs]

    # ----- for tests and benchmarks (the scheduler reads the progress record) ------------------
    def describe(self) -> dict:
        """The progress record, the engine's counters and the swap log."""
        stats = self.engine.stats()
        return {**self.status.record().to_dict(), "swap_seconds": stats.swap_seconds,
                "report_seconds": self.status.report_seconds, "num_draft_tokens": stats.num_draft_tokens,
                "swap_log": list(self.swapper.log), "warm_up": self.warm_up}
