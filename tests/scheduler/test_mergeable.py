"""Which finished copies the scheduler merges, from their index entries alone: the workers' merge key
(parent, head shape, draft vocabulary) read through the torch-free DraftIndex, grouped by the pure policy."""

from __future__ import annotations

import torch

from drafter.draft.head import EagleConfig, EagleHead, head_config
from drafter.train.checkpoint import DraftMeta
from scheduler.policy import CopyView, group_copies
from tests.conftest import tiny_model
from workers.draft_index import DraftIndex
from workers.redis_server import PrivateRedis
from workers.store import DraftStore, merge_key


def copy(store: DraftStore, head: EagleHead, steps: int, parent: int = 0) -> int:
    state, config = head.state_dict(), head_config(head)
    meta = DraftMeta(version=0, parent_version=parent, policy_version=0, num_steps=steps, total_steps=steps,
                     num_tokens=steps, head_config=config, extra={"merge_key": merge_key(parent, config, state)})
    return store.publish(state, meta)


def grouped(redis, versions: list[int]) -> tuple[list[int], list[int]]:
    index = DraftIndex(redis, "job:copies")
    return group_copies([CopyView(v, index.entry(v)["num_steps"], index.entry(v)["extra"]["merge_key"])
                         for v in versions])


def test_the_largest_compatible_group_is_merged_and_the_rest_named(tmp_path):
    model = tiny_model()
    cfg = EagleConfig(draft_vocab_size=16)
    a, b, c = (EagleHead(model.cfg, cfg) for _ in range(3))
    counts = torch.zeros(model.cfg.vocab_size)
    counts[-16:] = 1.0
    c.set_vocab(counts)  # another worker's rollouts chose another draft vocabulary
    with PrivateRedis() as server:
        redis = server.client()
        store = DraftStore(redis, tmp_path, "job:copies")
        va, vb, vc = copy(store, a, 3), copy(store, b, 4), copy(store, c, 5)
        assert grouped(redis, [va, vb, vc]) == ([va, vb], [vc])  # 7 steps beat 5
        vd = copy(store, c, 9)
        assert grouped(redis, [va, vb, vc, vd]) == ([vc, vd], [va, vb])
        ve = copy(store, a, 100, parent=1)  # another parent never averages with parent 0
        assert grouped(redis, [va, ve]) == ([ve], [va])
        merged = store.merge_and_publish(grouped(redis, [va, vb, vc])[0])  # what the scorer does with the group
        assert store.load(merged)[1].parent_version == 0
