"""JobSpec.policy_dtype: a rollout worker serving a bf16 policy (the GPU bench's setting) generates with drafts,
reports what each draft length served per live-batch bucket, takes float32 policy weights from the learner,
and trains float32 drafter heads against the bf16 policy (real Redis, real tiny model, real store)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from drafter.draft.head import head_config, new_head
from drafter.model.linear import fast_bf16
from drafter.model.loading import cast_state
from drafter.train.checkpoint import DraftMeta
from workers.device import policy_dtype
from workers.rollout import RolloutRunner
from workers.spec import JobSpec
from workers.step_data import sum_served

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4, 4]]
SAMPLED = [{"max_new_tokens": 40, "temperature": 1.0, "seed": 7 + i, "ignore_eos": True} for i in range(3)]


def test_policy_dtype_defaults_to_float32_and_names_itself_when_wrong():
    assert JobSpec().policy_dtype == "float32" and JobSpec(policy_dtype="bfloat16").policy_dtype == "bfloat16"
    with pytest.raises(ValidationError, match="policy_dtype"):
        JobSpec(policy_dtype="float16")
    with pytest.raises(ValueError, match="policy_dtype must be one of auto, float32, bfloat16, got 'half'"):
        policy_dtype("half", "cpu")


def test_auto_is_bf16_where_the_device_runs_it_natively(device):
    """auto: bf16 on a GPU and on a CPU with bf16 units (torch emulates it elsewhere, slower than float32); the
    named precisions whatever the device. A worker of an auto job serves the precision its own device resolves."""
    native = fast_bf16(device)
    assert policy_dtype("auto", device) == (torch.bfloat16 if native else torch.float32)
    assert policy_dtype("float32", device) == torch.float32 and policy_dtype("bfloat16", device) == torch.bfloat16
    if torch.device(device).type == "cuda":
        assert native  # every GPU the CUDA set runs on has bf16


def test_an_auto_worker_serves_its_devices_precision(device, redis_client, tmp_path):
    spec = JobSpec(model="tiny", draft_k=2, draft_vocab_size=32, device=device, policy_dtype="auto")
    r = RolloutRunner("job1", "w0", spec, redis_client, str(tmp_path))
    assert r.policy.dtype == policy_dtype("auto", device)
    r.load_policy(cast_state(r.policy.state_dict(), torch.float32), 1)  # a sync in another precision is cast
    assert r.policy.dtype == policy_dtype("auto", device) and r.status.policy_version == 1


def test_a_bf16_worker_drafts_reports_buckets_syncs_and_trains_float32_heads(device, redis_client, tmp_path):
    spec = JobSpec(model="tiny", draft_k=2, draft_vocab_size=32, device=device, policy_dtype="bfloat16")
    r = RolloutRunner("job1", "w0", spec, redis_client, str(tmp_path))
    assert r.policy.dtype == torch.bfloat16 and r.policy.device.type == torch.device(device).type
    head = new_head(r.policy, None, spec.draft_vocab_size, seed=3).float()
    meta = DraftMeta(version=0, parent_version=0, policy_version=0, num_steps=1, total_steps=1, num_tokens=1,
                     head_config=head_config(head), extra={"accepted_length": 2.5})  # a score that drafts at once
    r.swapper.swap(r.served.publish(head.state_dict(), meta))

    out = r.generate(PROMPTS, SAMPLED, rl_step=0)
    served, throughput = out[0]["bucket_served"], out[0]["bucket_throughput"]
    assert all(o["bucket_served"] == served for o in out) and r.engine.stats().num_draft_tokens > 0
    assert set(served) == set(throughput)  # the same steps, counted by k as well
    for bucket, by_k in served.items():
        assert sum(c[0] for c in by_k.values()) == pytest.approx(throughput[bucket][0])
        assert sum(c[3] for c in by_k.values()) == pytest.approx(throughput[bucket][1])  # the same seconds, by k
        for k, (tokens, steps, rows, _) in by_k.items():
            assert 0 <= int(k) <= spec.draft_k and steps >= 1 and rows >= steps
            assert rows <= tokens <= rows * (int(k) + 1)  # each live row emits 1..k+1 tokens a step
    assert sum(c[0] for by_k in served.values() for c in by_k.values()) == sum(len(o["token_ids"]) for o in out)
    assert sum_served([served, served]) == {b: {k: [2 * c for c in v] for k, v in by_k.items()}
                                            for b, by_k in served.items()}

    # the learner's float32 weights, cast as the driver sends them: the worker serves them in bf16
    learner = {k: (v.float() + 0.01).cpu() for k, v in r.policy.state_dict().items()}
    r.load_policy(cast_state(learner, torch.bfloat16), policy_version=1)
    name = next(k for k, v in learner.items() if v.is_floating_point())
    assert r.policy.state_dict()[name].dtype == torch.bfloat16
    assert torch.equal(r.policy.state_dict()[name].cpu(), learner[name].to(torch.bfloat16))

    r.generate(PROMPTS, SAMPLED, rl_step=1)  # harvested pairs of the bf16 policy: what a lease trains on
    done = r.leases.run(r.leases.accept({"lease_id": "l1", "parent_version": 1, "deadline_s": 0.5}))
    assert done.steps >= 1 and done.error is None
    state, _ = r.copies.load(done.version)
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}  # masters stay float32


def test_cast_state_keeps_tied_weights_one_tensor():
    w = torch.randn(4, 3)
    out = cast_state({"embed": w, "lm_head": w, "ids": torch.arange(3)}, torch.bfloat16)
    assert out["embed"] is out["lm_head"] and out["embed"].dtype == torch.bfloat16
    assert out["ids"].dtype == torch.long
