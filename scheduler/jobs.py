"""Job specs (validated input), job records in Redis, and atomic state changes."""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from typing import Literal

import redis as redis_lib
from pydantic import BaseModel, ConfigDict, Field, model_validator

from drafter.config import PRESETS, SMOLLM2_SPEC
from workers.protocol import idempotency_key, job_key, jobs_index_key

IDEMPOTENCY_TTL_S = 24 * 3600  # a client retrying a submit does so within minutes; a day is generous
RAY_NAMESPACE = "tlt"  # named, detached job drivers are found again by a restarted scheduler in this namespace


def driver_name(job_id: str) -> str:
    """The Ray actor name of a job's driver (detached: it outlives the scheduler process)."""
    return f"tlt-driver-{job_id}"


class JobState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


TERMINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


class DrafterSpec(BaseModel):
    """How a lease trains the drafter (drafter/train.py TrainConfig has the reasons for the defaults)."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-3, gt=0, le=1)
    num_unroll: int = Field(3, ge=1, le=16, description="draft positions trained per pair")
    max_tokens_per_row: int = Field(256, ge=2, le=65_536, description="pairs per packed row")
    num_rows: int = Field(4, ge=1, le=1024, description="rows per micro-step; smaller micro-steps stop sooner")
    anneal_to_budget: bool = Field(True, description="decay the rate to its floor by each lease's deadline")
    bf16_autocast: bool | None = Field(None, description="bf16 autocast in lease training; null: where native")


class JobSpec(BaseModel):
    """POST /v1/jobs body. Unknown fields are rejected, so a typo never silently becomes a default."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(SMOLLM2_SPEC, min_length=1, description="preset, 'smollm2-135m', .gguf file or HF dir")
    task: Literal["arithmetic", "dataset"] = "arithmetic"
    dataset_path: str | None = None
    reward: Literal["arithmetic", "numeric", "exact"] = "arithmetic"
    num_steps: int = Field(2, ge=1, le=100_000)
    num_prompts_per_step: int = Field(4, ge=1, le=65_536)
    group_size: int = Field(4, ge=2, le=256, description="rollouts per prompt (GRPO group)")
    max_new_tokens: int = Field(128, ge=1, le=131_072)
    temperature: float = Field(1.0, gt=0, le=2)
    lr: float = Field(1e-5, gt=0, le=1)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    kl_coef: float = Field(0.0, ge=0)
    num_gpus: int = Field(2, ge=1, le=4096, description="rollout workers, one GPU each")
    tlt: bool = Field(True, description="speculative rollouts with idle-time drafter training")
    draft_k: int = Field(2, ge=1, le=16)
    draft_dtype: Literal["auto", "float32", "bfloat16", "int8"] = Field(
        "auto", description="precision the draft head serves in; auto: bf16 where the device has bf16 units; int8: "
        "int8 weights with float32 activations, CPU-only (measured slower at T=1 on a Zen 3 box)")
    draft_tree: str = Field("", pattern=r"^$|^([1-9]|1[0-6])(,([1-9]|1[0-6])){0,15}$", description=(
        "draft candidates at the first depths, e.g. '3,2' (three at the first, two at the second); '' drafts "
        "a chain (the default: on the CPU boxes measured, a tree's drafting and verifying cost more than its extra "
        "accepted tokens bring). Trees are drafted only while at most four rollouts of a worker are live"))
    min_accepted_length: float = Field(1.2, ge=0, le=17, description=(
        "speculate only with a draft measured (at publish) to give at least this many tokens per verify step; "
        "drafting and verifying k tokens cost ~1.1-1.2x a plain step on CPU. 0: always speculate"))
    drafter: DrafterSpec = Field(default_factory=DrafterSpec)
    seed: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.task == "dataset" and not self.dataset_path:
            raise ValueError("dataset_path is required when task is 'dataset'")
        if self.model not in PRESETS and self.model != SMOLLM2_SPEC and not self.model.startswith(("/", ".")):
            raise ValueError(f"model must be a preset ({', '.join(PRESETS)}), {SMOLLM2_SPEC!r} or a path")
        return self


class JobStore:
    """Job records: one JSON string per job, plus an index sorted by submission time."""

    def __init__(self, redis: redis_lib.Redis) -> None:
        self.redis = redis

    def create(self, spec: JobSpec, idem_key: str | None = None) -> tuple[dict, bool]:
        """Store a new PENDING job; returns (record, created). With an idempotency key already used,
        returns the earlier job and creates nothing."""
        job_id = uuid.uuid4().hex[:16]
        now = time.time()
        record = {"job_id": job_id, "state": JobState.PENDING.value, "spec": spec.model_dump(), "created_at": now,
                  "updated_at": now, "error": None, "steps": 0}
        # claim the key first (SET NX): two identical submits race for it, one wins
        if idem_key is not None and not self.redis.set(idempotency_key(idem_key), job_id, nx=True,
                                                       ex=IDEMPOTENCY_TTL_S):
            earlier = self.get(self.redis.get(idempotency_key(idem_key)))
            if earlier is not None:
                return earlier, False
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(job_key(job_id), json.dumps(record))
            pipe.zadd(jobs_index_key(), {job_id: now})
            pipe.execute()
        return record, True

    def get(self, job_id: str) -> dict | None:
        raw = self.redis.get(job_key(job_id))
        return json.loads(raw) if raw else None

    def list(self, limit: int = 100) -> list[dict]:
        ids = self.redis.zrevrange(jobs_index_key(), 0, limit - 1)
        raws = self.redis.mget([job_key(i) for i in ids]) if ids else []
        return [json.loads(r) for r in raws if r]

    def transition(self, job_id: str, to: JobState, allowed_from: set[JobState], **fields) -> dict | None:
        """Change state only from `allowed_from` (WATCH/MULTI); returns the new record, or None if the
        job is missing or in another state."""
        key = job_key(job_id)
        with self.redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(key)
                    raw = pipe.get(key)
                    if raw is None:
                        return None
                    record = json.loads(raw)
                    if JobState(record["state"]) not in allowed_from:
                        return None
                    record.update(fields, state=to.value, updated_at=time.time())
                    pipe.multi()
                    pipe.set(key, json.dumps(record))
                    pipe.execute()
                    return record
                except redis_lib.WatchError:
                    continue
