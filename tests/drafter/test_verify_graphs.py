"""drafter.decode.verify_graphs: verification over static buffers (captured in a CUDA graph on a GPU, run uncaptured
on a CPU) gives drafter.decode.sampling.verify's verdict exactly: every sampling mode, batches padded to their
bucket, a bucket reused by a smaller batch, and whole generations (greedy and T=1) equal token for token."""

from __future__ import annotations

import copy

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import BatchSampling, SamplingParams, verify
from drafter.decode.verify_graphs import VerifyGraphs
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleHead
from tests.conftest import random_prompts

V = 96


def _inputs(B: int, K: int, temperatures: list[float], device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, K + 1, V, generator=g)).to(device)
    sampling = BatchSampling.from_params([SamplingParams(temperature=t) for t in temperatures], device)
    draft_logits = logits[:, :K] + torch.randn(B, K, V, generator=g).to(device)  # a draft close to the target
    probs = draft_logits.softmax(-1)
    tokens = torch.stack([torch.multinomial(probs[b].cpu(), 1, generator=g)[:, 0] for b in range(B)]).to(device) \
        if K else torch.zeros(B, 0, dtype=torch.long, device=device)
    lens = torch.randint(0, K + 1, (B,), generator=g).to(device)
    uniforms = torch.rand(B, K + 1, generator=g).to(device)
    return logits, tokens, lens, probs, sampling, uniforms


@pytest.mark.parametrize("temperatures", [[0.0] * 3, [1.0] * 3, [0.0, 1.0, 0.7]], ids=["greedy", "t1", "mixed"])
@pytest.mark.parametrize("K", [0, 2])
@pytest.mark.parametrize("with_probs", [True, False], ids=["eagle", "deterministic"])
def test_the_buffered_verdict_is_verifys(device, temperatures, K, with_probs):
    graphs = VerifyGraphs(V, torch.device(device), cuda_graphs=device == "cuda")
    graphs.buffered = True  # on a CPU: the buffers, uncaptured
    for seed, B in ((0, 3), (1, 4), (2, 3)):  # 3 rows pad to the bucket of 4; the bucket is reused, rows shrink
        temps = (temperatures * 2)[:B]
        logits, tokens, lens, probs, sampling, uniforms = _inputs(B, K, temps, device, seed)
        probs = probs if with_probs else None
        sampled = not sampling.all_greedy
        want = verify(logits, tokens, lens, probs, sampling, uniforms if sampled else None)
        got = graphs.verify(logits, tokens, lens, probs, sampling, uniforms if sampled else None)
        assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.next_tokens, want.next_tokens)
    if device == "cuda":  # one graph per shape and mode, replayed for the second batch of 3 rows
        assert graphs.shapes.num_captures == 1
    with pytest.raises(ValueError, match="uniforms are required"):
        graphs.verify(*_inputs(2, K, [1.0, 1.0], device, 0)[:4], BatchSampling.from_params(
            [SamplingParams(temperature=1.0)] * 2, device), None)


def test_rows_that_truncate_are_verified_uncaptured(device):
    graphs = VerifyGraphs(V, torch.device(device), cuda_graphs=device == "cuda")
    graphs.buffered = True
    logits, tokens, lens, probs, _, uniforms = _inputs(2, 2, [1.0, 1.0], device, 5)
    sampling = BatchSampling.from_params([SamplingParams(temperature=1.0, top_p=0.9)] * 2, device)
    want = verify(logits, tokens, lens, probs, sampling, uniforms)
    got = graphs.verify(logits, tokens, lens, probs, sampling, uniforms)
    assert torch.equal(got.next_tokens, want.next_tokens) and not graphs.bufs and not graphs.graphs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generations_with_buffered_verification_are_token_for_token_the_same(tiny, device, temperature):
    """The engine's static path with the buffers (on CUDA: replayed graphs) against plain verify, same seeds:
    the same tokens, plain and speculative, rows finishing at different steps."""
    model = copy.deepcopy(tiny).to(device)
    head = EagleHead(model.cfg).to(device)
    prompts = random_prompts([5, 9, 3], model.cfg.vocab_size, seed=4)
    requests = [Request(p, SamplingParams(max_new_tokens=12 + 5 * i, temperature=temperature, seed=i,
                                          ignore_eos=True)) for i, p in enumerate(prompts)]
    outs = {}
    for buffered in (False, True):
        engine = Engine(model, static=True)
        drafter = EagleDrafter(model, head, static=True)
        engine.verifier.buffered = buffered  # on CUDA: replayed graphs against eager verify
        engine.generate(requests, k=2, drafter=drafter)  # every shape met before the compared runs
        outs[buffered] = [[o.token_ids for o in engine.generate(requests, k=k, drafter=drafter if k else None)]
                          for k in (0, 2)]
    assert outs[True] == outs[False]
    assert outs[True][0] == outs[True][1] or temperature > 0  # greedy: speculative equals plain
