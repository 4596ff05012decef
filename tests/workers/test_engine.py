"""The built-in engine behind the RolloutEngine seam: lossless speculation, harvesting, draft installs,
policy loads and the counters it reports (real tiny model, on the `device` fixture's device: JobSpec.device)."""

from __future__ import annotations

import pytest
import torch

from drafter.draft.head import head_config, new_head
from drafter.train.buffer import RolloutBuffer
from tests.conftest import tiny_model
from workers.builtin_engine import BuiltinEngine
from workers.engine import Completion, RolloutEngine
from workers.spec import JobSpec

PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [4, 4]]


def params(temperature: float, max_new_tokens: int = 24) -> list[dict]:
    return [{"temperature": temperature, "max_new_tokens": max_new_tokens, "seed": 10 + i, "ignore_eos": True}
            for i in range(len(PROMPTS))]


def engine(device: str, **kw) -> BuiltinEngine:
    e = BuiltinEngine(tiny_model().to(device), None, JobSpec(model="tiny", draft_k=3, device=device, **kw))
    assert e.policy.device.type == device
    return e


def test_speculation_is_lossless_and_reported(device):
    """Greedy, so token for token (sampled rollouts are lossless in distribution: tests/drafter)."""
    e = engine(device)
    assert isinstance(e, RolloutEngine) and e.draft_version == 0
    plain = e.generate(PROMPTS, params(0.0), speculation="off")
    assert e.stats().num_draft_tokens == 0 and e.stats().mean_accepted_length == 1.0
    spec = e.generate(PROMPTS, params(0.0), speculation="always")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    s = e.stats()
    assert s.num_draft_tokens > 0 and s.num_generated == 2 * 3 * 24 and s.tokens_per_s > 0
    assert all(isinstance(o, Completion) and o.finish_reason == "length" and o.draft_version == 0 for o in spec)
    assert sum(o.num_steps for o in spec) < sum(o.num_steps for o in plain)  # drafts were accepted
    assert spec[0].to_dict()["prompt_ids"] == PROMPTS[0]


def test_adaptive_speculation_is_lossless_learns_across_batches_and_is_reported(device):
    """Adaptive (the default mode of a job): greedy outputs equal plain; the engine's chooser keeps its
    measurements across batches and starts each draft version from its published score (the untrained version 0
    is never tried; a version whose score says it pays is tried at once), and every completion carries its
    draft length per live-batch bucket."""
    e = engine(device)
    plain = e.generate(PROMPTS, params(0.0), speculation="off")
    assert all(o.speculation == {"3-4": 0} for o in plain)  # plain: k 0 in the buckets it ran
    first = e.generate(PROMPTS, params(0.0), speculation="adaptive")
    assert [o.token_ids for o in first] == [o.token_ids for o in plain]
    assert first[0].speculation == {"3-4": 0} and first[0].to_dict()["speculation"] == {"3-4": 0}
    one = [{"temperature": 0.0, "max_new_tokens": 160, "seed": 1, "ignore_eos": True}]
    alone = e.generate(PROMPTS[:1], one, speculation="adaptive")
    alone_plain = e.generate(PROMPTS[:1], one, speculation="off")[0].token_ids
    assert alone[0].token_ids == alone_plain
    assert e.tuner.estimates()["1"].keys() == {0}  # version 0 is untrained: its prior expects nothing, none tried
    head = new_head(e.policy, None, None, seed=4)
    e.install_draft(1, head.state_dict(), head_config(head), accepted_length=3.0)  # scored: the prior expects gains
    alone = e.generate(PROMPTS[:1], one, speculation="adaptive")
    assert alone[0].token_ids == alone_plain
    assert e.tuner.estimates()["1"].keys() == {0, 1, 2, 3}  # batch 1: every arm the prior expects to pay, tried
    assert alone[0].speculation["1"] in (0, 1, 2, 3)
    second = e.generate(PROMPTS, params(0.0, max_new_tokens=8), speculation="adaptive")
    assert [o.token_ids for o in second] == [o.token_ids[:8] for o in plain]
    assert e.choosers["always"].summary() == {} and e.choosers["off"].throughput()["3-4"][0] > 0
    e.install_draft(2, head.state_dict(), head_config(head))  # another draft: its arms are measured afresh
    assert e.tuner.estimates()["1"].keys() == {0}
    with pytest.raises(ValueError, match="speculation must be one of"):
        e.generate(PROMPTS, params(0.0), speculation="sometimes")


