"""Waiting for a job's rollout workers to start, never forever.

A worker started while the Ray cluster has no GPU free for it (a node lost, another job holding them) waits
in Ray unplaced; a driver that waited for it without a bound would wait forever. `await_started` waits at
most `timeout_s`, and less once the job's started workers fill every GPU the cluster has (the rest cannot be
placed while it is that short); the driver kills the ones that did not start and runs without them.
"""

from __future__ import annotations

import time

import ray

from workers.errors import one_line

START_POLL_S = 1.0  # how often, while workers start, the cluster's GPUs are counted again


def cluster_gpus() -> int:
    """GPUs of the Ray cluster's live nodes (logical ones on CPU)."""
    return int(ray.cluster_resources().get("GPU", 0))


def worker_slots(gpus_per_worker: float) -> int:
    """How many workers asking `gpus_per_worker` of a GPU each (JobSpec.gpus_per_worker) the cluster can hold:
    Ray places a share on one GPU, so a GPU holds floor(1 / share) of them."""
    return cluster_gpus() * int(1 / gpus_per_worker + 1e-9)


def await_started(started: dict, num_running: int, timeout_s: float,
                  gpus_per_worker: float = 1.0) -> tuple[list[str], dict[str, str]]:
    """Wait until each worker of `started` (id -> actor handle) has started, or its start failed, for at most
    `timeout_s`; `num_running`: the job's workers already up, each asking `gpus_per_worker`. Returns (ids of those
    not started: still unplaced or still loading at the end, ids of those whose start failed -> one line why)."""
    refs = {w.__ray_ready__.remote(): wid for wid, w in started.items()}
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, min(START_POLL_S, left)))
        is_full = num_running + len(refs) - len(pending) >= worker_slots(gpus_per_worker)
        if pending and (left <= START_POLL_S or is_full):
            break
    failed, unstarted = {}, set(pending)
    for ref, wid in refs.items():
        if ref in unstarted:
            continue
        try:
            ray.get(ref)
        except ray.exceptions.RayError as exc:  # its __init__ raised, or it died: its own error, in one line
            failed[wid] = one_line(exc)
    return [refs[r] for r in pending], failed
