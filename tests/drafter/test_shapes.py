"""The static path's shapes (issue 38, item 7): a generate whose sizes were met before captures, rebuilds and
clears nothing, the batch keeps its bucket while rows finish, and switching k=0 <-> k>0 is exact and costs
at most one extra draft pass. On a CPU no graph is captured, so the rebuild count is the one that shows; on
CUDA (the device fixture) both do."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import SamplingParams
from drafter.decode.warmup import Schedule, warm_up
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


class Sequence(Schedule):
    """A chooser serving the draft lengths of `ks` in order (the last one after), logging what it is told."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(ks)
        self.log = []

    def record(self, batch_size: int, k: int, num_tokens: int, seconds: float, steady: bool = True) -> None:
        if steady:
            self.log.append(k)

    def record_rows(self, batch_size: int, k: int, rows: list[tuple[int, int]]) -> None:
        pass


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
    schedule = [0, 0, 4, 4, 4, 2, 2, 0, 4]  # k=2 after k=4 feeds a backlog first (on CUDA: the catch-up graph)
    for k in (0, 4):  # first meetings: the plain shapes, the speculative ones, and the tuner's
        engine.generate(requests, k=k, drafter=drafter)
    engine.generate(requests, k=4, drafter=drafter, tuner=Sequence(schedule))
    before = _counts(engine, drafter)
    assert before[1] >= 2  # the runner and the head cache were made (and, on CUDA, graphs captured)
    plain = engine.generate(requests)
    spec = engine.generate(requests, k=4, drafter=drafter)
    adaptive = engine.generate(requests, k=4, drafter=drafter, tuner=Sequence(schedule))
    assert _counts(engine, drafter) == before  # no capture, rebuild or clear
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain] == [o.token_ids for o in adaptive]
    assert len({len(o.token_ids) for o in plain}) == min(batch, 4)  # rows did finish at different steps


@pytest.mark.parametrize("keep_buckets", [None, True])
def test_the_batch_keeps_its_bucket_until_half_its_rows_finish_where_graphs_need_it(model_and_head, device,
                                                                                    keep_buckets):
    """9-16 rows run in bucket 16: where graphs are captured (keep_buckets None on CUDA, or True) a finished row is
    masked, not compacted away, until the live rows fit 8; uncaptured (None on a CPU) each finished row goes at once.
    Either way the outputs are plain decoding's."""
    model, head = model_and_head
    engine = Engine(copy.deepcopy(model).to(device), static=True, keep_buckets=keep_buckets)
    drafter = EagleDrafter(engine.model, copy.deepcopy(head).to(device), static=True)
    requests = _requests(16, model.cfg.vocab_size)
    plain = engine.generate(requests)
    kept = []
    original = drafter.keep_rows
    drafter.keep_rows = lambda rows: (kept.append(len(rows)), original(rows))[1]
    outs = engine.generate(requests, k=3, drafter=drafter)
    # caps 6, 11, 16, 21 per quarter: 12 live after the first quarter finishes (bucket 16: kept where graphs need
    # it, else compacted), 8 after the second (bucket 8: compacted), 4 after the third (bucket 4: once more)
    keeps = keep_buckets if keep_buckets is not None else torch.device(device).type == "cuda"
    assert engine.keeps_bucket == keeps
    assert kept == ([8, 4] if keeps else [12, 8, 4])
    assert sorted({len(o.token_ids) for o in outs}) == [6, 11, 16, 21]
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


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


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_warm_up_meets_every_shape_a_job_then_uses(model_and_head, device, temperature):
    """warm_up (forced on a CPU, where nothing is captured): the caches sized and, on CUDA, every bucket's
    graphs at every draft length captured before the first batch; an adaptive batch of up to that many rows
    afterwards captures and rebuilds nothing, and the warm-up left the engine's counters as they were."""
    model, head = model_and_head
    model, head = copy.deepcopy(model).to(device), copy.deepcopy(head).to(device)
    engine = Engine(model, static=True)
    drafter = EagleDrafter(model, head, static=True)
    params = SamplingParams(temperature=temperature)
    out = warm_up(engine, 16, 40, (0, 1, 2, 4), params, drafter, force=True)
    assert out["batches"] == 5 * 4 and out["rebuilds"] >= 2  # buckets 16, 8, 4, 2, 1; the runner and head cache
    assert (out["captures"] > 0) == (torch.device(device).type == "cuda")
    assert engine.stats.num_forwards == 0 and engine.stats.num_generated == 0
    before = _counts(engine, drafter)
    requests = _requests(16, model.cfg.vocab_size, temperature)
    adaptive = engine.generate(requests, k=4, drafter=drafter, tuner=Sequence([4, 4, 0, 1, 2, 2, 0, 4, 1, 4]))
    assert _counts(engine, drafter) == before  # no capture, rebuild or clear
    if temperature == 0.0:
        assert [o.token_ids for o in adaptive] == [o.token_ids for o in engine.generate(requests)]
    assert warm_up(engine, 16, 40, (0, 4), params, drafter)["captures"] == 0  # met already (nothing on a CPU)
    with pytest.raises(ValueError, match="k > 0 needs a drafter"):
        warm_up(engine, 4, 40, (0, 2), params)
    with pytest.raises(ValueError, match="max_batch >= 1"):
        warm_up(engine, 0, 40, (0,), params)


