"""Sampling parameters, the token distribution they define, and lossless draft verification.

Naming, here and everywhere in drafter/: p is the target's (the policy's) distribution, q the draft's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy: the argmax token, no randomness
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()  # added to the model's EOS ids
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False  # benchmarks generate a fixed number of tokens
    seed: int | None = None  # per-request seed; None draws one from torch's global generator
    # Gumbel-max sampling keyed by (seed, position, token) (drafter.decode.coupled): the same seed gives the same
    # tokens with or without drafts, whatever the draft; sampled rows only (greedy ones are already)
    coupled: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.coupled, bool):
            raise ValueError(f"coupled must be a bool, got {self.coupled!r}")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class BatchSampling:
    """Per-row sampling settings as tensors, so one batch can mix greedy and sampled rows; `host` holds the
    same settings as Python values, so the decode loop asks which paths a batch needs without reading the
    device back (a CUDA graph cannot)."""

    temperature: torch.Tensor  # (B,) float, 0 for greedy rows
    top_k: torch.Tensor  # (B,) long, 0 = off
    top_p: torch.Tensor  # (B,) float, 1 = off
    host: tuple[tuple[float, int, float], ...] | None = None  # per row (temperature, top_k, top_p)
    # drafter.decode.coupled.Coupling: the rows that sample coupled (greedy here, over perturbed logits), None: none
    coupling: Any = None
    is_greedy: torch.Tensor = field(init=False)  # (B,) bool

    def __post_init__(self) -> None:
        self.is_greedy = self.temperature == 0
        if self.host is None:
            self.host = tuple(zip(self.temperature.tolist(), self.top_k.tolist(), self.top_p.tolist()))

    @classmethod
    def from_params(cls, params: list[SamplingParams], device: torch.device | str = "cpu") -> BatchSampling:
        return cls(torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                   torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
                   torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                   tuple((float(p.temperature), int(p.top_k), float(p.top_p)) for p in params))

    def select(self, rows: torch.Tensor) -> BatchSampling:
        host = tuple(self.host[i] for i in rows.tolist())
        return BatchSampling(self.temperature[rows], self.top_k[rows], self.top_p[rows], host,
                             None if self.coupling is None else self.coupling.select(rows))

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 for t, _, _ in self.host)

    @property
    def any_greedy(self) -> bool:
        return any(t == 0 for t, _, _ in self.host)

    def truncates(self, vocab_size: int) -> bool:
        """Whether any row applies top-k (below the vocabulary) or top-p."""
        return any(0 < k < vocab_size or p < 1 for _, k, p in self.host)


def token_probs(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """(B, T, V) logits -> (B, T, V) float32 probabilities after temperature, top-k and top-p.

    The same function shapes the target and the draft distributions, so verification compares
    like with like. Greedy rows get a one-hot on the argmax.
    """
    logits = logits.float()
    B, T, V = logits.shape
    temp = torch.where(sampling.is_greedy, torch.ones_like(sampling.temperature), sampling.temperature)
    logits = logits / temp.view(B, 1, 1)
    if sampling.truncates(V):
        logits = truncate(logits, sampling)
    probs = logits.softmax(dim=-1)
    if sampling.any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(sampling.is_greedy.view(B, 1, 1), one_hot, probs)
    return probs


def draft_probs(logits: torch.Tensor, sampling: BatchSampling, draft_temperature: float) -> torch.Tensor:
    """(B, T, V') draft logits -> the draft distribution q: the rows' sampling distribution over
    logits / draft_temperature, or a one-hot on the argmax when draft_temperature is 0."""
    if draft_temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return token_probs(logits if draft_temperature == 1 else logits / draft_temperature, sampling)


TRUNCATION_CANDIDATES = 1024  # top-k/top-p look at the best this many first (a full sort is the fallback)


def truncate(logits: torch.Tensor, sampling: BatchSampling) -> torch.Tensor:
    """Top-k, then top-p (the smallest prefix, by probability, whose mass reaches top_p): every
    other logit becomes -inf. The kept tokens are almost always among the best few hundred, so
    this ranks the best TRUNCATION_CANDIDATES with topk (a full sort of a 49k vocabulary is a
    quarter of a batched decode step on CPU). When a row's kept set might reach past them (or a
    top-k lies between them and the vocabulary), everything is done again with a full sort."""
    B, T, V = logits.shape
    k = torch.where(sampling.top_k > 0, sampling.top_k.clamp(max=V), torch.full_like(sampling.top_k, V)).view(B, 1, 1)
    top_p = sampling.top_p.view(B, 1, 1)
    C = min(V, TRUNCATION_CANDIDATES)
    if C < V:
        vals, order = logits.topk(C, dim=-1)  # (B, T, C), best first
        drop = _drop_mask(vals, k, top_p, logits)
        # complete: everything past the candidates is dropped too (by rank, or by mass, which only grows)
        if bool(((k <= C) | (k >= V)).all()) and bool((drop[..., -1] | (k[..., 0] <= C)).all()):
            return torch.full_like(logits, float("-inf")).scatter(-1, order, vals.masked_fill(drop, float("-inf")))
    vals, order = logits.sort(dim=-1, descending=True)
    drop = _drop_mask(vals, k, top_p, logits)
    return logits.scatter(-1, order, vals.masked_fill(drop, float("-inf")))


def _drop_mask(sorted_vals: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """For the best-first prefix `sorted_vals` (B, T, C) of `logits`: True where top-k or top-p drops it."""
    C, V = sorted_vals.shape[-1], logits.shape[-1]
    rank = torch.arange(C, device=logits.device).view(1, 1, C)
    drop = rank >= k
    # log-normaliser of the top-k distribution: over the prefix when it holds all k, else over everything
    in_prefix = sorted_vals.masked_fill(drop, float("-inf")).logsumexp(-1, keepdim=True)
    norm = in_prefix if C == V else torch.where(k <= C, in_prefix, logits.logsumexp(-1, keepdim=True))
    probs = (sorted_vals - norm).exp().masked_fill(drop, 0.0)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumsum
    drop = drop | (mass_before >= top_p)  # keep the smallest prefix reaching top_p
    drop[..., 0] = False
    return drop


SAMPLE_BLOCK = 1024  # sample()'s block of the vocabulary (SmolLM2's 49,152 = 48 blocks, a draft's 8,192 = 8)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: (N, V) probabilities, (N,) uniforms in [0, 1) -> (N,) token ids: the first token whose
    cumulative mass passes u times the total. In two levels: the block whose cumulative mass passes it (a sum per
    block of SAMPLE_BLOCK tokens, then a scan over the blocks), then the token within that block (a scan over its
    SAMPLE_BLOCK). A scan over a whole 49k vocabulary for a few rows ran as one slow kernel on a GPU (0.06 ms a call,
    several per T=1 speculative step); these are short."""
    N, V = probs.shape
    pad = -V % SAMPLE_BLOCK  # a vocabulary that is no multiple of the block: zeros after it, never drawn
    blocks = (F.pad(probs, (0, pad)) if pad else probs).reshape(N, -1, SAMPLE_BLOCK)  # (N, nb, block)
    block_cdf = blocks.sum(-1).cumsum(-1)  # (N, nb)
    target = (uniforms * block_cdf[:, -1]).unsqueeze(-1)  # (N, 1)
    b = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)  # (N, 1)
    before = torch.where(b > 0, block_cdf.gather(-1, (b - 1).clamp(min=0)), 0.0)  # mass of the blocks before
    within = blocks.gather(1, b.unsqueeze(-1).expand(N, 1, SAMPLE_BLOCK)).squeeze(1)  # (N, block)
    i = torch.searchsorted(within.cumsum(-1) + before, target, right=True).clamp_(max=SAMPLE_BLOCK - 1)
    idx = (b * SAMPLE_BLOCK + i).squeeze(-1).clamp_(max=V - 1)
    # a zero-probability token can only be hit through rounding at a CDF's flat end: step back
    bad = probs.gather(-1, idx.unsqueeze(-1)).squeeze(-1) <= 0
    return torch.where(bad, probs.argmax(-1), idx)  # unconditionally: no read-back (capturable)


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # (B,) draft tokens accepted, 0..draft_lens[b]
    next_tokens: torch.Tensor  # (B,) the token after the accepted ones: correction or bonus


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_lens: torch.Tensor,
           draft_probs: torch.Tensor | None, sampling: BatchSampling,
           uniforms: torch.Tensor | None) -> Verdict:
    """Accept a prefix of each row's draft so the output keeps the target distribution exactly.

    target_logits (B, K+1, V): position i scores the token after draft_tokens[:, :i].
    draft_tokens (B, K), draft_lens (B,): row b proposes draft_tokens[b, :draft_lens[b]].
    draft_probs (B, K, V): the draft distribution q each token was drawn from, or None for
    deterministic drafters (a one-hot on the proposed token).
    uniforms (B, K+1) in [0, 1): K acceptance tests and one draw for the final token.
    """
    B, K = draft_tokens.shape
    device = target_logits.device
    in_draft = torch.arange(K, device=device).view(1, K) < draft_lens.view(B, 1)  # (B, K)
    if sampling.all_greedy:
        # Greedy: accept while the draft equals the target's argmax; the next token is the argmax.
        target_tokens = target_logits.argmax(-1)  # (B, K+1)
        accept = (draft_tokens == target_tokens[:, :K]) & in_draft
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
        return Verdict(num_accepted, target_tokens.gather(1, num_accepted.view(B, 1)).squeeze(1))
    # Rejection sampling, p the target's (policy's) distribution and q the draft's:
    #   accept draft token x with probability min(1, p(x) / q(x));
    #   on the first rejection sample from norm(max(0, p - q)); if all K pass, sample p (the bonus token).
    p = token_probs(target_logits, sampling)  # (B, K+1, V), greedy rows are one-hots
    if draft_probs is None:
        q = torch.zeros(B, K, p.shape[-1], device=device).scatter_(-1, draft_tokens.unsqueeze(-1), 1.0)
    else:
        q = draft_probs.float()
    p_x = p[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, K)
    q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, K)
    if uniforms is None:
        raise ValueError("uniforms are required when any row samples (temperature > 0)")
    accept = (uniforms[:, :K] * q_x < p_x) & in_draft  # u < p/q without dividing by q
    num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # (B,)
    rows = torch.arange(B, device=device)
    p_n = p[rows, num_accepted]  # (B, V)
    rejected = num_accepted < draft_lens
    q_n = torch.where(rejected.view(B, 1), q[rows, num_accepted.clamp(max=max(K - 1, 0))], 0.0) if K else 0.0
    residual = (p_n - q_n).clamp_(min=0)
    empty = residual.sum(-1) <= 0  # only when q == p up to rounding: then p itself is exact
    residual = torch.where(empty.view(B, 1), p_n, residual)
    return Verdict(num_accepted, sample(residual, uniforms[:, K]))
