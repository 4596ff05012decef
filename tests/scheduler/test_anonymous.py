"""Nothing about the server without the token (issue 34, item 5): every route a client can reach without the
token, and every error, checked for paths, addresses, tracebacks and echoes. A real app, a real redis-server."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.metrics import model_label
from scheduler.routes.jobs import router as jobs_router
from tests.scheduler.apps import token_app
from workers.spec import JobSpec

TOKEN = "anon-token"
ECHO = "EchoMarker7"  # sent in paths, queries, headers and bodies: never in an answer


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


def assert_no_leak(client, r) -> None:
    port = client.redis.connection_pool.connection_kwargs["port"]
    for leak in (str(client.roots), "secret-model", "127.0.0.1", f":{port}", "Traceback", 'File "', ECHO, TOKEN):
        assert leak not in r.text, (leak, r.request.method, r.request.url, r.status_code, r.text[:300])
    assert r.status_code not in (500, 502, 504), (r.request.url, r.text[:300])  # readyz's 503: no Ray here


def anonymous_requests(job_id: str):
    yield "GET", "/healthz", {}
    yield "GET", "/readyz", {}
    yield "GET", "/metrics", {}
    yield "GET", "/ui/", {}
    yield "GET", "/openapi.json", {}
    yield "GET", f"/{ECHO}", {}
    yield "GET", f"/ui/{ECHO}", {}
    yield "DELETE", "/healthz", {}
    for route in jobs_router.routes:  # every job route, without a token and with a wrong one
        for method in route.methods:
            path = route.path.replace("{job_id}", job_id)
            yield method, path, {}
            yield method, path, {"headers": {"Authorization": f"Bearer {ECHO}"}}
            if "{job_id}" in route.path:  # an id that is no job's: a 404 that does not echo it
                yield method, path.replace(job_id, ECHO), {"headers": {"Authorization": f"Bearer {TOKEN}"}}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    yield "POST", "/v1/jobs", {"headers": auth, "json": {"model": f"/{ECHO}/x"}}
    yield "POST", "/v1/jobs", {"headers": auth, "json": {ECHO: 1}}
    yield "POST", "/v1/jobs", {"headers": auth | {"Idempotency-Key": ECHO + "/!"}, "json": {}}
    yield "POST", "/v1/jobs", {"headers": auth | {"Content-Type": "application/json"}, "content": "{" + ECHO}
    yield "GET", f"/v1/jobs/{job_id}/events?after={ECHO}", {"headers": auth}
    yield "GET", f"/v1/jobs/{job_id}/steps?start={ECHO}", {"headers": auth}


def test_no_route_or_error_leaks_paths_addresses_tracebacks_or_echoes(client):
    job_id = client.get("/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"}).json()[0]["job_id"]
    for method, path, kwargs in anonymous_requests(job_id):
        assert_no_leak(client, client.request(method, path, **kwargs))


def test_public_metrics_name_a_path_model_by_its_hash(client):
    text = client.get("/metrics").text
    models = {s.labels["model"] for f in text_string_to_metric_families(text) if f.name == "tlt_job_info"
              for s in f.samples}
    assert models == {model_label(client.model_path), "smollm2-135m"}
    assert model_label(client.model_path).startswith("sha256:") and len(model_label(client.model_path)) == 19
    assert model_label("tiny") == "tiny"
