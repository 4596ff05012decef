"""The state an EagleDrafter (drafter.draft.eagle) keeps while it serves, in small parts: the head waiting to be
swapped in, what swaps have cost, and the live rows' draft state."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from drafter.draft.head import EagleHead
from drafter.model.causal_lm import KVCache

MAX_SWAP_LOG = 64  # swaps remembered with their times: a job swaps once per draft version, readers want the recent


class PendingSwap:
    """The head to serve from the next draft step on: set from any thread, taken by the decode loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next: tuple[EagleHead, int | None, bool] | None = None

    def put(self, head: EagleHead, version: int | None, replace: bool = True, owned: bool = False) -> None:
        """Queue `head` (owned: the drafter may keep it as its own, no one else holding it); a head already queued
        is replaced, unless not `replace` (then it keeps its place)."""
        with self._lock:
            if replace or self._next is None:
                self._next = (head, version, owned)

    def take(self) -> tuple[EagleHead, int | None, bool] | None:
        with self._lock:
            nxt, self._next = self._next, None
        return nxt


@dataclass
class SwapStats:
    """How many heads were swapped in, what it cost the decode loop, and when each began serving."""

    num_swaps: int = 0
    seconds: float = 0.0  # decode-loop time spent switching heads (re-feeding the history)
    # (version, wall time it began serving) of the latest MAX_SWAP_LOG swaps
    log: deque[tuple[int | None, float]] = field(default_factory=lambda: deque(maxlen=MAX_SWAP_LOG))

    def record(self, version: int | None, seconds: float) -> None:
        self.num_swaps += 1
        self.seconds += seconds
        self.log.append((version, time.time()))

    @property
    def last(self) -> tuple[int | None, float] | None:
        """(version, wall time) of the latest swap, None before the first."""
        return self.log[-1] if self.log else None


Chunk = tuple[torch.Tensor, int, int]  # (features (B, T, F), row r, count n): the pairs features[r, :n]


@dataclass
class DraftRows:
    """Per-row draft state of the live batch: the head's KV cache over the true pairs fed so far, the
    true (policy features, token that followed) pairs not fed yet, and every true pair so far (the
    history a newly swapped-in head is re-fed). Features: drafter.model.causal_lm.draft_features, (n, F) per row.

    Features are kept as chunks of the tensors the engine handed over, not copied per row: observing a step
    costs no tensor op (it runs every decode step, drafting or not), and when every row's pending pairs are
    one step's, `fresh` holds that step's tensor whole, so a feed copies it in one op."""

    cache: KVCache | None = None
    pending_chunks: list[list[Chunk]] = field(default_factory=list)  # per row: features not yet fed
    pending_tokens: list[list[int]] = field(default_factory=list)  # per row: the n tokens that followed them
    history_chunks: list[list[Chunk]] = field(default_factory=list)  # per row: every true pair so far
    history_tokens: list[list[int]] = field(default_factory=list)
    # (features (B, T, F), counts): the one tensor all rows' pending pairs are in, row b's the first counts[b]
    fresh: tuple[torch.Tensor, list[int]] | None = None
    # the static path (drafter.draft.draft_graphs): the cache has a bucket of rows, compacted in place (graphs hold it)
    static: bool = False

    def begin(self, prompts: list[list[int]], prefill_hidden: torch.Tensor | None, empty: torch.Tensor) -> None:
        """A new batch: each prompt's pairs (features at i, t_{i+1}) are pending; prefill_hidden (B, P, F)."""
        self.cache = None
        counts = [len(p) - 1 for p in prompts]
        self.pending_chunks = [[(prefill_hidden, b, n)] if prefill_hidden is not None and n > 0 else []
                               for b, n in enumerate(counts)]
        self.pending_tokens = [list(p[1:]) for p in prompts]
        self.history_chunks = [list(c) for c in self.pending_chunks]
        self.history_tokens = [list(t) for t in self.pending_tokens]
        self.fresh = (prefill_hidden, counts) if prefill_hidden is not None else None

    def replay(self, empty: torch.Tensor) -> None:
        """A new head: its cache starts empty and every true pair so far is pending again."""
        self.cache = None  # the old head's keys mean nothing to the new one
        self.pending_chunks = [list(c) for c in self.history_chunks]
        self.pending_tokens = [list(t) for t in self.history_tokens]
        self.fresh = None

    def clear_pending(self, empty: torch.Tensor) -> None:
        self.pending_chunks = [[] for _ in self.pending_tokens]
        self.pending_tokens = [[] for _ in self.pending_tokens]
        self.fresh = None

    def observe(self, new_tokens: list[list[int]], hidden: torch.Tensor) -> None:
        was_empty = not any(self.pending_tokens)
        for b, toks in enumerate(new_tokens):
            chunk = (hidden, b, len(toks))
            self.pending_chunks[b].append(chunk)  # pairs not fed yet stay queued
            self.pending_tokens[b] += toks
            self.history_chunks[b].append(chunk)
            self.history_tokens[b] += toks
        self.fresh = (hidden, [len(t) for t in new_tokens]) if was_empty else None

    def pending_hidden(self, b: int, empty: torch.Tensor) -> torch.Tensor:
        """Row b's pending features (n, F)."""
        return _join(self.pending_chunks[b], empty)

    def ensure_cache(self, head: EagleHead, batch_size: int, needed: int, dtype: torch.dtype, device) -> KVCache:
        """The head's cache with room for `needed` slots per row: a new one, or the old one grown."""
        cache = self.cache
        if cache is None:
            cache = head.new_cache(batch_size, max(needed, 64), dtype, device)
        elif needed > cache.max_len:  # grow geometrically; old slots keep their values
            grown = head.new_cache(batch_size, max(needed, 2 * cache.max_len), dtype, device)
            grown.k[:, :, : cache.max_len] = cache.k
            grown.v[:, :, : cache.max_len] = cache.v
            grown.lens = cache.lens
            cache = grown
        self.cache = cache
        return cache

    def keep(self, rows: torch.Tensor) -> None:
        idx = rows.tolist()
        self.pending_chunks = [self.pending_chunks[i] for i in idx]
        self.pending_tokens = [self.pending_tokens[i] for i in idx]
        self.history_chunks = [self.history_chunks[i] for i in idx]
        self.history_tokens = [self.history_tokens[i] for i in idx]
        self.fresh = None
        if self.cache is not None:
            self.cache.keep_rows(rows.to(self.cache.lens.device), in_place=self.static)



def _join(chunks: list[Chunk], empty: torch.Tensor) -> torch.Tensor:
    parts = [t[r, :n] for t, r, n in chunks if n > 0]
    return torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else empty)
