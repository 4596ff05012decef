"""Under sampling, speculative decoding must keep the policy's distribution over whole sequences.

Exact enumeration: on a 6-token vocabulary every 3-token continuation's probability is computed from
the policy, and 20k speculative samples are checked against it with a chi-square test. The same test
must reject deliberately wrong verifiers, so its threshold is known to have teeth.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import drafter.decode.engine as engine_mod
import drafter.decode.verify_graphs as verify_graphs_mod
from drafter.decode import sampling
from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import BatchSampling, SamplingParams, Verdict, token_probs
from drafter.decode.tree import Tree, TreeVerdict, verify_tree
from drafter.draft.combined import CombinedDrafter
from drafter.draft.drafters import Drafter, NgramDrafter, Proposal
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleConfig, EagleHead
from drafter.draft.history import HistoryDrafter
from drafter.model.int8 import int8_linear_available
from tests.conftest import tiny_model

VOCAB, NEW, NUM_SAMPLES, ALPHA = 6, 3, 20_000, 1e-3
PROMPT = [1, 2, 1, 2, 1]
NEEDS_INT8 = pytest.mark.skipif(not int8_linear_available(), reason="no fbgemm/x86 int8 kernels in this torch")
PARAMS = {"temperature": 0.9, "top_k": 5, "top_p": 0.95}


def policy():
    torch.manual_seed(0)
    return tiny_model(vocab_size=VOCAB, seed=0, std=0.5, max_position=64)


@pytest.fixture(scope="module")
def model():
    return policy()


@pytest.fixture(scope="module")
def exact(model) -> dict[tuple[int, ...], float]:
    return exact_probs(model)


def exact_probs(model) -> dict[tuple[int, ...], float]:
    """P(continuation) for every continuation, from full forwards of the policy."""
    seqs = list(itertools.product(range(VOCAB), repeat=NEW))
    ids = torch.tensor([PROMPT + list(s) for s in seqs])  # (N, L)
    N, L = ids.shape
    logits, _ = model(ids, torch.arange(L).expand(N, L), model.new_cache(N, L))
    bs = BatchSampling.from_params([SamplingParams(**PARAMS)] * N)
    p = token_probs(logits, bs)[:, len(PROMPT) - 1 : -1]  # (N, NEW, V): the step producing each token
    probs = p.gather(-1, ids[:, len(PROMPT) :].unsqueeze(-1)).squeeze(-1).prod(-1)
    return dict(zip(seqs, probs.tolist()))


def sample_pvalue(model, exact, k, drafter) -> float:
    reqs = [Request(PROMPT, SamplingParams(**PARAMS, max_new_tokens=NEW, seed=i)) for i in range(NUM_SAMPLES)]
    return pvalue_of(Engine(model).generate(reqs, k=k, drafter=drafter), exact)


def pvalue_of(outs, exact) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    keys = list(exact)
    obs = np.array([counts.get(s, 0) for s in keys], dtype=float)
    expected = np.array([exact[s] for s in keys]) * NUM_SAMPLES
    if obs[expected == 0].sum() > 0:
        return 0.0  # a sequence the policy can never produce
    obs, expected = obs[expected > 0], expected[expected > 0]
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = np.append(obs[big], obs[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    obs, expected = obs[keep], expected[keep] * obs[keep].sum() / expected[keep].sum()
    return float(chisquare(obs, expected).pvalue)


class NoisyPolicyDrafter(Drafter):
    """Drafts by sampling a perturbed copy of the policy: q overlaps p without equalling it, which is
    the regime where a wrong rejection rule shows (a random draft head's q barely overlaps p)."""

    name = "noisy-policy"

    def __init__(self, policy, noise: float = 0.3, seed: int = 3, tree: tuple[int, ...] = ()) -> None:
        self.model = copy.deepcopy(policy)
        self.widths = tree
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * noise)

    def next_probs(self, ctx: list[list[int]], sampling_) -> torch.Tensor:
        B, lens = len(ctx), torch.tensor([len(c) for c in ctx])
        L = int(lens.max())
        ids = torch.zeros(B, L, dtype=torch.long)
        for b, c in enumerate(ctx):
            ids[b, : len(c)] = torch.tensor(c)
        logits, _ = self.model(ids, torch.arange(L).expand(B, L), self.model.new_cache(B, L))
        return token_probs(logits[torch.arange(B), lens - 1].unsqueeze(1), sampling_)[:, 0]  # (B, V)

    def propose(self, contexts, caps, sampling_, uniforms, width=None):
        B, K = len(contexts), max(caps)
        ctx = [list(c) for c in contexts]
        tokens = torch.zeros(B, K, dtype=torch.long)
        probs = torch.zeros(B, K, VOCAB)
        for j in range(K):
            q = self.next_probs(ctx, sampling_)
            x = sampling.sample(q, uniforms[:, j])
            tokens[:, j], probs[:, j] = x, q
            for b in range(B):
                ctx[b].append(int(x[b]))
        return Proposal(tokens, torch.tensor(caps), probs)

    def tree_for(self, k, batch_size=1):
        return Tree.for_k(k, self.widths, 2) if self.widths else None

    def propose_tree(self, contexts, caps, sampling_, uniforms, tree):
        """An independent reading of drafter.decode.tree's contract: each node's candidates drawn without
        replacement from the noisy policy at that node; a candidate past the draft's support is not proposed."""
        B, N = len(contexts), tree.num_nodes
        tokens, probs = torch.zeros(B, N, dtype=torch.long), torch.zeros(B, N, VOCAB)
        valid = tree.depth[1:].view(1, N) <= torch.tensor(caps).view(B, 1)
        for par in range(N + 1):
            kids = [int(c) for c in tree.children[par] if c > 0]
            if not kids:
                continue
            path = [j for j in range(1, N + 1) if tree.ancestors[par, j]]  # parents before children
            q = self.next_probs([list(c) + tokens[b, [j - 1 for j in path]].tolist()
                                 for b, c in enumerate(contexts)], sampling_)
            for j in kids:
                mass = q.sum(-1, keepdim=True)
                valid[:, j - 1] &= (mass[:, 0] > 0) & (valid[:, par - 1] if par else True)
                q = torch.where(mass > 0, q / mass.clamp(min=1e-30), torch.ones_like(q) / VOCAB)
                x = sampling.sample(q, uniforms[:, j - 1])
                tokens[:, j - 1], probs[:, j - 1] = x, q
                q = q.scatter(1, x.unsqueeze(1), 0.0)
        return Proposal(tokens, valid.sum(1), probs, valid)


