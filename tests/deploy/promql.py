"""What the deploy tests need to read the dashboard and the Prometheus rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/dashboards/tlt-scheduler.json"
RULES = ROOT / "deploy/prometheus/rules.yml"
PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
# metric names: ours all start tlt_ (exported) or job:tlt_ (recorded); `up` is Prometheus's own
METRIC = re.compile(r"\b((?:job:)?tlt_[a-zA-Z0-9_:]*)")
VARIABLES = {"$job": ".*", "$worker": ".*"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def panel_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, PromQL) for every target of every panel."""
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def recorded() -> set[str]:
    return {r["record"] for r in rules() if "record" in r}


def metric_names(expr: str) -> set[str]:
    return set(METRIC.findall(expr))


def substitute(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    return expr


def exported_names(metrics_text: str) -> set[str]:
    """Series names a /metrics page can carry, from its # TYPE lines (counters get _total, histograms
    _bucket/_sum/_count), whether or not a sample is there yet."""
    names = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if kind == "counter":
                names |= {name + "_total", name}
            elif kind == "histogram":
                names |= {name + "_bucket", name + "_sum", name + "_count"}
            else:
                names.add(name)
    return names
