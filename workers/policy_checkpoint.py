"""The RL policy's checkpoint: what lets a job whose driver died resume instead of starting over.

One file per job, `store_dir/JOB/policy/checkpoint.safetensors`, beside its draft stores: the policy's
weights, its optimizer's state and the step it was taken after, in the trainer-checkpoint format the
drafter uses (drafter.train.checkpoint: safetensors with a sha256 over tensors and metadata, written to a temp
file and renamed over the old one, so a crash leaves the previous checkpoint whole). Nothing is
unpickled on load; a corrupt or mismatched file is a CheckpointError naming it.

The driver writes in two moves around the step's record: `stage_policy` (the expensive write, to
`checkpoint.next.safetensors`) before it, `commit_policy` (one rename) after it. A resume point is never
ahead of the step records: a driver that dies between the two resumes from the previous checkpoint and
redoes the steps since (their records are dropped and written again), never skips a step's record.

Path helpers are torch-free (the scheduler checks for a checkpoint, and removes it on cancel); the
save and load functions import torch when called.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from workers.protocol.keys import check_id

CHECKPOINT_FILE = "checkpoint.safetensors"
STAGED_FILE = "checkpoint.next.safetensors"  # written, not yet the resume point (commit_policy makes it that)


def policy_dir(store_dir: str | Path, job_id: str) -> Path:
    return Path(store_dir) / check_id("job_id", job_id) / "policy"


def policy_checkpoint_path(store_dir: str | Path, job_id: str) -> Path:
    return policy_dir(store_dir, job_id) / CHECKPOINT_FILE


def has_policy_checkpoint(store_dir: str | Path, job_id: str) -> bool:
    return policy_checkpoint_path(store_dir, job_id).is_file()


def remove_policy_checkpoints(store_dir: str | Path, job_id: str) -> None:
    """A cancelled job's checkpoints go with it (they are the size of the policy and its optimizer, thrice)."""
    shutil.rmtree(policy_dir(store_dir, job_id), ignore_errors=True)


def save_policy(path: str | Path, policy, optimizer, rl_step: int, policy_version: int) -> str:
    """Write the policy and its optimizer after step `rl_step` (atomically); returns the file's sha256."""
    from drafter.train.checkpoint import DraftMeta, save_trainer_state

    meta = DraftMeta(version=0, parent_version=None, policy_version=policy_version, extra={"kind": "policy"})
    return save_trainer_state(path, policy.state_dict(), optimizer, meta,
                              {"rl_step": int(rl_step), "policy_version": int(policy_version)})


def staged_policy_path(path: str | Path) -> Path:
    return Path(path).with_name(STAGED_FILE)


def stage_policy(path: str | Path, policy, optimizer, rl_step: int, policy_version: int) -> str:
    """save_policy beside `path` (staged_policy_path): whole on disk, not yet what a resume reads."""
    return save_policy(staged_policy_path(path), policy, optimizer, rl_step, policy_version)


def commit_policy(path: str | Path) -> None:
    """Make the staged checkpoint the resume point: one atomic rename over the previous one."""
    os.replace(staged_policy_path(path), path)


def load_policy(path: str | Path, policy, optimizer) -> tuple[int, int]:
    """Restore `policy` and `optimizer` in place from a checkpoint; returns (rl_step it was taken after,
    policy_version). CheckpointError if it is corrupt, not a policy checkpoint, or does not fit."""
    from drafter.train.checkpoint import CheckpointError, load_trainer_state

    meta, counters = load_trainer_state(path, policy, optimizer)
    if meta.extra.get("kind") != "policy" or not {"rl_step", "policy_version"} <= set(counters):
        raise CheckpointError(f"{path}: not a policy checkpoint")
    return int(counters["rl_step"]), int(counters["policy_version"])