def test_harvest_feeds_the_buffer_with_the_policy_version(device):
    e, buffer = engine(device), RolloutBuffer(max_bytes=1 << 20, hidden_dtype=torch.float32)
    e.generate(PROMPTS, params(1.0), speculation="off")
    assert len(buffer) == 0
    e.load_policy({k: v.clone() for k, v in e.policy.state_dict().items()}, policy_version=3)
    outs = e.generate(PROMPTS, params(1.0), speculation="always", harvest_into=buffer)
    assert buffer.policy_versions == [3] and len(buffer) == len(PROMPTS)
    # every token of each prompt and response but the last is a training pair
    assert buffer.num_tokens == sum(len(p) + len(o.token_ids) - 1 for p, o in zip(PROMPTS, outs))


def test_load_policy_changes_what_is_generated(device):
    e = engine(device)
    before = e.generate(PROMPTS, params(0.0), speculation="off")
    other = tiny_model(seed=7).state_dict()
    e.load_policy({k: v.numpy() for k, v in other.items()}, policy_version=1)  # as Ray maps them: numpy
    after = e.generate(PROMPTS, params(0.0), speculation="always")
    assert torch.equal(e.policy.lm_head.weight.cpu(), other["lm_head.weight"] if "lm_head.weight" in other
                       else other["embed.weight"])
    assert [o.token_ids for o in after] != [o.token_ids for o in before]
    assert [o.token_ids for o in after] == [o.token_ids for o in e.generate(PROMPTS, params(0.0), speculation="off")]


def test_install_draft_serves_the_version_from_the_next_step(device):
    e = engine(device)
    head = new_head(e.policy, None, None, seed=4)
    e.install_draft(5, head.state_dict(), head_config(head))
    assert e.draft_version == 5 and e.stats().num_swaps == 1
    outs = e.generate(PROMPTS, params(0.0), speculation="always")
    assert {o.draft_version for o in outs} == {5}
    with pytest.raises(ValueError, match="fc.weight"):  # a state that does not fit its config: the draft serving stays
        e.install_draft(6, {k: v for k, v in head.state_dict().items() if k != "fc.weight"}, head_config(head))
    assert e.draft_version == 5 and e.stats().num_swaps == 1


def test_params_must_match_the_prompts():
    e = engine("cpu")
    with pytest.raises(ValueError, match="params has 1 entries for 3 prompts"):
        e.generate(PROMPTS, params(0.0)[:1], speculation="off")
    with pytest.raises(ValueError, match="temperature"):
        e.generate(PROMPTS[:1], [{"temperature": -1.0}], speculation="off")


def test_history_drafts_are_lossless_and_remember_earlier_responses(device):
    """JobSpec.history_drafts: rows draft from their group and from the responses of earlier batches of the same
    prompts, which the engine keeps (bounded) after each batch; greedy outputs stay plain decoding's."""
    e = engine(device, history_drafts=True)
    plain = e.generate(PROMPTS, params(0.0), speculation="off")
    assert len(e.history.store) == len(PROMPTS)  # kept after a plain batch too
    spec = e.generate(PROMPTS, params(0.0), speculation="always")
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert e.serving.num_history_rows > 0  # the stored responses drafted, and were accepted whole
    assert sum(o.num_steps for o in spec) <= sum(o.num_steps for o in plain) / 3
    assert e.history.store.nbytes <= e.history.store.max_bytes
    assert engine(device).history is None  # off by default
