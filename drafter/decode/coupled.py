"""Coupled sampling: a row's sample at each position is a function of its seed, the position and the policy's
distribution only, so plain decoding, every draft length and every draft emit the same tokens for the same seed.

Gumbel-max: token t of a row is argmax_j(log p_t(j) + G(key, t, j)), where G is standard Gumbel noise made by a
counter-based hash of (the row's key, the token's index in the row, the token id) rather than drawn from a
stream. That is an exact sample of p_t (the policy's distribution after temperature, top-k and top-p). A draft
token is then accepted exactly when it equals that token: the greedy verifier run on the perturbed logits
(`Coupling.perturb`). This is drafter-invariant speculative decoding (Daliri, Musco and Suresh, 2024,
arXiv 2408.07978): the output does not depend on the draft, only the time it takes does. The EAGLE head drafts
argmax(log q + G) with the same noise (`Coupling.draft`), so its token is accepted with probability
P(argmax(log q + G) == argmax(log p + G)) >= (1 - TV) / (1 + TV), against rejection sampling's 1 - TV; drafts
without a distribution (history, n-grams) are accepted with probability p(draft). `tlt bench rl --coupled` uses
it to compare arms on identical rollouts (docs/benchmarks.md, "Paired arms").

The tokens are identical across arms only where the policy's logits are: in float32 the verify forward's logits
match a one-token forward's to within rounding that almost never moves the noisy argmax, but in bfloat16 they
differ enough to flip it within tens of tokens (the run still samples the policy exactly; it is only no longer
paired token for token).

The hash is 32-bit integer arithmetic carried in int64 tensors (every product stays below 2**63), so it runs
the same on every device: a row's noise, and so its tokens, are the same on a CPU and a GPU up to the logits'
own rounding.
"""

from __future__ import annotations

import logging
import os
import random
import time
from dataclasses import dataclass

import torch

from drafter.decode.sampling import BatchSampling, truncate

log = logging.getLogger(__name__)

MASK32 = 0xFFFFFFFF
# TLT_COMPILE_NOISE=0 computes the noise eagerly (the compiled kernel's first call takes about 10 s in a process,
# a few with inductor's disk cache warm)
COMPILE_NOISE = os.environ.get("TLT_COMPILE_NOISE", "1") != "0"
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


def gumbel_noise(keys: torch.Tensor, token_index: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, len(ids)) float32 standard Gumbel noise G(keys[b], token_index[b, t], ids[j]).

    keys (B,) int64 in [0, 2**63); token_index (B, T) int64 >= 0: the index in its row (prompt included) of the
    token that position samples; ids (V,) int64 token ids (the policy's whole vocabulary, or a draft's). Uniforms
    are (h + 0.5) / 2**32 for a 32-bit hash h, so G lies in about [-3.1, 22.9]; it is computed in float64 and
    rounded once."""
    row = _mix(_mix(keys & MASK32) ^ (keys >> 32))  # (B,)
    pos = _mix(row.view(-1, 1) ^ (token_index & MASK32))  # (B, T)
    x = pos.unsqueeze(-1) ^ ids.to(torch.int64)  # (B, T, V)
    return _noise(x.reshape(-1)).view(x.shape)


def _gumbel_of(x: torch.Tensor) -> torch.Tensor:
    """(M,) int64 in [0, 2**32) -> (M,) float32 standard Gumbel noise: the last mix and the two logs."""
    u = (_mix(x).double() + 0.5) * (2.0 ** -32)
    return u.log().neg().log().neg().float()


_compiled: dict[str, object] = {}  # "fn": _gumbel_of compiled (one pass over the noise), or None once it failed


def _noise(x: torch.Tensor) -> torch.Tensor:
    """_gumbel_of, compiled where torch.compile works (eager: about 20 passes over (rows x positions x vocabulary)
    int64 and float64 tensors, 0.3 ms per position of SmolLM2's 49k vocabulary on a 2-core CPU; compiled: one
    pass, about 5x faster), else eager, saying so once. Both compute the same integers and the same float64 logs
    before rounding to float32. The input is flat, so one graph serves every batch and position count."""
    fn = _compiled.get("fn", 0)
    if fn == 0:
        fn = _compiled["fn"] = torch.compile(_gumbel_of, dynamic=True) if COMPILE_NOISE else None
    if fn is not None:
        try:
            return fn(x)
        except Exception as exc:  # no C++ compiler or triton here: the eager ops compute the same noise
            log.warning("coupled sampling: torch.compile of the noise failed (%s: %s); computing it eagerly",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            _compiled["fn"] = None
    return _gumbel_of(x)


def warm_noise(device: torch.device | str) -> float:
    """Compile the noise kernel now, on a few rows of a small vocabulary (its graph takes any size: dynamic), and
    return the seconds it took: its first call in a process costs seconds (18 s cold here), which a job's workers
    pay before their first rollout (drafter.decode.warmup) rather than inside it."""
    start = time.perf_counter()
    keys = torch.arange(2, dtype=torch.int64, device=device)
    gumbel_noise(keys, keys.view(2, 1) + 3, torch.arange(64, dtype=torch.int64, device=device))
    return time.perf_counter() - start


def row_key(seed: int | None) -> int:
    """A row's noise key: its seed (so the same seed gives the same tokens in every arm), or a drawn one."""
    return int(seed) if seed is not None else random.getrandbits(63)


