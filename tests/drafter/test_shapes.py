"""The static path's shapes (issue 38, item 7): a generate whose sizes were met before captures, rebuilds and
clears nothing, the batch keeps its bucket while rows finish, and switching k=0 <-> k>0 is exact and costs
at most one extra draft pass. On a CPU no graph is captured, so the rebuild count is the one that shows; on
CUDA (the device fixture) both do."""

from __future__ import annotations

import copy

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.draft.draft_graphs import CHUNK
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleHead
from tests.conftest import random_prompts, structured_model


def _requests(batch: int, vocab_size: int, temperature: float = 0.0) -> list[Request]:
    """`batch` rows that finish at different steps (their caps differ)."""
    prompts = random_prompts([3 + 2 * (i % 5) for i in range(batch)], vocab_size, seed=batch)
    return [Request(p, SamplingParams(max_new_tokens=6 + 5 * (i % 4), ignore_eos=True, seed=i,
                                      temperature=temperature)) for i, p in enumerate(prompts)]


def _counts(engine: Engine, drafter) -> tuple[int, int]:
    theirs = drafter.shape_counts()
    return (engine.shapes.num_captures + theirs.num_captures, engine.shapes.num_rebuilds + theirs.num_rebuilds)


class Sequence:
    """A chooser serving the draft lengths of `ks` in order (the last one after), logging what it is told."""

    def __init__(self, ks: list[int]) -> None:
        self.ks, self.step, self.log = ks, 0, []

    def choose(self, batch_size: int) -> int:
        self.step += 1
        return self.ks[min(self.step, len(self.ks)) - 1]

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None:
        if steady:
            self.log.append(k)


@pytest.fixture(scope="module")
def model_and_head():
    model = structured_model()
    return model, EagleHead(model.cfg)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_a_second_generate_of_the_same_sizes_captures_and_rebuilds_nothing(model_and_head, device, batch):
    model, head = model_and_head
    model, head = copy.deepcopy(model).to(device), copy.deepcopy(head).to(device)
    engine = Engine(model, static=True)
    drafter = EagleDrafter(model, head, static=True)
    requests = _requests(batch, model.cfg.vocab_size)
    for k in (0, 2, 4):  # the plain shapes and the speculative ones the tuner below serves: first meetings
        engine.generate(requests, k=k, drafter=drafter)
    before = _counts(engine, drafter)
    assert before[1] >= 2  # the runner and the head cache were made (and, on CUDA, graphs captured)
    plain = engine.generate(requests)
    spec = engine.generate(requests, k=4, drafter=drafter)
    adaptive = engine.generate(requests, k=4, drafter=drafter, tuner=Sequence([0, 0, 4, 4, 4, 2, 2, 0, 4]))
    assert _counts(engine, drafter) == before  # no capture, rebuild or clear
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain] == [o.token_ids for o in adaptive]
    assert len({len(o.token_ids) for o in plain}) == min(batch, 4)  # rows did finish at different steps


def test_the_batch_keeps_its_bucket_until_half_its_rows_finish(model_and_head, device):
    """9-16 rows run in bucket 16: a finished row is masked, not compacted away, until the live rows fit 8."""
    model, head = model_and_head
    engine = Engine(copy.deepcopy(model).to(device), static=True)
    drafter = EagleDrafter(engine.model, copy.deepcopy(head).to(device), static=True)
    kept = []
    original = drafter.keep_rows
    drafter.keep_rows = lambda rows: (kept.append(len(rows)), original(rows))[1]
    outs = engine.generate(_requests(16, model.cfg.vocab_size), k=3, drafter=drafter)
    # caps 6, 11, 16, 21 per quarter: 12 live after the first quarter finishes (bucket 16 kept), 8 after the
    # second (bucket 8: compacted once), 4 after the third (bucket 4: once more)
    assert kept == [8, 4]
    assert sorted({len(o.token_ids) for o in outs}) == [6, 11, 16, 21]


