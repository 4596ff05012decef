"""The built-in engine's path in workers/ on the policy's device: generation (plain, speculative, sampled),
harvest, draft installs and policy loads behind the RolloutEngine seam; the learner's training pairs and
GRPO's forward and update.

Collected where only torch, numpy, safetensors and pytest are installed (the CUDA set: tests/cuda_tests.txt):
no Redis, no Ray, no pydantic. So the engine gets a stand-in for the JobSpec fields it reads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from drafter.draft.head import head_config, new_head
from drafter.train.buffer import RolloutBuffer
from tests.conftest import tiny_model
from workers.builtin_engine import BuiltinEngine
from workers.device import job_device
from workers.grpo import grpo_update, response_mask, sequence_logprobs
from workers.learner_pairs import LearnerPairs, add_pairs
from workers.policy_sync import SYNC_KEY, is_sync_message, read_policy_file, write_policy_file

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4], [6, 6]]


@dataclass
class EngineSpec:
    """The workers.spec.JobSpec fields BuiltinEngine reads (JobSpec itself needs pydantic)."""

    draft_k: int = 3
    draft_vocab_size: int | None = 40
    draft_dtype: str = "auto"  # JobSpec's default: bf16 drafts where the device has native bf16
    draft_tree: str = ""
    history_drafts: bool = False  # JobSpec's default


def params(temperature: float, max_new_tokens: int = 20) -> list[dict]:
    return [{"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": 10 + i, "ignore_eos": True}
            for i in range(len(PROMPTS))]


def test_the_builtin_engine_generates_harvests_and_swaps_on_its_device(device):
    policy = tiny_model().to(device)
    engine = BuiltinEngine(policy, None, EngineSpec())
    assert engine.drafter.head.fc.weight.device == policy.device
    plain = engine.generate(PROMPTS, params(0.0), speculation="off")
    buffer = RolloutBuffer(max_bytes=1 << 24, hidden_dtype=torch.float32)
    spec = engine.generate(PROMPTS, params(0.0), speculation="always", harvest_into=buffer)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]  # greedy: lossless token for token
    assert buffer.num_tokens == sum(len(p) - 1 + 20 for p in PROMPTS)  # prompt and generated pairs, kept on the CPU
    assert all(r.hidden.device.type == "cpu" and r.tokens.device.type == "cpu" for r in buffer.rollouts)
    # a draft version as the store hands it over (CPU tensors), served from the next step, on the policy's device
    head = new_head(policy, buffer, 40, seed=5)
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    engine.install_draft(1, state, head_config(head))
    assert engine.draft_version == 1 and engine.drafter.head.fc.weight.device == policy.device
    assert [o.token_ids for o in engine.generate(PROMPTS, params(0.0), speculation="always")] == \
           [o.token_ids for o in plain]
    sampled = [o.token_ids for o in engine.generate(PROMPTS, params(1.0), speculation="always")]
    assert sampled == [o.token_ids for o in engine.generate(PROMPTS, params(1.0), speculation="always")]  # seeded
    # new policy weights arrive on the CPU (Ray's object store): loaded into the module on its device
    engine.load_policy({k: v.detach().cpu() * 1.5 for k, v in policy.state_dict().items()}, policy_version=2)
    assert policy.device.type == torch.device(device).type
    moved = engine.generate(PROMPTS, params(0.0), speculation="always")
    assert [o.token_ids for o in moved] == [o.token_ids for o in engine.generate(PROMPTS, params(0.0))]
    assert [o.token_ids for o in moved] != [o.token_ids for o in plain]


def test_a_warmed_up_engine_captures_nothing_in_its_batches_nor_after_a_swap(device):
    """The worker's warm-up before its first rollout (RolloutEngine.warm_up): on CUDA its graphs captured then,
    none in the batches after, a published draft version included (written into the served head); on a CPU it
    only sizes the static cache, so the batches rebuild nothing either."""
    policy = tiny_model().to(device)
    engine = BuiltinEngine(policy, None, EngineSpec())
    cuda = torch.device(device).type == "cuda"
    out = engine.warm_up(len(PROMPTS), 64, {"temperature": 1.0}, "always", harvest=True)
    assert (out["captures"] > 0) == cuda and out["rebuilds"] >= 1
    buffer = RolloutBuffer(max_bytes=1 << 24, hidden_dtype=torch.float32)
    rebuilt = engine.engine.shapes.num_rebuilds
    engine.generate(PROMPTS, params(1.0), speculation="always", harvest_into=buffer)
    assert engine.engine.shapes.num_rebuilds == rebuilt  # the policy's cache was sized for the job already
    marks, served = engine.engine.shapes_seen(engine.serving), engine.drafter.head
    head = new_head(policy, buffer, 40, seed=5)
    engine.install_draft(1, {k: v.detach().cpu() for k, v in head.state_dict().items()}, head_config(head))
    assert engine.drafter.head is served and engine.draft_version == 1  # written in place
    assert torch.equal(served.vocab_ids, head.vocab_ids)
    engine.generate(PROMPTS, params(1.0), speculation="always", harvest_into=buffer)
    assert engine.engine.shapes_seen(engine.serving) == marks
    with pytest.raises(ValueError, match="speculation must be one of"):
        engine.warm_up(4, 64, {"temperature": 1.0}, "sometimes", harvest=False)


def test_the_learners_pairs_on_its_device_are_the_engines_harvest(device):
    """The learner's features (a padded cache-free forward on the device, recorded on the CPU for the message)
    equal the engine's harvest, rollout by rollout, for each way the driver records them."""
    policy = tiny_model().to(device)
    engine = BuiltinEngine(policy, None, EngineSpec())
    theirs = RolloutBuffer(max_bytes=1 << 24, hidden_dtype=torch.float32)
    outs = engine.generate(PROMPTS, params(1.0), speculation="always", harvest_into=theirs)
    seqs, plens = [list(o.prompt_ids) + list(o.token_ids) for o in outs], [len(o.prompt_ids) for o in outs]
    for path in ("fill", "logprob", "update"):
        learner = copy.deepcopy(policy)
        pairs = LearnerPairs(learner, seqs, plens, ["w0"] * len(seqs), torch.float32, 1 << 24)
        if path == "fill":
            assert pairs.fill(learner, micro_batch_size=3) == len(seqs)
        elif path == "logprob":
            with torch.no_grad():
                sequence_logprobs(learner, seqs, plens, recorder=pairs)
        else:
            learner.train().requires_grad_(True)
            spec = SimpleNamespace(micro_batch_size=2, kl_coef=0.0, clip_eps=0.2, max_grad_norm=1.0)
            grpo_update(learner, torch.optim.SGD(learner.parameters(), lr=0.0), seqs, plens,
                        torch.tensor([1.0, -1.0, 0.5, -0.5]), None, response_mask(seqs, plens), spec, recorder=pairs)
        assert not pairs.missing and all(f.device.type == "cpu" for f in pairs.features.values())
        ours = RolloutBuffer(max_bytes=1 << 24, hidden_dtype=torch.float32)
        assert add_pairs(ours, pairs.messages(policy_version=0)["w0"], pairs.feature_size) == theirs.num_tokens
        for a, b in zip(ours.rollouts, theirs.rollouts, strict=True):
            assert torch.equal(a.tokens, b.tokens) and a.num_prompt == b.num_prompt
            torch.testing.assert_close(a.hidden, b.hidden, atol=1e-4, rtol=1e-4)