@dataclass
class Coupling:
    """The coupled rows of a batch: `mask` (B,) True for rows that sample coupled (temperature > 0 and coupled),
    their keys, and the batch's own sampling settings (`base`: what the noise is added under). The drafter and
    the verifier see `seen()`: the coupled rows greedy, with this coupling attached (BatchSampling.coupling)."""

    mask: torch.Tensor  # (B,) bool
    keys: torch.Tensor  # (B,) int64, 0 for rows that are not coupled
    base: BatchSampling

    @classmethod
    def of(cls, params: list, sampling: BatchSampling, device: torch.device | str) -> Coupling | None:
        """The batch's coupling (params: each row's SamplingParams), None when no row samples coupled."""
        coupled = [bool(p.coupled) and p.temperature > 0 for p in params]
        if not any(coupled):
            return None
        keys = torch.tensor([row_key(p.seed) if c else 0 for p, c in zip(params, coupled)], dtype=torch.int64,
                            device=device)
        return cls(torch.tensor(coupled, dtype=torch.bool, device=device), keys, sampling)

    def seen(self) -> BatchSampling:
        """What drafters and the verifier get: the coupled rows greedy, the others as they are."""
        host = tuple((0.0, 0, 1.0) if c else h for c, h in zip(self.mask.tolist(), self.base.host))
        return BatchSampling(torch.where(self.mask, 0.0, self.base.temperature), self.base.top_k, self.base.top_p,
                             host, self)

    def select(self, rows: torch.Tensor) -> Coupling:
        """The coupling of the batch positions `rows` (a host tensor), as BatchSampling.select."""
        at = rows.to(self.mask.device)
        return Coupling(self.mask[at], self.keys[at], self.base.select(rows))

    def perturb(self, logits: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """(B, T, V) logits -> float32 logits whose argmax is each coupled row's sample at token_index (B, T):
        logits / temperature, top-k/top-p applied (dropped tokens -inf), plus the row's Gumbel noise. Rows that
        are not coupled keep their logits (verify samples them as before)."""
        logits = logits.float()
        B, T, V = logits.shape
        z = logits / torch.where(self.mask, self.base.temperature, 1.0).view(B, 1, 1)
        if self.base.truncates(V):
            z = truncate(z, self.base)
        z = z + gumbel_noise(self.keys, token_index, torch.arange(V, device=logits.device))
        return torch.where(self.mask.view(B, 1, 1), z, logits)

    def draft(self, logits: torch.Tensor, token_index: torch.Tensor, ids: torch.Tensor,
              draft_temperature: float) -> torch.Tensor:
        """A draft's choice for its coupled rows: (B, V') draft logits over token ids `ids` -> (B,) indices into
        them, argmax(logits / (draft_temperature * T) + G) with the noise the policy's sample at token_index (B,)
        will use, so the draft's token is the policy's whenever the two distributions agree there (Gumbel
        coupling: accepted with probability at least (1 - TV) / (1 + TV)). draft_temperature 0: the argmax.
        Rows that are not coupled get their argmax (the caller keeps its own choice for them)."""
        logits = logits.float()
        if draft_temperature == 0:
            return logits.argmax(-1)
        B = logits.shape[0]
        z = logits / (draft_temperature * torch.where(self.mask, self.base.temperature, 1.0)).view(B, 1)
        z = z + gumbel_noise(self.keys, token_index.view(B, 1), ids)[:, 0]
        return torch.where(self.mask, z.argmax(-1), logits.argmax(-1))
