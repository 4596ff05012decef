"""Rollout buffer accounting and eviction, and sequence packing."""

from __future__ import annotations

import pytest
import torch

from drafter.buffer import RolloutBuffer, block_diagonal_causal_mask, iter_batches

D = 4


def rollout(length: int, fill: float = 0.0):
    return list(range(length)), torch.full((length - 1, D), fill)


def test_byte_accounting_uses_compact_dtypes():
    buf = RolloutBuffer(max_bytes=1 << 20)
    buf.add(*rollout(10), policy_version=0)
    assert buf.num_bytes == 10 * 4 + 9 * D * 2  # int32 tokens, bf16 hidden
    assert buf.rollouts[0].hidden.dtype == torch.bfloat16 and buf.num_tokens == 9


def test_eviction_drops_oldest_policy_version_first_then_oldest_insertion():
    per = 10 * 4 + 9 * D * 2
    buf = RolloutBuffer(max_bytes=3 * per)
    buf.add(*rollout(10, 1.0), policy_version=1)
    buf.add(*rollout(10, 0.0), policy_version=0)
    buf.add(*rollout(10, 2.0), policy_version=1)
    buf.add(*rollout(10, 3.0), policy_version=2)  # over budget: version 0 goes
    assert [r.policy_version for r in buf.rollouts] == [1, 1, 2]
    buf.add(*rollout(10, 4.0), policy_version=2)  # then the older of the two version-1 rollouts
    assert [float(r.hidden[0, 0]) for r in buf.rollouts] == [2.0, 3.0, 4.0]
    assert buf.num_bytes <= 3 * per


def test_max_policy_versions_and_drop():
    buf = RolloutBuffer(max_bytes=1 << 20, max_policy_versions=2)
    for v in range(4):
        buf.add(*rollout(5), policy_version=v)
    assert buf.policy_versions == [2, 3]
    buf.drop_policy_versions_below(3)
    assert buf.policy_versions == [3]


@pytest.mark.parametrize(("args", "field"), [
    ((list(range(5)), torch.zeros(3, D), 0), "hidden"),
    (([1], torch.zeros(0, D), 0), "tokens"),
    ((list(range(5)), torch.zeros(4, D), -1), "policy_version"),
    ((list(range(500)), torch.zeros(499, D), 0), "max_bytes"),
])
def test_bad_rollouts_are_rejected_and_change_nothing(args, field):
    buf = RolloutBuffer(max_bytes=2000)
    buf.add(*rollout(5), policy_version=0)
    with pytest.raises(ValueError, match=field):
        buf.add(*args)
    assert len(buf) == 1 and buf.num_bytes == 5 * 4 + 4 * D * 2


def test_packing_covers_every_pair_once_within_row_limits():
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    lengths = [5, 9, 3, 30, 12, 7]
    for i, n in enumerate(lengths):
        buf.add(list(range(100 * i, 100 * i + n)), torch.arange((n - 1) * D, dtype=torch.float32).view(n - 1, D) + i,
                policy_version=0)
    seen = []
    for batch in iter_batches(buf, max_tokens_per_row=10, num_rows=2, seed=3):
        assert batch.tokens.shape[1] <= 10 and batch.tokens.shape[0] <= 2
        real = batch.seq_ids >= 0
        seen += batch.tokens[real].tolist()
        for r in range(batch.tokens.shape[0]):
            for t in range(batch.tokens.shape[1] - 1):
                same_next = bool(real[r, t]) and batch.seq_ids[r, t] == batch.seq_ids[r, t + 1]
                assert bool(batch.target_mask[r, t]) == same_next
                if same_next:
                    assert batch.positions[r, t + 1] == batch.positions[r, t] + 1
                    assert batch.tokens[r, t + 1] == batch.tokens[r, t] + 1
    expected = [100 * i + j for i, n in enumerate(lengths) for j in range(1, n)]
    assert sorted(seen) == sorted(expected)  # x_{j+1} of every pair, once


def test_long_sequence_is_chunked_with_continuing_positions():
    buf = RolloutBuffer(max_bytes=1 << 20)
    buf.add(*rollout(26), policy_version=0)  # 25 pairs -> chunks of 10, 10, 5
    batch = next(iter_batches(buf, max_tokens_per_row=10, num_rows=4, shuffle=False))
    assert batch.num_sequences == 3 and batch.num_tokens == 25
    assert batch.positions[1, 0] == 10 and batch.positions[2, 4] == 24


def test_batches_are_deterministic_per_seed():
    buf = RolloutBuffer(max_bytes=1 << 20)
    for n in range(3, 20):
        buf.add(*rollout(n, float(n)), policy_version=0)

    def order(seed):
        return [b.feats[:, 0, 0].tolist() for b in iter_batches(buf, 12, 1, seed=seed)]

    assert order(1) == order(1) and order(1) != order(2)


def test_block_diagonal_causal_mask():
    seq = torch.tensor([[0, 0, 0, 1, 1, -1]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    m = block_diagonal_causal_mask(seq, pos)[0, 0]
    assert m[2].tolist() == [True, True, True, False, False, False]
    assert m[4].tolist() == [False, False, False, True, True, False]
    assert m[1, 2].item() is False and not m[5].any()
