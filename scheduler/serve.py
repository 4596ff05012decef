"""`tlt serve`: the REST app under uvicorn, as a service one can leave running (docs/operations.md).

- Ray starts (or is joined) before uvicorn installs its signal handlers: ray.init sets a SIGTERM handler that
  raises SystemExit wherever the main thread is, which killed the scheduler inside a request (exit 134, 500s,
  reset connections). Started first, uvicorn's handlers replace it.
- SIGTERM or SIGINT: uvicorn stops accepting, finishes the requests in flight (GRACEFUL_SHUTDOWN_S at most),
  runs the app's shutdown; then a private Ray is shut down (its jobs end with it and resume from their
  checkpoints when the scheduler starts again), a joined cluster only disconnected (its jobs run on). Exit 0.
- Slow clients are dropped: a connection idle between requests after KEEP_ALIVE_S, one whose request line and
  headers are not complete HEADER_TIMEOUT_S after it opened (or after its last response), and one whose body is
  not complete BODY_TIMEOUT_S after its headers (a 408 first) (GuardedH11Protocol).
- SIGTERM to the whole process group (systemd, a terminal's process group) reaches the private redis-server and
  Ray's processes too: Ray's driver then waits RAY_FLUSH_TIMEOUT_MS, not Ray's 5 s, for a GCS that is gone.
- The private Ray advertises the address the API serves on (loopback by default), with no dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal

import h11
import ray
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from scheduler.app import create_app, init_ray
from scheduler.settings import Settings

log = logging.getLogger(__name__)
# a request line and headers are a few hundred bytes: a client on any link sends them in well under a second; one
# still sending them after this is holding a connection open (2,000 such were held for 60 s, issue 34)
HEADER_TIMEOUT_S = 10.0
# a body is at most 64 KiB (http_errors.MAX_BODY_BYTES): 6 s at 10 KB/s, the slowest link a client uses; one
# still unsent after this is holding a connection open (a POST declaring 100 bytes and sending 10 was held 40 s)
BODY_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # an idle keep-alive connection (uvicorn's default), so pollers reuse theirs between polls
# requests in flight at a SIGTERM are each under a second (the slowest, a 100,000-event page, a few); Kubernetes
# sends SIGKILL 30 s after SIGTERM by default
GRACEFUL_SHUTDOWN_S = 20
# how long Ray's driver in this process flushes its task events at shutdown (Ray's task_events_shutdown_flush_
# timeout_ms, 5,000 by default). A GCS that answers takes them in milliseconds; one SIGTERMed with the process group
# never answers, and the shutdown waited the whole 5 s for it (issue 42: 17.7 s to exit, against 3.4 s)
RAY_FLUSH_TIMEOUT_ENV = "RAY_task_events_shutdown_flush_timeout_ms"
RAY_FLUSH_TIMEOUT_MS = 500


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read timeouts: the connection closes unless a request's line and headers are
    complete HEADER_TIMEOUT_S after it opened or after its last response, and its body BODY_TIMEOUT_S after its
    headers (answered 408 first). uvicorn has neither: its keep-alive timer stops at the first byte of the next
    request, so a client dribbling bytes, or stopping short of its Content-Length, held it forever."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a request's headers are complete: its body has body_timeout_s
            self._cancel_timers()
            if self.cycle.more_body and not self.transport.is_closing():
                self._body_timer = self.loop.call_later(self.body_timeout_s, self._on_body_timeout)
        elif self._body_timer is not None and not self.cycle.more_body:  # the body is complete
            self._body_timer.cancel()
            self._body_timer = None

    def _on_body_timeout(self) -> None:
        """408 (unless the app has begun answering) and close: what follows on the connection is never read."""
        self._body_timer = None
        if self.transport.is_closing():
            return
        if not self.cycle.response_started:
            body = json.dumps({"detail": f"request body not complete {self.body_timeout_s:.0f} s after its "
                                         f"headers"}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            self.cycle.response_started = True  # the app's own answer, if it ever makes one, is not sent
            try:
                for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            except h11.LocalProtocolError:  # h11 would not frame it here: close without an answer
                pass
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def _cancel_timers(self) -> None:
        for name in ("_header_timer", "_body_timer"):
            if (timer := getattr(self, name)) is not None:
                timer.cancel()
                setattr(self, name, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)


class Server(uvicorn.Server):
    """uvicorn's server, without re-raising the signal that stopped it: the shutdown it asked for is done, so
    the process exits 0 (uvicorn re-raises it under the previous handler, which killed the process with it).
    At the signal, before the requests in flight finish, the app's launcher lets go of its jobs' drivers
    (Launcher.let_go): Redis and Ray may be going at the same moment (a process-group SIGTERM)."""

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        launcher = getattr(getattr(self.config.app, "state", None), "launcher", None)
        if launcher is not None:
            launcher.let_go()

    @contextlib.contextmanager
    def capture_signals(self):
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def server_config(app, host: str, port: int) -> uvicorn.Config:
    """uvicorn's settings for `tlt serve`: h11 with the header timeout, the keep-alive and shutdown bounds."""
    return uvicorn.Config(app, host=host, port=port, http=GuardedH11Protocol, timeout_keep_alive=KEEP_ALIVE_S,
                          timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, log_level="info")


def serve(settings: Settings, host: str, port: int) -> int:
    """Run the API until SIGTERM or SIGINT, then stop as the module says. Returns the exit status."""
    os.environ.setdefault(RAY_FLUSH_TIMEOUT_ENV, str(RAY_FLUSH_TIMEOUT_MS))  # read as Ray's driver starts
    init_ray(settings)  # before uvicorn's handlers: they replace Ray's
    app = create_app(settings)
    server = Server(server_config(app, host, port))
    try:
        server.run()
    finally:
        if ray.is_initialized():
            is_private = settings.ray_address is None
            log.info("stopping: %s", "shutting down the private Ray" if is_private else
                     "leaving the Ray cluster (its jobs run on)")
            ray.shutdown()
    return 0 if server.started else 1
