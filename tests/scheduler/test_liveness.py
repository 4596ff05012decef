"""Liveness without Redis (issue 34, item 5): /healthz answers at once while Redis hangs and Redis-bound
requests fill the server's thread pool. A real uvicorn server, a real redis-server stopped with SIGSTOP."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import httpx
import uvicorn

from scheduler.app import Settings, create_app
from workers.redis_server import PrivateRedis

NUM_HUNG = 60  # more than the thread pool's 40 workers: every sync route queues behind Redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_healthz_answers_while_redis_hangs(tmp_path):
    with PrivateRedis() as redis:
        app = create_app(Settings(redis_url=redis.url, store_dir=str(tmp_path), start_ray=False, watch=False))
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.started
        os.kill(redis.proc.pid, signal.SIGSTOP)
        hung = [threading.Thread(target=lambda: httpx.get(f"{url}/v1/jobs", timeout=60), daemon=True)
                for _ in range(NUM_HUNG)]
        try:
            for t in hung:
                t.start()
            time.sleep(1.0)  # every pool thread now waits on Redis
            latencies = []
            with httpx.Client(base_url=url, timeout=5) as client:
                for _ in range(50):
                    t0 = time.perf_counter()
                    assert client.get("/healthz").json() == {"status": "ok"}
                    latencies.append(time.perf_counter() - t0)
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        for t in hung:
            t.join(timeout=60)
        server.should_exit = True
        thread.join(timeout=30)
    latencies.sort()
    assert latencies[int(0.99 * len(latencies))] < 0.1, latencies[-5:]
