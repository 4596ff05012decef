"""The SGLang engine's own logic, without SGLang (any environment): sampling settings, acceptance counts from
meta_info, the weight-update selector guard, and the error where SGLang cannot run.
The contract with the real package is tests/engines/test_sglang_contract.py."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from drafter.model.loading import load_model
from workers.engines import ENGINES, SGLANG_VERSION, unavailable_reason
from workers.sglang_engine import SglangEngine, sampling_params, spec_counts, weight_update_requests
from workers.spec import JobSpec


def test_sampling_settings_map_to_sglangs_names_and_every_request_has_a_seed():
    rng = random.Random(0)
    sp = sampling_params({"temperature": 0.7, "top_k": 0, "top_p": 0.9, "max_new_tokens": 12, "seed": 5,
                          "stop_token_ids": [7], "ignore_eos": False}, (2,), False, rng)
    assert sp == {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 12, "stop": None,
                  "stop_token_ids": [7, 2], "ignore_eos": False, "sampling_seed": 5}
    # unseeded requests get distinct drawn seeds (SGLang would give every one of them the same)
    seeds = {sampling_params({"seed": None}, (), False, rng)["sampling_seed"] for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert sampling_params({"top_k": 5, "ignore_eos": True}, (2,), False, rng)["stop_token_ids"] is None
    with pytest.raises(ValueError, match="tokenizer"):
        sampling_params({"stop_strings": ["\n"]}, (), False, rng)
    with pytest.raises(ValueError, match="temperature"):
        sampling_params({"temperature": -1}, (), False, rng)
    with pytest.raises(ValueError, match="coupled sampling is the built-in engine's; SGLang samples its own way"):
        sampling_params({"temperature": 1.0, "coupled": True}, (), False, rng)


def test_acceptance_comes_from_meta_info_counts_or_lengths():
    exact = {"spec_verify_ct": 10, "spec_num_correct_drafts": 12, "spec_num_proposed_drafts": 20,
             "spec_accept_length": 2.2, "spec_accept_rate": 0.6}
    assert spec_counts(exact, 22, 2) == (10, 12, 20, 10)
    # an engine reporting only the length and rate (the same response)
    assert spec_counts({"spec_verify_ct": 10, "spec_accept_length": 2.2, "spec_accept_rate": 0.6}, 22, 2) == (
        10, 12, 20, 10)
    assert spec_counts({}, 5, 2) == (5, 0, 0, 0)  # plain decoding: every token its own forward
    assert spec_counts({"spec_verify_ct": 3, "spec_num_correct_drafts": 9}, 4, 3)[:2] == (1, 3)  # cut at max tokens


def test_weight_updates_name_one_runner_never_all():
    io = SimpleNamespace(BeginWeightUpdateReqInput=lambda **kw: ("begin", kw),
                         UpdateWeightsFromTensorReqInput=lambda **kw: ("update", kw),
                         EndWeightUpdateReqInput=lambda **kw: ("end", kw))
    begin, update, end = weight_update_requests(io, "draft", [b"x"], flush_cache=False)
    assert begin == ("begin", {"selector": "draft"}) and end == ("end", {})
    assert update == ("update", {"serialized_named_tensors": [b"x"], "flush_cache": False, "selector": "draft"})
    for bad in ("all", None, "Draft"):
        with pytest.raises(ValueError, match="selector"):
            weight_update_requests(io, bad, [b"x"], flush_cache=False)


def test_without_sglang_or_a_gpu_the_engine_says_what_is_missing():
    import importlib.util

    import torch

    if importlib.util.find_spec("sglang") is not None and torch.cuda.is_available():
        pytest.skip("sglang and a GPU are both here: the engine runs (tests/engines/test_sglang_contract.py)")
    reason = unavailable_reason("sglang")
    assert reason is not None and "SGLang engine" in reason and "JobSpec.engine is 'sglang'" in reason
    assert (f"pip install sglang=={SGLANG_VERSION}" in reason) or "CUDA GPU" in reason
    with pytest.raises(ValueError, match="SGLang engine"):
        SglangEngine(load_model("tiny").model, None, JobSpec(model="tiny"))
    assert SGLANG_VERSION in ENGINES["sglang"].install_hint


def test_a_jobs_driver_asks_for_the_package_only():
    """The driver holds no GPU (workers do): it refuses an 'sglang' job only where sglang is not installed."""
    import importlib.util

    reason = unavailable_reason("sglang", needs_gpu=False)
    assert (reason is None) == (importlib.util.find_spec("sglang") is not None)
    assert reason is None or f"sglang=={SGLANG_VERSION}" in reason
