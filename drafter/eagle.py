"""EAGLE-style draft head: one decoder layer over (policy hidden state, next token embedding).

The head lags the policy by one position: the pair (h_i, t_{i+1}) - the policy's final hidden
state at position i and the token that followed - predicts h_{i+1}, and the policy's own LM head
turns that prediction into a distribution over t_{i+2}. Embedding and LM head are shared with
the policy (not copied), so the head's own weights are one layer plus a projection.
"""

from __future__ import annotations

import copy
import threading
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from drafter.drafters import Drafter, Proposal
from drafter.model import (
    CausalLM,
    DecoderLayer,
    Int8Linear,
    KVCache,
    Linear,
    ModelConfig,
    PackedWeight,
    RMSNorm,
    Rotary,
    fast_bf16,
    int8_linear_available,
    linear,
    quantize_int8,
    tree_inputs,
)
from drafter.sampling import BatchSampling, sample, token_probs
from drafter.tree import Tree, parse_widths, tree_attention


@dataclass
class EagleConfig:
    num_layers: int = 1  # EAGLE: one layer is enough to reach most of the acceptance
    # Score only this many tokens (the most frequent in rollouts, as EAGLE-3 does): the LM head is
    # a fifth of SmolLM2's weights, and each draft step would otherwise pay for all of it.
    draft_vocab_size: int | None = None  # None = the policy's full vocabulary
    init_seed: int = 0
    # Sampled rows draft from the job's sampling distribution over logits / draft_temperature (0: the
    # argmax). Rejection sampling stays exact for any draft distribution; what it accepts, sum min(p, q),
    # is highest for q = p, so a head whose q is flatter than p accepts more with a sharper q. Which one
    # wins is measured: calibrate_draft_temperature (drafter.evaluate) on held-out rollouts. SmolLM2's
    # warm-started head scored best at 1.0 (docs/benchmarks.md).
    draft_temperature: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.draft_temperature, (int, float)) or not 0 <= self.draft_temperature <= 10:
            raise ValueError(f"draft_temperature must be in [0, 10], got {self.draft_temperature!r}")

    def to_dict(self) -> dict:
        return asdict(self)


