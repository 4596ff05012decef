"""Int8 draft products (drafter.model.linear.draft_int8_pays, EagleDrafter.int8_products): where a CPU drafts faster
from int8 copies of the head's weights, "auto" serves the head's products from them while the head keeps its own
weights; outputs stay exact, copies follow weight updates and swaps, nothing else is touched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.eagle import EagleDrafter, linear_shapes
from drafter.draft.head import EagleHead
from drafter.model import linear as linear_module
from drafter.model.int8 import int8_linear_available
from drafter.model.linear import Linear, draft_int8_pays
from tests.conftest import on, random_prompts, tiny_model

needs_int8 = pytest.mark.skipif(not int8_linear_available(), reason="no fbgemm/x86 int8 kernels in this torch")


@pytest.fixture
def int8_mode(monkeypatch):
    """Sets TLT_CPU_DRAFT_INT8 for the test (draft_int8_pays's cache cleared before and after)."""
    def force(mode: str) -> None:
        monkeypatch.setenv("TLT_CPU_DRAFT_INT8", mode)
        draft_int8_pays.cache_clear()
    yield force
    draft_int8_pays.cache_clear()


def linears(head: EagleHead) -> list[Linear]:
    return [m for m in head.modules() if isinstance(m, Linear)]


@needs_int8
def test_a_linear_on_int8_products_is_close_and_follows_weight_updates():
    torch.manual_seed(0)
    layer = Linear(48, 80, bias=True)
    layer.int8 = True
    x = torch.randn(3, 48)
    with torch.inference_mode():
        for _ in range(2):
            got, want = layer(x), F.linear(x, layer.weight, layer.bias)
            assert layer._packed.q is not None and got.dtype == x.dtype
            assert float((got - want).norm() / want.norm()) < 0.05
            layer.weight.mul_(2.0)  # a swap in place: the int8 copy may not serve the old values
    x.requires_grad_(True)  # training ignores it: autograd's F.linear, exactly
    layer.weight.requires_grad_(True)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    assert copy.deepcopy(layer).int8 is False  # a copy is a plain layer again


def test_a_bad_setting_is_named(int8_mode):
    int8_mode("fast")
    with pytest.raises(ValueError, match="TLT_CPU_DRAFT_INT8 must be one of auto, on, off, got 'fast'"):
        draft_int8_pays(torch.float32, ((8, 8),))


@needs_int8
def test_the_probe_decides_once_per_dtype_and_shapes(int8_mode, monkeypatch):
    int8_mode("auto")
    monkeypatch.setattr(linear_module, "SMALL_WEIGHT_BYTES", 0)  # this tiny head timed too
    head = EagleHead(tiny_model().cfg)
    shapes = linear_shapes(head)
    assert len(linears(head)) == 6 and len(shapes) == 5  # o and the LM head share one
    assert set(shapes) == {tuple(m.weight.shape) for m in linears(head)}
    first = draft_int8_pays(torch.float32, shapes)
    assert isinstance(first, bool)
    assert draft_int8_pays(torch.float32, shapes) is first and draft_int8_pays.cache_info().hits >= 1


@needs_int8
def test_auto_serves_int8_products_on_a_cpu_only_and_explicit_precisions_never(int8_mode, device):
    int8_mode("on")
    policy = on(tiny_model(), device)
    drafter = EagleDrafter(policy, EagleHead(policy.cfg).to(device), "auto", own_head=True)
    cpu = torch.device(device).type == "cpu"
    assert drafter.int8_products is cpu
    assert drafter.precision.endswith(" (int8 products)") is cpu
    assert [m.int8 for m in linears(drafter.head)] == [cpu] * 6
    for explicit in ("float32", None):
        assert EagleDrafter(policy, EagleHead(policy.cfg).to(device), explicit).int8_products is False
    int8_mode("off")
    off = EagleDrafter(policy, EagleHead(policy.cfg).to(device), "auto", own_head=True)
    assert off.int8_products is False and not any(m.int8 for m in linears(off.head))


@needs_int8
def test_greedy_speculation_with_int8_products_is_plain_decoding(int8_mode, device):
    """The draft's precision moves only what it proposes: verification keeps the outputs plain decoding's."""
    int8_mode("on")
    model = on(tiny_model(seed=3), device)
    prompts = random_prompts([9, 5, 12], model.cfg.vocab_size, seed=5)
    reqs = [Request(p, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)) for p in prompts]
    head = EagleHead(model.cfg).to(device)
    drafter = EagleDrafter(model, head, "auto", own_head=True)
    plain = Engine(model).generate(reqs)
    spec = Engine(model).generate(reqs, k=3, drafter=drafter)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    if drafter.int8_products:
        assert drafter.head.lm_head._packed.q is not None  # it drafted from the int8 copies


@needs_int8
def test_an_in_place_swap_keeps_int8_products_and_a_callers_head_is_left_as_it_is(int8_mode):
    int8_mode("on")
    policy = tiny_model()
    drafter = EagleDrafter(policy, EagleHead(policy.cfg), "auto", own_head=True)
    served = drafter.head
    new = EagleHead(policy.cfg).to(served.fc.weight.dtype)
    with torch.no_grad():
        new.fc.weight.normal_()
    drafter.request_swap(new, 2)
    drafter.apply_pending_swap()
    assert drafter.head is served and torch.equal(served.fc.weight, new.fc.weight)  # written in place
    assert all(m.int8 for m in linears(served)) and not any(m.int8 for m in linears(new))
    # a head served as itself (in the serving dtype already, not handed over) is the caller's: left unmarked
    callers = EagleHead(policy.cfg).to(drafter.dtype)
    unowned = EagleDrafter(policy, callers, "auto")
    assert unowned.head is callers and unowned.int8_products
    assert not any(m.int8 for m in linears(callers))
