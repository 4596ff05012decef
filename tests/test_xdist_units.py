"""`make test`'s units of work under pytest-xdist (tests/conftest.py): every module that starts a Ray cluster in its
own process (ray.init, or `ray start` through the ray binary) is one of RAY_MODULES, which run one after another."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import RAY_MODULES, work_unit

ROOT = Path(__file__).resolve().parents[1]
STARTS_RAY = re.compile(r"ray\.init\(|with_name\(\"ray\"\)")
NOT_UNDER_XDIST = {"tests/engines/test_vllm_job.py"}  # the engines venv's tests run in one process after the suite


def test_every_module_that_starts_ray_is_in_the_ray_unit_and_every_listed_module_exists():
    modules = (ROOT / "tests").rglob("test_*.py")
    starting = {str(p.relative_to(ROOT)) for p in modules if STARTS_RAY.search(p.read_text())}
    assert starting - NOT_UNDER_XDIST - RAY_MODULES == set()
    assert {m for m in RAY_MODULES if not (ROOT / m).is_file()} == set()


def test_a_tests_unit_is_its_module_or_the_ray_unit():
    assert work_unit("tests/scheduler/test_queue.py::test_x[a-b]") == "ray"
    assert work_unit("tests/drafter/test_sampling.py::test_y[eagle-4]") == "tests/drafter/test_sampling.py"
