"""An EagleDrafter's chain drafting on the static path: one step feeds the true pairs the policy just
verified and drafts k tokens, on one head KV cache with no read-back; on CUDA each (batch bucket, pairs, k,
slots, sampling mode) step is captured once in a CUDA graph and replayed.

Shapes stay put for the drafter's life: `begin` sizes the head cache for the batch (rows of its bucket, slots
for the policy's longest sequence plus a margin) and it is only ever made larger; every bucket's graphs read
rows 0..bucket-1 of that one cache, so a batch that drops to a smaller bucket moves nothing but its live rows
(DraftRows.keep, in place). Graph buffers are kept per k. A step always drafts k tokens (rows past their cap
draft fewer: their draft length says so) after feeding k + 1 pairs per row, padded. A backlog of pairs (the
prompts, steps the tuner served plain, a swapped-in head re-fed its history) is fed first in captured chunks
of CHUNK pairs per row on CUDA, and in one uncaptured pass where no graph is kept (a CPU, top-k/top-p rows).

The head runs the static path's lean attention (drafter.decode.static.attend: one rotary for q/k/v, one cache
write, SDPA's fused kernel under an additive mask) over the same weights, positions and pairs as
EagleDrafter's eager loop (drafter.draft.eagle), with the same draft distribution and uniforms: drafts agree up
to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from drafter.decode.capture import capture
from drafter.decode.sampling import BatchSampling, draft_probs, sample, token_probs
from drafter.decode.static import (
    ShapeCounts,
    StaticCache,
    additive_mask,
    attend,
    batch_bucket,
    rope_tables,
    rotate_half_matrix,
    rotated_heads,
    slot_bucket,
    slot_buckets,
    to_device,
)
from drafter.draft.drafters import Proposal

NUM_INTS = 3  # per-row integers after the pending tokens in the input buffer: num_pending, lens, caps
CHUNK = 32  # pairs per row a captured catch-up step feeds: a backlog of n pairs takes ceil(n / CHUNK) replays


class DraftGraphs:
    """Static-path drafting for one EagleDrafter (`drafter`), which owns the head and the rows' state."""

    def __init__(self, drafter, cuda_graphs: bool) -> None:
        self.drafter = drafter
        self.cuda_graphs = cuda_graphs
        # feed a backlog in chunks of CHUNK pairs (fixed shapes: what graphs need); where no graph is kept, one
        # pass over it all is cheaper. A switch, so a CPU test can run the chunked path uncaptured
        self.chunked = cuda_graphs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.shapes = ShapeCounts()
        self.cache: StaticCache | None = None  # the head's, every bucket's rows in it
        self.bufs: dict[int, dict[str, torch.Tensor]] = {}  # per k (0: catch-up): graph inputs and outputs
        self._head = None  # the head the graphs were captured on (they read its weights by address)
        # the serving head's draft_temperature, on the device (never 0: a head of 0 drafts one-hot, its own graphs)
        self.draft_temperature = torch.ones((), device=drafter.policy.device)
        self._draft_temperature = 1.0  # its value, host-side

    # --- sizes ---------------------------------------------------------------------------------------
    def begin(self, num_rows: int, max_len: int) -> None:
        """A new batch of num_rows rows whose sequences stay within max_len slots: the cache made large enough
        (a batch or a length larger than any before rebuilds it, and drops the graphs; else nothing changes)."""
        self._ensure(batch_bucket(num_rows), max_len + 2 * CHUNK)

    def _ensure(self, num_rows: int, num_slots: int) -> StaticCache:
        d = self.drafter
        cache = self.cache
        if cache is None or cache.max_batch < num_rows or cache.max_len < num_slots:
            rows = max(num_rows, cache.max_batch if cache is not None else 0)
            slots = slot_bucket(max(num_slots, cache.max_len if cache is not None else 0), 1 << 30)
            self.cache = self.bufs = None  # free the old ones first
            self.cache = cache = StaticCache(d.head.policy_cfg, 1, rows, slots, d.dtype, d.policy.device)
            cache.num_used = slots
            self.bufs = {}
            self._drop_graphs()
            self.shapes.num_rebuilds += 1
        return cache

    def _drop_graphs(self) -> None:
        if self.graphs:
            self.graphs.clear()
            self.shapes.num_rebuilds += 1

    def _buffers(self, K: int, P: int | None = None) -> dict[str, torch.Tensor]:
        """The graph buffers of draft length K (P = K + 1 pairs; K = 0: catch-up, CHUNK pairs), made on first
        use; with P given (an uncaptured step of a longer backlog), scratch buffers for this step alone."""
        b = self.bufs.get(K) if P is None else None
        if b is not None:
            return b
        d = self.drafter
        dev, V, B = d.policy.device, d.policy.cfg.vocab_size, self.cache.max_batch
        P = P if P is not None else (K + 1 if K else CHUNK)
        b = {
            "P": P,
            "feats": torch.zeros(B, P, d.head.feature_size, dtype=d.dtype, device=dev),
            "ints": torch.zeros(B, P + NUM_INTS, dtype=torch.long, device=dev),  # tokens | NUM_INTS
            "uniforms": torch.zeros(B, K, device=dev),
            "temperature": torch.zeros(B, device=dev),
            "tokens": torch.zeros(B, K, dtype=torch.long, device=dev),
            "probs": torch.zeros(B, K, V, device=dev),
            "new_lens": torch.zeros(B, dtype=torch.long, device=dev),
            "draft_lens": torch.zeros(B, dtype=torch.long, device=dev),
            "steps": torch.arange(max(P, K) + 1, device=dev),
            "rows": torch.arange(B, device=dev),
            "slots": torch.arange(self.cache.max_len, device=dev),
        }
        if (K + 1 if K else CHUNK) == P:
            self.bufs[K] = b
        return b

    # --- the step ------------------------------------------------------------------------------------
    def _layer(self, b, hidden: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
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
                     b["rows"][:B].view(B, 1), positions, mask, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim))
        o_proj, down_proj = attn.o_proj, layer.mlp.down_proj
        # residual + o_proj (on a CPU head with int8 products, EagleDrafter.int8_products, the layer's own product)
        x = flat + o_proj(out) if o_proj.int8 else torch.addmm(flat, out, o_proj.weight.t())
        gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(x)).chunk(2, dim=-1)
        act = F.silu(gate) * up
        return (x + down_proj(act) if down_proj.int8 else x.addmm_(act, down_proj.weight.t())).view(B, T, D)

    def _step(self, b: dict, Bp: int, K: int, S: int, greedy: bool, any_greedy: bool, truncates: bool,
              one_hot: bool) -> None:
        """Feed b's P pending pairs per row, then draft K tokens: everything on the device (capturable). one_hot:
        the head's draft_temperature is 0 (its argmax drafts); else its logits are divided by the device scalar
        self.draft_temperature, which a new head's value is written into: a captured step serves it too."""
        d, P = self.drafter, b["P"]
        head = d.head
        h, layer = head.policy_cfg.num_kv_heads, self.cache.kv[0]  # (B_max, 2Hkv, 1, S_max, D)
        self._views = (layer, layer[:Bp, :h].flatten(1, 2)[:, :, :S], layer[:Bp, h:].flatten(1, 2)[:, :, :S])
        ints = b["ints"][:Bp]
        toks, num_pending, lens, caps = ints[:, :P], ints[:, P], ints[:, P + 1], ints[:, P + 2]
        slots = b["slots"][:S]
        positions = lens.view(Bp, 1) + b["steps"][:P].view(1, P)  # (Bp, P)
        hidden = head.fuse(b["feats"][:Bp])  # (Bp, P, 4D) -> (Bp, P, D)
        embeds = d.policy.embed_tokens(toks).to(d.dtype)
        out = self._layer(b, hidden, embeds, positions, additive_mask(slots, positions, d.dtype))  # (Bp, P, D)
        pos = lens + num_pending  # (Bp,): the first speculative slot
        b["new_lens"][:Bp].copy_(pos)
        if K == 0:
            return
        pred = out.gather(1, (num_pending - 1).clamp(min=0).view(Bp, 1, 1).expand(Bp, 1, out.shape[-1]))
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
                # (Bp, V'): the draft's q (drafter.decode.sampling.draft_probs, its temperature read on the device)
                q = (draft_probs(logits, sampling, 0.0) if one_hot
                     else token_probs(logits / self.draft_temperature, sampling))[:, 0]
                x = vocab_ids[sample(q, b["uniforms"][:Bp, j])]
                probs[:, j].index_copy_(1, vocab_ids, q)  # scattered onto the policy vocabulary
            if b["coupled"] is not None:  # uncaptured: coupled rows draft with their policy sample's noise
                coupling, index = b["coupled"]
                tau = head.cfg.draft_temperature
                chosen = vocab_ids[coupling.draft(logits[: len(index), 0], index + j, vocab_ids, tau)]
                x = torch.cat([torch.where(coupling.mask, chosen, x[: len(index)]), x[len(index) :]])
            tokens[:, j] = x
            if j + 1 < K:
                embeds = d.policy.embed_tokens(x.view(Bp, 1)).to(d.dtype)
                pred = self._layer(b, pred, embeds, chain[:, j : j + 1], chain_mask[:, :, j : j + 1])

    def _run(self, b: dict, key: tuple, captured: bool) -> None:
        """Replay the graph of `key` (captured on first use, with every slot bucket of its shape: the batch goes
        through them all), or run the step uncaptured."""
        if not captured:
            self._step(b, *key)
            return
        if key not in self.graphs:
            Bp, K, _, *mode = key
            for s in slot_buckets(self.cache.max_len):
                self._capture(b, (Bp, K, s, *mode))
        self.graphs[key].replay()

    # --- propose -------------------------------------------------------------------------------------
    def propose(self, caps: list[int], sampling: BatchSampling, uniforms: torch.Tensor | None, K: int,
                index: torch.Tensor | None = None) -> Proposal:
        """index (B,): each row's context length, the token index of its first draft (for coupled rows; their
        steps run uncaptured)."""
        d, rows = self.drafter, self.drafter.rows
        B = len(caps)
        device, V = d.policy.device, d.policy.cfg.vocab_size
        num_pending = [len(t) for t in rows.pending_tokens]
        if max(num_pending) == 0 or K == 0:
            return Proposal(torch.zeros(B, K, dtype=torch.long, device=device),
                            torch.zeros(B, dtype=torch.long, device=device),
                            None if sampling.all_greedy else torch.zeros(B, K, V, device=device), host_lens=[0] * B)
        # a row's head cache holds every true pair not pending: known here, never read back
        lens = [len(h) - n for h, n in zip(rows.history_tokens, num_pending)]
        Bp = batch_bucket(B)
        cache = self._ensure(Bp, max(lens) + max(num_pending) + CHUNK + 2 * K + 2)
        rows.cache = cache
        if self._head is not d.head:  # graphs read the head's weights by address
            self._drop_graphs()
            self._head = d.head
            self._rotate = rotate_half_matrix(d.head.policy_cfg.head_dim, d.dtype, device)
            self._rotated = rotated_heads(d.head.policy_cfg.num_heads, d.head.policy_cfg.num_kv_heads, device)
        truncates = sampling.truncates(d.head.lm_head.weight.shape[0])
        chunked = self.chunked and not truncates and K + 1 <= CHUNK
        captured = chunked and self.cuda_graphs
        done = [0] * B  # pairs of each row fed so far this step
        joined = None  # each row's pending features, joined once for all its chunks
        if chunked:  # the backlog beyond the last k + 1 pairs, in (captured) chunks
            backlog = [max(n - (K + 1), 0) for n in num_pending]
            if any(backlog):
                joined = [rows.pending_hidden(r, d._empty()) for r in range(B)]
            while any(x > y for x, y in zip(backlog, done)):
                counts = [min(CHUNK, x - y) for x, y in zip(backlog, done)]
                b = self._buffers(0)
                self._fill(b, Bp, done, counts, lens, [0] * B, joined)
                self._run(b, (Bp, 0, self._slots(lens, done, CHUNK, 0), True, True, False, False), captured)
                done = [x + y for x, y in zip(done, counts)]
        counts = [n - x for n, x in zip(num_pending, done)]
        P = max(counts)
        b = self._buffers(K) if P <= K + 1 else self._buffers(K, P)
        self._fill(b, Bp, done, counts, lens, caps, joined)
        greedy = sampling.all_greedy
        if not greedy:
            b["temperature"][:Bp].zero_()
            b["temperature"][:B].copy_(sampling.temperature)
            b["uniforms"][:B, :K].copy_(uniforms[:, :K])
        if truncates:
            self._truncating = _padded(sampling, Bp)
        one_hot = not greedy and self._set_draft_temperature(d.head.cfg.draft_temperature)
        b["coupled"] = None if sampling.coupling is None else (sampling.coupling, index)
        key = (Bp, K, self._slots(lens, done, b["P"], K), greedy, sampling.any_greedy, truncates, one_hot)
        self._run(b, key, captured and b["P"] == K + 1 and b["coupled"] is None)
        cache.lens = b["new_lens"][:B].clone()
        rows.clear_pending(d._empty())
        host_lens = [min(c, K) if n > 0 else 0 for c, n in zip(caps, num_pending)]
        return Proposal(b["tokens"][:B, :K].clone(), b["draft_lens"][:B].clone(),
                        None if greedy else b["probs"][:B, :K].clone(), host_lens=host_lens)

    def _set_draft_temperature(self, t: float) -> bool:
        """The head's draft temperature written where the graphs read it (when it changed); True if it is 0."""
        if t and t != self._draft_temperature:
            self.draft_temperature.fill_(t)
            self._draft_temperature = t
        return not t

    def _slots(self, lens: list[int], done: list[int], P: int, K: int) -> int:
        """The slot bucket a step reads: past every position it writes (pairs padded to P, then K drafts)."""
        return slot_bucket(max(n + x for n, x in zip(lens, done)) + P + K, self.cache.max_len)

    def _fill(self, b: dict, Bp: int, start: list[int], counts: list[int], lens: list[int], caps: list[int],
              joined: list[torch.Tensor] | None = None) -> None:
        """Rows' pending pairs [start, start + count) into b (one copy when they are one step's output whole),
        with tokens and counts in one host-to-device copy; padded rows feed and draft nothing. joined: each
        row's pending features, already joined."""
        rows, B, P = self.drafter.rows, len(counts), b["P"]
        feats = b["feats"][:Bp]
        fresh = rows.fresh
        if fresh is not None and fresh[0].shape[0] == B and not any(start) and counts == fresh[1]:
            n = min(fresh[0].shape[1], P)
            feats[:B, :n] = fresh[0][:, :n]  # past a row's count: pairs the mask and the gather never use
        else:
            empty = self.drafter._empty()
            for r in range(B):
                if counts[r]:
                    pending = joined[r] if joined is not None else rows.pending_hidden(r, empty)
                    feats[r, : counts[r]] = pending[start[r] : start[r] + counts[r]]
        pad = [0] * P
        host = [(t[s : s + c] + pad)[:P] + [c, n + s, cap]
                for t, s, c, n, cap in zip(rows.pending_tokens, start, counts, lens, caps)]
        host += [pad + [0] * NUM_INTS] * (Bp - B)  # padded rows: nothing pending, nothing drafted
        ints = torch.tensor(host, dtype=torch.long, device="cpu")
        b["ints"][:Bp, : P + NUM_INTS].copy_(to_device(ints, b["ints"].device))

    def _capture(self, b: dict, key: tuple) -> None:
        """Capture one shape. Its warm-up runs on the step's real inputs (what it writes, the replay that
        follows writes again)."""
        graph, _ = capture(lambda: self._step(b, *key), self.pool)
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = graph
        self.shapes.num_captures += 1


def _padded(sampling: BatchSampling, Bp: int) -> BatchSampling:
    """`sampling` with greedy rows appended up to Bp (the bucket's padded rows)."""
    n = Bp - len(sampling.host)
    return BatchSampling(F.pad(sampling.temperature, (0, n)), F.pad(sampling.top_k, (0, n)),
                         F.pad(sampling.top_p, (0, n), value=1.0), sampling.host + ((0.0, 0, 1.0),) * n)
