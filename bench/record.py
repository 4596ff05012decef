"""What the benches share about results: `pct`, and (from workers/results.py, which `tlt simulate` writes
through as well) the checkout's ROOT and the one writer of docs/bench/NAME.json, which among the benches only
the registry (bench/cli.py) calls."""

from __future__ import annotations

from workers.results import ROOT, write_result

__all__ = ["ROOT", "pct", "write_result"]


def pct(values: list[float], q: float) -> float | None:
    """The `q` quantile of `values` (nearest rank, from below: p99 of 20 values is the largest); None if empty."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]
