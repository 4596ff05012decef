"""The CUDA test set (tests/cuda_tests.txt) runs on a GPU node that has only torch, transformers, safetensors,
numpy and pytest: every module listed must be collectable there, and `-k cuda` must select exactly the
cuda-parametrized cases of the `device` fixture. Checked by collecting the set in a fresh interpreter in which
the packages such a node lacks cannot be imported, and without pytest plugins it would not have."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIST = ROOT / "tests" / "cuda_tests.txt"
# what a bare GPU node lacks of this project's dependencies (and of the dev extras)
ABSENT = ("ray", "redis", "fastapi", "starlette", "uvicorn", "pydantic", "orjson", "msgpack", "simpy", "scipy",
          "prometheus_client", "httpx", "matplotlib", "selenium", "schemathesis")
COLLECT = """
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {absent!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (a bare GPU node lacks it)", name=name)
        return None

sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def listed() -> list[str]:
    return [line.split("#", 1)[0].strip() for line in LIST.read_text().splitlines() if line.split("#", 1)[0].strip()]


def collect(*args: str) -> list[str]:
    """Test ids pytest collects with `args`, in an interpreter without the ABSENT packages or plugins."""
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run([sys.executable, "-c", COLLECT.format(absent=ABSENT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def is_cuda_case(test_id: str) -> bool:
    return "[" in test_id and "cuda" in test_id[test_id.index("[") + 1 : -1].split("-")


def test_the_cuda_set_is_collectable_on_a_bare_gpu_node_and_k_cuda_selects_its_cuda_cases():
    paths = listed()
    assert paths and all((ROOT / p).is_file() for p in paths), paths
    everything = collect(*paths)
    selected = collect("-k", "cuda", *paths)
    assert selected == [t for t in everything if is_cuda_case(t)]
    assert {t.split("::")[0] for t in selected} == set(paths)  # each module listed has cuda cases
    cpu_twins = {t.replace("cuda", "cpu") for t in selected}
    assert cpu_twins <= set(everything)  # and each cuda case its CPU counterpart


def test_the_check_would_catch_a_module_that_needs_redis():
    done = subprocess.run([sys.executable, "-c", COLLECT.format(absent=ABSENT), "tests/workers/test_store.py"],
                          cwd=ROOT, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode != 0 and "a bare GPU node lacks it" in done.stdout + done.stderr


FULL_LIST = ROOT / "tests" / "cuda_tests_full.txt"


def test_the_full_venv_cuda_set_has_cuda_cases_in_each_module_and_none_of_the_bare_sets():
    paths = [line.split("#", 1)[0].strip() for line in FULL_LIST.read_text().splitlines()
             if line.split("#", 1)[0].strip()]
    assert paths and all((ROOT / p).is_file() for p in paths) and not set(paths) & set(listed())
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-k",
                           "cuda", *paths], cwd=ROOT, capture_output=True, text=True, timeout=300)
    selected = [line for line in done.stdout.splitlines() if "::" in line]
    assert done.returncode == 0 and all(is_cuda_case(t) for t in selected), done.stdout[-3000:]
    assert {t.split("::")[0] for t in selected} == set(paths)
