"""Drafters propose up to k tokens per sequence; the engine verifies them against the policy.

A drafter keeps per-row state for the live batch. The engine calls, in order:
  begin(prompts, prefill_hidden)            once per batch
  propose(contexts, caps, sampling, u)      before each verify forward (a chain of drafts), or
  propose_tree(contexts, caps, sampling, u, tree)   when tree_for(k) gave a draft tree
  observe(new_tokens, hidden, num_new)      after it, with what the policy accepted
  keep_rows(rows)                           when finished rows leave the batch
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from drafter.decode.sampling import BatchSampling


@dataclass
class Proposal:
    tokens: torch.Tensor  # (B, K) long, padded with 0 past each row's length
    lens: torch.Tensor  # (B,) long, number of real draft tokens per row (<= caps)
    probs: torch.Tensor | None  # (B, K, V) the draft distribution q, None for deterministic drafters
    # draft trees (drafter.decode.tree): tokens[:, j - 1] is node j's; valid (B, N) marks the nodes row b proposed
    valid: torch.Tensor | None = None
    host_lens: list[int] | None = None  # `lens` as the drafter knew them on the host (the engine reads none back)


class Drafter(ABC):
    # True when the drafter consumes the policy's features (drafter.model.causal_lm.draft_features)
    needs_hidden: bool = False
    aux_layers: tuple[int, ...] | None = None  # the policy layers those features carry (EAGLE-3's aux states)
    name: str = "drafter"

    def begin(self, prompts: list[list[int]], prefill_hidden: torch.Tensor | None, max_len: int = 0) -> None:
        """A new batch starts. prefill_hidden (B, P, F): the policy's features at prompt[:-1], right-padded.
        max_len: the policy cache's slots per row (no row grows past it), for drafters that size a cache."""
        return None

    @abstractmethod
    def propose(self, contexts: list[list[int]], caps: list[int], sampling: BatchSampling,
                uniforms: torch.Tensor | None, width: int | None = None) -> Proposal:
        """Draft up to caps[b] tokens after contexts[b]; uniforms (B, k) drive sampled drafts. width: the
        proposal's columns (the engine's k, which every step of a draft length keeps; None: max(caps))."""

    def tree_for(self, k: int, batch_size: int = 1):
        """The draft tree (drafter.decode.tree.Tree) this drafter proposes for draft depth k with batch_size
        sequences live, or None for a chain of k tokens through `propose`. At batch_size 1 it is the
        largest tree the drafter ever proposes for k."""
        return None

    def propose_tree(self, contexts: list[list[int]], caps: list[int], sampling: BatchSampling,
                     uniforms: torch.Tensor | None, tree) -> Proposal:
        """Draft `tree`'s nodes after each context, none deeper than caps[b]; uniforms (B, N)."""
        raise NotImplementedError(f"{type(self).__name__} drafts chains only")

    def observe(self, new_tokens: list[list[int]], hidden: torch.Tensor | None) -> None:
        """new_tokens[b]: tokens the policy emitted this step; hidden (B, T, F): its features at the
        verified positions, of which the first len(new_tokens[b]) are valid for row b."""
        return None

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keep only `rows` of the batch, in that order."""
        return None

    def shape_counts(self):
        """The drafter's static-path counters (drafter.decode.static.ShapeCounts), None where it keeps none."""
        return None

    def step_sources(self) -> dict[str, tuple[int, int, int]]:
        """A drafter of several sources (drafter.draft.combined): the last step's drafts per source, {source:
        (rows, tokens drafted, drafts accepted)}, for the draft-length tuner's reports; {} for one source."""
        return {}


def pad_proposal(drafts: list[list[int]], device: torch.device | str = "cpu", width: int | None = None
                 ) -> Proposal:
    """Token lists as a Proposal on `device`, right-padded with 0 to `width` (None: the longest)."""
    width = max((len(d) for d in drafts), default=0) if width is None else width
    tokens = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long, device=device)
    lens = torch.tensor([len(d) for d in drafts], dtype=torch.long, device=device)
    return Proposal(tokens.view(len(drafts), width), lens, None)


def widen(prop: Proposal, width: int) -> Proposal:
    """`prop` with exactly `width` draft columns (a drafter may return fewer: padded with token 0, q 0)."""
    have = prop.tokens.shape[1]
    if have > width:
        raise ValueError(f"the drafter proposed {have} tokens per row; at most {width} were asked for")
    if have == width:
        return prop
    probs = None if prop.probs is None else torch.nn.functional.pad(prop.probs, (0, 0, 0, width - have))
    return Proposal(torch.nn.functional.pad(prop.tokens, (0, width - have)), prop.lens, probs, prop.valid,
                    prop.host_lens)


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens
    (n from max_ngram down to min_ngram) and propose the tokens that followed it."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def lookup(self, context: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        seq = np.asarray(context, dtype=np.int64)
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)  # (L-n, n), excludes the suffix itself
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent match
                return seq[start : start + k].tolist()
        return []

    def propose(self, contexts, caps, sampling, uniforms, width=None) -> Proposal:
        return pad_proposal([self.lookup(c, cap) for c, cap in zip(contexts, caps)], width=width)
