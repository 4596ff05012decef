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

import importlib
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from drafter.decode.engine import EngineStats
from drafter.decode.sampling import SamplingParams
from drafter.draft.meter import FixedDraftLength
from drafter.train.buffer import RolloutBuffer
from workers.engines import ENGINES, Speculation, unavailable_reason

if TYPE_CHECKING:  # engines read a few of its fields: they run where pydantic is not installed (a bare GPU node)
    from drafter.model.loading import LoadedModel
    from workers.spec import JobSpec

# on_progress(num_finished, num_generated): called by the engine as its batch advances (it may be often;
# the caller rate-limits what it does with it)
ProgressCallback = Callable[[int, int], None]


def as_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Tensors as they are; numpy arrays (read-only, mapped from Ray's object store) wrapped without a copy."""
    with warnings.catch_warnings():  # from_numpy on a read-only array: it is only read
        warnings.simplefilter("ignore", UserWarning)
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in state.items()}


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
    # this batch's steps per live-batch-size bucket and draft length served: {"1": {"2": [tokens, steps, rows,
    # seconds]}} (rows: live rows summed over the steps, so tokens / rows is the accepted length, tokens / seconds
    # its rate); the same dict on every completion of a batch ({} from an engine that does not count them)
    bucket_served: dict[str, dict[str, list[float]]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def check_batch(prompts: list, params: list, speculation: str) -> Speculation:
    """What every engine's generate checks first: one settings dict per prompt, a known speculation mode."""
    if len(params) != len(prompts):
        raise ValueError(f"params has {len(params)} entries for {len(prompts)} prompts")
    if speculation not in set(Speculation):
        raise ValueError(f"speculation must be one of {', '.join(Speculation)}, got {speculation!r}")
    return Speculation(speculation)


def bucket_deltas(meter, before: dict[str, tuple[float, float]]) -> dict[str, list[float]]:
    """Completion.bucket_throughput: what `meter` (a draft-length chooser) measured per live-batch bucket since
    its bucket_totals() were `before`, buckets with no time left out."""
    deltas = {name: [t - before.get(name, (0.0, 0.0))[0], s - before.get(name, (0.0, 0.0))[1]]
              for name, (t, s) in meter.bucket_totals().items()}
    return {name: ts for name, ts in deltas.items() if ts[1] > 0}


def served_deltas(meter, before: dict[str, dict[int, tuple[float, int, int, float]]]
                  ) -> dict[str, dict[str, list[float]]]:
    """Completion.bucket_served: what `meter` (a draft-length chooser) served per bucket and k since its
    bucket_served() was `before`, the (bucket, k) pairs that served no step left out; k as text (JSON keys)."""
    out: dict[str, dict[str, list[float]]] = {}
    for name, by_k in meter.bucket_served().items():
        for k, now in by_k.items():
            then = before.get(name, {}).get(k, (0.0, 0, 0, 0.0))
            if now[1] > then[1]:
                out.setdefault(name, {})[str(k)] = [a - b for a, b in zip(now, then)]
    return out


class RolloutEngine(ABC):
    """An inference engine with speculative decoding and a hot-swappable draft."""

    # Whether generate(harvest_into=...) adds the batch's (token, policy hidden state) training pairs itself, as
    # cheaply as it generates. An engine that cannot hand the policy's per-token aux-layer states back says False
    # and is never given a buffer: its worker's pairs come from the learner's log-prob forward instead
    # (workers.learner_pairs). Each engine states its own.
    harvests_pairs: bool = False

    @classmethod
    def build(cls, loaded: LoadedModel, spec: JobSpec, num_threads: int) -> RolloutEngine:
        """The engine a rollout worker runs (workers.rollout): serving `loaded`, the worker's own policy copy,
        which it shares; `num_threads` the cores it may use."""
        return cls(loaded.model, loaded.tokenizer, spec)

    @abstractmethod
    def load_policy(self, state: dict[str, Any], policy_version: int) -> None:
        """Serve the policy weights `state` (name -> tensor) from the next batch on."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: list[dict], *, speculation: Speculation = Speculation.OFF,
                 harvest_into: RolloutBuffer | None = None,
                 on_progress: ProgressCallback | None = None) -> list[Completion]:
        """One rollout per prompt, as one batch. `speculation`: how to draft with the installed version
        (Speculation; lossless: the outputs follow the policy's distribution either way); an adaptive engine
        keeps what it measured across batches. `harvest_into`: add the batch's (token, policy hidden state)
        training pairs to this buffer, tagged with the policy version."""

    def warm_up(self, max_rows: int, max_len: int, params: dict, speculation: Speculation,
                harvest: bool) -> dict:
        """Before the job's first batch: meet the shapes its batches will (at most max_rows rows of at most max_len
        tokens, sampled by `params` as generate's, drafting as `speculation`, harvesting or not), so that no
        rollout pays for them. Returns what it took ({"seconds": ...}); an engine that prepares itself when it
        starts (vLLM and SGLang capture their graphs then) has nothing to do."""
        return {"seconds": 0.0}

    @abstractmethod
    def install_draft(self, version: int, state: dict[str, Any], head_config: dict,
                      accepted_length: float = 0.0) -> None:
        """Serve draft `version` (its weights and the head_config that rebuilds it) from the next draft
        step on, without pausing a batch under way. Thread-safe: called from the swap listener.
        accepted_length: its published score at the job's draft_k (0: none), what an engine that chooses k
        from measured gains may start from."""

    @property
    @abstractmethod
    def draft_version(self) -> int:
        """The draft version serving now (0: the untrained initial draft)."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Acceptance and throughput so far."""


def request_settings(params: dict, eos_token_ids: tuple[int, ...], has_tokenizer: bool,
                     external: str | None = None) -> tuple[SamplingParams, list]:
    """One request's settings (the dict above) checked as the built-in engine checks them (ValueError naming the
    setting), and its stop token ids: its own, then the model's EOS ids unless it ignores EOS (an external engine
    knows only its tokenizer's EOS, and a tokenizer-less model has none). external: the label of the external
    engine asking, which samples its own way (no coupled sampling)."""
    p = SamplingParams(**{k: tuple(v) if k.startswith("stop_") else v for k, v in params.items()})
    if p.stop_strings and not has_tokenizer:
        raise ValueError("stop_strings need a tokenizer; this model has none")
    if p.coupled and external is not None:
        raise ValueError(f"coupled sampling is the built-in engine's; {external} samples its own way")
    return p, list(dict.fromkeys([*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)]))


class ExternalEngine(RolloutEngine):
    """The bookkeeping every engine that drives another project's inference engine (vLLM, SGLang) shares: its
    counters and their lock, stats(), the draft version, the policy copy load_policy updates, and the generate
    preamble. Speculation is fixed when such an engine starts: with tlt on and speculation other than "off" it
    drafts draft_k tokens every step ("adaptive" included), otherwise none."""

    name = ""  # its key in workers.engines.ENGINES

    def __init__(self, policy, tokenizer, spec: JobSpec) -> None:
        self.policy, self.tokenizer, self.spec = policy, tokenizer, spec
        self.k = spec.draft_k if spec.tlt and spec.speculation != Speculation.OFF else 0
        self.meter = FixedDraftLength(self.k)
        self._lock = threading.Lock()  # the counters below (never held while the engine works)
        self._counts = dict.fromkeys(("num_generated", "num_seq_steps", "num_draft_tokens", "num_accepted",
                                      "num_verify_steps", "num_swaps"), 0)
        self._seconds = {"generate": 0.0, "swap": 0.0}
        self._version = 0

    @classmethod
    def import_package(cls) -> Any:
        """The engine's package, imported now; ValueError saying what is missing where it cannot run here."""
        reason = unavailable_reason(cls.name)
        if reason is not None:
            raise ValueError(reason)
        return importlib.import_module(ENGINES[cls.name].package)

    def _load_policy_copy(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The worker's policy copy takes `state` (the drafter trains and is scored against it); returns it as
        tensors, for the engine's own reload."""
        state = as_tensors(state)
        self.policy.load_state_dict(state)
        self.policy.requires_grad_(False)
        return state

    def _begin_batch(self, prompts: list, params: list, speculation: str) -> tuple[tuple[int, ...], bool]:
        """The generate preamble: the batch checked (ValueError) against what the engine was started with;
        returns (the model's EOS ids, whether it has a tokenizer)."""
        check_batch(prompts, params, speculation)
        label = ENGINES[self.name].label
        if (speculation == Speculation.OFF) != (self.k == 0):
            raise ValueError(f"this {label} engine was started {'without' if not self.k else 'with'} speculation "
                             f"and cannot serve speculation={speculation!r}: {label} fixes it at start")
        return tuple(self.policy.cfg.eos_token_ids), self.tokenizer is not None

    def _count(self, num_tokens: int, counts: tuple[int, int, int, int]) -> None:
        """Add one finished response: its tokens and (num_steps, num_accepted, num_draft_tokens, num_verify_steps)."""
        num_steps, num_accepted, num_drafted, num_verify = counts
        with self._lock:
            for key, n in (("num_generated", num_tokens), ("num_seq_steps", num_steps), ("num_accepted", num_accepted),
                           ("num_draft_tokens", num_drafted), ("num_verify_steps", num_verify)):
                self._counts[key] += n

    def _add_seconds(self, key: str, start: float) -> float:
        """Add the time since perf_counter() `start` to the `key` total ("generate" or "swap"); returns it."""
        seconds = time.perf_counter() - start
        with self._lock:
            self._seconds[key] += seconds
        return seconds

    def _installed(self, version: int, start: float) -> float:
        """Draft `version` serves now, its install begun at perf_counter() `start`; returns the seconds it took."""
        seconds = self._add_seconds("swap", start)
        with self._lock:
            self._version = version
            self._counts["num_swaps"] += 1
        return seconds

    @property
    def draft_version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        with self._lock:
            c, s = dict(self._counts), dict(self._seconds)
        return EngineStats(**c, generate_seconds=s["generate"], swap_seconds=s["swap"])