def make_drafter(name, model):
    """ngram, history (every request shares the prompt: one group, siblings streaming in), history-stored (with an
    earlier response), combined (history where its match holds 2 tokens, else an untrained head), eagle, eagle-T
    (draft temperature T; 0: the argmax is proposed), eagle-bf16 and eagle-int8 (drafts in bf16, or with int8
    weights), noisy-policy; a "-tree" suffix drafts a tree with 3 candidates at depth 1 and 2 at depth 2."""
    tree = (3, 2) if name.endswith("-tree") else ()
    name = name.removesuffix("-tree")
    if name == "ngram":
        return NgramDrafter()
    if name == "history":
        return HistoryDrafter()
    if name == "history-stored":  # an earlier response every row drafts first: far likelier than the policy makes it
        drafter = HistoryDrafter(tree=tree, tree_side_depth=2, tree_max_batch=NUM_SAMPLES)
        drafter.remember(PROMPT, [3, 3, 3])
        if tree:  # more candidates, ones the policy often emits: the residuals between them matter
            drafter.remember(PROMPT, [0, 4, 2])
            drafter.remember(PROMPT, [4, 4, 4])
        return drafter
    if name == "combined":
        return CombinedDrafter(make_drafter("eagle", model), HistoryDrafter(), min_match=2)
    if name.startswith("eagle"):
        dtype = {"bf16": "bfloat16", "int8": "int8"}.get(name.rpartition("-")[2])
        tau = float(name.removesuffix("-bf16").removesuffix("-int8").partition("-")[2] or 1.0)
        head = EagleHead(model.cfg, EagleConfig(draft_temperature=tau, init_seed=1))
        return EagleDrafter(model, head, dtype, tree=tree, tree_side_depth=2, tree_max_batch=NUM_SAMPLES)
    return NoisyPolicyDrafter(model, tree=tree)


def test_exact_distribution_sums_to_one(exact):
    assert abs(sum(exact.values()) - 1) < 1e-4


def test_plain_sampling_matches_policy(model, exact):
    assert sample_pvalue(model, exact, 0, None) > ALPHA


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("drafter_name", ["ngram", "history", "combined", "eagle", "noisy-policy"])
def test_speculative_sampling_matches_policy(model, exact, k, drafter_name):
    assert sample_pvalue(model, exact, k, make_drafter(drafter_name, model)) > ALPHA


def test_drafts_from_an_earlier_response_stay_lossless(model, exact):
    """Every row first drafts a stored response ([3, 3, 3]) far likelier than the policy makes it; the same drafts
    with every token accepted fail the test (test_wrong_verifier_fails_the_test)."""
    assert sample_pvalue(model, exact, 2, make_drafter("history-stored", model)) > ALPHA


