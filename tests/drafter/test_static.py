"""The static decode path (drafter.decode.static, drafter.draft.draft_graphs) against the eager one: same logits up to
rounding, same tokens greedy and seeded, on CPU (where the same static path runs uncaptured) and on CUDA
(captured in graphs)."""

from __future__ import annotations

import copy

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.decode.static import (
    StaticRunner,
    additive_mask,
    attend,
    batch_bucket,
    fold_mask,
    rotate_half_matrix,
    slot_bucket,
)
from drafter.draft.drafters import NgramDrafter
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleHead
from drafter.model.causal_lm import CausalLM
from drafter.model.config import ModelConfig
from tests.conftest import random_prompts, structured_model, tiny_model

LENGTHS = [1, 3, 5, 9, 2, 17, 4, 33]


def top_level_aten_ops(fn) -> int:
    """Top-level aten ops of fn(): profiler events named aten::* whose parent is not an aten op."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def test_buckets_and_rotation():
    assert [batch_bucket(n) for n in (1, 3, 5, 128, 129, 200)] == [1, 4, 8, 128, 192, 256]
    assert [slot_bucket(n, 1000) for n in (1, 64, 65, 600, 999)] == [64, 64, 128, 1000, 1000]
    x = torch.randn(3, 8)
    assert torch.equal(x @ rotate_half_matrix(8, torch.float32, torch.device("cpu")),
                       torch.cat([-x[:, 4:], x[:, :4]], dim=-1))


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_static_forward_matches_eager(device, num_tokens):
    model = tiny_model(seed=3).to(device)
    runner = StaticRunner(model, max_batch=3, max_len=128)
    cache = model.new_cache(3, 128)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (3, 20), generator=g).to(device)
    positions = torch.arange(20, device=device).expand(3, 20)
    aux = (0, 1, 2)
    with torch.inference_mode():
        model(prompt, positions, cache, logits_for="none")
        runner.forward(prompt, positions, 20, aux)
        for step in range(3):  # replays of one captured shape, at moving positions
            ids = torch.randint(0, 64, (3, num_tokens), generator=g).to(device)
            pos = 20 + step * num_tokens + torch.arange(num_tokens, device=device).expand(3, num_tokens)
            want, hidden, states = model(ids, pos, cache, aux_layers=aux)
            got, feats = runner.forward(ids, pos, int(pos.max()) + 1, aux)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(feats[..., -hidden.shape[-1]:], hidden, atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(feats[..., : states.shape[-1]], states, atol=2e-4, rtol=2e-4)
            assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_static_runner_rejects_bad_sizes():
    model = tiny_model()
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        StaticRunner(model, 0, 64)
    with pytest.raises(ValueError, match="beyond the model's context"):
        StaticRunner(model, 1, model.cfg.max_position + 1)
    runner = StaticRunner(model, 2, 64)
    ids = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(ValueError, match="num_slots must be in"):
        runner.forward(ids, ids, 65)
    with pytest.raises(ValueError, match="larger than this runner's cache"):
        runner.forward(torch.zeros(3, 1, dtype=torch.long), torch.zeros(3, 1, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="aux_layers \\[7\\]"):
        runner.forward(ids, ids, 4, aux_layers=(7,))


def _requests(prompts, temperature: float, max_new_tokens: int = 40):
    # every third row greedy: one batch mixes greedy and sampled rows
    return [Request(p, SamplingParams(max_new_tokens=max_new_tokens, seed=i,
                                      temperature=temperature if i % 3 else 0.0)) for i, p in enumerate(prompts)]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
@pytest.mark.parametrize("drafter_name", ["none", "ngram", "eagle"])
def test_static_engine_equals_eager(device, temperature, drafter_name):
    """Same requests, same seeds: the static path emits exactly the eager path's tokens, plain and speculative
    (rows finish at different steps, so the batch shrinks through its buckets)."""
    model = copy.deepcopy(structured_model()).to(device)  # the cached one stays on the CPU
    prompts = random_prompts(LENGTHS, model.cfg.vocab_size)
    requests = _requests(prompts, temperature)
    head = EagleHead(model.cfg).to(device)
    outs, accepted = [], []
    for static in (False, True):
        engine = Engine(model, static=static)
        drafter = {"none": None, "ngram": NgramDrafter(),
                   "eagle": EagleDrafter(model, head, static=static)}[drafter_name]
        outs.append(engine.generate(requests, k=0 if drafter is None else 3, drafter=drafter))
        accepted.append(engine.stats.num_accepted)
    for eager, static in zip(*outs):
        assert static.token_ids == eager.token_ids
        assert static.finish_reason == eager.finish_reason
    assert accepted[0] == accepted[1]
    if temperature == 0.0:  # and speculation stays lossless: plain decoding's tokens
        plain = Engine(model, static=False).generate(requests)
        assert [o.token_ids for o in outs[1]] == [o.token_ids for o in plain]


def test_static_engine_keeps_its_runner_between_calls(device):
    model = tiny_model().to(device)
    engine = Engine(model, static=True)
    requests = _requests(random_prompts([4, 6], model.cfg.vocab_size), 0.0, max_new_tokens=8)
    engine.generate(requests)
    runner = engine.runner
    assert runner is not None and engine.shapes.num_rebuilds == 1  # kept on a CPU too: no cache made per call
    engine.generate(requests[:1])
    assert engine.runner is runner  # smaller batch, same room: same cache (and graphs)
    engine.generate(_requests(random_prompts([4, 6, 5], model.cfg.vocab_size), 0.0, max_new_tokens=100))
    assert engine.runner is not runner and engine.runner.cache.max_len >= 106


def test_the_cpu_default_takes_the_static_path_for_chains_and_the_eager_one_for_trees():
    model = tiny_model()
    head = EagleHead(model.cfg)
    requests = _requests(random_prompts([4, 6], model.cfg.vocab_size), 0.0, max_new_tokens=8)
    engine = Engine(model)
    plain = engine.generate(requests)
    assert engine.static
    chain = engine.generate(requests, k=3, drafter=EagleDrafter(model, head))
    assert engine.static
    tree = engine.generate(requests, k=3, drafter=EagleDrafter(model, head, tree="2,2"))
    assert not engine.static  # a tree's side slots: the eager path
    assert [o.token_ids for o in chain] == [o.token_ids for o in tree] == [o.token_ids for o in plain]


def test_static_forward_is_lean():
    """The static path's forward at batch 1, SmolLM2-135M's shape: at most 600 top-level aten ops (the eager
    path takes 1,663); on a GPU each is about one launch, and the graph replays them all at once."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig()).eval().requires_grad_(False)
    runner = StaticRunner(model, 1, 256)
    runner.onednn = False  # the GPU's path (aten's GEMMs), not the CPU's oneDNN ones
    ids, pos = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), 128)
    with torch.inference_mode():
        runner.forward(ids, pos, 129)
        num_ops = top_level_aten_ops(lambda: runner.forward(ids, pos, 129))
    assert num_ops <= 600, num_ops