def test_a_new_draft_version_serves_on_the_graphs_already_captured(model_and_head, device):
    """A drafter that owns its head writes each swapped-in head's weights into it: the next batch captures and
    rebuilds nothing, drafts as the new head does (greedy: lossless either way), and the head passed in is not
    the one serving (a caller keeps training its own). A head of another layout serves as itself, written into
    only if it was handed over."""
    model, head = model_and_head
    model = copy.deepcopy(model).to(device)
    engine = Engine(model, static=True)
    drafter = EagleDrafter(model, copy.deepcopy(head).to(device), static=True, own_head=True)
    served = drafter.head
    requests = _requests(4, model.cfg.vocab_size)
    plain = engine.generate(requests)
    engine.generate(requests, k=3, drafter=drafter)
    before = _counts(engine, drafter)
    new = EagleHead(model.cfg, dataclasses.replace(head.cfg, init_seed=7)).to(device)
    drafter.request_swap(new, version=1)
    drafter.apply_pending_swap()
    assert drafter.head is served and drafter.version == 1
    assert all(torch.equal(a, b) for a, b in zip(served.state_dict().values(), new.state_dict().values()))
    spec = engine.generate(requests, k=3, drafter=drafter)
    assert _counts(engine, drafter) == before
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    # the served head drafts as the new one: one more batch with `new` served by a fresh drafter matches it
    fresh = EagleDrafter(model, new, static=True)
    again = Engine(model, static=True).generate(requests, k=3, drafter=fresh)
    assert [o.num_accepted for o in again] == [o.num_accepted for o in spec]
    with torch.no_grad():
        new.fc.weight.add_(1.0)  # the caller's head moves on: the served copy does not
    assert not torch.equal(new.fc.weight, served.fc.weight)
    # another draft temperature is written too (the graphs read it on the device): sampled batches, same shapes
    sampled = _requests(4, model.cfg.vocab_size, temperature=1.0)
    engine.generate(sampled, k=3, drafter=drafter)
    before = _counts(engine, drafter)
    cooler = EagleHead(model.cfg, dataclasses.replace(head.cfg, draft_temperature=0.5)).to(device)
    drafter.request_swap(cooler, version=2)
    drafter.apply_pending_swap()
    assert drafter.head is served and served.cfg.draft_temperature == 0.5
    engine.generate(sampled, k=3, drafter=drafter)
    assert _counts(engine, drafter) == before
    if drafter.graphs.cuda_graphs:
        assert float(drafter.graphs.draft_temperature) == 0.5
    # a head of another layout (its draft vocabulary) serves as itself (the graphs are captured again); the caller
    # keeps it, so the next version is not written into it
    small = dataclasses.replace(head.cfg, draft_vocab_size=16)
    other = EagleHead(model.cfg, small).to(device)
    drafter.request_swap(other, version=3)
    drafter.apply_pending_swap()
    assert drafter.head is other
    kept = {n: t.clone() for n, t in other.state_dict().items()}
    drafter.request_swap(EagleHead(model.cfg, dataclasses.replace(small, init_seed=3)).to(device), version=4)
    drafter.apply_pending_swap()
    assert drafter.head is not other and all(torch.equal(t, kept[n]) for n, t in other.state_dict().items())
    # handed over (give: a fresh load, as a worker's), it is the drafter's own: the next version is written into it
    given = EagleHead(model.cfg, small).to(device)
    drafter.request_swap(given, version=5, give=True)
    drafter.apply_pending_swap()
    drafter.request_swap(EagleHead(model.cfg, dataclasses.replace(small, init_seed=4)).to(device), version=6)
    drafter.apply_pending_swap()
    assert drafter.head is given and drafter.version == 6
    # a drafter that does not own its head never writes into the caller's
    mine = copy.deepcopy(head).to(device)
    kept = {n: t.clone() for n, t in mine.state_dict().items()}
    borrower = EagleDrafter(model, mine, static=True)
    borrower.request_swap(copy.deepcopy(new), version=1)
    borrower.apply_pending_swap()
    assert all(torch.equal(t, kept[n]) for n, t in mine.state_dict().items())