@pytest.mark.parametrize("drafter_name", ["eagle-0.5", "eagle-0", "eagle-bf16",
                                          pytest.param("eagle-int8", marks=NEEDS_INT8)])
def test_sharpened_or_bf16_drafts_stay_lossless(model, exact, drafter_name):
    assert sample_pvalue(model, exact, 2, make_drafter(drafter_name, model)) > ALPHA


@pytest.mark.parametrize("drafter_name", ["noisy-policy-tree", "history-stored-tree", "eagle-tree", "eagle-0-tree",
                                          "eagle-bf16-tree",
                                          pytest.param("eagle-int8-tree", marks=NEEDS_INT8)])
def test_tree_drafts_stay_lossless(model, exact, drafter_name):
    """Several candidates per position, verified by recursive rejection sampling: still the policy's
    distribution (k=2: every node of the tree can be reached within the 3 tokens)."""
    assert sample_pvalue(model, exact, 2, make_drafter(drafter_name, model)) > ALPHA


class Cycle:
    """Switches the draft length every step (0 included), as an adaptive chooser may."""

    def __init__(self, ks: list[int]) -> None:
        self.ks, self.num_steps = ks, 0

    def choose(self, batch_size: int) -> int:
        self.num_steps += 1
        return self.ks[(self.num_steps - 1) % len(self.ks)]

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None:
        return None

    def record_rows(self, batch_size: int, k: int, rows: list[tuple[int, int]]) -> None:
        pass


@pytest.mark.parametrize("ks", [[0, 2], [1, 0, 3], [2, 1]])
@pytest.mark.parametrize("drafter_name", ["eagle", "noisy-policy"])
def test_draft_length_switching_step_to_step_stays_lossless(model, exact, ks, drafter_name):
    """Adaptive speculation (drafter.draft.adaptive) changes k between steps from what past steps measured."""
    reqs = [Request(PROMPT, SamplingParams(**PARAMS, max_new_tokens=NEW, seed=i)) for i in range(NUM_SAMPLES)]
    tuner = Cycle(ks)
    outs = Engine(model).generate(reqs, k=3, drafter=make_drafter(drafter_name, model), tuner=tuner)
    assert tuner.num_steps >= 2
    assert pvalue_of(outs, exact) > ALPHA


def accept_always(target_logits, draft_tokens, draft_lens, draft_probs, sampling_, uniforms):
    v = sampling.verify(target_logits, draft_tokens, draft_lens, draft_probs, sampling_, uniforms)
    return Verdict(draft_lens.clone(), v.next_tokens)


def resample_from_target(target_logits, draft_tokens, draft_lens, draft_probs, sampling_, uniforms):
    """The classic bug: on rejection, sample p instead of norm(max(0, p - q))."""
    v = sampling.verify(target_logits, draft_tokens, draft_lens, draft_probs, sampling_, uniforms)
    p = token_probs(target_logits, sampling_)
    rows = torch.arange(p.shape[0])
    return Verdict(v.num_accepted, sampling.sample(p[rows, v.num_accepted], uniforms[:, -1]))


@pytest.mark.parametrize(("wrong", "drafter_name"), [(accept_always, "ngram"), (accept_always, "eagle"),
                                                    (accept_always, "noisy-policy"),
                                                    (accept_always, "history-stored"),
                                                    (resample_from_target, "noisy-policy")])
def test_wrong_verifier_fails_the_test(model, exact, monkeypatch, wrong, drafter_name):
    # the engine verifies a chain through its VerifyGraphs, which runs that module's verify (eagerly, over its
    # buffers, or captured in a graph on CUDA)
    monkeypatch.setattr(verify_graphs_mod, "verify", wrong)
    assert sample_pvalue(model, exact, 2, make_drafter(drafter_name, model)) < ALPHA


