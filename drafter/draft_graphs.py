"""An EagleDrafter's chain drafting on the static path: one step feeds the true pairs the policy just
verified and drafts k tokens, on a head KV cache of a bucketed batch, with no read-back; on CUDA each
(batch bucket, k, slots, sampling mode) step is captured once in a CUDA graph and replayed.

The drafts are those of EagleDrafter's eager loop (drafter.eagle): the same head, the same pairs in the
same positions, the same draft distribution and uniforms; attention reads a bucket of slots under a mask
instead of exactly the slots written, so values agree up to float rounding. A step whose pending pairs
outnumber k + 1 (a batch's first, after its prompt, or the first after a swap, which re-feeds the
history) runs the same function uncaptured.
"""

from __future__ import annotations

import torch

from drafter.drafters import Proposal
from drafter.model import KVCache, attention_mask
from drafter.sampling import BatchSampling, draft_probs, sample
from drafter.static import batch_bucket, slot_bucket


class DraftGraphs:
    """Static-path drafting for one EagleDrafter (`drafter`), which owns the head and the rows' state."""

    def __init__(self, drafter, cuda_graphs: bool) -> None:
        self.drafter = drafter
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = None
        self.bufs: dict[str, torch.Tensor] = {}
        self._cache_id = None

    def usable(self, sampling: BatchSampling) -> bool:
        """Top-k/top-p truncation reads the device back (drafter.sampling._truncate): eager only."""
        return not sampling.truncates(self.drafter.head.lm_head.weight.shape[0])

    def _cache(self, Bp: int, needed: int) -> KVCache:
        """The rows' head cache with exactly Bp rows and room for `needed` slots; a new one (the old content
        copied, captured graphs dropped) when the bucket or the room changed."""
        d, rows = self.drafter, self.drafter.rows
        cache = rows.cache
        if cache is None or cache.k.shape[1] != Bp or cache.max_len < needed:
            size = max(needed, cache.max_len if cache is not None else 0)
            new = d.head.new_cache(Bp, slot_bucket(size, 1 << 30), d.dtype, d.policy.device)
            if cache is not None:  # live rows and the slots they use (lens is set by the caller)
                n, s = min(Bp, cache.k.shape[1]), cache.max_len
                new.k[:, :n, :s] = cache.k[:, :n]
                new.v[:, :n, :s] = cache.v[:, :n]
            rows.cache = cache = new
        if id(cache.k) != self._cache_id:
            self.graphs.clear()
            self._cache_id = id(cache.k)
        return cache

    def _buffers(self, Bp: int, P: int, K: int, V: int, F: int) -> dict[str, torch.Tensor]:
        """Graph inputs and outputs, grown (and graphs dropped) when a step needs more."""
        b = self.bufs
        shape = (Bp, P, K)
        if not b or any(x > y for x, y in zip(shape, b["shape"])):
            d = self.drafter
            dev, B2, P2, K2 = d.policy.device, *(max(x, y) for x, y in zip(shape, b.get("shape", shape)))
            self.graphs.clear()
            b = self.bufs = {
                "shape": (B2, P2, K2),
                "feats": torch.zeros(B2, P2, F, dtype=d.dtype, device=dev),
                "toks": torch.zeros(B2, P2, dtype=torch.long, device=dev),
                "num_pending": torch.zeros(B2, dtype=torch.long, device=dev),
                "lens": torch.zeros(B2, dtype=torch.long, device=dev),
                "uniforms": torch.zeros(B2, K2, device=dev),
                "temperature": torch.zeros(B2, device=dev),
                "tokens": torch.zeros(B2, K2, dtype=torch.long, device=dev),
                "probs": torch.zeros(B2, K2, V, device=dev),
                "steps": torch.arange(max(P2, K2), device=dev),
                "rows": torch.arange(B2, device=dev),
            }
        return b

    def _step(self, Bp: int, P: int, K: int, S: int, greedy: bool, any_greedy: bool) -> None:
        """Feed P pending pairs per row, then draft K tokens: everything on the device (capturable)."""
        d, b = self.drafter, self.bufs
        head, cache = d.head, d.rows.cache
        lens, num_pending = b["lens"][:Bp], b["num_pending"][:Bp]
        positions = lens.view(Bp, 1) + b["steps"][:P].view(1, P)  # (Bp, P)
        hidden = head.fuse(b["feats"][:Bp, :P])  # (Bp, P, 4D) -> (Bp, P, D)
        embeds = d.policy.embed_tokens(b["toks"][:Bp, :P]).to(d.dtype)
        out = head(hidden, embeds, positions, cache, (positions, attention_mask(positions, S)))  # (Bp, P, D)
        pred = out[b["rows"][:Bp], (num_pending - 1).clamp(min=0)].unsqueeze(1)  # (Bp, 1, D)
        pos = (lens + num_pending).view(Bp, 1)  # the first speculative slot
        tokens, probs = b["tokens"][:Bp, :K], b["probs"][:Bp, :K]
        # rows' temperatures from the buffer; host: whether any row may be greedy (one-hots), no truncation
        host = ((0.0 if any_greedy else 1.0, 0, 1.0),) * Bp
        sampling = None if greedy else BatchSampling(b["temperature"][:Bp], torch.zeros_like(lens),
                                                     torch.ones_like(b["temperature"][:Bp]), host)
        if not greedy:
            probs.zero_()
        vocab_ids = head.vocab_ids
        for j in range(K):
            logits = head.logits(pred)  # (Bp, 1, V')
            if greedy:
                x = vocab_ids[logits[:, 0].argmax(-1)]
            else:
                q = draft_probs(logits, sampling, head.cfg.draft_temperature)[:, 0]  # (Bp, V'): the draft's q
                x = vocab_ids[sample(q, b["uniforms"][:Bp, j])]
                probs[:, j].index_copy_(1, vocab_ids, q)  # scattered onto the policy vocabulary
            tokens[:, j] = x
            if j + 1 < K:
                p = pos + j
                pred = head(pred, d.policy.embed_tokens(x.unsqueeze(1)).to(d.dtype), p, cache,
                            (p, attention_mask(p, S)))

    def propose(self, caps: list[int], sampling: BatchSampling, uniforms: torch.Tensor | None) -> Proposal:
        d, rows = self.drafter, self.drafter.rows
        B, K = len(caps), max(caps)
        device, V = d.policy.device, d.policy.cfg.vocab_size
        num_pending = [len(t) for t in rows.pending_tokens]
        P = max(num_pending)
        if P == 0 or K == 0:
            return Proposal(torch.zeros(B, K, dtype=torch.long, device=device),
                            torch.zeros(B, dtype=torch.long, device=device),
                            None if sampling.all_greedy else torch.zeros(B, K, V, device=device))
        # a row's head cache holds every true pair not pending: known here, never read back
        lens = [len(h) - n for h, n in zip(rows.history_tokens, num_pending)]
        Bp = batch_bucket(B)
        captured = self.cuda_graphs and P <= K + 1
        P = K + 1 if captured else P  # captured steps feed a fixed k + 1 pairs per row, padded
        cache = self._cache(Bp, max(lens) + P + K + 1)
        S = slot_bucket(max(lens) + P + K, cache.max_len)
        b = self._buffers(Bp, P, K, V, d.head.feature_size)
        feats, toks = b["feats"][:Bp, :P], b["toks"][:Bp, :P]
        feats.zero_()
        padded = [t + [0] * (P - len(t)) for t in rows.pending_tokens] + [[0] * P] * (Bp - B)
        toks.copy_(torch.tensor(padded, dtype=torch.long), non_blocking=True)
        for r, h in enumerate(rows.pending_hidden):
            if len(h):
                feats[r, : len(h)] = h
        b["num_pending"][:Bp].copy_(torch.tensor(num_pending + [0] * (Bp - B)), non_blocking=True)
        b["lens"][:Bp].copy_(torch.tensor(lens + [0] * (Bp - B)), non_blocking=True)
        greedy = sampling.all_greedy
        if not greedy:
            b["temperature"][:Bp].zero_()
            b["temperature"][:B].copy_(sampling.temperature)
            b["uniforms"][:B, :K].copy_(uniforms[:, :K])
        if captured:
            key = (Bp, P, K, S, greedy, sampling.any_greedy)
            if key not in self.graphs:
                self._capture(key)
            self.graphs[key][0].replay()
        else:
            self._step(Bp, P, K, S, greedy, sampling.any_greedy)
        cache.lens = torch.tensor([n + p for n, p in zip(lens, num_pending)], dtype=torch.long).to(device)
        rows.clear_pending(d._empty())
        draft_lens = [min(c, K) if n > 0 else 0 for c, n in zip(caps, num_pending)]
        return Proposal(b["tokens"][:B, :K].clone(), torch.tensor(draft_lens, dtype=torch.long).to(device),
                        None if greedy else b["probs"][:B, :K].clone())

    def _capture(self, key: tuple) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the capture (idempotent: same inputs, same writes)
            self._step(*key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(*key)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, ())
