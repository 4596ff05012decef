"""Greedy speculative decoding must reproduce plain decoding token for token."""

from __future__ import annotations

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.adaptive import DraftLengthTuner
from drafter.draft.draft_state import MAX_SWAP_LOG
from drafter.draft.drafters import NgramDrafter
from drafter.draft.eagle import EagleDrafter, serving_dtype, serving_precision
from drafter.draft.head import EagleHead
from drafter.model.causal_lm import CausalLM, draft_features
from drafter.model.config import default_aux_layer_ids
from drafter.model.int8 import int8_linear_available
from drafter.model.linear import fast_bf16
from drafter.train.buffer import PackedBatch
from drafter.train.unroll import unrolled_predictions
from tests.conftest import on, random_prompts, tiny_model

LENGTHS_8 = [1, 3, 5, 9, 2, 17, 4, 33]
# draft trees run on the eager path only: on CUDA the engine and the drafter default to the static one (chains)
EAGER = {"static": False}
NEEDS_INT8 = pytest.mark.skipif(not int8_linear_available(), reason="no fbgemm/x86 int8 kernels in this torch")


def make_drafter(name: str, model: CausalLM):
    if name == "ngram":
        return NgramDrafter()
    return EagleDrafter(model, EagleHead(model.cfg), {"eagle-bf16": "bfloat16", "eagle-int8": "int8"}.get(name))


def greedy_requests(prompts, max_new_tokens=48):
    return [Request(p, SamplingParams(max_new_tokens=max_new_tokens)) for p in prompts]


@pytest.mark.parametrize("drafter_name", ["ngram", "eagle", "eagle-bf16", pytest.param("eagle-int8", marks=NEEDS_INT8)])
@pytest.mark.parametrize("k", [1, 2, 4, 7])
@pytest.mark.parametrize("lengths", [[6], LENGTHS_8], ids=["batch1", "batch8"])
def test_greedy_speculative_equals_plain(tiny, drafter_name, k, lengths, device):
    if drafter_name == "eagle-int8" and device != "cpu":
        pytest.skip("int8 drafting is CPU-only")
    model = on(tiny, device)
    engine = Engine(model)
    requests = greedy_requests(random_prompts(lengths, tiny.cfg.vocab_size))
    plain = engine.generate(requests)
    spec = engine.generate(requests, k=k, drafter=make_drafter(drafter_name, model))
    for a, b in zip(plain, spec):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert b.num_steps <= a.num_steps


class CycleK:
    """A chooser that switches the draft length through `ks` (0 included), and logs the steps it is told of."""

    def __init__(self, ks: list[int]) -> None:
        self.ks, self.num_steps, self.log, self.chosen = ks, 0, [], []

    def choose(self, batch_size: int) -> int:
        self.num_steps += 1
        self.chosen.append(self.ks[(self.num_steps - 1) % len(self.ks)])
        return self.chosen[-1]

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None:
        if steady:
            self.log.append((batch_size, k, num_tokens, seconds))

    def record_rows(self, batch_size: int, k: int, rows: list[tuple[int, int]]) -> None:
        pass


