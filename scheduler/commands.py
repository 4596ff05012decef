"""Commands to rollout workers over Ray, sent without waiting and answered in a later `poll`.

A command (start_lease, stop_training, score_round, publish_candidate) goes to the worker's named
actor (worker_actor_name in RAY_NAMESPACE; handles cached). `send` returns at once; the time of the
answer is taken when it arrives (a future's callback), and `poll`, called by the watcher's tick,
hands each answer to its callback in the tick's thread. A command unanswered after its timeout is
logged with the worker's name and answered with an error: one slow worker never holds up a tick,
another job's decisions, or the other commands of its own job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray

from workers.actors import get_worker
from workers.errors import one_line
from workers.protocol import worker_actor_name

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 10.0  # the commands return at once (the work runs in the worker's background)



@dataclass
class Reply:
    job_id: str
    worker_id: str
    method: str
    value: Any = None
    error: str | None = None  # one line: what went wrong, or that no answer came in time
    seconds: float = 0.0  # from sending to the answer


@dataclass
class _Pending:
    job_id: str
    worker_id: str
    method: str
    future: Future
    on_reply: Callable[[Reply], None]
    sent_at: float  # perf_counter
    timeout_s: float
    answered: list = field(default_factory=list)  # [perf_counter at the answer], set by the future's callback


class Commands:
    def __init__(self, timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.handles: dict[tuple[str, str], Any] = {}
        self.pending: list[_Pending] = []

    def handle(self, job_id: str, worker_id: str):
        """The worker's actor handle (cached), or None if there is no such actor now."""
        key = (job_id, worker_id)
        if key not in self.handles:
            if not ray.is_initialized():  # never let a lookup start a Ray of its own
                return None
            try:
                self.handles[key] = get_worker(job_id, worker_id)
            except ValueError:
                return None
        return self.handles[key]

    def is_pending(self, job_id: str, worker_id: str, method: str) -> bool:
        return any((p.job_id, p.worker_id, p.method) == (job_id, worker_id, method) for p in self.pending)

    def send(self, job_id: str, worker_id: str, method: str, *args: Any, on_reply: Callable[[Reply], None],
             timeout_s: float | None = None) -> None:
        """Call `method(*args)` on the worker; `on_reply` gets its Reply from a later `poll` (at once,
        with an error, if the worker has no actor)."""
        handle = self.handle(job_id, worker_id)
        if handle is None:
            on_reply(Reply(job_id, worker_id, method, error=f"worker {worker_id} has no actor "
                                                            f"{worker_actor_name(job_id, worker_id)!r}"))
            return
        sent_at = time.perf_counter()
        try:
            future = getattr(handle, method).remote(*args).future()
        except Exception as exc:  # the handle is dead or stale: look it up again next time
            self.handles.pop((job_id, worker_id), None)
            on_reply(Reply(job_id, worker_id, method, error=one_line(exc)))
            return
        pending = _Pending(job_id, worker_id, method, future, on_reply, sent_at,
                           self.timeout_s if timeout_s is None else timeout_s)
        future.add_done_callback(lambda _: pending.answered.append(time.perf_counter()))
        self.pending.append(pending)

    def poll(self) -> None:
        """Hand every answer that arrived, and every timeout, to its callback."""
        now, waiting = time.perf_counter(), []
        current, self.pending = self.pending, []  # callbacks may send new commands meanwhile
        for p in current:
            if p.future.done():
                seconds = (p.answered[0] if p.answered else now) - p.sent_at
                exc = p.future.exception()
                if exc is not None:
                    self.handles.pop((p.job_id, p.worker_id), None)  # it may have restarted: look it up again
                    reply = Reply(p.job_id, p.worker_id, p.method, error=one_line(exc), seconds=seconds)
                else:
                    reply = Reply(p.job_id, p.worker_id, p.method, value=p.future.result(), seconds=seconds)
            elif now - p.sent_at > p.timeout_s:
                log.warning("job %s: worker %s did not answer %s within %.1f s", p.job_id, p.worker_id, p.method,
                            p.timeout_s)
                self.handles.pop((p.job_id, p.worker_id), None)
                reply = Reply(p.job_id, p.worker_id, p.method, error=f"no answer within {p.timeout_s:g} s",
                              seconds=now - p.sent_at)
            else:
                waiting.append(p)
                continue
            try:
                p.on_reply(reply)
            except Exception:
                log.exception("job %s: handling %s's answer to %s failed", p.job_id, p.worker_id, p.method)
        self.pending = waiting + self.pending

    def forget(self, job_id: str) -> None:
        """Drop a finished job's handles and unanswered commands."""
        self.pending = [p for p in self.pending if p.job_id != job_id]
        self.handles = {k: h for k, h in self.handles.items() if k[0] != job_id}
