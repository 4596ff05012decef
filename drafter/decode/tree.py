"""Draft trees: several candidates per position, verified in one policy forward, still lossless.

A chain of k drafts is accepted only as far as its first miss; at temperature 1 the first miss comes
early (a single guess is accepted with probability sum min(p, q), p the target's distribution and q
the draft's). A tree offers the policy a second or third candidate where the first is rejected.
Verification is recursive rejection sampling (SpecInfer's multi-candidate speculative sampling): at
a node whose target distribution is p, the children c_1..c_m were drawn one after another from
q_1..q_m (for sampled drafts q_{i+1} is q_i without c_i, renormalised: drawing without replacement);
c_i is accepted with probability min(1, r_i(c_i) / q_i(c_i)) where r_1 = p and
r_{i+1} = norm(max(0, r_i - q_i)); when all are rejected the token is drawn from r_{m+1}. Each round
emits exactly r_i whatever the later rounds do, so the node emits exactly p (induction on the
rounds), and the accepted child's subtree is verified the same way against the policy's
distribution there. Greedy rows have a one-hot p: the child equal to the argmax is taken, whatever
its rank.

Nodes are numbered 0 (the root: the sequence's last token, already sampled) to N, parents before
children. In one verify forward node j sits at KV slot `lens + j` and rotary position
`lens + depth(j)`, and attends to the sequence's cache plus its own ancestors (the tree mask); the
accepted path is then moved to consecutive slots, so the cache stays a plain sequence.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from drafter.decode.sampling import BatchSampling, sample, token_probs


class Tree:
    """A static tree shape. paths[j - 1] is node j's path from the root: the rank of each child
    taken (rank 0 is the first candidate drawn at that node, 1 the second...)."""

    def __init__(self, paths: list[tuple[int, ...]] | tuple[tuple[int, ...], ...]) -> None:
        paths = sorted({tuple(int(r) for r in p) for p in paths}, key=lambda p: (len(p), p))
        index = {(): 0}
        for p in paths:
            if not p or min(p) < 0:
                raise ValueError(f"tree path {p!r} must be a non-empty tuple of ranks >= 0")
            if p[:-1] not in index:
                raise ValueError(f"tree path {p!r} has no parent {p[:-1]!r}")
            if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in index:
                raise ValueError(f"tree path {p!r}: candidate {p[-1]} needs candidate {p[-1] - 1} before it")
            index[p] = len(index)
        self.paths = tuple(paths)
        n = len(paths) + 1  # nodes, root included
        # the shape's tables live on the CPU (a Tree is cached and shared by every device): users move them
        cpu = torch.device("cpu")
        self.parent = torch.tensor([-1] + [index[p[:-1]] for p in paths], dtype=torch.long, device=cpu)
        self.depth = torch.tensor([0] + [len(p) for p in paths], dtype=torch.long, device=cpu)
        self.rank = torch.tensor([0] + [p[-1] for p in paths], dtype=torch.long, device=cpu)
        self.max_depth = int(self.depth.max())
        self.width = max((p[-1] + 1 for p in paths), default=0)
        children = torch.full((n, max(self.width, 1)), -1, dtype=torch.long, device=cpu)
        for p in paths:
            children[index[p[:-1]], p[-1]] = index[p]
        self.children = children  # (N+1, W): node index of each rank's child, -1 where none
        anc = torch.eye(n, dtype=torch.bool, device=cpu)
        for j in range(1, n):  # parents come first: their rows are complete
            anc[j] |= anc[int(self.parent[j])]
        self.ancestors = anc  # (N+1, N+1): [j, i] true when i is j or an ancestor of j
        self.has_children = (children >= 0).any(dim=1)

    @property
    def num_nodes(self) -> int:
        """Draft nodes, the root excluded."""
        return len(self.paths)

    @property
    def is_chain(self) -> bool:
        return self.width <= 1

    @property
    def num_uniforms(self) -> int:
        """Uniforms one verification consumes: one test per (depth, rank), one final draw."""
        return self.max_depth * max(self.width, 1) + 1

    def __repr__(self) -> str:
        return f"Tree({self.num_nodes} nodes, depth {self.max_depth}, width {self.width})"

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def for_k(k: int, widths: tuple[int, ...], side_depth: int = 1) -> Tree:
        """The chain of k first candidates, plus, at each depth d <= len(widths), widths[d-1] - 1
        more candidates beside the chain's node there, each the root of a chain of `side_depth`
        nodes (bounded by k). widths=() is the plain chain."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if any(w < 1 for w in widths) or side_depth < 1:
            raise ValueError(f"tree widths must be >= 1 and side_depth >= 1, got {widths}, {side_depth}")
        paths = [(0,) * d for d in range(1, k + 1)]
        for d, w in enumerate(widths[:k], start=1):
            for r in range(1, w):
                side = (0,) * (d - 1) + (r,)
                paths += [side + (0,) * e for e in range(min(side_depth, k - d + 1))]
        return Tree(paths)


