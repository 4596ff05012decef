"""Few-row products (drafter.model.skinny, drafter.model.linear.skinny_rows): the AVX2 kernel matches F.linear, gives a
row the same bits at every row count it takes, follows weight updates, names what it refuses; the probe honours its
setting; a machine that cannot build it keeps oneDNN; greedy speculation on it is plain decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.eagle import EagleDrafter, linear_shapes
from drafter.draft.head import EagleHead
from drafter.model import linear as linear_module
from drafter.model import skinny
from drafter.model.linear import (
    Linear,
    draft_int8_pays,
    one_row_form,
    onednn_linear_available,
    product_form,
    skinny_rows,
)
from tests.conftest import on, random_prompts, tiny_model

needs_kernel = pytest.mark.skipif(skinny.library() is None or not onednn_linear_available(),
                                  reason="no AVX2/FMA CPU or no C compiler here: few-row products keep oneDNN")


@pytest.fixture
def skinny_mode(monkeypatch):
    """Sets TLT_CPU_SKINNY for the test (skinny_rows's cache cleared before and after)."""
    def force(mode: str) -> None:
        monkeypatch.setenv("TLT_CPU_SKINNY", mode)
        skinny_rows.cache_clear()
    yield force
    skinny_rows.cache_clear()


@needs_kernel
def test_the_kernel_matches_f_linear_and_a_row_keeps_its_bits_at_every_row_count():
    torch.manual_seed(0)
    weight, bias = torch.randn(80, 48), torch.randn(80)
    x, add = torch.randn(skinny.max_rows(), 48), torch.randn(skinny.max_rows(), 80)
    packed = skinny.pack(weight)
    assert packed.shape == (10, 48, 8)
    full = skinny.product(x, packed)
    torch.testing.assert_close(full, F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skinny.product(x, packed, bias=bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skinny.product(x, packed, add=add), add + F.linear(x, weight), rtol=1e-5, atol=1e-5)
    for rows in range(1, skinny.max_rows() + 1):  # the sums' order is each row's own: a verify's rows, to the bit
        assert torch.equal(skinny.product(x[:rows], packed), full[:rows])
    strided = torch.randn(48, 3)[:, :2].t()  # not contiguous: the kernel takes a copy
    torch.testing.assert_close(skinny.product(strided, packed), F.linear(strided, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_what_the_kernel_refuses_is_named():
    with pytest.raises(ValueError, match=r"N % 8 == 0 outputs and an even number of inputs, got \(81, 48\)"):
        skinny.pack(torch.randn(81, 48))
    with pytest.raises(ValueError, match=r"got \(80, 47\) torch.float32"):
        skinny.pack(torch.randn(80, 47))
    with pytest.raises(ValueError, match=r"got \(80, 48\) torch.bfloat16"):
        skinny.pack(torch.randn(80, 48, dtype=torch.bfloat16))
    packed = skinny.pack(torch.randn(80, 48))
    too_many = skinny.max_rows() + 1
    with pytest.raises(ValueError, match=f"does not take {too_many} rows of 48 torch.float32 inputs"):
        skinny.product(torch.randn(too_many, 48), packed)
    with pytest.raises(ValueError, match="does not take 2 rows of 40 torch.float32 inputs"):
        skinny.product(torch.randn(2, 40), packed)
    with pytest.raises(ValueError, match=r"add must be a CPU float32 tensor of shape \(3, 80\), got \(2, 80\)"):
        skinny.product(torch.randn(3, 48), packed, add=torch.randn(2, 80))
    with pytest.raises(ValueError, match=r"bias must be a CPU float32 tensor of shape \(80,\), got \(40,\)"):
        skinny.product(torch.randn(3, 48), packed, bias=torch.randn(40))


def test_a_bad_setting_is_named(skinny_mode, monkeypatch):
    skinny_mode("fast")
    with pytest.raises(ValueError, match="TLT_CPU_SKINNY must be one of auto, on, off, got 'fast'"):
        skinny_rows(torch.float32, 80, 48)
    monkeypatch.setenv("TLT_CPU_ONE_ROW", "skinny")  # one row forced onto the kernel, a shape it does not take
    one_row_form.cache_clear()
    try:
        with pytest.raises(ValueError, match="TLT_CPU_ONE_ROW=skinny: the few-row kernel does not take a 81 x 48"):
            one_row_form(torch.float32, 81, 48)
    finally:
        one_row_form.cache_clear()


@needs_kernel
def test_the_setting_and_the_dtype_decide_which_row_counts_it_serves(skinny_mode, monkeypatch):
    every = frozenset(range(2, skinny.max_rows() + 1))
    skinny_mode("on")
    assert skinny_rows(torch.float32, 80, 48) == every
    assert skinny_rows(torch.bfloat16, 80, 48) == frozenset()  # bf16 keeps oneDNN's row blocks
    assert skinny_rows(torch.float32, 81, 48) == frozenset()  # a shape the kernel does not take
    assert product_form(torch.randn(3, 48), torch.randn(80, 48)) == "skinny"
    assert product_form(torch.randn(skinny.max_rows() + 1, 48), torch.randn(80, 48)) == "onednn"
    skinny_mode("off")
    assert skinny_rows(torch.float32, 80, 48) == frozenset()
    skinny_mode("auto")
    monkeypatch.setattr(linear_module, "SMALL_WEIGHT_BYTES", 0)  # this small shape timed too
    timed = skinny_rows(torch.float32, 96, 64)  # timed against oneDNN, once per shape and process
    assert timed <= every and skinny_rows(torch.float32, 96, 64) is timed and skinny_rows.cache_info().hits >= 1


@needs_kernel
def test_a_layer_on_the_kernel_follows_in_place_updates_and_training_never_takes_it(skinny_mode):
    skinny_mode("on")
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    x = torch.randn(3, 48)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        first = layer._packed.s
        assert first is not None
        layer.weight.mul_(2.0)  # a weight sync in place: the packed copy may not serve the old values
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        assert layer._packed.s is not first
    trained = Linear(48, 80)
    trained(x.requires_grad_(True)).sum().backward()
    assert trained._packed.s is None and trained.weight.grad is not None


def test_a_machine_that_cannot_build_it_keeps_onednn(monkeypatch, tmp_path, skinny_mode):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="false could not build skinny.c"):
        skinny.build("false")
    assert not list((tmp_path / "native").glob("*.so"))  # nothing half-written left behind
    skinny.library.cache_clear()
    try:
        assert skinny.library() is None and skinny.max_rows() == 0
        skinny_mode("on")
        assert skinny_rows(torch.float32, 80, 48) == frozenset()
        assert product_form(torch.randn(3, 48), torch.randn(80, 48)) == "onednn"
    finally:
        skinny.library.cache_clear()  # later tests load the real build again


def test_greedy_speculation_on_the_kernel_is_plain_decoding(skinny_mode, device):
    """A verify's k + 1 rows run on the kernel (on a CPU; a GPU never takes it); the outputs stay plain decoding's."""
    skinny_mode("on")
    model = on(tiny_model(seed=3), device)
    prompts = random_prompts([9, 5, 12], model.cfg.vocab_size, seed=5)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)) for p in prompts]
    drafter = EagleDrafter(model, EagleHead(model.cfg).to(device), "float32", own_head=True)
    plain = Engine(model).generate(reqs[:1])
    spec = Engine(model).generate(reqs[:1], k=3, drafter=drafter)  # one row: its verify is 4 rows
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    served = torch.device(device).type == "cpu" and skinny.library() is not None and onednn_linear_available()
    assert (model.lm_head._packed.s is not None) is served
    plain, spec = Engine(model).generate(reqs), Engine(model).generate(reqs, k=1, drafter=drafter)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_a_drafter_probes_its_products_forms_when_built_not_in_a_step(skinny_mode, monkeypatch):
    monkeypatch.setenv("TLT_CPU_DRAFT_INT8", "off")  # int8 products take neither form
    draft_int8_pays.cache_clear()
    try:
        skinny_mode("on")
        policy = tiny_model()
        drafter = EagleDrafter(policy, EagleHead(policy.cfg), "float32", own_head=True)
        assert not drafter.int8_products
        probed = skinny_rows.cache_info().currsize
        assert probed >= len(linear_shapes(drafter.head)) > 0
    finally:
        draft_int8_pays.cache_clear()


