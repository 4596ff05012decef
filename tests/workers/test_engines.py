"""The engine table (workers.engines) and the bookkeeping the external engines share (workers.engine.ExternalEngine):
JobSpec and the rollout worker read the one table, an engine that cannot run says why in one line, and the
shared counters add up. The engines themselves run in tests/workers/test_engine.py and tests/engines."""

from __future__ import annotations

import importlib
import time
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from drafter.decode.engine import EngineStats
from tests.conftest import tiny_model
from workers.builtin_engine import BuiltinEngine
from workers.engine import ExternalEngine, RolloutEngine, check_batch
from workers.engines import ENGINES, EngineEntry, Speculation, engine_class, unavailable_reason
from workers.spec import JobSpec


def test_jobspec_offers_exactly_the_tables_engines_and_each_class_is_behind_the_seam():
    assert JobSpec.model_json_schema()["properties"]["engine"]["enum"] == list(ENGINES)
    for name, entry in ENGINES.items():
        module, _, cls_name = entry.class_path.partition(":")
        cls = getattr(importlib.import_module(module), cls_name)  # vllm and sglang themselves are imported later
        assert issubclass(cls, RolloutEngine), name
        if issubclass(cls, ExternalEngine):  # its counters, stats() and draft version are the base's, not copies
            assert cls.name == name and entry.package is not None
            assert not {"stats", "draft_version", "_count"} & set(vars(cls)), name
    assert engine_class("builtin") is BuiltinEngine


@pytest.mark.parametrize("name", [n for n, e in ENGINES.items() if not e.has_history_drafts])
def test_history_drafts_are_refused_by_engines_without_them(name):
    with pytest.raises(ValidationError, match=f"history_drafts must be false with engine '{name}'"):
        JobSpec(engine=name, history_drafts=True)
    assert JobSpec(engine="builtin", history_drafts=True).history_drafts


@pytest.mark.parametrize("name", [n for n, e in ENGINES.items() if not e.has_coupled_sampling])
def test_coupled_sampling_is_refused_by_engines_that_sample_their_own_way(name):
    with pytest.raises(ValidationError, match=f"coupled_sampling must be false with engine '{name}'"):
        JobSpec(engine=name, coupled_sampling=True)
    assert JobSpec(engine="builtin", coupled_sampling=True).coupled_sampling


@pytest.mark.parametrize("name", [n for n, e in ENGINES.items() if not e.has_draft_trees])
def test_jobspec_refuses_what_the_table_says_an_engine_cannot_serve(name):
    with pytest.raises(ValidationError, match=f"draft_tree must be '' with engine '{name}'"):
        JobSpec(engine=name, draft_tree="2,2")
    for dtype in {"auto", "float32", "bfloat16", "int8"} - set(ENGINES[name].draft_dtypes):
        with pytest.raises(ValidationError, match=f"draft_dtype must be 'auto' or 'float32' with engine '{name}'"):
            JobSpec(engine=name, draft_dtype=dtype)
    assert JobSpec(engine=name, draft_dtype="auto").engine == name
    assert JobSpec(engine="builtin", draft_tree="2,2", draft_dtype="int8").draft_tree == "2,2"


def test_a_new_engine_is_one_entry_and_says_what_it_lacks(monkeypatch):
    monkeypatch.setitem(ENGINES, "fake", EngineEntry("tests.no_such_module:Fake", "Fake", package="tlt_no_such_pkg",
                                                     install_hint="pip install tlt-no-such-pkg"))
    reason = unavailable_reason("fake", needs_gpu=False)
    assert reason == ("JobSpec.engine is 'fake' but the tlt_no_such_pkg package is not installed here: the Fake "
                      "engine needs it; pip install tlt-no-such-pkg")
    with pytest.raises(ValueError, match="tlt_no_such_pkg package is not installed"):
        engine_class("fake")  # before its module is imported
    # a CUDA-only engine whose package is here: the driver (no GPU) lets it start; a worker without a GPU does not
    monkeypatch.setitem(ENGINES, "cuda_only", EngineEntry("json:JSONDecoder", "CudaOnly", package="json",
                                                          is_cuda_only=True))
    assert unavailable_reason("cuda_only", needs_gpu=False) is None
    on_worker = unavailable_reason("cuda_only")
    assert (on_worker is None) == torch.cuda.is_available()
    assert on_worker is None or "CudaOnly engine's kernels are published for CUDA only" in on_worker


