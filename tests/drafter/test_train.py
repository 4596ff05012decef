"""Drafter training: unrolling matches inference, loss decreases, trained beats untrained, stops."""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleConfig, EagleHead, draft_lm_weight, new_head
from drafter.model.causal_lm import draft_features
from drafter.model.config import TrainConfig, default_aux_layer_ids
from drafter.model.int8 import Int8Linear, int8_linear_available
from drafter.model.linear import fast_bf16
from drafter.train.buffer import PackedBatch, RolloutBuffer, iter_batches
from drafter.train.checkpoint import DraftMeta, load_draft
from drafter.train.evaluate import (
    DRAFT_TEMPERATURES,
    acceptance_by_position,
    calibrate_draft_temperature,
    expected_accepted_length,
)
from drafter.train.trainer import DraftTrainer, StopRequestedError, draft_loss
from drafter.train.unroll import unrolled_predictions
from drafter.train.warmstart import HarvestConfig, harvest, measure, warm_start
from tests.conftest import on, pattern_corpus, random_prompts, structured_model, tiny_model


def offline_cfg(**kwargs) -> TrainConfig:
    """TrainConfig as offline recipes set it (its defaults serve online leases): numerics that never
    depend on the box (no bf16 autocast) and a cosine over total_steps, not each train() call's budget; 3 unrolled
    positions unless asked (the tests' cost: each position is another forward and backward)."""
    return TrainConfig(**{"anneal_to_budget": False, "bf16_autocast": False, "num_unroll": 3, **kwargs})


def single_sequence_batch(model, seq: list[int]) -> PackedBatch:
    """The pairs of one sequence as a packed batch, on the model's device."""
    L, device = len(seq), model.device
    ids = torch.tensor([seq], device=device)
    _, hidden, aux = model(ids, torch.arange(L, device=device).unsqueeze(0), model.new_cache(1, L), logits_for="none",
                           aux_layers=default_aux_layer_ids(model.cfg.num_layers))  # (1, L, D), (1, L, 3D)
    T = L - 1  # pairs (f_j, x_{j+1}), j = 0..L-2
    target = torch.ones(1, T, dtype=torch.bool, device=device)
    target[0, -1] = False
    feats = draft_features(hidden, aux)[:, :T]  # (1, T, 4D)
    return PackedBatch(feats=feats, tokens=ids[:, 1:], positions=torch.arange(T, device=device).unsqueeze(0),
                       seq_ids=ids.new_zeros(1, T), target_mask=target, seg_start=ids.new_zeros(1, T), num_tokens=T,
                       num_sequences=1)


@torch.no_grad()
def test_unrolled_training_sees_what_inference_sees(device):
    """Unroll step s at slot j must equal running the head with a KV cache: true pairs (fused aux states)
    up to the chain start c = j - s, then s steps fed with its own outputs."""
    model = tiny_model(seed=3).to(device, torch.float64)  # float64: a wrong mask or shift differs by O(1), rounding
    head = EagleHead(model.cfg, EagleConfig(init_seed=1)).to(device, torch.float64).eval()  # by 1e-12
    for p in head.parameters():  # larger weights, so a wrong mask or shift shows clearly
        p.mul_(10)
    seq = random_prompts([14], model.cfg.vocab_size, seed=5)[0]
    batch = single_sequence_batch(model, seq)
    preds = unrolled_predictions(head, model.embed_tokens, batch, num_unroll=3)
    emb = model.embed_tokens
    for c in (0, 3, 7):
        cache = head.new_cache(1, 32, torch.float64, device)
        out = head(head.fuse(batch.feats[:, : c + 1]), emb(batch.tokens[:, : c + 1]),
                   torch.arange(c + 1, device=device).unsqueeze(0), cache)
        pred = out[:, -1:]  # (1, 1, D): the output that scores x_{c+2}
        torch.testing.assert_close(pred[0, 0], preds[0][0, c], atol=1e-9, rtol=1e-9)
        for s in (1, 2):
            j = c + s
            pred = head(pred, emb(batch.tokens[:, j : j + 1]), torch.tensor([[j]], device=device), cache)
            torch.testing.assert_close(pred[0, 0], preds[s][0, j], atol=1e-9, rtol=1e-9)


