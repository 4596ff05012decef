"""A real two-node Ray cluster on this machine: a job's rollout workers land on both nodes and the job
finishes; then the second node is killed mid-step: the job runs on degraded on the head's workers, keeps the
steps it finished, and succeeds with a warning naming the workers it lost.

Real parts only: a Ray head and a second Ray node, each its own `ray start` process with its own temp
dir and 2 logical GPUs (Ray supports a temp dir per node; the two share the cluster's session name),
a private redis-server, `tlt serve --ray-address` as a subprocess. A 4-worker job needs a GPU on
both nodes. Where each actor runs is read from Ray's state API (the head runs the dashboard, which
serves it; dead actors stay listed with their node). Teardown signals only the processes below the
two `ray start` processes this module started (never `ray stop`: other Ray clusters run on this
machine).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from ray.util.state import list_actors, list_nodes

from scheduler.launcher import MAX_UNPLACEABLE_S, Launcher
from scheduler.settings import Settings
from tests.scheduler.test_restart import get, post, serve
from workers.protocol.keys import job_phase_key, job_result_key
from workers.protocol.messages import JobResult, PhaseRecord
from workers.protocol.states import JobState, Phase
from workers.redis_server import PrivateRedis, free_port

RAY = str(Path(sys.executable).with_name("ray"))
NUM_GPUS_PER_NODE = 2  # logical; a job of 2 * NUM_GPUS_PER_NODE workers needs both nodes
NUM_WORKERS = 2 * NUM_GPUS_PER_NODE
SPEC = {"model": "tiny", "num_workers": NUM_WORKERS, "num_prompts_per_step": 4, "group_size": 2,
        "max_new_tokens": 24}
TERMINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
# the GCS declares a node dead after failure_threshold missed health checks (default 5 x 3 s): sooner here
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",  # a loopback-only test cluster
           "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
           "RAY_health_check_failure_threshold": "3"}


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name field may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


@dataclass
class Node:
    """One `ray start --block` process (its own session: its group holds the raylet and its helpers)."""

    name: str
    proc: subprocess.Popen
    log: Path

    def kill(self) -> None:
        """SIGKILL the node: `ray start`, its raylet and helpers, and the actor processes below the raylet
        (each in a process group of its own). Read first: once the raylet dies they are no longer below it."""
        pids = process_tree(self.proc.pid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(30)


def start_node(name: str, args: list[str], temp_dir: str, env: dict[str, str] | None = None) -> Node:
    """`ray start --block` with its own temp dir and ports (`env` over RAY_ENV); returns once the node is
    registered with the GCS (`ray start` prints "Ray runtime started." only then)."""
    log = Path(temp_dir) / f"{name}.log"
    ports = [f"--dashboard-agent-listen-port={free_port()}", "--min-worker-port=0", "--max-worker-port=0"]
    proc = subprocess.Popen([RAY, "start", "--block", f"--num-gpus={NUM_GPUS_PER_NODE}", "--num-cpus=1",
                             "--disable-usage-stats", f"--temp-dir={temp_dir}/{name}", *ports, *args],
                            env={**os.environ, **RAY_ENV, **(env or {})}, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    node = Node(name, proc, log)
    deadline = time.monotonic() + 120
    while "Ray runtime started." not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            node.kill()
            raise AssertionError(f"ray start ({name}) did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.3)
    return node


@dataclass
class Cluster:
    address: str  # the GCS, for `tlt serve --ray-address`
    dashboard: str  # the state API's URL
    nodes: dict[str, Node]  # "head", "node2"

    def placement(self, prefix: str) -> dict[str, str]:
        """Actor name -> the node it was placed on ("head" or "node2"), for the actors whose name starts with
        `prefix`, live or dead; one not placed yet (waiting for a GPU) is left out."""
        names = {n.node_id: "head" if n.is_head_node else "node2" for n in list_nodes(self.dashboard)}
        return {a.name: names[a.node_id] for a in list_actors(self.dashboard, limit=10_000)
                if a.name.startswith(prefix) and a.node_id in names}

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Until no job actor (driver or worker) is alive or waiting to be placed: an earlier job's are killed
        once it has ended, and go away a moment later."""
        deadline = time.monotonic() + timeout_s
        while any(a.name.startswith("tlt-") and a.state != "DEAD" for a in list_actors(self.dashboard, limit=10_000)):
            if time.monotonic() > deadline:
                raise AssertionError("an earlier job's actors are still alive")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def cluster():
    """A head and a second node, 2 logical GPUs each. Stopped at the end by killing exactly the
    processes below the two `ray start` processes."""
    temp_dir = tempfile.mkdtemp(prefix="tlt-mn-", dir="/tmp")  # short: Ray's socket paths live under it
    nodes: dict[str, Node] = {}
    try:
        port, dashboard_port = free_port(), free_port()
        nodes["head"] = start_node("head", ["--head", f"--port={port}", "--include-dashboard=true",
                                            "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
                                            f"--ray-client-server-port={free_port()}"], temp_dir)
        nodes["node2"] = start_node("node2", [f"--address=127.0.0.1:{port}"], temp_dir)
        cluster = Cluster(f"127.0.0.1:{port}", f"http://127.0.0.1:{dashboard_port}", nodes)
        deadline = time.monotonic() + 60
        while True:  # the dashboard serves the state API a little after the head is up
            try:
                if sum(n.state == "ALIVE" for n in list_nodes(cluster.dashboard)) == 2:
                    break
            except Exception:  # noqa: BLE001 - not serving yet
                pass
            if time.monotonic() > deadline:
                raise AssertionError("the state API does not list both nodes alive")
            time.sleep(0.5)
        yield cluster
    finally:
        for node in nodes.values():
            node.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def scheduler(cluster, tmp_path_factory):
    """`tlt serve --ray-address` on the cluster, with a private Redis: (base URL, redis client, log)."""
    tmp = tmp_path_factory.mktemp("multinode")
    port, log = free_port(), tmp / "scheduler.log"
    with PrivateRedis() as redis_server:
        proc = serve(redis_server.url, cluster.address, port, str(tmp / "drafts"), log)
        try:
            yield f"http://127.0.0.1:{port}", redis_server.client(), log
        finally:
            proc.kill()
            proc.wait(30)


