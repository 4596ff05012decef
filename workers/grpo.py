"""GRPO: group-normalised advantages, clipped-ratio loss, optional KL to a frozen reference.

Log-probabilities always come from the POLICY (never the drafter): speculative decoding changes
how fast tokens are produced, not which distribution they follow, so the policy's own log-probs
are the right `old_logp` and the update stays on-policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GRPOConfig:
    group_size: int = 4  # rollouts per prompt; advantages compare within a group
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # verifiable rewards rarely need it (DAPO drops it); set > 0 to keep near the reference
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    micro_batch_size: int = 4  # sequences per backward; bounds activation memory
    normalize_std: bool = True

    def __post_init__(self) -> None:
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.kl_coef < 0 or self.lr <= 0 or self.micro_batch_size < 1:
            raise ValueError("kl_coef must be >= 0, lr > 0 and micro_batch_size >= 1")


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """(num_groups, group_size) rewards -> advantages: reward minus its group's mean, over the std."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (num_groups, group_size), got shape {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centered


def sequence_logprobs(model, sequences: list[list[int]], prompt_lens: list[int],
                      pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of each generated token under `model`: (B, T) with T the longest sequence - 1, and
    a mask that is True only on generated (not prompt, not padding) positions."""
    B, L = len(sequences), max(len(s) for s in sequences)
    ids = torch.full((B, L), pad_id, dtype=torch.long)
    mask = torch.zeros(B, L - 1, dtype=torch.bool)
    for b, (s, p) in enumerate(zip(sequences, prompt_lens)):
        ids[b, : len(s)] = torch.tensor(s)
        mask[b, p - 1 : len(s) - 1] = True  # position t scores token t+1
    logits, _ = model(ids, torch.arange(L).expand(B, L), None)  # (B, L, V)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return logp * mask, mask


def grpo_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_eps: float, kl_coef: float = 0.0, ref_logp: torch.Tensor | None = None,
              num_tokens: int | None = None) -> tuple[torch.Tensor, dict]:
    """Token-level mean over all valid tokens (divided by `num_tokens` when micro-batching):
    -min(r A, clip(r, 1-eps, 1+eps) A) with r = exp(logp - old_logp), plus kl_coef * k3 KL."""
    denom = num_tokens if num_tokens is not None else int(mask.sum())
    ratio = torch.exp(logp - old_logp)  # (B, T)
    adv = advantages.view(-1, 1)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = surrogate
    kl = torch.zeros(())
    if kl_coef > 0 and ref_logp is not None:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * k3
        kl = (k3 * mask).sum() / max(denom, 1)
    loss = (per_token * mask).sum() / max(denom, 1)
    ratio_d = ratio.detach()
    clipped = ((ratio_d - 1).abs() > clip_eps) & mask
    stats = {"clip_fraction": float(clipped.sum()) / max(int(mask.sum()), 1),
             "mean_ratio": float((ratio_d * mask).sum()) / max(int(mask.sum()), 1), "kl": float(kl.detach())}
    return loss, stats


def grpo_update(model, optimizer, sequences, prompt_lens, advantages: torch.Tensor, old_logp: torch.Tensor,
                mask: torch.Tensor, cfg: GRPOConfig, ref_model=None) -> dict:
    """One optimizer step over all sequences, accumulated over micro-batches so the gradient equals
    the full batch's token mean."""
    num_tokens = int(mask.sum())
    optimizer.zero_grad(set_to_none=True)
    total, stats = 0.0, {}
    for i in range(0, len(sequences), cfg.micro_batch_size):
        sl = slice(i, i + cfg.micro_batch_size)
        logp, m = sequence_logprobs(model, sequences[sl], prompt_lens[sl])
        t = logp.shape[1]
        ref = None
        if ref_model is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref, _ = sequence_logprobs(ref_model, sequences[sl], prompt_lens[sl])
        loss, stats = grpo_loss(logp, old_logp[sl, :t], advantages[sl], m, cfg.clip_eps, cfg.kl_coef, ref, num_tokens)
        loss.backward()
        total += float(loss.detach())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    optimizer.step()
    return {"loss": total, "grad_norm": float(grad_norm), **stats}
