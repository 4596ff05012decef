"""Offline acceptance: how many tokens per verify step a draft head would give on recorded rollouts.

The scheduler publishes a merged draft only if it is not worse than the one being served, measured
on the same recent rollouts. Replaying generation for that would cost a rollout; instead we reuse
the recorded (token, policy hidden state) pairs: with training-time unrolling (exact to inference,
see tests/drafter/test_train.py) the head drafts k tokens from every position of every recorded
sequence at once, and each draft step s is scored against the policy's own next-token distribution
there (the policy's LM head on the recorded hidden state).

Per draft step the acceptance probability alpha is
  greedy:   1 if the draft's argmax is the policy's argmax, else 0;
  sampled:  sum_x min(p(x), q(x)), the rejection-sampling acceptance rate for draft q, target p
            (p at temperature 1; q over the head's logits / draft_temperature, or its argmax at 0).
A chain starting at position i then yields 1 + sum_{m=1..k} prod_{s<m} alpha_s(i+s) tokens per step,
averaged over every chain start whose k targets are in the sequence and that decoding could draft from: the
prompt's last pair on (the policy emits the first response token there; a chain rooted inside the prompt would
score guesses of prompt tokens, which no draft makes, and a templated prompt's are easy). Online decoding visits
only the chain starts its own acceptances lead to, so the two agree in expectation, not token for token.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from drafter.draft.head import EagleHead
from drafter.model.causal_lm import CausalLM
from drafter.train.buffer import Rollout, iter_batches
from drafter.train.unroll import loss_mask, unrolled_predictions

ROW_TOKENS = 256  # pairs per packed row: long responses are cut into chunks of this many
NUM_ROWS = 4  # rows per batch: bounds the (rows * tokens * vocab) logits held at once
# positions scored together on a CPU: their policy logits (64 x 49,152 float32 for SmolLM2, 12.6 MB) stay in the
# cache through the softmax and the draft temperatures' comparisons instead of a batch's 0.2 GB going through memory
# several times: a scoring round ran 3.6 s instead of 4.8 beside a one-row decode on the other core (session 38;
# the decode's own slowdown beside it, about 10%, stayed). A GPU scores a whole batch at once
CPU_CHUNK_POSITIONS = 64


# Draft temperatures calibrate_draft_temperature tries: from the head's own distribution to its argmax.
DRAFT_TEMPERATURES = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.0)


class EvaluationStoppedError(RuntimeError):
    """A scoring's `stop` event was set (the worker's rollouts arrived): it ended between two batches."""


def expected_accepted_length(head: EagleHead, policy: CausalLM, rollouts: list[Rollout], k: int,
                             greedy: bool = True, draft_temperature: float | None = None) -> float:
    """Mean tokens per verify step the head would give with k drafts on these rollouts (sampled: with
    draft_temperature, by default the head's own)."""
    tau = head.cfg.draft_temperature if draft_temperature is None else draft_temperature
    return expected_accepted_lengths(head, policy, rollouts, k, greedy, (tau,))[0]


def calibrate_draft_temperature(head: EagleHead, policy: CausalLM, rollouts: list[Rollout], k: int,
                                candidates: tuple[float, ...] = DRAFT_TEMPERATURES,
                                stop: threading.Event | None = None) -> tuple[float, dict[float, float]]:
    """The draft temperature with the most expected tokens per verify step when sampling at temperature
    1 on these (held-out) rollouts, and every candidate's score. Ties keep the earlier candidate. `stop`: raise
    EvaluationStoppedError at the next batch once it is set."""
    scores = expected_accepted_lengths(head, policy, rollouts, k, False, candidates, stop)
    best = max(range(len(candidates)), key=lambda i: (scores[i], -i))
    return candidates[best], dict(zip(candidates, scores))


def expected_accepted_lengths(head: EagleHead, policy: CausalLM, rollouts: list[Rollout], k: int,
                              greedy: bool = True, draft_temperatures: tuple[float, ...] = (1.0,),
                              stop: threading.Event | None = None) -> list[float]:
    """expected_accepted_length for each draft temperature (sampled; greedy ignores them), in one pass."""
    survived, count = _survival(head, policy, rollouts, k, greedy, draft_temperatures, stop)
    return (1.0 + survived.sum(1) / count).tolist()


def acceptance_by_position(head: EagleHead, policy: CausalLM, rollouts: list[Rollout], k: int, greedy: bool = True,
                           draft_temperature: float | None = None) -> list[float]:
    """Per draft position j = 1..k, the chance that draft j is accepted given drafts 1..j-1 were (greedy, or
    sampled at temperature 1 with draft_temperature, by default the head's own): where a chain's acceptance is
    lost. Their running product summed, plus one, is expected_accepted_length. A position no chain reaches scores
    0."""
    tau = head.cfg.draft_temperature if draft_temperature is None else draft_temperature
    survived, count = _survival(head, policy, rollouts, k, greedy, (tau,))
    reached = torch.cat([count.view(1), survived[0, :-1]])  # (k,): chains whose first j-1 drafts were accepted
    return torch.where(reached > 0, survived[0] / reached.clamp(min=1e-12), 0.0).tolist()


def _alphas(head: EagleHead, feats: torch.Tensor, preds: list[torch.Tensor], lm_full: torch.Tensor, greedy: bool,
            draft_temperatures: tuple[float, ...]) -> list[list[torch.Tensor]]:
    """Per draft temperature and draft step s, alpha (R, T-1): the chance that step s's draft at slot j is accepted
    (see the module's docstring), computed over chunks of slots (CPU_CHUNK_POSITIONS on a CPU)."""
    R, T1 = feats.shape[0], feats.shape[1] - 1
    hidden = head.policy_hidden(feats[:, 1:]).reshape(R * T1, -1)  # the policy at slot j
    drafted = [pred[:, :-1].reshape(R * T1, -1) for pred in preds]
    vocab_ids = head.vocab_ids
    out = [[hidden.new_empty(R * T1, dtype=torch.float32) for _ in preds] for _ in draft_temperatures]
    step = max(R * T1, 1) if hidden.device.type == "cuda" else CPU_CHUNK_POSITIONS
    for a in range(0, R * T1, step):
        target_logits = F.linear(hidden[a:a + step], lm_full).float()  # (c, V)
        if greedy:
            target_top = target_logits.argmax(-1)
        else:
            p_draft_vocab = target_logits.softmax(-1)[:, vocab_ids]  # (c, V')
        for s, pred in enumerate(drafted):
            draft_logits = head.logits(pred[a:a + step]).float()  # (c, V')
            for i, tau in enumerate(draft_temperatures):
                if greedy:
                    alpha = (vocab_ids[draft_logits.argmax(-1)] == target_top).float()
                elif tau == 0:  # the argmax is proposed: accepted with the policy's probability of it
                    alpha = p_draft_vocab.gather(-1, draft_logits.argmax(-1, keepdim=True)).squeeze(-1)
                else:
                    alpha = torch.minimum(p_draft_vocab, (draft_logits / tau).softmax(-1)).sum(-1)
                out[i][s][a:a + step] = alpha
    return [[x.view(R, T1) for x in row] for row in out]


@torch.no_grad()
def _survival(head: EagleHead, policy: CausalLM, rollouts: list[Rollout], k: int, greedy: bool,
              draft_temperatures: tuple[float, ...], stop: threading.Event | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed over every chain start whose k targets are in the sequence, from the prompt's last pair on (the
    batch's response_start): per draft temperature and m = 1..k,
    the chance that the first m drafts are all accepted ((n, k) float64, on the CPU), and the number of chains."""
    if any(t < 0 for t in draft_temperatures) or not draft_temperatures:
        raise ValueError(f"draft_temperatures must be >= 0 and not empty, got {draft_temperatures!r}")
    if greedy:
        draft_temperatures = draft_temperatures[:1]
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if not rollouts:
        raise ValueError("no rollouts to evaluate on")
    device = head.fc.weight.device  # every batch moves to the head's device, which must be the policy's
    if policy.device != device:
        raise ValueError(f"the head is on {device} and the policy on {policy.device}: score them on one device")
    was_training = head.training
    head.eval()
    dtype = head.fc.weight.dtype
    lm_full = policy.lm_head.weight.to(dtype)  # (V, D)
    n = len(draft_temperatures)
    # sums kept on the device and read once at the end: a float() per batch would wait for the device each time
    total = torch.zeros(n, k, dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    try:
        for batch in iter_batches(rollouts, ROW_TOKENS, NUM_ROWS, shuffle=False):
            if stop is not None and stop.is_set():
                raise EvaluationStoppedError("stopped before the last batch: the worker's rollouts came first")
            batch = batch.to(device, dtype)  # packed on the CPU, where the rollouts are
            preds = unrolled_predictions(head, policy.embed_tokens, batch, k)
            alphas = _alphas(head, batch.feats, preds, lm_full, greedy, draft_temperatures)  # [tau][s]: (R, T-1)
            R = alphas[0][0].shape[0]
            valid = []
            for s in range(k):
                for i in range(n):  # re-index by chain start i = j - s
                    alphas[i][s] = torch.cat([alphas[i][s][:, s:], alphas[i][s].new_zeros(R, s)], dim=1)
                ok = loss_mask(batch, s, response_only=True)  # the chain's root is in the segment's response
                valid.append(torch.cat([ok[:, s:], ok.new_zeros(R, s)], dim=1))
            chain_ok = torch.stack(valid).all(0)  # (R, T-1): every draft step of the chain has its target
            for i in range(n):
                survive = torch.stack(alphas[i]).cumprod(0)  # (k, R, T-1): the first m drafts all accepted
                total[i] += torch.where(chain_ok, survive, 0.0).sum((1, 2))  # (k,); no mask indexing: no sync
            count += chain_ok.sum()
    finally:
        head.train(was_training)
    total, count = total.cpu(), count.cpu()
    if float(count) == 0:
        raise ValueError(f"the rollouts are too short to score {k} draft steps")
    return total, count
