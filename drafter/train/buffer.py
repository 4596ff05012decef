"""Harvested rollouts for drafter training: a byte-bounded buffer and sequence packing.

A rollout x_0..x_{L-1} comes with f_0..f_{L-2}, the policy's features at each position (f_j produced
x_{j+1}): drafter.model.causal_lm.draft_features, the three aux layers' states an EAGLE-3 head fuses, then the
final hidden state h_j (4D per position, in the buffer's hidden_dtype). The draft head trains on pairs
j = (f_j, x_{j+1}); pair j's targets are h_{j+1} and x_{j+2}, so the last pair of a sequence has none.
The buffer itself only checks that every rollout has the same feature width.
"""

from __future__ import annotations

import json
import random
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from drafter.train.checkpoint import save_file_atomic

HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float32 for exact tests; bf16/fp16 halve the bytes
TOKEN_DTYPE = torch.int32  # every vocabulary fits; half the bytes of int64
MAX_OPEN_ROWS = 64  # first-fit packing window: O(num_segments * 64) while rows still fill up


@dataclass(eq=False)  # tensors inside: compare by identity
class Rollout:
    tokens: torch.Tensor  # (L,) int32: x_0..x_{L-1}
    hidden: torch.Tensor  # (L-1, F) compact float: the features f_0..f_{L-2}
    policy_version: int
    num_prompt: int  # tokens[:num_prompt] came from the prompt
    order: int = 0  # insertion counter: evicts oldest first within a policy version

    @property
    def num_pairs(self) -> int:
        return self.hidden.shape[0]

    @property
    def num_bytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size() + self.hidden.numel() * self.hidden.element_size()


