"""Protocol hygiene of the REST API (a real app on a real redis-server, issue 34): tokens compared exactly,
cursors and ranges refused with a 4xx naming the parameter, nothing the client sent echoed back."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from scheduler.app import Settings, create_app
from scheduler.deps import token_matches
from scheduler.jobs import JobStore
from workers.protocol import jobs_index_key
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec

TOKEN = "s3cret-T0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    roots = tmp_path_factory.mktemp("roots")
    with PrivateRedis() as server:
        app = create_app(Settings(redis_url=server.url, api_token=TOKEN, store_dir=str(roots / "drafts"),
                                  model_roots=(str(roots / "models"),), data_roots=(str(roots / "data"),),
                                  start_ray=False, watch=False))
        with TestClient(app, raise_server_exceptions=False) as c:
            c.redis = server.client()
            c.job_id = JobStore(c.redis).create(JobSpec())[0]["job_id"]  # a record to read (never launched)
            yield c


def assert_refused(r, status: int, field: str, *echoes: str) -> None:
    """A 4xx naming `field`, with none of `echoes` (what the client sent) in the body."""
    assert r.status_code == status, r.text
    assert field in [p for d in r.json()["detail"] for p in d["loc"]], r.text
    for echo in echoes:
        assert echo not in r.text, r.text


# ----- tokens ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("header", [
    f"Bearer {TOKEN}\u00a0".encode(), f"Bearer {TOKEN}".encode() + b"\xa0",  # NBSP in UTF-8 and in latin-1
    f"Bearer {TOKEN} ", f"Bearer {TOKEN}\t", f"Bearer  {TOKEN}", f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x",
    f"Bearer {TOKEN.upper()}", "Bearer ", "Bearer wrong"])
def test_only_the_exact_token_passes(client, header):
    r = client.get("/v1/jobs", headers={"Authorization": header})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (header, r.text)
    before = client.redis.zcard(jobs_index_key())
    assert client.post("/v1/jobs", json={"model": "tiny"}, headers={"Authorization": header}).status_code == 401
    assert client.redis.zcard(jobs_index_key()) == before


def test_the_exact_token_passes_in_any_scheme_case(client):
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert client.get("/v1/jobs", headers={"Authorization": f"{scheme} {TOKEN}"}).status_code == 200
    for header in (TOKEN, f"Basic {TOKEN}", f"Bearer  {TOKEN}", f"Bearer{TOKEN}"):
        assert client.get("/v1/jobs", headers={"Authorization": header}).status_code == 401, header


def test_token_matches_compares_bytes_exactly():
    assert token_matches("Bearer " + "t\u00e9".encode().decode("latin-1"), "t\u00e9")  # a non-ASCII token
    assert not token_matches(None, "t") and not token_matches("Bearer t\u00a0", "t")
