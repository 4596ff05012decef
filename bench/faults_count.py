"""The counting of `tlt bench faults` (bench/faults.py, bench/faults_live.py), on plain values: what a leak,
an accepted hostile input, a server error and a lost step are, and the goals. Pure; both parts import it
(tests/bench/test_faults.py)."""

from __future__ import annotations

import re
import sys

TOKEN = "bench-faults-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NUM_CLUSTER_GPUS = 2  # logical GPUs of the bench's Ray: one per rollout worker of the tiny jobs
# what a traceback or a server path looks like in an answer; the bench's own files live under /tmp, not here
LEAK_MARKERS = ("Traceback", 'File "', '.py"', "site-packages", "/work/")
GOALS = {"fuzz_requests": ">= 1000", "fuzz_server_errors": "== 0", "schema_violations": "== 0",
         "hostile_inputs_accepted": "== 0", "tracebacks_exposed": "== 0", "redis_outage_jobs_lost": "== 0",
         "redis_recovery_s": "< 10", "driver_kill_steps_lost": "<= checkpoint_every",
         "idempotent_duplicates": "== 0", "oversized_jobs_accepted": "== 0",
         "driver_rss_mb_before_first_step": "< 500", "queued_jobs_without_driver": "== num_extra_jobs (3)",
         "queue_fcfs_violations": "== 0", "sigterm_exit_code": "== 0", "sigterm_5xx": "== 0",
         "processes_left_after_exit": "== 0", "anonymous_leaks": "== 0", "slow_clients_held": "== 0",
         "healthz_p99_s_with_redis_hung": "< 0.1", "server_errors": "== 0",
         "restart_gpus_overcommitted": "== 0", "restart_resumed_progress_s": "<= 60", "fcfs_violations": "== 0",
         "stalled_body_held_s": "<= 15", "sigterm_group_exit_s": "<= 10 (exit code 0, 0 processes left)",
         "sigterm_group_exit_code": "== 0", "sigterm_group_processes_left": "== 0"}
MAX_RESUMED_PROGRESS_S = 60.0  # a resumed job's new step after a restart: Ray's start, its driver's and a step
MAX_STALLED_BODY_S = 15.0  # serve.BODY_TIMEOUT_S and a margin
MAX_GROUP_EXIT_S = 10.0  # the scheduler alone exits in 2-4 s with a job running
NUM_EXTRA_JOBS = 3  # the queue case: jobs beyond the cluster's GPUs (the N + 3)
MAX_DRIVER_RSS_MB = 500  # a driver before its first step: torch, the model, one step's prompts
# /readyz answers 503 by design on the scheduler started without Ray: a documented answer, not a failure
EXPECTED_5XX = {("GET", "/readyz"): 503}


def server_markers() -> tuple[str, ...]:
    """LEAK_MARKERS and this server's own paths: the checkout and the Python environment."""
    from bench.record import ROOT

    return tuple(dict.fromkeys((*LEAK_MARKERS, str(ROOT), sys.prefix)))


def leak_markers(text: str, markers: tuple[str, ...] = LEAK_MARKERS) -> list[str]:
    """The traceback or server-path markers found in `text` (an answer's body, a job's error)."""
    return [m for m in markers if m and m in text]


def is_accepted(status: int | None, num_created: int) -> bool:
    """A request that should be refused was accepted: a 2xx answer, or a job created."""
    return status is not None and 200 <= status < 300 or num_created > 0


def is_server_error(method: str, path: str, status: int | None) -> bool:
    """A 5xx that is not a documented answer of that route (EXPECTED_5XX)."""
    return status is not None and status >= 500 and EXPECTED_5XX.get((method.upper(), path)) != status


def resumed_after_step(warning: str | None) -> int | None:
    """The step a resumed job's policy checkpoint was taken after, from its warning (workers.driver)."""
    m = re.search(r"resumed from its policy checkpoint after step (\d+)", warning or "")
    return int(m.group(1)) if m else None


def steps_lost(num_recorded_at_kill: int, checkpoint_step: int, is_mid_step: bool) -> int:
    """Steps of work a killed driver lost: the finished steps recorded after its checkpoint's step (run again),
    and the step it was in the middle of."""
    return max(0, num_recorded_at_kill - (checkpoint_step + 1)) + int(is_mid_step)


def duplicates(job_ids: list[str]) -> int:
    """Jobs created beyond the one that a set of submits with one Idempotency-Key should create."""
    return max(0, len(set(job_ids)) - 1)


def fcfs_violations(records: list[dict]) -> int:
    """Jobs that left the queue before one submitted earlier did (records with created_at and started_at; those
    that never started, e.g. cancelled while QUEUED, are not counted)."""
    started = sorted((r for r in records if r.get("started_at") is not None), key=lambda r: r["created_at"])
    num, latest = 0, float("-inf")
    for r in started:
        num += r["started_at"] < latest
        latest = max(latest, r["started_at"])
    return num


