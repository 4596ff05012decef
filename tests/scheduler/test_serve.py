"""`tlt serve` as a service (issue 34, items 3, 4 and 6): a real `tlt serve` subprocess with its private
redis-server and private Ray, real sockets and real signals. Slow (it starts Ray): one server for the module.
The probes are the bench's (bench/faults_service.py): `tlt bench faults` reports the same counts."""

from __future__ import annotations

import signal

import psutil
import pytest

from bench.faults_service import MAX_EXIT_S, job_with_steps, served, sigterm, slow_clients, smuggling
from scheduler.jobs import JobStore
from scheduler.serve import HEADER_TIMEOUT_S
from workers.protocol.keys import job_result_key, job_steps_key
from workers.protocol.states import JobState
from workers.redis_server import PrivateRedis


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


def test_sigterm_with_a_job_running_finishes_requests_exits_0_and_leaves_no_process(server):
    proc, _, url, log = server
    result = sigterm(proc, url)  # a job mid-run, four clients polling it
    log.seek(0)
    assert {"redis-server", "raylet", "gcs_server", "ray::JobDriver"} <= set(result["process_names"]), result
    assert result["sigterm_exit_code"] == 0, log.read()[-3000:]
    assert result["exit_s"] < MAX_EXIT_S and result["steps_at_signal"] >= 1, result
    assert result["num_requests"] > 0 and result["sigterm_5xx"] == 0, result
    assert result["processes_left_after_exit"] == 0, result["left"]


def test_sigint_leaves_the_job_running_in_redis_and_a_restart_resumes_it(tmp_path):
    """The private Ray's shutdown ends the job's driver mid-step: the job stays RUNNING with no result (not
    FAILED), and a scheduler started again on the same Redis resumes it from its policy checkpoint; a signal to
    that one, with the resumed driver's thread following it, is graceful too."""
    with PrivateRedis() as redis:
        with served(tmp_path, redis_url=redis.url) as (proc, _, url, log):
            first = sigterm(proc, url, sig=signal.SIGINT)
        log_text = (tmp_path / "serve.log").read_text()
        assert first["sigterm_exit_code"] == 0 and first["sigterm_5xx"] == 0, log_text[-3000:]
        assert first["processes_left_after_exit"] == 0, first["left"]
        job_id, client = first["job_id"], redis.client()
        num_steps = client.llen(job_steps_key(job_id))
        assert JobStore(client).get(job_id)["state"] == JobState.RUNNING
        assert client.get(job_result_key(job_id)) is None  # no end recorded: the next scheduler resumes it
        with served(tmp_path, redis_url=redis.url) as (proc, _, url, log):
            job = job_with_steps(url, job_id, num_steps + 1)  # resumed: RUNNING, and a step more
            assert job["error"] is None, job
            again = sigterm(proc, url, job=job)
        assert again["sigterm_exit_code"] == 0 and again["processes_left_after_exit"] == 0, again