def test_the_loss_trains_chains_rooted_inside_their_segment_only(device):
    """One row holding two segments, the second a chunk that continues a sequence at position 5: the
    loss, rebuilt pair by pair, covers step s at pair j only when j - s is in j's segment."""
    model = tiny_model(seed=3).to(device, torch.float64)
    head = EagleHead(model.cfg, EagleConfig(init_seed=1)).to(device, torch.float64)
    seq = random_prompts([14], model.cfg.vocab_size, seed=5)[0]
    one = single_sequence_batch(model, seq)
    T = one.feats.shape[1]
    second = torch.arange(T, device=device) >= 5
    target = one.target_mask.clone()
    target[0, 4] = False  # the first segment's last pair
    batch = dataclasses.replace(one, seq_ids=second.long().unsqueeze(0), target_mask=target,
                                seg_start=torch.where(second, 5, 0).unsqueeze(0))
    lm = draft_lm_weight(head, model)
    with torch.no_grad():
        preds = unrolled_predictions(head, model.embed_tokens, batch, num_unroll=3)
    cfg = offline_cfg(num_unroll=3, position_loss="decay")
    loss, stats = draft_loss(head, model, batch, cfg)
    expected = 0.0
    for s in range(3):
        pairs = list(range(s, 4)) + list(range(5 + s, T - 1))  # the root j - s stays in the pair's segment
        targets = head.policy_hidden(batch.feats[0, [j + 1 for j in pairs]])  # the policy's final hidden h_{j+1}
        p = torch.softmax(torch.nn.functional.linear(targets, lm), -1)
        pred = head.norm(preds[s][0, pairs])
        ce = -(p * torch.log_softmax(head.lm_head(pred), -1)).sum(-1).mean()
        reg = torch.nn.functional.smooth_l1_loss(pred, targets)
        expected += cfg.unroll_decay**s * (ce + cfg.hidden_loss_weight * reg)
        assert float(stats[f"ce_{s}"]) == pytest.approx(float(ce.detach()), rel=1e-5)
    torch.testing.assert_close(loss.detach(), expected.to(loss.dtype), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def structured(device):
    """A tiny policy with structure on `device`, its rollout buffer (harvested there), and held-out prompts."""
    model = on(structured_model(), device)
    engine = Engine(model)
    buffer = RolloutBuffer(max_bytes=64 << 20)
    prompts = [p[:6].tolist() for p in pattern_corpus(72, seed=10_000)]
    harvest(engine, prompts[:64], buffer, cfg=HarvestConfig(batch_size=32, max_new_tokens=40, temperature=1.0))
    return model, engine, buffer, prompts[64:]


def test_loss_decreases_on_a_fixed_batch(structured):
    model, _, buffer, _ = structured
    head = new_head(model, None, None)
    trainer = DraftTrainer(model, head, offline_cfg(warmup_steps=1))
    batch = trainer.next_batch(buffer)
    first = trainer.micro_step(batch)["loss"]
    for _ in range(30):
        last = trainer.micro_step(batch)["loss"]
    assert last < 0.5 * first


@pytest.mark.parametrize("position_loss", ["decay", "reach"])
def test_the_multi_position_loss_trains_position_j(structured, position_loss):
    """Draft position j = 5 is accepted (given positions 1..4 were) far more often after 40 micro-steps on a fixed
    batch with 6 unrolled positions than before, and than with 1: position j is trained by its own unroll step."""
    model, _, buffer, _ = structured
    rollouts = buffer.rollouts[:8]
    batch = next(iter(iter_batches(rollouts, 512, 1, shuffle=False)))
    at_5 = {}
    for num_unroll in (1, 6):
        torch.manual_seed(0)
        head = new_head(model, None, None)
        trainer = DraftTrainer(model, head, offline_cfg(num_unroll=num_unroll, position_loss=position_loss,
                                                        warmup_steps=1))
        before = acceptance_by_position(head, model, rollouts, 6, greedy=False)
        for _ in range(40):
            trainer.micro_step(batch)
        at_5[num_unroll] = acceptance_by_position(head, model, rollouts, 6, greedy=False)[4]
        assert before[4] < 0.2  # an untrained head: about 1 / the vocabulary
    assert at_5[6] > 0.3 and at_5[6] > at_5[1] + 0.15, at_5


def test_acceptance_by_position_multiplies_to_the_expected_accepted_length(structured):
    model, _, buffer, held_out = structured
    head = new_head(model, None, None)
    DraftTrainer(model, head, offline_cfg(total_steps=30)).train(buffer, max_steps=30)
    for greedy in (True, False):
        by_position = acceptance_by_position(head, model, buffer.rollouts[:16], 4, greedy)
        assert len(by_position) == 4 and all(0 <= a <= 1 for a in by_position)
        assert 1 + sum(math.prod(by_position[:m]) for m in range(1, 5)) == pytest.approx(
            expected_accepted_length(head, model, buffer.rollouts[:16], 4, greedy), rel=1e-6)


def test_scoring_in_chunks_of_slots_gives_the_whole_batchs_scores(structured, monkeypatch):
    """A CPU scores a batch's slots in chunks (so a batch's logits stay in the cache); chunks of 7 slots, which split
    rows and chains, give every draft temperature the scores of one chunk holding the whole batch."""
    import drafter.train.evaluate as evaluate

    model, _, buffer, _ = structured
    head = new_head(model, None, None)
    DraftTrainer(model, head, offline_cfg(total_steps=20)).train(buffer, max_steps=20)
    rollouts, temps = buffer.rollouts[:12], (1.0, 0.6, 0.0)
    scores = {}
    for chunk in (7, 1 << 30):
        monkeypatch.setattr(evaluate, "CPU_CHUNK_POSITIONS", chunk)
        scores[chunk] = (evaluate.expected_accepted_lengths(head, model, rollouts, 4, False, temps),
                         evaluate.expected_accepted_lengths(head, model, rollouts, 4, True))
    (sampled, greedy), (sampled_whole, greedy_whole) = scores[7], scores[1 << 30]
    # equal up to a product's rounding, which may move an argmax near a tie: one chain of hundreds moves the mean
    # by under 0.01, a chunk scored at the wrong slots by far more
    assert sampled == pytest.approx(sampled_whole, abs=0.02) and greedy == pytest.approx(greedy_whole, abs=0.02)
    assert len(set(sampled)) == 3 and all(1 < x < 5 for x in sampled + greedy)  # distinct, non-trivial scores


def test_offline_scores_start_chains_where_decoding_drafts_not_inside_the_prompt(structured):
    """Decoding drafts from the prompt's last pair on (the policy emits the first response token there): a chain
    rooted inside the prompt would score guesses of prompt tokens, which no draft ever makes."""
    from drafter.train.evaluate import _survival

    model, _, buffer, _ = structured
    head = new_head(model, None, None)
    rollouts = [r for r in buffer.rollouts if r.num_prompt > 1 and r.tokens.numel() <= 200][:8]
    assert rollouts
    k = 3
    _, count = _survival(head, model, rollouts, k, True, (1.0,))
    # pairs j = 0..L-2, the last without a target: roots i from num_prompt - 1 to L - k - 2
    assert int(count) == sum(r.tokens.numel() - k - r.num_prompt for r in rollouts)
    whole = [dataclasses.replace(r, num_prompt=1) for r in rollouts]
    _, count_all = _survival(head, model, whole, k, True, (1.0,))
    assert int(count_all) == int(count) + sum(r.num_prompt - 1 for r in rollouts)
    late = [dataclasses.replace(r, num_prompt=r.tokens.numel() - k - 1) for r in rollouts]  # one root each
    assert int(_survival(head, model, late, k, True, (1.0,))[1]) == len(late)
    with pytest.raises(ValueError, match="too short to score"):
        _survival(head, model, [dataclasses.replace(r, num_prompt=r.tokens.numel()) for r in rollouts], k, True,
                  (1.0,))


def test_reach_weighs_each_pair_by_the_acceptance_of_its_chain(structured):
    """position_loss "reach" with a floor of 1 weighs every pair 1 (decay with unroll_decay 1); with a small floor,
    step 1's loss is its pairs' losses weighed by the acceptance of their chain's draft 0 (alpha_0)."""
    model, _, buffer, _ = structured
    head = new_head(model, None, None)
    DraftTrainer(model, head, offline_cfg(total_steps=20)).train(buffer, max_steps=20)
    batch = DraftTrainer(model, head, offline_cfg()).next_batch(buffer).to(model.device)  # packed on the host
    flat, _ = draft_loss(head, model, batch, offline_cfg(num_unroll=3, position_loss="decay", unroll_decay=1.0))
    floor1, _ = draft_loss(head, model, batch, offline_cfg(num_unroll=3, position_loss="reach", reach_floor=1.0))
    torch.testing.assert_close(floor1, flat)
    one, stats1 = draft_loss(head, model, batch, offline_cfg(num_unroll=1, position_loss="reach", reach_floor=1e-6))
    two, stats2 = draft_loss(head, model, batch, offline_cfg(num_unroll=2, position_loss="reach", reach_floor=1e-6))
    first, _ = draft_loss(head, model, batch, offline_cfg(num_unroll=1, position_loss="decay"))
    torch.testing.assert_close(one, first)  # step 0 weighs 1 whatever the floor
    assert 0 < float(two - one) < float(stats2["ce_1"])  # step 1 weighs alpha_0 < 1 per pair
    assert float(stats2["alpha_0"]) == pytest.approx(float(stats1["alpha_0"]))
    with pytest.raises(ValueError, match="position_loss must be one of"):
        TrainConfig(position_loss="uniform")


def test_trained_drafter_beats_untrained_on_held_out_rollouts(structured):
    model, engine, buffer, held_out = structured
    head = new_head(model, None, None)
    DraftTrainer(model, head, offline_cfg(total_steps=150)).train(buffer, max_steps=150)
    untrained = measure(engine, held_out, 3, EagleDrafter(model, new_head(model, None, None)), max_new_tokens=32)
    trained = measure(engine, held_out, 3, EagleDrafter(model, head), max_new_tokens=32)
    assert trained.mean_accepted_length > untrained.mean_accepted_length + 0.5
    # and it stays lossless
    reqs = [Request(p, SamplingParams(max_new_tokens=32)) for p in held_out]
    plain = engine.generate(reqs)
    spec = engine.generate(reqs, k=3, drafter=EagleDrafter(model, head))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # served in bf16 (a copy: the trained head stays float32), it drafts nearly as well and stays lossless
    bf16 = EagleDrafter(model, head, "bfloat16")
    assert bf16.head.fc.weight.dtype == torch.bfloat16 and head.fc.weight.dtype == torch.float32
    assert bf16.head.lm_head.weight.dtype == torch.bfloat16
    half = measure(engine, held_out, 3, bf16, max_new_tokens=32)
    assert half.mean_accepted_length > trained.mean_accepted_length - 0.15
    assert [o.token_ids for o in engine.generate(reqs, k=3, drafter=bf16)] == [o.token_ids for o in plain]
    if not int8_linear_available() or model.device.type != "cpu":  # int8 drafting is CPU-only
        return
    # with int8 weights (a quantized copy: the trained head keeps its float32 Linear layers), likewise
    int8 = EagleDrafter(model, head, "int8")
    assert isinstance(int8.head.fc, Int8Linear) and isinstance(int8.head.lm_head, Int8Linear)
    assert isinstance(head.fc, torch.nn.Linear) and head.fc.weight.dtype == torch.float32
    quarter = measure(engine, held_out, 3, int8, max_new_tokens=32)
    assert quarter.mean_accepted_length > trained.mean_accepted_length - 0.15
    assert [o.token_ids for o in engine.generate(reqs, k=3, drafter=int8)] == [o.token_ids for o in plain]


def test_stop_request_is_honoured_mid_epoch(structured):
    model, _, buffer, _ = structured
    trainer = DraftTrainer(model, new_head(model, None, None), offline_cfg())
    saved = []
    result = {}

    def run():
        result["report"] = trainer.train(buffer, max_seconds=60, checkpoint=lambda t: saved.append(t.step))

    thread = threading.Thread(target=run)
    thread.start()
    # mid-epoch: once a step is applied (a fixed sleep of 0.5 s saw none on a slow box, session 31)
    deadline = time.monotonic() + 30
    while trainer.step < 1 and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.perf_counter()
    trainer.request_stop()
    thread.join(timeout=30)
    assert not thread.is_alive()
    latency = time.perf_counter() - t0
    report = result["report"]
    assert report.stopped and report.num_steps >= 1
    assert saved and saved[-1] == trainer.step  # checkpointed at the stop, with every applied step
    assert latency < 5.0  # one micro-step on a tiny model; the benchmark measures the real p99


def test_a_stop_during_backward_aborts_the_micro_step_unapplied(structured):
    """The stop arrives once backward has begun: backward is cut short by a gradient hook and the
    optimizer step never runs."""
    model, _, buffer, _ = structured
    head = new_head(model, None, None)
    trainer = DraftTrainer(model, head, offline_cfg())
    batch = trainer.next_batch(buffer)
    before = {k: v.clone() for k, v in head.state_dict().items()}
    real_backward = torch.Tensor.backward

    def backward_then_stop(self, *args, **kwargs):
        trainer.request_stop()  # as if the request came in just as backward started
        return real_backward(self, *args, **kwargs)

    calls = []
    trainer._check_stop_orig = trainer._check_stop
    trainer._check_stop = lambda: calls.append(1) or trainer._check_stop_orig()
    try:
        torch.Tensor.backward = backward_then_stop
        with pytest.raises(StopRequestedError):
            trainer.micro_step(batch)
    finally:
        torch.Tensor.backward = real_backward
    # one check per unrolled step, one before backward, then the first gradient hook raised (the
    # check after backward would have made one more)
    assert len(calls) == trainer.cfg.num_unroll + 2
    assert trainer.step == 0
    assert all(torch.equal(v, before[k]) for k, v in head.state_dict().items())


@pytest.mark.parametrize("ahead", [False, True])
def test_train_needs_a_budget_and_data(structured, ahead):
    """ahead: the next batch packed in the background, as on a GPU (forced here on every device): a packing that
    failed on a buffer with no target yet is not the answer of the call after the buffer got one."""
    from concurrent.futures import ThreadPoolExecutor

    model, _, buffer, _ = structured
    trainer = DraftTrainer(model, new_head(model, None, None), offline_cfg())
    with pytest.raises(ValueError, match="max_steps or max_seconds"):
        trainer.train(buffer)
    with pytest.raises(ValueError, match="empty"):
        trainer.train(RolloutBuffer(max_bytes=1 << 20), max_steps=1)
    # single-pair rollouts have no target: batches of them are passed over, a buffer of only them refused
    short = RolloutBuffer(max_bytes=1 << 20)
    for r in buffer.rollouts[:6]:
        short.add(r.tokens[:2], r.hidden[:1], policy_version=0)
    small = offline_cfg(num_rows=1, max_tokens_per_row=8)
    trainer = DraftTrainer(model, new_head(model, None, None), small)
    trainer._packer = ThreadPoolExecutor(1) if ahead else None
    with pytest.raises(ValueError, match="no pair of the rollout buffer has a target"):
        trainer.train(short, max_steps=1)
    for r in buffer.rollouts[:2]:
        short.add(r.tokens, r.hidden, policy_version=0, num_prompt=r.num_prompt)
    assert trainer.train(short, max_steps=3).num_steps == 3
    with pytest.raises(ValueError, match="num_unroll"):
        TrainConfig(num_unroll=0)


def test_anneal_to_budget_ends_each_call_at_the_floor_rate(structured):
    """With anneal_to_budget the cosine spans the train() call's own budget: a lease's last steps run
    near lr * min_lr_ratio whatever total_steps says; without it they stay near the peak."""
    model, _, buffer, _ = structured
    cfg = offline_cfg(lr=1e-3, warmup_steps=2, total_steps=10_000, min_lr_ratio=0.0, anneal_to_budget=True)
    trainer = DraftTrainer(model, new_head(model, None, None), cfg)
    lrs = []
    trainer.train(buffer, max_steps=12, on_step=lambda step, stats: lrs.append(stats["lr"]))
    assert lrs[:2] == pytest.approx([5e-4, 1e-3])  # warmup
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))  # then decays monotonically ...
    assert lrs[-1] < 0.05 * 1e-3  # ... to the floor at the end of this call's 12 steps
    # a second call (the next lease) anneals over its own budget again, by time here: each step's rate is the
    # cosine at the budget's spent fraction when it began, and that fraction only grows, never ahead of the clock
    # (the test's clock starts first), however slow a busy box is
    lrs.clear()
    ends, progress, start = [], [], time.perf_counter()

    def on_step(step: int, stats: dict) -> None:
        ends.append(time.perf_counter() - start)
        lrs.append(stats["lr"])
        progress.append(stats["budget_progress"])

    trainer.train(buffer, max_seconds=2.0, on_step=on_step)  # at least two steps, even on a busy box
    assert len(lrs) >= 2 and lrs[-1] < lrs[0]
    assert progress == sorted(progress) and progress[0] >= 0
    assert all(p <= ended for p, ended in zip(progress, ends, strict=True))
    expected = [1e-3 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))) for p in progress]
    assert lrs == pytest.approx(expected, rel=1e-4, abs=1e-9)  # the trainer takes the cosine in float32
    flat = DraftTrainer(model, new_head(model, None, None), dataclasses.replace(cfg, anneal_to_budget=False))
    lrs.clear()
    flat.train(buffer, max_steps=12, on_step=lambda step, stats: lrs.append(stats["lr"]))
    assert lrs[-1] > 0.99 * 1e-3
    with pytest.raises(ValueError, match="min_lr_ratio"):
        TrainConfig(min_lr_ratio=1.5)


