"""Schemathesis against the live OpenAPI schema of a running scheduler (uvicorn on a free port, a real
redis-server, no Ray: jobs it manages to create fail at once, cheaply). Every operation, bounded examples,
with the token. Checks: no server error, and every response conforms to the schema the API declares."""

from __future__ import annotations

import tempfile

import pytest

schemathesis = pytest.importorskip("schemathesis")  # in the dev extra; CI installs it
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    allow_header_conformance,
    negative_data_rejection,
    positive_data_acceptance,
)

from scheduler.app import Settings, create_app  # noqa: E402
from scheduler.demo import start_server  # noqa: E402
from workers.redis_server import PrivateRedis  # noqa: E402

TOKEN = "fuzz-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _openapi() -> dict:
    """The schema the app serves at /openapi.json (built without starting it)."""
    return create_app(Settings(redis_url="redis://unused", start_ray=False, watch=False)).openapi()


@pytest.fixture(scope="module")
def base_url():
    with PrivateRedis() as redis_server:
        url, server = start_server(Settings(redis_url=redis_server.url, api_token=TOKEN, start_ray=False,
                                            watch=False, store_dir=tempfile.mkdtemp(prefix="tlt-fuzz-")))
        try:
            yield url
        finally:
            server.should_exit = True
            server.thread.join(10)


schema = schemathesis.openapi.from_dict(_openapi())


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_responses_match_the_schema(case, base_url):
    # /readyz answers 503 by design here (no Ray); positive_data_acceptance: a JobSpec's cross-field rules
    # (warm_draft a path or store ref, paths under the roots) are not in the JSON schema, so schema-valid
    # bodies may rightly get a 422; allow_header_conformance: Starlette's 405 names the methods of the first
    # route on the path only (GET /v1/jobs's, not POST's); negative_data_rejection: undeclared query parameters
    # and headers are ignored, as HTTP services do (bad values of declared ones are tested: test_hostile.py)
    excluded = [positive_data_acceptance, allow_header_conformance, negative_data_rejection]
    if case.path == "/readyz":
        excluded.append(not_a_server_error)
    case.call_and_validate(base_url=base_url, headers=AUTH, excluded_checks=excluded)
