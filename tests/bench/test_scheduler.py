"""`tlt bench scheduler` end to end at tiny sizes: real local Ray, two real rollout workers, a private
Redis and the real Watcher, through `tlt bench` (the registry's entry point); it prints its JSON last and
writes it where it is told (not docs/)."""

from __future__ import annotations

import json

import ray

from scheduler.cli import main


def test_bench_scheduler_runs_and_writes_its_json(tmp_path, capsys):
    try:
        rc = main(["bench", "scheduler", "--json", "--trials", "2", "--workers", "64", "--ticks", "5",
                   "--out-dir", str(tmp_path)])
    finally:
        ray.shutdown()
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    written = json.loads((tmp_path / "scheduler.json").read_text())
    assert printed.pop("path") == str(tmp_path / "scheduler.json")  # the registry's write, named in what it prints
    assert written == printed and written["commit"] and written["machine"]["num_cores"] >= 1
    p, w = written["policy_pass"], written["workers"]
    assert p["num_workers"] == 64 and p["num_ticks"] == 5 and 0 < p["policy_pass_p50_s"] <= p["policy_pass_p99_s"]
    assert p["progress_writes_per_s"] > 0 and p["worker_decisions_per_s"] > 0
    # every measured trial leased the worker that went idle first, and preempted it when the rollout ended
    assert w["num_dispatch_samples"] + w["missed"]["no_lease"] == 2
    assert w["num_dispatch_samples"] >= 1 and 0 < w["dispatch_p50_s"] < 5
    assert w["num_leases"] >= 2 and set(written["met"]) == set(written["goals"])