def test_bf16_autocast_trains_like_float32_and_keeps_float32_weights(structured):
    model, _, buffer, _ = structured
    batch = DraftTrainer(model, new_head(model, None, None), offline_cfg()).next_batch(buffer)
    losses = {}
    for bf16 in (False, True):
        head = new_head(model, None, None)
        trainer = DraftTrainer(model, head, offline_cfg(warmup_steps=1, bf16_autocast=bf16))
        losses[bf16] = [trainer.micro_step(batch)["loss"] for _ in range(31)]
        assert all(p.dtype == torch.float32 for p in head.parameters())
        assert all(s.dtype == torch.float32 for st in trainer.optimizer.state.values() for s in st.values()
                   if torch.is_tensor(s) and s.is_floating_point())
    assert losses[True][0] == pytest.approx(losses[False][0], rel=0.02)  # same loss, to bf16 rounding
    assert losses[True][-1] < 0.5 * losses[True][0]  # and it learns as float32 does
    assert losses[True][-1] < 1.5 * losses[False][-1]
    # None: on where the device has native bf16 matmuls
    auto = DraftTrainer(model, new_head(model, None, None), TrainConfig(bf16_autocast=None))
    assert auto.bf16_autocast == fast_bf16(model.device)
    assert TrainConfig().bf16_autocast is None and TrainConfig().anneal_to_budget  # the online lease's defaults


