"""An EagleDrafter's chain drafting on the static path: one step feeds the true pairs the policy just
verified and drafts k tokens, on a head KV cache of a bucketed batch, with no read-back; on CUDA each
(batch bucket, pairs, k, slots, sampling mode) step is captured once in a CUDA graph and replayed.

The head runs the static path's lean attention (drafter.decode.static.attend: one rotary for q/k/v, one cache
write, SDPA's fused kernel under an additive mask) over the same weights, positions and pairs as
EagleDrafter's eager loop (drafter.draft.eagle), with the same draft distribution and uniforms: drafts agree up
to float rounding. A step whose pending pairs outnumber k + 1 (a batch's first, after its prompt, or the
first after a swap, which re-feeds the history) runs the same function uncaptured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter.decode.sampling import BatchSampling, draft_probs, sample
from drafter.decode.static import (
    StaticCache,
    additive_mask,
    attend,
    batch_bucket,
    rope_tables,
    rotate_half_matrix,
    rotated_heads,
    slot_bucket,
    slot_buckets,
)
from drafter.draft.drafters import Proposal

NUM_INTS = 3  # per-row integers after the pending tokens in the input buffer: num_pending, lens, caps


class DraftGraphs:
    """Static-path drafting for one EagleDrafter (`drafter`), which owns the head and the rows' state."""

    def __init__(self, drafter, cuda_graphs: bool) -> None:
        self.drafter = drafter
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.bufs: dict[str, torch.Tensor] = {}
        self._caches: dict[int, StaticCache] = {}  # per batch bucket
        self._capacity = 0  # slots per row of every cache
        self._head = None  # the head the graphs were captured on (they read its weights by address)

    def _cache(self, Bp: int, needed: int) -> StaticCache:
        """The head cache of bucket Bp, with room for `needed` slots. One cache per bucket lives as long as the
        drafter (graphs hold their addresses): a new batch or a swap starts on it afresh (the rows' lengths
        say what is valid), and a batch whose bucket changes moves its live rows to that bucket's cache. Room
        grows geometrically; then every cache and graph is made anew."""
        d, rows = self.drafter, self.drafter.rows
        if needed > self._capacity:
            self._capacity = slot_bucket(2 * needed, 1 << 30)
            self._caches.clear()
            self.graphs.clear()
        cache = self._caches.get(Bp)
        if cache is None:
            cache = self._caches[Bp] = StaticCache(d.head.policy_cfg, 1, Bp, self._capacity, d.dtype, d.policy.device)
            cache.num_used = self._capacity
        old = rows.cache
        if old is not None and old is not cache:  # the live rows (the batch's first len(lens)) move over
            n = len(old.lens)
            if old.kv.shape[-2] == cache.kv.shape[-2]:
                cache.kv[:, :n] = old.kv[:, :n]
            else:  # room grew: the old slots into the new room
                cache.kv[:, :n, :, :, : old.kv.shape[-2]] = old.kv[:, :n]
            cache.lens = old.lens
        rows.cache = cache
        return cache

    def _buffers(self, Bp: int, P: int, K: int) -> dict[str, torch.Tensor]:
        """Graph inputs and outputs, grown (and graphs dropped) when a step needs more."""
        b = self.bufs
        shape = (Bp, P, K)
        if not b or any(x > y for x, y in zip(shape, b["shape"])):
            d = self.drafter
            dev, V = d.policy.device, d.policy.cfg.vocab_size
            B2, P2, K2 = (max(x, y) for x, y in zip(shape, b.get("shape", shape)))
            self.graphs.clear()
            b = self.bufs = {
                "shape": (B2, P2, K2),
                "feats": torch.zeros(B2, P2, d.head.feature_size, dtype=d.dtype, device=dev),
                "ints": torch.zeros(B2, P2 + NUM_INTS, dtype=torch.long, device=dev),  # tokens | NUM_INTS
                "uniforms": torch.zeros(B2, K2, device=dev),
                "temperature": torch.zeros(B2, device=dev),
                "tokens": torch.zeros(B2, K2, dtype=torch.long, device=dev),
                "probs": torch.zeros(B2, K2, V, device=dev),
                "new_lens": torch.zeros(B2, dtype=torch.long, device=dev),
                "draft_lens": torch.zeros(B2, dtype=torch.long, device=dev),
                "steps": torch.arange(max(P2, K2) + 1, device=dev),
                "rows": torch.arange(B2, device=dev),
                "slots": torch.arange(2 * d.policy.cfg.max_position, device=dev),
            }
        return b

    def _layer(self, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
               ) -> torch.Tensor:
        """The head's decoder layer (drafter.draft.head.Eagle3Layer) on the static cache: (B, T, D) -> (B, T, D)."""
        head = self.drafter.head
        layer, cfg = head.midlayer, head.policy_cfg
        B, T, D = hidden.shape
        cache_l, keys, values = self._views
        rope = rope_tables(head.rotary, positions, self._rotated, hidden.dtype)
        flat = hidden.reshape(B * T, D)
        x_in = layer.attn_input(flat, embeds.reshape(B * T, D))  # (B*T, 2D)
        attn = layer.self_attn
        out = attend(attn.qkv_proj(x_in), rope, self._rotate, cache_l, keys, values,
                     self.bufs["rows"][:B].view(B, 1), positions, mask, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        x = torch.addmm(flat, out, attn.o_proj.weight.t())  # residual + o_proj
        gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x.addmm_(F.silu(gate) * up, layer.mlp.down_proj.weight.t()).view(B, T, D)

    def _step(self, Bp: int, P: int, K: int, S: int, greedy: bool, any_greedy: bool, truncates: bool) -> None:
        """Feed P pending pairs per row, then draft K tokens: everything on the device (capturable)."""
        d, b = self.drafter, self.bufs
        head = d.head
        h, layer = head.policy_cfg.num_kv_heads, self._caches[Bp].kv[0]  # (Bp, 2Hkv, G, S_max, D)
        self._views = (layer, layer[:, :h].flatten(1, 2)[:, :, :S], layer[:, h:].flatten(1, 2)[:, :, :S])
        ints = b["ints"][:Bp]
        toks, num_pending, lens, caps = ints[:, :P], ints[:, P], ints[:, P + 1], ints[:, P + 2]
        slots = b["slots"][:S]
        positions = lens.view(Bp, 1) + b["steps"][:P].view(1, P)  # (Bp, P)
        hidden = head.fuse(b["feats"][:Bp, :P])  # (Bp, P, 4D) -> (Bp, P, D)
        embeds = d.policy.embed_tokens(toks).to(d.dtype)
        out = self._layer(hidden, embeds, positions, additive_mask(slots, positions, d.dtype))  # (Bp, P, D)
        pred = out.gather(1, (num_pending - 1).clamp(min=0).view(Bp, 1, 1).expand(Bp, 1, out.shape[-1]))
        pos = lens + num_pending  # (Bp,): the first speculative slot
        b["new_lens"][:Bp].copy_(pos)
        b["draft_lens"][:Bp].copy_(torch.where(num_pending > 0, caps.clamp(max=K), 0))
        chain = pos.view(Bp, 1) + b["steps"][:K].view(1, K)  # (Bp, K): draft step j writes slot pos + j
        chain_mask = additive_mask(slots, chain, d.dtype)  # (Bp, 1, K, S)
        tokens, probs = b["tokens"][:Bp, :K], b["probs"][:Bp, :K]
        # rows' temperatures from the buffer; host: whether any row may be greedy (one-hots). Top-k/top-p
        # (uncaptured: their truncation reads the device back) use the batch's own settings, padded
        host = ((0.0 if any_greedy else 1.0, 0, 1.0),) * Bp
        sampling = None if greedy else self._truncating if truncates else BatchSampling(
            b["temperature"][:Bp], torch.zeros_like(lens), torch.ones_like(b["temperature"][:Bp]), host)
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
                embeds = d.policy.embed_tokens(x.view(Bp, 1)).to(d.dtype)
                pred = self._layer(pred, embeds, chain[:, j : j + 1], chain_mask[:, :, j : j + 1])

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
        truncates = sampling.truncates(d.head.lm_head.weight.shape[0])
        captured = self.cuda_graphs and P <= K + 1 and not truncates
        P = K + 1 if captured else P  # captured steps feed a fixed k + 1 pairs per row, padded
        cache = self._cache(Bp, max(lens) + P + K + 1)
        S = slot_bucket(max(lens) + P + K, cache.max_len)
        b = self._buffers(Bp, P, K)
        if self._head is not d.head:  # graphs read the head's weights by address
            self.graphs.clear()
            self._head = d.head
            self._rotate = rotate_half_matrix(d.head.policy_cfg.head_dim, d.dtype, device)
            self._rotated = rotated_heads(d.head.policy_cfg.num_heads, d.head.policy_cfg.num_kv_heads, device)
        self._fill(b, Bp, P, num_pending, lens, caps)
        greedy = sampling.all_greedy
        if not greedy:
            b["temperature"][:Bp].zero_()
            b["temperature"][:B].copy_(sampling.temperature)
            b["uniforms"][:B, :K].copy_(uniforms[:, :K])
        if truncates:
            self._truncating = _padded(sampling, Bp)
        key = (Bp, P, K, S, greedy, sampling.any_greedy, truncates)
        if captured:
            if key not in self.graphs:  # every slot bucket of this shape at once: the batch goes through them
                for s in slot_buckets(cache.max_len):
                    self._capture((Bp, P, K, s, *key[4:]))
            self.graphs[key].replay()
        else:
            self._step(*key)
        cache.lens = b["new_lens"][:B].clone()
        rows.clear_pending(d._empty())
        host_lens = [min(c, K) if n > 0 else 0 for c, n in zip(caps, num_pending)]
        return Proposal(b["tokens"][:B, :K].clone(), b["draft_lens"][:B].clone(),
                        None if greedy else b["probs"][:B, :K].clone(), host_lens=host_lens)

    def _fill(self, b: dict, Bp: int, P: int, num_pending: list[int], lens: list[int], caps: list[int]) -> None:
        """The step's inputs into the graph's buffers: pending features (one copy when they are one step's
        output), and tokens and counts in one host-to-device copy."""
        rows, B = self.drafter.rows, len(num_pending)
        feats = b["feats"][:Bp, :P]
        fresh = rows.fresh
        if fresh is not None and fresh[0].shape[0] == B:
            n = min(fresh[0].shape[1], P)
            feats[:B, :n] = fresh[0][:, :n]  # past a row's count: pairs the mask and the gather never use
        else:
            empty = self.drafter._empty()
            for r in range(B):
                t = rows.pending_hidden(r, empty)
                if len(t):
                    feats[r, : len(t)] = t
        pad = [0] * P
        host = [(t + pad)[:P] + [n, s, c] for t, n, s, c in zip(rows.pending_tokens, num_pending, lens, caps)]
        host += [pad + [0] * NUM_INTS] * (Bp - B)  # padded rows: nothing pending, nothing drafted
        b["ints"][:Bp, : P + NUM_INTS].copy_(torch.tensor(host, dtype=torch.long, device="cpu"), non_blocking=True)

    def _capture(self, key: tuple) -> None:
        """Capture one shape. Its warm-up runs on the step's real inputs (what it writes, the replay that
        follows writes again)."""
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
        self.graphs[key] = graph


def _padded(sampling: BatchSampling, Bp: int) -> BatchSampling:
    """`sampling` with greedy rows appended up to Bp (the bucket's padded rows)."""
    n = Bp - len(sampling.host)
    return BatchSampling(F.pad(sampling.temperature, (0, n)), F.pad(sampling.top_k, (0, n)),
                         F.pad(sampling.top_p, (0, n), value=1.0), sampling.host + ((0.0, 0, 1.0),) * n)
