"""`tlt report`: spans and totals on constructed records, and the whole command against a live
scheduler (uvicorn, private Redis) holding a job written by the real progress writer."""

from __future__ import annotations

import json
import struct
import time

import pytest

from scheduler.app import Settings
from scheduler.cli import main
from scheduler.client import call
from scheduler.demo import start_server
from scheduler.jobs import JobStore
from scheduler.report import LEARNER, generating, spans, split_waits, totals
from workers.progress import ProgressReporter
from workers.protocol.keys import job_drafts_key, job_steps_key, job_tlt_key
from workers.protocol.messages import ProgressRecord
from workers.protocol.states import JobState, WorkerState
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec


def ev(worker, to, ts, step=0):
    return {"id": f"{int(ts * 1000)}-0", "worker": worker, "from": "", "to": to, "ts": ts, "rl_step": step}


def test_waits_are_split_into_idle_at_the_barrier_and_the_learner_phase():
    # step 0: w0 generates 0-4, w1 0-6; the learner phase 6-9; step 1: both generate from 9
    runs = {"w0": [("ROLLING_OUT", 0.0, 4.0, 0), ("IDLE", 4.0, 9.0, 0), ("ROLLING_OUT", 9.0, 12.0, 1)],
            "w1": [("ROLLING_OUT", 0.0, 6.0, 0), ("IDLE", 6.0, 9.0, 0), ("ROLLING_OUT", 9.0, 11.0, 1),
                   ("TRAINING", 11.0, 12.0, 1)]}
    assert generating(runs) == [(0.0, 6.0), (9.0, 12.0)]
    out = split_waits(runs)
    assert out["w0"] == [("ROLLING_OUT", 0.0, 4.0, 0), ("IDLE", 4.0, 6.0, 0), (LEARNER, 6.0, 9.0, 0),
                         ("ROLLING_OUT", 9.0, 12.0, 1)]
    assert out["w1"][1] == (LEARNER, 6.0, 9.0, 0)  # the last to finish waits only for the update
    assert out["w1"][-1] == ("TRAINING", 11.0, 12.0, 1)  # other states are drawn as they are
    # a worker idle across a whole rollout of the others: barrier, learner, barrier
    lone = {"w0": [("IDLE", 0.0, 10.0, 0)], "w1": [("ROLLING_OUT", 2.0, 4.0, 0), ("ROLLING_OUT", 6.0, 8.0, 1)]}
    assert [p[:3] for p in split_waits(lone)["w0"]] == [(LEARNER, 0.0, 2.0), ("IDLE", 2.0, 4.0), (LEARNER, 4.0, 6.0),
                                                        ("IDLE", 6.0, 8.0), (LEARNER, 8.0, 10.0)]


def test_spans_last_until_the_next_transition_and_the_last_until_the_end():
    events = [ev("w0", "ROLLING_OUT", 0.0), ev("w1", "ROLLING_OUT", 0.5), ev("w0", "IDLE", 3.0),
              ev("w0", "TRAINING", 3.5), ev("w1", "IDLE", 6.0), ev("w0", "IDLE", 6.2)]
    runs = spans(events)
    assert runs["w0"] == [("ROLLING_OUT", 0.0, 3.0, 0), ("IDLE", 3.0, 3.5, 0), ("TRAINING", 3.5, 6.2, 0),
                          ("IDLE", 6.2, 6.2, 0)]
    assert runs["w1"] == [("ROLLING_OUT", 0.5, 6.0, 0), ("IDLE", 6.0, 6.2, 0)]
    assert spans(events, end=10.0)["w1"][-1] == ("IDLE", 6.0, 10.0, 0)
    assert spans([]) == {}


def test_totals():
    steps = [{"timings": {"rollout": 6.0, "update": 2.0}, "idle_worker_s": 3.0},
             {"timings": {"rollout": 4.0, "update": 2.0}, "idle_worker_s": 1.0}]
    t = totals(steps, {"reclaimed_worker_s": 2.0, "num_leases": 3, "num_published": 1, "num_rejected": 1})
    assert t["step_s"] == 14.0 and t["rollout_share"] == pytest.approx(10 / 14)
    assert t["reclaimed_ratio"] == 0.5 and t["num_published"] == 1
    assert totals([], {})["reclaimed_ratio"] is None


def png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.fixture
def server(tmp_path):
    with PrivateRedis() as redis_server:
        url, srv = start_server(Settings(redis_url=redis_server.url, store_dir=str(tmp_path / "d"), start_ray=False,
                                         watch=False))
        yield url, redis_server.client()
        srv.should_exit = True
        srv.thread.join(10)


