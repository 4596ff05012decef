"""A real Prometheus scrapes a running scheduler during a short job with drafter leases, and the
status page runs in headless Chromium against the same job.

Real parts: redis-server, local Ray, the scheduler under uvicorn, Debian's `prometheus` with our rule
file, Debian's `chromium` + `chromedriver` driven by Selenium. `make test` installs the Debian
packages where apt is available; without them these tests skip, saying which binary is missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import ray
import yaml

from drafter.model.config import PRESETS
from drafter.model.loading import random_model, save_hf_dir
from scheduler.app import Settings
from scheduler.client import ClientError, call
from scheduler.demo import start_server
from scheduler.policy import PolicySettings
from tests.deploy.promql import ROOT, RULES, dashboard, panel_exprs, rules, substitute
from tests.waiting import until
from workers.redis_server import PrivateRedis, free_port

SPEC = {"num_steps": 10, "num_prompts_per_step": 3, "group_size": 4, "max_new_tokens": 600, "num_workers": 2,
        "draft_k": 2, "speculation": "always"}
ARTIFACTS = ROOT / "artifacts"


def http_json(url: str, body: dict | None = None) -> object:
    return call("GET" if body is None else "POST", url, "", body)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Redis, Ray, the scheduler on a free port, Prometheus scraping it every second, and one job."""
    if shutil.which("prometheus") is None:
        pytest.skip("Debian's prometheus is not installed (make test installs it where apt is available)")
    tmp = tmp_path_factory.mktemp("obs")
    cfg = dataclasses.replace(PRESETS["tiny"], eos_token_ids=(0,))  # natural long tails (see test_watcher)
    save_hf_dir(random_model(cfg, init_seed=0), None, tmp / "tiny-eos")
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    with PrivateRedis() as redis_server:
        base, server = start_server(Settings(redis_url=redis_server.url, store_dir=str(tmp / "drafts"),
                                             start_ray=False, watch_tick_s=0.05, model_roots=(str(tmp),),
                                             policy=PolicySettings(min_lease_s=0.05, min_buffer_tokens=16)))
        port = int(base.rsplit(":", 1)[1])
        prom_port = free_port()
        config = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
        config["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES)]
        config["scrape_configs"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{port}"]}]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prom = subprocess.Popen(["prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                stdout=subprocess.DEVNULL, stderr=(tmp / "prometheus.log").open("wb"))
        try:
            prom_url = f"http://127.0.0.1:{prom_port}"
            until(lambda: _ready(prom_url), 60, "prometheus", 0.2)
            start = time.time()
            job = http_json(f"{base}/v1/jobs", SPEC | {"model": str(tmp / "tiny-eos")})
            yield {"base": base, "prom": prom_url, "job_id": job["job_id"], "start": start, "tmp": tmp}
            # a job still running (a test failed before its end) is stopped first: shutting Ray down under its
            # driver while the scheduler follows it can take this process down with Ray's workers
            url = f"{base}/v1/jobs/{job['job_id']}"
            if http_json(url)["state"] in ("PENDING", "QUEUED", "RUNNING"):
                with contextlib.suppress(ClientError):  # 409: it ended meanwhile
                    http_json(f"{url}/cancel", {})
                until(lambda: http_json(url)["state"] not in ("PENDING", "QUEUED", "RUNNING"), 60, "the job to stop",
                      0.5)
        finally:
            prom.terminate()
            prom.wait(30)
            server.should_exit = True
            server.thread.join(30)
    ray.shutdown()


def _ready(prom_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{prom_url}/-/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def job_state(stack) -> dict:
    return http_json(f"{stack['base']}/v1/jobs/{stack['job_id']}")


def test_status_page_shows_the_running_job_in_chromium(stack):
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        pytest.skip("Debian's chromium and chromium-driver are not installed")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    until(lambda: job_state(stack)["steps"] >= 1, 120, "the job's first step", 0.2)
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(f"{stack['base']}/ui/?job={stack['job_id']}")
        rows = until(lambda: driver.find_elements(By.CSS_SELECTOR, "#timeline .row"), 30, "timeline rows", 0.2)
        assert job_state(stack)["state"] == "RUNNING"  # it showed a live job
        assert sorted(r.get_attribute("data-worker") for r in rows) == ["w0", "w1"]  # one row per worker
        assert driver.find_elements(By.CSS_SELECTOR, "#timeline .span.ROLLING_OUT")
        jobs = driver.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
        assert [j.get_attribute("data-job") for j in jobs] == [stack["job_id"]]
        figure = driver.find_element(By.CSS_SELECTOR, '[data-figure="reclaimed / idle"] b').text
        assert figure == "-" or figure.endswith("%")
        time.sleep(2.5)  # one refresh cycle, so a failing refresh would log
        ARTIFACTS.mkdir(exist_ok=True)
        driver.save_screenshot(str(ARTIFACTS / "status-page.png"))
        assert (ARTIFACTS / "status-page.png").stat().st_size > 10_000
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, errors
        assert "cannot reach" not in driver.find_element(By.ID, "status").text
    finally:
        driver.quit()


def query_range(stack, expr: str) -> list:
    params = urllib.parse.urlencode({"query": substitute(expr), "start": stack["start"] - 5, "end": time.time(),
                                     "step": "1"})
    body = http_json(f"{stack['prom']}/api/v1/query_range?{params}")
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_gets_data_for_every_dashboard_query_and_recording_rule(stack):
    until(lambda: job_state(stack)["state"] in ("SUCCEEDED", "FAILED"), 420, "the job to end", 1.0)
    assert job_state(stack)["state"] == "SUCCEEDED"
    time.sleep(3)  # a last scrape and rule evaluation
    drafts = http_json(f"{stack['base']}/v1/jobs/{stack['job_id']}/drafts")
    # the whole record on failure (leases, rounds, decisions and their reasons): pytest would shorten a dict
    assert drafts["num_leases"] >= 1 and drafts["num_published"] >= 1, json.dumps(drafts)
    exprs = panel_exprs(dashboard()) + [(r["record"], r["record"]) for r in rules() if "record" in r]
    empty = [(where, expr) for where, expr in exprs if not query_range(stack, expr)]
    assert not empty, f"no data for: {empty}"
    # the scrape target is healthy and the rule groups evaluated without errors
    targets = http_json(f"{stack['prom']}/api/v1/targets")["data"]["activeTargets"]
    assert [t["health"] for t in targets] == ["up"]
    groups = http_json(f"{stack['prom']}/api/v1/rules")["data"]["groups"]
    assert all(r["health"] == "ok" for g in groups for r in g["rules"]), groups


def test_promtool_accepts_the_rules_and_config():
    if shutil.which("promtool") is None:
        pytest.skip("promtool (Debian's prometheus package) is not installed")
    for args in (["check", "rules", str(RULES)], ["check", "config", str(ROOT / "deploy/prometheus/prometheus.yml")]):
        out = subprocess.run(["promtool", *args], capture_output=True, text=True, cwd=Path(RULES).parent)
        assert out.returncode == 0, out.stdout + out.stderr