class CountingEngine(ExternalEngine):
    """The base's bookkeeping alone (a unit test of pure logic: no external engine behind it)."""

    name = "vllm"  # its label and package in messages; nothing is imported

    def load_policy(self, state, policy_version):  # pragma: no cover - not called
        raise NotImplementedError

    def install_draft(self, version, state, head_config):
        self._installed(version, time.perf_counter() - 0.25)

    def generate(self, prompts, params, *, speculation=Speculation.OFF, harvest_into=None, on_progress=None):
        eos, has_tokenizer = self._begin_batch(prompts, params, speculation)
        start = time.perf_counter()
        for prompt in prompts:
            self._count(len(prompt), (len(prompt) - 1, 1, 2, 1))
        self._add_seconds("generate", start - 0.5)
        return [eos, has_tokenizer]


def test_external_engines_share_one_bookkeeping():
    policy = SimpleNamespace(cfg=SimpleNamespace(eos_token_ids=[2, 3]))
    e = CountingEngine(policy, None, JobSpec(model="tiny", draft_k=3, speculation="adaptive"))
    assert e.k == 3 and e.stats() == EngineStats() and e.stats().mean_accepted_length == 1.0  # empty: plain
    assert e.generate([[1, 2, 3], [4, 5]], [{}, {}], speculation="always") == [(2, 3), False]
    e.install_draft(4, {}, {})
    s = e.stats()
    assert (s.num_generated, s.num_seq_steps, s.num_accepted, s.num_draft_tokens, s.num_verify_steps) == (5, 3, 2, 4, 2)
    assert s.mean_accepted_length == pytest.approx(5 / 3) and s.generate_seconds >= 0.5 and s.tokens_per_s > 0
    assert e.draft_version == 4 and s.num_swaps == 1 and s.swap_seconds >= 0.25
    with pytest.raises(ValueError, match="this vLLM engine was started with speculation and cannot serve "
                                         "speculation='off'"):
        e.generate([[1]], [{}], speculation="off")
    plain = CountingEngine(policy, None, JobSpec(model="tiny", tlt=False))
    assert plain.k == 0
    with pytest.raises(ValueError, match="started without speculation"):
        plain.generate([[1]], [{}], speculation="adaptive")
    with pytest.raises(ValueError, match="speculation must be one of adaptive, always, off, got 'sometimes'"):
        check_batch([[1]], [{}], "sometimes")


def test_the_builtin_engines_stats_are_a_snapshot():
    e = BuiltinEngine(tiny_model(), None, JobSpec(model="tiny", draft_k=2))
    before = e.stats()
    e.generate([[1, 2, 3]], [{"max_new_tokens": 6, "ignore_eos": True, "seed": 1}], speculation="always")
    after = e.stats()
    assert before.num_generated == 0 and not before.accept_hist and after.num_generated == 6
    assert sum(after.accept_hist.values()) == after.num_seq_steps  # one entry per sequence-step
    after.accept_hist[99] += 1
    assert 99 not in e.stats().accept_hist  # the engine's own counter is not the caller's


def test_speculation_is_one_vocabulary_from_the_rest_api_to_the_simulator():
    from scheduler.simulate.profiles import Workload

    spec = JobSpec.model_validate_json('{"model": "tiny", "speculation": "always"}')
    assert spec.speculation is Speculation.ALWAYS
    assert '"speculation":"always"' in spec.model_dump_json()
    assert JobSpec.model_validate(spec.model_dump()).speculation is Speculation.ALWAYS  # dumped, handed down
    with pytest.raises(ValidationError, match="speculation"):
        JobSpec(speculation="sometimes")
    workload = Workload(lengths=None, prompts_per_worker=1, group_size=2, prompt_tokens=10.0, draft_k=2,
                        speculation="off")
    assert workload.speculation is Speculation.OFF
    with pytest.raises(ValueError, match="speculation must be one of adaptive, always, off"):
        Workload(lengths=None, prompts_per_worker=1, group_size=2, prompt_tokens=10.0, draft_k=2, speculation="x")