def reference_verify_tree(target_logits, tree, tokens, valid, draft_probs, sampling_, uniforms,
                          update_residual: bool = True) -> TreeVerdict:
    """Recursive rejection sampling one row and one candidate at a time, written from the paper's
    description; update_residual=False is the classic multi-candidate bug (every candidate tested
    against the target itself)."""
    p = token_probs(target_logits, sampling_)
    B, W = p.shape[0], max(tree.width, 1)
    path, num, nxt = torch.zeros(B, tree.max_depth, dtype=torch.long), torch.zeros(B, dtype=torch.long), []
    for b in range(B):
        cur, r = 0, p[b, 0]
        for d in range(tree.max_depth):
            moved = False
            for i in range(W):
                c = int(tree.children[cur, i])
                if c <= 0 or not valid[b, c - 1]:
                    continue
                x = int(tokens[b, c - 1])
                # None: deterministic candidates (history drafts), each drawn from a one-hot q
                q = draft_probs[b, c - 1] if draft_probs is not None else torch.nn.functional.one_hot(
                    torch.tensor(x), p.shape[-1]).to(p.dtype)
                if uniforms[b, d * W + i] * q[x] < r[x]:
                    path[b, d], num[b], cur, r, moved = c, num[b] + 1, c, p[b, c], True
                    break
                rest = (r - q).clamp(min=0)
                if update_residual and rest.sum() > 0:
                    r = rest / rest.sum()
            if not moved:
                break
        nxt.append(int(sampling.sample(r.unsqueeze(0), uniforms[b, -1:])[0]))
    return TreeVerdict(path, num, torch.tensor(nxt))


def test_tree_verifier_agrees_with_a_reference():
    """Same inputs, same uniforms: the batched verifier takes the reference's path and next token,
    for greedy and sampled rows mixed, ragged validity, and drafts drawn without replacement or one-hot."""
    g = torch.Generator().manual_seed(0)
    tree = Tree.for_k(3, (3, 2), 2)
    B, N, V = 64, tree.num_nodes, 7
    bs = BatchSampling.from_params([SamplingParams(temperature=0.0 if b % 5 == 0 else 1.0) for b in range(B)])
    target = torch.randn(B, N + 1, V, generator=g) * 1.5
    probs = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    tokens = torch.multinomial(probs.flatten(0, 1), 1, generator=g).view(B, N)
    tokens[::3] = target[::3, tree.parent[1:]].argmax(-1)  # some rows guess the target's favourites
    valid = tree.depth[1:].view(1, N) <= torch.randint(0, 4, (B, 1), generator=g)
    uniforms = torch.rand(B, tree.num_uniforms, generator=g)
    for q in (probs, None):  # None: deterministic candidates (history drafts), one-hot q
        got = verify_tree(target, tree, tokens, valid, q, bs, uniforms)
        want = reference_verify_tree(target, tree, tokens, valid, q, bs, uniforms)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.path, want.path)
        assert torch.equal(got.next_tokens, want.next_tokens)
        assert int(got.num_accepted.sum()) > 0 and bool((got.num_accepted == 0).any())


@pytest.mark.parametrize("drafter_name", ["noisy-policy-tree", "history-stored-tree"])
def test_wrong_tree_verifier_fails_the_test(model, exact, monkeypatch, drafter_name):
    """Testing every candidate against the target instead of the residual left by the rejected ones
    mis-weights the candidates (sampled or one-hot): the chi-square test must see it."""
    def no_residual(*args):
        return reference_verify_tree(*args, update_residual=False)

    monkeypatch.setattr(engine_mod, "verify_tree", no_residual)
    assert sample_pvalue(model, exact, 2, make_drafter(drafter_name, model)) < ALPHA


