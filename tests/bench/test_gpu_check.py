"""bench/gpu_check.py, the GPU session's prepared gpu-check, run for real on the CPU: a model file and a wheel cut into
real parts (deploy/bundle_parts.py) that each fit a call beside the tree, laid out one folder per call; the node side
keeps each part outside the tree, says which are still to come, names a damaged one, runs the CUDA test set, then
`bench.gpu` in two stages from the joined parts (on the CPU with the tiny model) and merges them into one result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.record import deploy_script
from tests.bench.test_gpu import TINY

ROOT = Path(__file__).resolve().parents[2]


def check(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_model_goes_in_parts_one_call_each_then_the_bench_runs_in_two_stages_and_merges(tmp_path):
    model, wheel = tmp_path / "m.gguf", tmp_path / "gguf-0.0-py3-none-any.whl"
    model.write_bytes(os.urandom(3_000_000))  # incompressible: two parts in the room the limit below leaves
    wheel.write_bytes(b"a stand-in: python3 here has gguf, so the node side installs nothing")
    dist, work, out = tmp_path / "dist", tmp_path / "work", tmp_path / "out"
    tree = deploy_script("transfer").tree_bytes(ROOT)
    env = {**os.environ, "GPU_CHECK_DIST": str(dist), "TLT_CHECK_DIR": str(work), "OUT": str(out),
           "TLT_CACHE_DIR": str(tmp_path / "cache"), "TLT_TRANSFER_LIMIT": str(tree + 2_000_000)}

    tight = check({**env, "TLT_TRANSFER_LIMIT": str(tree + 100_000)}, "prepare", "--gguf", str(model),
                  "--wheel", str(wheel))
    assert tight.returncode == 2 and "make it smaller" in tight.stdout, tight.stdout + tight.stderr
    prep = check(env, "prepare", "--gguf", str(model), "--wheel", str(wheel))
    assert prep.returncode == 0, prep.stdout + prep.stderr
    carry = dist / "gpu-check"
    manifest = json.loads((carry / "1" / "parts.json").read_text())
    names = [p["name"] for p in manifest["parts"]]
    assert len(names) == 2 and sorted(p.name for p in carry.iterdir()) == ["1", "2"]
    assert max(p["bytes"] for p in manifest["parts"]) - min(p["bytes"] for p in manifest["parts"]) <= 1  # even
    for i, name in enumerate(names, 1):
        assert sorted(p.name for p in (carry / str(i)).iterdir()) == sorted([name, "parts.json", "unpack.py"])
    assert prep.stdout.splitlines()[-3:] == [
        f'  run(command="python3 -m bench.gpu_check node {carry}/1 tests", carry=["{carry}/1"], timeout_s=300)',
        f'  run(command="python3 -m bench.gpu_check node {carry}/2 A", carry=["{carry}/2"], timeout_s=600)',
        '  run(command="python3 -m bench.gpu_check node - B", timeout_s=600)']

    early = check(env, "node", "-", "A")
    assert early.returncode == 2 and "no parts.json among the parts carried so far" in early.stdout
    tests = check(env, "node", str(carry / "1"), "tests")  # on a CPU the CUDA cases are collected and skipped
    assert f"still to carry: {names[1]}" in tests.stdout
    assert "CUDA tests: 0 passed, 0 failed" in tests.stdout and tests.returncode == 1, tests.stdout + tests.stderr
    assert (out / "cuda-tests.xml").is_file() and (work / "cuda-tests.xml").is_file()
    not_yet = check(env, "node", "-", "A")
    assert not_yet.returncode == 2 and f"A needs every part; still to carry: {names[1]}" in not_yet.stdout

    (work / "parts" / names[0]).write_bytes(b"damaged in transit")
    damaged = check(env, "node", str(carry / "2"), "A")
    assert damaged.returncode == 2 and names[0] in damaged.stdout and "all parts are here" in damaged.stdout
    assert not (work / "A").exists()  # nothing ran from damaged parts

    stage_env = {**env, "GPU_CHECK_ARGS": " ".join(a for a in TINY if a != "--json")}
    repaired = check(stage_env, "node", str(carry / "1"), "A")  # the part carried again
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr[-3000:]
    assert (work / "tlt-gpu-check" / "m.gguf").read_bytes() == model.read_bytes()  # joined and checked
    a = json.loads((out / "A" / "gpu_cpu.json").read_text())
    assert a["parts"] == "abcdgh" and a["warm_start"]["cached"] is False
    merged = check(stage_env, "node", "-", "B")
    assert merged.returncode == 0, merged.stdout + merged.stderr[-3000:]
    b = json.loads((out / "B" / "gpu_cpu.json").read_text())
    assert b["parts"] == "bef" and b["warm_start"]["cached"] is True  # A's draft, read from the cache
    result = json.loads((out / "gpu_cpu.json").read_text())
    assert result["parts"] == "abcdefgh" and [r["parts"] for r in result["merged_from"]] == ["abcdgh", "bef"]
    assert result["warm_start"] == a["warm_start"] and result["drift"] == b["drift"]
    assert "speedup_greedy_b1" in merged.stdout  # the goals, printed
