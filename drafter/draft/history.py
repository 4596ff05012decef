"""Drafts from history: each row proposes what followed the longest match of its context's suffix in the text its
group has seen (its prompt, its own output, its siblings' outputs as they stream in, and earlier responses to the
same prompt), the draft of DAS, SPEC-RL and RhymeRL. The proposal is deterministic (q one-hot), so the engine's
verification keeps the policy's distribution.

The index (`SuffixIndex`) maps every n-gram of NGRAM_SIZES lengths ending at a position to its latest few
occurrences: appending a token costs len(NGRAM_SIZES) dict inserts, amortized O(1). Each row keeps a pointer
into the index (a sequence and the position after its match) and moves it along while the policy emits what the
pointer predicted, so a row that follows a sibling pays one slice compare per step; only after a miss is the
context looked up again, longest n first. The match length (grown by each followed token) is the row's confidence.
Why not a library: the suffix-array packages on PyPI build static arrays (a sibling streaming in means a rebuild),
and Snowflake's suffix-tree decoder ships inside a vLLM plugin; this structure is small and tested here.

With `tree` widths, a row drafts a tree while few rows are live (`propose_tree`, the speculation trees of
SuffixDecoding): each node's candidates are the distinct tokens that followed the suffix matches, best first, so
where one sibling's continuation is rejected another's may be accepted (drafter.decode.tree verifies one-hot
candidates by recursive rejection sampling).

`ResponseStore` keeps earlier responses per prompt (keyed by a hash of its tokens) within a byte budget, evicting
the least recently used prompt's oldest response first: a rollout worker keeps it across RL steps.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

import numpy as np
import torch

from drafter.decode.tree import DraftTrees, Tree
from drafter.draft.drafters import Drafter, Proposal, pad_proposal

NGRAM_SIZES = (16, 12, 8, 6, 4, 3, 2, 1)  # looked up longest first; a match longer than 16 grows by following
MAX_OCCURRENCES = 8  # latest positions kept per n-gram: a group of 8 siblings all end their prompt at one n-gram
# earlier responses kept per worker: 64 MiB of int32 tokens is 16M tokens, some 30k responses of 512 tokens
STORE_MAX_BYTES = 64 << 20
STORE_MAX_PER_PROMPT = 16  # two groups of 8: the latest steps say most about the current policy
TREE_MAX_OCCURRENCES = 24  # occurrences a tree draft gathers (longest n-grams first) before it stops looking


def prompt_key(prompt: list[int]) -> str:
    """A prompt's key in the store: a hash of its tokens (stable across processes, so stores can be shared)."""
    return hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=16).hexdigest()


class SuffixIndex:
    """Token sequences and, for each n in NGRAM_SIZES, where each n-gram last ended in them."""

    def __init__(self, sizes: tuple[int, ...] = NGRAM_SIZES, max_occurrences: int = MAX_OCCURRENCES) -> None:
        if not sizes or min(sizes) < 1 or max_occurrences < 1:
            raise ValueError(f"need n-gram sizes >= 1 and max_occurrences >= 1, got {sizes}, {max_occurrences}")
        self.sizes = tuple(sorted(set(sizes), reverse=True))
        self.max_occurrences = max_occurrences
        self.seqs: list[list[int]] = []
        self.table: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # n-gram -> [(seq, end)], latest last

    def add(self, tokens: list[int], index_from: int = 1) -> int:
        """A new sequence (its id); n-grams ending at positions >= index_from (exclusive ends) are indexed."""
        seq_id = len(self.seqs)
        self.seqs.append(list(tokens))
        for end in range(max(index_from, 1), len(tokens) + 1):
            self._index(seq_id, end)
        return seq_id

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append `tokens` to sequence seq_id, indexing the n-grams that end in them."""
        seq = self.seqs[seq_id]
        for t in tokens:
            seq.append(t)
            self._index(seq_id, len(seq))

    def _index(self, seq_id: int, end: int) -> None:
        seq, table = self.seqs[seq_id], self.table
        for n in self.sizes:
            if n <= end:
                where = table.setdefault(tuple(seq[end - n : end]), [])
                where.append((seq_id, end))
                if len(where) > self.max_occurrences:
                    del where[0]

    def matches(self, context: list[int]):
        """(n, occurrences) for each indexed n-gram ending `context` that occurs, longest n first; an occurrence
        (seq, end) may have no token after it yet."""
        for n in self.sizes:
            if n <= len(context):
                where = self.table.get(tuple(context[-n:]))
                if where:
                    yield n, where

    def find(self, context: list[int], want: int) -> tuple[int, int, int] | None:
        """(seq, end, n): the longest n-gram ending `context` that occurs with at least one token after it. Of its
        occurrences, those whose next token is the most common one (sampled siblings vote for the policy's likely
        token), and of those the one with the most tokens after it (up to `want`; ties: the latest). None when
        nothing matches."""
        seqs = self.seqs
        for n, where in self.matches(context):
            votes: dict[int, int] = {}
            for seq_id, end in where:
                if end < len(seqs[seq_id]):
                    votes[seqs[seq_id][end]] = votes.get(seqs[seq_id][end], 0) + 1
            if not votes:
                continue
            top = max(votes.values())
            best, best_len = None, 0
            for seq_id, end in reversed(where):
                have = min(len(seqs[seq_id]) - end, want)
                if have > best_len and votes[seqs[seq_id][end]] == top:
                    best, best_len = (seq_id, end), have
            return best[0], best[1], n
        return None

    @property
    def num_tokens(self) -> int:
        return sum(len(s) for s in self.seqs)


class ResponseStore:
    """Earlier responses per prompt (int32 arrays, keyed by prompt_key), within max_bytes of tokens: past it the
    least recently used prompt loses its oldest response; a prompt keeps at most max_per_prompt."""

    def __init__(self, max_bytes: int = STORE_MAX_BYTES, max_per_prompt: int = STORE_MAX_PER_PROMPT) -> None:
        if max_bytes < 0 or max_per_prompt < 1:
            raise ValueError(f"need max_bytes >= 0 and max_per_prompt >= 1, got {max_bytes}, {max_per_prompt}")
        self.max_bytes, self.max_per_prompt = max_bytes, max_per_prompt
        self._by_prompt: OrderedDict[str, deque[np.ndarray]] = OrderedDict()
        self.nbytes = 0
        self.num_evicted = 0

    def add(self, prompt: list[int], response: list[int]) -> None:
        if not response:
            return
        key = prompt_key(prompt)
        kept = self._by_prompt.setdefault(key, deque())
        self._by_prompt.move_to_end(key)
        arr = np.asarray(response, dtype=np.int32)
        kept.append(arr)
        self.nbytes += arr.nbytes
        if len(kept) > self.max_per_prompt:
            self._drop(key)
        while self.nbytes > self.max_bytes and self._by_prompt:
            self._drop(next(iter(self._by_prompt)))

    def _drop(self, key: str) -> None:
        kept = self._by_prompt[key]
        self.nbytes -= kept.popleft().nbytes
        self.num_evicted += 1
        if not kept:
            del self._by_prompt[key]

    def responses(self, prompt: list[int]) -> list[list[int]]:
        """The prompt's kept responses, oldest first (a read counts as a use)."""
        key = prompt_key(prompt)
        kept = self._by_prompt.get(key)
        if kept is None:
            return []
        self._by_prompt.move_to_end(key)
        return [a.tolist() for a in kept]

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_prompt.values())


