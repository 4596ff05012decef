"""The built-in RolloutEngine: drafter.decode.engine.Engine (batched speculative decoding in PyTorch) with an
EAGLE-3 drafter (drafter.draft.eagle.EagleDrafter), on CPU or one GPU. With JobSpec.history_drafts, rows also draft
from their group's text (drafter.draft.combined: history where its match is long enough, else the head): a group's
rollouts are one batch on one worker (workers.driver.assign), so siblings stream into each other's index, and the
worker's ResponseStore keeps earlier steps' responses per prompt within its byte budget.

It shares its policy module with the worker (the learner-side copy the drafter trains against):
load_policy writes the weights into that module.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from drafter.decode.engine import Engine, EngineStats, Request
from drafter.decode.sampling import SamplingParams
from drafter.decode.warmup import warm_up
from drafter.draft.adaptive import DraftLengthTuner, StepCostPrior
from drafter.draft.combined import CombinedDrafter
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import head_from_state, new_head
from drafter.draft.history import HistoryDrafter
from drafter.draft.meter import FixedDraftLength
from drafter.model.causal_lm import CausalLM
from drafter.train.buffer import RolloutBuffer
from workers.engine import (
    Completion,
    ProgressCallback,
    RolloutEngine,
    as_tensors,
    bucket_deltas,
    check_batch,
    request_settings,
    served_deltas,
)
from workers.engines import Speculation

if TYPE_CHECKING:  # the engine reads a few of its fields: it runs where pydantic is not installed (a bare GPU node)
    from workers.spec import JobSpec


class BuiltinEngine(RolloutEngine):
    harvests_pairs = True  # record_hidden: the features of the forwards it runs anyway, copied per step

    def __init__(self, policy: CausalLM, tokenizer, spec: JobSpec) -> None:
        self.policy, self.draft_k = policy, spec.draft_k
        self.engine = Engine(policy, tokenizer)
        # version 0: an untrained head, served until the first published version arrives
        # its own head: each published version is written into it, so the captured draft graphs keep serving
        self.drafter = EagleDrafter(policy, new_head(policy, None, spec.draft_vocab_size), spec.draft_dtype,
                                    tree=spec.draft_tree, own_head=True)
        self.drafter.version = 0
        # what serves the drafts: the head alone, or history and the head per row (the head is fed either way)
        self.history = HistoryDrafter() if spec.history_drafts else None
        self.serving = CombinedDrafter(self.drafter, self.history) if self.history is not None else self.drafter
        self.policy_version = 0
        # one chooser per speculation mode, kept across batches and RL steps; each measures tokens/s per
        # live-batch bucket (the adaptive one learns from it; the fixed ones are its baselines)
        # its prior: version 0 is untrained (acceptance 0: no speculation until a scored version arrives)
        self.tuner = DraftLengthTuner(spec.draft_k, prior=StepCostPrior(acceptance=0.0))
        self.choosers = {Speculation.ADAPTIVE: self.tuner, Speculation.ALWAYS: FixedDraftLength(spec.draft_k),
                         Speculation.OFF: FixedDraftLength(0)}
        self._lock = threading.Lock()  # guards the counters below
        self._generate_seconds = 0.0
        self._num_installs = 0

    def load_policy(self, state: dict[str, Any], policy_version: int) -> None:
        self.policy.load_state_dict(as_tensors(state))
        self.policy.requires_grad_(False)
        self.policy_version = policy_version
        # the drafter's cache holds states of the old weights: refresh it (never dropping a draft version that
        # arrived meanwhile and is waiting for the next decode step)
        self.drafter.refresh()

    def generate(self, prompts: list[list[int]], params: list[dict], *, speculation: Speculation = Speculation.OFF,
                 harvest_into: RolloutBuffer | None = None,
                 on_progress: ProgressCallback | None = None) -> list[Completion]:
        speculation = check_batch(prompts, params, speculation)
        reqs = [Request(list(p), SamplingParams(**kw)) for p, kw in zip(prompts, params)]
        chooser = self.choosers[speculation]
        k = 0 if speculation == Speculation.OFF else self.draft_k
        if not k:  # not drafting: a version installed meanwhile starts serving now, between batches
            self.drafter.apply_pending_swap()
        before, served_before = chooser.bucket_totals(), chooser.bucket_served()
        start = time.perf_counter()
        try:
            # harvested features carry the layers the drafter's heads fuse, drafting or not
            outs = self.engine.generate(reqs, k=k, drafter=self.serving if k else None,
                                        record_hidden=harvest_into is not None, on_step=on_progress, tuner=chooser,
                                        aux_layers=self.drafter.aux_layers)
        finally:
            with self._lock:
                self._generate_seconds += time.perf_counter() - start
        if harvest_into is not None:
            harvest_into.add_outputs(outs, self.policy_version)
        if self.history is not None:  # for later steps' rollouts of the same prompts
            for o in outs:
                self.history.remember(o.prompt_ids, o.token_ids)
        version, chosen, buckets = self.draft_version, chooser.summary(), bucket_deltas(chooser, before)
        served = served_deltas(chooser, served_before)
        return [Completion(o.prompt_ids, o.token_ids, o.text, o.finish_reason, o.num_steps, o.num_accepted, version,
                           dict(chosen), buckets, served) for o in outs]

    def warm_up(self, max_rows: int, max_len: int, params: dict, speculation: Speculation,
                harvest: bool) -> dict:
        """drafter.decode.warmup.warm_up over the draft lengths `speculation`'s chooser may serve, with the serving
        drafter: on a GPU every CUDA graph of the job's batch buckets captured before its first rollout (nothing on
        a CPU)."""
        sampling, _ = request_settings(params, (), has_tokenizer=True)
        ks = self.choosers[check_batch([], [], speculation)].arms  # (0,) for plain
        return warm_up(self.engine, max_rows, max_len, tuple(ks), sampling, self.serving if any(ks) else None,
                       record_hidden=harvest, aux_layers=self.drafter.aux_layers)

    def install_draft(self, version: int, state: dict[str, Any], head_config: dict,
                      accepted_length: float = 0.0) -> None:
        head = head_from_state(head_config, as_tensors(state))
        # freshly built, so converted in place: request_swap then has no copy to make
        self.drafter.request_swap(self.drafter.convert(head), version, give=True)
        self.drafter.apply_pending_swap()  # between two of a running batch's draft-state updates
        if isinstance(self.serving, CombinedDrafter):  # which source pays is measured again against the new head
            self.serving.new_head()
        # its score says what to expect of it; a scored draft was published for beating the serving one on held-out
        # rollouts, so what the serving one measured stays as a floor (DraftLengthTuner.new_draft)
        scored = 1.0 <= accepted_length <= self.draft_k + 1 and self.draft_k > 0
        costs = StepCostPrior.step_costs(self.policy.device.type)
        self.tuner.new_draft(StepCostPrior.from_accepted_length(accepted_length, self.draft_k, **costs) if scored
                             else StepCostPrior(**costs), keep_estimates=scored)
        with self._lock:
            self._num_installs += 1

    @property
    def draft_version(self) -> int:
        return int(self.drafter.version or 0)

    def stats(self) -> EngineStats:
        s = self.engine.stats  # the decode loop's own, filled as it goes: a copy, with this engine's time and swaps
        with self._lock:
            return replace(s, accept_hist=Counter(s.accept_hist), generate_seconds=self._generate_seconds,
                           num_swaps=self._num_installs, swap_seconds=self.drafter.swaps.seconds)