def test_static_drafter_top_k_top_p_and_swaps(device):
    """Rows with top-k/top-p (their drafting runs uncaptured) and heads swapped mid-generation (the next step
    re-feeds every true pair): the static drafter's tokens are still the eager drafter's."""
    model = copy.deepcopy(structured_model()).to(device)
    prompts = random_prompts(LENGTHS, model.cfg.vocab_size, seed=5)
    requests = [Request(p, SamplingParams(max_new_tokens=30, seed=i, temperature=1.0, top_k=5 if i % 2 else 0,
                                          top_p=0.9 if i % 3 == 0 else 1.0)) for i, p in enumerate(prompts)]
    heads = [EagleHead(model.cfg).to(device), EagleHead(model.cfg, init=False).to(device)]
    with torch.no_grad():
        for p in heads[1].parameters():
            p.normal_(0, 0.05)
    outs = []
    for static in (False, True):
        drafter = EagleDrafter(model, heads[0], static=static)

        def swap(num_finished: int, num_generated: int, drafter=drafter) -> None:
            if num_generated % 7 == 0:
                drafter.request_swap(heads[num_generated % 2], version=num_generated)

        outs.append(Engine(model, static=static).generate(requests, k=3, drafter=drafter, on_step=swap))
        assert drafter.swaps.num_swaps > 0
    assert [o.token_ids for o in outs[0]] == [o.token_ids for o in outs[1]]


def test_folding_a_groups_query_heads_equals_grouped_attention(device):
    """The static path folds the G query heads of a KV group into the query length (one KV head stored, SDPA's
    fused kernel under a repeated mask) on every device; SDPA's own grouping (enable_gqa) reads the same cache and
    agrees, at one token and at a verify's five."""
    torch.manual_seed(0)
    H, Hkv, D, B, S = 6, 2, 8, 3, 64
    cache = torch.zeros(B, 2 * Hkv, 1, S, D, device=device)
    keys, values = cache[:, :Hkv].flatten(1, 2), cache[:, Hkv:].flatten(1, 2)  # (B, Hkv, S, D)
    rotate = rotate_half_matrix(D, torch.float32, torch.device(device))
    for T in (1, 5):
        positions = (torch.arange(T, device=device) + torch.tensor([[3], [9], [20]], device=device))  # (B, T)
        cos = torch.rand(B, T, 1, 1, D, device=device)
        rope = (cos, (1 - cos**2).sqrt())
        qkv = torch.randn(B * T, (H + 2 * Hkv) * D, device=device)
        mask = additive_mask(torch.arange(S, device=device), positions, torch.float32)
        rows = torch.arange(B, device=device).view(B, 1)
        grouped = attend(qkv, rope, rotate, cache, keys, values, rows, positions, mask, (H, Hkv, D), False)
        folded = attend(qkv, rope, rotate, cache, keys, values, rows, positions, mask, (H, Hkv, D), True)
        prefolded = attend(qkv, rope, rotate, cache, keys, values, rows, positions, fold_mask(mask, H // Hkv),
                           (H, Hkv, D), True)
        torch.testing.assert_close(folded, grouped, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(prefolded, grouped, atol=1e-5, rtol=1e-5)
        assert grouped.shape == (B * T, H * D)
