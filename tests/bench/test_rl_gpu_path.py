"""`tlt bench rl --size gpu`'s path on the CPU, scaled down: the same options the gpu size sets (a bf16 policy on
the rollout workers, micro-batches, a time budget that leaves a repeat out) on the tiny preset, through the
registry, on real jobs (private Redis, local Ray, the scheduler app); every per-step field rl_gpu.json records is
there and sane. The gpu size itself refuses a CPU, naming the option."""

from __future__ import annotations

import dataclasses
import json

from bench.cli import main
from bench.rl import POLICIES, RECIPES, SIZES
from bench.rl_figures import GOALS

PER_STEP = {"tail_fraction", "idle_worker_s", "reclaimed_worker_s", "accepted_length_by_bucket",
            "accepted_length_drafting_by_bucket", "k_served_by_bucket", "draft_versions_published", "draft_versions",
            "bucket_served"}
HEADLINE = {"rollout_speedup", "step_speedup", "tlt_vs_frozen_rollout_speedup", "reclaimed_ratio", "reward_delta_se",
            "accepted_length_last_step_tlt", "accepted_length_last_step_frozen", "seconds"}


def test_the_gpu_sizes_path_runs_on_a_cpu_scaled_down(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))  # its warm draft is built, not found
    argv = ["rl", "--size", "smallest", "--device", "cpu", "--policy-dtype", "bfloat16", "--micro-batch", "2",
            "--steps", "2", "--repeats", "2", "--max-seconds", "1", "--out-dir", str(tmp_path), "--json"]
    assert main(argv) == 0
    result = json.loads((tmp_path / "rl.json").read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["path"] == str(tmp_path / "rl.json")
    config = result["config"]
    assert (config["policy_dtype"], config["micro_batch_size"], config["max_seconds"]) == ("bfloat16", 2, 1.0)
    assert config["policy"]["min_lease_s"] == 2.0  # the CPU's scheduler settings (DEMO_POLICY)
    # the budget: the first repeat always runs, the second would end past 1 s and is left out, saying so
    assert result["num_repeats_done"] == 1 and result["stopped_early"].startswith("repeats 2..2 not started")
    assert len(result["repeat_seconds"]) == 1 and all(len(v) == 1 for v in result["job_seconds"].values())
    assert set(result) >= HEADLINE and set(result["goals_met"]) == {"frozen_rollout_speedup", "rollout_speedup",
                                                                     "tail_accepted_length_tlt",
                                                                     "tail_accepted_length_frozen"}
    assert result["seconds"] >= result["warm_start_s"] + sum(result["repeat_seconds"])
    for arm, runs in result["steps"].items():
        steps = runs[0]
        assert [s["rl_step"] for s in steps] == [0, 1]
        for s in steps:
            assert set(s) >= PER_STEP
            assert 0.0 <= s["tail_fraction"] <= 1.0 and s["idle_worker_s"] >= 0.0 and s["reclaimed_worker_s"] >= 0.0
            assert s["bucket_served"].keys() == s["bucket_throughput"].keys() == s["k_served_by_bucket"].keys()
            for bucket, by_k in s["k_served_by_bucket"].items():
                assert all(n >= 1 for n in by_k.values())
                assert {int(k) for k in by_k} <= ({0} if arm == "plain" else set(range(config["draft_k"] + 1)))
                assert 1.0 <= s["accepted_length_by_bucket"][bucket] <= config["draft_k"] + 1
            assert set(s["accepted_length_drafting_by_bucket"]) <= set(s["accepted_length_by_bucket"])
            published = s["draft_versions_published"]
            assert isinstance(published, list) and (arm == "tlt" or not published)


def test_the_gpu_size_is_for_a_gpu_and_fits_its_goals(tmp_path, capsys):
    assert main(["rl", "--size", "gpu", "--device", "cpu", "--out-dir", str(tmp_path)]) == 2
    assert "--size gpu is sized for one GPU" in capsys.readouterr().err and not list(tmp_path.iterdir())
    gpu = SIZES["gpu"]
    assert gpu["policy_dtype"] == "bfloat16" and gpu["max_seconds"] < GOALS["seconds"][1]
    assert RECIPES["gpu"]["train_seconds"] <= 60 and RECIPES["gpu"]["num_unroll"] >= gpu["k"]
    from scheduler.demo import DEMO_POLICY

    assert dataclasses.replace(DEMO_POLICY, **POLICIES["gpu"]).min_lease_s < DEMO_POLICY.min_lease_s  # valid, shorter
