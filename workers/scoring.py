"""Merging and scoring draft copies, on a worker (the scheduler does no tensor work).

score_round: average exactly the copies it is given (the scheduler grouped them by merge_key) into a
candidate in the copies store, then measure the candidate and the serving version, each at the draft temperature
that accepts the most, offline on this worker's most recent rollouts (drafter.train.evaluate), at the
job's draft_k (the worker's own JobSpec), and write the ScoringResult to job_scoring_key; a round that
could not be scored gets one with `error`.
publish_candidate: serve a scored candidate at its draft temperature, in the served store.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import redis as redis_lib

from drafter.model.causal_lm import CausalLM
from drafter.train.buffer import Rollout, RolloutBuffer
from drafter.train.evaluate import EvaluationStoppedError, calibrate_draft_temperature
from workers.errors import one_line
from workers.message import Message
from workers.protocol.keys import job_scoring_key
from workers.protocol.messages import ScoringRequest, ScoringResult
from workers.spec import JobSpec
from workers.status import WorkerStatus
from workers.store import DraftStore

log = logging.getLogger(__name__)
EVAL_TOKENS = 2048  # recorded pairs a round is scored on: ~1 s of a SmolLM2 forward on CPU


def recent_rollouts(buffer: RolloutBuffer, max_tokens: int = EVAL_TOKENS) -> tuple[list[Rollout], int]:
    """The newest rollouts of the buffer's newest policy version that no lease on this worker trained on (a copy
    scores higher on the rollouts it trained on: offline on SmolLM2, a lease's copy read +0.05 accepted tokens
    over its parent on them and -0.03 on held-out ones), up to `max_tokens` pairs, and their pairs."""
    rollouts = buffer.unread()
    if not rollouts:
        return [], 0
    newest = max(r.policy_version for r in rollouts)
    recent, num_tokens = [], 0
    for r in sorted((r for r in rollouts if r.policy_version == newest), key=lambda r: -r.order):
        if num_tokens >= max_tokens:
            break
        recent.append(r)
        num_tokens += r.num_pairs
    return recent, num_tokens


class Scorer:
    def __init__(self, spec: JobSpec, redis: redis_lib.Redis, policy: CausalLM, buffer: RolloutBuffer,
                 served: DraftStore, copies: DraftStore, status: WorkerStatus) -> None:
        self.spec, self.redis, self.policy, self.buffer = spec, redis, policy, buffer
        self.served, self.copies, self.status = served, copies, status
        self.scoring: str | None = None  # the round under scoring
        self._lock = threading.Lock()
        self._stop = threading.Event()  # set by preempt(): the round's scoring ends at its next batch
        self._done = threading.Event()  # cleared while a round's run() is under way
        self._done.set()

    def accept(self, request: dict) -> ScoringRequest:
        """The request, checked (ValueError naming the field), or ValueError if a round is under scoring."""
        req = ScoringRequest.from_dict(request) if not isinstance(request, Message) else request
        if not req.copies or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in req.copies):
            raise ValueError(f"copies must be a non-empty list of versions >= 1, got {req.copies!r}")
        with self._lock:
            if self.scoring is not None:
                raise ValueError(f"worker {self.status.worker_id} is scoring round {self.scoring}")
            self.scoring = req.round_id
            self._stop.clear()
        return req

    def preempt(self, wait_s: float = 0.0) -> bool:
        """Rollouts arrived: a round under scoring stops at its next batch and answers `preempted`, so that the
        scheduler has it scored again elsewhere (scoring is idle-time work: it must not slow a rollout, on this
        worker's cores or GPU); with wait_s > 0, also wait up to that long for it to have ended. True if a round was
        under scoring."""
        with self._lock:
            if self.scoring is None:
                return False
            self._stop.set()
        if wait_s > 0:
            self._done.wait(wait_s)
        return True

    def run(self, req: ScoringRequest) -> ScoringResult:
        """Merge and score an accepted request; the result (or the error) is written and returned."""
        result = ScoringResult(req.round_id, self.status.worker_id)
        with self._lock:
            self._done.clear()
        try:
            if self._stop.is_set() or self.status.is_generating:  # asked on an idle record, rollouts came first
                raise EvaluationStoppedError("rollouts arrived before it began")
            result.candidate = self.copies.merge_and_publish(list(req.copies))
            recent, result.num_tokens = recent_rollouts(self.buffer)
            if not recent:
                raise ValueError(f"worker {self.status.worker_id} has no rollouts its own leases did not train on "
                                 "to score drafts on")
            head, _ = self.copies.load_head(result.candidate, self.policy.dtype, self.policy.device)
            tau, scores = calibrate_draft_temperature(head, self.policy, recent, self.spec.draft_k, stop=self._stop)
            result.candidate_accepted_length, result.candidate_draft_temperature = scores[tau], tau
            if req.serving_version is not None:  # at its best draft temperature too: the candidate's score is the
                # best of DRAFT_TEMPERATURES on these rollouts, and against one fixed temperature that maximum alone
                # would favour it (runs J and K of `tlt bench rl` published versions that then accepted less)
                serving, _ = self.served.load_head(req.serving_version, self.policy.dtype, self.policy.device)
                _, serving_scores = calibrate_draft_temperature(serving, self.policy, recent, self.spec.draft_k,
                                                                stop=self._stop)
                result.serving_accepted_length = max(serving_scores.values())
        except EvaluationStoppedError as exc:
            log.info("job %s: worker %s: scoring round %s stopped for rollouts: %s", self.status.job_id,
                     self.status.worker_id, req.round_id, exc)
            result.error, result.preempted = f"preempted: {exc}", True
        except Exception as exc:  # the round's boundary: whatever failed, its ScoringResult is written (with the error)
            log.exception("job %s: worker %s: scoring round %s failed", self.status.job_id, self.status.worker_id,
                          req.round_id)
            result.error = one_line(exc)
        finally:
            with self._lock:
                self.scoring = None
                self._done.set()
        result = ScoringResult.from_dict(result.to_dict())  # validated as it is written
        self.redis.set(job_scoring_key(self.status.job_id), result.to_json())
        return result

    def publish_candidate(self, candidate: int, draft_temperature: float | None, extra: dict) -> int:
        """Serve candidate `candidate` of the copies store: at `draft_temperature` (None: its own), with
        `extra` merged into its meta (the scheduler's scores: "accepted_length" is the published score
        a worker's swap guard reads). Returns the version in the served store."""
        if isinstance(candidate, bool) or not isinstance(candidate, int) or candidate < 1:
            raise ValueError(f"candidate must be a version >= 1, got {candidate!r}")
        if draft_temperature is not None and (isinstance(draft_temperature, bool)
                                              or not isinstance(draft_temperature, int | float)
                                              or not math.isfinite(draft_temperature) or draft_temperature < 0):
            raise ValueError(f"draft_temperature must be a number >= 0 or None, got {draft_temperature!r}")
        if not isinstance(extra, dict):
            raise ValueError(f"extra must be a dict, got {type(extra).__name__}")
        state, meta = self.copies.load(candidate)
        if draft_temperature is not None:
            meta.head_config["eagle"]["draft_temperature"] = float(draft_temperature)
        meta.extra.update(extra)
        meta.extra.update(candidate=candidate, draft_temperature=meta.head_config["eagle"].get("draft_temperature"))
        meta.created_at = time.time()  # the served entry's time is its publish: swap latency counts from it
        return self.served.publish(state, meta)
