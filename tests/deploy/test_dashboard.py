"""The Grafana dashboard and the Prometheus rules are well formed and name only real metrics."""

from __future__ import annotations

import re

import yaml
from fastapi.testclient import TestClient

from scheduler.app import Settings, create_app
from tests.deploy.promql import (
    DASHBOARD,
    PROMETHEUS_CONFIG,
    ROOT,
    dashboard,
    exported_names,
    metric_names,
    panel_exprs,
    recorded,
    rules,
)
from workers.redis_server import PrivateRedis


def test_dashboard_is_well_formed():
    dash = dashboard()
    assert dash["uid"] and dash["title"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    refs = {"tlt-prometheus"}
    for p in dash["panels"]:
        assert p["datasource"]["uid"] in refs, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no targets"
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] in refs and t["expr"].strip(), p["title"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    used = {m for _, e in panel_exprs(dash) for m in re.findall(r"\$(\w+)", e)}
    assert used <= variables, f"undefined variables: {used - variables}"
    for v in dash["templating"]["list"]:  # a variable's own query may use only the ones before it
        before = {w["name"] for w in dash["templating"]["list"][: dash["templating"]["list"].index(v)]}
        assert set(re.findall(r"\$(\w+)", v["definition"])) <= before, v["name"]
    # the datasource uid the panels use is the provisioned one
    ds = yaml.safe_load((ROOT / "deploy/grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert {d["uid"] for d in ds["datasources"]} == refs
    provider = yaml.safe_load((ROOT / "deploy/grafana/provisioning/dashboards/tlt.yaml").read_text())
    assert provider["providers"][0]["type"] == "file" and DASHBOARD.suffix == ".json"


def test_the_dashboard_and_rules_name_only_metrics_the_scheduler_exports(tmp_path):
    with PrivateRedis() as server:
        app = create_app(Settings(redis_url=server.url, store_dir=str(tmp_path), start_ray=False, watch=False))
        with TestClient(app) as client:
            exported = exported_names(client.get("/metrics").text)
    assert {"tlt_idle_worker_seconds_total", "tlt_reclaimed_worker_seconds_total",
            "tlt_dispatch_latency_seconds_bucket", "tlt_worker_class"} <= exported
    known = exported | recorded()
    for where, expr in panel_exprs(dashboard()) + [(r.get("record") or r["alert"], r["expr"]) for r in rules()]:
        missing = metric_names(expr) - known
        assert not missing, f"{where}: {missing} not exported by the scheduler nor recorded"
    for v in dashboard()["templating"]["list"]:
        assert metric_names(v["definition"]) <= exported, v["name"]


def test_prometheus_loads_the_rule_file():
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["rule_files"] == ["rules.yml"]
    assert config["scrape_configs"][0]["metrics_path"] == "/metrics"
    names = [r.get("record") or r["alert"] for r in rules()]
    assert len(names) == len(set(names))