def goals_met(figures: dict, checkpoint_every: int) -> dict[str, bool]:
    def ok(value, test) -> bool:
        return value is not None and test(value)

    return {"fuzz_requests": ok(figures["fuzz_requests"], lambda v: v >= 1000),
            **{k: ok(figures[k], lambda v: v == 0) for k in (
                "fuzz_server_errors", "schema_violations", "hostile_inputs_accepted", "tracebacks_exposed",
                "redis_outage_jobs_lost", "idempotent_duplicates", "oversized_jobs_accepted", "queue_fcfs_violations",
                "sigterm_exit_code", "sigterm_5xx", "processes_left_after_exit", "anonymous_leaks",
                "slow_clients_held", "server_errors", "restart_gpus_overcommitted", "fcfs_violations",
                "sigterm_group_exit_code", "sigterm_group_processes_left")},
            "restart_resumed_progress_s": ok(figures["restart_resumed_progress_s"],
                                             lambda v: v <= MAX_RESUMED_PROGRESS_S),
            "stalled_body_held_s": ok(figures["stalled_body_held_s"], lambda v: v <= MAX_STALLED_BODY_S),
            "sigterm_group_exit_s": ok(figures["sigterm_group_exit_s"], lambda v: v <= MAX_GROUP_EXIT_S)
            and figures["sigterm_group_exit_code"] == 0 and figures["sigterm_group_processes_left"] == 0,
            "redis_recovery_s": ok(figures["redis_recovery_s"], lambda v: v < 10.0),
            "driver_kill_steps_lost": ok(figures["driver_kill_steps_lost"], lambda v: v <= checkpoint_every),
            "driver_rss_mb_before_first_step": ok(figures["driver_rss_mb_before_first_step"],
                                                  lambda v: v < MAX_DRIVER_RSS_MB),
            "queued_jobs_without_driver": ok(figures["queued_jobs_without_driver"], lambda v: v == NUM_EXTRA_JOBS),
            "healthz_p99_s_with_redis_hung": ok(figures["healthz_p99_s_with_redis_hung"], lambda v: v < 0.1)}


def collect_figures(result: dict) -> dict:
    """The headline figures from every part's result (bench/faults.py): the values GOALS are about."""
    fuzz, hostile, sweep, restart = result["fuzz"], result["hostile"], result["sweep"], result["restart"]
    group = result["shutdown_group"]  # its 503s while its Redis goes with the group are documented: not counted
    return {"fuzz_requests": fuzz["num_requests"], "fuzz_server_errors": fuzz["num_server_errors"],
            "schema_violations": fuzz["num_schema_violations"],
            "hostile_inputs_accepted": hostile["num_accepted"],
            "tracebacks_exposed": fuzz["num_leaks"] + hostile["num_leaks"] + sweep["num_leaks"],
            "redis_outage_jobs_lost": result["redis_outage"]["jobs_lost"],
            "redis_recovery_s": result["redis_outage"]["recovery_s"],
            "redis_outage_rollouts_lost": result["redis_outage"]["rollouts_lost"],  # reported, no goal
            "driver_kill_steps_lost": result["driver_kill"]["steps_lost"],
            "idempotent_duplicates": result["idempotency"]["duplicates"],
            "oversized_jobs_accepted": result["budget"]["oversized_jobs_accepted"],
            "driver_rss_mb_before_first_step": result["budget"]["driver_rss_mb_before_first_step"],
            "queued_jobs_without_driver": result["queue"]["queued_jobs_without_driver"],
            "queue_fcfs_violations": result["queue"]["fcfs_violations"],
            **{k: result["shutdown"][k] for k in ("sigterm_exit_code", "sigterm_5xx", "processes_left_after_exit")},
            "anonymous_leaks": result["leaks"]["anonymous_leaks"],
            "slow_clients_held": result["slow_clients"]["num_held"],
            "healthz_p99_s_with_redis_hung": result["liveness"]["healthz_p99_s_with_redis_hung"],
            "server_errors": (fuzz["num_server_errors"] + result["cursors"]["server_errors"]
                              + result["protocol"]["server_errors"] + result["leaks"]["server_errors"]
                              + int((result["smuggling"]["status"] or 0) >= 500)),
            "restart_gpus_overcommitted": restart["gpus_overcommitted"],
            "restart_resumed_progress_s": restart["resumed_progress_s"],
            "fcfs_violations": result["storm"]["fcfs_violations"],
            "stalled_body_held_s": result["stalled_body"]["held_s"],
            "sigterm_group_exit_s": group.get("exit_s"),
            "sigterm_group_exit_code": group.get("sigterm_exit_code"),
            "sigterm_group_processes_left": group.get("processes_left_after_exit")}
