"""`tlt serve` as a service (issue 34, items 3, 4 and 6): a real `tlt serve` subprocess with its private
redis-server and private Ray, real sockets and real signals. Slow (it starts Ray): one server for the module."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from scheduler.serve import HEADER_TIMEOUT_S
from workers.redis_server import free_port

START_TIMEOUT_S = 180.0  # Ray's start on a loaded 2-core box


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RAY_ADDRESS", "TLT_API_TOKEN")}
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "serve", "--host", "127.0.0.1", "--port",
                             str(port), "--gpus", "1", "--store-dir", str(tmp_path_factory.mktemp("drafts"))],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        log.seek(0)
        pytest.fail(f"tlt serve did not become ready: {log.read()[-3000:]}")
    try:
        yield proc, port, url, log
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def exchange(port: int, raw: bytes, timeout_s: float) -> tuple[bytes, float]:
    """Send `raw`, read until the server closes the connection; (what came back, seconds until the close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        t0 = time.monotonic()
        s.sendall(raw)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
        return got, time.monotonic() - t0


def test_both_framings_get_400_and_the_smuggled_request_is_never_answered(served):
    _, port, _, _ = served
    raw = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"0\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    got, _ = exchange(port, raw, timeout_s=10)
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert got.count(b"HTTP/1.1 ") == 1, got  # one answer, then the connection closed


def test_a_client_that_never_finishes_its_headers_is_dropped(served):
    _, port, _, _ = served
    with socket.create_connection(("127.0.0.1", port), timeout=HEADER_TIMEOUT_S + 20) as s:
        t0 = time.monotonic()
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        closed_at = None
        while time.monotonic() - t0 < HEADER_TIMEOUT_S + 15:  # a byte a second: uvicorn alone never dropped it
            try:
                s.sendall(b"X")
                if s.recv(1, socket.MSG_DONTWAIT) == b"":
                    closed_at = time.monotonic() - t0
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed_at = time.monotonic() - t0
                break
            time.sleep(1.0)
    assert closed_at is not None and closed_at < HEADER_TIMEOUT_S + 3, closed_at


def test_an_idle_keep_alive_connection_is_closed(served):
    _, port, _, _ = served
    got, seconds = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", timeout_s=30)
    assert got.startswith(b"HTTP/1.1 200 ") and seconds < 10, seconds


def test_the_scheduler_and_its_private_ray_listen_on_loopback_only(served):
    proc, _, _, _ = served
    tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    names = {p.pid: p.name() for p in tree}
    listening = {(names[c.pid], c.laddr.ip) for c in psutil.net_connections("tcp")
                 if c.status == "LISTEN" and c.pid in names}
    assert {name for name, _ in listening} >= {"gcs_server", "raylet"}, listening  # Ray's servers are in the tree
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening


def test_sigterm_finishes_requests_exits_0_and_leaves_no_process(served):
    proc, _, url, log = served
    tree = [proc] + [psutil.Process(p.pid) for p in psutil.Process(proc.pid).children(recursive=True)]
    assert any("redis-server" in " ".join(p.cmdline()) for p in tree[1:]), "no private redis-server in the tree"
    statuses: list[int] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=url, timeout=10) as client:
            while not stop.is_set():
                try:
                    statuses.append(client.get("/v1/jobs").status_code)
                except httpx.TransportError:  # refused once it stopped listening: the client retries elsewhere
                    time.sleep(0.05)

    pollers = [threading.Thread(target=poll, daemon=True) for _ in range(4)]
    for t in pollers:
        t.start()
    time.sleep(2.0)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    stop.set()
    for t in pollers:
        t.join(timeout=15)
    log.seek(0)
    assert code == 0, log.read()[-3000:]
    assert statuses and not [s for s in statuses if s >= 500], statuses
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(p.is_running() and p.status() != "zombie" for p in tree[1:]):
        time.sleep(0.2)
    left = [" ".join(p.cmdline())[:80] for p in tree[1:] if p.is_running() and p.status() != "zombie"]
    assert not left, left
