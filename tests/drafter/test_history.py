"""History drafts (drafter.draft.history) and the combined drafter: the index, the store's budget, siblings streaming
into their group, and greedy decoding with either equal to plain decoding."""

from __future__ import annotations

import pytest
import torch

from drafter.decode.engine import Engine, Request
from drafter.decode.sampling import BatchSampling, SamplingParams
from drafter.draft.adaptive import DraftLengthTuner, StepCostPrior
from drafter.draft.combined import CombinedDrafter, SourceChooser
from drafter.draft.drafters import NgramDrafter
from drafter.draft.eagle import EagleDrafter
from drafter.draft.head import EagleHead
from drafter.draft.history import HistoryDrafter, ResponseStore, SuffixIndex, prompt_key
from drafter.draft.meter import FixedDraftLength
from tests.conftest import on, random_prompts

GREEDY = BatchSampling.from_params([SamplingParams()] * 2)


def test_index_finds_the_longest_match_and_what_followed_it():
    index = SuffixIndex(sizes=(4, 2, 1))
    index.add([5, 6, 7, 8, 9, 1, 2])
    index.add([0, 7, 8, 3, 4])
    # [6, 7, 8] is not a size: the longest indexed suffix that occurs is [7, 8] (n=2), in both sequences
    seq_id, end, n = index.find([1, 6, 7, 8], want=3)
    assert n == 2 and index.seqs[seq_id][end : end + 3] in ([9, 1, 2], [3, 4])
    assert index.seqs[seq_id][end : end + 3] == [9, 1, 2]  # a tied vote goes to the most tokens after the match
    seq_id, end, n = index.find([5, 6, 7, 8], want=2)
    assert (n, index.seqs[seq_id][end : end + 2]) == (4, [9, 1])
    assert index.find([42], want=2) is None
    # three occurrences of [7, 8] now: two are followed by 3, one (the longest) by 9; the common next token wins
    index.add([7, 8, 3])
    seq_id, end, n = index.find([1, 6, 7, 8], want=3)
    assert n == 2 and index.seqs[seq_id][end : end + 3] == [3, 4]
    assert index.find([2], want=2) is None  # [2] occurs only at the end of a sequence: nothing follows it


def test_index_keeps_the_latest_occurrences_and_a_stream_extends_it():
    index = SuffixIndex(sizes=(1,), max_occurrences=2)
    for t in (10, 11, 12):
        index.add([3, t])
    assert [index.seqs[s][e] for s, e in index.table[(3,)]] == [11, 12]  # the oldest dropped
    live = index.add([3], index_from=1)
    assert index.find([3], want=1)[0] in (1, 2)
    index.extend(live, [13, 14])
    assert index.seqs[live] == [3, 13, 14] and (13,) in index.table
    with pytest.raises(ValueError, match="n-gram sizes"):
        SuffixIndex(sizes=(0, 2))


def test_store_evicts_the_least_recently_used_prompts_oldest_response_under_its_byte_budget():
    store = ResponseStore(max_bytes=10 * 4, max_per_prompt=3)  # ten int32 tokens
    store.add([1], [1, 1, 1, 1])
    store.add([2], [2, 2, 2])
    store.add([1], [1, 1])
    assert store.nbytes == 9 * 4 and len(store) == 3
    store.responses([2])  # prompt 2 is now the most recently used: prompt 1 loses its oldest first
    store.add([2], [2, 2])
    assert store.responses([1]) == [[1, 1]] and store.responses([2]) == [[2, 2, 2], [2, 2]]
    assert store.nbytes <= store.max_bytes and store.num_evicted == 1
    for _ in range(4):
        store.add([3], [3])
    assert store.responses([3]) == [[3]] * 3  # at most max_per_prompt per prompt
    assert prompt_key([1, 2]) != prompt_key([2, 1]) and prompt_key([1, 2]) == prompt_key([1, 2])
    with pytest.raises(ValueError, match="max_per_prompt"):
        ResponseStore(max_per_prompt=0)


def test_siblings_stream_into_their_group_only():
    drafter = HistoryDrafter(sizes=(4, 2, 1))
    a, b = [7, 8, 9], [30, 31]
    drafter.begin([a, a, b])
    assert drafter.drafts([a, a, b], [3, 3, 3]) == [[], [], []]  # nothing follows any prompt's end yet
    drafter.observe([[20, 21, 22], [20], [20, 21]], None)
    # row 1 trails its sibling row 0 by two tokens: it drafts what row 0 wrote after the same text
    drafts = drafter.drafts([a + [20, 21, 22], a + [20], b + [20, 21]], [3, 3, 3])
    assert drafts[1] == [21, 22]
    assert drafts[2] == []  # [20, 21] of row 0 is another group's text
    drafter.observe([[23], [21, 22], [5]], None)
    assert drafter.match_lens[1] >= 3  # row 1 kept following row 0: its match grew
    assert drafter.drafts([a + [20, 21, 22, 23], a + [20, 21, 22], b + [20, 21, 5]], [2, 2, 2])[1] == [23]
    drafter.keep_rows(torch.tensor([1]))
    assert drafter.drafts([a + [20, 21, 22]], [2]) == [[23]]


