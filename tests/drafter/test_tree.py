"""Draft trees: shape, tree attention, greedy exactness and what they buy. (Sampled exactness is in
test_sampling.py, with the chi-square tests of every drafter.)"""

from __future__ import annotations

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.decode.tree import Tree, compact_path, parse_widths, tree_attention
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleHead
from drafter.model.causal_lm import draft_features
from tests.conftest import on, random_prompts, tiny_model
from tests.drafter.test_engine import EAGER, LENGTHS_8, fit_eagle_head, greedy_requests


def test_tree_shape_from_k_and_widths():
    tree = Tree.for_k(3, (3, 2), side_depth=2)
    # chain 0,00,000; beside depth 1: 1,10 and 2,20; beside depth 2: 01,010
    assert set(tree.paths) == {(0,), (0, 0), (0, 0, 0), (1,), (1, 0), (2,), (2, 0), (0, 1), (0, 1, 0)}
    assert (tree.num_nodes, tree.max_depth, tree.width) == (9, 3, 3)
    for j, p in enumerate(tree.paths, start=1):
        assert int(tree.depth[j]) == len(p)
        parent = int(tree.parent[j])
        assert (tree.paths[parent - 1] if parent else ()) == p[:-1]
        assert int(tree.children[parent, p[-1]]) == j
        assert tree.ancestors[j, 0] and tree.ancestors[j, j] and tree.ancestors[j].sum() == len(p) + 1
    assert parent < j  # parents come first
    assert Tree.for_k(4, ()).is_chain and Tree.for_k(4, ()).num_nodes == 4
    assert Tree.for_k(2, (2, 2, 2)).num_nodes == 4  # widths past k are ignored


def test_bad_tree_specs_name_the_problem():
    with pytest.raises(ValueError, match="no parent"):
        Tree([(0,), (1, 0)])
    with pytest.raises(ValueError, match="needs candidate 1"):
        Tree([(0,), (2,)])
    with pytest.raises(ValueError, match="non-empty"):
        Tree([()])
    with pytest.raises(ValueError, match="comma-separated"):
        parse_widths("3;2")
    with pytest.raises(ValueError, match="1..16"):
        parse_widths("0,2")
    assert parse_widths("3,2") == (3, 2) and parse_widths("") == () and parse_widths(None) == ()
    with pytest.raises(ValueError, match="tree_side_depth"):
        EagleDrafter(tiny_model(), EagleHead(tiny_model().cfg), tree="2", tree_side_depth=0)


def test_tree_attention_sees_the_prefix_and_the_ancestors_only(device):
    tree = Tree.for_k(2, (2,))  # nodes: 1=(0,), 2=(1,), 3=(0,0)
    base = torch.tensor([3, 5], device=device)
    mask = tree_attention(base, torch.arange(4, device=device), tree, 0, 9)[:, 0].cpu()  # (B, T, S)
    assert mask.shape == (2, 4, 9)
    for b, n in enumerate(base.tolist()):
        for t, visible in enumerate(mask[b]):
            own = {n + a for a in range(4) if tree.ancestors[t, a]}
            assert {s for s in range(9) if visible[s]} == set(range(n)) | own
    head = tree_attention(base, torch.tensor([1, 3], device=device), tree, 1, 8)[0, 0].cpu()  # node j: slot base+j-1
    assert head[1].tolist() == [True] * 3 + [True, False, True] + [False] * 2


def test_compaction_moves_the_accepted_path_into_sequence(device):
    cache = tiny_model().to(device).new_cache(2, 8, extra=4)
    slots = torch.arange(cache.max_len, device=device).float()
    cache.k[:] = slots.view(1, 1, -1, 1, 1)
    cache.lens = torch.tensor([2, 4], device=device)
    compact_path(cache, torch.tensor([[2, 5, 0], [1, 3, 0]], device=device), torch.tensor([2, 1], device=device))
    assert cache.k[0, 0, :, 0, 0].tolist()[:6] == [0, 1, 2, 4, 7, 5]  # slots 3, 4 <- 4, 7
    assert cache.k[0, 1, :, 0, 0].tolist()[:8] == [0, 1, 2, 3, 4, 5, 6, 7]  # node 1 is already in place


@pytest.mark.parametrize("tree", ["2", "3,2", "2,2,2"])
@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize(("dtype", "max_batch"), [(None, 8), ("bfloat16", 4)])
def test_greedy_tree_equals_plain(tiny, tree, k, dtype, max_batch, device):
    """max_batch 4 of 8 rows: chain steps until only four rows are live, tree steps after."""
    model = on(tiny, device)
    engine = Engine(model, **EAGER)
    requests = greedy_requests(random_prompts(LENGTHS_8, tiny.cfg.vocab_size))
    plain = engine.generate(requests)
    drafter = EagleDrafter(model, EagleHead(tiny.cfg), dtype, tree=tree, tree_side_depth=2, tree_max_batch=max_batch,
                           **EAGER)
    assert drafter.tree_for(k, 1) is not None
    spec = engine.generate(requests, k=k, drafter=drafter, record_hidden=True)
    for a, b in zip(plain, spec):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        assert b.num_steps <= a.num_steps
        assert b.num_draft_tokens >= b.num_accepted


