"""Every route of the app, enumerated (issue 33, item 5): each answers a typed model (or is a documented
exception), each route under /v1 refuses a request without the token and changes nothing, and only the
listed operations routes are open. A real app on a real redis-server."""

from __future__ import annotations

import logging

import fastapi.routing
import pytest
from fastapi.routing import APIRoute
from pydantic import TypeAdapter

from scheduler.app import Settings, create_app
from scheduler.jobs import JobStore
from tests.scheduler.apps import step_record, token_app
from workers.protocol.keys import event_fields, job_events_key, job_steps_key
from workers.protocol.states import WorkerState

TOKEN = "routes-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
MUTATING = {"POST", "PUT", "PATCH", "DELETE"}
OPEN_PATHS = {"/metrics", "/healthz", "/readyz"}  # operations: no token, and nothing about jobs in them
UNTYPED = {"/metrics": "Prometheus text exposition, not JSON"}  # routes with no response model, and why
BODIES = {("POST", "/v1/jobs"): {"model": "tiny"}}  # a valid body: without the check it would create a job


def api_routes(app) -> list:
    """The app's own routes (path, methods, response_model), as mounted with their routers' prefixes and
    dependencies: not FastAPI's /openapi.json and /docs, nor the /ui static mount. FastAPI 0.16x includes
    routers lazily: app.routes holds the routers, iter_route_contexts the routes; older ones hold the routes."""
    contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    routes = list(contexts(app.routes)) if contexts else app.routes
    return [r for r in routes if isinstance(getattr(r, "original_route", r), APIRoute)]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with token_app(tmp_path_factory.mktemp("roots"), TOKEN) as c:
        c.redis.rpush(job_steps_key(c.job_id), step_record(0), step_record(1))
        c.redis.xadd(job_events_key(c.job_id), event_fields("w0", None, WorkerState.ROLLING_OUT, 1.0, 0))
        c.redis.xadd(job_events_key(c.job_id), event_fields("w0", WorkerState.ROLLING_OUT, WorkerState.IDLE, 2.0, 0))
        yield c


def test_every_route_has_a_response_model_or_is_a_documented_exception():
    app = create_app(Settings(redis_url="redis://unused", start_ray=False, watch=False))
    routes = api_routes(app)
    assert set(UNTYPED) <= {r.path for r in routes}, "a stale UNTYPED entry"
    schema = app.openapi()
    for route in routes:
        if route.path in UNTYPED:
            assert route.response_model is None, route.path
            continue
        assert route.response_model is not None, f"{route.path}: no response model"
        for method in route.methods:
            for code, answer in schema["paths"][route.path][method.lower()]["responses"].items():
                if code.startswith("2"):  # a model, or a list of models: never a bare object (list[dict])
                    body = answer["content"]["application/json"]["schema"]
                    assert "$ref" in body or "$ref" in body.get("items", {}), (method, route.path, code, body)


def test_only_the_operations_routes_are_open():
    app = create_app(Settings(redis_url="redis://unused", start_ray=False, watch=False))
    assert {r.path for r in api_routes(app) if not r.path.startswith("/v1/")} == OPEN_PATHS


def requests_of(client, headers: dict, methods: set[str] | None = None) -> list:
    """(method, route, answer): one request per method (of `methods`; None: all) of every route under /v1, the
    job in its path a real one."""
    out = []
    for route in api_routes(client.app):
        if route.path in OPEN_PATHS:
            continue
        path = route.path.replace("{job_id}", client.job_id)
        assert "{" not in path, f"{route.path}: a path parameter this test does not fill"
        for method in sorted(route.methods & (methods or route.methods)):
            out.append((method, route, client.request(method, path, headers=headers,
                                                      json=BODIES.get((method, route.path)))))
    return out


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}],
                         ids=["none", "wrong", "no-scheme"])
def test_every_v1_route_refuses_a_request_without_the_token_and_changes_nothing(client, headers):
    keys, record = sorted(client.redis.scan_iter()), JobStore(client.redis).get(client.job_id)
    answers = requests_of(client, headers)
    assert {method for method, _, _ in answers} & MUTATING, "no mutating route was tried"
    for method, route, r in answers:
        assert r.status_code == 401, (method, route.path, r.status_code, r.text)
        assert r.headers["www-authenticate"] == "Bearer" and r.json() == {"detail": "missing or wrong bearer token"}
    assert sorted(client.redis.scan_iter()) == keys  # no job created
    assert JobStore(client.redis).get(client.job_id) == record  # none cancelled


def test_an_unknown_job_gets_the_401_before_the_404(client):
    for route in api_routes(client.app):
        if "{job_id}" in route.path:
            for method in route.methods:
                r = client.request(method, route.path.replace("{job_id}", "no-such-job"))
                assert r.status_code == 401, (method, route.path, r.text)


def test_the_open_routes_answer_without_the_token(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/metrics").status_code == 200
    assert client.get("/readyz").status_code == 503  # no Ray here: not ready, but never a 401


def test_every_read_answers_its_response_model_with_the_token(client):
    answers = requests_of(client, AUTH, {"GET"})
    assert len(answers) >= 6, [route.path for _, route, _ in answers]
    for _, route, r in answers:
        assert r.status_code == 200, (route.path, r.text)
        TypeAdapter(route.response_model).validate_python(r.json())
    steps = client.get(f"/v1/jobs/{client.job_id}/steps", headers=AUTH).json()
    assert [(s["rl_step"], s["mean_reward"], s["reward_std"]) for s in steps] == [(0, -0.25, 0.0), (1, -0.25, 0.0)]
    events = client.get(f"/v1/jobs/{client.job_id}/events", headers=AUTH).json()
    assert [(e["from"], e["to"], e["ts"]) for e in events] == [("", "ROLLING_OUT", 1.0), ("ROLLING_OUT", "IDLE", 2.0)]


@pytest.mark.parametrize("damaged", ['{"rl_step": 2}', '{"rl_step": 2, "surprise": 1}', '[1, 2]',
                                     step_record(2).replace('"num_rollouts": 4', '"num_rollouts": -4')])
def test_a_damaged_step_record_is_logged_and_skipped_never_a_500(client, caplog, damaged):
    key = job_steps_key(client.job_id)
    client.redis.rpush(key, damaged, step_record(3))
    try:
        with caplog.at_level(logging.ERROR, logger="scheduler.schemas"):
            r = client.get(f"/v1/jobs/{client.job_id}/steps", headers=AUTH)
        assert r.status_code == 200 and [s["rl_step"] for s in r.json()] == [0, 1, 3], r.text
        assert f"job {client.job_id} step records: skipping a malformed entry" in caplog.text
    finally:
        client.redis.ltrim(key, 0, 1)
