"""The drafter's training loss over unrolled draft positions.

Loss per pair j = (a_j, x_{j+1}) (a_j: the policy's three aux layers' states at position j): cross-entropy of the
head's draft distribution (its own LM head) against the policy's own distribution softmax(lm_head(h_{j+1})) over
the draft vocabulary (h: the policy's final-norm hidden state), plus a smooth-L1 regression of the head's normed
output onto h_{j+1}, for each step s of the training-time unrolling (drafter.train.unroll).

How the steps weigh (TrainConfig.position_loss):
- "decay": step s weighs unroll_decay**s, every chain alike;
- "reach": where acceptance is lost. Inference scores draft s of a chain only if drafts 0..s-1 were accepted, so
  the pair at step s weighs the chance that its chain gets there: reach = prod_{t<s} alpha_t, with alpha_t the
  rejection-sampling acceptance sum_x min(p(x), q(x)) of the chain's draft t (p the policy at temperature 1, as
  RL samples; q the head's softmax), detached; never below reach_floor, so a position no chain reaches yet still
  learns. A chain that is rejected early stops pulling on the later positions, and the positions inference reaches
  most pull hardest: the expected accepted length 1 + sum_m prod_{s<m} alpha_s is what grows. The weights grow as
  the head learns, so this loss is not comparable across training; ce_0 (step 0 always weighs 1) is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from drafter.draft.head import EagleHead, draft_lm_weight
from drafter.model.causal_lm import CausalLM
from drafter.model.config import TrainConfig
from drafter.train.buffer import PackedBatch
from drafter.train.unroll import LossIndex, flash_varlen_kernel, unrolled_predictions


def draft_loss(head: EagleHead, policy: CausalLM, batch: PackedBatch, cfg: TrainConfig,
               check_stop: Callable[[], None] | None = None,
               lm_weight: torch.Tensor | None = None, index: LossIndex | None = None) -> tuple[torch.Tensor, dict]:
    """lm_weight: draft_lm_weight(head, policy), the policy's LM head over the draft vocabulary that scores
    the targets, possibly already in the autocast dtype (a trainer keeps one copy instead of gathering and
    casting 8192 x D weights at every use). The LM heads, the largest matmuls of a step, run on the
    trained pairs only (loss_mask), not on padding or pairs without a chain. index: LossIndex.of(batch),
    on the batch's device (None: built here, from the batch wherever it is). The stats are 0-d tensors on
    the batch's device, per unroll step s: ce_s (the unweighted cross-entropy), acc_s (the head's argmax is the
    policy's) and alpha_s (the mean acceptance sum_x min(p, q) of its pairs at temperature 1)."""
    if lm_weight is None:
        lm_weight = draft_lm_weight(head, policy)
    if index is None:
        index = LossIndex.of(batch, cfg.num_unroll)
    if batch.feats.dtype != head.fc.weight.dtype:  # packed in the buffer's dtype (bf16): computed in the head's
        batch = dataclasses.replace(batch, feats=batch.feats.to(head.fc.weight.dtype))
    slots = batch.feats.flatten(0, 1)  # (R*T, F)
    target_feats = head.policy_hidden(slots.index_select(0, index.first + 1))  # (N, D): h_{j+1} for pair j
    with torch.no_grad():
        target_logits = F.linear(target_feats, lm_weight).float()  # (N, V')
        target_p = F.softmax(target_logits, dim=-1)
        target_top = target_logits.argmax(-1)
        del target_logits
    kernel = flash_varlen_kernel() if cfg.varlen_attention and batch.feats.is_cuda else None
    preds = unrolled_predictions(head, policy.embed_tokens, batch, cfg.num_unroll, check_stop, kernel)
    by_reach = cfg.position_loss == "reach"
    reach = None  # (R*T,) per slot p: prod of alpha over the chain that ends at p, of the steps so far
    total, stats = 0.0, {}
    for s, pairs, picked in index.steps:  # picked: which of the targets step s trains on
        trained = head.norm(preds[s].flatten(0, 1).index_select(0, pairs))  # (n, D): what the head's LM head scores
        logits = head.lm_head(trained)  # (n, V')
        logp = F.log_softmax(logits.float(), dim=-1)
        p = target_p[picked]  # (n, V')
        ce_pairs = -(p * logp).sum(-1)  # (n,)
        reg_pairs = F.smooth_l1_loss(trained, target_feats[picked], reduction="none").mean(-1)  # (n,)
        with torch.no_grad():
            agree = (logits.argmax(-1) == target_top[picked]).float().mean()
            alpha = torch.minimum(p, logp.exp()).sum(-1)  # (n,): acceptance of this draft, sampled at T=1
        pair_loss = ce_pairs + cfg.hidden_loss_weight * reg_pairs  # (n,)
        if by_reach:
            # pair p of step s continues the chain that ended at slot p - 1 after step s-1 (same root p - s)
            got_here = torch.ones_like(alpha) if reach is None else reach.index_select(0, pairs - 1)  # (n,)
            # not normalised by the weights' sum: a position reached more often weighs more as a whole (normalised
            # within each step and weighed by decay instead, it gave 2.16 expected tokens where this gave 2.36)
            total = total + (got_here.clamp(min=cfg.reach_floor) * pair_loss).mean()
            reach = torch.zeros(slots.shape[0], dtype=alpha.dtype, device=alpha.device).index_copy(
                0, pairs, got_here * alpha)
        else:
            total = total + cfg.unroll_decay**s * pair_loss.mean()
        stats[f"ce_{s}"], stats[f"acc_{s}"], stats[f"alpha_{s}"] = ce_pairs.detach().mean(), agree, alpha.mean()
    return total, stats
