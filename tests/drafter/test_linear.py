"""The oneDNN linear path (CPU float32 inference) against F.linear: same values, stale packs rebuilt,
autograd left to F.linear, copies and pickles without the opaque packed tensor."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F

from drafter.decode.engine import Engine, Request
from drafter.decode.projections import project, project_into
from drafter.decode.sampling import SamplingParams
from drafter.draft.drafters import NgramDrafter
from drafter.draft.head import EagleHead
from drafter.model import linear as linear_module
from drafter.model import skinny
from drafter.model.int8 import Int8Linear, int8_linear_available, quantize_int8
from drafter.model.linear import (
    ONE_ROW_FORMS,
    Linear,
    PackedWeight,
    linear,
    native_cpu_bf16,
    one_row_form,
    onednn_linear_available,
)
from tests.conftest import random_prompts, tiny_model

needs_onednn = pytest.mark.skipif(not onednn_linear_available(), reason="this torch build has no oneDNN linear")


@needs_onednn
def test_packed_linear_matches_f_linear_for_every_row_count():
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    for rows in range(1, 9):
        x = torch.randn(2, rows, 48)
        with torch.inference_mode():
            got = layer(x)
        # a packed path ran: oneDNN's, or the few-row kernel's (skinny_rows)
        assert layer._packed.packed is not None or layer._packed.s is not None
        torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not (onednn_linear_available() and native_cpu_bf16()), reason="no native bf16 on this CPU")
def test_packed_bf16_linear_matches_f_linear():
    """A draft head served in bf16 (drafter.draft.eagle.serving_dtype) runs its linears on packed bf16 weights."""
    torch.manual_seed(0)
    layer = Linear(64, 96, bias=False).to(torch.bfloat16)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        with torch.inference_mode():
            got = layer(x)
        assert got.dtype == torch.bfloat16 and layer._packed.packed is not None
        torch.testing.assert_close(got.float(), F.linear(x.float(), layer.weight.float()), rtol=2e-2, atol=2e-2)


def test_mixed_dtypes_fall_back_to_f_linear():
    layer = Linear(8, 4, bias=False).to(torch.bfloat16)
    with torch.inference_mode(), pytest.raises(RuntimeError):
        layer(torch.randn(2, 8))  # float32 input, bf16 weight: F.linear's own error, not a wrong answer
    assert layer._packed.packed is None


@needs_onednn
def test_pack_is_rebuilt_after_an_in_place_update_or_a_new_weight():
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=False)
    x = torch.randn(12, 16)  # past the few-row kernel's rows (tests/drafter/test_skinny.py): oneDNN's GEMM
    with torch.inference_mode():
        layer(x)
    first = layer._packed.packed
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an optimizer step or a weight sync
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
    assert layer._packed.packed is not first
    layer.load_state_dict({"weight": torch.randn(8, 16)}, assign=True)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_training_takes_the_autograd_path():
    layer = Linear(16, 8)
    x = torch.randn(4, 16)
    layer(x).sum().backward()
    assert layer.weight.grad is not None and layer._packed.packed is None


def test_other_dtypes_and_no_cache_use_f_linear():
    w = torch.randn(8, 16, dtype=torch.float16)  # bf16 is packed where native: test_packed_bf16_linear_...
    x = torch.randn(2, 16, dtype=torch.float16)
    cache = PackedWeight()
    with torch.inference_mode():
        assert torch.equal(linear(x, w, None, cache), F.linear(x, w))
        x32, w32 = x.float(), w.float()
        assert torch.equal(linear(x32, w32, None, None), F.linear(x32, w32))
    assert cache.packed is None


def test_copies_and_pickles_drop_the_packed_tensor():
    layer = Linear(16, 8)
    with torch.inference_mode():
        layer(torch.randn(2, 16))
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert clone._packed.packed is None
        assert torch.equal(clone.weight, layer.weight)


def test_mkl_and_onednn_engines_agree_on_greedy_speculative_output(monkeypatch):
    """Greedy output is the same with either CPU linear backend, plain or speculative."""
    model = tiny_model(seed=3)
    prompts = random_prompts([5, 9, 3, 12], model.cfg.vocab_size, seed=5)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)) for p in prompts]
    outputs = {}
    for backend in ("onednn", "mkl"):
        monkeypatch.setenv("TLT_CPU_LINEAR", backend)
        onednn_linear_available.cache_clear()
        for k in (0, 3):
            outs = Engine(model).generate(reqs, k=k, drafter=NgramDrafter() if k else None)
            outputs[backend, k] = [o.token_ids for o in outs]
    onednn_linear_available.cache_clear()
    assert len({tuple(map(tuple, v)) for v in outputs.values()}) == 1


@pytest.mark.skipif(not int8_linear_available(), reason="no fbgemm/x86 int8 kernels in this torch")
def test_int8_linear_is_close_to_float32_and_quantize_replaces_every_linear():
    """Draft heads served with int8 weights (drafter.draft.eagle.serving_precision): per-channel weights,
    activations quantized per call. Close to float32, not equal: they only change what is drafted."""
    torch.manual_seed(0)
    for bias in (False, True):
        layer = Linear(64, 96, bias=bias)
        q = Int8Linear(layer.weight, layer.bias)
        for rows in (1, 3, 7):
            x = torch.randn(2, rows, 64)
            with torch.no_grad():
                ref = F.linear(x, layer.weight, layer.bias)
            got = q(x)
            assert got.shape == ref.shape and got.dtype == torch.float32
            assert float((got - ref).norm() / ref.norm()) < 0.05
    model = tiny_model()
    head = EagleHead(model.cfg)
    n = sum(isinstance(m, torch.nn.Linear) for m in head.modules())
    assert n == 6  # fc; the midlayer's qkv, o, gate_up and down; lm_head
    feats, embeds = torch.randn(1, 5, 64), torch.randn(1, 5, 64)
    positions = torch.arange(5).view(1, 5)
    with torch.inference_mode():
        ref = head.logits(head(feats, embeds, positions, head.new_cache(1, 8, torch.float32, "cpu")))
        assert quantize_int8(head) is head
        got = head.logits(head(feats, embeds, positions, head.new_cache(1, 8, torch.float32, "cpu")))
    assert not any(isinstance(m, torch.nn.Linear) for m in head.modules())
    assert sum(isinstance(m, Int8Linear) for m in head.modules()) == n
    assert float((got - ref).norm() / ref.norm()) < 0.05


@pytest.fixture
def one_row(monkeypatch):
    """Sets TLT_CPU_ONE_ROW for the test (one_row_form's cache cleared before and after)."""
    def force(mode: str) -> None:
        monkeypatch.setenv("TLT_CPU_ONE_ROW", mode)
        one_row_form.cache_clear()
    yield force
    one_row_form.cache_clear()


@needs_onednn
@pytest.mark.parametrize("form", ONE_ROW_FORMS)
def test_each_one_row_form_matches_f_linear_and_follows_weight_updates(one_row, form):
    """One-row products (plain decoding's) in each form, through Linear and the static path's project and
    project_into, equal F.linear to float32 rounding; the transposed copy is rebuilt after an in-place update."""
    if form == "skinny" and skinny.library() is None:
        pytest.skip("no AVX2/FMA CPU or no C compiler here: the few-row kernel is not built")
    one_row(form)
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    x, res = torch.randn(1, 48), torch.randn(1, 80)
    with torch.inference_mode():
        for _ in range(2):
            want = F.linear(x, layer.weight, layer.bias)
            torch.testing.assert_close(layer(x.view(1, 1, 48)).view(1, 80), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(project(x, layer.weight, layer.bias, layer._packed, True), want,
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(project_into(res, x, layer.weight, layer.weight.t(), layer._packed, True),
                                       res + F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)
            assert (layer._packed.t is not None) == (form == "transposed")
            assert (layer._packed.packed is not None) == (form == "onednn")
            assert (layer._packed.s is not None) == (form == "skinny")
            layer.weight.mul_(2.0)  # a weight sync in place: no copy may serve the old values


def test_one_row_form_is_float32_only_and_names_a_bad_setting(one_row):
    one_row("transposed")
    assert one_row_form(torch.float32, 80, 48) == ("transposed" if onednn_linear_available() else "onednn")
    assert one_row_form(torch.bfloat16, 80, 48) == "onednn"  # bf16 keeps oneDNN's row blocks
    one_row("fast")
    with pytest.raises(ValueError,
                       match="TLT_CPU_ONE_ROW must be auto or one of onednn, transposed, rows, skinny, got 'fast'"):
        one_row_form(torch.float32, 80, 48)


@needs_onednn
def test_the_probe_picks_a_form_once_per_shape(one_row, monkeypatch):
    one_row("auto")
    monkeypatch.setattr(linear_module, "SMALL_WEIGHT_BYTES", 0)  # this small shape timed too
    form = one_row_form(torch.float32, 96, 64)
    assert form in ONE_ROW_FORMS
    assert one_row_form(torch.float32, 96, 64) == form and one_row_form.cache_info().hits >= 1


@needs_onednn
def test_greedy_speculative_output_is_plain_decodings_in_every_one_row_form(one_row):
    """One row: plain steps run one_row_form's GEMV, a verify's k + 1 rows oneDNN; greedy outputs still agree,
    across forms and with speculation on and off."""
    model = tiny_model(seed=3)
    prompts = random_prompts([9], model.cfg.vocab_size, seed=5)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)) for p in prompts]
    outputs = {}
    for form in ONE_ROW_FORMS:
        one_row(form)
        for k in (0, 3):
            outs = Engine(model).generate(reqs, k=k, drafter=NgramDrafter() if k else None)
            outputs[form, k] = [o.token_ids for o in outs]
    assert len({tuple(map(tuple, v)) for v in outputs.values()}) == 1
