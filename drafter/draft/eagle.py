"""The drafting runtime: an EagleHead (drafter.draft.head, EAGLE-3 layout) drafts up to k tokens per verify
step, one KV cache row per sequence, and is hot-swapped between decode steps without pausing generation.

The head is fed the policy's true (aux layers' states, next token) pairs as the policy accepts them
(fused by its fc), then drafts autoregressively from its own outputs; a head swapped in mid-generation
re-feeds every true pair of the live rows first (DraftRows.history), so it drafts as if it had served
all along. The engine asks the policy for the aux layers of `EagleDrafter.aux_layers`.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time

import torch

from drafter.decode.sampling import BatchSampling, draft_probs, sample
from drafter.decode.tree import DraftTrees, Tree, tree_attention
from drafter.draft.draft_graphs import DraftGraphs
from drafter.draft.draft_state import DraftRows, PendingSwap, SwapStats
from drafter.draft.drafters import Drafter, Proposal
from drafter.draft.head import EagleHead
from drafter.model.causal_lm import CausalLM, KVCache
from drafter.model.int8 import Int8Linear, int8_linear_available, quantize_int8
from drafter.model.linear import Linear, draft_int8_pays, fast_bf16, product_forms


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


def linear_shapes(head: EagleHead) -> tuple[tuple[int, int], ...]:
    """The weight shapes (out, in) of a head's linear layers, each once."""
    return tuple(sorted({tuple(m.weight.shape) for m in head.modules() if isinstance(m, Linear)}))


def same_layout(a: EagleHead, b: EagleHead) -> bool:
    """Whether b's weights can be written into a's tensors (and b's config take a's place) to serve as b: the same
    configs but for the init seed and the draft temperature (captured draft steps read it on the device), the same
    state-dict keys, each tensor of the same shape, dtype and device; int8 heads (packed weights) never."""
    if isinstance(a.fc, Int8Linear) or isinstance(b.fc, Int8Linear) or a.policy_cfg != b.policy_cfg:
        return False
    if dataclasses.replace(a.cfg, init_seed=0, draft_temperature=1.0) != \
            dataclasses.replace(b.cfg, init_seed=0, draft_temperature=1.0):
        return False
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        x.shape == sb[n].shape and x.dtype == sb[n].dtype and x.device == sb[n].device for n, x in sa.items())


