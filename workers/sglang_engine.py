"""The SGLang RolloutEngine: upstream SGLang 0.5.x's offline engine (`sglang.Engine`) with EAGLE-3
speculation, on one CUDA GPU, behind the same seam as the built-in engine (workers.engine).

Written against sglang 0.5.23 (workers.engines.SGLANG_VERSION; names checked by
tests/engines/test_sglang_contract.py against the installed package); it needs a CUDA GPU (SGLang's kernels have
no CPU build that is published).

- Drafts: our head exported as a `LlamaForCausalLMEagle3` directory (drafter.draft.eagle3) for the engine's start;
  every later version is loaded into the live engine in a weight-update session on the DRAFT runner only:
  begin_weight_update(selector="draft"), update_weights_from_tensor(selector="draft"), end_weight_update().
  Never SGLang's default selector "all": it hands the same tensors to the target and the draft runner, and
  names both models have (the final norm, the LM head) overwrite the other's weights (the bug that took
  another project's accepted length from 2.71 to 1.00). `weight_update_requests` refuses any other selector.
  The swap guard (workers.guard) catches what a silent mis-load still does.
- SGLang copies the draft vocabulary map (d2t) once, when it starts: a version with another draft
  vocabulary (the first trained one replacing the untrained head, usually) starts the engine again, with the
  policy's current weights, between two batches; install_draft waits for a batch under way to end first.
- Policy updates: the same session on the TARGET runner, then the prefix cache is flushed (its KV entries
  came from the old policy).
- What crosses processes: the tensors go from the rollout worker to its own SGLang scheduler process as
  SGLang's MultiprocessingSerializer payload (a pickle of CUDA IPC handles, read back with its restricted
  unpickler) over a local ZMQ socket; nothing leaves the worker's own process tree.
- generate: one request per prompt with its own sampling settings and seed (per-request seeds take effect
  in SGLang only with enable_deterministic_inference, which this engine turns on; an unseeded request is
  given a drawn seed, since SGLang would give every unseeded request the same one). Acceptance comes from
  each response's meta_info (spec_verify_ct, spec_num_correct_drafts, spec_num_proposed_drafts; else
  spec_accept_length and spec_accept_rate).
- training pairs: SGLang's return_hidden_states hands back the final hidden state, not the three aux layers'
  states the draft fuses, so `harvests_pairs` is False: a rollout worker passes no buffer and its pairs come from
  the learner's forward (workers.learner_pairs). A caller that does pass harvest_into gets the rows harvested
  only when their width is the drafter's feature width (logged once otherwise).
- Speculation is fixed when the engine starts: tlt on and speculation other than "off" drafts draft_k tokens
  every step ("adaptive" included); otherwise plain.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from drafter.model.causal_lm import CausalLM
from drafter.model.config import NUM_AUX_LAYERS
from drafter.train.buffer import RolloutBuffer
from workers.engine import Completion, ExternalEngine, ProgressCallback, as_tensors, bucket_deltas, request_settings
from workers.engines import Speculation
from workers.learner_pairs import DTYPE_NAMES
from workers.spec import JobSpec

if TYPE_CHECKING:
    from drafter.model.loading import LoadedModel

log = logging.getLogger(__name__)
SELECTORS = ("target", "draft")  # the weight-update runners this engine names; never SGLang's default "all"
DRAFT_SELECTOR = "draft"


def server_kwargs(model_dir: str | Path, draft_dir: str | Path | None, k: int, spec: JobSpec, *,
                  has_tokenizer: bool, dtype: str, context_length: int) -> dict[str, Any]:
    """sglang.Engine's keyword arguments (ServerArgs fields) for a policy directory and, with k > 0, an EAGLE-3
    draft directory drafting k tokens per step as one chain."""
    kwargs: dict[str, Any] = {
        "model_path": str(model_dir), "skip_tokenizer_init": not has_tokenizer, "dtype": dtype,
        "context_length": context_length, "random_seed": spec.seed, "log_level": "error",
        "enable_deterministic_inference": True,  # per-request sampling seeds are read only in this mode
        # rollouts' (token, hidden state) pairs, asked for per request when the job trains its drafter
        "enable_return_hidden_states": spec.trains_drafter,
    }
    if k:
        kwargs |= {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(draft_dir),
                   "speculative_num_steps": k, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": k + 1}
    return kwargs


def sampling_params(params: dict, eos_token_ids: tuple[int, ...], has_tokenizer: bool,
                    rng: random.Random) -> dict[str, Any]:
    """SGLang sampling parameters for one request's settings (workers.engine's dict), checked as the built-in
    engine checks them (workers.engine.request_settings, EOS ids among the stops); an unseeded request gets a
    seed drawn from `rng`."""
    p, stops = request_settings(params, eos_token_ids, has_tokenizer, "SGLang")
    return {"temperature": float(p.temperature), "top_p": float(p.top_p), "top_k": int(p.top_k) or -1,
            "max_new_tokens": p.max_new_tokens, "stop": list(p.stop_strings) or None,
            "stop_token_ids": stops or None, "ignore_eos": p.ignore_eos,
            "sampling_seed": p.seed if p.seed is not None else rng.getrandbits(63)}


def spec_counts(meta: dict, num_tokens: int, k: int) -> tuple[int, int, int, int]:
    """(num_steps, num_accepted, num_draft_tokens, num_verify_steps) of one response from its meta_info. Every
    policy forward yields one token of its own besides the drafts it accepts, so steps = tokens - accepted."""
    verify = int(meta.get("spec_verify_ct") or 0)
    if not verify or num_tokens == 0:
        return num_tokens, 0, 0, 0
    if "spec_num_correct_drafts" in meta:
        accepted, drafted = int(meta["spec_num_correct_drafts"]), int(meta.get("spec_num_proposed_drafts") or 0)
    else:  # spec_accept_length = completion tokens / verify steps; spec_accept_rate = accepted / proposed
        accepted = round((float(meta.get("spec_accept_length") or 1.0) - 1.0) * verify)
        rate = float(meta.get("spec_accept_rate") or 0.0)
        drafted = round(accepted / rate) if rate > 0 else verify * k
    accepted = max(0, min(accepted, num_tokens - 1))
    return num_tokens - accepted, accepted, drafted or verify * k, verify


def weight_update_requests(io: Any, selector: str, payloads: list[bytes], *, flush_cache: bool) -> tuple:
    """The (begin, update, end) requests of one weight-update session on one runner (`io`: SGLang's
    sglang.srt.managers.io_struct). ValueError for any selector but "target" or "draft"."""
    if selector not in SELECTORS:
        raise ValueError(f"selector must be one of {SELECTORS}, got {selector!r}: SGLang's 'all' would load the "
                         "same tensors into the target and the draft")
    return (io.BeginWeightUpdateReqInput(selector=selector),
            io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=payloads, flush_cache=flush_cache,
                                               selector=selector),
            io.EndWeightUpdateReqInput())


class SglangEngine(ExternalEngine):
    """`policy` is the worker's own copy (the drafter trains and is scored against it; load_policy updates it
    too); `model_dir` the HF directory it came from (None: written from `policy`). SGLang starts at the first
    batch, with the draft installed by then (a job's warm draft is installed before its first rollout)."""

    # SGLang's return_hidden_states does not return the rows the drafter trains on (the three aux layers' states
    # and the final one, 4D per position): the learner's forward records them, and requests do not pay for it
    name = "sglang"
    harvests_pairs = False

    def __init__(self, policy: CausalLM, tokenizer, spec: JobSpec, *, model_dir: str | Path | None = None,
                 engine_options: dict | None = None) -> None:
        self.sgl = self.import_package()
        from drafter.draft.head import new_head

        super().__init__(policy, tokenizer, spec)
        self.engine_options = dict(engine_options or {})
        self._model_dir = None if model_dir is None else Path(model_dir)  # None once the policy changed
        self._dir = Path(tempfile.mkdtemp(prefix="tlt-sglang-"))  # private: what SGLang starts from
        self._head = new_head(policy, None, spec.draft_vocab_size) if self.k else None  # version 0
        self._vocab = None  # the draft vocabulary (d2t) the running engine started with
        self.engine = self._loop = None
        self.device = "cuda"  # where tensors go before a weight update: SGLang reads them as CUDA IPC handles
        self._engine_lock = threading.Lock()  # a batch, or an engine (re)start
        self._rng = random.Random(spec.seed)
        self._num_launches = 0
        self.policy_version, self._warned_width = 0, False

    # ----- the engine's life ---------------------------------------------------------------------------
    def _launch(self) -> None:
        """(Re)start SGLang from the policy's current weights and the current draft (under _engine_lock)."""
        from drafter.draft.eagle3 import export_eagle3
        from drafter.model.loading import save_hf_dir

        self._shutdown()
        self._num_launches += 1
        run = self._dir / f"run{self._num_launches}"
        model_dir = self._model_dir
        if model_dir is None:
            model_dir = run / "policy"
            save_hf_dir(self.policy, self.tokenizer, model_dir)
        draft_dir = export_eagle3(self._head, self.policy, run / "draft") if self.k else None
        kwargs = server_kwargs(model_dir, draft_dir, self.k, self.spec, has_tokenizer=self.tokenizer is not None,
                               dtype=DTYPE_NAMES[self.policy.dtype], context_length=self.policy.cfg.max_position)
        engine = self.sgl.Engine(**{**kwargs, **self.engine_options})
        self._vocab = self._head.vocab_ids.clone() if self.k else None  # target id of each draft id
        self._loop = engine.loop  # SGLang's own loop, run by one thread; every call is submitted to it
        threading.Thread(target=self._loop.run_forever, daemon=True, name="sglang-loop").start()
        self.engine = engine  # last: a running engine has its vocabulary and its loop

    def _shutdown(self) -> None:
        engine, loop, self.engine, self._loop = self.engine, self._loop, None, None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if engine is not None:
            engine.shutdown()

    def close(self) -> None:
        """Stop SGLang's processes and remove the private directory."""
        with self._engine_lock:
            self._shutdown()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _update(self, selector: str, named: list[tuple[str, Any]], *, flush_cache: bool) -> None:
        """One weight-update session on `selector`'s runner of the running engine; RuntimeError if SGLang
        reports a failure (the session is closed either way)."""
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer

        named = [(n, t.to(self.device)) for n, t in named]  # kept alive (referenced) until the calls return
        begin, update, end = weight_update_requests(io_struct, selector, [MultiprocessingSerializer.serialize(named)],
                                                    flush_cache=flush_cache)
        tm = self.engine.tokenizer_manager
        self._check(self._run(tm.begin_weight_update(begin, None)), "begin_weight_update", selector)
        try:
            self._check(self._run(tm.update_weights_from_tensor(update, None)), "update_weights_from_tensor", selector)
        finally:
            self._check(self._run(tm.end_weight_update(end, None)), "end_weight_update", selector)

    @staticmethod
    def _check(result: Any, call: str, selector: str) -> None:
        success, message = result if isinstance(result, tuple) else (getattr(result, "success", False), result)
        if not success:
            raise RuntimeError(f"SGLang {call}(selector={selector!r}) failed: {message}")

    @classmethod
    def build(cls, loaded: LoadedModel, spec: JobSpec, num_threads: int) -> SglangEngine:
        return cls(loaded.model, loaded.tokenizer, spec, model_dir=loaded.path)

    # ----- weights ---------------------------------------------------------------------------------------
    def load_policy(self, state: dict[str, Any], policy_version: int) -> None:
        from drafter.model.loading import hf_tensors

        state = self._load_policy_copy(state)
        self.policy_version, self._model_dir = policy_version, None  # a restart writes the current weights
        with self._engine_lock:
            if self.engine is not None:
                self._update("target", list(hf_tensors(state, self.policy.cfg).items()), flush_cache=True)

    def install_draft(self, version: int, state: dict[str, Any], head_config: dict,
                      accepted_length: float = 0.0) -> None:
        start = time.perf_counter()
        if self.k:
            import torch

            from drafter.draft.eagle3 import eagle3_tensors
            from drafter.draft.head import head_from_state

            head = head_from_state(head_config, as_tensors(state)).to(self.policy.dtype)
            tensors = eagle3_tensors(head)
            if self.engine is not None and self._vocab is not None and torch.equal(head.vocab_ids, self._vocab):
                live = [(n, t) for n, t in tensors.items() if n not in ("d2t", "t2d")]  # the vocabulary: unchanged
                self._update(DRAFT_SELECTOR, live, flush_cache=False)  # between two steps, a batch under way or not
                self._head = head
            else:  # SGLang keeps the vocabulary it started with: start it again, after a batch under way
                with self._engine_lock:
                    self._head = head
                    if self.engine is not None:
                        log.info("SGLang: draft v%d has another draft vocabulary; restarting the engine", version)
                        self._launch()
        self._installed(version, start)

    # ----- generation ------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[dict], *, speculation: Speculation = Speculation.OFF,
                 harvest_into: RolloutBuffer | None = None,
                 on_progress: ProgressCallback | None = None) -> list[Completion]:
        eos, has_tok = self._begin_batch(prompts, params, speculation)
        sps = [sampling_params(p, eos, has_tok, self._rng) for p in params]
        hidden = harvest_into is not None and self.spec.trains_drafter  # what the engine was started to allow
        with self._engine_lock:
            if self.engine is None:
                self._launch()
            before, start = self.meter.bucket_totals(), time.perf_counter()
            futures = [asyncio.run_coroutine_threadsafe(self.engine.async_generate(
                input_ids=list(p), sampling_params=sp, return_hidden_states=hidden), self._loop)
                for p, sp in zip(prompts, sps)]
            outs: list[dict | None] = [None] * len(prompts)
            index = {f: i for i, f in enumerate(futures)}
            num_generated = 0
            try:
                for f in concurrent.futures.as_completed(futures):  # progress as each response finishes
                    outs[index[f]] = f.result()
                    num_generated += len(outs[index[f]]["output_ids"])
                    if on_progress is not None:
                        on_progress(sum(o is not None for o in outs), num_generated)
            except BaseException:
                for f in futures:
                    f.cancel()  # SGLang aborts a request whose task is cancelled
                raise
            finally:
                seconds = self._add_seconds("generate", start)
        self.meter.record(len(prompts), self.k, num_generated, seconds)
        completions = self._completions(prompts, outs, before)
        if hidden:
            self._harvest(prompts, completions, outs, harvest_into)
        return completions

    def _completions(self, prompts, outs, before) -> list[Completion]:
        chosen, buckets = self.meter.summary(), bucket_deltas(self.meter, before)
        completions = []
        for prompt, out in zip(prompts, outs):
            meta, ids = out["meta_info"], list(out["output_ids"])
            finish = meta.get("finish_reason")
            reason = finish.get("type") if isinstance(finish, dict) else finish
            if reason not in ("stop", "length"):
                raise RuntimeError(f"SGLang ended a request with finish_reason {finish!r}")
            counts = spec_counts(meta, len(ids), self.k)
            self._count(len(ids), counts)
            completions.append(Completion(list(prompt), ids, out.get("text") if self.tokenizer is not None else None,
                                          reason, counts[0], counts[1], self._version, dict(chosen), buckets))
        return completions

    def _harvest(self, prompts, completions, outs, buffer: RolloutBuffer) -> None:
        """Add the batch's (token, feature) pairs from SGLang's hidden states: rows for the prompt's positions,
        then one per generated token. Only rows of the drafter's feature width are usable."""
        import torch

        width = (NUM_AUX_LAYERS + 1) * self.policy.cfg.hidden_size
        made = []
        for prompt, c, out in zip(prompts, completions, outs):
            chunks = out["meta_info"].get("hidden_states") or []
            rows = [r for chunk in chunks for r in (chunk if chunk and isinstance(chunk[0], list) else [chunk])]
            need = len(prompt) - 1 + len(c.token_ids)
            if len(rows) < need or not rows or len(rows[0]) != width:
                if not self._warned_width:
                    self._warned_width = True
                    log.warning("SGLang returned %d hidden-state rows of width %s for %d positions; the drafter "
                                "trains on width %d: these rollouts' pairs come from the learner's forward",
                                len(rows), len(rows[0]) if rows else None, need, width)
                return
            h = torch.tensor(rows[:need], dtype=self.policy.dtype)  # (P-1+N, F)
            made.append(SimpleNamespace(prompt_ids=list(prompt), token_ids=c.token_ids,
                                        prompt_hidden_states=h[: len(prompt) - 1], hidden_states=h[len(prompt) - 1:]))
        buffer.add_outputs(made, self.policy_version)