def test_report_writes_plots_and_a_summary(server, tmp_path, capsys):
    url, redis = server
    store = JobStore(redis)
    job_id = store.create(JobSpec(model="tiny", num_workers=2, num_steps=2))[0]["job_id"]
    store.transition(job_id, JobState.RUNNING, {JobState.PENDING})
    t0 = time.time()
    for wid, states in (("w0", ["ROLLING_OUT", "IDLE", "TRAINING", "IDLE", "ROLLING_OUT", "IDLE"]),
                        ("w1", ["ROLLING_OUT", "IDLE", "ROLLING_OUT", "IDLE"])):
        reporter = ProgressReporter(redis, job_id, wid)
        for i, state in enumerate(states):
            reporter.report(ProgressRecord(job_id, wid, WorkerState(state), 0, min(i, 4), 4, 10 * i, 50.0, 1.3, 1, 1,
                                           i // 3, t0 + i), force=True)
    for step in range(2):
        redis.rpush(job_steps_key(job_id), json.dumps({
            "rl_step": step, "policy_version": step + 1, "idle_worker_s": 2.0, "mean_reward": 0.1, "num_rollouts": 8,
            "failures": [], "num_tokens": 400, "mean_accepted_length": 1.0 + 0.3 * step,
            "timings": {"weight_sync": 1.0, "rollout": 8.0, "reward": 0.0, "logprob": 1.0, "update": 2.0},
            "worker_rollout_s": {"w0": 6.0, "w1": 8.0}, "draft_versions": {"w0": step, "w1": step}}))
    worse = "scored worse than the serving draft"
    for candidate, cand_len, published, reason in ((1, 1.6, 1, None), (2, 1.4, None, worse)):
        redis.rpush(job_drafts_key(job_id), json.dumps({
            "candidate": candidate, "merged": [candidate * 10, candidate * 10 + 1], "dropped": [],
            "parent_version": candidate - 1,
            "evaluated_by": "w1", "held_out": True, "at": t0 + 10 * candidate, "candidate_accepted_length": cand_len,
            "serving_accepted_length": None if candidate == 1 else 1.6, "published_version": published,
            **({"reason": reason} if reason else {})}))
    redis.hset(job_tlt_key(job_id), mapping={"reclaimed_worker_s": 3.0, "num_leases": 2, "num_published": 1,
                                             "num_rejected": 1})
    store.transition(job_id, JobState.SUCCEEDED, {JobState.RUNNING})
    out = tmp_path / "report"
    assert main(["report", job_id, "--out", str(out), "--url", url]) == 0
    printed = capsys.readouterr().out
    for name in ("timeline", "steps", "phases"):
        width, height = png_size(out / f"{name}.png")
        assert width > 200 and height > 200, name
        assert f"{name}: {out / name}.png" in printed
    summary = (out / "summary.md").read_text()
    assert f"# Job {job_id}" in summary and "SUCCEEDED" in summary
    assert "2 rollout workers" in summary and "2 of 2 steps done" in summary  # steps: the step records
    assert "reclaimed for drafter training: 3.0 (75%)" in summary  # 3.0 of 2 x 2.0 idle worker-seconds
    assert all(f"({name}.png)" in summary for name in ("timeline", "steps", "phases"))
    assert "versions published 1, candidates rejected 1, serving draft none" in summary
    assert "| 1 | 10, 11 | 1.60 | - | published v1 |" in summary  # merged copies are copy versions (ints)
    assert "| 2 | 20, 21 | 1.40 | 1.60 | rejected: scored worse than the serving draft |" in summary
    # what the timeline drew: one span per transition the progress writer recorded
    runs = spans(call("GET", url, f"/v1/jobs/{job_id}/events"))
    assert {w: [r[0] for r in rs] for w, rs in runs.items()} == {
        "w0": ["ROLLING_OUT", "IDLE", "TRAINING", "IDLE", "ROLLING_OUT", "IDLE"],
        "w1": ["ROLLING_OUT", "IDLE", "ROLLING_OUT", "IDLE"]}


def test_report_on_an_unknown_job_names_it(server, tmp_path, capsys):
    url, _ = server
    assert main(["report", "nosuchjob", "--out", str(tmp_path / "r"), "--url", url]) == 2
    assert "nosuchjob" in capsys.readouterr().err


def test_report_on_a_job_with_no_steps_or_events_says_so(server, tmp_path, capsys):
    url, redis = server
    job_id = JobStore(redis).create(JobSpec(model="tiny"))[0]["job_id"]  # created after startup: stays PENDING
    out = tmp_path / "empty"
    assert main(["report", job_id, "--out", str(out), "--url", url]) == 0
    assert f"summary: {out / 'summary.md'}" in capsys.readouterr().out
    summary = (out / "summary.md").read_text()
    assert "PENDING" in summary and "No RL step has finished yet" in summary and "n/a (no idle time)" in summary
    assert all(min(png_size(out / f"{name}.png")) > 200 for name in ("timeline", "steps", "phases"))
