"""Rollout buffer accounting, eviction and validation; sequence packing and its attention mask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from drafter.train.buffer import RolloutBuffer, iter_batches

D = 4
PER = 10 * 4 + 9 * D * 2  # bytes of a 10-token rollout: int32 tokens, bf16 hidden


def rollout(length: int, fill: float = 0.0):
    return list(range(length)), torch.full((length - 1, D), fill)


def numbered(buf: RolloutBuffer, lengths: list[int], version: int = 0) -> None:
    """Rollout i has tokens 100i.. and hidden rows whose first value is 1000i + j (float32 buffers: exact)."""
    for i, n in enumerate(lengths):
        hidden = torch.zeros(n - 1, D)
        hidden[:, 0] = 1000 * i + torch.arange(n - 1)
        buf.add(list(range(100 * i, 100 * i + n)), hidden, policy_version=version)


def test_unread_holds_what_arrived_since_a_trainer_last_read_the_buffer():
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    numbered(buf, [5, 6])
    assert [r.num_pairs for r in buf.unread()] == [4, 5]  # nothing read yet
    assert [r.num_pairs for r in buf.read_for_training()] == [4, 5]
    assert buf.unread() == []
    numbered(buf, [7], version=1)
    assert [r.num_pairs for r in buf.unread()] == [6]
    buf.clear()
    assert buf.unread() == []


def test_byte_accounting_uses_compact_dtypes():
    buf = RolloutBuffer(max_bytes=1 << 20)
    buf.add(*rollout(10), policy_version=0)
    buf.add(torch.arange(5), torch.zeros(4, D, dtype=torch.float64), policy_version=0, num_prompt=2)
    assert buf.num_bytes == PER + 5 * 4 + 4 * D * 2 == sum(r.num_bytes for r in buf.rollouts)
    r = buf.rollouts[0]
    assert r.hidden.dtype == torch.bfloat16 and r.tokens.dtype == torch.int32
    assert len(buf) == 2 and buf.num_tokens == 9 + 4 and buf.rollouts[1].num_prompt == 2
    half = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float16)
    half.add(*rollout(10), policy_version=0)
    assert half.num_bytes == PER and half.rollouts[0].hidden.dtype == torch.float16


def test_add_copies_its_inputs():
    tokens, hidden = torch.arange(4), torch.ones(3, D)
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    buf.add(tokens, hidden, policy_version=0)
    tokens[0], hidden[0, 0] = 7, 5.0
    assert buf.rollouts[0].tokens[0] == 0 and buf.rollouts[0].hidden[0, 0] == 1.0


def test_eviction_drops_oldest_policy_version_first_then_oldest_insertion():
    buf = RolloutBuffer(max_bytes=3 * PER)
    buf.add(*rollout(10, 1.0), policy_version=1)
    buf.add(*rollout(10, 0.0), policy_version=0)
    buf.add(*rollout(10, 2.0), policy_version=1)
    buf.add(*rollout(10, 3.0), policy_version=2)  # over budget: version 0 goes, though inserted later
    assert [r.policy_version for r in buf.rollouts] == [1, 1, 2]
    buf.add(*rollout(10, 4.0), policy_version=2)  # then the older of the two version-1 rollouts
    assert [float(r.hidden[0, 0]) for r in buf.rollouts] == [2.0, 3.0, 4.0]
    assert buf.num_bytes == 3 * PER and buf.num_tokens == 27 and buf.policy_versions == [1, 2]
    buf.add(*rollout(10, 5.0), policy_version=0)  # older than all held: evicted by its own add
    assert [float(r.hidden[0, 0]) for r in buf.rollouts] == [2.0, 3.0, 4.0]


def test_one_add_may_evict_several():
    buf = RolloutBuffer(max_bytes=3 * PER)
    for v in range(3):
        buf.add(*rollout(10), policy_version=v)
    buf.add(*rollout(15), policy_version=3)  # 60 + 14*8 = 172 bytes: needs two of the 112-byte rollouts gone
    assert buf.policy_versions == [2, 3] and buf.num_bytes == PER + 15 * 4 + 14 * D * 2


def test_max_policy_versions_drop_and_clear():
    buf = RolloutBuffer(max_bytes=1 << 20, max_policy_versions=2)
    for v in [0, 1, 3, 2, 1]:
        buf.add(*rollout(5), policy_version=v)
    assert buf.policy_versions == [2, 3] and len(buf) == 2
    buf.add(*rollout(5), policy_version=4)  # a newer version evicts the oldest held, with its bytes and tokens
    assert buf.policy_versions == [3, 4] and buf.num_tokens == 8 and buf.num_bytes == 2 * (5 * 4 + 4 * D * 2)
    buf.clear()
    assert len(buf) == 0 and buf.num_bytes == 0 and buf.num_tokens == 0 and buf.policy_versions == []
    buf.add(list(range(3)), torch.zeros(2, D + 1), policy_version=0)  # empty again: a new D is accepted
    assert buf.hidden_size == D + 1


@pytest.mark.parametrize(("args", "kwargs", "field"), [
    ((list(range(5)), torch.zeros(3, D), 0), {}, "hidden must be"),
    ((list(range(5)), torch.zeros(4 * D), 0), {}, "hidden must be"),
    ((list(range(5)), torch.zeros(4, D, dtype=torch.long), 0), {}, "hidden must be floating"),
    ((list(range(5)), torch.zeros(4, D + 1), 0), {}, "hidden size"),
    (([1], torch.zeros(0, D), 0), {}, "tokens"),
    ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(5, D), 0), {}, "tokens"),
    ((torch.arange(5.0), torch.zeros(4, D), 0), {}, "tokens must be integer"),
    (([0, 1, -2], torch.zeros(2, D), 0), {}, "tokens must be in"),
    ((list(range(5)), torch.zeros(4, D), -1), {}, "policy_version"),
    ((list(range(5)), torch.zeros(4, D), 1.0), {}, "policy_version"),
    ((list(range(5)), torch.zeros(4, D), True), {}, "policy_version"),
    ((list(range(5)), torch.zeros(4, D), 0), {"num_prompt": 6}, "num_prompt"),
    ((list(range(500)), torch.zeros(499, D), 0), {}, "max_bytes"),
])
def test_bad_rollouts_are_rejected_and_change_nothing(args, kwargs, field):
    buf = RolloutBuffer(max_bytes=2000)
    buf.add(*rollout(5), policy_version=0)
    with pytest.raises(ValueError, match=field):
        buf.add(*args, **kwargs)
    assert len(buf) == 1 and buf.num_bytes == 5 * 4 + 4 * D * 2 and buf.num_tokens == 4


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"max_bytes": 0}, "max_bytes"),
    ({"max_bytes": 100, "hidden_dtype": torch.int8}, "hidden_dtype"),
    ({"max_bytes": 100, "max_policy_versions": 0}, "max_policy_versions"),
])
def test_bad_buffer_settings_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RolloutBuffer(**kwargs)


def output(prompt: list[int], generated: list[int], with_prompt_hidden: bool = True, start: float = 0.0):
    """A GenerationOutput look-alike whose state at sequence position j is start + j."""
    P, N = len(prompt), len(generated)
    states = (start + torch.arange(P + N - 1, dtype=torch.float32))[:, None].expand(-1, D)
    return SimpleNamespace(prompt_ids=prompt, token_ids=generated, hidden_states=states[P - 1 :],
                           prompt_hidden_states=states[: P - 1] if with_prompt_hidden else None)


def test_add_outputs_with_and_without_prompt_hidden_states():
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    num_pairs = buf.add_outputs([output([5, 6, 7], [8, 9]), output([5, 6, 7], [8, 9], with_prompt_hidden=False),
                                 output([5, 6, 7], [], with_prompt_hidden=False)], policy_version=3)  # last: no pair
    assert num_pairs == 4 + 2 and len(buf) == 2 and buf.policy_versions == [3]
    full, generated = buf.rollouts
    assert full.tokens.tolist() == [5, 6, 7, 8, 9] and full.hidden[:, 0].tolist() == [0, 1, 2, 3]
    assert full.num_prompt == 3
    assert generated.tokens.tolist() == [7, 8, 9] and generated.hidden[:, 0].tolist() == [2, 3]
    assert generated.num_prompt == 1


def test_add_outputs_is_all_or_nothing():
    buf = RolloutBuffer(max_bytes=1 << 20)
    bad = output([1, 2], [3, 4])
    bad.hidden_states = bad.hidden_states[:1]
    with pytest.raises(ValueError, match="hidden"):
        buf.add_outputs([output([1, 2], [3]), bad], policy_version=0)
    no_hidden = SimpleNamespace(prompt_ids=[1], token_ids=[2], hidden_states=None, prompt_hidden_states=None)
    with pytest.raises(ValueError, match=r"outputs\[0\].hidden_states"):
        buf.add_outputs([no_hidden], policy_version=0)
    assert len(buf) == 0 and buf.num_bytes == 0


def test_packing_hand_built_example():
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    numbered(buf, [4, 3, 5])  # 3, 2 and 4 pairs
    (batch,) = iter_batches(buf, max_tokens_per_row=5, num_rows=2, shuffle=False)
    # first fit: row 0 = A(3) + B(2), full; C(4) opens row 1 and leaves one padding slot
    assert batch.tokens.tolist() == [[1, 2, 3, 101, 102], [201, 202, 203, 204, 0]]
    assert batch.feats[..., 0].tolist() == [[0, 1, 2, 1000, 1001], [2000, 2001, 2002, 2003, 0]]
    assert batch.feats.dtype == torch.float32 and batch.feats.shape == (2, 5, D)
    assert batch.positions.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert batch.seq_ids.tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, -1]]
    assert batch.target_mask.tolist() == [[True, True, False, True, False], [True, True, True, False, False]]
    assert batch.num_tokens == 9 and batch.num_sequences == 3


def test_packing_covers_every_pair_once_within_row_limits():
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    lengths = [5, 9, 3, 30, 12, 7, 2, 11, 4, 4]
    numbered(buf, lengths)
    seen, num_tokens = [], 0
    batches = list(iter_batches(buf, max_tokens_per_row=10, num_rows=2, seed=3))
    for batch in batches:
        R, T = batch.tokens.shape
        assert T <= 10 and R <= 2
        real = batch.seq_ids >= 0
        assert (real.sum(1) <= 10).all() and int(real.sum()) == batch.num_tokens
        seen += batch.feats[..., 0][real].tolist()
        num_tokens += batch.num_tokens
        for r in range(R):
            for t in range(T - 1):
                same_next = bool(real[r, t]) and batch.seq_ids[r, t] == batch.seq_ids[r, t + 1]
                assert bool(batch.target_mask[r, t]) == same_next
                if same_next:
                    assert batch.positions[r, t + 1] == batch.positions[r, t] + 1
                    assert batch.tokens[r, t + 1] == batch.tokens[r, t] + 1
            assert not batch.target_mask[r, T - 1]
    assert all(b.tokens.shape[0] == 2 for b in batches[:-1])
    expected = [1000 * i + j for i, n in enumerate(lengths) for j in range(n - 1)]
    assert sorted(seen) == sorted(expected) and num_tokens == buf.num_tokens  # each pair exactly once


def test_long_sequence_is_chunked_with_continuing_positions():
    buf = RolloutBuffer(max_bytes=1 << 20)
    buf.add(*rollout(26), policy_version=0)  # 25 pairs -> chunks of 10, 10, 5
    (batch,) = iter_batches(buf, max_tokens_per_row=10, num_rows=4, shuffle=False)
    assert batch.num_sequences == 3 and batch.num_tokens == 25 and batch.tokens.shape == (3, 10)
    assert batch.positions[:, 0].tolist() == [0, 10, 20] and batch.positions[2, :5].tolist() == [20, 21, 22, 23, 24]
    assert batch.tokens[1].tolist() == list(range(11, 21))  # x_{j+1}
    assert batch.seq_ids[:, 0].tolist() == [0, 1, 2] and (batch.seq_ids[2, 5:] == -1).all()
    assert batch.target_mask.sum(1).tolist() == [9, 9, 4]  # each chunk's last pair loses its target


def test_packing_marks_where_each_segment_starts():
    buf = RolloutBuffer(max_bytes=1 << 20)
    buf.add(*rollout(6), policy_version=0)  # 5 pairs
    buf.add(*rollout(26), policy_version=0)  # 25 pairs -> chunks of 10, 10, 5
    (batch,) = iter_batches(buf, max_tokens_per_row=10, num_rows=4, shuffle=False)
    real = batch.seq_ids >= 0
    firsts = [(int(batch.seg_start[r, t]), int(batch.positions[r, t])) for r in range(batch.seq_ids.shape[0])
              for t in range(10) if real[r, t] and (t == 0 or batch.seq_ids[r, t] != batch.seq_ids[r, t - 1])]
    assert sorted(firsts) == [(0, 0), (0, 0), (10, 10), (20, 20)]  # a chunk's chains start inside it
    for r in range(batch.seq_ids.shape[0]):
        for t in range(1, 10):
            if real[r, t] and batch.seq_ids[r, t] == batch.seq_ids[r, t - 1]:
                assert batch.seg_start[r, t] == batch.seg_start[r, t - 1]


def test_batches_are_deterministic_per_seed():
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    numbered(buf, list(range(3, 20)))

    def order(seed):
        return [b.feats[..., 0].tolist() for b in iter_batches(buf, 12, 2, seed=seed)]

    assert order(1) == order(1) and order(1) != order(2)
    unshuffled = [b.feats[..., 0].tolist() for b in iter_batches(buf, 12, 2, shuffle=False, seed=1)]
    assert unshuffled == [b.feats[..., 0].tolist() for b in iter_batches(buf, 12, 2, shuffle=False, seed=2)]


def test_empty_buffer_and_bad_arguments():
    buf = RolloutBuffer(max_bytes=1 << 20)
    assert list(iter_batches(buf, 8, 2)) == []
    with pytest.raises(ValueError, match="max_tokens_per_row"):
        next(iter_batches(buf, 0, 2))
    with pytest.raises(ValueError, match="num_rows"):
        next(iter_batches(buf, 8, 0))


def block_diagonal_causal_mask(seq_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The attention a packed row allows, as SDPA's attn_mask (drafter.train.unroll builds it, step 0, inline): (R, T),
    (R, T) -> (R, 1, T, T) bool, True where query t may attend key u, i.e. same segment and positions[u] <=
    positions[t]. A padding slot attends only to itself, so that no query row is fully masked."""
    R, T = seq_ids.shape
    same = (seq_ids[:, :, None] == seq_ids[:, None, :]) & (seq_ids[:, :, None] >= 0)  # (R, Tq, Tk)
    causal = positions[:, None, :] <= positions[:, :, None]  # (R, Tq, Tk)
    padding_self = torch.eye(T, dtype=torch.bool) & (seq_ids < 0)[:, :, None]  # (R, Tq, Tk)
    return ((same & causal) | padding_self).unsqueeze(1)  # (R, 1, Tq, Tk)


