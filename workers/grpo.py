"""GRPO: group-normalised advantages, clipped-ratio loss, optional KL to a frozen reference.

Log-probabilities always come from the POLICY, never from a drafter: speculative decoding changes
how fast tokens are produced, not which distribution they follow (verification is lossless), so
the policy's own log-probs are the right `old_logp` and the update stays on-policy. A drafter's
log-probs describe a different distribution and would bias every ratio.

Layout used throughout: `logp`, `old_logp`, `ref_logp` and `mask` are (B, T) with T the longest
RESPONSE in the batch; column j is the j-th generated token of that row, right-padded.

The settings (group_size, clip_eps, kl_coef, max_grad_norm, micro_batch_size, normalize_std) are the
job's own: the functions read them off its JobSpec (workers.spec), where each default has its reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from drafter.model.causal_lm import CausalLM

if TYPE_CHECKING:  # only its fields are read: the learner's math imports no pydantic (a bare GPU node runs it)
    from workers.spec import JobSpec


class StateRecorder(Protocol):
    """Takes the policy states a log-prob forward computes anyway (workers.learner_pairs.LearnerPairs: drafter
    training pairs for engines that do not harvest them)."""

    aux_layers: tuple[int, ...]  # the layers the forward is asked for (drafter.model.causal_lm.CausalLM.forward)

    def record(self, rows: Sequence[int], hidden: torch.Tensor, aux: torch.Tensor) -> None:
        """hidden (b, L, D), aux (b, L, 3D) of the forward's rows, right-padded; rows[i]: row i's index in the
        caller's batch."""


def group_advantages(rewards: torch.Tensor, spec: JobSpec, eps: float = 1e-6) -> torch.Tensor:
    """(num_groups, group_size) rewards -> same-shape advantages: reward minus its group's mean,
    divided by the group's population std (+ eps) when spec.normalize_std. A unanimous group gets 0."""
    if rewards.dim() != 2 or rewards.shape[1] != spec.group_size:
        raise ValueError(f"rewards must be (num_groups, group_size={spec.group_size}), got shape "
                         f"{tuple(rewards.shape)}")
    rewards = rewards.float()
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (G, S)
    if spec.normalize_std:
        centered = centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centered


