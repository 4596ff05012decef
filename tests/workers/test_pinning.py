"""Which cores each rollout worker gets (pure logic), and that a process really pins itself."""

from __future__ import annotations

import os
import threading

import pytest

from workers.pinning import Placement, pin_process, place_worker, usable_cores


def test_workers_that_fit_get_disjoint_contiguous_slices_covering_every_core():
    cores = [0, 1, 2, 3, 4, 5, 6]
    placements = [place_worker(i, 3, cores) for i in range(3)]
    assert [p.cores for p in placements] == [(0, 1, 2), (3, 4), (5, 6)]  # the remainder goes to the first
    assert [p.num_threads for p in placements] == [3, 2, 2] and all(p.is_dedicated for p in placements)
    assert place_worker(1, 2, [0, 1]) == Placement((1,), 1, is_dedicated=True)  # this box: a core each
    assert place_worker(0, 1, [4, 2, 2, 6]) == Placement((2, 4, 6), 3, is_dedicated=True)  # sorted, deduplicated


def test_more_workers_than_cores_share_every_core_with_a_thread_share():
    assert place_worker(2, 3, [0, 1]) == Placement((0, 1), 1, is_dedicated=False)
    assert place_worker(0, 5, list(range(4))) == Placement((0, 1, 2, 3), 1, is_dedicated=False)
    # never zero threads
    assert all(place_worker(i, 9, [0, 1, 2, 3]).num_threads == 1 for i in range(9))


@pytest.mark.parametrize(("args", "match"), [((0, 2, []), "usable_cores"), ((0, 0, [0]), "num_workers"),
                                             ((2, 2, [0, 1]), "index"), ((-1, 2, [0, 1]), "index")])
def test_placement_errors_name_the_argument(args, match):
    with pytest.raises(ValueError, match=match):
        place_worker(*args)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pin_process_moves_every_thread_of_the_process():
    before = usable_cores()
    started, release = threading.Event(), threading.Event()
    seen: list[set[int]] = []

    def worker() -> None:  # a thread that exists before the pin
        started.set()
        release.wait()
        seen.append(os.sched_getaffinity(0))

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    try:
        pin_process((before[0],))
        release.set()
        t.join()
        assert os.sched_getaffinity(0) == {before[0]} and seen == [{before[0]}]
    finally:
        pin_process(tuple(before))
    assert usable_cores() == before