def parse_widths(spec: str | tuple[int, ...] | list[int] | None) -> tuple[int, ...]:
    """'3,2' -> (3, 2): candidates at the first depths of a draft tree; '' or None -> () (a chain)."""
    if spec is None or spec == "":
        return ()
    if isinstance(spec, str):
        try:
            widths = tuple(int(w) for w in spec.split(","))
        except ValueError:
            raise ValueError(f"draft tree widths must be comma-separated ints like '3,2', got {spec!r}") from None
    else:
        widths = tuple(int(w) for w in spec)
    if any(w < 1 or w > 16 for w in widths) or len(widths) > 16:
        raise ValueError(f"draft tree widths must be 1..16 candidates at up to 16 depths, got {spec!r}")
    return widths


@dataclass(frozen=True)
class DraftTrees:
    """A drafter's tree options: widths (parse_widths), each extra candidate heading a chain of side_depth nodes
    (Tree.for_k), drafted only while at most max_batch sequences are live: verifying a tree's extra nodes is nearly
    free at batch 1 (bound by reading the weights), not in a full batch."""

    widths: tuple[int, ...] = ()
    side_depth: int = 1
    max_batch: int = 4

    @classmethod
    def of(cls, tree: str | tuple[int, ...] | list[int] | None, side_depth: int = 1, max_batch: int = 4
           ) -> DraftTrees:
        if side_depth < 1 or max_batch < 0:
            raise ValueError(f"tree_side_depth must be >= 1 and tree_max_batch >= 0, got {side_depth}, {max_batch}")
        return cls(parse_widths(tree), side_depth, max_batch)

    @property
    def branches(self) -> bool:
        """Whether any depth has more than one candidate (else every draft is a chain)."""
        return any(w > 1 for w in self.widths)

    def tree_for(self, k: int, batch_size: int) -> Tree | None:
        """The tree for draft depth k with batch_size sequences live, None for a chain."""
        if k < 1 or not self.branches or batch_size > self.max_batch:
            return None
        return Tree.for_k(k, self.widths, self.side_depth)


def tree_attention(base: torch.Tensor, nodes: torch.Tensor, tree: Tree, offset: int,
                   num_slots: int) -> torch.Tensor:
    """(B, 1, T, S) bool mask for queries at tree `nodes` (T,) whose node j lives in slot
    base[b] + j - offset: every slot before base[b], plus the query's own ancestors (itself included)."""
    slots = torch.arange(num_slots, device=base.device).view(1, -1)  # (1, S)
    rel = slots - base.view(-1, 1) + offset  # (B, S): the node index a slot holds, if any
    inside = (rel >= 0) & (rel <= tree.num_nodes)
    anc = tree.ancestors.to(base.device)[nodes]  # (T, N+1)
    tree_part = anc[:, rel.clamp(0, tree.num_nodes)]  # (T, B, S)
    if offset:  # nodes below `offset` are not in this cache's tree slots
        inside &= rel >= offset
    visible = (slots < base.view(-1, 1)).unsqueeze(1) | (tree_part.transpose(0, 1) & inside.unsqueeze(1))
    return visible.unsqueeze(1)


@dataclass
class TreeVerdict:
    path: torch.Tensor  # (B, D) accepted node indices, depth order; 0 past num_accepted
    num_accepted: torch.Tensor  # (B,)
    next_tokens: torch.Tensor  # (B,) the policy's token after the accepted path