def sequence_logprobs(model: CausalLM, sequences: list[list[int]], prompt_lens: list[int], pad_id: int = 0,
                      recorder: StateRecorder | None = None,
                      rows: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each generated token under `model` (always the POLICY, never a drafter).

    sequences[b] = prompt + response token ids; prompt_lens[b] = len(prompt) >= 1. One cache-free
    causal forward over the right-padded batch; differentiable when grad is enabled.
    Returns (logp, mask), both (B, T) with T the longest response: logp[b, j] = log p(response
    token j | everything before it); mask is False on padding, where logp is 0.
    recorder: the same forward also returns the recorder's aux layers, handed to it with `rows` (the sequences'
    indices in the recorder's batch; None: 0..B-1). With no response token at all there is no forward.
    """
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"prompt_lens has {len(prompt_lens)} entries for {len(sequences)} sequences")
    if not sequences:
        raise ValueError("sequences must not be empty")
    for b, (s, p) in enumerate(zip(sequences, prompt_lens)):
        if not 1 <= p <= len(s):
            raise ValueError(f"prompt_lens[{b}] must be in [1, {len(s)}] (the sequence's length), got {p}")
    device = model.device
    B, L = len(sequences), max(len(s) for s in sequences)
    ids = torch.tensor([s + [pad_id] * (L - len(s)) for s in sequences], dtype=torch.long, device=device)  # (B, L)
    plens = torch.tensor(prompt_lens, device=device)  # (B,)
    resp_lens = torch.tensor([len(s) for s in sequences], device=device) - plens  # (B,)
    T = int(resp_lens.max())
    j = torch.arange(T, device=device)  # (T,)
    mask = j.unsqueeze(0) < resp_lens.unsqueeze(1)  # (B, T)
    if T == 0:
        return torch.zeros(B, 0, device=device), mask
    positions = torch.arange(L, device=device).expand(B, L)  # (B, L)
    if recorder is None:
        _, hidden = model(ids, positions, None, logits_for="none")  # (B, L, D)
    else:
        _, hidden, aux = model(ids, positions, None, logits_for="none", aux_layers=recorder.aux_layers)
        recorder.record(range(B) if rows is None else rows, hidden, aux)  # (B, L, D), (B, L, 3D)
    # response token j of row b sits at position plens[b] + j and is scored by the logits one before it: the LM
    # head runs on those positions only (not on the prompt's), the costliest layer at SmolLM2's 49k vocabulary
    target_pos = (plens.unsqueeze(1) + j).clamp(max=L - 1)  # (B, T); padding rows clamp to a valid index
    score_pos = target_pos - 1  # (B, T)
    D = hidden.shape[-1]
    picked = model.lm_head(hidden.gather(1, score_pos.unsqueeze(-1).expand(B, T, D))).float()  # (B, T, V)
    targets = ids.gather(1, target_pos)  # (B, T)
    logp = torch.log_softmax(picked, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return torch.where(mask, logp, torch.zeros_like(logp)), mask


def response_mask(sequences: list[list[int]], prompt_lens: list[int],
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """(B, T) bool on `device`, T the longest response: True on each row's generated tokens (sequence_logprobs's
    mask, without its forward)."""
    resp_lens = torch.tensor([len(s) - p for s, p in zip(sequences, prompt_lens)], device=device)  # (B,)
    T = max((len(s) - p for s, p in zip(sequences, prompt_lens)), default=0)
    return torch.arange(T, device=device).unsqueeze(0) < resp_lens.unsqueeze(1)  # (B, T)


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float, kl_coef: float, ref_logp: torch.Tensor | None = None,
              num_tokens: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate plus optional k3 KL, as a TOKEN-level mean over all valid tokens of the batch.

    per token: -min(r A, clip(r, 1-eps, 1+eps) A), r = exp(logp - old_logp), plus
    kl_coef * (exp(ref - logp) - (ref - logp) - 1) (k3: unbiased, always >= 0).
    Token-level mean (DAPO): every token weighs the same, so long responses are not down-weighted
    the way a per-sequence mean would. `num_tokens` overrides the divisor (the full batch's valid
    token count when micro-batching, so micro-batch losses sum to the full-batch loss).
    stats are means over this call's valid tokens: clip_fraction (tokens where the clip is active,
    i.e. the gradient is cut), mean_ratio, kl (0 when no ref_logp).
    """
    if logp.shape != old_logp.shape or logp.shape != mask.shape:
        raise ValueError(f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same shape")
    if advantages.shape != (logp.shape[0],):
        raise ValueError(f"advantages must be ({logp.shape[0]},), got {tuple(advantages.shape)}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError("ref_logp is required when kl_coef > 0")
    mask = mask.to(logp.device, torch.bool)  # response_mask makes it on the CPU
    num_valid = int(mask.sum())
    denom = max(num_tokens if num_tokens is not None else num_valid, 1)
    adv = advantages.to(logp).unsqueeze(1)  # (B, 1)
    ratio = torch.exp(logp - old_logp.to(logp))  # (B, T)
    clipped_ratio = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)  # (B, T)
    kl = torch.zeros((), device=logp.device)
    if ref_logp is not None:
        d = ref_logp.to(logp) - logp
        k3 = torch.exp(d) - d - 1  # (B, T)
        if kl_coef > 0:
            per_token = per_token + kl_coef * k3
        kl = torch.where(mask, k3, 0.0).sum().detach() / max(num_valid, 1)
    loss = torch.where(mask, per_token, 0.0).sum() / denom
    r = ratio.detach()
    is_clipped = ((r > 1 + clip_eps) & (adv > 0)) | ((r < 1 - clip_eps) & (adv < 0))  # (B, T)
    n = max(num_valid, 1)
    stats = {"clip_fraction": float((is_clipped & mask).sum()) / n,
             "mean_ratio": float(torch.where(mask, r, 0.0).sum()) / n, "kl": float(kl)}
    return loss, stats


def update_rows(mask: torch.Tensor, advantages: torch.Tensor, old_logp: torch.Tensor | None,
                spec: JobSpec) -> list[int]:
    """The rows grpo_update runs forward: every row with a generated token, but with old_logp None and kl_coef 0
    none whose advantage is 0 (see grpo_update)."""
    row_tokens = mask.sum(dim=1).tolist()
    can_skip = old_logp is None and spec.kl_coef == 0
    return [b for b in range(mask.shape[0]) if row_tokens[b] and not (can_skip and float(advantages[b]) == 0.0)]


def grpo_update(model: CausalLM, optimizer: torch.optim.Optimizer, sequences: list[list[int]],
                prompt_lens: list[int], advantages: torch.Tensor, old_logp: torch.Tensor | None,
                mask: torch.Tensor, spec: JobSpec, ref_model: CausalLM | None = None,
                pad_id: int = 0, recorder: StateRecorder | None = None) -> dict[str, float]:
    """One optimizer step over all sequences.

    Gradients are accumulated over micro-batches of `spec.micro_batch_size` sequences, each loss
    divided by the FULL batch's valid-token count, so the summed gradient equals the full batch's
    token-mean gradient. Then clip to `spec.max_grad_norm` and step once. `old_logp` and `mask` are
    what `sequence_logprobs` returned for these sequences (policy, no grad). `ref_model` is needed
    when spec.kl_coef > 0. The caller loops `spec.num_updates_per_step` times with the same old_logp.
    old_logp=None: the policy has not moved since the rollouts (the first, or only, update of a step), so
    old_logp is this update's own forward, detached: the ratio is 1 and the loss and gradient are those of
    a separate no-grad pass, which this saves (mask from `response_mask`).
    Cheaper, same result: when old_logp is None and kl_coef is 0, a row whose advantage is 0 (a group whose
    rollouts all scored alike: most groups while rewards are rare) adds exactly nothing to the loss or the
    gradient (its ratio is 1, never clipped), so it is not run forward at all; its tokens still count in the
    token mean's divisor and in the stats. The rows that run are taken longest first, so a micro-batch pads
    its rows to lengths alike.
    recorder: the rows' forwards hand it their states too (sequence_logprobs), before the step moves the policy.
    Returns JSON-ready stats: loss, grad_norm, clip_fraction, mean_ratio, kl, num_tokens, num_skipped (rows).
    """
    B = len(sequences)
    if mask.dim() != 2 or mask.shape[0] != B or (old_logp is not None and old_logp.shape != mask.shape):
        shape = None if old_logp is None else tuple(old_logp.shape)
        raise ValueError(f"old_logp {shape} and mask {tuple(mask.shape)} must be ({B}, T)")
    if advantages.shape != (B,):
        raise ValueError(f"advantages must be ({B},), got {tuple(advantages.shape)}")
    if spec.kl_coef > 0 and ref_model is None:
        raise ValueError("ref_model is required when kl_coef > 0")
    num_tokens = int(mask.sum())
    sums = {"loss": 0.0, "clip_fraction": 0.0, "mean_ratio": 0.0, "kl": 0.0}
    optimizer.zero_grad(set_to_none=True)
    if num_tokens == 0:  # nothing was generated: no gradient, no step
        return {**sums, "grad_norm": 0.0, "num_tokens": 0, "num_skipped": 0}
    row_tokens = mask.sum(dim=1).tolist()
    rows = update_rows(mask, advantages, old_logp, spec)
    skipped_tokens = num_tokens - sum(row_tokens[b] for b in rows)
    sums["mean_ratio"] = skipped_tokens / num_tokens  # a skipped row's ratio is exactly 1 (old_logp is its own)
    rows.sort(key=lambda b: -len(sequences[b]))
    for start in range(0, len(rows), spec.micro_batch_size):
        idx = rows[start : start + spec.micro_batch_size]
        mb_mask = mask[idx]
        mb_tokens = int(mb_mask.sum())
        mb_seqs, mb_plens = [sequences[b] for b in idx], [prompt_lens[b] for b in idx]
        logp, _ = sequence_logprobs(model, mb_seqs, mb_plens, pad_id, recorder, idx)  # (b, t), t <= T
        t = logp.shape[1]
        ref = None
        if ref_model is not None and spec.kl_coef > 0:
            with torch.no_grad():
                ref, _ = sequence_logprobs(ref_model, mb_seqs, mb_plens, pad_id)
        old = logp.detach() if old_logp is None else old_logp[idx, :t]
        loss, st = grpo_loss(logp, old, advantages[idx], mb_mask[:, :t].to(logp.device),
                             spec.clip_eps, spec.kl_coef, ref, num_tokens)
        loss.backward()
        sums["loss"] += float(loss.detach())
        for key in ("clip_fraction", "mean_ratio", "kl"):  # token-weighted, so they are full-batch means
            sums[key] += st[key] * mb_tokens / num_tokens
    if len(rows) == 0:  # every row skipped: the gradient is exactly zero; the step keeps the optimizer's clock
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.max_grad_norm)
    optimizer.step()
    return {**sums, "grad_norm": float(grad_norm), "num_tokens": num_tokens, "num_skipped": B - len(rows)}