@pytest.mark.parametrize("drafter_name", ["ngram", "eagle", "eagle-tree"])
def test_greedy_adaptive_draft_length_equals_plain(tiny, drafter_name, device):
    """k switching step to step (0, the most, between; a tree at small batches) leaves greedy outputs
    identical to plain decoding; the chooser hears of the steady steps only (the same k as the step before, no
    capture or rebuild: on a CPU exactly those), capped at the engine's k."""
    model = on(tiny, device)
    engine = Engine(model, **(EAGER if drafter_name == "eagle-tree" else {}))
    requests = greedy_requests(random_prompts(LENGTHS_8, tiny.cfg.vocab_size, seed=11))
    plain = engine.generate(requests)
    drafter = (EagleDrafter(model, EagleHead(tiny.cfg), tree="3,2", **EAGER) if drafter_name == "eagle-tree"
               else make_drafter(drafter_name, model))
    assert drafter_name != "eagle-tree" or drafter.tree_for(4, 1) is not None
    cycle = CycleK([0, 0, 4, 4, 1, 1, 0, 9, 4, 2, 2, 3, 3, 3])
    spec = engine.generate(requests, k=4, drafter=drafter, tuner=cycle)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    served = [min(k, 4) for k in cycle.chosen]
    steady = [k for prev, k in zip(served, served[1:]) if k == prev]
    assert {k for _, k, _, _ in cycle.log} == {0, 1, 2, 3, 4} and len(cycle.log) <= len(steady)
    if device == "cpu":  # no graph to capture: every step that kept its k is steady
        assert [k for _, k, _, _ in cycle.log] == steady
    assert all(s > 0 for *_, s in cycle.log) and cycle.log[0][0] == len(requests)
    tuner = DraftLengthTuner(4)
    adaptive = engine.generate(requests, k=4, drafter=make_drafter(drafter_name.removesuffix("-tree"), model),
                               tuner=tuner)
    assert [o.token_ids for o in adaptive] == [o.token_ids for o in plain]
    assert set(tuner.summary()) <= {"1", "2", "3-4", "5-8"} and "5-8" in tuner.summary()


def test_serving_dtype_resolves_and_rejects_unknown_names(tiny):
    assert serving_dtype(tiny, None) == tiny.dtype == torch.float32
    assert serving_dtype(tiny, "auto") == (torch.bfloat16 if fast_bf16("cpu") else torch.float32)
    assert serving_dtype(tiny, "bfloat16") == serving_dtype(tiny, torch.bfloat16) == torch.bfloat16
    with pytest.raises(ValueError, match="draft dtype"):
        serving_dtype(tiny, "bf17")
    with pytest.raises(ValueError, match="draft dtype"):
        EagleDrafter(tiny, EagleHead(tiny.cfg), torch.int8)
    # int8: float32 activations, int8 weights; asked for only (auto never picks it)
    auto = (torch.bfloat16, False) if fast_bf16("cpu") else (torch.float32, False)
    assert serving_precision(tiny, "auto") == auto
    assert serving_precision(tiny, None) == (torch.float32, False)
    if int8_linear_available():
        assert serving_precision(tiny, "int8") == (torch.float32, True)
        assert EagleDrafter(tiny, EagleHead(tiny.cfg), "int8").precision == "int8"
    assert EagleDrafter(tiny, EagleHead(tiny.cfg), "float32").precision == "float32"
    with pytest.raises(ValueError, match="int8 needs a CPU policy"):
        serving_precision(tiny_model().to("meta"), "int8")


def test_swaps_are_counted_and_their_log_is_bounded(tiny, device):
    """Every installed head is counted, but only the latest MAX_SWAP_LOG swaps keep their times; a
    refresh (new policy weights) re-installs the serving head unless another is already queued. The heads are
    made on the policy's device, so none is a converted copy the drafter owns: each is served as itself (an owned
    head would take the next version's weights in place, tests/drafter/test_shapes.py)."""
    model = on(tiny, device)
    drafter = EagleDrafter(model, EagleHead(tiny.cfg).to(device))
    assert drafter.swaps.last is None and drafter.head.fc.weight.device == model.device
    heads = [EagleHead(tiny.cfg, init=False).to(device) for _ in range(2)]
    num = MAX_SWAP_LOG + 5
    for v in range(1, num + 1):
        drafter.request_swap(heads[v % 2], version=v)
        drafter.apply_pending_swap()
    assert drafter.swaps.num_swaps == num and len(drafter.swaps.log) == MAX_SWAP_LOG
    assert [v for v, _ in drafter.swaps.log] == list(range(num - MAX_SWAP_LOG + 1, num + 1))
    assert drafter.swaps.last[0] == num == drafter.version and drafter.head is heads[num % 2]
    drafter.request_swap(heads[0], version=num + 1)
    drafter.refresh()  # the queued head keeps its place
    drafter.apply_pending_swap()
    assert drafter.version == num + 1 and drafter.head is heads[0]
    drafter.refresh()  # nothing queued: the serving head again, re-fed against the new policy's states
    drafter.apply_pending_swap()
    assert drafter.version == num + 1 and drafter.head is heads[0]
    assert drafter.swaps.num_swaps == num + 2