class HistoryDrafter(Drafter):
    """Per row: the continuation, up to its cap, of the longest suffix match in its group's index (see the module).
    Rows with the same prompt in a batch are a group: each streams into the one index its siblings draft from."""

    name = "history"

    def __init__(self, store: ResponseStore | None = None, min_match: int = 1,
                 sizes: tuple[int, ...] = NGRAM_SIZES, tree: str | tuple[int, ...] | None = None,
                 tree_side_depth: int = 1, tree_max_batch: int = 4) -> None:
        """store: earlier responses (None: a fresh store of the default budget). min_match: the shortest match
        that drafts (a row with a shorter one proposes nothing). tree: candidates at the first depths of a draft
        tree ('3,2'; None or '': chains), each extra candidate heading a chain of tree_side_depth nodes, drafted
        while at most tree_max_batch rows are live (see `propose_tree`)."""
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match}")
        self.trees = DraftTrees.of(tree, tree_side_depth, tree_max_batch)
        self.store = ResponseStore() if store is None else store
        self.min_match, self.sizes = min_match, sizes
        self.indexes: list[SuffixIndex] = []
        self.groups: list[int] = []  # row -> its group's index
        self.own: list[int] = []  # row -> its sequence in that index
        self.prompts: list[list[int]] = []
        self.pointers: list[tuple[int, int] | None] = []  # row -> (seq, end) its context's suffix matches before
        self.match_lens: list[int] = []  # row -> length of that match (0: none)

    def begin(self, prompts, prefill_hidden=None, max_len: int = 0) -> None:
        by_prompt: dict[tuple[int, ...], int] = {}
        self.indexes, self.groups, self.own, self.prompts = [], [], [], []
        for prompt in prompts:
            key = tuple(prompt)
            g = by_prompt.get(key)
            if g is None:
                g = by_prompt[key] = len(self.indexes)
                index = SuffixIndex(self.sizes)
                index.add(list(prompt))  # n-grams inside the prompt (its own lookup)
                for response in self.store.responses(list(prompt)):
                    index.add(list(prompt) + response, index_from=len(prompt))
                self.indexes.append(index)
            self.groups.append(g)
            # a row's own text, indexed as it streams in: n-grams ending in its output (the ones ending with its
            # prompt would crowd the earlier responses' out of MAX_OCCURRENCES before the row has written anything)
            self.own.append(self.indexes[g].add(list(prompt), index_from=len(prompt) + 1))
            self.prompts.append(list(prompt))
        self.pointers = [None] * len(prompts)
        self.match_lens = [0] * len(prompts)

    def observe(self, new_tokens, hidden=None) -> None:
        for b, toks in enumerate(new_tokens):
            if not toks:
                continue
            index = self.indexes[self.groups[b]]
            index.extend(self.own[b], toks)
            ptr = self.pointers[b]
            if ptr is not None:
                seq_id, end = ptr
                if index.seqs[seq_id][end : end + len(toks)] == toks:  # the policy emitted what the match predicted
                    self.pointers[b] = (seq_id, end + len(toks))
                    self.match_lens[b] += len(toks)
                    continue
            self.pointers[b], self.match_lens[b] = None, 0  # looked up again when it next drafts

    def keep_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()
        for name in ("groups", "own", "prompts", "pointers", "match_lens"):
            old = getattr(self, name)
            setattr(self, name, [old[j] for j in keep])

    def lookup(self, b: int, context: list[int], cap: int) -> list[int]:
        """Row b's draft of up to `cap` tokens (its match re-found when it has none or it predicts nothing)."""
        if cap <= 0:
            return []
        index = self.indexes[self.groups[b]]
        ptr = self.pointers[b]
        if ptr is None or ptr[1] >= len(index.seqs[ptr[0]]):
            found = index.find(context, cap)
            if found is None:
                self.pointers[b], self.match_lens[b] = None, 0
                return []
            seq_id, end, n = found
            longer = self.match_lens[b]  # the match just lost; at the longest n-gram it may hold here too
            if not (n == index.sizes[0] and end >= longer > n
                    and index.seqs[seq_id][end - longer : end] == context[-longer:]):
                longer = n
            ptr, self.pointers[b], self.match_lens[b] = (seq_id, end), (seq_id, end), longer
        if self.match_lens[b] < self.min_match:
            return []
        seq_id, end = ptr
        return index.seqs[seq_id][end : end + cap]

    def drafts(self, contexts: list[list[int]], caps: list[int]) -> list[list[int]]:
        return [self.lookup(b, c, cap) for b, (c, cap) in enumerate(zip(contexts, caps))]

    def propose(self, contexts, caps, sampling, uniforms, width=None) -> Proposal:
        return pad_proposal(self.drafts(contexts, caps), width=width)

    def tree_for(self, k: int, batch_size: int = 1) -> Tree | None:
        return self.trees.tree_for(k, batch_size)

    def continuations(self, b: int, context: list[int], cap: int) -> dict:
        """Row b's candidate continuations as a trie {token: [(longest n, count), subtrie]}: what followed each
        occurrence of the context's suffix n-grams, longest n first, up to TREE_MAX_OCCURRENCES occurrences. A
        branch ranks by the longest match behind it, then by how many occurrences took it (siblings vote)."""
        index, root, seen, longest = self.indexes[self.groups[b]], {}, set(), 0
        for n, where in index.matches(context):
            if len(seen) >= TREE_MAX_OCCURRENCES:
                break
            for seq_id, end in reversed(where):
                seq = index.seqs[seq_id]
                if end >= len(seq) or (seq_id, end) in seen:
                    continue
                seen.add((seq_id, end))
                longest = max(longest, n)
                node = root
                for t in seq[end : end + cap]:
                    cell = node.setdefault(t, [(n, 0), {}])
                    cell[0] = (max(cell[0][0], n), cell[0][1] + 1)
                    node = cell[1]
        self.match_lens[b] = longest
        return root if longest >= self.min_match else {}

    def propose_tree(self, contexts, caps, sampling, uniforms, tree: Tree) -> Proposal:
        """Each row's trie of continuations (`continuations`) laid on `tree`: a node of rank r is its parent's
        r-th best branch. The candidates are deterministic and distinct at each node (q one-hot), so the tree's
        recursive rejection sampling keeps the policy's distribution."""
        B, N = len(contexts), tree.num_nodes
        tokens, valid = [[0] * N for _ in range(B)], [[False] * N for _ in range(B)]

        def best_first(trie: dict) -> list:
            return sorted(trie.items(), key=lambda kv: kv[1][0], reverse=True)  # ties: the latest occurrence first

        for b, (context, cap) in enumerate(zip(contexts, caps)):
            ranked = {(): best_first(self.continuations(b, context, cap)) if cap > 0 else []}  # path -> branches
            for j, path in enumerate(tree.paths):  # parents before children
                branches = ranked.get(path[:-1])
                if not branches or len(path) > cap or path[-1] >= len(branches):
                    continue
                token, (_, sub) = branches[path[-1]]
                tokens[b][j], valid[b][j] = token, True
                if tree.has_children[j + 1]:
                    ranked[path] = best_first(sub)
        # host tensors, as pad_proposal's: the engine moves a proposal to the policy's device
        tok = torch.tensor(tokens, dtype=torch.long, device="cpu").view(B, N)
        ok = torch.tensor(valid, dtype=torch.bool, device="cpu").view(B, N)
        return Proposal(tok, ok.sum(1), None, ok)

    def remember(self, prompt: list[int], response: list[int]) -> None:
        """Keep a finished response for later batches of the same prompt (the store's budget applies)."""
        self.store.add(prompt, response)