def test_grpo_on_the_policys_device_matches_the_cpu(device):
    """Log-probs from a device forward equal the CPU's; an update there moves the rewarded sequence's up (its
    mask made on the CPU by response_mask, as the driver makes it)."""
    cpu = tiny_model(seed=4)
    policy = copy.deepcopy(cpu).to(device)
    seqs, plens = [[1, 2, 3, 4, 5, 6], [7, 8, 9], [3, 3, 3, 3]], [2, 1, 3]
    with torch.no_grad():
        ours, mask = sequence_logprobs(policy, seqs, plens)
        theirs, cpu_mask = sequence_logprobs(cpu, seqs, plens)
    assert ours.device == policy.device and torch.equal(mask.cpu(), cpu_mask)
    torch.testing.assert_close(ours.cpu(), theirs, atol=1e-4, rtol=1e-4)
    policy.train().requires_grad_(True)
    spec = SimpleNamespace(micro_batch_size=2, kl_coef=0.0, clip_eps=0.2, max_grad_norm=1.0)
    adv = torch.tensor([1.0, 0.0, -1.0])
    stats = grpo_update(policy, torch.optim.SGD(policy.parameters(), lr=0.5), seqs, plens, adv, None,
                        response_mask(seqs, plens), spec)
    assert stats["num_skipped"] == 1 and stats["grad_norm"] > 0
    with torch.no_grad():
        after, _ = sequence_logprobs(policy, seqs, plens)
    assert float(after[0].sum()) > float(ours[0].sum()) and float(after[2].sum()) < float(ours[2].sum())


def test_the_jobs_device_setting_resolves_in_this_process(device):
    assert job_device("cpu").type == "cpu"  # even where a GPU is visible
    assert job_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        assert job_device("cuda").type == "cuda"
    elif not torch.cuda.is_available():  # a job that asked for the GPU never runs on the CPU by mistake
        with pytest.raises(ValueError, match="sees no CUDA device"):
            job_device("cuda")
    with pytest.raises(ValueError, match="device must be one of auto, cuda, cpu"):
        job_device("gpu")


def test_a_policy_sync_file_carries_the_learners_weights_to_a_workers_device(device, tmp_path):
    """The learner writes its state once (tied weights once); a worker maps the file and loads it onto its own
    device, equal to the learner's; a file cut short is refused naming it."""
    learner = tiny_model(seed=7).to(device)
    message = write_policy_file(learner.state_dict(), tmp_path / "policy.safetensors")
    assert is_sync_message(message) and not is_sync_message(learner.state_dict())
    state = read_policy_file(message)
    assert set(state) == set(learner.state_dict())
    assert all(t.device.type == "cpu" for t in state.values())  # mapped: the copy onto the device is the load's
    with safe_open(message[SYNC_KEY], framework="pt") as f:
        assert len(list(f.keys())) == len(state) - 1  # the tied LM head is its embedding, written once
    worker = tiny_model(seed=8).to(device)
    BuiltinEngine(worker, None, EngineSpec()).load_policy(state, policy_version=1)
    assert all(torch.equal(a, b) for a, b in zip(worker.state_dict().values(), learner.state_dict().values()))
    assert worker.device.type == torch.device(device).type
    with open(message[SYNC_KEY], "r+b") as f:
        f.truncate(message["num_bytes"] // 2)
    with pytest.raises(ValueError, match=r"policy sync file .*policy.safetensors"):
        read_policy_file(message)
