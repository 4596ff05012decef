"""Two sources, one verify: per row and step, the history draft (drafter.draft.history) where its suffix match is
long enough, else the EAGLE head's. Both are fed every step (begin, observe, keep_rows and EAGLE's own propose
go to both), so either can take a row over at the next step; the chosen rows' drafts are one chain each, verified
by the engine as any chain is. The choice depends only on tokens already emitted, never on the step's uniforms,
and a history draft is deterministic (q one-hot), so verification keeps the policy's distribution.
"""

from __future__ import annotations

import torch

from drafter.draft.drafters import Drafter, Proposal, pad_proposal, widen
from drafter.draft.history import HistoryDrafter

# the shortest history match that drafts instead of the head. `tlt bench drafter-history` measures the drafts a
# history step accepts by match length (SmolLM2, long-tail groups of 8 at T=1, k=4: 0.17 at 1 token, 0.31 at 2,
# 0.48 at 3, 0.6 at 4, 1.5 from 6 on; docs/benchmarks.md, "History drafts") and takes the crossover with the head
# it runs; a trained head accepts 1.0-1.5 drafts per step at k=4 (fewer at T=1), which history passes from about
# 4 tokens on. Re-measure with the long-tail warm draft (the bench's `combined_min_match`)
HISTORY_MIN_MATCH = 4


class CombinedDrafter(Drafter):
    needs_hidden = True
    name = "combined"

    def __init__(self, eagle: Drafter, history: HistoryDrafter, min_match: int = HISTORY_MIN_MATCH) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.eagle, self.history, self.min_match = eagle, history, min_match
        self.needs_hidden = eagle.needs_hidden
        self.aux_layers = eagle.aux_layers
        self.num_history_rows = 0  # row-steps drafted from history
        self.num_eagle_rows = 0  # row-steps drafted by the head

    def begin(self, prompts, prefill_hidden, max_len: int = 0) -> None:
        self.eagle.begin(prompts, prefill_hidden, max_len=max_len)
        self.history.begin(prompts, prefill_hidden, max_len=max_len)

    def observe(self, new_tokens, hidden) -> None:
        self.eagle.observe(new_tokens, hidden)
        self.history.observe(new_tokens, hidden)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.eagle.keep_rows(rows)
        self.history.keep_rows(rows)

    def shape_counts(self):
        return self.eagle.shape_counts()

    def propose(self, contexts, caps, sampling, uniforms, width=None) -> Proposal:
        K = max(caps, default=0) if width is None else width
        drafts = self.history.drafts(contexts, caps)
        lens = self.history.match_lens
        chosen = [b for b, d in enumerate(drafts) if d and lens[b] >= self.min_match]
        prop = widen(self.eagle.propose(contexts, caps, sampling, uniforms, width=K), K)
        self.num_history_rows += len(chosen)
        self.num_eagle_rows += sum(1 for c in caps if c > 0) - len(chosen)
        if not chosen:
            return prop
        device = prop.tokens.device
        rows = torch.tensor(chosen, dtype=torch.long, device=device)
        hist = pad_proposal([drafts[b] for b in chosen], device, width=K)  # (C, K)
        tokens = prop.tokens.index_copy(0, rows, hist.tokens)
        num = prop.lens.index_copy(0, rows, hist.lens.to(prop.lens.dtype))
        probs = prop.probs
        if probs is not None:  # q of a history draft: one-hot on its token (fresh tensors: written in place)
            one_hot = torch.zeros(len(chosen), K, probs.shape[-1], dtype=probs.dtype, device=device)
            probs.index_copy_(0, rows, one_hot.scatter_(-1, hist.tokens.unsqueeze(-1), 1.0))
        return Proposal(tokens, num, probs)
