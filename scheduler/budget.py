"""Job budgets: a job's size checked as a whole at the REST edge, before anything is stored.

Each JobSpec field has its own bound, but their product is what costs: 65,536 prompts x 256 rollouts x
131,072 tokens passed every field's bound and asked the driver for 2.2e12 tokens a step. The limits live in
JobBudget (scheduler.settings.Settings.budget), each with its reason; a job over one gets a 422 that names the
limit and the fields it multiplies, never the values sent. Pure: no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafter.model.config import PRESETS, SMOLLM2_SPEC, ModelConfig
from workers.spec import JobSpec

HELD_TOKEN_BYTES = 40  # a token id in the driver's Python lists: an 8-byte slot and a 28-byte int, rounded up
PROMPT_TOKENS = 512  # a prompt's tokens, as counted for memory: the built-in tasks' chat-encoded prompts are ~150
LOGIT_BYTES = 8  # the learner's float32 logits and their gradient, per token and vocabulary entry
# a model named by path is not opened at the edge: counted at the largest vocabulary the supported families have
# (Qwen2's 151,936), so a path never passes a check a preset would fail
PATH_MODEL_VOCAB = 151_936


@dataclass(frozen=True)
class JobBudget:
    """The most a job may ask for as a whole (docs/api.md, "Job budgets")."""

    # prompts x group x max_new_tokens: 512 prompts x 16 rollouts x 8k tokens, the scale of published reasoning RL
    # steps (DAPO), held by the driver for the update
    max_tokens_per_step: int = 1 << 26
    # num_steps x the step's tokens: a month of 64 GPUs decoding ~6,000 tokens/s each; beyond it, a typo
    max_tokens_per_job: int = 10**12
    # the driver's step memory, estimated: the step's rollouts as token lists plus the learner's logits for one
    # micro-batch; a learner node's host memory with room left for the policy and its optimizer
    max_step_memory_bytes: int = 32 << 30

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_step", "max_tokens_per_job", "max_step_memory_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


def vocab_size(model: str) -> int:
    """The vocabulary the budget counts `model` at: a preset's own, SmolLM2's, PATH_MODEL_VOCAB for a path."""
    if model in PRESETS:
        return PRESETS[model].vocab_size
    return ModelConfig().vocab_size if model == SMOLLM2_SPEC else PATH_MODEL_VOCAB


def step_tokens(spec: JobSpec) -> int:
    """The most tokens one step generates: prompts x group x max_new_tokens."""
    return spec.num_prompts_per_step * spec.group_size * spec.max_new_tokens


def step_memory_bytes(spec: JobSpec) -> int:
    """The driver's estimated memory for a step: its rollouts held as token lists (prompt and response), and
    the logits (with their gradient) of one learner micro-batch of the longest sequences."""
    num_rollouts = spec.num_prompts_per_step * spec.group_size
    seq_len = PROMPT_TOKENS + spec.max_new_tokens
    held = num_rollouts * seq_len * HELD_TOKEN_BYTES
    logits = min(spec.micro_batch_size, num_rollouts) * seq_len * vocab_size(spec.model) * LOGIT_BYTES
    return held + logits


def budget_errors(spec: JobSpec, budget: JobBudget) -> list[tuple[str, str]]:
    """(field, message) for each limit `spec` exceeds: the limit's name and bound and the fields that make
    it up, never the values sent (inputs are not echoed)."""
    errors = []
    per_step = step_tokens(spec)
    if per_step > budget.max_tokens_per_step:
        errors.append(("num_prompts_per_step", f"over the job budget's max_tokens_per_step "
                       f"({budget.max_tokens_per_step}): num_prompts_per_step x group_size x max_new_tokens"))
    if per_step * spec.num_steps > budget.max_tokens_per_job:
        errors.append(("num_steps", f"over the job budget's max_tokens_per_job ({budget.max_tokens_per_job}): "
                       f"num_steps x num_prompts_per_step x group_size x max_new_tokens"))
    if step_memory_bytes(spec) > budget.max_step_memory_bytes:
        errors.append(("micro_batch_size", f"over the job budget's max_step_memory_bytes "
                       f"({budget.max_step_memory_bytes}): the step's rollouts held by the driver plus one "
                       f"learner micro-batch's logits (micro_batch_size x sequence length x the model's vocabulary)"))
    return errors
