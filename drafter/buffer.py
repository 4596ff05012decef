"""Harvested rollouts for drafter training: a byte-bounded buffer and sequence packing.

A rollout x_0..x_{L-1} comes with h_0..h_{L-2}, the policy's final hidden state at each position
(h_j produced x_{j+1}). The draft head trains on pairs j = (h_j, x_{j+1}); pair j's targets are
h_{j+1} and x_{j+2}, so the last pair of a sequence has none.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass
class Rollout:
    tokens: torch.Tensor  # (L,) int32
    hidden: torch.Tensor  # (L-1, D) compact float (bf16 by default)
    policy_version: int
    num_prompt: int
    order: int  # insertion counter: evicts oldest first within a policy version

    @property
    def num_pairs(self) -> int:
        return self.hidden.shape[0]

    @property
    def num_bytes(self) -> int:
        return self.tokens.numel() * self.tokens.element_size() + self.hidden.numel() * self.hidden.element_size()


class RolloutBuffer:
    """Keeps the most recent rollouts within max_bytes: evicts the oldest policy version first."""

    def __init__(self, max_bytes: int, hidden_dtype: torch.dtype = torch.bfloat16,
                 max_policy_versions: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        if hidden_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"hidden_dtype must be bfloat16, float16 or float32, got {hidden_dtype}")
        if max_policy_versions is not None and max_policy_versions < 1:
            raise ValueError(f"max_policy_versions must be >= 1, got {max_policy_versions}")
        self.max_bytes, self.hidden_dtype, self.max_policy_versions = max_bytes, hidden_dtype, max_policy_versions
        self.rollouts: list[Rollout] = []
        self.num_bytes = 0
        self.hidden_size: int | None = None
        self._counter = 0

    def __len__(self) -> int:
        return len(self.rollouts)

    @property
    def num_tokens(self) -> int:
        """Training pairs held."""
        return sum(r.num_pairs for r in self.rollouts)

    @property
    def policy_versions(self) -> list[int]:
        return sorted({r.policy_version for r in self.rollouts})

    def add(self, tokens, hidden: torch.Tensor, policy_version: int, num_prompt: int = 0) -> None:
        tokens = torch.as_tensor(tokens).reshape(-1)
        if tokens.numel() < 2:
            raise ValueError(f"tokens must hold at least 2 ids, got {tokens.numel()}")
        if hidden.dim() != 2 or hidden.shape[0] != tokens.numel() - 1:
            raise ValueError(f"hidden must be (len(tokens) - 1, D) = ({tokens.numel() - 1}, D), "
                             f"got {tuple(hidden.shape)}")
        if self.hidden_size is not None and hidden.shape[1] != self.hidden_size:
            raise ValueError(f"hidden size {hidden.shape[1]} differs from the buffer's {self.hidden_size}")
        if not isinstance(policy_version, int) or policy_version < 0:
            raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
        if not 0 <= num_prompt <= tokens.numel():
            raise ValueError(f"num_prompt must be in [0, {tokens.numel()}], got {num_prompt}")
        r = Rollout(tokens.to(torch.int32).cpu().clone(), hidden.detach().to("cpu", self.hidden_dtype).clone(),
                    policy_version, num_prompt, self._counter)
        if r.num_bytes > self.max_bytes:
            raise ValueError(f"one rollout needs {r.num_bytes} bytes, more than max_bytes={self.max_bytes}")
        self._counter += 1
        self.hidden_size = hidden.shape[1]
        self.rollouts.append(r)
        self.num_bytes += r.num_bytes
        self._evict()

    def add_outputs(self, outputs, policy_version: int) -> None:
        """Add engine outputs generated with record_hidden=True. Without prompt hidden states, only
        the generated part is kept: tokens = [last prompt token] + generated."""
        for o in outputs:
            if o.hidden_states is None or not o.token_ids:
                raise ValueError("outputs need hidden states: generate with record_hidden=True")
            if o.prompt_hidden_states is not None:
                tokens = list(o.prompt_ids) + list(o.token_ids)
                hidden = torch.cat([o.prompt_hidden_states.to(o.hidden_states.dtype), o.hidden_states])
                num_prompt = len(o.prompt_ids)
            else:
                tokens, hidden, num_prompt = [o.prompt_ids[-1]] + list(o.token_ids), o.hidden_states, 1
            self.add(tokens, hidden, policy_version, num_prompt)

    def _evict(self) -> None:
        if self.max_policy_versions is not None:
            keep = set(self.policy_versions[-self.max_policy_versions :])
            self._remove([r for r in self.rollouts if r.policy_version not in keep])
        if self.num_bytes > self.max_bytes:
            victims, excess = [], self.num_bytes - self.max_bytes
            for r in sorted(self.rollouts, key=lambda r: (r.policy_version, r.order)):
                if excess <= 0:
                    break
                victims.append(r)
                excess -= r.num_bytes
            self._remove(victims)

    def _remove(self, victims: list[Rollout]) -> None:
        ids = {id(r) for r in victims}
        self.rollouts = [r for r in self.rollouts if id(r) not in ids]
        self.num_bytes = sum(r.num_bytes for r in self.rollouts)

    def drop_policy_versions_below(self, version: int) -> None:
        self._remove([r for r in self.rollouts if r.policy_version < version])

    def clear(self) -> None:
        self.rollouts, self.num_bytes = [], 0


@dataclass
class PackedBatch:
    feats: torch.Tensor  # (R, T, D) float32: h_j
    tokens: torch.Tensor  # (R, T) long: x_{j+1}
    positions: torch.Tensor  # (R, T) long: j, the pair's position in its own sequence
    seq_ids: torch.Tensor  # (R, T) long: segment id, unique in the batch; -1 = padding
    target_mask: torch.Tensor  # (R, T) bool: slot t+1 holds the same segment's next pair
    num_tokens: int  # real pairs
    num_sequences: int


def _segments(buffer: RolloutBuffer, max_len: int) -> list[tuple[Rollout, int, int]]:
    """(rollout, start, end) pair ranges; long sequences are cut into consecutive chunks of max_len
    (a chunk does not attend to the chunk before it)."""
    out = []
    for r in buffer.rollouts:
        for start in range(0, r.num_pairs, max_len):
            out.append((r, start, min(start + max_len, r.num_pairs)))
    return out


def iter_batches(buffer: RolloutBuffer, max_tokens_per_row: int, num_rows: int, shuffle: bool = True,
                 seed: int = 0) -> Iterator[PackedBatch]:
    """One epoch over the buffer: segments packed greedily into rows of <= max_tokens_per_row pairs."""
    if max_tokens_per_row < 1 or num_rows < 1:
        raise ValueError("max_tokens_per_row and num_rows must be >= 1")
    segs = _segments(buffer, max_tokens_per_row)
    if shuffle:
        random.Random(seed).shuffle(segs)
    rows: list[list[tuple[Rollout, int, int]]] = []
    current, used = [], 0
    for seg in segs:
        n = seg[2] - seg[1]
        if used + n > max_tokens_per_row:
            rows.append(current)
            current, used = [], 0
        current.append(seg)
        used += n
    if current:
        rows.append(current)
    for i in range(0, len(rows), num_rows):
        yield _pack(rows[i : i + num_rows], buffer.hidden_size or 0)


def _pack(rows: list[list[tuple[Rollout, int, int]]], hidden_size: int) -> PackedBatch:
    R = len(rows)
    T = max(sum(e - s for _, s, e in row) for row in rows)
    feats = torch.zeros(R, T, hidden_size)
    tokens = torch.zeros(R, T, dtype=torch.long)
    positions = torch.zeros(R, T, dtype=torch.long)
    seq_ids = torch.full((R, T), -1, dtype=torch.long)
    target = torch.zeros(R, T, dtype=torch.bool)
    seg_id = num_tokens = 0
    for b, row in enumerate(rows):
        t = 0
        for r, s, e in row:
            n = e - s
            feats[b, t : t + n] = r.hidden[s:e].float()
            tokens[b, t : t + n] = r.tokens[s + 1 : e + 1].long()
            positions[b, t : t + n] = torch.arange(s, e)
            seq_ids[b, t : t + n] = seg_id
            target[b, t : t + n - 1] = True
            seg_id, t, num_tokens = seg_id + 1, t + n, num_tokens + n
    return PackedBatch(feats, tokens, positions, seq_ids, target, num_tokens, seg_id)


def block_diagonal_causal_mask(seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(R, T) -> (R, 1, T, T) bool: True where a query may attend (same segment, not in the future)."""
    same = (seq_ids[:, :, None] == seq_ids[:, None, :]) & (seq_ids[:, :, None] >= 0)
    return (same & (positions[:, None, :] <= positions[:, :, None])).unsqueeze(1)
