"""The RL policy's checkpoint: a round trip restores the policy and its optimizer exactly (the next update
is bit-identical), and a broken or foreign file is refused by name."""

from __future__ import annotations

import pytest
import torch

from drafter.model.loading import load_model
from drafter.train.checkpoint import CheckpointError, DraftMeta, save_draft
from workers.policy_checkpoint import (
    has_policy_checkpoint,
    load_policy,
    policy_checkpoint_path,
    remove_policy_checkpoints,
    save_policy,
)


def trained(seed: int = 0):
    torch.manual_seed(seed)
    policy = load_model("tiny").model.requires_grad_(True)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    return policy, opt


def update(policy, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, policy.cfg.vocab_size, (2, 12), generator=g)
    positions = torch.arange(12).expand(2, 12)
    logits, _ = policy(ids, positions, None)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_a_round_trip_resumes_bit_identically(tmp_path):
    policy, opt = trained()
    update(policy, opt, 1)
    path = policy_checkpoint_path(tmp_path, "job1")
    assert not has_policy_checkpoint(tmp_path, "job1")
    save_policy(path, policy, opt, rl_step=4, policy_version=5)
    assert has_policy_checkpoint(tmp_path, "job1")
    fresh, fresh_opt = trained(seed=7)  # other weights, an optimizer with no state yet
    assert load_policy(path, fresh, fresh_opt) == (4, 5)
    update(policy, opt, 2)
    update(fresh, fresh_opt, 2)  # the optimizer's moments came back too
    for (name, a), b in zip(policy.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    remove_policy_checkpoints(tmp_path, "job1")
    assert not has_policy_checkpoint(tmp_path, "job1")


def test_a_corrupt_or_foreign_file_is_refused_by_name(tmp_path):
    policy, opt = trained()
    path = policy_checkpoint_path(tmp_path, "job1")
    save_policy(path, policy, opt, rl_step=0, policy_version=1)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF  # a flipped bit in the last tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_policy(path, policy, opt)
    draft = tmp_path / "draft.safetensors"
    save_draft(draft, {"w": torch.zeros(2)}, DraftMeta(version=1, parent_version=0, policy_version=0))
    with pytest.raises(CheckpointError, match="is a 'draft' checkpoint"):
        load_policy(draft, policy, opt)
    with pytest.raises(ValueError, match="job_id"):
        policy_checkpoint_path(tmp_path, "../escape")
