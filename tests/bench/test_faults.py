"""The counting of `tlt bench faults` (bench/faults_count.py), on plain values: no server, no Redis, no Ray."""

from __future__ import annotations

from bench.faults_count import (
    duplicates,
    fcfs_violations,
    goals_met,
    is_accepted,
    is_server_error,
    leak_markers,
    resumed_after_step,
    steps_lost,
)

ALL_MET = {"fuzz_requests": 1350, "fuzz_server_errors": 0, "schema_violations": 0, "hostile_inputs_accepted": 0,
           "tracebacks_exposed": 0, "redis_outage_jobs_lost": 0, "redis_recovery_s": 0.4,
           "driver_kill_steps_lost": 2, "idempotent_duplicates": 0, "oversized_jobs_accepted": 0,
           "driver_rss_mb_before_first_step": 310.0, "queued_jobs_without_driver": 3, "queue_fcfs_violations": 0,
           "sigterm_exit_code": 0, "sigterm_5xx": 0, "processes_left_after_exit": 0, "anonymous_leaks": 0,
           "slow_clients_held": 0, "healthz_p99_s_with_redis_hung": 0.004, "server_errors": 0,
           "restart_gpus_overcommitted": 0, "restart_resumed_progress_s": 30.0, "fcfs_violations": 0,
           "stalled_body_held_s": 10.0, "sigterm_group_exit_s": 4.0, "sigterm_group_exit_code": 0,
           "sigterm_group_processes_left": 0}  # every goal met
TRACEBACK = """Traceback (most recent call last):
  File "/work/main/.venv/lib/python3.11/site-packages/ray/_private/worker.py", line 2961, in get
    raise value
  File "/work/main/workers/driver.py", line 88, in __init__
ValueError: dataset_path: bad.jsonl is not UTF-8 text"""


def test_a_traceback_is_flagged_and_a_clean_one_line_error_passes():
    assert leak_markers(TRACEBACK) == ["Traceback", 'File "', '.py"', "site-packages", "/work/"]
    assert leak_markers("ValueError: dataset_path: /tmp/x/bad.jsonl is not UTF-8 text (invalid start byte)") == []
    assert leak_markers('{"detail":"missing or wrong bearer token"}') == []
    assert leak_markers("ray actor died: /srv/app/x", ("/srv/app",)) == ["/srv/app"]  # this server's own paths


def test_what_counts_as_accepted_and_as_a_server_error():
    assert is_accepted(201, 1) and is_accepted(200, 0) and is_accepted(422, 1)  # a job created is accepted
    assert not is_accepted(422, 0) and not is_accepted(413, 0) and not is_accepted(None, 0)  # None: connection cut
    assert is_server_error("get", "/v1/jobs", 500) and is_server_error("POST", "/v1/jobs", 503)
    assert not is_server_error("GET", "/readyz", 503)  # not ready without Ray: a documented answer
    assert not is_server_error("GET", "/v1/jobs", 404) and not is_server_error("GET", "/v1/jobs", None)


def test_steps_lost_after_a_driver_kill():
    warning = "driver lost, resumed from its policy checkpoint after step 1 (steps 2..2 redone)"
    assert resumed_after_step(warning) == 1 and resumed_after_step(None) is None
    assert resumed_after_step("rollout workers lost: w1 at step 0; each was started again") is None
    assert steps_lost(3, 1, is_mid_step=True) == 2  # step 2 redone, step 3 was under way
    assert steps_lost(2, 1, is_mid_step=False) == 0  # killed right after a checkpointed step


def test_duplicates_and_goals():
    assert duplicates(["a"] * 20) == 0 and duplicates(["a", "b", "a", "c"]) == 2 and duplicates([]) == 0
    figures = dict(ALL_MET)
    assert all(goals_met(figures, checkpoint_every=2).values())
    met = goals_met(figures | {"driver_kill_steps_lost": 3, "redis_recovery_s": None, "fuzz_requests": 999,
                               "sigterm_exit_code": 134, "queued_jobs_without_driver": 2,
                               "driver_rss_mb_before_first_step": 520.0, "healthz_p99_s_with_redis_hung": 13.5}, 2)
    assert sorted(k for k, ok in met.items() if not ok) == sorted([
        "fuzz_requests", "redis_recovery_s", "driver_kill_steps_lost", "sigterm_exit_code",
        "queued_jobs_without_driver", "driver_rss_mb_before_first_step", "healthz_p99_s_with_redis_hung"])


def test_first_come_first_served():
    def job(created, started):
        return {"created_at": created, "started_at": started}

    assert fcfs_violations([job(1, 10), job(2, 11), job(3, 30), job(4, 20)]) == 1  # the 4th started before the 3rd
    assert fcfs_violations([job(1, 10), job(2, None), job(3, 12)]) == 0  # a job cancelled while queued never started
    assert fcfs_violations([job(2, 12), job(1, 10)]) == 0 and fcfs_violations([]) == 0


def test_the_goals_of_issue_42():
    figures = dict(ALL_MET)
    assert all(goals_met(figures, checkpoint_every=2).values())
    failing = {"restart_gpus_overcommitted": 1, "restart_resumed_progress_s": None, "fcfs_violations": 1,
               "stalled_body_held_s": 40.0}
    met = goals_met(figures | failing, 2)
    assert sorted(k for k, ok in met.items() if not ok) == sorted(failing)
    for group in ({"sigterm_group_exit_s": 17.7}, {"sigterm_group_exit_code": 1}, {"sigterm_group_processes_left": 2},
                  {"sigterm_group_exit_s": None}):  # slow, or quick but not clean: not met
        assert not goals_met(figures | group, 2)["sigterm_group_exit_s"], group