@pytest.fixture(scope="module")
def fitted(device):
    model = tiny_model(vocab_size=32, seed=5, std=0.4).to(device)
    prompts = random_prompts([4] * 32, model.cfg.vocab_size, seed=7)
    # a short fit: a head that misses now and then (a perfect one leaves a tree nothing to catch)
    return model, prompts, fit_eagle_head(model, prompts, steps=60)


def test_fitted_head_accepts_more_as_a_tree_and_stays_lossless(fitted):
    """The second and third candidates catch what the first misses: more tokens per verify forward
    than the chain of the same depth, with output still equal to plain decoding."""
    model, prompts, head = fitted
    engine = Engine(model, **EAGER)
    requests = greedy_requests(prompts[:8], max_new_tokens=32)
    plain = engine.generate(requests)
    chain = engine.generate(requests, k=4, drafter=EagleDrafter(model, head))
    tree = engine.generate(requests, k=4, drafter=EagleDrafter(model, head, tree="3,2", tree_side_depth=2,
                                                               tree_max_batch=len(requests), **EAGER))  # every step
    for outs in (chain, tree):
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]

    def steps(outs):
        return sum(o.num_steps for o in outs)

    assert steps(tree) < steps(chain) < steps(plain)


def test_tree_records_the_hidden_states_of_the_accepted_path(fitted):
    """Accepted side candidates must hand on their own policy states (and leave their K/V in
    sequence), or the next step and the harvested training data would be wrong."""
    model, prompts, head = fitted
    drafter = EagleDrafter(model, head, tree="3,3", tree_side_depth=2, **EAGER)
    out = Engine(model, **EAGER).generate(greedy_requests(prompts[:1], max_new_tokens=40), k=4, drafter=drafter,
                                          record_hidden=True)[0]
    seq = torch.tensor([out.prompt_ids + out.token_ids], device=model.device)
    L, P = seq.shape[1], len(out.prompt_ids)
    _, hidden, aux = model(seq, torch.arange(L, device=model.device).unsqueeze(0), model.new_cache(1, L),
                           logits_for="none", aux_layers=head.aux_layers)
    feats = draft_features(hidden, aux)  # (1, L, 4D): what a draft head trains on
    # a wrong path differs by O(1); on a GPU the tree's verify forwards and this full forward run float32 kernels of
    # other shapes, which round differently (up to 3e-4 in this model's large activations on an H100)
    tol = 1e-4 if model.device.type == "cpu" else 1e-3
    torch.testing.assert_close(out.hidden_states, feats[0, P - 1 : L - 1], atol=tol, rtol=tol)
    assert out.num_accepted > 0


def test_sampled_rows_beside_greedy_rows_and_the_context_limit(device):
    """A mixed batch: the greedy rows still equal plain decoding; a row at the context's end stops
    with 'length' though the tree's side slots reach past it. The sampled row drafts its tree at T=1."""
    model = tiny_model(max_position=40).to(device)
    engine = Engine(model, **EAGER)
    prompts = random_prompts([30, 5, 7], model.cfg.vocab_size, seed=2)
    params = [SamplingParams(max_new_tokens=100), SamplingParams(temperature=1.0, max_new_tokens=20, seed=1),
              SamplingParams(max_new_tokens=20)]
    reqs = [Request(p, sp) for p, sp in zip(prompts, params)]
    plain = engine.generate(reqs)
    drafter = EagleDrafter(model, EagleHead(model.cfg), tree="3,2", tree_side_depth=2, **EAGER)
    assert drafter.tree_for(4, 3) is not None and drafter.tree_for(4, 5) is None  # tree_max_batch: 4
    spec = engine.generate(reqs, k=4, drafter=drafter)
    assert len(spec[0].token_ids) == 10 and spec[0].finish_reason == "length"
    assert spec[0].token_ids == plain[0].token_ids and spec[2].token_ids == plain[2].token_ids
    assert len(spec[1].token_ids) == 20
    again = engine.generate(reqs, k=4, drafter=EagleDrafter(model, EagleHead(model.cfg), tree="3,2",
                                                             tree_side_depth=2, **EAGER))
    assert again[1].token_ids == spec[1].token_ids  # sampled rows reproduce per seed