def test_small_weights_are_not_timed(monkeypatch):
    """A small_weight sits in a core's caches, where a product costs its call: the probes take their fixed forms
    without timing it (a tiny model's job worker paid seconds for it); a larger shape is timed."""
    def timed(forms, rounds=3):
        raise AssertionError("timed")
    monkeypatch.setattr(linear_module, "fastest_seconds", timed)
    monkeypatch.setenv("TLT_CPU_ONE_ROW", "auto")
    monkeypatch.setenv("TLT_CPU_SKINNY", "auto")
    monkeypatch.setenv("TLT_CPU_DRAFT_INT8", "auto")
    for probe in (one_row_form, skinny_rows, draft_int8_pays):
        probe.cache_clear()
    try:
        assert draft_int8_pays(torch.float32, ((64, 192), (64, 64))) is False
        if onednn_linear_available():  # else every product is oneDNN's, untimed
            assert one_row_form(torch.float32, 64, 64) == "transposed"
            every = frozenset(range(2, skinny.max_rows() + 1)) if skinny.library() is not None else frozenset()
            assert skinny_rows(torch.float32, 64, 64) == every
            with pytest.raises(AssertionError, match="timed"):  # SmolLM2's k/v projection, 442 KB
                one_row_form(torch.float32, 192, 576)
    finally:
        for probe in (one_row_form, skinny_rows, draft_int8_pays):
            probe.cache_clear()
