"""The vLLM engine's pure logic, without vllm (the main venv has none): request settings mapped to vLLM's
SamplingParams, accepted counts from vLLM's per-request metrics, the draft tensors vLLM loads, the CPU kernel
fix, the JobSpec field, and the one-line errors a job gets where vllm is missing. tests/engines runs the
engine itself against a real vLLM."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest
import torch
from pydantic import ValidationError

from workers.engines import unavailable_reason
from workers.errors import one_line
from workers.spec import JobSpec
from workers.vllm_engine import FairLock, accepted_counts, cpu_threads_env, sampling_kwargs, vllm_draft_tensors
from workers.vllm_extension import _expand

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_request_settings_map_to_vllm_sampling_params():
    assert sampling_kwargs({}, (2,), True) == {
        "temperature": 0.0, "top_k": 0, "top_p": 1.0, "max_tokens": 128, "seed": None, "stop": None,
        "stop_token_ids": [2], "ignore_eos": False, "detokenize": True}
    kw = sampling_kwargs({"temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_new_tokens": 7, "seed": 11,
                          "stop_token_ids": [5, 2], "stop_strings": ["\n\n"]}, (2, 3), True)
    assert kw == {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "max_tokens": 7, "seed": 11, "stop": ["\n\n"],
                  "stop_token_ids": [5, 2, 3], "ignore_eos": False, "detokenize": True}
    # ignore_eos: the model's EOS ids are not stops, the request's own stop tokens still are
    kw = sampling_kwargs({"ignore_eos": True, "stop_token_ids": [5]}, (2,), False)
    assert kw["stop_token_ids"] == [5] and kw["ignore_eos"] and not kw["detokenize"]
    assert sampling_kwargs({"ignore_eos": True}, (2,), True)["stop_token_ids"] is None


@pytest.mark.parametrize(("params", "match"), [
    ({"top_p": 0.0}, "top_p"), ({"temperature": -1}, "temperature"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"stop_strings": [""]}, "stop_strings"), ({"stop_strings": ["x"]}, "need a tokenizer"),
    ({"temperature": 1.0, "coupled": True}, "coupled sampling is the built-in engine's; vLLM samples its own way")])
def test_bad_request_settings_are_named(params, match):
    with pytest.raises(ValueError, match=match):
        sampling_kwargs(params, (), False)


def test_accepted_counts_from_vllms_per_request_metrics():
    assert accepted_counts(12, None) == (12, 0, 0, 0)  # plain decoding: one forward per token
    summary = {"num_accepted_draft_tokens": 8, "num_draft_tokens": 12, "num_spec_steps": 4}
    assert accepted_counts(12, summary) == (4, 8, 12, 4)  # 4 forwards, each 1 own token + 2 accepted
    # drafts accepted past max tokens or a stop are cut: never more accepted than tokens after the first
    assert accepted_counts(3, {**summary, "num_accepted_draft_tokens": 5}) == (1, 2, 12, 4)
    assert accepted_counts(0, summary) == (0, 0, 0, 0)


def test_draft_tensors_as_vllm_loads_them():
    config = {"draft_vocab_size": 4, "vocab_size": 4}
    tensors = {"lm_head.weight": torch.ones(4, 2), "d2t": torch.zeros(4, dtype=torch.long),
               "t2d": torch.ones(4, dtype=torch.bool)}
    assert set(vllm_draft_tensors(tensors, config)) == {"lm_head.weight"}  # vLLM refuses d2t at a full vocabulary
    with pytest.raises(ValueError, match="permuted"):
        vllm_draft_tensors({**tensors, "d2t": torch.tensor([1, -1, 0, 0])}, config)
    subset = {"draft_vocab_size": 2, "vocab_size": 4}
    assert vllm_draft_tensors(tensors, subset) is tensors


def test_the_expand_kernel_fix_writes_its_float_output():
    out = torch.full((6,), -1.0)
    _expand(out, torch.tensor([0.5, 0.0, 2.0]), torch.tensor([2, 5, 6], dtype=torch.int32), 0, 1)
    assert out.tolist() == [0.5, 0.5, 1.0, 1.0, 1.0, 2.0]  # a greedy request's 0 temperature becomes 1
    ids = torch.zeros(3, dtype=torch.long)
    _expand(ids, torch.tensor([7, 9]), torch.tensor([1, 3]), -1, 0)
    assert ids.tolist() == [7, 9, 9]


def test_vllm_threads_are_bound_to_this_process_cores_and_restored():
    before = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")}
    first = min(os.sched_getaffinity(0))
    with cpu_threads_env(1):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == str(first)
        assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert {k: os.environ.get(k) for k in before} == before


def test_the_engine_field_and_what_vllm_cannot_serve():
    assert JobSpec().engine == "builtin" and JobSpec(engine="vllm").engine == "vllm"
    with pytest.raises(ValidationError, match="engine"):
        JobSpec(engine="tgi")
    with pytest.raises(ValidationError, match="draft_tree"):
        JobSpec(engine="vllm", draft_tree="2,2")
    with pytest.raises(ValidationError, match="draft_dtype"):
        JobSpec(engine="vllm", draft_dtype="int8")
    assert JobSpec(engine="vllm", speculation="adaptive", draft_dtype="auto").speculation == "adaptive"


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed in this venv")
def test_a_vllm_job_without_vllm_fails_at_start_with_one_line_naming_the_field():
    from workers.driver import Driver
    from workers.vllm_engine import VllmEngine

    assert unavailable_reason("builtin") is None
    reason = unavailable_reason("vllm")
    assert "JobSpec.engine" in reason and "make venv-engines" in reason
    spec = JobSpec(engine="vllm")
    with pytest.raises(ValueError) as caught:  # the driver checks before it loads the model or starts workers
        Driver("j", spec, None, "redis://unused", "/unused")
    assert one_line(caught.value) == f"ValueError: {reason}"
    with pytest.raises(ValueError, match="JobSpec.engine is 'vllm'"):  # and so does the engine, in a worker
        VllmEngine(None, None, spec)


def test_a_swap_waits_one_step_not_many():
    """The decode loop takes the engine's lock for every step and asks again at once; a draft swap asking
    meanwhile is served right after the step under way (with a plain Lock it waited 1.0 s p50 in `tlt bench
    engine`: CPython's Lock lets the releasing thread take it back)."""
    lock, steps, waited = FairLock(), [], {}
    stop = threading.Event()

    def decode_loop():
        while not stop.is_set():
            with lock:
                steps.append(time.perf_counter())
                time.sleep(0.01)  # a step

    loop = threading.Thread(target=decode_loop, daemon=True)
    loop.start()
    time.sleep(0.05)
    before = len(steps)
    with lock:
        waited["steps"] = len(steps) - before
    stop.set()
    loop.join()
    assert waited["steps"] <= 2, waited