def test_earlier_responses_draft_a_new_batch_of_the_same_prompt():
    store = ResponseStore()
    drafter = HistoryDrafter(store)
    drafter.remember([1, 2], [3, 4, 5, 6])
    drafter.begin([[1, 2], [9, 2]])
    assert drafter.drafts([[1, 2], [9, 2]], [3, 3]) == [[3, 4, 5], []]
    with pytest.raises(ValueError, match="min_match"):
        HistoryDrafter(min_match=0)


def groups_of(prompts: list[list[int]], size: int, lengths: list[int]) -> list[Request]:
    """`size` rows per prompt, each with its own max_new_tokens: rows finish at different steps."""
    rows = [p for p in prompts for _ in range(size)]
    return [Request(p, SamplingParams(max_new_tokens=n)) for p, n in zip(rows, lengths)]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("shape", ["batch1", "batch8"])
def test_greedy_history_drafts_equal_plain(tiny, device, k, shape):
    model = on(tiny, device)
    engine = Engine(model)
    if shape == "batch1":
        requests = groups_of(random_prompts([6], tiny.cfg.vocab_size), 1, [40])
    else:  # two groups of four, each row its own length
        requests = groups_of(random_prompts([5, 9], tiny.cfg.vocab_size), 4, [40, 13, 27, 7, 33, 20, 9, 40])
    plain = engine.generate(requests)
    store = ResponseStore()
    first = engine.generate(requests, k=k, drafter=HistoryDrafter(store))
    for o in first:
        store.add(o.prompt_ids, o.token_ids)
    again = engine.generate(requests, k=k, drafter=HistoryDrafter(store))  # with the earlier responses
    for outs in (first, again):
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in plain]
    # greedy answers repeat: the stored ones are accepted whole, so each row takes about 1/(k+1) of the forwards
    assert sum(o.num_accepted for o in again) >= 0.9 * sum(o.num_draft_tokens for o in again) > 0
    assert sum(o.num_steps for o in again) <= sum(o.num_steps for o in plain) / (k + 1) + 2 * len(requests)


def test_tree_ranks_each_nodes_branches_by_longest_match_then_votes():
    """A history tree: a node of rank r is its parent's r-th best continuation, distinct tokens at each node; a
    branch's longest match behind it counts before how many occurrences took it."""
    drafter = HistoryDrafter(sizes=(3, 1), tree="3,2", tree_side_depth=2)
    prompt = [1, 2, 3]
    for response in ([4, 5, 6], [4, 5, 7], [4, 8, 9], [9, 9, 9]):
        drafter.remember(prompt, response)
    drafter.begin([prompt, [7, 8]])
    tree = drafter.tree_for(3, 2)
    assert tree is not None and drafter.tree_for(3, 5) is None  # tree_max_batch 4
    prop = drafter.propose_tree([prompt, [7, 8]], [3, 3], GREEDY, None, tree)
    got = {p: int(t) for p, t, ok in zip(tree.paths, prop.tokens[0], prop.valid[0]) if ok}
    # after [1, 2, 3] (n=3): 4 three times; 9 only after [3] (n=1): ranked after 4 whatever its count
    assert got[(0,)] == 4 and got[(1,)] == 9 and (2,) not in got
    assert got[(0, 0)] == 5 and got[(0, 1)] == 8 and got[(0, 0, 0)] in (6, 7) and got[(1, 0)] == 9
    assert drafter.match_lens[0] == 3
    assert not prop.valid[1].any() and prop.lens.tolist() == [len(got), 0]  # row 1 matches nothing
    capped = drafter.propose_tree([prompt, [7, 8]], [1, 0], GREEDY, None, tree)
    assert {tree.paths[j][0] for j in range(tree.num_nodes) if capped.valid[0, j]} == {0, 1}  # depth <= its cap
    assert all(len(tree.paths[j]) == 1 for j in range(tree.num_nodes) if capped.valid[0, j])
    with pytest.raises(ValueError, match="tree_side_depth"):
        HistoryDrafter(tree="2", tree_side_depth=0)


@pytest.mark.parametrize("shape", ["batch1", "batch8"])
def test_greedy_history_trees_equal_plain(tiny, device, shape):
    """Tree steps while at most 4 rows are live (batch8: chains first), rows finishing at different steps."""
    model = on(tiny, device)
    engine = Engine(model)
    if shape == "batch1":
        requests = groups_of(random_prompts([6], tiny.cfg.vocab_size), 1, [40])
    else:
        requests = groups_of(random_prompts([5, 9], tiny.cfg.vocab_size), 4, [40, 13, 27, 7, 33, 20, 9, 40])
    plain = engine.generate(requests)
    store = ResponseStore()
    for o in plain:  # each row's stored answer, plus a wrong one ranked beside it: trees carry both
        store.add(o.prompt_ids, o.token_ids)
        store.add(o.prompt_ids, [(t + 1) % tiny.cfg.vocab_size for t in o.token_ids])
    drafter = HistoryDrafter(store, tree="2,2", tree_side_depth=3)
    spec = engine.generate(requests, k=3, drafter=drafter)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in spec] == [o.finish_reason for o in plain]
    assert sum(o.num_steps for o in spec) < sum(o.num_steps for o in plain) / 2


