"""Coupled sampling (drafter.decode.coupled): exact samples of the policy, and the same tokens for the same seed
with or without drafts, whatever the draft, draft length, batch or decode path."""

from __future__ import annotations

import math

import pytest
import torch

import drafter.decode.coupled as coupled_mod
from drafter.decode.coupled import Coupling, gumbel_noise
from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import BatchSampling, SamplingParams
from drafter.decode.warmup import warm_up
from drafter.draft.adaptive import DraftLengthTuner
from tests.conftest import on, tiny_model
from tests.drafter.test_sampling import (
    ALPHA,
    NEW,
    NUM_SAMPLES,
    PARAMS,
    PROMPT,
    exact_probs,
    make_drafter,
    policy,
    pvalue_of,
)


@pytest.fixture(scope="module")
def model():
    return policy()


@pytest.fixture(scope="module")
def exact(model) -> dict[tuple[int, ...], float]:
    return exact_probs(model)


def coupled_requests(n: int, params: dict = PARAMS, new: int = NEW, prompt: list[int] = PROMPT) -> list[Request]:
    return [Request(prompt, SamplingParams(**params, max_new_tokens=new, seed=i, coupled=True)) for i in range(n)]


def test_coupled_plain_sampling_matches_policy(model, exact):
    """Gumbel-max over keyed noise is an exact sample of p (temperature, top-k and top-p applied)."""
    assert pvalue_of(Engine(model).generate(coupled_requests(NUM_SAMPLES)), exact) > ALPHA


def test_noise_shared_across_positions_fails_the_test(model, exact, monkeypatch):
    """Teeth: noise that ignores the position (the same draw at every token of a row) is not the policy's."""
    real = coupled_mod.gumbel_noise
    monkeypatch.setattr(coupled_mod, "gumbel_noise", lambda keys, index, ids: real(keys, index * 0, ids))
    assert pvalue_of(Engine(model).generate(coupled_requests(NUM_SAMPLES)), exact) < ALPHA


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize(("drafter_name", "k"), [("eagle", 1), ("eagle", 3), ("eagle-tree", 2), ("ngram", 2),
                                                   ("history-stored", 2), ("combined", 3)])
def test_coupled_speculation_emits_plain_decodings_tokens(model, drafter_name, k, static):
    """The same seeds give identical tokens with and without drafts (a tree drafter drafts chains for them), on
    both decode paths, while the drafts are accepted at times (else the test would say nothing)."""
    reqs = coupled_requests(64, new=12)
    plain = Engine(model, static=static).generate(reqs)
    spec = Engine(model, static=static).generate(reqs, k=k, drafter=make_drafter(drafter_name, model))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.num_accepted for o in spec) > 0 and sum(o.num_steps for o in spec) < sum(o.num_steps for o in plain)


def test_coupled_rows_beside_sampled_and_greedy_rows_keep_their_tokens(model):
    """A batch mixing coupled, ordinarily sampled and greedy rows, with a tuner changing k from step to step:
    the coupled rows' tokens are plain decoding's, the greedy rows' too."""
    coupled = coupled_requests(8, new=16)
    greedy = [Request(PROMPT[:3], SamplingParams(max_new_tokens=16))]
    sampled = [Request(PROMPT[:4], SamplingParams(**PARAMS, max_new_tokens=16, seed=5))]
    alone = Engine(model).generate(coupled + greedy)
    mixed = Engine(model).generate(coupled + sampled + greedy, k=3, drafter=make_drafter("eagle", model),
                                   tuner=DraftLengthTuner(3))
    assert [o.token_ids for o in mixed[:8]] == [o.token_ids for o in alone[:8]]
    assert mixed[9].token_ids == alone[8].token_ids


