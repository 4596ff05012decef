"""Nothing about the server without the token (issue 34, item 5): every route a client can reach without the
token, and every error, checked for paths, addresses, tracebacks and echoes. A real app, a real redis-server."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.faults_service import anonymous_leaks
from scheduler.metrics import model_label
from tests.scheduler.apps import token_app
from workers.spec import JobSpec

TOKEN = "anon-token"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    roots = tmp_path_factory.mktemp("roots")
    (roots / "models" / "secret-model").mkdir(parents=True)
    with token_app(roots, TOKEN) as c:
        c.roots = roots
        c.model_path = str(roots / "models" / "secret-model")
        from scheduler.jobs import JobStore  # a job naming a path, as a real one would
        JobStore(c.redis).create(JobSpec(model=c.model_path))
        yield c


def test_no_route_or_error_leaks_paths_addresses_tracebacks_or_echoes(client):
    job_id = client.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).json()[0]["job_id"]
    port = client.redis.connection_pool.connection_kwargs["port"]
    found = anonymous_leaks(client, job_id, TOKEN, (str(client.roots), "secret-model", "127.0.0.1", f":{port}"))
    assert found["num_requests"] >= 30 and found["anonymous_leaks"] == 0, found["evidence"]
    assert found["server_errors"] == 0, found  # readyz's 503 (no Ray here) is its documented answer


def test_public_metrics_name_a_path_model_by_its_hash(client):
    text = client.get("/metrics").text
    models = {s.labels["model"] for f in text_string_to_metric_families(text) if f.name == "tlt_job_info"
              for s in f.samples}
    assert models == {model_label(client.model_path), "smollm2-135m"}
    assert model_label(client.model_path).startswith("sha256:") and len(model_label(client.model_path)) == 19
    assert model_label("tiny") == "tiny"
