"""The simulator (scheduler/simulate): deterministic, its long tail as fitted, TLT off reclaims nothing, the
real policy drives it, bad parameters are refused naming the field. Pure logic: no Redis, Ray or torch."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from scheduler import policy
from scheduler.cli import main
from scheduler.simulate import service
from scheduler.simulate.cost import Forward, StepCost, accepted_length, choose_k, rate_for_length
from scheduler.simulate.cpu import cpu_profile, fit_lengths, load_bench
from scheduler.simulate.gpu import VERL_7412, VERL_BATCH, gpu_8b_profile, request_seconds
from scheduler.simulate.lengths import LengthKind, LengthModel
from scheduler.simulate.model import Simulation, simulate
from scheduler.simulate.profiles import Acceptance, Phases, Workload
from scheduler.simulate.project import tick_cost, tiled
from scheduler.simulate.run import run_all
from scheduler.simulate.validate import validate_cpu
from scheduler.simulate.worker import Timeline

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def gpu8b():
    return gpu_8b_profile()


@pytest.fixture(scope="module")
def cpu():
    return cpu_profile()


def test_a_seed_fixes_the_run_and_another_seed_changes_it(gpu8b):
    runs = [simulate(gpu8b, 12, "tlt", seed, 2) for seed in (5, 5, 6)]
    figures = [[(s.rollout_s, s.step_s, s.reclaimed_worker_s, s.accepted_length) for s in r.steps] for r in runs]
    assert figures[0] == figures[1]
    assert runs[0].num_leases == runs[1].num_leases
    assert figures[0] != figures[2]


def test_the_cpu_lengths_reproduce_the_figures_they_were_fitted_to():
    rl = load_bench("rl")
    model, targets, got = fit_lengths(rl)
    for name, value in targets.items():
        assert got[name] == pytest.approx(value, rel=0.02), name
    # and drawing steps from the model gives the same shape as its analytic figures
    rng = random.Random(0)
    lengths = [n for _ in range(400) for g in model.sample_groups(rng, 10, 4) for n in g]
    assert statistics.median(lengths) == pytest.approx(model.quantile(0.5), rel=0.05)
    assert np.percentile(lengths, 90) == pytest.approx(model.quantile(0.9), rel=0.1)
    assert statistics.fmean(lengths) == pytest.approx(model.mean(), rel=0.05)
    assert max(lengths) == model.max_tokens


def test_the_gpu_lengths_give_verls_request_time_shape(gpu8b):
    t = request_seconds(gpu8b, VERL_BATCH)
    assert t.min() / t.max() == pytest.approx(VERL_7412["min_s"] / VERL_7412["max_s"], rel=0.02)
    assert t.mean() / t.max() == pytest.approx(VERL_7412["mean_s"] / VERL_7412["max_s"], rel=0.02)


def test_the_exact_mix_holds_one_long_prompt_in_ten():
    model = LengthModel((LengthKind(0.9, 20, 0.5), LengthKind(0.1, 400, 0.5)), 512, exact_mix=True)
    rng = random.Random(1)
    for _ in range(20):
        assert model.prompt_kinds(rng, 10).count(1) == 1


def test_tlt_off_reclaims_nothing_and_tlt_on_reclaims_only_idle_time(gpu8b):
    for arm in ("plain", "frozen"):
        r = simulate(gpu8b, 16, arm, 0, 2)
        assert r.num_leases == 0 and all(s.reclaimed_worker_s == 0 for s in r.steps)
        assert r.tick_s == []  # no watcher follows a job that trains no drafter
    r = simulate(gpu8b, 16, "tlt", 0, 2)
    assert r.num_leases > 0
    for s in r.steps:
        assert 0 < s.reclaimed_worker_s <= s.idle_worker_s + 1e-6


def test_the_simulation_calls_the_real_policy_functions():
    for name in ("decide", "scoring_fits", "choose_scorer", "group_copies", "should_publish", "track_rollouts",
                 "reclaimed_by_step"):
        assert getattr(service, name) is getattr(policy, name), name


def test_a_policy_change_shows_up_in_the_simulation(gpu8b):
    base = simulate(gpu8b, 16, "tlt", 0, 2)
    # leases must last longer than any rollout's rest: the real decide grants none
    never = replace(gpu8b, policy=replace(gpu8b.policy, min_lease_s=1e6, max_lease_s=1e6))
    none = simulate(never, 16, "tlt", 0, 2)
    assert base.num_leases > 0 and none.num_leases == 0
    assert sum(s.reclaimed_worker_s for s in none.steps) == 0
    # a tail that begins only when every worker waits: no grant either
    late = replace(gpu8b, policy=replace(gpu8b.policy, long_tail_idle_fraction=1.0))
    assert simulate(late, 16, "tlt", 0, 2).num_leases == 0
    # a rule that never publishes: the drafts served stay the warm one
    strict = replace(gpu8b, policy=replace(gpu8b.policy, publish_tolerance=-10.0))
    assert base.num_published > 0 and simulate(strict, 16, "tlt", 0, 2).num_published == 0


def test_speculation_pays_where_a_forward_is_bound_by_reading_and_not_with_a_useless_draft(gpu8b):
    cost = gpu8b.cost
    rows, ctx = np.array([1.0, 128.0]), np.array([4000.0, 4000.0])
    # a speculative step at k=3 and batch 1 (a 4-token verify and 3 draft forwards) costs under 2 plain steps
    assert cost.seconds(rows[:1], 3, ctx[:1])[0] < 2 * cost.seconds(rows[:1], 0, ctx[:1])[0]
    assert list(choose_k(cost, rows, ctx, 0.0, 4, "adaptive")) == [0, 0]  # nothing accepted: plain decoding
    assert choose_k(cost, rows, ctx, 0.8, 4, "adaptive")[0] > 0
    assert list(choose_k(cost, rows, ctx, 0.8, 4, "off")) == [0, 0]


def test_accepted_length_and_its_inverse():
    for k, a in ((1, 0.3), (3, 0.684), (4, 0.9)):
        assert rate_for_length(k, accepted_length(k, a)) == pytest.approx(a, abs=1e-6)
    assert accepted_length(3, 0.0) == 1.0 and accepted_length(3, 1.0) == 4.0


def test_a_better_draft_mid_rollout_finishes_the_rows_sooner(gpu8b):
    lengths = [500, 2000, 8000, 16000]
    slow = Timeline(lengths, 512, gpu8b.cost, 4, "adaptive")
    slow.build(0.0, 0.0, 0.5)
    fast = Timeline(lengths, 512, gpu8b.cost, 4, "adaptive")
    fast.build(0.0, 0.0, 0.5)
    fast.retime(slow.finish[1], 0.8)
    assert list(np.diff(fast.finish) >= 0) == [True] * 3  # rows finish in length order
    assert fast.finish[:2] == pytest.approx(slow.finish[:2])  # what finished before the swap is unchanged
    assert all(fast.finish[2:] < slow.finish[2:])
    assert fast.num_finished(slow.finish[1]) == 2


def test_bad_parameters_are_refused_naming_the_field(gpu8b):
    with pytest.raises(ValueError, match="warm_rate"):
        Acceptance(min_rate=0.1, max_rate=0.5, warm_rate=0.6, train_tau_s=10, drift_retain=1.0)
    with pytest.raises(ValueError, match="train_tau_s"):
        Acceptance(min_rate=0.1, max_rate=0.5, warm_rate=0.3, train_tau_s=0, drift_retain=1.0)
    with pytest.raises(ValueError, match="tick_s"):
        Phases(sync_s=0, learner_s=(1.0,), tick_s=0)
    with pytest.raises(ValueError, match="learner_s"):
        Phases(sync_s=0, learner_s=(), tick_s=0.5)
    with pytest.raises(ValueError, match="draft_k"):
        replace(gpu8b.workload, draft_k=0)
    with pytest.raises(ValueError, match="speculation"):
        Workload(gpu8b.workload.lengths, 1, 4, 10.0, 2, speculation="sometimes")
    with pytest.raises(ValueError, match="sigma"):
        LengthKind(1.0, 100, -1.0)
    with pytest.raises(ValueError, match="weights must sum to 1"):
        LengthModel((LengthKind(0.5, 100, 1.0),), 512)
    with pytest.raises(ValueError, match="bandwidth"):
        Forward(bandwidth=-1.0)
    with pytest.raises(ValueError, match="spec_overhead_s"):
        StepCost(Forward(), Forward(), -1.0)
    with pytest.raises(ValueError, match="arm"):
        Simulation(gpu8b, 4, "sometimes")
    with pytest.raises(ValueError, match="num_workers"):
        Simulation(gpu8b, 0, "plain")
    with pytest.raises(ValueError, match="--profile"):
        run_all(profiles=("gpu-1t",))


def test_the_cpu_profile_reproduces_this_machines_bench_within_its_bound():
    result = validate_cpu(num_seeds=10)
    bounded = [c for c in result["checks"] if "bound" in c]
    assert {c["figure"] for c in bounded} >= {"plain rollout_s", "plain step_s", "tlt rollout_s", "tlt step_s"}
    for c in bounded:
        assert c["within_bound"] == (abs(c["error"]) <= c["bound"])
    assert result["all_within_bound"], [(c["figure"], round(c["error"], 3)) for c in bounded]


def test_tick_cost_times_the_policy_on_as_many_workers_as_asked(gpu8b):
    r = simulate(gpu8b, 16, "tlt", 0, 1, snapshot_every=5)
    assert r.snapshots
    grown = tiled(r.snapshots[0], 40)
    assert len({v.worker_id for v in grown["views"]}) == 40
    cost = tick_cost(r.snapshots[:3], 40, gpu8b, repeats=1)
    assert cost["num_workers"] == 40 and cost["num_ticks"] == 3 and 0 < cost["p50_s"] <= cost["p99_s"]


def test_tlt_simulate_writes_its_json_and_refuses_bad_options(tmp_path, capsys):
    assert main(["simulate", "--gpus", "0"]) == 2
    assert "--gpus" in capsys.readouterr().err
    rc = main(["simulate", "--json", "--profile", "gpu-8b", "--gpus", "16", "--steps", "1", "--tick-workers", "32",
               "--validation-seeds", "2", "--out-dir", str(tmp_path), "--plot", str(tmp_path / "plots")])
    assert rc == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    written = json.loads((tmp_path / "simulate.json").read_text())
    assert {"commit", "machine", "date"} <= set(written)  # provenance, as every bench records it
    assert written["projections"][0]["num_gpus"] == 16 and printed["projections"] == written["projections"]
    assert {"cpu", "nemo_rl_8b", "shape"} <= set(written["validation"])
    assert "32" in written["policy_tick"]["pure_policy"]
    assert all(Path(p).is_file() for p in written.get("plots", {}).values())


def test_the_simulator_loads_no_torch():
    code = ("import scheduler.simulate.run, scheduler.simulate.plots, scheduler.simulate.command; import sys; "
            "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