class EagleHead(nn.Module):
    def __init__(self, policy_cfg: ModelConfig, cfg: EagleConfig | None = None, init: bool = True) -> None:
        """init=False leaves the weights uninitialised, for a head about to load a checkpoint (a
        hot swap: random init is most of the cost of building a SmolLM2-size head)."""
        super().__init__()
        self.cfg = cfg or EagleConfig()
        self.policy_cfg = policy_cfg
        d = policy_cfg.hidden_size
        self.fc = Linear(2 * d, d, bias=False)  # fuse [embedding(t_{i+1}); h_i]
        self.layers = nn.ModuleList(DecoderLayer(policy_cfg) for _ in range(self.cfg.num_layers))
        self.norm = RMSNorm(d, policy_cfg.rms_norm_eps)
        # drafting runs up to k positions past the policy's context: give the table room for it
        self.rotary = Rotary(policy_cfg.head_dim, 2 * policy_cfg.max_position, policy_cfg.rope_theta)
        if init:
            gen = torch.Generator().manual_seed(self.cfg.init_seed)
            for p in self.parameters():
                if p.dim() == 2:
                    nn.init.normal_(p, std=0.02, generator=gen)
        num_draft = self.cfg.draft_vocab_size or policy_cfg.vocab_size
        if not 0 < num_draft <= policy_cfg.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {policy_cfg.vocab_size}], got {num_draft}")
        # policy token id of each draft-vocabulary entry; set_vocab picks them from rollouts
        self.register_buffer("vocab_ids", torch.arange(num_draft, dtype=torch.long))

    def set_vocab(self, token_counts: torch.Tensor, always: tuple[int, ...] = ()) -> None:
        """Keep the most frequent tokens (counts: (V,) over the policy vocabulary) plus `always` (EOS)."""
        n = self.vocab_ids.numel()
        counts = token_counts.double().clone()
        counts[list(always)] = float("inf")
        ids = counts.topk(n).indices.sort().values
        self.vocab_ids.copy_(ids)

    def draft_logits(self, predicted: torch.Tensor, lm_weight: torch.Tensor,
                     packed: PackedWeight | None = None) -> torch.Tensor:
        """(..., D) predicted features -> (..., V') logits over the draft vocabulary;
        lm_weight is the policy's LM head restricted to vocab_ids: (V', D). `packed`: its oneDNN
        copy for CPU inference (see drafter.model.linear)."""
        return linear(predicted, lm_weight, None, packed)

    def new_cache(self, batch_size: int, max_len: int, dtype: torch.dtype, device) -> KVCache:
        c = self.policy_cfg
        return KVCache(self.cfg.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim, dtype, device)

    def forward(self, features: torch.Tensor, token_embeds: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, tree: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """features, token_embeds: (B, T, D); positions (B, T). Returns predicted features (B, T, D).
        tree: (slots, mask) of a draft tree's nodes, as in CausalLM.forward."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))  # (B, T, 2D) -> (B, T, D)
        rope = self.rotary(positions, x.dtype)
        slots, mask, num_slots = tree_inputs(positions, cache, tree)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache, i, slots, mask, num_slots)
        return self.norm(x)


def draft_lm_weight(head: EagleHead, policy: CausalLM) -> torch.Tensor:
    """The policy's LM head restricted to the head's draft vocabulary, (V', D): what draft_logits takes."""
    return policy.lm_head.weight[head.vocab_ids]


def draft_probs(logits: torch.Tensor, sampling: BatchSampling, draft_temperature: float) -> torch.Tensor:
    """(B, T, V') draft logits -> the draft distribution q: the rows' sampling distribution over
    logits / draft_temperature, or a one-hot on the argmax when draft_temperature is 0."""
    if draft_temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return token_probs(logits if draft_temperature == 1 else logits / draft_temperature, sampling)


def serving_precision(policy: CausalLM, spec: torch.dtype | str | None) -> tuple[torch.dtype, bool]:
    """(dtype the head computes in, whether its linear layers hold int8 weights) for a precision spec:
    None, "auto", "float32", "bfloat16", "float16" or "int8" (float32 activations, int8 weights: CPU
    only; never picked by "auto"). Drafting at batch 1 is bound by reading the head's weights (and, on
    a CPU, the policy's evict them every step): bf16 halves those bytes, int8 quarters them, but int8's
    per-call activation quantization cost SmolLM2's head 0.12-0.22 accepted tokens per step, which ate
    the time it saved (docs/benchmarks.md, session 9). Verification keeps the output exact whatever
    the draft's precision."""
    if spec == "int8":
        if policy.device.type != "cpu" or not int8_linear_available():
            raise ValueError("draft dtype int8 needs a CPU policy and torch's fbgemm/x86 quantized engine")
        return torch.float32, True
    return serving_dtype(policy, spec), False


def serving_dtype(policy: CausalLM, dtype: torch.dtype | str | None) -> torch.dtype:
    """The dtype a draft head computes in (see serving_precision; "int8" computes in float32). None:
    the policy's. "auto": bfloat16 for a float32 policy on a device with native bf16 matmuls
    (fast_bf16), else the policy's."""
    if dtype is None:
        return policy.dtype
    if dtype == "int8":
        return torch.float32
    if dtype == "auto":
        return torch.bfloat16 if policy.dtype == torch.float32 and fast_bf16(policy.device) else policy.dtype
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    resolved = names.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if resolved not in names.values():
        raise ValueError(f"draft dtype must be None, 'auto', 'int8' or one of {sorted(names)}, got {dtype!r}")
    return resolved


class EagleDrafter(Drafter):
    """Runs an EagleHead autoregressively for k steps per verify, one KV cache row per sequence."""

    needs_hidden = True
    name = "eagle"

    def __init__(self, policy: CausalLM, head: EagleHead, dtype: torch.dtype | str | None = None,
                 tree: str | tuple[int, ...] | None = None, tree_side_depth: int = 1,
                 tree_max_batch: int = 4) -> None:
        """dtype: the precision the head drafts in (see serving_dtype); the head passed in is never
        converted in place: a head in another dtype is served from a converted copy. tree: candidates
        at the first draft depths ("3,2": three at the first, two at the second; None or "": a chain),
        each extra candidate heading a chain of tree_side_depth nodes (drafter.tree.Tree.for_k). A
        tree is drafted only while at most tree_max_batch sequences are live: verifying a tree's extra
        nodes is nearly free at batch 1 (bound by reading the weights), not in a full batch."""
        self.policy = policy
        self.dtype, self.int8 = serving_precision(policy, dtype)
        self.tree_widths = parse_widths(tree)
        if tree_side_depth < 1 or tree_max_batch < 0:
            raise ValueError(f"tree_side_depth must be >= 1 and tree_max_batch >= 0, got {tree_side_depth}, "
                             f"{tree_max_batch}")
        self.tree_side_depth, self.tree_max_batch = tree_side_depth, tree_max_batch
        self._install(self._prepare(head))
        self.version: int | None = None  # draft version serving, for progress reports
        self._next: tuple[EagleHead, int | None] | None = None
        self._lock = threading.Lock()
        # held by every step of the decode loop that touches the draft state (begin, propose,
        # observe, keep_rows) and by an install: a head switches between them, never inside one
        self._serve_lock = threading.RLock()
        self.num_swaps = 0
        self.swap_times: list[tuple[int | None, float]] = []  # (version, wall time it began serving)
        self.swap_seconds = 0.0  # decode-loop time spent switching heads (re-feeding the history)
        self.cache: KVCache | None = None
        self.pending_hidden: list[torch.Tensor] = []  # per row: (n, D) policy states not yet fed
        self.pending_tokens: list[list[int]] = []  # per row: the n tokens that followed them
        self.history_hidden: list[list[torch.Tensor]] = []  # per row: every true pair so far, to re-feed a new head
        self.history_tokens: list[list[int]] = []

    @property
    def precision(self) -> str:
        """What the head drafts in: "int8" (int8 weights, float32 activations), else its dtype's name."""
        return "int8" if self.int8 else str(self.dtype).removeprefix("torch.")

    def _prepare(self, head: EagleHead) -> EagleHead:
        """`head` on the policy's device in the serving precision: itself if it already is, else a copy
        (an int8 head is a quantized copy: the float head passed in stays trainable and intact)."""
        if head.policy_cfg.hidden_size != self.policy.cfg.hidden_size:
            raise ValueError("draft head hidden_size does not match the policy's")
        if isinstance(head.fc, Int8Linear):
            if not self.int8:
                raise ValueError("an int8 head can only be served by an int8 drafter")
            return head.eval()
        weight = head.fc.weight
        if self.int8 or weight.device != self.policy.device or weight.dtype != self.dtype:
            return self.convert(copy.deepcopy(head))
        return head.eval()

    def convert(self, head: EagleHead) -> EagleHead:
        """`head` itself, converted in place to the serving precision (for a head no one else holds,
        such as one just loaded from the store: `request_swap` then has no copy to make)."""
        head = head.to(device=self.policy.device, dtype=self.dtype)
        return (quantize_int8(head) if self.int8 else head).eval()

    def _install(self, head: EagleHead) -> None:
        self.head = head
        self.vocab_ids = self.head.vocab_ids
        # (V', D), sliced once, in the head's dtype
        self.lm_weight = draft_lm_weight(head, self.policy).to(self.dtype).contiguous()
        self.lm_packed = PackedWeight()
        self.lm_int8 = Int8Linear(self.lm_weight) if self.int8 else None

    def _draft_logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """(B, T, D) predicted features -> (B, T, V') logits over the draft vocabulary."""
        if self.lm_int8 is not None:
            return self.lm_int8(predicted)
        return self.head.draft_logits(predicted, self.lm_weight, self.lm_packed)

    def request_swap(self, head: EagleHead, version: int | None = None) -> None:
        """Serve `head` from the next draft step on (thread-safe; never mid-forward). Its KV cache is
        rebuilt from the true pairs seen so far, so the swap costs one head pass over the history. A
        dtype conversion happens here, in the caller's thread, not in the decode loop."""
        head = self._prepare(head)
        with self._lock:
            self._next = (head, version)

    def refresh(self) -> None:
        """The policy's weights changed: re-slice its LM head at the next draft step. A head already
        requested keeps its place (it is installed against the new weights anyway)."""
        with self._lock:
            if self._next is None:
                self._next = (self.head, self.version)

    def apply_pending_swap(self) -> None:
        """Switch to a requested head now. Thread-safe: a generation under way is between two of its
        draft-state updates when this runs (while the policy verifies, typically), so the switch does
        not wait for the next draft step; the engine's next `propose` re-feeds the history."""
        with self._serve_lock:
            self._apply_swap()

    def _apply_swap(self) -> None:
        with self._lock:
            nxt, self._next = self._next, None
        if nxt is None:
            return
        start = time.perf_counter()
        self._install(nxt[0])
        self.version = nxt[1]
        self.num_swaps += 1
        self.cache = None  # the old head's keys mean nothing to the new one
        self.pending_hidden = [torch.cat(h) if h else self._empty() for h in self.history_hidden]
        self.pending_tokens = [list(t) for t in self.history_tokens]
        self.swap_times.append((self.version, time.time()))
        self.swap_seconds += time.perf_counter() - start


    def begin(self, prompts, prefill_hidden) -> None:
        with self._serve_lock:
            self._begin(prompts, prefill_hidden)

    def _begin(self, prompts, prefill_hidden) -> None:
        self.cache = None
        self.pending_hidden, self.pending_tokens = [], []
        for b, p in enumerate(prompts):
            n = len(p) - 1
            hid = prefill_hidden[b, :n] if prefill_hidden is not None and n > 0 else self._empty()
            self.pending_hidden.append(hid)
            self.pending_tokens.append(list(p[1:]))
        self.history_hidden = [[h] for h in self.pending_hidden]
        self.history_tokens = [list(t) for t in self.pending_tokens]

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, self.policy.cfg.hidden_size, dtype=self.policy.dtype, device=self.policy.device)

    def ensure_cache(self, batch_size: int, needed: int) -> KVCache:
        if self.cache is None:
            self.cache = self.head.new_cache(batch_size, max(needed, 64), self.dtype, self.policy.device)
        elif needed > self.cache.max_len:  # grow geometrically; old slots keep their values
            grown = self.head.new_cache(batch_size, max(needed, 2 * self.cache.max_len), self.dtype,
                                        self.policy.device)
            grown.k[:, :, : self.cache.max_len] = self.cache.k
            grown.v[:, :, : self.cache.max_len] = self.cache.v
            grown.lens = self.cache.lens
            self.cache = grown
        return self.cache

    def tree_for(self, k: int, batch_size: int = 1) -> Tree | None:
        if k < 1 or not any(w > 1 for w in self.tree_widths) or batch_size > self.tree_max_batch:
            return None
        return Tree.for_k(k, self.tree_widths, self.tree_side_depth)

    def propose(self, contexts, caps, sampling: BatchSampling, uniforms) -> Proposal:
        with self._serve_lock:
            return self._propose(contexts, caps, sampling, uniforms)

    def propose_tree(self, contexts, caps, sampling: BatchSampling, uniforms, tree: Tree) -> Proposal:
        with self._serve_lock:
            return self._propose(contexts, caps, sampling, uniforms, tree)

    def _feed_pending(self, B: int, extra: int) -> tuple[torch.Tensor, torch.Tensor, KVCache] | None:
        """Run every row's pending true pairs through the head (ragged, right-padded). Returns the
        head's prediction after each row's last pair (B, 1, D), the number fed per row and the cache,
        with room for `extra` speculative slots; None when no row has anything pending."""
        device = self.policy.device
        num_pending = torch.tensor([len(t) for t in self.pending_tokens], dtype=torch.long, device=device)
        P = int(num_pending.max())
        cache = self.ensure_cache(B, int(self.cache.lens.max() if self.cache is not None else 0) + P + extra + 1)
        if P == 0:
            return None
        feats = torch.zeros(B, P, self.policy.cfg.hidden_size, dtype=self.dtype, device=device)
        toks = torch.zeros(B, P, dtype=torch.long, device=device)
        for b in range(B):
            n = len(self.pending_tokens[b])
            feats[b, :n] = self.pending_hidden[b]
            toks[b, :n] = torch.tensor(self.pending_tokens[b], dtype=torch.long)
        positions = cache.lens.unsqueeze(1) + torch.arange(P, device=device)  # (B, P)
        out = self.head(feats, self.policy.embed_tokens(toks).to(self.dtype), positions, cache)  # (B, P, D)
        last = (num_pending - 1).clamp(min=0)
        pred = out[torch.arange(B, device=device), last].unsqueeze(1)  # (B, 1, D)
        cache.lens = cache.lens + num_pending
        self.pending_hidden = [self._empty() for _ in range(B)]
        self.pending_tokens = [[] for _ in range(B)]
        return pred, num_pending, cache

    @torch.inference_mode()
    def _propose(self, contexts, caps, sampling: BatchSampling, uniforms, tree: Tree | None = None) -> Proposal:
        self._apply_swap()
        if tree is not None:
            return self._propose_tree(contexts, caps, sampling, uniforms, tree)
        B, device = len(contexts), self.policy.device
        K = max(caps)
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        probs = None if sampling.all_greedy else torch.zeros(B, K, self.policy.cfg.vocab_size, device=device)
        fed = self._feed_pending(B, K) if K > 0 else None  # 1) the true pairs
        if fed is None:
            return Proposal(tokens, torch.zeros(B, dtype=torch.long, device=device), probs)
        pred, num_pending, cache = fed
        lens = torch.where(num_pending > 0, torch.tensor(caps, device=device).clamp(max=K), 0)
        pos = cache.lens.unsqueeze(1)  # (B, 1): next speculative slot
        # 2) draft autoregressively from the head's own predictions
        for j in range(K):
            logits = self._draft_logits(pred)  # (B, 1, V')
            if sampling.all_greedy:
                x = self.vocab_ids[logits[:, 0].argmax(-1)]
            else:
                p = draft_probs(logits, sampling, self.head.cfg.draft_temperature)[:, 0]  # (B, V')
                x = self.vocab_ids[sample(p, uniforms[:, j])]
                probs[:, j].index_copy_(1, self.vocab_ids, p)  # scattered onto the policy vocabulary
            tokens[:, j] = x
            if j + 1 < K:
                pred = self.head(pred, self.policy.embed_tokens(x.unsqueeze(1)).to(self.dtype), pos + j, cache)
        return Proposal(tokens, lens, probs)

    def _propose_tree(self, contexts, caps, sampling: BatchSampling, uniforms, tree: Tree) -> Proposal:
        """Draft `tree` depth by depth: at each node with children, its candidates in rank order (greedy
        rows and a draft temperature of 0: the best logits, as one-hots; sampled rows: drawn without
        replacement from the draft distribution, whose remainder each next candidate is drawn from),
        then one head pass over the depth's nodes that have children, under the tree mask."""
        B, device, N = len(contexts), self.policy.device, tree.num_nodes
        V = self.policy.cfg.vocab_size
        tokens = torch.zeros(B, N, dtype=torch.long, device=device)
        probs = None if sampling.all_greedy else torch.zeros(B, N, V, device=device)
        fed = self._feed_pending(B, N)
        if fed is None:
            return Proposal(tokens, torch.zeros(B, dtype=torch.long, device=device), probs,
                            torch.zeros(B, N, dtype=torch.bool, device=device))
        pred, num_pending, cache = fed
        depth = tree.depth[1:].to(device)
        cap = torch.where(num_pending > 0, torch.tensor(caps, device=device), 0)
        valid = depth.view(1, N) <= cap.view(B, 1)  # (B, N)
        node_pred = torch.zeros(B, N + 1, pred.shape[-1], dtype=pred.dtype, device=device)
        node_pred[:, 0] = pred[:, 0]
        base = cache.lens  # (B,): node j's slot is base + j - 1, its position base + depth - 1
        num_slots = int(base.max()) + N
        rows = torch.arange(B, device=device)
        deterministic = sampling.all_greedy or self.head.cfg.draft_temperature == 0
        parents = tree.parent[1:].tolist()
        for d in range(1, tree.max_depth + 1):
            at_d = [j for j in range(1, N + 1) if int(tree.depth[j]) == d]
            pars = sorted({parents[j - 1] for j in at_d})
            # one pass over the draft LM head for the whole depth: reading its weight is the cost
            depth_logits = self._draft_logits(node_pred[:, pars]).float()
            for col, par in enumerate(pars):
                kids = [int(c) for c in tree.children[par] if c > 0]
                logits = depth_logits[:, col]  # (B, V')
                if deterministic:
                    best = logits.topk(len(kids), dim=-1).indices  # (B, m)
                    for i, j in enumerate(kids):
                        tokens[:, j - 1] = self.vocab_ids[best[:, i]]
                        if probs is not None:
                            probs[rows, j - 1, tokens[:, j - 1]] = 1.0
                    continue
                p = draft_probs(logits.unsqueeze(1), sampling, self.head.cfg.draft_temperature)[:, 0]  # (B, V')
                taken = torch.zeros_like(p, dtype=torch.bool)
                for j in kids:
                    mass = p.sum(-1)
                    spent = mass <= 1e-6  # a one-hot (greedy row) or an exhausted draft: next best, as a one-hot
                    x = torch.where(spent, logits.masked_fill(taken, float("-inf")).argmax(-1),
                                    sample(p / mass.clamp(min=1e-30).unsqueeze(1), uniforms[:, j - 1]))
                    q = torch.where(spent.unsqueeze(1), torch.zeros_like(p).scatter_(1, x.unsqueeze(1), 1.0),
                                    p / mass.clamp(min=1e-30).unsqueeze(1))
                    tokens[:, j - 1] = self.vocab_ids[x]
                    probs[:, j - 1].index_copy_(1, self.vocab_ids, q)
                    taken[rows, x] = True
                    p = p.masked_fill(taken, 0.0)
            if d == tree.max_depth:
                break
            grow = [j for j in at_d if bool(tree.has_children[j])]
            if not grow:
                continue
            nodes = torch.tensor(grow, dtype=torch.long, device=device)
            feats = node_pred[:, tree.parent[nodes].to(device)]  # (B, T, D)
            embeds = self.policy.embed_tokens(tokens[:, nodes - 1]).to(self.dtype)
            positions = base.view(B, 1) + (d - 1)
            slots = base.view(B, 1) + nodes.view(1, -1) - 1
            mask = tree_attention(base, nodes, tree, 1, num_slots)
            node_pred[:, nodes] = self.head(feats, embeds, positions.expand(B, len(grow)), cache, (slots, mask))
        return Proposal(tokens, valid.sum(1), probs, valid)

    def observe(self, new_tokens, hidden) -> None:
        with self._serve_lock:
            self._observe(new_tokens, hidden)

    def _observe(self, new_tokens, hidden) -> None:
        for b, toks in enumerate(new_tokens):
            h = hidden[b, : len(toks)]
            self.pending_hidden[b] = torch.cat([self.pending_hidden[b], h])  # pairs not fed yet stay queued
            self.pending_tokens[b] = self.pending_tokens[b] + list(toks)
            self.history_hidden[b].append(h)
            self.history_tokens[b] += list(toks)

    def keep_rows(self, rows: torch.Tensor) -> None:
        with self._serve_lock:
            self._keep_rows(rows)

    def _keep_rows(self, rows: torch.Tensor) -> None:
        idx = rows.tolist()
        self.pending_hidden = [self.pending_hidden[i] for i in idx]
        self.pending_tokens = [self.pending_tokens[i] for i in idx]
        self.history_hidden = [self.history_hidden[i] for i in idx]
        self.history_tokens = [self.history_tokens[i] for i in idx]
        if self.cache is not None:
            self.cache.keep_rows(rows.to(self.cache.lens.device))
