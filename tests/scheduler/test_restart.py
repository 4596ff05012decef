"""The scheduler process is killed (SIGKILL) while a job runs and a lease is open, and started again:
the job finishes with its record intact, and no lease or draft version is lost.

Real parts only: a Ray cluster started with `ray start` (jobs must outlive the scheduler, so it
cannot be the scheduler's in-process Ray), a private redis-server, `tlt serve` as a subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from drafter.model.config import PRESETS
from drafter.model.loading import random_model, save_hf_dir
from workers.protocol.keys import drafts_index_key, job_steps_key, job_tlt_key
from workers.redis_server import PrivateRedis, free_port

RAY = str(Path(sys.executable).with_name("ray"))
SPEC = {"num_steps": 12, "num_prompts_per_step": 3, "group_size": 4, "max_new_tokens": 300, "num_workers": 2,
        "draft_k": 2}


def get(url: str) -> dict | list:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def cluster():
    """A standalone Ray head of its own (4 logical GPUs on 2 CPUs, its own temp dir), stopped at the
    end by signalling its process group: other Ray instances on the machine are left alone."""
    port = free_port()
    temp_dir = tempfile.mkdtemp(prefix="tlt-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}  # loopback-only test cluster
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={port}", "--num-cpus=2", "--num-gpus=4",
                             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp_dir}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:  # the GCS answers on its port once the head is up
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"ray start --head did not come up (exit code {head.poll()})") from None
                time.sleep(0.3)
        yield f"127.0.0.1:{port}"
    finally:
        # `ray start --block` outlived SIGTERM's 30 s in CI (a teardown of 30.05 s): 5 s, then SIGKILL
        for sig, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
            try:
                os.killpg(head.pid, sig)  # the head, its raylet and GCS, and the workers they started
            except ProcessLookupError:
                break
            try:
                head.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(temp_dir, ignore_errors=True)


def serve(redis_url: str, ray_address: str, port: int, store_dir: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "REDIS_URL": redis_url, "TLT_WATCH_TICK_S": "0.05",
           "TLT_POLICY_MIN_LEASE_S": "0.05",
           "TLT_POLICY_MIN_BUFFER_TOKENS": "16",
           "TLT_MODEL_ROOTS": str(Path(store_dir).parent)}  # the test's model directory sits beside the store
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.cli", "serve", "--port", str(port), "--ray-address",
                             ray_address, "--store-dir", store_dir], env=env, stdout=log.open("ab"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if get(f"http://127.0.0.1:{port}/readyz")["status"] == "ready":
                return proc
        except (OSError, ValueError):  # not listening yet, or (once in CI) an empty answer while starting
            time.sleep(0.3)
    proc.kill()
    raise AssertionError(f"scheduler did not become ready:\n{log.read_text()[-3000:]}")


def test_killed_scheduler_restarts_and_the_job_finishes_intact(cluster, tmp_path):
    cfg = dataclasses.replace(PRESETS["tiny"], eos_token_ids=(0,))  # natural long tails (see test_watcher)
    save_hf_dir(random_model(cfg, init_seed=0), None, tmp_path / "tiny-eos")
    port, log = free_port(), tmp_path / "scheduler.log"
    base = f"http://127.0.0.1:{port}"
    with PrivateRedis() as redis_server:
        r = redis_server.client()
        proc = serve(redis_server.url, cluster, port, str(tmp_path / "drafts"), log)
        try:
            before = post(f"{base}/v1/jobs", SPEC | {"model": str(tmp_path / "tiny-eos")})
            job_id = before["job_id"]
            # kill it in the middle of the job while a drafter lease is open. Leases open only in a step whose
            # workers finish apart (sampled lengths, and the drafts served change the sampled stream): in one CI
            # run 7 of 8 steps had none, so the job has steps enough for a lease to open before its last two
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                state = r.hget(job_tlt_key(job_id), "state")
                open_leases = json.loads(state)["leases"] if state else {}
                if open_leases and 1 <= r.llen(job_steps_key(job_id)) < SPEC["num_steps"] - 2:
                    break
                time.sleep(0.02)
            else:
                raise AssertionError(f"no lease opened mid-job ({r.llen(job_steps_key(job_id))} steps recorded):\n"
                                     f"{log.read_text()[-3000:]}")
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
            open_lease = next(iter(open_leases.values()))["lease_id"]
            served_before = get_versions(r, job_id)
            proc = serve(redis_server.url, cluster, port, str(tmp_path / "drafts"), log)
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline:
                after = get(f"{base}/v1/jobs/{job_id}")
                if after["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"):
                    break
                time.sleep(0.5)
            assert after["state"] == "SUCCEEDED", after
            assert after["steps"] == SPEC["num_steps"] and after["created_at"] == before["created_at"]
            assert after["spec"] == before["spec"]
            assert r.llen(job_steps_key(job_id)) == SPEC["num_steps"]  # every step recorded once
            drafts = get(f"{base}/v1/jobs/{job_id}/drafts")
            # no draft version lost: everything served before the kill is still indexed
            assert set(served_before) <= {v["version"] for v in drafts["versions"]}
            # no lease lost: the open lease was collected by the new process; its copy (if it trained) merged
            text = log.read_text()
            assert f"lease {open_lease} on" in text, text[-3000:]
            copies = {json.loads(v)["extra"].get("lease_id"): int(k)
                      for k, v in r.hgetall(drafts_index_key(f"{job_id}:copies")).items()}
            if open_lease in copies:
                assert any(copies[open_lease] in d["merged"] for d in drafts["decisions"]), drafts["decisions"]
            assert "reattached" in text
        finally:
            proc.kill()
            proc.wait(30)


def get_versions(r, job_id: str) -> list[int]:
    return [int(v) for v in r.hkeys(drafts_index_key(job_id))]