def test_ngram_drafts_are_accepted_and_save_forwards(tiny):
    """The random tiny model repeats itself, so prompt lookup must pay: fewer forwards than tokens."""
    engine = Engine(tiny)
    requests = greedy_requests(random_prompts(LENGTHS_8, tiny.cfg.vocab_size), max_new_tokens=64)
    out = engine.generate(requests, k=4, drafter=NgramDrafter())
    assert sum(o.num_accepted for o in out) > 0
    assert sum(o.num_steps for o in out) < sum(len(o.token_ids) for o in out)


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_qwen2_architecture(tiny_qwen2, k):
    engine = Engine(tiny_qwen2)
    requests = greedy_requests(random_prompts(LENGTHS_8, tiny_qwen2.cfg.vocab_size, seed=3))
    plain = engine.generate(requests)
    spec = engine.generate(requests, k=k, drafter=NgramDrafter())
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


def test_batch_output_equals_single_sequence_output(tiny):
    engine = Engine(tiny)
    requests = greedy_requests(random_prompts(LENGTHS_8, tiny.cfg.vocab_size))
    batched = engine.generate(requests, k=3, drafter=NgramDrafter())
    for req, out in zip(requests, batched):
        assert engine.generate([req])[0].token_ids == out.token_ids


@pytest.mark.parametrize("static", [True, False], ids=["static", "eager"])
@pytest.mark.parametrize("k", [0, 3])
def test_rows_with_one_prompt_share_its_prefill_and_decode_as_alone(tiny, device, static, k):
    """A GRPO group: rows with one prompt, sampled apart by their seeds. The prefill runs each distinct prompt
    once (a batch of 2 here, not 5), and every row decodes as it would alone: the same tokens and features as
    its request generated on its own."""
    model = on(tiny, device)
    a, b = random_prompts([7, 4], tiny.cfg.vocab_size, seed=5)
    reqs = [Request(p, SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=i))
            for i, p in enumerate([a, b, a, a, b])]
    engine, prefills = Engine(model, static=static), []
    forward = engine._forward

    def spy(aux, ids, *args, **kwargs):
        if kwargs.get("logits_for") == "none":
            prefills.append(ids.shape[0])
        return forward(aux, ids, *args, **kwargs)

    engine._forward = spy
    outs = engine.generate(reqs, k=k, drafter=NgramDrafter() if k else None, record_hidden=True)
    assert prefills == [2]
    assert len({tuple(o.token_ids) for o in outs}) == 5  # the siblings sampled apart
    for req, out in zip(reqs, outs):
        alone = Engine(model, static=static).generate([req], k=k, drafter=NgramDrafter() if k else None,
                                                      record_hidden=True)[0]
        assert out.token_ids == alone.token_ids
        torch.testing.assert_close(out.prompt_hidden_states, alone.prompt_hidden_states, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden_states, alone.hidden_states, atol=1e-4, rtol=1e-4)


def fit_eagle_head(model: CausalLM, prompts: list[list[int]], steps: int = 200, num_unroll: int = 3) -> EagleHead:
    """Fit of a draft head on the policy's own greedy rollouts (a test-only trainer: plain cross-entropy on
    the tokens, over drafter.train.unroll's training-time unrolling, which tests/drafter/test_train.py checks
    against inference), so that drafts past the first are accepted too."""
    outs = Engine(model).generate(greedy_requests(prompts, max_new_tokens=32))
    device = model.device  # the fit runs where the model is
    seqs = torch.tensor([o.prompt_ids + o.token_ids for o in outs if len(o.token_ids) == 32], device=device)  # (N, L)
    N, L = seqs.shape
    head = EagleHead(model.cfg).to(device)
    with torch.no_grad():
        _, hidden, aux = model(seqs, torch.arange(L, device=device).expand(N, L), model.new_cache(N, L),
                               logits_for="none", aux_layers=head.aux_layers)  # (N, L, D), (N, L, 3D)
    head.init_lm_head(model)
    T = L - 1  # pair j = (f_j, x_{j+1}) at step s predicts x_{j+2} from a chain rooted at pair j - s
    arange = torch.arange(max(N, T), device=device)
    batch = PackedBatch(feats=draft_features(hidden, aux)[:, :T], tokens=seqs[:, 1:], positions=arange[:T].expand(N, T),
                        seq_ids=arange[:N].unsqueeze(1).expand(N, T), target_mask=seqs.new_ones(N, T, dtype=torch.bool),
                        seg_start=seqs.new_zeros(N, T), num_tokens=N * T, num_sequences=N)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(steps):
        preds = unrolled_predictions(head, model.embed_tokens, batch, num_unroll)
        loss = sum(torch.nn.functional.cross_entropy(head.logits(out[:, s : T - 1]).flatten(0, 1),
                                                     seqs[:, s + 2 :].flatten()) for s, out in enumerate(preds))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval().requires_grad_(False)


