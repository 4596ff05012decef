"""The RolloutEngine seam: what a rollout worker asks of the inference engine it drives.

A worker (workers.rollout.RolloutRunner) loads policy weights into its engine, has it generate a
batch with per-request sampling settings and seeds, collects the training pairs the engine harvested
for the drafter (an engine that cannot, `harvests_pairs` False, has them from the learner's forward),
installs draft versions as they are published, and reports the engine's acceptance and throughput.
Nothing here names a built-in class: the built-in engine (workers.builtin_engine) is the first
implementation, vLLM and SGLang engines come next behind the same calls.

Per-request sampling settings are plain dicts (they cross Ray from the driver):
    temperature (0: greedy), top_k (0: off), top_p (1.0: off), max_new_tokens, seed (None: drawn),
    stop_token_ids, stop_strings, ignore_eos
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from drafter.buffer import RolloutBuffer

# on_progress(num_finished, num_generated): called by the engine as its batch advances (it may be often;
# the caller rate-limits what it does with it)
ProgressCallback = Callable[[int, int], None]
# how a batch drafts: adaptive (k per live-batch-size bucket from measured tokens/s, drafter.adaptive),
# always (the engine's draft_k every step) or off (plain decoding); JobSpec.speculation
Speculation = Literal["adaptive", "always", "off"]
SPECULATION_MODES = ("adaptive", "always", "off")


@dataclass(frozen=True)
class Completion:
    """One finished response, as the driver receives it."""

    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None  # decoded, cut before a matched stop string; None without a tokenizer
    finish_reason: str  # "stop" (EOS, stop token or stop string) or "length"
    num_steps: int  # policy forwards this response took part in (len(token_ids) with plain decoding)
    num_accepted: int  # drafted tokens the policy accepted
    draft_version: int  # the draft version serving when the batch finished (0: the untrained init)
    # the engine's draft length per live-batch-size bucket when the batch finished ({"1": 2, "9-16": 0}; 0:
    # plain); the same dict on every completion of a batch: the driver's StepRecord.speculation[worker]
    speculation: dict[str, int] = field(default_factory=dict)
    # this batch's decoding per live-batch-size bucket, whatever k served: {"1": [tokens, seconds], ...}; the
    # same dict on every completion of a batch (speculation is judged against plain decoding per bucket)
    bucket_throughput: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters since it started (cumulative: callers take differences)."""

    num_generated: int = 0  # tokens generated
    num_seq_steps: int = 0  # sum over policy forwards of the sequences in them
    num_draft_tokens: int = 0  # drafted tokens proposed
    num_accepted: int = 0  # drafted tokens accepted
    # sequence-steps that verified at least one drafted token: the swap guard's unit (workers.guard); an engine
    # that cannot count them leaves 0, and the guard then never judges its swaps
    num_verify_steps: int = 0
    generate_seconds: float = 0.0  # wall time inside generate
    num_swaps: int = 0  # draft versions installed
    swap_seconds: float = 0.0  # time the decode loop spent switching drafts

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per sequence per policy forward (1.0: plain decoding)."""
        return self.num_generated / self.num_seq_steps if self.num_seq_steps else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated / self.generate_seconds if self.generate_seconds > 0 else 0.0


def check_batch(prompts: list, params: list, speculation: str) -> None:
    """What every engine's generate checks first: one settings dict per prompt, a known speculation mode."""
    if len(params) != len(prompts):
        raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
    if speculation not in SPECULATION_MODES:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")


def check_fixed_speculation(engine: str, draft_k: int, speculation: str) -> None:
    """For an engine that fixes speculation at start (vLLM, SGLang): ValueError unless `speculation` is what
    it was started with (off without a draft, drafting with one)."""
    if (speculation == "off") != (draft_k == 0):
        raise ValueError(f"this {engine} engine was started {'without' if not draft_k else 'with'} speculation "
                         f"and cannot serve speculation={speculation!r}: {engine} fixes it at start")


class RolloutEngine(ABC):
    """An inference engine with speculative decoding and a hot-swappable draft."""

    # Whether generate(harvest_into=...) adds the batch's (token, policy hidden state) training pairs itself, as
    # cheaply as it generates. An engine that cannot hand the policy's per-token aux-layer states back says False
    # and is never given a buffer: its worker's pairs come from the learner's log-prob forward instead
    # (workers.learner_pairs). Each engine states its own.
    harvests_pairs: bool = False

    @abstractmethod
    def load_policy(self, state: dict[str, Any], policy_version: int) -> None:
        """Serve the policy weights `state` (name -> tensor) from the next batch on."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: list[dict], *, speculation: Speculation = "off",
                 harvest_into: RolloutBuffer | None = None,
                 on_progress: ProgressCallback | None = None) -> list[Completion]:
        """One rollout per prompt, as one batch. `speculation`: how to draft with the installed version
        (Speculation; lossless: the outputs follow the policy's distribution either way); an adaptive engine
        keeps what it measured across batches. `harvest_into`: add the batch's (token, policy hidden state)
        training pairs to this buffer, tagged with the policy version."""

    @abstractmethod
    def install_draft(self, version: int, state: dict[str, Any], head_config: dict) -> None:
        """Serve draft `version` (its weights and the head_config that rebuilds it) from the next draft
        step on, without pausing a batch under way. Thread-safe: called from the swap listener."""

    @property
    @abstractmethod
    def draft_version(self) -> int:
        """The draft version serving now (0: the untrained initial draft)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Acceptance and throughput so far."""
