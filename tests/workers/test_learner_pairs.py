"""Drafter training pairs from the learner's forward (workers.learner_pairs), for engines that do not harvest
them: the same pairs as the built-in engine's harvest, by whichever forward records them; the message a worker
adds; a worker that takes them (real tiny models, real Redis; no Ray here: tests/workers/test_learner_pairs_job.py)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from drafter.train.buffer import RolloutBuffer
from tests.conftest import tiny_model
from workers.builtin_engine import BuiltinEngine
from workers.grpo import grpo_update, response_mask, sequence_logprobs, update_rows
from workers.learner_pairs import LearnerPairs, add_pairs, as_numpy, from_numpy
from workers.rollout import RolloutRunner
from workers.spec import JobSpec

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4], [6, 6]]


def params(max_new_tokens: int = 20) -> list[dict]:
    return [{"temperature": 1.0, "max_new_tokens": max_new_tokens, "seed": 10 + i, "ignore_eos": True}
            for i in range(len(PROMPTS))]


def harvested(dtype: torch.dtype, device: str) -> tuple[BuiltinEngine, list, RolloutBuffer]:
    """The built-in engine's own harvest on `device`, speculating (accepted drafts: several positions per verify
    forward)."""
    engine = BuiltinEngine(tiny_model().to(device), None, JobSpec(model="tiny", draft_k=3, device=device))
    engine.load_policy({k: v.clone() for k, v in engine.policy.state_dict().items()}, policy_version=3)
    buffer = RolloutBuffer(max_bytes=1 << 24, hidden_dtype=dtype)
    outs = engine.generate(PROMPTS, params(), speculation="always", harvest_into=buffer)
    assert sum(o.num_accepted for o in outs) > 0
    return engine, outs, buffer


def record(path: str, learner, seqs: list, plens: list, pairs: LearnerPairs) -> None:
    """The driver's three ways: the old-log-prob pass; the update's own forward (rows with advantage 0 filled
    first); a features-only forward alone."""
    if path == "logprob":
        with torch.no_grad():
            sequence_logprobs(learner, seqs, plens, recorder=pairs)
    elif path == "update":
        adv, mask = torch.tensor([1.0, 0.0, -1.0, 0.0]), response_mask(seqs, plens)
        spec = JobSpec(micro_batch_size=2)
        assert pairs.fill(learner, update_rows(mask, adv, None, spec)) == 2  # the two rows the update skips
        learner.train().requires_grad_(True)
        grpo_update(learner, torch.optim.SGD(learner.parameters(), lr=0.0), seqs, plens, adv, None, mask, spec,
                    recorder=pairs)
    else:
        assert pairs.fill(learner, micro_batch_size=3) == len(seqs)
    assert not pairs.missing


@pytest.mark.parametrize("path", ["logprob", "update", "fill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_learner_pairs_are_the_engines_harvest(device, path, dtype):
    """Same sequences, same policy weights: the learner's pairs are the engine's, rollout by rollout (tokens,
    prompt length, policy version, features to tolerance: a cache-free padded forward against the engine's
    incremental ones), after crossing as the message a worker adds. The engine and the learner on the `device`
fixture's device."""
    engine, outs, theirs = harvested(dtype, device)
    learner = copy.deepcopy(engine.policy)  # the driver's own copy, on the engine's device
    assert learner.device.type == device
    seqs, plens = [list(o.prompt_ids) + list(o.token_ids) for o in outs], [len(o.prompt_ids) for o in outs]
    pairs = LearnerPairs(learner, seqs, plens, ["w0"] * len(seqs), dtype, 1 << 24)
    record(path, learner, seqs, plens, pairs)
    message = pairs.messages(policy_version=3)["w0"]
    assert message["tokens"].dtype == np.int32 and message["hidden_dtype"] == str(dtype).removeprefix("torch.")
    ours = RolloutBuffer(max_bytes=1 << 24, hidden_dtype=dtype)
    assert add_pairs(ours, message, pairs.feature_size) == theirs.num_tokens
    assert len(ours) == len(theirs) == len(PROMPTS) and ours.num_bytes == theirs.num_bytes
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}  # bf16: an ulp
    for a, b in zip(ours.rollouts, theirs.rollouts):
        assert torch.equal(a.tokens.cpu(), b.tokens.cpu()) and a.num_prompt == b.num_prompt and a.policy_version == 3
        assert a.hidden.dtype == b.hidden.dtype == dtype and a.hidden.shape == b.hidden.shape
        torch.testing.assert_close(a.hidden.float().cpu(), b.hidden.float().cpu(), **tol)


def test_recording_leaves_the_update_as_it_was(device):
    seqs, plens = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [10, 11, 12, 13]], [2, 1, 3]
    adv, mask = torch.tensor([1.0, -0.5, 0.0]), response_mask(seqs, plens)
    runs = []
    for is_recording in (False, True):
        model = tiny_model().to(device).requires_grad_(True)
        pairs = LearnerPairs(model, seqs, plens, ["w0"] * 3, torch.float32, 1 << 20) if is_recording else None
        stats = grpo_update(model, torch.optim.SGD(model.parameters(), lr=0.0), seqs, plens, adv, None, mask,
                            JobSpec(micro_batch_size=2), recorder=pairs)
        runs.append((stats, torch.cat([p.grad.flatten() for p in model.parameters()])))
        if pairs is not None:
            assert pairs.missing == [2]  # advantage 0: no forward, left to fill
    (plain, g_plain), (recording, g_recording) = runs
    assert plain == recording and torch.equal(g_plain, g_recording)