def acceptance(outs) -> float:
    return sum(o.num_accepted for o in outs) / max(1, sum(o.num_draft_tokens for o in outs))


def test_fitted_eagle_head_is_accepted_and_stays_lossless(device):
    """A head fitted to the policy's rollouts must be accepted on them: this checks that the drafter
    feeds (h_i, x_{i+1}) pairs at inference exactly as laid out in training, through the KV cache."""
    model = tiny_model(vocab_size=32, seed=5, std=0.4).to(device)
    engine = Engine(model)
    prompts = random_prompts([4] * 32, model.cfg.vocab_size, seed=7)
    head = fit_eagle_head(model, prompts)
    requests = greedy_requests(prompts[:8], max_new_tokens=32)
    plain = engine.generate(requests)
    untrained = engine.generate(requests, k=4, drafter=EagleDrafter(model, EagleHead(model.cfg).to(device)))
    one = engine.generate(requests, k=1, drafter=EagleDrafter(model, head))
    four = engine.generate(requests, k=4, drafter=EagleDrafter(model, head))
    # k switching, 0 included: the head catches up on the pairs of the plain steps before drafting
    cycled = engine.generate(requests, k=4, drafter=EagleDrafter(model, head), tuner=CycleK([0, 0, 4, 1, 0, 2]))
    for outs in (untrained, one, four, cycled):
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert acceptance(one) > 0.9
    assert acceptance(four) > max(0.3, 2 * acceptance(untrained))
    assert sum(o.num_steps for o in four) < sum(o.num_steps for o in plain)
    assert acceptance(cycled) > max(0.3, 2 * acceptance(untrained))


def test_sampled_generation_is_reproducible_per_seed(tiny, device):
    model = on(tiny, device)
    engine = Engine(model)
    prompts = random_prompts([5, 8, 3], tiny.cfg.vocab_size)

    def run(seed0, k, drafter=None):
        reqs = [Request(p, SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=24, seed=seed0 + i))
                for i, p in enumerate(prompts)]
        return [o.token_ids for o in engine.generate(reqs, k=k, drafter=(drafter or NgramDrafter()) if k else None)]

    assert run(0, 0) == run(0, 0)
    assert run(0, 3) == run(0, 3)
    assert run(0, 0) != run(100, 0)
    eagle = run(0, 3, EagleDrafter(model, EagleHead(tiny.cfg)))  # an EAGLE chain at T=1: drafts sampled on the device
    assert eagle == run(0, 3, EagleDrafter(model, EagleHead(tiny.cfg))) and [len(t) for t in eagle] == [24] * 3


def _features_of(model, out, device) -> torch.Tensor:
    """What record_hidden should give for `out`'s whole sequence: one full forward's draft features."""
    seq = torch.tensor([out.prompt_ids + out.token_ids], device=device)
    L = seq.shape[1]
    positions = torch.arange(L, device=device).unsqueeze(0)
    _, hidden = model(seq, positions, model.new_cache(1, L), logits_for="none")
    _, _, aux = model(seq, positions, model.new_cache(1, L), logits_for="none",
                      aux_layers=default_aux_layer_ids(model.cfg.num_layers))
    return draft_features(hidden, aux)[0]  # the aux layers' states, then the final hidden state