def wait_end(base: str, job_id: str, timeout_s: float, log: Path) -> dict:
    """The job once it is terminal."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = get(f"{base}/v1/jobs/{job_id}")
        if job["state"] in TERMINAL:
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not end in {timeout_s} s: {job}\n{log.read_text()[-3000:]}")


def test_job_runs_on_both_nodes_and_finishes(cluster, scheduler):
    base, _, log = scheduler
    job_id = post(f"{base}/v1/jobs", SPEC | {"num_steps": 2})["job_id"]
    job = wait_end(base, job_id, 180, log)
    assert job["state"] == JobState.SUCCEEDED, job
    assert job["steps"] == 2 and job["warning"] is None, job
    steps = get(f"{base}/v1/jobs/{job_id}/steps")
    assert [s["rl_step"] for s in steps] == [0, 1]
    assert all(s["failures"] == [] and s["num_rollouts"] == 8 for s in steps), steps
    # each node ran as many of the job's workers as it has GPUs: both took part
    placed = cluster.placement(f"tlt-worker-{job_id}-")
    assert sorted(placed) == [f"tlt-worker-{job_id}-w{i}" for i in range(NUM_WORKERS)], placed
    assert sorted(placed.values()) == ["head"] * NUM_GPUS_PER_NODE + ["node2"] * NUM_GPUS_PER_NODE, placed


def test_losing_a_node_mid_step_runs_on_degraded_and_keeps_finished_steps(cluster, scheduler):
    """The second node is killed (every process of it, SIGKILL) during step 1's rollout; it held two of the
    job's four workers, and perhaps its driver (Ray places a driver, which needs no resources, on either node).
    - Driver on the head: the lost workers' share of the step is lost, the step finishes on the head's two and
      its record names the lost workers under `failures`.
    - Driver on node2: it dies with the node; the launcher starts a new one from the policy checkpoint
      (`checkpoint_every: 1`), which resumes after the last recorded step; the two workers Ray cannot place
      (2 GPUs left for 4) are dropped at its start instead of waited for.
    Either way the lost slots cannot be filled again; the driver's bounded wait gives them up at once (the
    workers it has fill the cluster's GPUs), and the job, still finishing steps, is not failed by the
    launcher's grace rule (MAX_UNPLACEABLE_S): it succeeds on two workers, every step it finished before the
    kill kept, with a warning naming the two workers not running at the end."""
    base, redis, log = scheduler
    cluster.wait_idle()  # the first job's workers hold no GPU any more: this one's land two per node
    spec = SPEC | {"num_steps": 6, "max_new_tokens": 200, "checkpoint_every": 1}
    job_id = post(f"{base}/v1/jobs", spec)["job_id"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # mid-step: step 1's rollout, step 0 recorded
        raw = redis.get(job_phase_key(job_id))
        phase = PhaseRecord.from_json(raw) if raw else None
        if phase is not None and phase.phase == Phase.ROLLOUT and phase.rl_step >= 1:
            break
        time.sleep(0.02)
    else:
        raise AssertionError(f"job {job_id} never reached step 1's rollout:\n{log.read_text()[-3000:]}")
    placed = cluster.placement(f"tlt-worker-{job_id}-")
    lost = {name.rsplit("-", 1)[1] for name, node in placed.items() if node == "node2"}
    assert len(lost) == NUM_GPUS_PER_NODE, placed
    driver_node = cluster.placement(f"tlt-driver-{job_id}")[f"tlt-driver-{job_id}"]
    before = get(f"{base}/v1/jobs/{job_id}/steps")
    cluster.nodes["node2"].kill()
    job = wait_end(base, job_id, MAX_UNPLACEABLE_S + 120, log)
    after = get(f"{base}/v1/jobs/{job_id}/steps")
    assert before and after[:len(before)] == before, (before, after)  # nothing finished is lost
    assert job["state"] == JobState.SUCCEEDED and job["error"] is None, (job["error"], job.get("warning"))
    assert job["steps"] == len(after) == spec["num_steps"], job
    assert [s["rl_step"] for s in after] == list(range(spec["num_steps"]))
    down = re.search(r"; (w\d), (w\d) not running at the end \(2 of 4 workers\)$", job["warning"] or "")
    assert down is not None, job["warning"]
    assert all(len(s["worker_rollout_s"]) == NUM_GPUS_PER_NODE for s in after[-2:]), after[-2:]  # degraded
    if driver_node == "head":  # the step the node died in finished on the head, and names the lost workers
        assert {f["worker"] for s in after[len(before):] for f in s["failures"]} == lost, after[len(before):]
        assert set(down.groups()) == lost, job["warning"]
        assert job["warning"].startswith("rollout workers lost: "), job["warning"]
    else:
        text = log.read_text()  # one new driver, placed once the node was known dead (not on the dying node)
        assert "its driver is gone; starting a new one from its policy checkpoint (restart 1 of" in text
        assert "(restart 2 of" not in text
        assert job["warning"].startswith("driver lost, resumed from its policy checkpoint after step "), job
        assert " at start (not placed)" in job["warning"], job["warning"]


class OneJob:
    """The little of a JobStore that Launcher.check_placeable reads: one RUNNING job of 4 workers, 3 steps."""

    def __init__(self) -> None:
        self.record = {"state": JobState.RUNNING.value, "spec": {"num_workers": NUM_WORKERS}}
        self.redis: dict[str, str] = {}  # key -> value: the job's result, once it has one
        self.steps = 3

    def get(self, job_id: str) -> dict:
        return self.record

    def num_steps(self, job_ids: list[str]) -> list[int]:
        return [self.steps]


def test_a_job_the_cluster_cannot_hold_fails_only_after_the_grace_without_a_step(monkeypatch):
    """The rule the node-loss test drives for real, at its edges, without Ray: a shortage starts the clock,
    GPUs back reset it, a step finished restarts it (the job runs degraded), and a job that ended, or was
    cancelled, is never failed for it."""
    gpus = [NUM_WORKERS]
    monkeypatch.setattr(Launcher, "cluster_gpus", staticmethod(lambda: gpus[0]))
    store = OneJob()
    check = Launcher(store, Settings(redis_url="redis://unused")).check_placeable
    assert check("j", None, 100.0) == (None, None)  # enough GPUs
    gpus[0] = NUM_GPUS_PER_NODE  # a node lost
    assert check("j", None, 100.0) == ((100.0, 3), None)  # the clock starts, at 3 steps
    assert check("j", (100.0, 3), 100.0 + MAX_UNPLACEABLE_S - 1) == ((100.0, 3), None)
    short, line = check("j", (100.0, 3), 100.0 + MAX_UNPLACEABLE_S)
    assert short == (100.0, 3) and line == (f"the Ray cluster has had {NUM_GPUS_PER_NODE} GPUs for "
                                            f"{MAX_UNPLACEABLE_S:.0f} s, fewer than the {NUM_WORKERS} its "
                                            f"{NUM_WORKERS} rollout workers ask (a node lost?), and no step "
                                            f"finished: stopped after 3 steps, kept")
    store.steps = 4  # a step finished on the workers it has left: degraded, not stuck; the clock starts again
    assert check("j", (100.0, 3), 100.0 + MAX_UNPLACEABLE_S) == ((100.0 + MAX_UNPLACEABLE_S, 4), None)
    assert check("j", (100.0 + MAX_UNPLACEABLE_S, 4), 100.0 + 2 * MAX_UNPLACEABLE_S - 1)[1] is None
    assert check("j", (100.0 + MAX_UNPLACEABLE_S, 4), 100.0 + 2 * MAX_UNPLACEABLE_S)[1] is not None
    gpus[0] = NUM_WORKERS  # the node is back in time: the clock resets
    assert check("j", (100.0, 4), 100.0 + MAX_UNPLACEABLE_S - 1) == (None, None)
    gpus[0] = NUM_GPUS_PER_NODE
    store.redis[job_result_key("j")] = JobResult(ok=True, steps=6, finished_at=0.0).to_json()
    assert check("j", (100.0, 4), 100.0 + 2 * MAX_UNPLACEABLE_S) == ((100.0, 4), None)  # it ended: not failed
    store.record["state"] = JobState.CANCELLED.value
    assert check("j", (100.0, 4), 100.0 + 2 * MAX_UNPLACEABLE_S) == (None, None)


def test_a_stopping_launcher_never_asks_ray_for_the_clusters_gpus(monkeypatch):
    """With the whole process group signalled, Ray's GCS goes as the scheduler stops, and asking it for the cluster's
    resources then aborts the process (a failed check in Ray's global state accessor: exit 1, not 0). Once stopping,
    check_placeable reads nothing from Ray and fails no job."""
    asked = []
    monkeypatch.setattr(Launcher, "cluster_gpus", staticmethod(lambda: asked.append(1) or NUM_GPUS_PER_NODE))
    launcher = Launcher(OneJob(), Settings(redis_url="redis://unused"))
    assert launcher.check_placeable("j", None, 100.0) == ((100.0, 3), None) and asked == [1]  # short: the clock runs
    launcher.is_stopping = True
    assert launcher.check_placeable("j", (100.0, 3), 100.0 + MAX_UNPLACEABLE_S) == (None, None)
    assert asked == [1]
