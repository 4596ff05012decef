"""`tlt bench rl --size smallest --device DEVICE` end to end through the registry: the three arms interleaved on
real jobs (private Redis, local Ray, the scheduler app), its own small warm draft built first on the device,
and the result in rl.json on the CPU, rl_gpu.json on CUDA (which a CPU run never touches)."""

from __future__ import annotations

import json

import pytest

from bench.cli import main
from bench.rl import gpu_share, record_as
from drafter.model.linear import fast_bf16

KEYS = {"rollout_speedup", "step_speedup", "frozen_rollout_speedup", "reclaimed_ratio", "reward_delta_se",
        "accepted_length_last_step_tlt", "accepted_length_last_step_frozen", "per_step_mean"}


def test_the_smallest_bench_runs_the_three_arms_on_the_device(device, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "cache"))  # its warm draft is built, not found
    other = "rl_gpu.json" if device == "cpu" else "rl.json"
    (tmp_path / other).write_text("{}")
    assert main(["rl", "--size", "smallest", "--device", device, "--out-dir", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    name = "rl.json" if device == "cpu" else "rl_gpu.json"
    result = json.loads((tmp_path / name).read_text())
    assert printed["path"] == str(tmp_path / name) and (tmp_path / other).read_text() == "{}"
    assert result["device"] == result["config"]["device"] == device and result["config"]["size"] == "smallest"
    assert set(result) >= KEYS and result["rollout_speedup"] > 0 and result["step_speedup"] > 0
    assert set(result["steps"]) == {"plain", "frozen", "tlt"} and all(len(r[0]) == 1 for r in result["steps"].values())
    assert (tmp_path / "cache" / "drafters").is_dir()  # the warm draft arms b and c started from was built here
    assert result["config"]["warm_draft"].startswith(str(tmp_path / "cache"))
    # the default precision, auto, recorded as what the workers resolved it to on this device
    assert result["config"]["policy_dtype"] == "auto"
    assert result["config"]["policy_dtype_served"] == ("bfloat16" if fast_bf16(device) else "float32")
    if device == "cuda":
        assert result["machine"]["gpu"] == result["gpu"] and result["config"]["gpus_per_worker"] <= 1


def test_workers_share_the_gpus_when_they_outnumber_them():
    assert gpu_share(1, 2, "cuda") == 0.5 and gpu_share(1, 3, "cuda") == 0.3333 and gpu_share(4, 2, "cuda") == 1.0
    assert gpu_share(0, 2, "cpu") == 1.0
    with pytest.raises(ValueError, match="Ray finds no GPU"):
        gpu_share(0, 2, "cuda")
    assert record_as({"device": "cuda", "gpu": "NVIDIA H100"}) == ("rl_gpu", "NVIDIA H100")
    assert record_as({"device": "cpu"}) == ("rl", None)
