"""bench/gpu_rl.sh, the GPU session's prepared script, run for real on the CPU: real parts (deploy/bundle_parts.py's
writer and unpack.py) of a stand-in bundle whose install.sh only records its call, laid out one per transfer; the
node side keeps each part outside the tree and says which are still to come, names a damaged part and stops, and
once all are there installs once and runs `tlt bench rl` from the tree (on the CPU, --size smallest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.record import deploy_script

ROOT = Path(__file__).resolve().parents[2]


def script(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "bench/gpu_rl.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_parts_go_one_call_at_a_time_then_the_bench_runs_from_the_tree(tmp_path):
    bundle = tmp_path / "tlt-bundle"
    bundle.mkdir()
    (bundle / "install.sh").write_text('echo "$1" >> "$(dirname "$0")/../installs.txt"\n')
    (bundle / "payload.bin").write_bytes(os.urandom(5_000_000))  # incompressible: three parts of 2 MB
    manifest = deploy_script("bundle_parts").write_parts(bundle, tmp_path / "parts", 2_000_000)
    names = [p["name"] for p in manifest["parts"]]
    assert len(names) == 3
    carry, stash, out = tmp_path / "carry", tmp_path / "stash", tmp_path / "out"
    env = {**os.environ, "TLT_CARRY": str(carry), "TLT_PARTS": str(stash), "OUT": str(out), "TLT_VENV": sys.prefix,
           "RL_BENCH": "--device cpu --size smallest", "TLT_CACHE_DIR": str(tmp_path / "cache")}

    tree = deploy_script("transfer").tree_bytes(ROOT)
    tight = script({**env, "TLT_TRANSFER_LIMIT": str(tree + 1_500_000)}, "prepare", str(tmp_path / "parts"))
    assert tight.returncode == 1 and "over a call's" in tight.stderr and "SPLIT=1M" in tight.stderr, tight.stderr
    assert not carry.exists()  # nothing laid out for parts that cannot travel

    prep = script(env, "prepare", str(tmp_path / "parts"))
    assert prep.returncode == 0, prep.stderr
    for i, name in enumerate(names, 1):
        assert sorted(p.name for p in (carry / str(i)).iterdir()) == sorted([name, "parts.json", "unpack.py"])
    assert f'run(command="sh bench/gpu_rl.sh node {carry}/3", carry=["{carry}/3"], timeout_s=600)' in prep.stdout

    for i in (1, 2):
        step = script(env, "node", str(carry / str(i)))
        assert step.returncode == 0, step.stderr
        assert step.stdout.strip().endswith(f"still to carry: {' '.join(names[i:])}")
    assert not (out / "rl_gpu.log").exists()  # nothing runs before every part is there

    (stash / names[0]).write_bytes(b"damaged in transit")
    bad = script(env, "node", str(carry / "3"))
    assert bad.returncode == 1 and f"{names[0]} is damaged" in bad.stderr and "the install failed" in bad.stderr
    assert not (stash / ".installed").exists()

    assert script(env, "node", str(carry / "1")).returncode == 0  # carried again: the good part replaces it
    done = script(env, "node", str(carry / "3"))
    assert done.returncode == 0, done.stderr + (out / "rl_gpu.log").read_text()
    assert (stash / "installs.txt").read_text().split() == [sys.prefix]  # install.sh ran once, into TLT_VENV
    assert "rollout_speedup" in done.stdout and "goals_met" in done.stdout
    result = json.loads((out / "rl.json").read_text())  # the CPU run's name; on CUDA rl_gpu.json
    assert result["config"]["size"] == "smallest" and set(result["steps"]) == {"plain", "frozen", "tlt"}
    assert (out / "rl_gpu.log").read_text() and (out / "install.log").is_file()
    progress = json.loads((out / "rl_progress.json").read_text())  # what a run stopped at the limit leaves
    assert progress["steps"] == result["steps"] and progress["config"]["policy_dtype"] == "auto"
