"""`tlt serve` as a service (issue 34, items 3, 4 and 6; issue 42): a real `tlt serve` subprocess with its private
redis-server and private Ray, real sockets and real signals. Slow (it starts Ray): one server for the module, and
their own for the restarts. The probes are the bench's (bench/faults_service.py, faults_sockets.py,
faults_restart.py): `tlt bench faults` reports the same counts."""

from __future__ import annotations

import signal

import psutil
import pytest

from bench.faults_restart import restart_with_queue
from bench.faults_service import MAX_EXIT_S, job_with_steps, served, sigterm
from bench.faults_sockets import exchange, slow_clients, smuggling, stalled_body
from scheduler.jobs import JobStore
from scheduler.queue import MAX_UNPLACEABLE_S
from scheduler.serve import BODY_TIMEOUT_S, HEADER_TIMEOUT_S
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


def test_a_body_stopping_short_of_its_content_length_gets_408_and_is_closed(server):
    _, port, _, _ = server
    held = stalled_body(port)  # 10 of 100 bytes, then nothing: held open past 40 s before issue 42
    assert held["status"] == 408 and "body not complete" in held["answer"], held
    assert BODY_TIMEOUT_S - 1 < held["held_s"] < BODY_TIMEOUT_S + 5, held


def test_an_idle_keep_alive_connection_is_closed(server):
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



def test_a_restart_gives_the_resumed_job_its_gpu_before_the_queue_and_a_group_sigterm_is_quick(tmp_path):
    """Issue 42, items 1 and 5. One GPU: A runs, B and D wait QUEUED; SIGTERM, and a scheduler started again on the
    same Redis finds no driver and no placement group on its new private Ray. A gets its GPU back first (never
    two RUNNING jobs on the one GPU; B and D stay QUEUED) and finishes a new step; then SIGTERM to the new
    scheduler's whole process group (its Redis-less children and Ray's get it too) exits 0 as quickly as the
    scheduler alone, and leaves no process."""
    with PrivateRedis() as redis:
        result = restart_with_queue(tmp_path, redis.url)
    log = (tmp_path / "serve.log").read_text()
    assert result["first_exit_code"] == 0 and result["queued_before"] == ["QUEUED", "QUEUED"], result
    assert result["gpus_overcommitted"] == 0, result
    assert all(states == ["QUEUED"] for states in result["queued_states_seen"].values()), result
    assert result["resumed_progress_s"] is not None and result["resumed_progress_s"] <= MAX_UNPLACEABLE_S, (
        result, log[-3000:])
    assert "placed again: its new driver starts" in log, log[-3000:]
    group = result["group_sigterm"]
    assert group["sigterm_exit_code"] == 0 and group["processes_left_after_exit"] == 0, group
    # quick, not timed: the 10 s figure is `tlt bench faults`' (sigterm_group_exit_s); a loaded CI box took 13 s here
    assert group["exit_s"] < MAX_EXIT_S and group["sigterm_5xx"] == 0, group


def test_sigterm_to_the_whole_process_group_exits_as_quickly_and_cleanly(tmp_path):
    """Issue 42, item 5: systemd and a terminal signal the process group: its private redis-server and Ray's
    processes get SIGTERM at the same moment as the scheduler. It took 17.7 s to exit (Ray's driver waiting 5 s to
    flush task events to a GCS already gone, among others), against 3.4 s for the scheduler alone."""
    with served(tmp_path) as (proc, _, url, log):
        result = sigterm(proc, url, is_group=True)
        log.seek(0)
        assert {"redis-server", "raylet", "gcs_server", "ray::JobDriver"} <= set(result["process_names"]), result
        assert result["sigterm_exit_code"] == 0, log.read()[-3000:]
    assert result["exit_s"] < MAX_EXIT_S and result["processes_left_after_exit"] == 0, result  # the figure: the bench's