def test_only_wanted_sequences_within_each_workers_bytes_are_recorded():
    model = tiny_model()
    seqs = [[1, 2, 3], [4, 5, 6, 7], [8], [9, 10], [11, 12, 13], [14, 15]]
    owners = ["w0", None, "w0", "w1", "w0", "w1"]
    row = 4 * model.cfg.hidden_size * 2  # one bf16 feature row
    cap = 3 * 4 + 2 * row + 2 * 4 + 1 * row  # w0: its first sequence fits, not its second; w1: both of its
    pairs = LearnerPairs(model, seqs, [1] * len(seqs), owners, torch.bfloat16, cap)
    assert sorted(pairs.slots) == [0, 3, 5]  # None: not wanted; [8]: no pair; [11, 12, 13]: over w0's bytes
    pairs.fill(model)
    messages = pairs.messages(0)
    assert messages["w0"]["lengths"] == [3] and messages["w1"]["lengths"] == [2, 2]
    assert messages["w1"]["tokens"].tolist() == [9, 10, 14, 15] and messages["w1"]["hidden"].shape == (2, 4 * 64)
    with pytest.raises(RuntimeError, match="never recorded"):
        LearnerPairs(model, seqs, [1] * len(seqs), owners, torch.bfloat16, cap).messages(0)


def test_bf16_travels_as_its_bits():
    t = torch.randn(5, 8).to(torch.bfloat16)
    a = as_numpy(t)
    assert a.dtype == np.int16 and torch.equal(from_numpy(a, "bfloat16"), t)
    a.setflags(write=False)  # as mapped from Ray's object store
    assert torch.equal(from_numpy(a, "bfloat16"), t)


def message(**kw) -> dict:
    return {"policy_version": 1, "lengths": [3, 2], "num_prompt": [1, 1], "tokens": np.array([1, 2, 3, 4, 5], np.int32),
            "hidden": np.zeros((3, 8), np.float32), "hidden_dtype": "float32"} | kw


@pytest.mark.parametrize("bad, match", [
    ({"hidden_dtype": "int8"}, "hidden_dtype"),
    ({"hidden_dtype": "bfloat16"}, "expected torch.int16"),
    ({"hidden": np.zeros((4, 8), np.float32)}, "hidden has shape"),
    ({"hidden": np.zeros((3, 6), np.float32)}, "hidden has shape"),
    ({"tokens": np.array([1, 2, 3], np.int32)}, "tokens has shape"),
    ({"lengths": [3, 1]}, "lengths"),
    ({"num_prompt": [1]}, "lengths"),
])
def test_a_malformed_message_is_refused_naming_the_field_and_adds_nothing(bad, match):
    buffer = RolloutBuffer(max_bytes=1 << 20)
    assert add_pairs(buffer, message(), 8) == 3 and len(buffer) == 2
    buffer.clear()
    with pytest.raises(ValueError, match=match):
        add_pairs(buffer, message(**bad), 8)
    broken = message()
    del broken["tokens"]
    with pytest.raises(ValueError, match="needs policy_version"):
        add_pairs(buffer, broken, 8)
    assert len(buffer) == 0


def test_a_worker_that_does_not_harvest_takes_the_learners_pairs_and_one_that_does_refuses(redis_client, tmp_path):
    spec = JobSpec(model="tiny", draft_k=2)
    learner_fed = RolloutRunner("job1", "w0", spec, redis_client, str(tmp_path), harvest_in_engine=False)
    outs = learner_fed.generate(PROMPTS, params(8), rl_step=0)
    assert len(learner_fed.buffer) == 0 and all(o["learner_pairs"] for o in outs)  # the engine was not asked
    seqs, plens = [o["prompt_ids"] + o["token_ids"] for o in outs], [len(o["prompt_ids"]) for o in outs]
    pairs = LearnerPairs(learner_fed.policy, seqs, plens, ["w0"] * len(seqs), torch.bfloat16, 1 << 24)
    pairs.fill(learner_fed.policy)
    assert learner_fed.add_learner_pairs(pairs.messages(0)["w0"]) == sum(len(s) - 1 for s in seqs)
    assert learner_fed.buffer.num_tokens == sum(len(s) - 1 for s in seqs) and learner_fed.buffer.policy_versions == [0]
    assert learner_fed.describe()["buffer_tokens"] == learner_fed.buffer.num_tokens

    harvesting = RolloutRunner("job1", "w1", spec, redis_client, str(tmp_path))
    outs = harvesting.generate(PROMPTS, params(8), rl_step=0)
    assert harvesting.buffer.num_tokens > 0 and not any(o["learner_pairs"] for o in outs)
    with pytest.raises(ValueError, match="takes no training pairs from the learner"):
        harvesting.add_learner_pairs(pairs.messages(0)["w0"])
    frozen = RolloutRunner("job1", "w2", spec.model_copy(update={"idle_training": False}), redis_client,
                           str(tmp_path), harvest_in_engine=False)
    assert not any(o["learner_pairs"] for o in frozen.generate(PROMPTS, params(8), rl_step=0))  # trains nothing