class EagleDrafter(Drafter):
    """Runs an EagleHead autoregressively for k steps per verify, one KV cache row per sequence. Every head it
    serves fuses the same policy layers (aux_layers, fixed by the first): the engine records those."""

    needs_hidden = True
    name = "eagle"

    def __init__(self, policy: CausalLM, head: EagleHead, dtype: torch.dtype | str | None = None,
                 tree: str | tuple[int, ...] | None = None, tree_side_depth: int = 1,
                 tree_max_batch: int = 4, static: bool | None = None, own_head: bool = False) -> None:
        """dtype: the precision the head drafts in (see serving_dtype); the head passed in is never
        converted in place: a head in another dtype is served from a converted copy. own_head: `head` is the
        drafter's alone (no one else holds it), so a swap may write a new head's weights into it (see
        `_install`; a head converted here is a copy, the drafter's too); otherwise a swap serves the new head as
        itself, the drafter's own from then on if handed over (request_swap's `give`). tree: candidates
        at the first draft depths ("3,2": three at the first, two at the second; None or "": a chain),
        each extra candidate heading a chain of tree_side_depth nodes, drafted only while at most
        tree_max_batch sequences are live (drafter.decode.tree.DraftTrees)."""
        self.policy = policy
        self.dtype, self.int8 = serving_precision(policy, dtype)
        self.trees = DraftTrees.of(tree, tree_side_depth, tree_max_batch)
        # the policy layers the engine hands over (drafter.model.causal_lm.draft_features)
        self.aux_layers = head.aux_layers
        prepared = self._prepare(head)
        self.head = prepared  # the head serving (its own LM head over the draft vocabulary included)
        # whether swaps may write into self.head: a copy made here is ours, the caller's own head is not
        self._owns_head = bool(own_head) or prepared is not head
        # "auto" on a CPU: the head's products run on int8 copies of its weights where that is timed faster
        # (draft_int8_pays); the head keeps its weights (in-place swaps, scoring and training as before)
        self.int8_products = (dtype == "auto" and not self.int8 and policy.device.type == "cpu"
                              and draft_int8_pays(self.dtype, linear_shapes(prepared)))
        self._mark_int8()
        if policy.device.type == "cpu" and not (self.int8 or self.int8_products):
            product_forms(self.dtype, linear_shapes(prepared))  # its products' forms probed here, not in a step
        self.version: int | None = None  # draft version serving, for progress reports
        self.pending = PendingSwap()
        self.swaps = SwapStats()
        self.rows = DraftRows()
        # static: chains drafted on drafter.draft.draft_graphs' path (one head cache kept between calls, CUDA graphs
        # on a GPU); None chooses it wherever it applies, as the engine does: on CUDA, and on a CPU unless a tree
        # or int8 weights (CPU-only, eager) are asked for. It drafts chains only: no tree is proposed while it is on
        on = (policy.device.type == "cuda" or not (self.trees.branches or self.int8)) \
            if static is None else bool(static)
        if on and self.int8:
            raise ValueError("int8 drafting runs on the eager path only: leave static unset (None) or False")
        self.graphs = DraftGraphs(self, policy.device.type == "cuda") if on else None
        self.rows.static = on
        # held by every step of the decode loop that touches the draft state (begin, propose,
        # observe, keep_rows) and by an install: a head switches between them, never inside one
        self._serve_lock = threading.RLock()

    @property
    def precision(self) -> str:
        """What the head drafts in: "int8" (int8 weights, float32 activations), else its dtype's name, with
        " (int8 products)" where its products run on int8 copies of its weights."""
        if self.int8:
            return "int8"
        return str(self.dtype).removeprefix("torch.") + (" (int8 products)" if self.int8_products else "")

    def _mark_int8(self) -> None:
        """The serving head's linear layers run on int8 copies of their weights iff int8_products and the head is
        the drafter's own (a caller's head serving as itself stays as the caller left it)."""
        on = self.int8_products and self._owns_head
        for module in self.head.modules():
            if isinstance(module, Linear):
                module.int8 = on

    def _prepare(self, head: EagleHead) -> EagleHead:
        """`head` on the policy's device in the serving precision: itself if it already is, else a copy
        (an int8 head is a quantized copy: the float head passed in stays trainable and intact)."""
        if head.policy_cfg.hidden_size != self.policy.cfg.hidden_size:
            raise ValueError("draft head hidden_size does not match the policy's")
        if head.aux_layers != self.aux_layers:
            raise ValueError(f"draft head fuses layers {head.aux_layers}; this drafter serves heads of "
                             f"{self.aux_layers}")
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

    def _install(self, head: EagleHead, owned: bool) -> None:
        """Serve `head`. Where the serving head is the drafter's own and `head` has its layout (configs, and each
        tensor's shape, dtype and device), its weights are copied into the serving head's tensors: captured CUDA
        graphs read those by address, so a new draft version serves with no capture (the copy runs on the stream
        the graphs replay on, after the steps before it). Else `head` serves as itself (the graphs are captured
        again, once), the drafter's own from then on if `owned`."""
        old = self.head
        if head is old:
            return
        if self._owns_head and same_layout(old, head):
            with torch.no_grad():
                torch._foreach_copy_(list(old.state_dict().values()), list(head.state_dict().values()))
            old.cfg = dataclasses.replace(head.cfg)
            return
        self.head, self._owns_head = head, owned
        self._mark_int8()

    def request_swap(self, head: EagleHead, version: int | None = None, give: bool = False) -> None:
        """Serve `head` from the next draft step on (thread-safe; never mid-forward). Its KV cache is
        rebuilt from the true pairs seen so far, so the swap costs one head pass over the history. A
        dtype conversion happens here, in the caller's thread, not in the decode loop. give: `head` is handed
        over (a fresh load no one else holds), so the drafter may keep it and write later versions into it; a
        head converted here is a copy, the drafter's either way."""
        prepared = self._prepare(head)
        self.pending.put(prepared, version, owned=give or prepared is not head)

    def refresh(self) -> None:
        """The policy's weights changed: re-install the serving head at the next draft step (its cache is
        rebuilt from the true pairs; the head holds nothing of the policy's, whose embedding it reads live). A
        head already requested keeps its place."""
        self.pending.put(self.head, self.version, replace=False, owned=self._owns_head)

    def apply_pending_swap(self) -> None:
        """Switch to a requested head now. Thread-safe: a generation under way is between two of its
        draft-state updates when this runs (while the policy verifies, typically), so the switch does
        not wait for the next draft step; the engine's next `propose` re-feeds the history."""
        with self._serve_lock:
            self._apply_swap()

    def _apply_swap(self) -> None:
        nxt = self.pending.take()
        if nxt is None:
            return
        start = time.perf_counter()
        self._install(nxt[0], nxt[2])
        self.version = nxt[1]
        self.rows.replay(self._empty())
        self.swaps.record(self.version, time.perf_counter() - start)

    def begin(self, prompts, prefill_hidden, max_len: int = 0) -> None:
        with self._serve_lock:
            self.rows.begin(prompts, prefill_hidden, self._empty())
            if self.graphs is not None:
                self.graphs.begin(len(prompts), max_len)

    def observe(self, new_tokens, hidden) -> None:
        with self._serve_lock:
            self.rows.observe(new_tokens, hidden)

    def keep_rows(self, rows: torch.Tensor) -> None:
        with self._serve_lock:
            self.rows.keep(rows)

    def shape_counts(self):
        return self.graphs.shapes if self.graphs is not None else None

    def _empty(self) -> torch.Tensor:
        return torch.zeros(0, self.head.feature_size, dtype=self.policy.dtype, device=self.policy.device)

    def tree_for(self, k: int, batch_size: int = 1) -> Tree | None:
        return None if self.graphs is not None else self.trees.tree_for(k, batch_size)

    def propose(self, contexts, caps, sampling: BatchSampling, uniforms, width: int | None = None) -> Proposal:
        with self._serve_lock:
            return self._propose(contexts, caps, sampling, uniforms, width=width)

    def propose_tree(self, contexts, caps, sampling: BatchSampling, uniforms, tree: Tree) -> Proposal:
        with self._serve_lock:
            return self._propose(contexts, caps, sampling, uniforms, tree)

    def _feed_pending(self, B: int, extra: int) -> tuple[torch.Tensor, torch.Tensor, KVCache] | None:
        """Run every row's pending true pairs through the head (ragged, right-padded). Returns the
        head's output after each row's last pair (B, 1, D), the number fed per row and the cache,
        with room for `extra` speculative slots; None when no row has anything pending."""
        device, rows = self.policy.device, self.rows
        num_pending = torch.tensor([len(t) for t in rows.pending_tokens], dtype=torch.long, device=device)
        P = int(num_pending.max())
        needed = int(rows.cache.lens.max() if rows.cache is not None else 0) + P + extra + 1
        cache = rows.ensure_cache(self.head, B, needed, self.dtype, device)
        if P == 0:
            return None
        feats = torch.zeros(B, P, self.head.feature_size, dtype=self.dtype, device=device)
        toks = torch.tensor([t + [0] * (P - len(t)) for t in rows.pending_tokens], dtype=torch.long, device=device)
        for b in range(B):
            n = len(rows.pending_tokens[b])
            feats[b, :n] = rows.pending_hidden(b, self._empty())
        positions = cache.lens.unsqueeze(1) + torch.arange(P, device=device)  # (B, P)
        hidden = self.head.fuse(feats)  # (B, P, 4D) -> (B, P, D)
        out = self.head(hidden, self.policy.embed_tokens(toks).to(self.dtype), positions, cache)  # (B, P, D)
        last = (num_pending - 1).clamp(min=0)
        pred = out[torch.arange(B, device=device), last].unsqueeze(1)  # (B, 1, D)
        cache.lens = cache.lens + num_pending
        rows.clear_pending(self._empty())
        return pred, num_pending, cache

    @torch.inference_mode()
    def _propose(self, contexts, caps, sampling: BatchSampling, uniforms, tree: Tree | None = None,
                 width: int | None = None) -> Proposal:
        self._apply_swap()
        if tree is not None:
            return self._propose_tree(contexts, caps, sampling, uniforms, tree)
        B, device = len(contexts), self.policy.device
        coupling = sampling.coupling  # coupled rows draft with the noise their policy sample will use
        index = None if coupling is None else torch.tensor([len(c) for c in contexts], device=device)
        if self.graphs is not None:
            return self.graphs.propose(caps, sampling, uniforms, max(caps) if width is None else width, index)
        K = max(caps) if width is None else width
        vocab_ids = self.head.vocab_ids
        tokens = torch.zeros(B, K, dtype=torch.long, device=device)
        probs = None if sampling.all_greedy else torch.zeros(B, K, self.policy.cfg.vocab_size, device=device)
        fed = self._feed_pending(B, K) if K > 0 else None  # 1) the true pairs
        if fed is None:
            return Proposal(tokens, torch.zeros(B, dtype=torch.long, device=device), probs)
        pred, num_pending, cache = fed
        lens = torch.where(num_pending > 0, torch.tensor(caps, device=device).clamp(max=K), 0)
        pos = cache.lens.unsqueeze(1)  # (B, 1): next speculative slot
        # 2) draft autoregressively from the head's own outputs
        for j in range(K):
            logits = self.head.logits(pred)  # (B, 1, V')
            if sampling.all_greedy:
                x = vocab_ids[logits[:, 0].argmax(-1)]
            else:
                q = draft_probs(logits, sampling, self.head.cfg.draft_temperature)[:, 0]  # (B, V'): the draft's q
                x = vocab_ids[sample(q, uniforms[:, j])]
                probs[:, j].index_copy_(1, vocab_ids, q)  # scattered onto the policy vocabulary
            if coupling is not None:  # greedy rows to the verifier: their q never enters its test
                chosen = vocab_ids[coupling.draft(logits[:, 0], index + j, vocab_ids, self.head.cfg.draft_temperature)]
                x = torch.where(coupling.mask, chosen, x)
            tokens[:, j] = x
            if j + 1 < K:
                pred = self.head(pred, self.policy.embed_tokens(x.unsqueeze(1)).to(self.dtype), pos + j, cache)
        return Proposal(tokens, lens, probs)

    def _propose_tree(self, contexts, caps, sampling: BatchSampling, uniforms, tree: Tree) -> Proposal:
        """Draft `tree` depth by depth: at each node with children, its candidates in rank order (greedy
        rows and a draft temperature of 0: the best logits, as one-hots; sampled rows: drawn without
        replacement from the draft distribution q, whose remainder each next candidate is drawn from),
        then one head pass over the depth's nodes that have children, under the tree mask."""
        B, device, N = len(contexts), self.policy.device, tree.num_nodes
        V, vocab_ids = self.policy.cfg.vocab_size, self.head.vocab_ids
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
            depth_logits = self.head.logits(node_pred[:, pars]).float()
            for col, par in enumerate(pars):
                kids = [int(c) for c in tree.children[par] if c > 0]
                logits = depth_logits[:, col]  # (B, V')
                if deterministic:
                    best = logits.topk(len(kids), dim=-1).indices  # (B, m)
                    for i, j in enumerate(kids):
                        tokens[:, j - 1] = vocab_ids[best[:, i]]
                        if probs is not None:
                            probs[rows, j - 1, tokens[:, j - 1]] = 1.0
                    continue
                # q: the draft mass not drawn yet at this node; q_i: what candidate i is drawn from
                q = draft_probs(logits.unsqueeze(1), sampling, self.head.cfg.draft_temperature)[:, 0]  # (B, V')
                taken = torch.zeros_like(q, dtype=torch.bool)
                for j in kids:
                    mass = q.sum(-1)
                    spent = mass <= 1e-6  # a one-hot (greedy row) or an exhausted draft: next best, as a one-hot
                    x = torch.where(spent, logits.masked_fill(taken, float("-inf")).argmax(-1),
                                    sample(q / mass.clamp(min=1e-30).unsqueeze(1), uniforms[:, j - 1]))
                    q_i = torch.where(spent.unsqueeze(1), torch.zeros_like(q).scatter_(1, x.unsqueeze(1), 1.0),
                                      q / mass.clamp(min=1e-30).unsqueeze(1))
                    tokens[:, j - 1] = vocab_ids[x]
                    probs[:, j - 1].index_copy_(1, vocab_ids, q_i)
                    taken[rows, x] = True
                    q = q.masked_fill(taken, 0.0)
            if d == tree.max_depth:
                break
            grow = [j for j in at_d if bool(tree.has_children[j])]
            if not grow:
                continue
            nodes = torch.tensor(grow, dtype=torch.long, device=device)
            feats = node_pred[:, tree.parent.to(device)[nodes]]  # (B, T, D); the tree's tables are on the CPU
            embeds = self.policy.embed_tokens(tokens[:, nodes - 1]).to(self.dtype)
            positions = base.view(B, 1) + (d - 1)
            slots = base.view(B, 1) + nodes.view(1, -1) - 1
            mask = tree_attention(base, nodes, tree, 1, num_slots)
            node_pred[:, nodes] = self.head(feats, embeds, positions.expand(B, len(grow)), cache, (slots, mask))
        return Proposal(tokens, valid.sum(1), probs, valid)
