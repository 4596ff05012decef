"""GRPO math on hand-computed examples, and the update on a tiny model (the learner's forwards and steps on the
`device` fixture's device); settings come off a JobSpec."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_model
from workers.grpo import group_advantages, grpo_loss, grpo_update, response_mask, sequence_logprobs
from workers.spec import JobSpec


def test_group_advantages_hand_computed():
    # group 0: mean 0.5, population std 0.5 -> (r - 0.5) / 0.5 = +-1; group 1 is unanimous -> 0
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]), JobSpec(group_size=4))
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]),
                               atol=1e-5, rtol=0)
    # [3, 0, 0]: mean 1, std sqrt((4 + 1 + 1) / 3) = sqrt(2) -> [2, -1, -1] / sqrt(2)
    adv = group_advantages(torch.tensor([[3.0, 0.0, 0.0]]), JobSpec(group_size=3))
    s = math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([[2 / s, -1 / s, -1 / s]]), atol=1e-5, rtol=0)
    dr_grpo = JobSpec(group_size=2, normalize_std=False)
    assert group_advantages(torch.tensor([[3.0, 1.0]]), dr_grpo).tolist() == [[1.0, -1.0]]
    with pytest.raises(ValueError, match="num_groups, group_size"):
        group_advantages(torch.tensor([1.0, 0.0]), dr_grpo)
    with pytest.raises(ValueError, match="group_size=2"):  # groups of another size than the job's
        group_advantages(torch.tensor([[1.0, 0.0, 1.0]]), dr_grpo)


def _loss_example():
    # seq 0, A = +1, logp - old = [0.5, 0, -0.5] -> r = [1.6487, 1, 0.6065]
    #   token 0: min(1.6487, clip 1.2) = 1.2          -> term -1.2      (clip active)
    #   token 1: r = 1                                -> term -1.0
    #   token 2: min(0.6065, clip 0.8) = 0.6065       -> term -0.6065   (low clip inactive for A > 0)
    # seq 1, A = -1, logp - old = [-0.5, 0.1, pad]   -> r = [0.6065, 1.1052]
    #   token 0: min(-0.6065, -0.8) = -0.8            -> term +0.8      (clip active)
    #   token 1: min(-1.1052, -1.1052)                -> term +1.1052
    # loss = (-1.2 - 1 - 0.6065 + 0.8 + 1.1052) / 5 valid tokens; clip_fraction = 2 / 5
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    logp = old + torch.tensor([[0.5, 0.0, -0.5], [-0.5, 0.1, 3.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    return logp, old, torch.tensor([1.0, -1.0]), mask


def test_grpo_loss_hand_computed():
    logp, old, adv, mask = _loss_example()
    logp.requires_grad_(True)
    loss, stats = grpo_loss(logp, old, adv, mask, clip_eps=0.2, kl_coef=0.0)
    e = math.exp
    expected = (-1.2 - 1.0 - e(-0.5) + 0.8 + e(0.1)) / 5
    assert math.isclose(float(loss.detach()), expected, rel_tol=1e-5)
    assert math.isclose(stats["clip_fraction"], 2 / 5, rel_tol=1e-6)
    assert math.isclose(stats["mean_ratio"], (e(0.5) + 1 + e(-0.5) + e(-0.5) + e(0.1)) / 5, rel_tol=1e-5)
    assert stats["kl"] == 0.0
    # d loss / d logp = -A r / 5 where the clip is inactive, 0 where it is active or masked
    loss.backward()
    expected_grad = torch.tensor([[0.0, -1.0, -e(-0.5)], [0.0, e(0.1), 0.0]]) / 5
    torch.testing.assert_close(logp.grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_grpo_loss_k3_kl_term():
    logp, old, adv, mask = _loss_example()
    base, _ = grpo_loss(logp, old, adv, mask, clip_eps=0.2, kl_coef=0.0)
    # d = ref - logp per token; k3(d) = e^d - d - 1:
    #   k3(0.2) = 0.02140, k3(0) = 0, k3(-0.2) = 0.01873, k3(0.1) = 0.00517, k3(0.3) = 0.04986; the
    #   padded token's d = 5 (k3 = 142.4) must not count. mean over 5 tokens = 0.019033
    d = torch.tensor([[0.2, 0.0, -0.2], [0.1, 0.3, 5.0]])
    loss, stats = grpo_loss(logp, old, adv, mask, clip_eps=0.2, kl_coef=0.5, ref_logp=logp + d)
    k3 = [math.exp(x) - x - 1 for x in (0.2, 0.0, -0.2, 0.1, 0.3)]
    kl = sum(k3) / 5
    assert math.isclose(kl, 0.019033, rel_tol=1e-4)
    assert math.isclose(stats["kl"], kl, rel_tol=1e-4)
    assert math.isclose(float(loss) - float(base), 0.5 * kl, rel_tol=1e-4)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(logp, old, adv, mask, clip_eps=0.2, kl_coef=0.5)


def test_sequence_logprobs_scores_generated_tokens_only(device):
    model = tiny_model().to(device).requires_grad_(True)
    seqs, plens = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]], [2, 2, 4]
    logp, mask = sequence_logprobs(model, seqs, plens, pad_id=0)
    # responses: [3, 4, 5], [8], [] -> (B, T) with T = 3, right-padded
    assert logp.shape == mask.shape == (3, 3)
    assert mask.tolist() == [[True, True, True], [True, False, False], [False, False, False]]
    assert logp.requires_grad
    for b, (s, p) in enumerate(zip(seqs, plens)):  # one unpadded forward per sequence
        ids = torch.tensor([s], device=device)  # (1, L)
        logits, _ = model(ids, torch.arange(len(s), device=device).unsqueeze(0), None)  # (1, L, V)
        full = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:].unsqueeze(-1)).squeeze(-1)
        n = len(s) - p
        torch.testing.assert_close(logp[b, :n], full[p - 1 :], atol=1e-5, rtol=1e-5)
        assert (logp[b, n:] == 0).all()
    with pytest.raises(ValueError, match=r"prompt_lens\[1\]"):
        sequence_logprobs(model, seqs, [2, 0, 1])


def _batch():
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13], [3, 3, 3, 3, 3], [5, 6, 7]]
    plens = [2, 1, 3, 2, 3]  # the last one generated nothing
    return seqs, plens, torch.tensor([1.0, -0.5, 0.3, -0.8, 0.2])


def test_micro_batches_give_the_full_batch_gradient_and_stats(device):
    seqs, plens, adv = _batch()
    ref_model = tiny_model(seed=5).to(device)
    grads, stats = [], []
    for mb in (5, 2, 1):
        model = tiny_model().to(device).requires_grad_(True)
        with torch.no_grad():
            logp, mask = sequence_logprobs(model, seqs, plens)
        noise = torch.randn(logp.shape, generator=torch.Generator().manual_seed(0)).to(device)  # the same on any device
        old = logp - 0.3 * noise * mask  # r != 1
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the weights alone
        cfg = JobSpec(micro_batch_size=mb, max_grad_norm=1e9, kl_coef=0.1)
        stats.append(grpo_update(model, opt, seqs, plens, adv, old, mask, cfg, ref_model=ref_model))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    for g, s in zip(grads[1:], stats[1:]):
        torch.testing.assert_close(g, grads[0], atol=1e-6, rtol=1e-4)
        for key in ("loss", "clip_fraction", "mean_ratio", "kl", "grad_norm"):
            assert math.isclose(s[key], stats[0][key], rel_tol=1e-4, abs_tol=1e-7), key
    assert stats[0]["num_tokens"] == 4 + 2 + 1 + 3 and stats[0]["clip_fraction"] > 0 and stats[0]["kl"] > 0


def test_response_mask_is_sequence_logprobs_mask_without_the_forward():
    seqs, plens, _ = _batch()
    _, mask = sequence_logprobs(tiny_model(), seqs, plens)
    assert torch.equal(response_mask(seqs, plens), mask)
    assert response_mask(seqs, plens).sum(1).tolist() == [4, 2, 1, 3, 0]


def separate_and_own(device, seqs, plens, adv, cfg, ref_model=None) -> list[tuple[dict, torch.Tensor]]:
    """[(stats, gradient)] of one lr-0 update with old_logp from a separate no-grad pass, then with
    old_logp=None (the update's own forward)."""
    runs = []
    for is_separate in (True, False):
        model = tiny_model().to(device).requires_grad_(True)
        if is_separate:
            with torch.no_grad():
                old, mask = sequence_logprobs(model, seqs, plens)
        else:
            old, mask = None, response_mask(seqs, plens)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stats = grpo_update(model, opt, seqs, plens, adv, old, mask, cfg, ref_model=ref_model)
        runs.append((stats, torch.cat([p.grad.flatten() for p in model.parameters()])))
    return runs


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_one_update_per_step_takes_old_logp_from_its_own_forward(device, kl_coef):
    """old_logp=None (the update's own forward, detached) gives the loss, gradient and stats of a separate
    no-grad pass, with or without the KL term against a reference."""
    seqs, plens, adv = _batch()
    ref_model = tiny_model(seed=5).to(device)
    cfg = JobSpec(micro_batch_size=2, max_grad_norm=1e9, kl_coef=kl_coef)
    (separate, g_separate), (own, g_own) = separate_and_own(device, seqs, plens, adv, cfg, ref_model)
    torch.testing.assert_close(g_own, g_separate, atol=1e-7, rtol=1e-5)
    assert g_own.abs().sum() > 0
    for key in ("loss", "mean_ratio", "clip_fraction", "kl", "grad_norm", "num_tokens"):
        assert math.isclose(own[key], separate[key], rel_tol=1e-5, abs_tol=1e-8), key
    assert own["mean_ratio"] == pytest.approx(1.0, abs=1e-6) and own["clip_fraction"] == 0.0
    assert (own["kl"] > 0) == (kl_coef > 0)


def test_rows_with_zero_advantage_are_skipped_with_the_same_result(device):
    """Unanimous groups (advantage 0) run no forward: gradient and stats equal the full pass's."""
    seqs, plens, _ = _batch()
    adv = torch.tensor([0.0, -0.5, 0.0, 0.8, 0.0])
    cfg = JobSpec(micro_batch_size=2, max_grad_norm=1e9)
    # a separate old_logp pass runs every row; old_logp=None skips
    (full, w_full), (skipping, w_skipping) = separate_and_own(device, seqs, plens, adv, cfg)
    assert w_full.abs().sum() > 0
    assert full["num_skipped"] == 1 and skipping["num_skipped"] == 3  # the empty row; then the zero advantages
    torch.testing.assert_close(w_skipping, w_full, atol=1e-7, rtol=1e-5)
    for key in ("loss", "mean_ratio", "clip_fraction", "kl", "grad_norm", "num_tokens"):
        assert math.isclose(skipping[key], full[key], rel_tol=1e-5, abs_tol=1e-8), key


def test_an_update_with_every_advantage_zero_runs_no_forward_and_still_steps(device):
    seqs, plens, _ = _batch()
    model = tiny_model().to(device).requires_grad_(True)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    stats = grpo_update(model, opt, seqs, plens, torch.zeros(5), None, response_mask(seqs, plens), JobSpec())
    assert stats["num_skipped"] == 5 and stats["loss"] == 0.0 and stats["mean_ratio"] == 1.0
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.testing.assert_close(after, before * (1 - 1e-2 * 0.1))  # AdamW's decay, as with a zero gradient


def test_update_raises_the_logprob_of_a_rewarded_sequence(device):
    model = tiny_model().to(device).requires_grad_(True)
    seqs, plens = [[1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]], [2, 2]
    with torch.no_grad():
        old, mask = sequence_logprobs(model, seqs, plens)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stats = grpo_update(model, opt, seqs, plens, torch.tensor([1.0, -1.0]), old, mask, JobSpec())
    assert stats["grad_norm"] > 0 and math.isclose(stats["mean_ratio"], 1.0, rel_tol=1e-5)
    with torch.no_grad():
        new, _ = sequence_logprobs(model, seqs, plens)
    assert new[0].sum() > old[0].sum()
    assert new[1].sum() < old[1].sum()


def test_update_with_nothing_generated_takes_no_step(device):
    model = tiny_model().to(device).requires_grad_(True)
    before = [p.clone() for p in model.parameters()]
    seqs, plens = [[1, 2, 3], [4, 5]], [3, 2]
    with torch.no_grad():
        old, mask = sequence_logprobs(model, seqs, plens)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    stats = grpo_update(model, opt, seqs, plens, torch.tensor([1.0, -1.0]), old, mask, JobSpec())
    assert stats["num_tokens"] == 0 and stats["grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_update_input_errors():
    model = tiny_model().requires_grad_(True)
    seqs, plens = [[1, 2, 3]], [1]
    with torch.no_grad():
        old, mask = sequence_logprobs(model, seqs, plens)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="ref_model"):
        grpo_update(model, opt, seqs, plens, torch.tensor([1.0]), old, mask, JobSpec(kl_coef=0.1))
    with pytest.raises(ValueError, match="advantages"):
        grpo_update(model, opt, seqs, plens, torch.tensor([1.0, 2.0]), old, mask, JobSpec())


@pytest.mark.parametrize("field", ["group_size", "clip_eps", "kl_coef", "lr", "max_grad_norm",
                                   "micro_batch_size", "num_updates_per_step"])
def test_grpo_settings_are_checked_by_the_spec_naming_the_field(field):
    bad = {"group_size": 1, "clip_eps": 1.5, "kl_coef": -0.1, "lr": 0.0, "max_grad_norm": 0.0,
           "micro_batch_size": 0, "num_updates_per_step": 0}
    with pytest.raises(ValueError, match=field):
        JobSpec(**{field: bad[field]})
