"""Joining a standalone Ray cluster that fails says why: Ray's own error ("Failed to connect to Ray cluster")
is the same whether nothing listens at the address or the cluster's GCS refuses a process without its token.

Real parts: a `ray start --head` with token authentication (its own temp dir and ports, stopped by killing
exactly its processes), and `tlt serve --ray-address` as a subprocess. The hint's logic against a closed port
and an open one is checked without Ray.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from scheduler.app import join_hint
from tests.scheduler.test_multinode import start_node
from workers.redis_server import PrivateRedis, free_port

TLT = str(Path(sys.executable).with_name("tlt"))


def test_the_hint_tells_a_closed_port_from_a_gcs_that_refused_the_token():
    closed = free_port()
    assert "nothing accepts connections at 127.0.0.1:" in join_hint(f"127.0.0.1:{closed}", {})
    with socket.create_server(("127.0.0.1", 0)) as server:  # something answers: the token is what was refused
        address = f"127.0.0.1:{server.getsockname()[1]}"
        assert "which has no Ray token" in join_hint(address, {}) and "RAY_AUTH_TOKEN" in join_hint(address, {})
        assert "is RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) the cluster's token" in join_hint(
            address, {"RAY_AUTH_MODE": "token"})
    assert "RAY_AUTH_MODE=token" in join_hint("ray://head:10001", {})  # Ray Client: no probe, both causes named


def test_serve_without_the_clusters_token_names_token_authentication():
    temp_dir = tempfile.mkdtemp(prefix="tlt-auth-", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    head = start_node("head", ["--head", f"--port={port}", "--include-dashboard=false",
                               f"--ray-client-server-port={free_port()}"], temp_dir,
                      env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)})
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        with PrivateRedis() as redis_server:
            out = subprocess.run([TLT, "serve", "--port", str(free_port()), "--ray-address", f"127.0.0.1:{port}",
                                  "--store-dir", f"{temp_dir}/drafts"],
                                 env=env | {"REDIS_URL": redis_server.url, "RAY_USAGE_STATS_ENABLED": "0"},
                                 capture_output=True, text=True, timeout=180)
    finally:
        head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert out.returncode != 0
    assert f"cannot join the Ray cluster at '127.0.0.1:{port}'" in out.stderr, out.stderr[-3000:]
    assert "refused this process, which has no Ray token" in out.stderr, out.stderr[-3000:]
