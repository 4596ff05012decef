"""Which finished copies the watcher may average: same parent, head shape and draft vocabulary."""

from __future__ import annotations

import torch

from drafter.checkpoint import DraftMeta
from drafter.eagle import EagleConfig, EagleHead
from drafter.warmstart import head_config
from scheduler.watcher import mergeable
from tests.conftest import tiny_model
from workers.redis_server import PrivateRedis
from workers.store import DraftStore


def copy(store: DraftStore, head: EagleHead, steps: int, parent: int = 0) -> int:
    meta = DraftMeta(version=0, parent_version=parent, policy_version=0, num_steps=steps, total_steps=steps,
                     num_tokens=steps, head_config=head_config(head))
    return store.publish(head.state_dict(), meta)


def test_the_largest_compatible_group_is_merged_and_the_rest_named(tmp_path):
    model = tiny_model()
    cfg = EagleConfig(draft_vocab_size=16)
    a, b, c = (EagleHead(model.cfg, cfg) for _ in range(3))
    counts = torch.zeros(model.cfg.vocab_size)
    counts[-16:] = 1.0
    c.set_vocab(counts)  # another worker's rollouts chose another draft vocabulary
    with PrivateRedis() as server:
        store = DraftStore(server.client(), tmp_path, "job:copies")
        va, vb, vc = copy(store, a, 3), copy(store, b, 4), copy(store, c, 5)
        assert mergeable(store, [va, vb, vc]) == ([va, vb], [vc])  # 7 steps beat 5
        vd = copy(store, c, 9)
        assert mergeable(store, [va, vb, vc, vd]) == ([vc, vd], [va, vb])
        ve = copy(store, a, 100, parent=1)  # another parent never averages with parent 0
        assert mergeable(store, [va, ve]) == ([ve], [va])
        merged = store.merge_and_publish(mergeable(store, [va, vb, vc])[0])
        assert store.load(merged)[1].parent_version == 0