def test_block_diagonal_causal_mask():
    seq = torch.tensor([[0, 0, 0, 1, 1, -1]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = block_diagonal_causal_mask(seq, pos)
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    T, F_ = True, False
    assert mask[0, 0].tolist() == [
        [T, F_, F_, F_, F_, F_],
        [T, T, F_, F_, F_, F_],
        [T, T, T, F_, F_, F_],
        [F_, F_, F_, T, F_, F_],
        [F_, F_, F_, T, T, F_],
        [F_, F_, F_, F_, F_, T],  # padding sees only itself: no fully masked row
    ]


def test_mask_isolates_packed_sequences_under_sdpa():
    buf = RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    torch.manual_seed(0)
    for n in [4, 3, 5]:
        buf.add(list(range(n)), torch.randn(n - 1, D), policy_version=0)
    (batch,) = iter_batches(buf, max_tokens_per_row=5, num_rows=2, shuffle=False)
    x = batch.feats.unsqueeze(1)  # (R, 1, T, D): one head, q = k = v
    out = F.scaled_dot_product_attention(x, x, x, attn_mask=block_diagonal_causal_mask(batch.seq_ids, batch.positions))
    assert torch.isfinite(out).all()
    for r, (s, e) in [(0, (0, 3)), (0, (3, 5)), (1, (0, 4))]:
        alone = x[r : r + 1, :, s:e]
        expected = F.scaled_dot_product_attention(alone, alone, alone, is_causal=True)
        torch.testing.assert_close(out[r : r + 1, :, s:e], expected)


def test_save_and_load_round_trip(tmp_path):
    buf = RolloutBuffer(max_bytes=1 << 20)
    numbered(buf, [5, 3, 9], version=2)
    buf.add(list(range(4)), torch.randn(3, D), policy_version=3, num_prompt=2)
    path = tmp_path / "harvest.safetensors"
    buf.save(path)
    back = RolloutBuffer(max_bytes=1 << 20)
    assert back.load(path) == 4
    assert len(back) == 4 and back.num_bytes == buf.num_bytes and back.policy_versions == [2, 3]
    for a, b in zip(buf.rollouts, back.rollouts):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.hidden, b.hidden)
        assert (a.policy_version, a.num_prompt) == (b.policy_version, b.num_prompt)
    with pytest.raises(ValueError, match="empty"):
        RolloutBuffer(max_bytes=1 << 20).save(tmp_path / "empty.safetensors")


def test_load_rejects_a_broken_file_and_adds_nothing(tmp_path):
    buf = RolloutBuffer(max_bytes=1 << 20)
    numbered(buf, [5, 6])
    path = tmp_path / "harvest.safetensors"
    buf.save(path)
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 10])
    (tmp_path / "junk.safetensors").write_bytes(b"not a file at all")
    for name in ("cut", "junk"):
        target = RolloutBuffer(max_bytes=1 << 20)
        with pytest.raises(ValueError, match=name):
            target.load(tmp_path / f"{name}.safetensors")
        assert len(target) == 0