def test_record_hidden_matches_a_full_forward(tiny, device):
    model = on(tiny, device)
    engine = Engine(model)
    req = greedy_requests(random_prompts([6], tiny.cfg.vocab_size), max_new_tokens=20)
    plain = engine.generate(req)[0]
    assert plain.hidden_states is None
    out = engine.generate(req, k=3, drafter=NgramDrafter(), record_hidden=True)[0]
    hidden, P, L = _features_of(model, out, device), len(out.prompt_ids), len(out.prompt_ids) + len(out.token_ids)
    assert out.hidden_states.shape == (len(out.token_ids), 4 * tiny.cfg.hidden_size)
    # the state at position P-1+i produced generated token i
    torch.testing.assert_close(out.hidden_states, hidden[P - 1 : L - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.prompt_hidden_states, hidden[: P - 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [0, 3])
def test_each_row_of_a_batch_records_its_own_features(tiny, device, k):
    """Rows of different lengths, finishing at different steps (the batch compacted as they do): every row's
    features are its own sequence's, whatever rows it shared its steps with."""
    model = on(tiny, device)
    prompts = random_prompts([5, 9, 3, 7, 4], tiny.cfg.vocab_size, seed=3)
    reqs = [Request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(prompts, [3, 17, 9, 1, 12])]
    outs = Engine(model).generate(reqs, k=k, drafter=NgramDrafter() if k else None, record_hidden=True)
    assert [len(o.token_ids) for o in outs] == [3, 17, 9, 1, 12]
    for out in outs:
        hidden, P = _features_of(model, out, device), len(out.prompt_ids)
        torch.testing.assert_close(out.hidden_states, hidden[P - 1 : P - 1 + len(out.token_ids)], atol=1e-4,
                                   rtol=1e-4)


def test_stop_token_and_max_new_tokens_match_plain():
    model = tiny_model(seed=2)
    engine = Engine(model)
    prompts = random_prompts(LENGTHS_8, model.cfg.vocab_size, seed=4)
    free = engine.generate(greedy_requests(prompts, max_new_tokens=30))
    stop_tok = free[0].token_ids[5]  # a token the policy does emit
    reqs = [Request(p, SamplingParams(max_new_tokens=30, stop_token_ids=(stop_tok,))) for p in prompts]
    plain = engine.generate(reqs)
    spec = engine.generate(reqs, k=5, drafter=NgramDrafter())
    assert plain[0].token_ids[-1] == stop_tok and plain[0].finish_reason == "stop"
    assert len(plain[0].token_ids) <= 6
    for a, b in zip(plain, spec):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        assert len(a.token_ids) <= 30
        assert a.finish_reason == "stop" or len(a.token_ids) == 30


def test_model_eos_stops_unless_ignored():
    base = tiny_model(seed=2)
    first = Engine(base).generate(greedy_requests([[1, 2, 3]], max_new_tokens=30))[0].token_ids
    eos = first[3]
    model = tiny_model(seed=2, eos=(eos,))
    out = Engine(model).generate(greedy_requests([[1, 2, 3]], max_new_tokens=30))[0]
    assert out.token_ids[-1] == eos and out.finish_reason == "stop"
    ignored = Engine(model).generate([Request([1, 2, 3], SamplingParams(max_new_tokens=30, ignore_eos=True))])[0]
    assert len(ignored.token_ids) == 30 and ignored.finish_reason == "length"


def test_context_limit_stops_with_length():
    model = tiny_model(max_position=40)
    out = Engine(model).generate(greedy_requests([list(range(30))], max_new_tokens=100), k=4,
                                 drafter=NgramDrafter())[0]
    assert len(out.token_ids) == 10 and out.finish_reason == "length"


def test_forward_without_cache_matches_cached_forward(tiny, device):
    model = on(tiny, device)
    ids = torch.tensor(random_prompts([12, 12], tiny.cfg.vocab_size), device=device)
    pos = torch.arange(12, device=device).expand(2, 12)
    cached, _ = model(ids, pos, model.new_cache(2, 12))
    free, _ = model(ids, pos, None)
    torch.testing.assert_close(free, cached, atol=1e-5, rtol=1e-5)