def test_trainer_keeps_the_draft_lm_weight_and_rebuilds_it_when_the_policy_changes(structured):
    """The trainer keeps the draft vocabulary's LM head between micro-steps (in the autocast dtype);
    the loss it gives equals gathering it afresh, and an in-place policy update or a new draft
    vocabulary is seen at once, never a stale copy."""
    model, _, buffer, _ = structured
    policy = copy.deepcopy(model)
    head = EagleHead(policy.cfg, EagleConfig(draft_vocab_size=policy.cfg.vocab_size // 2)).to(policy.device)
    for bf16 in (False, True):
        trainer = DraftTrainer(policy, head, offline_cfg(bf16_autocast=bf16))
        kept = trainer.lm_weight()
        assert kept.dtype == (torch.bfloat16 if bf16 else torch.float32)
        assert torch.equal(kept, draft_lm_weight(head, policy).to(kept.dtype))
        assert trainer.lm_weight() is kept  # not rebuilt while nothing changed
    batch = trainer.next_batch(buffer)
    batch = batch.to(policy.device)
    with torch.autocast(policy.device.type, dtype=torch.bfloat16):
        fresh = draft_loss(head, policy, batch, trainer.cfg)[0]
        cached = draft_loss(head, policy, batch, trainer.cfg, lm_weight=trainer.lm_weight())[0]
    assert float(cached.detach()) == float(fresh.detach())
    with torch.no_grad():
        policy.lm_head.weight.mul_(2)  # an in-place weight sync
    assert not torch.equal(trainer.lm_weight(), kept)
    assert torch.equal(trainer.lm_weight(), draft_lm_weight(head, policy).to(torch.bfloat16))
    policy.lm_head.weight = torch.nn.Parameter(policy.lm_head.weight.detach() * 3)  # a replaced weight
    assert torch.equal(trainer.lm_weight(), draft_lm_weight(head, policy).to(torch.bfloat16))
    ids = head.vocab_ids.clone()
    head.set_vocab(torch.arange(policy.cfg.vocab_size))  # a new draft vocabulary: the highest ids
    assert not torch.equal(head.vocab_ids, ids)
    assert torch.equal(trainer.lm_weight(), draft_lm_weight(head, policy).to(torch.bfloat16))


def test_rms_norm_of_bf16_activations_with_float32_weights():
    """Under autocast the head's norms see bf16 activations and float32 weights: normalised in float32."""
    from drafter.model.causal_lm import RMSNorm
    norm = RMSNorm(16, 1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 16)
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), norm(x), atol=0.05, rtol=0.02)


