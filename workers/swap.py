"""Hot swap: every draft version published to the job's served store is loaded and installed in the
worker's engine, between two decode steps of a batch under way, or at once when the worker is idle.

A listener thread follows the served store's announcements (Redis pub/sub); in its quiet seconds it
keeps the worker's progress record alive. Each swap is logged (bounded) with its times, and the
progress record carries the count and the latest one (the scheduler's swap latency metric).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from workers.engine import RolloutEngine
from workers.protocol import WorkerState
from workers.status import WorkerStatus
from workers.store import DraftStore

log = logging.getLogger(__name__)
MAX_SWAP_LOG = 64  # swaps remembered with their times: one per published version; readers want the recent
LISTEN_TIMEOUT_S = 1.0  # a quiet second: heartbeat the progress record (its TTL is 15 s)


class Swapper:
    def __init__(self, engine: RolloutEngine, served: DraftStore, status: WorkerStatus) -> None:
        self.engine, self.served, self.status = engine, served, status
        # {version, published_at, received_at, loaded_at, serving_at} of the latest swaps
        self.log: deque[dict] = deque(maxlen=MAX_SWAP_LOG)
        self.num_swaps = 0
        self.last_version = 0
        self.last_at = 0.0  # wall clock the latest install began
        # the serving version's accepted length as measured when it was published (0: never measured)
        self.draft_accepted_length = 0.0
        self._lock = threading.Lock()  # one swap at a time (the listener; tests and benchmarks call directly)
        self._stop = threading.Event()

    def record_fields(self) -> dict:
        """The swap fields of the worker's progress record."""
        return {"num_swaps": self.num_swaps, "last_swap_version": self.last_version, "last_swap_at": self.last_at}

    def swap(self, version: int, published_at: float | None = None) -> None:
        """Load `version` from the served store (checksum-checked) and install it. A generating worker
        switches drafts without pausing its batch; an idle one reports SWAPPING while it loads and installs."""
        received_at = time.time()
        with self._lock:
            is_idle = not self.status.is_generating and self.status.set_state(WorkerState.SWAPPING,
                                                                                only_from=WorkerState.IDLE)
            try:
                state, meta = self.served.load(version)
                loaded_at = time.time()
                self.engine.install_draft(version, state, meta.head_config)
                self.log.append({"version": version, "published_at": published_at, "received_at": received_at,
                                 "loaded_at": loaded_at, "serving_at": time.time()})
                self.draft_accepted_length = float(meta.extra.get("accepted_length") or 0.0)
                self.last_version, self.last_at = version, loaded_at
                self.num_swaps += 1  # last: a record that counts this swap names its version
            finally:
                if is_idle:
                    self.status.set_state(WorkerState.IDLE, only_from=WorkerState.SWAPPING)
            if not is_idle:  # an idle worker's return to IDLE carried the new swap fields already
                self.status.report(force=True)

    def catch_up(self) -> None:
        """Install the served store's latest version if it is newer than the one serving: a version
        published before this worker subscribed (a job's warm draft, published as the workers start)."""
        latest = self.served.latest_version()
        if latest is not None and latest > self.last_version:
            try:
                self.swap(latest)
            except Exception:  # as in listen: the engine keeps the draft it has
                log.exception("worker %s: catching up to v%d failed", self.status.worker_id, latest)

    def listen(self) -> None:
        """Swap in every announced version until `stop`; heartbeat the progress record when quiet."""
        sub = self.served.subscribe()
        try:
            self.catch_up()
            while not self._stop.is_set():
                msg = sub.get(timeout=LISTEN_TIMEOUT_S)
                if msg is None:
                    self.status.heartbeat()
                    continue
                try:
                    self.swap(msg.version, msg.published_at)
                except Exception:  # a bad version is skipped: the engine keeps serving the draft it has
                    log.exception("worker %s: swap to v%d failed", self.status.worker_id, msg.version)
        finally:
            sub.close()

    def start(self) -> threading.Thread:
        """Install the latest served version now (a job's warm draft: before the worker's first rollout),
        then follow the announcements in a thread."""
        self.catch_up()
        thread = threading.Thread(target=self.listen, daemon=True, name=f"swap-{self.status.worker_id}")
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
