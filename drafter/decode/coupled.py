"""Coupled sampling: a row's sample at each position is a function of its seed, the position and the policy's
distribution only, so plain decoding, every draft length and every draft emit the same tokens for the same seed.

Gumbel-max: token t of a row is argmax_j(log p_t(j) + G(key, t, j)), where G is standard Gumbel noise made by a
counter-based hash of (the row's key, the token's index in the row, the token id) rather than drawn from a
stream. That is an exact sample of p_t (the policy's distribution after temperature, top-k and top-p). A draft
token is then accepted exactly when it equals that token: the greedy verifier run on the perturbed logits
(`Coupling.perturb`). This is drafter-invariant speculative decoding (Daliri, Musco and Suresh, 2024,
arXiv 2408.07978): the output does not depend on the draft, only the time it takes does. What it costs: a draft
token is accepted with probability P(argmax q == argmax(log p + G)) instead of rejection sampling's
sum_j min(p_j, q_j), and here the draft proposes its argmax (its distribution's most likely token), so a
coupled row accepts p(the draft's choice) per position. `tlt bench rl --coupled` uses it to compare arms on
identical rollouts (docs/benchmarks.md, "Paired arms").

The hash is 32-bit integer arithmetic carried in int64 tensors (every product stays below 2**63), so it runs
the same on every device: a row's noise, and so its tokens, are the same on a CPU and a GPU up to the logits'
own rounding.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from drafter.decode.sampling import BatchSampling, truncate

MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31 (a product of two 32-bit values would overflow int64): an avalanche mix in the
# manner of the murmur3 / lowbias32 finalizers
MIX_A, MIX_B = 0x7FEB352D, 0x2C1B3C6D


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix of x (int64 holding values in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = (x * MIX_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * MIX_B) & MASK32
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, token_index: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, T, V) float32 standard Gumbel noise G(keys[b], token_index[b, t], j) for every token id j < V.

    keys (B,) int64 in [0, 2**63); token_index (B, T) int64 >= 0: the index in its row (prompt included) of the
    token that position samples. Uniforms are (h + 0.5) / 2**32 for a 32-bit hash h, so G lies in about
    [-3.1, 22.9]; it is computed in float64 and rounded once."""
    device = keys.device
    row = _mix(_mix(keys & MASK32) ^ (keys >> 32))  # (B,)
    pos = _mix(row.view(-1, 1) ^ (token_index & MASK32))  # (B, T)
    ids = torch.arange(vocab_size, dtype=torch.int64, device=device)
    h = _mix(pos.unsqueeze(-1) ^ ids)  # (B, T, V)
    u = (h.double() + 0.5) * (2.0 ** -32)
    return u.log_().neg_().log_().neg_().float()


def row_key(seed: int | None) -> int:
    """A row's noise key: its seed (so the same seed gives the same tokens in every arm), or a drawn one."""
    return int(seed) if seed is not None else random.getrandbits(63)


@dataclass
class Coupling:
    """The coupled rows of a batch: `mask` (B,) True for rows that sample coupled (temperature > 0 and coupled),
    their keys, the batch's own sampling settings (`base`, what the noise is added under) and what the drafter
    and the verifier see instead (`seen`: coupled rows greedy)."""

    mask: torch.Tensor  # (B,) bool
    keys: torch.Tensor  # (B,) int64, 0 for rows that are not coupled
    base: BatchSampling
    seen: BatchSampling

    @classmethod
    def of(cls, params: list, sampling: BatchSampling, device: torch.device | str) -> Coupling | None:
        """The batch's coupling (params: each row's SamplingParams), None when no row samples coupled."""
        coupled = [bool(p.coupled) and p.temperature > 0 for p in params]
        if not any(coupled):
            return None
        keys = torch.tensor([row_key(p.seed) if c else 0 for p, c in zip(params, coupled)], dtype=torch.int64,
                            device=device)
        mask = torch.tensor(coupled, dtype=torch.bool, device=device)
        host = tuple((0.0, 0, 1.0) if c else h for c, h in zip(coupled, sampling.host))
        seen = BatchSampling(torch.where(mask, 0.0, sampling.temperature), sampling.top_k, sampling.top_p, host)
        return cls(mask, keys, sampling, seen)

    def select(self, rows: torch.Tensor) -> Coupling:
        """The coupling of the batch positions `rows` (a host tensor), as BatchSampling.select."""
        at = rows.to(self.mask.device)
        return Coupling(self.mask[at], self.keys[at], self.base.select(rows), self.seen.select(rows))

    def perturb(self, logits: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits -> float32 logits whose argmax is each coupled row's sample at token_index (B, T):
        logits / temperature, top-k/top-p applied (dropped tokens -inf), plus the row's Gumbel noise. Rows that
        are not coupled keep their logits (verify samples them as before)."""
        logits = logits.float()
        B, T, V = logits.shape
        temp = torch.where(self.mask, self.base.temperature, 1.0).view(B, 1, 1)
        z = logits / temp
        if self.base.truncates(V):
            z = truncate(z, self.base)
        z = z + gumbel_noise(self.keys, token_index, V)
        return torch.where(self.mask.view(B, 1, 1), z, logits)
