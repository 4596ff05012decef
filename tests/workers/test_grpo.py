"""GRPO math on hand-computed examples, and the tasks' rewards."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_model
from workers.grpo import GRPOConfig, group_advantages, grpo_loss, grpo_update, sequence_logprobs
from workers.tasks import ArithmeticTask, get_reward


def test_group_advantages_hand_computed():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]), atol=1e-5, rtol=0)
    raw = group_advantages(torch.tensor([[3.0, 1.0]]), normalize_std=False)
    assert raw.tolist() == [[1.0, -1.0]]


def test_grpo_loss_hand_computed():
    # sequence 0: A=+1, ratios e^0.5=1.649 (clipped to 1.2) and 1 -> terms -1.2, -1.0
    # sequence 1: A=-1, ratio e^-0.5=0.607 -> min(-0.607, -0.8) = -0.8 -> term +0.8; 2nd token masked
    logp = torch.tensor([[0.0, 0.0], [-0.5, 0.0]])
    old = torch.tensor([[-0.5, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = grpo_loss(logp, old, torch.tensor([1.0, -1.0]), mask, clip_eps=0.2)
    assert math.isclose(float(loss), (-1.2 - 1.0 + 0.8) / 3, rel_tol=1e-5)
    assert math.isclose(stats["clip_fraction"], 2 / 3, rel_tol=1e-6)
    # KL (k3) to a reference: d = ref - logp = 0.1 on every token -> e^0.1 - 0.1 - 1
    loss_kl, stats_kl = grpo_loss(logp, old, torch.tensor([1.0, -1.0]), mask, 0.2, kl_coef=0.5, ref_logp=logp + 0.1)
    k3 = math.exp(0.1) - 0.1 - 1
    assert math.isclose(float(loss_kl) - float(loss), 0.5 * k3, rel_tol=1e-4)
    assert math.isclose(stats_kl["kl"], k3, rel_tol=1e-4)


def test_sequence_logprobs_scores_generated_tokens_only():
    model = tiny_model()
    seqs, plens = [[1, 2, 3, 4, 5], [6, 7, 8]], [2, 2]
    logp, mask = sequence_logprobs(model, seqs, plens)
    assert mask.tolist() == [[False, True, True, True], [False, True, False, False]]
    logits, _ = model(torch.tensor([seqs[0]]), torch.arange(5).unsqueeze(0), None)
    ref = torch.log_softmax(logits[0, :-1], -1).gather(-1, torch.tensor(seqs[0][1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp[0, 1:], ref[1:], atol=1e-5, rtol=1e-5)


def test_micro_batches_give_the_full_batch_gradient():
    seqs = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13], [3, 3, 3, 3, 3]]
    plens = [2, 1, 3, 2]
    adv = torch.tensor([1.0, -0.5, 0.3, -0.8])
    grads = []
    for mb in (4, 1):
        model = tiny_model().requires_grad_(True)
        with torch.no_grad():
            old, mask = sequence_logprobs(model, seqs, plens)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        grpo_update(model, opt, seqs, plens, adv, old, mask, GRPOConfig(micro_batch_size=mb, max_grad_norm=1e9))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)


def test_update_raises_the_logprob_of_a_rewarded_sequence():
    model = tiny_model().requires_grad_(True)
    seqs, plens = [[1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9]], [2, 2]
    with torch.no_grad():
        old, mask = sequence_logprobs(model, seqs, plens)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    grpo_update(model, opt, seqs, plens, torch.tensor([1.0, -1.0]), old, mask, GRPOConfig())
    with torch.no_grad():
        new, _ = sequence_logprobs(model, seqs, plens)
    assert new[0].sum() > old[0].sum() and new[1].sum() < old[1].sum()


def test_arithmetic_task_is_deterministic_and_correct():
    a, b = ArithmeticTask(seed=3).sample(20), ArithmeticTask(seed=3).sample(20)
    assert a == b and a != ArithmeticTask(seed=4).sample(20)
    for p in a:  # replay the chain from the text
        value = int(p.prompt.split(" has ")[1].split(" ")[0])
        for sentence in p.prompt.split(". ")[1:]:
            if "gets" in sentence:
                value += int(sentence.split("gets ")[1].split(" ")[0])
            elif "gives away" in sentence:
                value -= int(sentence.split("gives away ")[1].rstrip("."))
            elif "doubles" in sentence:
                value *= 2
        assert str(value) == p.answer
    assert len({p.prompt.count("Then") for p in a}) > 1  # chains of different lengths


@pytest.mark.parametrize(("text", "reward"), [("so 3 + 4 = 7. Answer: 7", 1.0), ("Answer: 12.", 0.0),
                                              ("Answer: 8", 0.0), ("I think it is 7", 1.0), ("no idea", 0.0),
                                              ("Answer: -7", 0.0)])
def test_arithmetic_reward(text, reward):
    assert get_reward("arithmetic")(text, "7") == reward


def test_rewards_by_name_only():
    assert get_reward("numeric")("it is 3.0", "3") == 1.0
    assert get_reward("exact")(" yes ", "yes") == 1.0
    with pytest.raises(ValueError, match="reward must be one of"):
        get_reward("os.system")
