"""What the benches share about results: `pct`, and (from workers/results.py, which `tlt simulate` writes
through as well) the checkout's ROOT and the one writer of docs/bench/NAME.json, which among the benches only
the registry (bench/cli.py) calls; and `deploy_script`, a script of deploy/ loaded by path. Standard library
only: a bare GPU node imports it."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from workers.results import ROOT, write_result

__all__ = ["ROOT", "deploy_script", "pct", "write_result"]


def deploy_script(name: str) -> ModuleType:
    """deploy/NAME.py (a script of the checkout, not a package: it also travels alone, as unpack.py), loaded by
    path."""
    spec = importlib.util.spec_from_file_location(f"tlt_deploy_{name}", ROOT / "deploy" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pct(values: list[float], q: float) -> float | None:
    """The `q` quantile of `values` (nearest rank, from below: p99 of 20 values is the largest); None if empty."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]