def test_greedy_combined_drafts_equal_plain_and_use_both_sources(tiny, device):
    model = on(tiny, device)
    engine = Engine(model)
    requests = groups_of(random_prompts([5, 9], tiny.cfg.vocab_size), 4, [40, 13, 27, 7, 33, 20, 9, 40])
    plain = engine.generate(requests)
    store = ResponseStore()  # earlier responses of the first group only: its rows draft from history, the others
    for o in plain[:4]:  # from the head (a random policy's own text seldom repeats 3 tokens)
        store.add(o.prompt_ids, o.token_ids)
    eagle = EagleDrafter(model, EagleHead(model.cfg).to(device))
    combined = CombinedDrafter(eagle, HistoryDrafter(store), min_match=3)
    spec = engine.generate(requests, k=3, drafter=combined)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert combined.num_history_rows > 0 and combined.num_eagle_rows > 0
    assert sum(o.num_steps for o in spec) < sum(o.num_steps for o in plain)
    with pytest.raises(ValueError, match="min_match"):
        CombinedDrafter(eagle, HistoryDrafter(), min_match=0)


def test_source_chooser_trusts_measurements_over_min_match():
    rule = SourceChooser(min_match=4, min_steps=2)
    assert not rule.use_history(2) and rule.use_history(5)  # nothing measured: the min_match rule
    for _ in range(2):
        rule.record_head(1)
        rule.record_history(2, 3)
        rule.record_history(6, 0)
    assert rule.use_history(2) and not rule.use_history(6)  # measured: 3 and 0 drafts a step against the head's 1
    assert rule.use_history(9)  # not measured at 9 (its own bucket): the rule again
    with pytest.raises(ValueError, match="min_match"):
        SourceChooser(min_match=0)


def test_combined_judges_every_history_draft_on_the_tokens_that_follow():
    """A history draft, used or not, counts the tokens of it the policy went on to emit, over several steps."""
    combined = CombinedDrafter(NgramDrafter(), HistoryDrafter(sizes=(2, 1)), min_match=99)  # history never drafts
    a = [7, 8, 9]
    combined.begin([a, a], None)
    combined.observe([[20, 21, 22], [20]], None)
    prop = combined.propose([a + [20, 21, 22], a + [20]], [3, 3], GREEDY, None, width=3)
    assert combined.num_history_rows == 0 and prop.lens.tolist()[1] == 0  # the n-gram "head" found nothing
    # row 1's history draft was [21, 22], after a match of 2 ([9, 20]): one agreed, one left to judge
    combined.observe([[23], [21]], None)
    assert combined.chooser.history[2] == [0, 0]
    combined.observe([[24], [5, 6]], None)
    assert combined.chooser.history[2] == [1, 1]  # judged: 1 of its 2 tokens was what the policy emitted
    assert combined.chooser.head[0] == 2  # both rows' head steps were counted


def test_the_tuner_is_told_which_source_drafted_per_bucket(tiny, device):
    """The combined drafter says per step which source drafted each row and what it had accepted; the engine hands
    that to its draft-length tuner, which keeps it per live-batch bucket: the rows and drafts accepted add up to
    the drafter's counts and the outputs' own, and greedy outputs are still plain decoding's."""
    model = on(tiny, device)
    engine = Engine(model)
    requests = groups_of(random_prompts([5, 9], tiny.cfg.vocab_size), 4, [40, 13, 27, 7, 33, 20, 9, 40])
    plain = engine.generate(requests)
    store = ResponseStore()
    for o in plain[:4]:
        store.add(o.prompt_ids, o.token_ids)
    for tuner in (FixedDraftLength(3), DraftLengthTuner(3, prior=StepCostPrior(acceptance=0.9))):
        combined = CombinedDrafter(EagleDrafter(model, EagleHead(model.cfg).to(device)), HistoryDrafter(store),
                                   min_match=3)
        spec = engine.generate(requests, k=3, drafter=combined, tuner=tuner)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        sources = tuner.bucket_sources()
        assert set(sources) <= set(tuner.bucket_served())
        totals = {s: [sum(by[s][i] for by in sources.values() if s in by) for i in range(3)]
                  for s in ("history", "eagle")}
        assert totals["history"][0] == combined.num_history_rows > 0
        assert totals["eagle"][0] == combined.num_eagle_rows
        assert totals["history"][2] + totals["eagle"][2] == sum(o.num_accepted for o in spec)
        assert totals["history"][1] + totals["eagle"][1] == sum(o.num_draft_tokens for o in spec)
    # the first group's rows (stored answers) draft from history and have it all accepted; the others from the head
    assert len([by for by in sources.values() if "history" in by]) >= 2
    assert all(by["history"][1] == by["history"][2] for by in sources.values() if "history" in by)
