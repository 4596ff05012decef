"""What a decode step costs on one rollout worker, plain or speculative, and the draft length it serves.

One engine forward over B live rows, each feeding q new tokens (1 plain, k + 1 to verify k drafts) at a
mean context of c tokens, takes (a roofline: the slower of reading the bytes and doing the flops)

    t = overhead_s + per_token_s * B q + max(bytes / bandwidth, flops / compute)
    bytes = dense_bytes + expert_bytes * (1 - (1 - expert_fraction)^(B q)) + B c kv_bytes_per_token
    flops = B q (flops_per_token + c attn_flops_per_ctx)

The KV cache is read once per forward whatever q is (the q queries of a row attend together), so verifying
k drafts is nearly free where a forward is bound by reading weights or the KV cache, and costs compute where
it is bound by flops. An MoE reads only the experts its tokens route to: at batch 1 a verify over 4 tokens
reads up to 4x the experts of a plain step. `per_token_s` is the CPU's linear cost per row-token (a CPU
forward here is compute-bound past the weight read, docs/benchmarks.md). A speculative step is one verify
forward plus k draft forwards (a chain) plus `spec_overhead_s`; it yields `accepted_length(k, a)` tokens per
row, a being the chance each drafted position is accepted (the chain model the swap guard uses too).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from drafter.draft.meter import arms_for
from workers.engines import Speculation


def accepted_length(k: int, rate: float) -> float:
    """Expected tokens per verify step of a k-token chain, each position accepted with `rate` after the
    previous one: 1 + a + ... + a^k (the policy's own token always comes)."""
    return float(k + 1) if rate >= 1 else (1 - rate ** (k + 1)) / (1 - rate)


def rate_for_length(k: int, length: float) -> float:
    """The per-position rate a whose k-chain accepts `length` tokens per step (inverse of accepted_length)."""
    if not 1 <= length <= k + 1:
        raise ValueError(f"accepted length must be in [1, {k + 1}] for k={k}, got {length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if accepted_length(k, mid) < length else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class Forward:
    """One model's forward cost (see the module docstring); zeros switch terms off."""

    overhead_s: float = 0.0
    per_token_s: float = 0.0
    bandwidth: float = 1.0  # bytes/s achieved
    compute: float = 1.0  # flop/s achieved
    dense_bytes: float = 0.0
    expert_bytes: float = 0.0
    expert_fraction: float = 0.0  # experts a token routes to / experts
    kv_bytes_per_token: float = 0.0
    flops_per_token: float = 0.0
    attn_flops_per_ctx: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, int | float) and np.isfinite(value) and value >= 0):
                raise ValueError(f"{f.name} must be a finite number >= 0, got {value!r}")
        if self.bandwidth <= 0 or self.compute <= 0:
            raise ValueError("bandwidth and compute must be > 0")
        if self.expert_fraction > 1:
            raise ValueError(f"expert_fraction must be in [0, 1], got {self.expert_fraction}")

    def seconds(self, rows, q, ctx):
        """Seconds of one forward; rows, q and ctx may be numpy arrays (broadcast)."""
        tokens = rows * q
        bytes_ = self.dense_bytes + rows * ctx * self.kv_bytes_per_token
        if self.expert_bytes:
            bytes_ = bytes_ + self.expert_bytes * (1 - (1 - self.expert_fraction) ** tokens)
        flops = tokens * (self.flops_per_token + ctx * self.attn_flops_per_ctx)
        return self.overhead_s + self.per_token_s * tokens + np.maximum(bytes_ / self.bandwidth,
                                                                         flops / self.compute)


@dataclass(frozen=True)
class StepCost:
    """A worker's decode step: the policy's forward, the draft's, and what a speculative step adds."""

    target: Forward
    draft: Forward
    spec_overhead_s: float = 0.0  # per speculative step: rejection sampling, the draft's bookkeeping

    def __post_init__(self) -> None:
        if not self.spec_overhead_s >= 0:
            raise ValueError(f"spec_overhead_s must be >= 0, got {self.spec_overhead_s}")

    def seconds(self, rows, k: int, ctx):
        """One step at draft length k (0: plain decoding)."""
        if k == 0:
            return self.target.seconds(rows, 1, ctx)
        return (self.target.seconds(rows, k + 1, ctx) + k * self.draft.seconds(rows, 1, ctx)
                + self.spec_overhead_s)

    def prefill_seconds(self, rows: int, prompt_tokens: float) -> float:
        """The prompts' prefill: one forward over every row's prompt."""
        return float(self.target.seconds(rows, prompt_tokens, prompt_tokens / 2))


def choose_k(cost: StepCost, rows: np.ndarray, ctx: np.ndarray, rate: float, k_max: int,
             speculation: Speculation) -> np.ndarray:
    """Draft length per segment. adaptive: of the arms the real tuner tries (drafter.draft.meter.arms_for), the
    one with the most tokens per second here (the tuner's choice once it has measured every arm; its
    exploration is not modelled); always: k_max; off: 0."""
    if speculation == Speculation.OFF or k_max == 0:
        return np.zeros_like(rows, dtype=int)
    if speculation == Speculation.ALWAYS:
        return np.full_like(rows, k_max, dtype=int)
    arms = arms_for(k_max)
    rates = np.stack([accepted_length(k, rate) / cost.seconds(rows, k, ctx) for k in arms])  # (arms, segments)
    return np.asarray(arms)[np.argmax(rates, axis=0)]
