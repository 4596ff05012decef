"""The alert rules fire when they should: each is documented, and promtool's rule unit tests run the
acceptance-collapse alert over series like the scheduler's (Debian's `prometheus` ships promtool; make
test installs it where apt is available, else the promtool test skips)."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.promql import ROOT, RULES, rules

COLLAPSE_ALERT = "TLTDraftAcceptanceCollapsed"


def test_every_alert_is_documented_in_operations():
    text = (ROOT / "docs/operations.md").read_text()
    section = text[text.index("### Alerts"):]
    for r in rules():
        if "alert" in r:
            assert f"`{r['alert']}`" in section, f"{r['alert']} is not in docs/operations.md's Alerts table"
            assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]


def test_the_collapse_alert_reads_the_guards_counter():
    (rule,) = [r for r in rules() if r.get("alert") == COLLAPSE_ALERT]
    assert "tlt_draft_collapses_total" in rule["expr"] and "for" not in rule  # one collapse is enough


def test_promtool_fires_the_collapse_alert_on_a_collapse_only(tmp_path):
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    alert = {"alertname": COLLAPSE_ALERT, "severity": "warning"}
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            # a job whose worker rolled a draft back at minute 5; another that never did (its counter at 0
            # from the start: the scheduler exports it for every running job)
            "input_series": [{"series": 'tlt_draft_collapses_total{job="j1"}', "values": "0x4 1x40"},
                             {"series": 'tlt_draft_collapses_total{job="j2"}', "values": "0x45"}],
            "alert_rule_test": [
                {"eval_time": "4m", "alertname": COLLAPSE_ALERT, "exp_alerts": []},
                {"eval_time": "6m", "alertname": COLLAPSE_ALERT,
                 "exp_alerts": [{"exp_labels": alert | {"job": "j1"}}]},
                {"eval_time": "19m", "alertname": COLLAPSE_ALERT,
                 "exp_alerts": [{"exp_labels": alert | {"job": "j1"}}]},
                {"eval_time": "25m", "alertname": COLLAPSE_ALERT, "exp_alerts": []},  # 15 minutes without one
            ],
        }],
    }
    # the annotations are matched too: take them from the rule file, so the test checks firing, not wording
    (rule,) = [r for r in rules() if r.get("alert") == COLLAPSE_ALERT]
    for case in tests["tests"][0]["alert_rule_test"]:
        for exp in case["exp_alerts"]:
            exp["exp_annotations"] = rule["annotations"]
    path = tmp_path / "collapse_test.yml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