def test_the_noise_is_gumbel_keyed_and_the_same_on_every_device(device):
    keys = torch.tensor([7, 2**62 + 11], dtype=torch.int64)
    index = torch.tensor([[5, 6], [5, 6]], dtype=torch.int64)
    ids = torch.arange(50_000)
    g = gumbel_noise(keys, index, ids)  # (2, 2, V)
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi ** 2 / 6) < 0.03
    assert torch.equal(g, gumbel_noise(keys, index, ids))  # keyed, not drawn
    flat = torch.arange(0, 2**32, 2**32 // 10_000, dtype=torch.int64)
    assert torch.equal(coupled_mod._noise(flat), coupled_mod._gumbel_of(flat))  # compiled (where it is) = eager
    assert torch.equal(gumbel_noise(keys, index, ids[7::3])[..., 2], g[..., 13])  # a token's noise, in any subset
    for a, b in [((0, 0), (0, 1)), ((0, 0), (1, 0))]:  # another position, another key: another draw
        assert torch.corrcoef(torch.stack([g[a], g[b]]))[0, 1].abs() < 0.02
    there = gumbel_noise(keys.to(device), index.to(device), ids.to(device))
    assert there.device.type == torch.device(device).type and torch.allclose(there.cpu(), g, atol=1e-5)


def test_coupled_decoding_on_a_device_equals_the_cpus(device):
    """The same seeds give the same tokens on the device as on the CPU (float32: only the logits' rounding
    differs, and at these margins it never flips a token)."""
    cpu = tiny_model(vocab_size=64, seed=4, std=0.5, max_position=64)
    reqs = coupled_requests(16, {"temperature": 1.0}, new=10, prompt=[3, 9, 27])
    want = [o.token_ids for o in Engine(cpu).generate(reqs)]
    assert [o.token_ids for o in Engine(on(cpu, device)).generate(reqs)] == want


def test_a_draft_that_is_the_policy_always_drafts_the_policys_sample(device):
    """Coupling.draft adds the noise the policy's sample at that token will use: a draft distribution equal to
    the policy's (over a subset of its vocabulary holding the sample) drafts exactly that sample, at any draft
    temperature of 1 (rows at T=0.7 here); with the noise of another position it mostly does not."""
    B, V = 64, 500
    logits = torch.randn(B, 1, V, generator=torch.Generator().manual_seed(0), device="cpu").to(device) * 3
    params = [SamplingParams(temperature=0.7, seed=1000 + b, coupled=True) for b in range(B)]
    coupling = Coupling.of(params, BatchSampling.from_params(params, device), device)
    index = torch.full((B, 1), 40, dtype=torch.long, device=device)
    sample = coupling.perturb(logits, index).argmax(-1)[:, 0]  # (B,): the policy's coupled samples
    ids = torch.arange(V, device=device)
    assert torch.equal(coupling.draft(logits[:, 0], index[:, 0], ids, 1.0), sample)
    assert (coupling.draft(logits[:, 0], index[:, 0] + 1, ids, 1.0) == sample).float().mean() < 0.7
    sub = torch.cat([ids[:100], sample.unique()]).unique()  # a draft vocabulary that holds every sample
    p_sub = logits[:, 0, sub]
    drafted = sub[coupling.draft(p_sub, index[:, 0], sub, 1.0)]
    # over a subset, the draft's argmax is the policy's sample whenever the sample is in it (here: always)
    assert torch.equal(drafted, sample)


def test_coupled_must_be_a_bool():
    with pytest.raises(ValueError, match="coupled must be a bool"):
        SamplingParams(coupled="yes")


@pytest.mark.parametrize("coupled", [True, False])
def test_a_jobs_warm_up_compiles_the_noise_where_its_rows_sample_coupled(model, monkeypatch, coupled):
    """Its first call in a process costs seconds: a job's workers pay it in warm_up, before their first rollout,
    on a CPU too (where warm_up captures nothing and only sizes the static cache), and only when the job samples
    coupled."""
    monkeypatch.setattr(coupled_mod, "_compiled", {})  # this process's kernel forgotten: compiled again
    engine = Engine(model)
    out = warm_up(engine, 4, 32, (0,), SamplingParams(temperature=1.0, coupled=coupled))
    assert ("fn" in coupled_mod._compiled) == coupled  # compiled (or, where compiling fails, eager from now on)
    assert out["captures"] == out["batches"] == 0 and out["rebuilds"] == 1 and (out["seconds"] > 0 or not coupled)
    assert engine.runner.cache.max_batch == 4 and engine.runner.cache.max_len >= 32  # the job's rows fit it
