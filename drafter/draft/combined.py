"""Two sources, one verify: per row and step, the history draft (drafter.draft.history) where its suffix match is
long enough, else the EAGLE head's. Both are fed every step (begin, observe, keep_rows and EAGLE's own propose
go to both), so either can take a row over at the next step; the chosen rows' drafts are one chain each, verified
by the engine as any chain is. The choice depends only on tokens already emitted, never on the step's uniforms,
and a history draft is deterministic (q one-hot), so verification keeps the policy's distribution.

Which source pays is measured as it serves (`SourceChooser`): the head's drafts accepted per step where it drafted,
and, per match length, what every history draft would have had accepted, drafted or not. A one-hot draft's
tokens are each accepted with the policy's chance of emitting them, so the expected number accepted is the
expected common prefix of the draft and the tokens the policy goes on to emit (whatever drafted them: the output
is the policy's sample); a draft's prefix is compared with the row's next tokens as they arrive, over steps.

Each step also says which source drafted each row and what it had accepted (`step_sources`): the engine hands
that to its draft-length tuner, which keeps it per live-batch bucket (drafter.draft.adaptive) for its reports.
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
MIN_STEPS_TO_JUDGE = 32  # measured steps a source needs at a match length before the rule trusts them over min_match
MAX_MATCH_BUCKET = 16  # longer matches share the last bucket
SOURCES = ("history", "eagle")  # the names step_sources reports the two sources by


class SourceChooser:
    """Pure: per match length, history's measured drafts accepted per step against the head's; min_match where
    either has fewer than MIN_STEPS_TO_JUDGE steps."""

    def __init__(self, min_match: int = HISTORY_MIN_MATCH, min_steps: int = MIN_STEPS_TO_JUDGE) -> None:
        if min_match < 1 or min_steps < 1:
            raise ValueError(f"min_match and min_steps must be >= 1, got {min_match}, {min_steps}")
        self.min_match, self.min_steps = min_match, min_steps
        self.history = [[0, 0] for _ in range(MAX_MATCH_BUCKET + 1)]  # per match bucket: steps, drafts accepted
        self.head = [0, 0]

    def record_history(self, match: int, num_accepted: int) -> None:
        cell = self.history[min(match, MAX_MATCH_BUCKET)]
        cell[0] += 1
        cell[1] += num_accepted

    def record_head(self, num_accepted: int) -> None:
        self.head[0] += 1
        self.head[1] += num_accepted

    def use_history(self, match: int) -> bool:
        steps, accepted = self.history[min(match, MAX_MATCH_BUCKET)]
        if steps < self.min_steps or self.head[0] < self.min_steps:
            return match >= self.min_match
        return accepted / steps >= self.head[1] / self.head[0]


class CombinedDrafter(Drafter):
    needs_hidden = True
    name = "combined"

    def __init__(self, eagle: Drafter, history: HistoryDrafter, min_match: int = HISTORY_MIN_MATCH,
                 adaptive: bool = True) -> None:
        """min_match: the rule until measured (always, with adaptive False). adaptive: choose by SourceChooser's
        measurements, kept across batches (a new head resets them: `new_head`)."""
        self.eagle, self.history = eagle, history
        self.chooser = SourceChooser(min_match)
        self.adaptive = adaptive
        self.needs_hidden = eagle.needs_hidden
        self.aux_layers = eagle.aux_layers
        self.num_history_rows = 0  # row-steps drafted from history
        self.num_eagle_rows = 0  # row-steps drafted by the head
        # row -> (the part of a history draft not yet judged, its match length, its tokens agreed so far)
        self._pending: list[tuple[list[int], int, int] | None] = []
        self._drafted_by: list[tuple[str, int] | None] = []  # row -> (source, tokens drafted) this step
        self._step_sources: dict[str, tuple[int, int, int]] = {}

    @property
    def min_match(self) -> int:
        return self.chooser.min_match

    def new_head(self) -> None:
        """A new head serves: what the old one accepted says nothing of it."""
        self.chooser.head = [0, 0]

    def begin(self, prompts, prefill_hidden, max_len: int = 0) -> None:
        self.eagle.begin(prompts, prefill_hidden, max_len=max_len)
        self.history.begin(prompts, prefill_hidden, max_len=max_len)
        self._pending, self._drafted_by = [None] * len(prompts), [None] * len(prompts)
        self._step_sources = {}

    def step_sources(self) -> dict[str, tuple[int, int, int]]:
        """The last step's drafts by source: {"history" or "eagle": (rows, tokens drafted, drafts accepted)},
        the sources that drafted no row left out ({} after a plain step)."""
        return dict(self._step_sources)

    def observe(self, new_tokens, hidden) -> None:
        counts: dict[str, list[int]] = {}
        for b, toks in enumerate(new_tokens):
            drafted = self._drafted_by[b]
            if drafted is not None and toks:
                source, num_drafted = drafted
                cell = counts.setdefault(source, [0, 0, 0])
                cell[0], cell[1], cell[2] = cell[0] + 1, cell[1] + num_drafted, cell[2] + len(toks) - 1
                if source == "eagle":
                    self.chooser.record_head(len(toks) - 1)
            pending = self._pending[b]
            if pending is None or not toks:
                continue
            draft, match, agreed = pending
            agree = 0
            while agree < min(len(draft), len(toks)) and draft[agree] == toks[agree]:
                agree += 1
            if agree == len(toks) < len(draft):  # every token so far agreed: judged on the next ones
                self._pending[b] = (draft[agree:], match, agreed + agree)
                continue
            self.chooser.record_history(match, agreed + agree)
            self._pending[b] = None
        self._step_sources = {source: tuple(counts[source]) for source in SOURCES if source in counts}
        self._drafted_by = [None] * len(new_tokens)
        self.eagle.observe(new_tokens, hidden)
        self.history.observe(new_tokens, hidden)

    def keep_rows(self, rows: torch.Tensor) -> None:
        self.eagle.keep_rows(rows)
        self.history.keep_rows(rows)
        keep = rows.tolist()
        self._pending = [self._pending[j] for j in keep]
        self._drafted_by = [self._drafted_by[j] for j in keep]

    def shape_counts(self):
        return self.eagle.shape_counts()

    def propose(self, contexts, caps, sampling, uniforms, width=None) -> Proposal:
        K = max(caps, default=0) if width is None else width
        drafts = self.history.drafts(contexts, caps)
        lens, rule = self.history.match_lens, self.chooser
        chosen = [b for b, d in enumerate(drafts)
                  if d and (rule.use_history(lens[b]) if self.adaptive else lens[b] >= rule.min_match)]
        for b, d in enumerate(drafts):  # judged against what the policy emits next
            if d and self._pending[b] is None:
                self._pending[b] = (list(d), lens[b], 0)
        picked = set(chosen)
        # the head drafts every row with room (chains of its cap); the chosen rows take history's draft instead
        self._drafted_by = [("history", len(drafts[b])) if b in picked else ("eagle", c) if c > 0 else None
                            for b, c in enumerate(caps)]
        prop = widen(self.eagle.propose(contexts, caps, sampling, uniforms, width=K), K)
        self.num_history_rows += len(chosen)
        self.num_eagle_rows += sum(1 for d in self._drafted_by if d is not None and d[0] == "eagle")
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
