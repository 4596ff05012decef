"""`tlt serve` as a service (issue 34, items 3, 4 and 6): a real `tlt serve` subprocess with its private
redis-server and private Ray, real sockets and real signals. Slow (it starts Ray): one server for the module.
The probes are the bench's (bench/faults_service.py): `tlt bench faults` reports the same counts."""

from __future__ import annotations

import psutil
import pytest

from bench.faults_service import served, sigterm, slow_clients, smuggling
from scheduler.serve import HEADER_TIMEOUT_S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("serve")) as running:
        yield running


def test_both_framings_get_400_and_the_smuggled_request_is_never_answered(server):
    _, port, _, _ = server
    assert smuggling(port) == {"status": 400, "num_answers": 1}  # one answer, then the connection closed


def test_a_client_that_never_finishes_its_headers_is_dropped(server):
    _, port, _, _ = server
    held = slow_clients(port, num_clients=20, wait_s=HEADER_TIMEOUT_S + 3)  # a byte a second: uvicorn alone kept them
    assert held["num_held"] == 0, held


def test_an_idle_keep_alive_connection_is_closed(server):
    from bench.faults_service import exchange

    _, port, _, _ = server
    got, seconds = exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", timeout_s=30)
    assert got.startswith(b"HTTP/1.1 200 ") and seconds < 10, seconds


def test_the_scheduler_and_its_private_ray_listen_on_loopback_only(server):
    proc, _, _, _ = server
    tree = psutil.Process(proc.pid).children(recursive=True) + [psutil.Process(proc.pid)]
    names = {p.pid: p.name() for p in tree}
    listening = {(names[c.pid], c.laddr.ip) for c in psutil.net_connections("tcp")
                 if c.status == "LISTEN" and c.pid in names}
    assert {name for name, _ in listening} >= {"gcs_server", "raylet"}, listening  # Ray's servers are in the tree
    assert {ip for _, ip in listening} <= {"127.0.0.1", "::ffff:127.0.0.1", "::1"}, listening


def test_sigterm_finishes_requests_exits_0_and_leaves_no_process(server):
    proc, _, url, log = server
    result = sigterm(proc, url)
    log.seek(0)
    assert result["has_private_redis"], "no private redis-server in the tree"
    assert result["sigterm_exit_code"] == 0, log.read()[-3000:]
    assert result["num_requests"] > 0 and result["sigterm_5xx"] == 0, result
    assert result["processes_left_after_exit"] == 0, result["left"]
