"""Commands to rollout workers over Ray, sent without waiting and answered in a later `poll`.

A command (start_lease, stop_training, score_round, publish_candidate) goes to the worker's named
actor (worker_actor_name in RAY_NAMESPACE; handles cached). `send` returns at once; the time of the
answer is taken when it arrives (a future's callback), and `poll`, called by the watcher's tick,
hands each answer to its callback in the tick's thread. A command unanswered after its timeout is
logged with the worker's name and answered with an error: one slow worker never holds up a tick,
another job's decisions, or the other commands of its own job.

An answer that says the worker's actor is dead for good (Ray has no actor by its name, or says it died:
`is_gone`) is also kept per job until the watcher takes it (`take_gone`), which then leaves the worker
out of its decisions at once instead of asking it again every tick until its progress record expires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayError

from workers.actors import get_worker
from workers.errors import one_line
from workers.protocol.keys import worker_actor_name

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 10.0  # the commands return at once (the work runs in the worker's background)


def is_gone(exc: BaseException) -> bool:
    """Whether a command's exception means the worker's actor is dead for good: killed, its process or its node
    lost, or its __init__ failed (ActorDiedError; a worker's actors are never restarted by Ray). Not a worker that
    is unreachable for now (ActorUnavailableError), slow (a timeout), or that refused (its own error, a
    RayTaskError)."""
    return isinstance(exc, ActorDiedError)


@dataclass
class Reply:
    job_id: str
    worker_id: str
    method: str
    value: Any = None
    error: str | None = None  # one line: what went wrong, or that no answer came in time
    seconds: float = 0.0  # from sending to the answer
    is_gone: bool = False  # the error says the worker's actor is dead or does not exist: asking again is pointless
    # no answer (unreachable, or timed out), as at its previous command: logged once when it began, so a caller
    # asking every tick need not warn again
    quiet: bool = False


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
        self.gone: dict[str, dict[str, str]] = {}  # job id -> worker id -> the error that said it is gone
        # (job id, worker id) -> [monotonic time, count] of its unanswered commands in a row (unreachable or timed
        # out, not gone): a dying node's worker is warned of once, not every tick until Ray says it is dead
        self.unanswered: dict[tuple[str, str], list] = {}

    def handle(self, job_id: str, worker_id: str):
        """The worker's actor handle (cached), or None if there is no such actor now."""
        key = (job_id, worker_id)
        if key not in self.handles:
            if not ray.is_initialized():  # never let a lookup start a Ray of its own
                return None
            try:
                self.handles[key] = get_worker(job_id, worker_id)
            except ValueError:  # Ray's "Failed to look up actor": none by that name (dead, or never started)
                return None
        return self.handles[key]

    def is_pending(self, job_id: str, worker_id: str, method: str) -> bool:
        return any((p.job_id, p.worker_id, p.method) == (job_id, worker_id, method) for p in self.pending)

    def send(self, job_id: str, worker_id: str, method: str, *args: Any, on_reply: Callable[[Reply], None],
             timeout_s: float | None = None) -> None:
        """Call `method(*args)` on the worker; `on_reply` gets its Reply from a later `poll` (at once,
        with an error, if the worker has no actor)."""
        handle = self.handle(job_id, worker_id)
        if handle is None:  # Ray has no such actor; without a Ray there was nobody to ask, and nothing is known
            on_reply(self._noted(Reply(job_id, worker_id, method, is_gone=ray.is_initialized(),
                                       error=f"worker {worker_id} has no actor "
                                             f"{worker_actor_name(job_id, worker_id)!r}")))
            return
        sent_at = time.perf_counter()
        try:
            future = getattr(handle, method).remote(*args).future()
        except RayError as exc:  # the handle is dead or stale: look it up again next time
            self.handles.pop((job_id, worker_id), None)
            on_reply(self._noted(Reply(job_id, worker_id, method, error=one_line(exc), is_gone=is_gone(exc)),
                                 unanswered=isinstance(exc, ActorUnavailableError)))
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
                    reply = self._noted(Reply(p.job_id, p.worker_id, p.method, error=one_line(exc), seconds=seconds,
                                              is_gone=is_gone(exc)), unanswered=isinstance(exc, ActorUnavailableError))
                else:
                    reply = self._noted(Reply(p.job_id, p.worker_id, p.method, value=p.future.result(),
                                              seconds=seconds))
            elif now - p.sent_at > p.timeout_s:
                self.handles.pop((p.job_id, p.worker_id), None)
                reply = self._noted(Reply(p.job_id, p.worker_id, p.method, error=f"no answer within {p.timeout_s:g} s",
                                          seconds=now - p.sent_at), unanswered=True)
                (log.debug if reply.quiet else log.warning)(
                    "job %s: worker %s did not answer %s within %.1f s", p.job_id, p.worker_id, p.method, p.timeout_s)
            else:
                waiting.append(p)
                continue
            try:
                p.on_reply(reply)
            except Exception:  # one job's handler (a boundary, logged with its id) never loses the other answers
                log.exception("job %s: handling %s's answer to %s failed", p.job_id, p.worker_id, p.method)
        self.pending = waiting + self.pending

    def _noted(self, reply: Reply, unanswered: bool = False) -> Reply:
        """Keep a gone worker's reply for take_gone; count a worker's unanswered commands in a row (`unanswered`:
        this one got no answer), marking the second and later quiet."""
        key = (reply.job_id, reply.worker_id)
        if reply.is_gone:
            self.gone.setdefault(reply.job_id, {})[reply.worker_id] = reply.error or "gone"
            self.unanswered.pop(key, None)
        elif unanswered:
            streak = self.unanswered.setdefault(key, [time.monotonic(), 0])
            reply.quiet = streak[1] > 0
            streak[1] += 1
        elif key in self.unanswered:  # it answered (a refusal is an answer too)
            since, count = self.unanswered.pop(key)
            log.info("job %s: worker %s answers again after %.1f s (%d commands unanswered)", reply.job_id,
                     reply.worker_id, time.monotonic() - since, count)
        return reply

    def take_gone(self, job_id: str) -> dict[str, str]:
        """The job's workers found gone since the last call: worker id -> the error that said so."""
        return self.gone.pop(job_id, {})

    def forget(self, job_id: str) -> None:
        """Drop a finished job's handles, unanswered commands and gone workers."""
        self.pending = [p for p in self.pending if p.job_id != job_id]
        self.handles = {k: h for k, h in self.handles.items() if k[0] != job_id}
        self.gone.pop(job_id, None)
        self.unanswered = {k: v for k, v in self.unanswered.items() if k[0] != job_id}