def test_response_only_chains_start_at_the_prompts_last_pair_and_keep_the_prompt_as_context():
    from drafter.train.buffer import Rollout
    from drafter.train.unroll import loss_mask

    lengths, prompts = (40, 25, 300), (10, 1, 30)  # the 300-token one is cut into chunks of 128 pairs
    rollouts = [Rollout(torch.arange(n, dtype=torch.int32), torch.randn(n - 1, 8), 0, p)
                for n, p in zip(lengths, prompts)]
    batches = list(iter_batches(rollouts, 128, 8, shuffle=False))
    assert len(batches) == 1
    batch = batches[0]
    # pairs j = 0..L-2, the last of each chunk without a target; a response root j >= num_prompt - 1
    everywhere, responses = loss_mask(batch, 0), loss_mask(batch, 0, response_only=True)
    assert int(everywhere.sum()) == (40 - 2) + (25 - 2) + (299 - 3)  # three chunks: three last pairs
    assert int(responses.sum()) == int(everywhere.sum()) - (10 - 1) - (30 - 1)
    assert bool((batch.positions[:, :-1][responses] >= batch.response_start[:, :-1][responses]).all())
    for s in (1, 3):  # step s trains pair j only if its chain's root j - s is a response root
        roots, trained = batch.positions[:, :-1] - s, loss_mask(batch, s, response_only=True)
        assert bool((roots[trained] >= batch.response_start[:, :-1][trained]).all())
        assert int(loss_mask(batch, s, True).sum()) < int(loss_mask(batch, s).sum())