def verify_tree(target_logits: torch.Tensor, tree: Tree, draft_tokens: torch.Tensor, valid: torch.Tensor,
                draft_probs: torch.Tensor | None, sampling: BatchSampling,
                uniforms: torch.Tensor | None) -> TreeVerdict:
    """target_logits (B, N+1, V): node j's row scores the token after node j. draft_tokens (B, N) and
    valid (B, N): node j's token and whether row b proposed it (column j-1). draft_probs (B, N, V):
    the draft distribution q node j was drawn from (None: one-hots, deterministic candidates). uniforms
    (B, tree.num_uniforms) for sampled rows, consumed as (depth, rank) tests then the final draw."""
    B = target_logits.shape[0]
    device = target_logits.device
    D, W = tree.max_depth, max(tree.width, 1)
    children = tree.children.to(device)
    rows = torch.arange(B, device=device)
    cur = torch.zeros(B, dtype=torch.long, device=device)
    active = torch.ones(B, dtype=torch.bool, device=device)
    path = torch.zeros(B, max(D, 1), dtype=torch.long, device=device)
    num_acc = torch.zeros(B, dtype=torch.long, device=device)
    greedy = sampling.all_greedy
    if greedy:
        target = target_logits.argmax(-1)  # (B, N+1)
    else:
        if uniforms is None:
            raise ValueError("uniforms are required when any row samples (temperature > 0)")
        p = token_probs(target_logits, sampling)  # (B, N+1, V): the target's distribution at each node
        residual = p[:, 0].clone()
    for d in range(D):
        moved = torch.zeros(B, dtype=torch.bool, device=device)
        for i in range(W):
            child = children[cur, i]  # (B,)
            col = (child - 1).clamp(min=0)
            test = active & ~moved & (child > 0) & valid[rows, col]
            if not bool(test.any()):
                continue
            x = draft_tokens[rows, col]
            if greedy:
                acc = test & (x == target[rows, cur])
            else:
                # Candidate i, drawn from the draft's q_i, against the residual r_i (r_1 = p):
                #   accept x with probability min(1, r_i(x) / q_i(x));
                #   on rejection the next one faces r_{i+1} = norm(max(0, r_i - q_i)); after the last, sample it.
                if draft_probs is None:
                    q = torch.zeros_like(residual).scatter_(1, x.unsqueeze(1), 1.0)
                else:
                    q = draft_probs[rows, col].float()
                qx, rx = q[rows, x], residual[rows, x]
                acc = test & (uniforms[:, d * W + i] * qx < rx)  # u < r/q without dividing by q
                rest = (residual - q).clamp_(min=0)
                mass = rest.sum(-1, keepdim=True)
                # mass 0 only when q equals the residual up to rounding: the residual itself is then exact
                rest = torch.where(mass > 0, rest / mass.clamp(min=1e-30), residual)
                residual = torch.where((test & ~acc).unsqueeze(1), rest, residual)
                residual = torch.where(acc.unsqueeze(1), p[rows, child.clamp(min=0)], residual)
            path[:, d] = torch.where(acc, child, path[:, d])
            num_acc += acc.long()
            cur = torch.where(acc, child, cur)
            moved |= acc
        active &= moved
        if not bool(active.any()):
            break
    nxt = target[rows, cur] if greedy else sample(residual, uniforms[:, -1])
    return TreeVerdict(path[:, :D], num_acc, nxt)


def compact_path(cache, path: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Move the accepted nodes' K/V from slots lens + path[:, j] to lens + j + 1, for all layers, so the
    cache holds the accepted tokens in sequence (cache.lens is not changed here)."""
    B, D = path.shape
    if D == 0:
        return
    device = cache.lens.device
    j = torch.arange(D, device=device).view(1, D)
    node = torch.where(j < num_accepted.view(B, 1), path, j + 1)  # rows past their path copy in place
    if bool((node == j + 1).all()):
        return  # first candidates all along: already in place
    limit = cache.max_len - 1
    src = (cache.lens.view(B, 1) + node).clamp(max=limit)
    dst = (cache.lens.view(B, 1) + j + 1).clamp(max=limit)
    rows = torch.arange(B, device=device).view(B, 1)
    cache.k[:, rows, dst] = cache.k[:, rows, src]
    cache.v[:, rows, dst] = cache.v[:, rows, src]