def test_killed_trainer_resumes_from_its_last_checkpoint(structured, tmp_path):
    model, _, buffer, _ = structured
    path = tmp_path / "trainer.safetensors"
    meta = DraftMeta(version=2, parent_version=1, policy_version=0)
    trainer = DraftTrainer(model, new_head(model, None, None), offline_cfg(warmup_steps=1))
    trainer.train(buffer, max_steps=5, checkpoint=lambda t: t.save(path, meta), checkpoint_every=2)
    saved = {k: v.clone() for k, v in trainer.head.state_dict().items()}
    # "killed" after the checkpoint: a fresh process rebuilds the trainer and resumes
    fresh = DraftTrainer(model, EagleHead(model.cfg, EagleConfig(init_seed=9)).to(model.device),
                         offline_cfg(warmup_steps=1))
    assert fresh.resume(path).version == 2
    assert fresh.step == 5 and fresh.num_tokens == trainer.num_tokens
    for k, v in fresh.head.state_dict().items():
        assert torch.equal(v, saved[k]), k
    batch = trainer.next_batch(buffer)
    assert trainer.micro_step(batch)["loss"] == fresh.micro_step(batch)["loss"]  # same optimizer state


def test_head_swap_mid_generation_is_lossless_and_takes_effect(structured):
    model, engine, buffer, held_out = structured
    trained = new_head(model, None, None)
    DraftTrainer(model, trained, offline_cfg(total_steps=100)).train(buffer, max_steps=100)
    reqs = [Request(p, SamplingParams(max_new_tokens=32)) for p in held_out]
    plain = engine.generate(reqs)
    drafter = EagleDrafter(model, new_head(model, None, None))
    calls = {"n": 0}
    original = drafter.propose

    def propose(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:  # as a published version would arrive: between two decode steps
            drafter.request_swap(trained, version=7)
        return original(*args, **kwargs)

    drafter.propose = propose
    swapped = engine.generate(reqs, k=3, drafter=drafter)
    assert [o.token_ids for o in swapped] == [o.token_ids for o in plain]
    assert drafter.swaps.num_swaps == 1 and drafter.version == 7
    untrained = engine.generate(reqs, k=3, drafter=EagleDrafter(model, new_head(model, None, None)))
    assert sum(o.num_accepted for o in swapped) > sum(o.num_accepted for o in untrained) + 20
    # a bf16 drafter takes a float32 head: converted when requested, the published head left as it was
    half = EagleDrafter(model, new_head(model, None, None), "bfloat16")
    half.request_swap(trained, version=8)
    assert [o.token_ids for o in engine.generate(reqs, k=3, drafter=half)] == [o.token_ids for o in plain]
    assert half.version == 8 and half.head.fc.weight.dtype == torch.bfloat16
    assert trained.fc.weight.dtype == torch.float32 and half.head is not trained
    if int8_linear_available() and model.device.type == "cpu":  # likewise int8 (CPU-only); a head converted in place
        # (as a worker's fresh load) is not copied
        q = EagleDrafter(model, new_head(model, None, None), "int8")
        q.request_swap(trained, version=9)
        assert [o.token_ids for o in engine.generate(reqs, k=3, drafter=q)] == [o.token_ids for o in plain]
        assert isinstance(q.head.fc, Int8Linear) and isinstance(trained.fc, torch.nn.Linear)
        fresh = copy.deepcopy(trained)
        q.request_swap(q.convert(fresh), version=10)
        q.apply_pending_swap()
        assert q.head is fresh and isinstance(fresh.fc, Int8Linear) and q.version == 10
        with pytest.raises(ValueError, match="int8 head can only be served by an int8 drafter"):
            EagleDrafter(model, fresh, "float32")


def test_offline_acceptance_tracks_online_decoding(structured):
    """The scheduler's publish rule scores drafts on recorded rollouts (drafter/train/evaluate.py): it must
    rank drafts as decoding does, and under greedy land near the accepted length decoding measures."""
    model, engine, buffer, held_out = structured
    head = new_head(model, None, None)
    DraftTrainer(model, head, offline_cfg(total_steps=150)).train(buffer, max_steps=150)
    untrained = new_head(model, None, None)
    greedy_rollouts = RolloutBuffer(max_bytes=16 << 20, hidden_dtype=torch.float32)
    harvest(engine, held_out, greedy_rollouts, cfg=HarvestConfig(batch_size=8, max_new_tokens=32, temperature=0.0))
    sampled_rollouts = RolloutBuffer(max_bytes=16 << 20, hidden_dtype=torch.float32)
    harvest(engine, held_out, sampled_rollouts, cfg=HarvestConfig(batch_size=8, max_new_tokens=32, temperature=1.0,
                                                                 top_p=1.0))
    for k in (1, 3):
        online = measure(engine, held_out, k, EagleDrafter(model, head), max_new_tokens=32).mean_accepted_length
        offline = expected_accepted_length(head, model, greedy_rollouts.rollouts, k)
        assert offline == pytest.approx(online, rel=0.15), (k, offline, online)
        assert offline > expected_accepted_length(untrained, model, greedy_rollouts.rollouts, k) + 0.3 * k
    sampled = expected_accepted_length(head, model, sampled_rollouts.rollouts, 3, greedy=False)
    assert 1.0 <= sampled <= 4.0
    assert sampled > expected_accepted_length(untrained, model, sampled_rollouts.rollouts, 3, greedy=False) + 0.5
    with pytest.raises(ValueError, match="k must be"):
        expected_accepted_length(head, model, greedy_rollouts.rollouts, 0)
    with pytest.raises(ValueError, match="no rollouts"):
        expected_accepted_length(head, model, [], 3)


def test_calibrated_draft_temperature_scores_best_offline_and_online(structured):
    """calibrate_draft_temperature picks the candidate with the most expected tokens per step under
    sampling; the offline score of a draft temperature tracks what sampled decoding measures with it."""
    model, engine, buffer, held_out = structured
    head = new_head(model, None, None)
    DraftTrainer(model, head, offline_cfg(total_steps=150)).train(buffer, max_steps=150)
    sampled_rollouts = RolloutBuffer(max_bytes=16 << 20, hidden_dtype=torch.float32)
    harvest(engine, held_out, sampled_rollouts, cfg=HarvestConfig(batch_size=8, max_new_tokens=32, temperature=1.0,
                                                                 top_p=1.0))
    tau, scores = calibrate_draft_temperature(head, model, sampled_rollouts.rollouts, 3)
    assert set(scores) == set(DRAFT_TEMPERATURES) and scores[tau] == max(scores.values())
    for t in (1.0, 0.0):
        assert scores[t] == pytest.approx(expected_accepted_length(head, model, sampled_rollouts.rollouts, 3,
                                                                   greedy=False, draft_temperature=t))
    for t in {1.0, tau, 0.0}:
        h = copy.copy(head)
        h.cfg = dataclasses.replace(head.cfg, draft_temperature=t)
        online = measure(engine, held_out * 4, 3, EagleDrafter(model, h), temperature=1.0,
                         max_new_tokens=32).mean_accepted_length
        assert online == pytest.approx(scores[t], rel=0.2), (t, online, scores[t])
    with pytest.raises(ValueError, match="draft_temperature"):
        EagleConfig(draft_temperature=-1)


def test_warm_start_keeps_its_harvest_and_saves_a_calibrated_head(structured, tmp_path):
    """The offline warm start: harvest (kept in a file a second run reads instead of generating),
    train, calibrate the draft temperature on the held-out prompts, save draft v1, report acceptance."""
    model, _, _, held_out = structured
    prompts = [p[:6].tolist() for p in pattern_corpus(24, seed=20_000)]
    harvest_file = tmp_path / "harvest.safetensors"
    messages: list[str] = []
    head, report = warm_start(model, None, prompts, tmp_path / "a", max_steps=40, draft_vocab_size=None,
                              harvest_cfg=HarvestConfig(batch_size=12, max_new_tokens=24, temperature=1.0),
                              eval_prompts=held_out, eval_ks=(2,), progress=messages.append,
                              harvest_file=harvest_file)
    assert harvest_file.is_file() and 0 < report.num_harvested_tokens <= 24 * 24 and report.train_steps == 40
    assert report.draft_temperature in DRAFT_TEMPERATURES and head.cfg.draft_temperature == report.draft_temperature
    scores = report.draft_temperature_scores
    assert scores[str(report.draft_temperature)] == max(scores.values())
    _, meta = load_draft(report.path)
    assert meta.head_config["eagle"]["draft_temperature"] == report.draft_temperature and meta.num_steps == 40
    assert float(report.acceptance["2"]) > 1.0
    messages.clear()
    _, again = warm_start(model, None, prompts[:1], tmp_path / "b", max_steps=2, draft_vocab_size=None,
                          progress=messages.append, harvest_file=harvest_file)
    assert again.num_harvested_tokens == report.num_harvested_tokens
    assert any("read from" in m for m in messages) and not any(m.startswith("harvest [") for m in messages)


def test_a_head_on_another_device_than_the_policy_is_refused():
    """The trainer and the offline scorer take the device from the head and need the policy there too: a
    clear error up front, not a device mismatch deep in a forward (here: the meta device stands in for a GPU)."""
    model = tiny_model()
    elsewhere = EagleHead(model.cfg).to("meta")
    with pytest.raises(ValueError, match="the head is on meta and the policy on cpu"):
        DraftTrainer(model, elsewhere)
    with pytest.raises(ValueError, match="the head is on meta and the policy on cpu"):
        rollouts = RolloutBuffer(max_bytes=1 << 20)
        rollouts.add(list(range(6)), torch.zeros(5, elsewhere.feature_size), policy_version=0)
        expected_accepted_length(elsewhere, model, rollouts.rollouts, 3)  # before anything is read
    head = new_head(model.to("meta"), None, 16)  # a new head is made on its policy's device
    assert head.fc.weight.is_meta and head.vocab_ids.is_meta


def test_a_training_step_does_not_wait_for_the_device(structured):
    """On a GPU the forward and backward of a micro-step queue their kernels without reading anything back:
    the loss's indices come from the masks on the CPU, before the batch moves (torch's sync debug mode makes
    every synchronizing call an error). bf16 autocast, as online leases train."""
    model, _, buffer, _ = structured
    if model.device.type != "cuda":
        pytest.skip("host syncs are a GPU matter")
    from drafter.train.unroll import LossIndex

    trainer = DraftTrainer(model, new_head(model, None, 32), offline_cfg(bf16_autocast=True))
    cpu_batch = trainer.next_batch(buffer)
    index, batch = LossIndex.of(cpu_batch, trainer.cfg.num_unroll), cpu_batch.to(model.device)
    index = index.to(model.device)
    lm_weight = trainer.lm_weight()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, stats = draft_loss(trainer.head, model, batch, trainer.cfg, trainer._check_stop, lm_weight, index)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert set(stats) == {f"{n}_{s}" for n in ("ce", "acc", "alpha") for s in range(trainer.cfg.num_unroll)}
    assert math.isfinite(float(loss.detach())) and trainer.head.fc.weight.grad is not None


def test_masked_attention_with_kv_heads_repeated_equals_grouped(device):
    """The GPU form (each KV head repeated per query head, for the fused kernels) computes what grouped SDPA
    does, gradients included."""
    from drafter.train.unroll import masked_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 5, 8, generator=gen).to(device).requires_grad_() for h in (6, 2, 2))
    mask = (torch.rand(2, 1, 5, 7, generator=gen) < 0.7).to(device)
    mask[..., 0] = True  # every query sees at least one key
    k7, v7 = torch.cat([k, k[:, :, :2]], dim=2), torch.cat([v, v[:, :, :2]], dim=2)  # (2, 2, 7, 8)
    outs = [masked_attention(q, k7, v7, mask, repeat_kv=r) for r in (False, True)]
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
