"""Dedicated compute per rollout worker on CPU: which cores each worker of a job runs on.

TLT trains the drafter on workers that finished their rollouts while the stragglers still generate. On a
CPU box that time is free only if the idle worker's cores are its own: pinned, a lease takes nothing from a
straggler. So when a job's workers fit the machine (num_workers <= usable cores) worker i gets its own
contiguous slice of the cores and as many torch threads; otherwise the workers share every core with
max(1, cores // num_workers) threads each (said in the worker's log). On GPU nothing is pinned: one worker
per GPU. Pure logic here; the worker applies its placement (workers.actors.RolloutWorker).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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
