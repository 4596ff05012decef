"""`tlt serve`: the REST app under uvicorn, as a service one can leave running (docs/operations.md).

- Ray starts (or is joined) before uvicorn installs its signal handlers: ray.init sets a SIGTERM handler that
  raises SystemExit wherever the main thread is, which killed the scheduler inside a request (exit 134, 500s,
  reset connections). Started first, uvicorn's handlers replace it.
- SIGTERM or SIGINT: uvicorn stops accepting, finishes the requests in flight (GRACEFUL_SHUTDOWN_S at most),
  runs the app's shutdown; then a private Ray is shut down (its jobs end with it and resume from their
  checkpoints when the scheduler starts again), a joined cluster only disconnected (its jobs run on). Exit 0.
- Slow clients are dropped: a connection idle between requests after KEEP_ALIVE_S, one whose request line and
  headers are not complete HEADER_TIMEOUT_S after it opened (or after its last response) (GuardedH11Protocol).
- The private Ray advertises the address the API serves on (loopback by default), with no dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import ray
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from scheduler.app import create_app, init_ray
from scheduler.settings import Settings

log = logging.getLogger(__name__)
# a request line and headers are a few hundred bytes: a client on any link sends them in well under a second; one
# still sending them after this is holding a connection open (2,000 such were held for 60 s, issue 34)
HEADER_TIMEOUT_S = 10.0
KEEP_ALIVE_S = 5  # an idle keep-alive connection (uvicorn's default), so pollers reuse theirs between polls
# requests in flight at a SIGTERM are each under a second (the slowest, a 100,000-event page, a few); Kubernetes
# sends SIGKILL 30 s after SIGTERM by default
GRACEFUL_SHUTDOWN_S = 20


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header-read timeout: the connection closes unless a request's line and
    headers are complete HEADER_TIMEOUT_S after it opened or after its last response (uvicorn has none; its
    keep-alive timer stops at the first byte of the next request, so a client dribbling bytes held it forever)."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
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
        if self.cycle is not cycle and self._header_timer is not None:  # a request's headers are complete
            self._header_timer.cancel()
            self._header_timer = None

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


class Server(uvicorn.Server):
    """uvicorn's server, without re-raising the signal that stopped it: the shutdown it asked for is done, so
    the process exits 0 (uvicorn re-raises it under the previous handler, which killed the process with it)."""

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