class RolloutBuffer:
    """Most recent rollouts within max_bytes. Eviction drops the oldest policy version first and, within
    a version, the oldest insertion; with max_policy_versions only the newest that many versions stay.
    A rollout of a version older than everything held may thus be evicted by its own add. Thread-safe."""

    def __init__(self, max_bytes: int, hidden_dtype: torch.dtype = torch.bfloat16,
                 max_policy_versions: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype must be one of {HIDDEN_DTYPES}, got {hidden_dtype}")
        if max_policy_versions is not None and max_policy_versions < 1:
            raise ValueError(f"max_policy_versions must be >= 1 or None, got {max_policy_versions}")
        self.max_bytes, self.hidden_dtype, self.max_policy_versions = max_bytes, hidden_dtype, max_policy_versions
        self.hidden_size: int | None = None  # F, the feature width, fixed by the first rollout while non-empty
        self._by_order: dict[int, Rollout] = {}  # insertion order
        self._by_version: dict[int, deque[Rollout]] = {}  # each deque in insertion order
        self._num_bytes = self._num_tokens = self._counter = 0
        self._read_through = -1  # the newest insertion a trainer has read (read_for_training)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._by_order)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_tokens(self) -> int:
        """Training pairs held."""
        return self._num_tokens

    @property
    def policy_versions(self) -> list[int]:
        return sorted(self._by_version)

    @property
    def rollouts(self) -> list[Rollout]:
        """A snapshot, oldest insertion first."""
        with self._lock:
            return list(self._by_order.values())

    def read_for_training(self) -> list[Rollout]:
        """A snapshot, oldest insertion first, for a trainer: every rollout in it counts as seen by training from
        now on (unread() leaves it out)."""
        with self._lock:
            self._read_through = self._counter - 1
            return list(self._by_order.values())

    def unread(self) -> list[Rollout]:
        """The rollouts added since a trainer last read the buffer, oldest first: data a draft trained on this
        buffer has not seen, which is what it can be scored on without flattering it."""
        with self._lock:
            return [r for r in self._by_order.values() if r.order > self._read_through]

    def add(self, tokens: Sequence[int] | torch.Tensor, hidden: torch.Tensor, policy_version: int,
            num_prompt: int = 0) -> None:
        """Copy one rollout in (tokens as int32, hidden as hidden_dtype, on CPU), then evict."""
        r = self._make(tokens, hidden, policy_version, num_prompt, self.hidden_size)
        with self._lock:
            self._insert(r)

    def add_outputs(self, outputs: Iterable, policy_version: int) -> int:
        """Add engine outputs generated with record_hidden=True (duck-typed GenerationOutput); returns the pairs
        added. With prompt_hidden_states the whole sequence is kept: tokens = prompt + generated. Without it only
        the generated pairs are: tokens = [last prompt token] + generated, hidden = hidden_states. Outputs with
        fewer than 2 tokens are skipped (no pair). All outputs are validated before any is added."""
        made: list[Rollout] = []
        hidden_size = self.hidden_size
        for i, o in enumerate(outputs):
            if o.hidden_states is None:
                raise ValueError(f"outputs[{i}].hidden_states is None: generate with record_hidden=True")
            if o.prompt_hidden_states is not None:
                tokens = list(o.prompt_ids) + list(o.token_ids)
                hidden = torch.cat([o.prompt_hidden_states.to(o.hidden_states), o.hidden_states])  # its dtype, device
                num_prompt = len(o.prompt_ids)
            else:
                if not o.prompt_ids:
                    raise ValueError(f"outputs[{i}].prompt_ids is empty")
                tokens, hidden, num_prompt = [o.prompt_ids[-1]] + list(o.token_ids), o.hidden_states, 1
            if len(tokens) < 2:
                continue
            made.append(self._make(tokens, hidden, policy_version, num_prompt, hidden_size))
            hidden_size = made[-1].hidden.shape[1]
        with self._lock:
            for r in made:  # all share one D, so a mismatch raises at the first, before anything is added
                self._insert(r)
        return sum(r.num_pairs for r in made)

    def save(self, path: str | Path) -> None:
        """Write every rollout to one safetensors file (atomically, as checkpoints are), e.g. to keep a
        warm start's harvest: generating it costs far more than training on it."""
        rollouts = self.rollouts
        if not rollouts:
            raise ValueError("the buffer is empty: nothing to save")
        index = [[r.tokens.numel(), r.policy_version, r.num_prompt] for r in rollouts]
        tensors = {"tokens": torch.cat([r.tokens for r in rollouts]), "hidden": torch.cat([r.hidden for r in rollouts])}
        save_file_atomic(path, tensors, {"kind": "rollouts", "index": json.dumps(index)})

    def load(self, path: str | Path) -> int:
        """Add the rollouts of a file written by save() (oldest first, evicting as add() does); returns
        how many were read. A file that is not such a file raises ValueError and adds nothing."""
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                meta = f.metadata() or {}
                if meta.get("kind") != "rollouts":
                    raise ValueError(f"{path}: not a saved rollout buffer")
                tokens, hidden = f.get_tensor("tokens"), f.get_tensor("hidden")
            index = json.loads(meta["index"])
        except (SafetensorError, OSError, KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: unreadable rollout file ({e})") from e
        if sum(n for n, _, _ in index) != tokens.numel() or sum(n - 1 for n, _, _ in index) != hidden.shape[0]:
            raise ValueError(f"{path}: its index does not match its tensors (truncated or edited?)")
        made, t, h = [], 0, 0
        for n, version, num_prompt in index:
            made.append(self._make(tokens[t : t + n], hidden[h : h + n - 1], version, num_prompt, self.hidden_size))
            t, h = t + n, h + n - 1
        with self._lock:
            for r in made:
                self._insert(r)
        return len(made)

    def clear(self) -> None:
        with self._lock:
            self._by_order.clear()
            self._by_version.clear()
            self._num_bytes = self._num_tokens = 0
            self.hidden_size = None

    def _make(self, tokens: Sequence[int] | torch.Tensor, hidden: torch.Tensor, policy_version: int,
              num_prompt: int, hidden_size: int | None) -> Rollout:
        """Validate and convert; raises ValueError naming the offending field."""
        tokens = torch.as_tensor(tokens, device="cpu")  # validated and stored on the CPU, as the buffer is
        if tokens.dim() != 1 or tokens.numel() < 2:
            raise ValueError(f"tokens must be 1-D with at least 2 ids, got shape {tuple(tokens.shape)}")
        if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
        if int(tokens.min()) < 0 or int(tokens.max()) > torch.iinfo(TOKEN_DTYPE).max:
            raise ValueError(f"tokens must be in [0, {torch.iinfo(TOKEN_DTYPE).max}]")
        L = tokens.numel()
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] != L - 1:
            got = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
            raise ValueError(f"hidden must be (len(tokens) - 1, D) = ({L - 1}, D), got {got}")
        if not hidden.dtype.is_floating_point:
            raise ValueError(f"hidden must be floating point, got {hidden.dtype}")
        if hidden_size is not None and hidden.shape[1] != hidden_size:
            raise ValueError(f"hidden size {hidden.shape[1]} differs from the buffer's {hidden_size}")
        if not isinstance(policy_version, int) or isinstance(policy_version, bool) or policy_version < 0:
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        if not 0 <= num_prompt <= L:
            raise ValueError(f"num_prompt must be in [0, {L}], got {num_prompt}")
        num_bytes = L * TOKEN_DTYPE.itemsize + hidden.numel() * self.hidden_dtype.itemsize
        if num_bytes > self.max_bytes:
            raise ValueError(f"one rollout needs {num_bytes} bytes, more than max_bytes={self.max_bytes}")
        hidden = hidden.detach().to("cpu", self.hidden_dtype, copy=True)
        return Rollout(tokens.to("cpu", TOKEN_DTYPE, copy=True), hidden, policy_version, num_prompt)

    def _insert(self, r: Rollout) -> None:
        """Caller holds the lock."""
        if self.hidden_size is not None and r.hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden size {r.hidden.shape[1]} differs from the buffer's {self.hidden_size}")
        r.order, self._counter = self._counter, self._counter + 1
        self.hidden_size = r.hidden.shape[1]
        self._by_order[r.order] = r
        self._by_version.setdefault(r.policy_version, deque()).append(r)
        self._num_bytes += r.num_bytes
        self._num_tokens += r.num_pairs
        if self.max_policy_versions is not None:
            for v in sorted(self._by_version)[: -self.max_policy_versions]:
                self._drop_version(v)
        while self._num_bytes > self.max_bytes:
            oldest = min(self._by_version)
            victim = self._by_version[oldest].popleft()
            if not self._by_version[oldest]:
                del self._by_version[oldest]
            self._forget(victim)

    def _drop_version(self, version: int) -> None:
        for r in self._by_version.pop(version):
            self._forget(r)

    def _forget(self, r: Rollout) -> None:
        del self._by_order[r.order]
        self._num_bytes -= r.num_bytes
        self._num_tokens -= r.num_pairs
        if not self._by_order:
            self.hidden_size = None


@dataclass(eq=False)  # tensors inside: compare by identity
class PackedBatch:
    # (R, T, F) f_j, the policy's features at pair j, in the buffer's dtype (bf16: half the bytes to pack and move;
    # PackedBatch.to and draft_loss convert them where they are computed)
    feats: torch.Tensor
    tokens: torch.Tensor  # (R, T) long: x_{j+1}
    positions: torch.Tensor  # (R, T) long: j, the pair's position in its own sequence
    seq_ids: torch.Tensor  # (R, T) long: segment id, unique in the batch; -1 = padding
    target_mask: torch.Tensor  # (R, T) bool: slot t+1 holds the same segment's next pair
    seg_start: torch.Tensor  # (R, T) long: position of the segment's first pair (a chain cannot reach before it)
    num_tokens: int  # real pairs
    num_sequences: int  # segments (a chunk of a long sequence counts as one)
    # (R, T) long: the first pair of the slot's rollout a decoding chain can start at, num_prompt - 1 (the policy
    # emits the first response token from the prompt's last pair, and drafting starts there: no draft ever guesses
    # prompt tokens); None: every pair (batches built by hand)
    response_start: torch.Tensor | None = None

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> PackedBatch:
        """The batch on `device` (the head's that trains or scores on it), features in `dtype` (None: as they
        are): batches are packed on the CPU, where the buffer lives, and moved once, whole."""
        def move(t: torch.Tensor, to: torch.dtype | None = None) -> torch.Tensor:
            # non_blocking: from pageable memory the copy is staged at once, and the stream is not synchronized
            return t.to(device, to or t.dtype, non_blocking=True)

        return PackedBatch(move(self.feats, dtype), move(self.tokens), move(self.positions), move(self.seq_ids),
                           move(self.target_mask), move(self.seg_start), self.num_tokens, self.num_sequences,
                           None if self.response_start is None else move(self.response_start))


@dataclass(eq=False)  # tensors inside: compare by identity
class _Segment:
    rollout: Rollout
    start: int  # first pair
    end: int  # one past the last pair


@dataclass(eq=False)  # open_rows.remove must find this row, not an equal-looking one
class _Row:
    segments: list[_Segment] = field(default_factory=list)
    num_tokens: int = 0


def iter_batches(buffer: RolloutBuffer | Sequence[Rollout], max_tokens_per_row: int, num_rows: int,
                 shuffle: bool = True, seed: int = 0) -> Iterator[PackedBatch]:
    """One epoch over a snapshot of the buffer: every pair appears exactly once.

    Sequences (in a seeded shuffle, or insertion order) are packed first-fit into rows of at most
    max_tokens_per_row pairs; num_rows rows make a batch (the last may have fewer), padded to its longest row.
    A sequence with more pairs than max_tokens_per_row is cut into consecutive chunks, each its own segment with
    positions continuing from the original sequence; a chunk cannot attend to the chunk before it, and the last
    pair of a non-final chunk gets no target. Deterministic for a given buffer content and seed.
    """
    if max_tokens_per_row < 1:
        raise ValueError(f"max_tokens_per_row must be >= 1, got {max_tokens_per_row}")
    if num_rows < 1:
        raise ValueError(f"num_rows must be >= 1, got {num_rows}")
    rollouts = list(buffer) if isinstance(buffer, list | tuple) else buffer.rollouts
    hidden_size = rollouts[0].hidden.shape[1] if rollouts else 0
    segments = [_Segment(r, s, min(s + max_tokens_per_row, r.num_pairs))
                for r in rollouts for s in range(0, r.num_pairs, max_tokens_per_row)]
    if shuffle:
        random.Random(seed).shuffle(segments)
    rows: list[_Row] = []
    open_rows: list[_Row] = []  # rows with room, oldest first; at most MAX_OPEN_ROWS
    for seg in segments:
        n = seg.end - seg.start
        row = next((row for row in open_rows if row.num_tokens + n <= max_tokens_per_row), None)
        if row is None:
            row = _Row()
            rows.append(row)
            open_rows.append(row)
            if len(open_rows) > MAX_OPEN_ROWS:
                open_rows.pop(0)
        row.segments.append(seg)
        row.num_tokens += n
        if row.num_tokens == max_tokens_per_row:
            open_rows.remove(row)
    for i in range(0, len(rows), num_rows):
        yield _pack(rows[i : i + num_rows], hidden_size)


def _pack(rows: list[_Row], hidden_size: int) -> PackedBatch:
    """Packed on the CPU, where the rollouts are (PackedBatch.to moves a batch to its head's device)."""
    R, T = len(rows), max(row.num_tokens for row in rows)
    cpu = torch.device("cpu")
    dtype = rows[0].segments[0].rollout.hidden.dtype  # the buffer's (bf16): converted where the batch goes, once
    feats = torch.zeros(R, T, hidden_size, dtype=dtype, device=cpu)
    tokens = torch.zeros(R, T, dtype=torch.long, device=cpu)
    positions = torch.zeros(R, T, dtype=torch.long, device=cpu)
    seq_ids = torch.full((R, T), -1, dtype=torch.long, device=cpu)
    target_mask = torch.zeros(R, T, dtype=torch.bool, device=cpu)
    seg_start = torch.zeros(R, T, dtype=torch.long, device=cpu)
    response_start = torch.zeros(R, T, dtype=torch.long, device=cpu)
    num_segments = num_tokens = 0
    for b, row in enumerate(rows):
        t = 0
        for seg in row.segments:
            s, e, n = seg.start, seg.end, seg.end - seg.start
            feats[b, t : t + n] = seg.rollout.hidden[s:e]
            tokens[b, t : t + n] = seg.rollout.tokens[s + 1 : e + 1].long()
            positions[b, t : t + n] = torch.arange(s, e, device=cpu)
            seq_ids[b, t : t + n] = num_segments
            target_mask[b, t : t + n - 1] = True
            seg_start[b, t : t + n] = s
            response_start[b, t : t + n] = max(seg.rollout.num_prompt - 1, 0)
            num_segments, num_tokens, t = num_segments + 1, num_tokens + n, t + n
    return PackedBatch(feats, tokens, positions, seq_ids, target_mask, seg_start, num_tokens, num_segments,
                       response_start)
