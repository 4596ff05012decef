"""Which cores each rollout worker gets (pure logic), and that a process really pins itself."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from workers.pinning import Placement, pin_process, place_worker, run_at_idle_priority, usable_cores


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


def test_run_at_idle_priority_runs_in_a_thread_of_idle_policy_and_hands_back_its_value_or_error():
    caller = threading.get_ident(), os.sched_getscheduler(0)
    seen = run_at_idle_priority(lambda x: (threading.get_ident(), os.sched_getscheduler(0), x), 7)
    assert seen[0] != caller[0] and seen[1] == os.SCHED_IDLE and seen[2] == 7
    assert os.sched_getscheduler(0) == caller[1] == os.SCHED_OTHER  # the caller's own priority is untouched

    def fails() -> None:
        raise ValueError("the lease's own error")

    with pytest.raises(ValueError, match="the lease's own error"):
        run_at_idle_priority(fails)


def test_idle_priority_env_0_runs_the_work_here_at_the_callers_priority(monkeypatch):
    from workers.pinning import IDLE_PRIORITY_ENV

    monkeypatch.setenv(IDLE_PRIORITY_ENV, "0")
    caller = threading.get_ident(), os.sched_getscheduler(0)
    assert run_at_idle_priority(lambda: (threading.get_ident(), os.sched_getscheduler(0))) == caller


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: imports workers
COUNT = """
import os, sys, time
os.sched_setaffinity(0, {%d})
import workers.pinning
from workers.pinning import run_at_idle_priority
workers.pinning.STARVED_S = 60.0  # what idle priority alone does: no starvation guard within the count
def count(seconds):
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n
print(run_at_idle_priority(count, 1.5) if sys.argv[1] == "idle" else count(1.5))
"""


def test_idle_priority_work_leaves_a_shared_core_to_normal_work():
    """What a lease's training does to a straggler whose core it shares with the job's other processes: two counting
    loops on one core, one through run_at_idle_priority, the other at normal priority: the idle one gets next to
    nothing (at the same priority each would get about half)."""
    code = COUNT % usable_cores()[0]
    procs = {mode: subprocess.Popen([sys.executable, "-c", code, mode], stdout=subprocess.PIPE, text=True, cwd=ROOT)
             for mode in ("idle", "normal")}
    counts = {mode: int(p.communicate(timeout=60)[0]) for mode, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values())
    assert counts["idle"] < 0.2 * counts["normal"], counts


POLICY_AFTER = """
import os, time
os.sched_setaffinity(0, {%d})
from workers.pinning import STARVED_S, run_at_idle_priority
def busy_then_policy(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
    return os.sched_getscheduler(0)
print(run_at_idle_priority(busy_then_policy, 6 * STARVED_S))
"""
BUSY = """
import os
os.sched_setaffinity(0, {%d})
print("busy", flush=True)
while True:
    pass
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority back needs root (or RLIMIT_NICE >= 20)")
def test_starved_idle_priority_work_runs_at_normal_priority_again():
    """A box busy with other work (here a normal-priority loop on the same core) would leave idle-priority work
    nothing: a lease that never ends its micro-step. After STARVED_S of next to no CPU it runs at normal priority."""
    core = usable_cores()[0]
    busy = subprocess.Popen([sys.executable, "-c", BUSY % core], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert busy.stdout.readline() == "busy\n"  # the core is taken before the idle work starts
        out = subprocess.run([sys.executable, "-c", POLICY_AFTER % core], capture_output=True, text=True, cwd=ROOT,
                             timeout=60)
    finally:
        busy.kill()
        busy.wait()
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == os.SCHED_OTHER  # it began at SCHED_IDLE (the tests above) and was raised back


BLOCKED = """
import os, time
from workers.pinning import STARVED_S, run_at_idle_priority
def sleep_then_policy(seconds):
    time.sleep(seconds)  # blocked, as a lease loading its parent draft: not waiting for a core
    return os.sched_getscheduler(0)
print(run_at_idle_priority(sleep_then_policy, 3 * STARVED_S))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority back needs root (or RLIMIT_NICE >= 20)")
@pytest.mark.skipif(not os.path.exists(f"/proc/self/task/{threading.get_native_id()}/schedstat"),
                    reason="the kernel keeps no schedstat: a blocked thread counts as starved there")
def test_blocked_idle_priority_work_is_not_starved_and_stays_idle():
    """The guard raises work that waits for a core, not work that waits for something else: a thread asleep for
    three of the guard's windows keeps its idle priority (with CPU time alone it would look starved)."""
    out = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == os.SCHED_IDLE