def test_switching_between_plain_and_speculation_is_exact_and_cheap(model_and_head, device):
    """Plain steps leave the draft's pairs pending; the switch to k > 0 feeds them in the same pass as its own
    (on CUDA: one captured chunk of up to CHUNK pairs first), and greedy outputs are plain decoding's."""
    model, head = model_and_head
    engine = Engine(copy.deepcopy(model).to(device), static=True)
    drafter = EagleDrafter(engine.model, copy.deepcopy(head).to(device), static=True)
    requests = _requests(4, model.cfg.vocab_size)
    plain = engine.generate(requests)
    engine.generate(requests, k=3, drafter=drafter)  # first meetings
    passes = []
    original = drafter.graphs._run
    drafter.graphs._run = lambda b, key, captured: (passes.append(key[1]), original(b, key, captured))[1]
    switching = Sequence([3, 3, 0, 0, 0, 0, 0, 0, 3, 3, 3, 0, 0, 3])
    outs = engine.generate(requests, k=3, drafter=drafter, tuner=switching)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    served = [switching.ks[min(i, len(switching.ks) - 1)] for i in range(switching.step)]
    switches = sum(1 for prev, k in zip([0, *served], served) if k and not prev)  # into speculation (the start too)
    catch_ups = len(passes) - sum(1 for k in served if k)  # passes beyond one per drafting step
    assert catch_ups == 0 if torch.device(device).type == "cpu" else 0 <= catch_ups <= switches
    assert set(passes) <= {0, 3} and CHUNK >= 6 + 4  # six plain steps' pairs and a step's own fit one chunk
    assert switching.log and set(switching.log) <= {0, 3}


def test_bf16_speculation_equals_bf16_plain(model_and_head, device):
    """The usual RL setting: the policy in bf16, the head served in it too; greedy speculative outputs are bf16
    plain decoding's, token for token, rows finishing at different steps."""
    model, head = model_and_head
    model = copy.deepcopy(model).to(device=device, dtype=torch.bfloat16)
    engine = Engine(model)
    drafter = EagleDrafter(model, copy.deepcopy(head).to(device))
    assert drafter.dtype == torch.bfloat16 and drafter.graphs is not None
    requests = _requests(8, model.cfg.vocab_size)
    plain = engine.generate(requests)
    spec = engine.generate(requests, k=4, drafter=drafter)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats.num_accepted > 0  # it did speculate


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_a_backlog_fed_in_chunks_drafts_what_one_pass_does(model_and_head, device, temperature):
    """CUDA feeds a backlog (here the prompts, and six plain steps' pairs) in fixed chunks of CHUNK pairs; on a
    CPU the same chunked path runs uncaptured when asked: its drafts, and so the outputs, equal one pass's."""
    model, head = model_and_head
    model = copy.deepcopy(model).to(device)
    prompts = random_prompts([40, 70, 3, 35], model.cfg.vocab_size, seed=5)  # prompts longer than a chunk
    requests = [Request(p, SamplingParams(max_new_tokens=24, ignore_eos=True, seed=i, temperature=temperature))
                for i, p in enumerate(prompts)]
    outs, passes = [], []
    for chunked in (False, True):
        engine = Engine(model, static=True)
        drafter = EagleDrafter(model, copy.deepcopy(head).to(device), static=True)
        drafter.graphs.chunked = chunked
        seen = []
        original = drafter.graphs._run
        drafter.graphs._run = lambda b, key, captured, seen=seen, original=original: (seen.append(key[1]),
                                                                                    original(b, key, captured))[1]
        outs.append(engine.generate(requests, k=3, drafter=drafter, tuner=Sequence([3, 3] + [0] * 6 + [3])))
        passes.append(seen)
    assert [o.token_ids for o in outs[1]] == [o.token_ids for o in outs[0]]
    assert passes[1].count(0) >= 3 > passes[0].count(0) == 0  # 70 - 4 prompt pairs: three chunks of 32