def test_token_probs_top_k_top_p_and_greedy():
    logits = torch.tensor([[[2.0, 1.0, 0.5, 0.0, -1.0]]]).repeat(4, 1, 1)  # (4, 1, 5)
    bs = BatchSampling(torch.tensor([1.0, 1.0, 0.5, 0.0]), torch.tensor([2, 0, 0, 0]),
                       torch.tensor([1.0, 0.8, 1.0, 1.0]))
    p = token_probs(logits, bs)[:, 0]
    ref = logits[0, 0].softmax(-1)
    torch.testing.assert_close(p[0], torch.cat([ref[:2] / ref[:2].sum(), torch.zeros(3)]))
    # top_p=0.8: the top two hold 0.77 < 0.8, so the smallest prefix reaching 0.8 has three tokens
    torch.testing.assert_close(p[1], torch.cat([ref[:3] / ref[:3].sum(), torch.zeros(2)]))
    torch.testing.assert_close(p[2], (logits[0, 0] / 0.5).softmax(-1))
    assert p[3].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def _full_sort_reference(logits: torch.Tensor, bs: BatchSampling) -> torch.Tensor:
    """Top-k then top-p by sorting the whole vocabulary: what the candidate shortcut must equal."""
    B, T, V = logits.shape
    logits = logits / bs.temperature.view(B, 1, 1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(V).view(1, 1, V)
    k = torch.where(bs.top_k > 0, bs.top_k, torch.full_like(bs.top_k, V)).view(B, 1, 1)
    drop = rank >= k
    sp = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    drop = drop | ((sp.cumsum(-1) - sp) >= bs.top_p.view(B, 1, 1))
    drop[..., 0] = False
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf"))).softmax(-1)


@pytest.mark.parametrize("wide_k", [10, 500])  # 500: a top-k past the candidates forces the full sort
@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat and typical: nuclei past 64 tokens; peaked
def test_top_k_top_p_shortcut_equals_a_full_sort(scale, wide_k, monkeypatch):
    monkeypatch.setattr(sampling, "TRUNCATION_CANDIDATES", 64)
    sorts = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda self, *a, **kw: sorts.append(1) or real_sort(self, *a, **kw))
    g = torch.Generator().manual_seed(int(scale * 100))
    V = 3000
    logits = torch.randn(6, 3, V, generator=g) * scale
    bs = BatchSampling(torch.tensor([1.0, 0.7, 1.3, 1.0, 1.0, 0.9]), torch.tensor([0, 0, 50, 64, wide_k, 10]),
                       torch.tensor([0.9, 0.95, 0.8, 1.0, 0.99, 0.5]))
    got = token_probs(logits, bs)
    sorted_everything = bool(sorts)
    torch.testing.assert_close(got, _full_sort_reference(logits, bs), rtol=1e-5, atol=1e-6)
    kept = (got > 0).sum(-1)
    assert int(kept.max()) > 1 and int(kept.min()) >= 1
    assert sorted_everything == (scale < 8 or wide_k == 500)  # the shortcut served the peaked batches


def test_greedy_verify_counts_the_matching_prefix():
    V = 5
    target = torch.full((2, 4, V), -1.0)
    target[0, torch.arange(4), torch.tensor([3, 1, 4, 2])] = 1.0  # argmax path 3, 1, 4 then 2
    target[1, torch.arange(4), torch.tensor([0, 0, 0, 0])] = 1.0
    drafts = torch.tensor([[3, 1, 0], [0, 0, 0]])
    bs = BatchSampling(torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2))
    v = sampling.verify(target, drafts, torch.tensor([3, 2]), None, bs, None)
    assert v.num_accepted.tolist() == [2, 2]  # row 1 proposes only 2: both accepted, then the bonus
    assert v.next_tokens.tolist() == [4, 0]


def test_sampling_params_reject_bad_values():
    for kwargs, field in [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                          ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                          ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop_strings": ("",)}, "stop_strings")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_engine_rejects_bad_arguments(model):
    engine = Engine(model)
    ok = [Request([1, 2])]
    with pytest.raises(ValueError, match="k"):
        engine.generate(ok, k=-1, drafter=NgramDrafter())
    with pytest.raises(ValueError, match="drafter"):
        engine.generate(ok, k=2)
    with pytest.raises(ValueError, match="prompt_ids.*empty"):
        engine.generate([Request([])])
    with pytest.raises(ValueError, match="prompt_ids.*context"):
        engine.generate([Request(list(range(VOCAB)) * 20)])
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([Request([VOCAB + 3])])
    with pytest.raises(ValueError, match="stop_strings"):
        engine.generate([Request([1], SamplingParams(stop_strings=("x",)))])
    with pytest.raises(ValueError, match="requests"):
        engine.generate([])


@pytest.mark.parametrize("V", [96, 1024, 3000])
def test_sample_draws_the_token_whose_cumulative_mass_passes_u(V, device):
    """drafter.decode.sampling.sample (in blocks) against inverse-CDF sampling in float64 over the whole row: the same
    token but where u sits within rounding of a boundary; never a token of zero probability; u near 0 and 1 too."""
    g = torch.Generator().manual_seed(V)
    probs = (3 * torch.randn(64, V, generator=g)).softmax(-1)
    probs[:, ::5] = 0.0  # holes, at block edges too
    probs[0] = 0.0
    probs[0, V - 1] = 1.0  # all the mass on the last token
    uniforms = torch.rand(64, generator=g)
    uniforms[1], uniforms[2] = 0.0, 1.0 - 1e-7
    got = sampling.sample(probs.to(device), uniforms.to(device)).cpu()
    cdf = probs.double().cumsum(-1)
    target = uniforms.double().unsqueeze(-1) * cdf[:, -1:]
    want = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=V - 1)
    near = ((cdf - target).abs() < 1e-5).any(-1)  # a boundary within rounding: either side is right
    assert bool((got == want)[~near].all()) and int((~near).sum()) >= 60
    assert bool((probs.gather(-1, got.unsqueeze(-1)) > 0).all()) and int(got[0]) == V - 1
