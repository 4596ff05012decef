"""Drafter-training leases: an idle worker trains a copy of a draft version on its own harvested
rollouts until the lease's deadline or a stop, and publishes the copy to the job's copies store.

The worker writes each lease's LeaseOutcome to job_leases_key: RUNNING when it accepts the offer,
DONE (with the copy's version) or FAILED when it ends, with `started_at` (accepted) and `ended_at`
(the trainer stopped) on the wall clock: the scheduler counts the part within the rollout as
reclaimed. It keeps at most MAX_LEASE_OUTCOMES of its own outcomes there (the oldest go first), so
the hash stays bounded however long the job runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import redis as redis_lib
import torch

from drafter.draft.head import EagleHead, head_config, new_head
from drafter.model.causal_lm import CausalLM
from drafter.train.buffer import RolloutBuffer
from drafter.train.checkpoint import DraftMeta
from drafter.train.trainer import DraftTrainer
from workers.errors import one_line
from workers.message import Message
from workers.protocol.keys import MAX_LEASE_OUTCOMES, job_leases_key
from workers.protocol.messages import LeaseOffer, LeaseOutcome
from workers.protocol.states import LeaseState, WorkerState
from workers.spec import JobSpec
from workers.status import WorkerStatus
from workers.store import DraftStore, merge_key

log = logging.getLogger(__name__)


class LeaseRunner:
    """At most one lease at a time on one worker."""

    def __init__(self, spec: JobSpec, redis: redis_lib.Redis, policy: CausalLM, buffer: RolloutBuffer,
                 served: DraftStore, copies: DraftStore, status: WorkerStatus) -> None:
        self.spec, self.redis, self.policy, self.buffer = spec, redis, policy, buffer
        self.served, self.copies, self.status = served, copies, status
        self.key = job_leases_key(status.job_id)
        self.running: str | None = None  # the lease being trained
        self.trainer: DraftTrainer | None = None
        self.is_stop_requested = False  # a stop that came before the running lease's trainer existed
        self.started_at = 0.0  # wall clock the running lease was accepted
        self._written: deque[str] = deque()  # lease ids whose outcomes this worker wrote, oldest first
        self._trainer_done = threading.Event()
        self._lock = threading.Lock()

    def _write(self, outcome: LeaseOutcome) -> None:
        """HSET the outcome and, in the same MULTI/EXEC, drop this worker's oldest beyond MAX_LEASE_OUTCOMES."""
        with self._lock:
            if outcome.lease_id not in self._written:
                self._written.append(outcome.lease_id)
            dropped = [self._written.popleft() for _ in range(len(self._written) - MAX_LEASE_OUTCOMES)]
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.key, outcome.lease_id, outcome.to_json())
            if dropped:
                pipe.hdel(self.key, *dropped)
            pipe.execute()

    def accept(self, offer: dict) -> LeaseOffer:
        """Take the offer, or raise ValueError naming the bad field, or saying this worker is busy or
        failed. On accept, its RUNNING outcome is in Redis when this returns."""
        lease = LeaseOffer.from_dict(offer) if not isinstance(offer, Message) else offer
        with self._lock:
            if self.status.state == WorkerState.FAILED:
                raise ValueError(f"worker {self.status.worker_id} has failed: it takes no lease")
            if self.running is not None:
                raise ValueError(f"worker {self.status.worker_id} already holds lease {self.running}")
            if lease.lease_id in self._written:
                raise ValueError(f"lease_id {lease.lease_id!r} was already used on this worker")
            self.running, self.is_stop_requested = lease.lease_id, False
            self.started_at = time.time()  # the lease holds the worker from here (loading the parent is lease work)
        self._write(LeaseOutcome(lease.lease_id, self.status.worker_id, LeaseState.RUNNING, started_at=self.started_at))
        return lease

    def run(self, lease: LeaseOffer) -> LeaseOutcome:
        """Train an accepted lease to its end; its outcome (DONE or FAILED) is written and returned."""
        try:
            outcome = self._train(lease)
        except Exception as exc:  # the lease's boundary: whatever failed, its outcome is written (FAILED, one line)
            log.exception("job %s: worker %s: lease %s failed", self.status.job_id, self.status.worker_id,
                          lease.lease_id)
            outcome = LeaseOutcome(lease.lease_id, self.status.worker_id, LeaseState.FAILED, error=one_line(exc),
                                   started_at=self.started_at, ended_at=time.time())
        with self._lock:
            self.running = None
        self._write(outcome)
        # free for the next lease only now, the copy published and the outcome written; a rollout that
        # started meanwhile owns the worker's state
        self.status.set_state(WorkerState.ROLLING_OUT if self.status.is_generating else WorkerState.IDLE,
                              only_from=WorkerState.TRAINING)
        return outcome

    def _parent(self, version: int) -> EagleHead:
        """The head a lease trains from: a stored version, or (version 0 before any was published) a new
        head whose draft vocabulary is this worker's most frequent rollout tokens. In float32 whatever the
        policy's dtype (JobSpec.policy_dtype): its weights are the optimizer's masters, and AdamW's small steps
        would round away in bf16 weights (the trainer's bf16 autocast, where native, gives bf16's speed)."""
        if version == 0 and self.served.latest_version() is None:
            head = new_head(self.policy, self.buffer if len(self.buffer) else None, self.spec.draft_vocab_size)
            return head.float()
        return self.served.load_head(version, torch.float32, self.policy.device)[0]

    def _train(self, lease: LeaseOffer) -> LeaseOutcome:
        head = self._parent(lease.parent_version)
        with self._lock:
            self.trainer = DraftTrainer(self.policy, head, self.spec.train_config())
            self._trainer_done.clear()
            if self.status.is_generating or self.is_stop_requested:  # rollouts arrived, or a preemption,
                self.trainer.request_stop()  # while the parent loaded: the GPU is theirs
        if not self.status.is_generating:
            self.status.set_state(WorkerState.TRAINING)
        try:
            rep = self.trainer.train(self.buffer, max_seconds=lease.deadline_s)
        finally:
            with self._lock:
                self.trainer = None
                self._trainer_done.set()
        ended_at = time.time()  # the trainer stopped: the worker's compute is free (the copy's write follows)
        version = None
        if rep.num_steps > 0:
            state, config = head.state_dict(), head_config(head)
            meta = DraftMeta(version=0, parent_version=lease.parent_version,
                             policy_version=self.status.policy_version, num_steps=rep.num_steps,
                             total_steps=rep.num_steps, num_tokens=rep.num_tokens, head_config=config,
                             extra={"worker": self.status.worker_id, "lease_id": lease.lease_id,
                                    "merge_key": merge_key(lease.parent_version, config, state)})
            version = self.copies.publish(state, meta)
        return LeaseOutcome(lease.lease_id, self.status.worker_id, LeaseState.DONE, steps=rep.num_steps,
                            tokens=rep.num_tokens, seconds=rep.seconds, stopped=rep.stopped, version=version,
                            started_at=self.started_at, ended_at=ended_at)

    def stop(self, wait_s: float = 0.0) -> bool:
        """Ask a running trainer to stop (it does within one micro-step); with wait_s > 0, also wait up
        to that long for it to have stopped. Returns whether a trainer was running."""
        with self._lock:
            if self.trainer is None:
                if self.running is None:
                    return False
                self.is_stop_requested = True  # the lease is loading its parent: it stops at its first step
                return True
            self.trainer.request_stop()
        if wait_s > 0:
            self._trainer_done.wait(wait_s)
        return True
