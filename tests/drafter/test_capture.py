"""drafter.decode.capture: the collector is paused for a capture and restored after, and (on a GPU) a dead graph
held in a reference cycle, collected while another graph captures, no longer breaks that capture."""

from __future__ import annotations

import gc

import pytest
import torch

from drafter.decode.capture import capture, gc_paused


@pytest.mark.parametrize("was_enabled", [True, False])
def test_the_collector_is_paused_in_the_block_and_restored_after(was_enabled):
    gc.enable() if was_enabled else gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == was_enabled
        with pytest.raises(RuntimeError, match="inside the block"), gc_paused():
            raise RuntimeError("inside the block")
        assert gc.isenabled() == was_enabled
    finally:
        gc.enable()


class _Cycle:
    """An object that refers to itself: only the cyclic collector frees it."""

    def __init__(self, graph) -> None:
        self.me, self.graph = self, graph


def test_a_capture_survives_a_collection_that_would_free_a_dead_graph(device):
    if device != "cuda":
        pytest.skip("a CPU captures no graphs (the pause itself is tested above, on every machine)")
    x = torch.arange(4.0, device=device)
    first, out = capture(lambda: x * 2, None)
    first.replay()
    assert out.tolist() == [0.0, 2.0, 4.0, 6.0]
    _Cycle(first)  # dead at once, in a cycle: the next collection destroys `first`
    del first, out
    threshold = gc.get_threshold()
    gc.set_threshold(1)  # a collection at almost every allocation: one falls inside the capture
    try:
        second, out = capture(lambda: torch.stack([x + i for i in range(50)]).sum(0), None)
    finally:
        gc.set_threshold(*threshold)
    x.fill_(1.0)
    second.replay()
    torch.cuda.synchronize()
    assert out.tolist() == [50.0 + 1225.0] * 4
