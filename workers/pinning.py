"""Dedicated compute per rollout worker on CPU: which cores each worker of a job runs on.

TLT trains the drafter on workers that finished their rollouts while the stragglers still generate. On a
CPU box that time is free only if the idle worker's cores are its own: pinned, a lease takes nothing from a
straggler. So when a job's workers fit the machine (num_workers <= usable cores) worker i gets its own
contiguous slice of the cores and as many torch threads; otherwise the workers share every core with
max(1, cores // num_workers) threads each (said in the worker's log). On GPU nothing is pinned: one worker
per GPU. Pure logic here; the worker applies its placement (workers.actors.RolloutWorker).

Pinning alone leaves the job's other processes (its driver, the scheduler, Ray's and Redis's daemons) free to run on
any core. While a lease trains, neither core is idle, so they split between the trainer's core and the straggler's,
and the straggler loses what lands on its own. Idle-time work on a CPU therefore runs at idle priority
(run_at_idle_priority): a core that runs only such work counts as idle where the kernel places waking threads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    cores: tuple[int, ...]  # the CPU ids the worker may run on
    num_threads: int  # torch threads: one per core it owns, or its share when sharing
    is_dedicated: bool  # True: these cores are this worker's alone (within the job)


def place_worker(index: int, num_workers: int, usable_cores: list[int] | tuple[int, ...]) -> Placement:
    """Worker `index` of `num_workers`: a dedicated contiguous slice of `usable_cores` when every worker
    gets at least one (the first len(cores) % num_workers workers get one core more), else all the cores,
    shared, with max(1, len(cores) // num_workers) threads."""
    cores = tuple(sorted(set(usable_cores)))
    if not cores:
        raise ValueError("usable_cores must not be empty")
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if not 0 <= index < num_workers:
        raise ValueError(f"index must be in [0, {num_workers}), got {index}")
    if num_workers > len(cores):
        return Placement(cores, max(1, len(cores) // num_workers), is_dedicated=False)
    base, extra = divmod(len(cores), num_workers)
    start = index * base + min(index, extra)
    mine = cores[start : start + base + (1 if index < extra else 0)]
    return Placement(mine, len(mine), is_dedicated=True)


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity, which a container or taskset may have narrowed)."""
    return sorted(os.sched_getaffinity(0))


def pin_process(cores: tuple[int, ...]) -> None:
    """Restrict every thread of this process to `cores` (sched_setaffinity acts on one thread; threads
    started later inherit their creator's mask)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile, or one we may not move
            continue


# idle-priority work that got less than STARVED_SHARE of a core over STARVED_S while it waited to run for at least
# half of it (a box busy with other work: another job, a test run beside it) runs at normal priority again, where
# the process may raise it: otherwise a lease would never end its micro-step, nor a round its batch. Short enough to
# act within a second's tail (a CI run's tiny jobs have such tails); a thread blocked meanwhile (loading, waiting for
# a lock) is not starved and stays idle where the kernel says how long it waited (/proc's schedstat)
STARVED_S = 0.5
STARVED_SHARE = 0.1


# "0": leases and scoring run at the worker's own priority (a box whose other work, at normal priority, should not
# starve them); a worker process reads it, so it goes in the Ray workers' environment
IDLE_PRIORITY_ENV = "TLT_IDLE_PRIORITY"


def _ran_and_waited(tid: int, clock: int) -> tuple[float, float | None]:
    """Thread `tid`'s seconds on a CPU and waiting to run on one (None where the kernel keeps no schedstat)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            ran_ns, waited_ns = f.read().split()[:2]
        return int(ran_ns) / 1e9, int(waited_ns) / 1e9
    except (OSError, ValueError):
        return time.clock_gettime(clock), None


def run_at_idle_priority(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a new thread at idle priority (Linux SCHED_IDLE; where there is none, at the caller's), waited
    for here: its value, or its exception raised here. Any runnable thread of normal priority takes the core before
    it, and the kernel places waking threads on a core that runs only such work as on an idle one. Measured here
    (2-core AMD EPYC, one row of SmolLM2 decoding on core 0, a busy loop on core 1, three processes each busy 2 ms in
    14 ms on no core in particular): 44 tokens/s with core 1 idle, 35-38 beside a normal busy loop, 43.7-44 beside an
    idle-priority one. Starved (STARVED_S waiting to run with next to no CPU; where the kernel keeps no schedstat,
    STARVED_S of next to no CPU, blocked included, which costs nothing), the thread itself goes back to normal
    priority if it may (threads it started keep theirs). A new thread each time: an unprivileged thread may not
    raise its priority back, and the threads it starts inherit it. IDLE_PRIORITY_ENV=0: fn(*args) here, as is."""
    if os.environ.get(IDLE_PRIORITY_ENV, "1") == "0":
        return fn(*args)
    out: dict[str, Any] = {}
    ready = threading.Event()

    def body() -> None:
        try:
            out["tid"], out["clock"] = threading.get_native_id(), time.pthread_getcpuclockid(threading.get_ident())
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
            out["idle"] = True
        except (AttributeError, OSError):  # no SCHED_IDLE here, or not allowed: the work runs at the caller's priority
            pass
        finally:
            ready.set()
        try:
            out["value"] = fn(*args)
        except BaseException as exc:  # raised again in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=body, name=f"idle-{getattr(fn, '__name__', 'work')}", daemon=True)
    thread.start()
    ready.wait()
    try:
        before = _ran_and_waited(out["tid"], out["clock"]) if out.get("idle") else None
    except OSError:  # the work has ended already
        before = None
    while before is not None:
        thread.join(STARVED_S)
        if not thread.is_alive():
            break
        try:
            now = _ran_and_waited(out["tid"], out["clock"])
            ran, waited = now[0] - before[0], None if now[1] is None or before[1] is None else now[1] - before[1]
            before = now
            if ran < STARVED_SHARE * STARVED_S and (waited is None or waited >= STARVED_S / 2):
                os.sched_setscheduler(out["tid"], os.SCHED_OTHER, os.sched_param(0))
                log.info("%s had %.2f s of CPU in %.1f s at idle priority: it runs at normal priority now",
                         thread.name, ran, STARVED_S)
                break
        except OSError as exc:  # the thread ended meanwhile, or this process may not raise a priority: it stays idle
            log.info("%s stays at idle priority: %s", thread.name, exc)
            break
    thread.join()
    if "error" in out:
        raise out["error"]
    return out.get("value")
