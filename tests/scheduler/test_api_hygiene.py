"""Protocol hygiene of the REST API (a real app on a real redis-server, issue 34): tokens compared exactly,
cursors and ranges refused with a 4xx naming the parameter, nothing the client sent echoed back."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from scheduler import report
from scheduler.app import Settings, create_app
from scheduler.deps import token_matches
from scheduler.http_errors import RETRY_AFTER_S
from scheduler.routes.jobs import MAX_STEPS_READ
from tests.scheduler.apps import step_record, token_app
from workers.protocol.keys import event_fields, job_events_key, job_steps_key, jobs_index_key
from workers.protocol.states import WorkerState
from workers.redis_server import PrivateRedis

TOKEN = "s3cret-T0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with token_app(tmp_path_factory.mktemp("roots"), TOKEN) as c:
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


# ----- cursors and ranges ---------------------------------------------------------------------------
MAX_ID_PART = 2 ** 64 - 1
BAD_CURSORS = [f"{MAX_ID_PART + 1}-0", f"0-{MAX_ID_PART + 1}", "99999999999999999999-0", "1", "1-2-3", "-1-0",
               "a-b", "\uff11-0", "1-0 ", " 1-0", "1.5-0", "..%2F..", "%00", "1" * 5000]


@pytest.mark.parametrize("after", BAD_CURSORS)
def test_malformed_events_cursors_get_422_naming_after_without_the_value(client, after):
    r = client.get(f"/v1/jobs/{client.job_id}/events", params={"after": after}, headers=AUTH)
    assert_refused(r, 422, "after", *([after] if len(after) > 3 else []))
    assert "must be a stream id" in r.text


def test_crafted_events_cursors_answer_and_never_fail(client):
    base = f"/v1/jobs/{client.job_id}/events"
    key = job_events_key(client.job_id)
    client.redis.delete(key)
    for entry_id in ("5-0", "5-1", "6-0"):
        client.redis.xadd(key, event_fields("w0", None, WorkerState.IDLE, 1.0, 0), id=entry_id)
    answers = {after: client.get(base, params={"after": after}, headers=AUTH) for after in (
        f"{MAX_ID_PART}-{MAX_ID_PART}", f"{MAX_ID_PART}-0", f"0-{MAX_ID_PART}", f"5-{MAX_ID_PART}", "0-0", "5-0",
        "00000000000000000005-00000000000000000001")}
    assert {a: r.status_code for a, r in answers.items()} == dict.fromkeys(answers, 200)
    ids = {a: [e["id"] for e in r.json()] for a, r in answers.items()}
    everything = ["5-0", "5-1", "6-0"]
    assert ids == {f"{MAX_ID_PART}-{MAX_ID_PART}": [], f"{MAX_ID_PART}-0": [], f"0-{MAX_ID_PART}": everything,
                   f"5-{MAX_ID_PART}": ["6-0"], "0-0": everything, "5-0": ["5-1", "6-0"],
                   "00000000000000000005-00000000000000000001": ["6-0"]}


@pytest.mark.parametrize(("query", "field"), [
    ("steps?start=-1", "start"), (f"steps?start={2 ** 63}", "start"), (f"steps?start={2 ** 64}", "start"),
    ("steps?start=1e400", "start"), ("steps?start=%00", "start"), ("steps?start=0x10", "start"),
    ("events?limit=many", "limit"), ("events?limit=1.5", "limit")])
def test_malformed_ranges_get_422_naming_the_parameter(client, query, field):
    r = client.get(f"/v1/jobs/{client.job_id}/{query}", headers=AUTH)
    assert_refused(r, 422, field, query.partition("=")[2])


@pytest.mark.parametrize("query", [f"/v1/jobs?limit={10 ** 30}", "/v1/jobs?limit=-5", "/v1/jobs?limit=0",
                                   "{base}/events?limit=-1", f"{{base}}/events?limit={2 ** 70}",
                                   f"{{base}}/steps?start={2 ** 62}"])
def test_out_of_range_limits_are_clamped(client, query):
    assert client.get(query.format(base=f"/v1/jobs/{client.job_id}"), headers=AUTH).status_code == 200


# ----- readiness ------------------------------------------------------------------------------------
def test_readyz_says_redis_unavailable_with_retry_after_and_never_where_or_why(tmp_path):
    redis_server = PrivateRedis().start()
    try:
        app = create_app(Settings(redis_url=redis_server.url, store_dir=str(tmp_path), start_ray=False, watch=False))
        with TestClient(app, raise_server_exceptions=False) as c:
            r = c.get("/readyz")  # no Ray here: not ready, in fixed words
            assert r.status_code == 503 and r.json() == {"detail": "ray not initialised"}
            assert int(r.headers["retry-after"]) == RETRY_AFTER_S
            redis_server.kill()
            r = c.get("/readyz")
            assert r.status_code == 503 and r.json() == {"detail": "redis unavailable; ray not initialised"}
            assert int(r.headers["retry-after"]) == RETRY_AFTER_S
            for leak in (str(redis_server.port), "127.0.0.1", "localhost", "Error", "connect", "refused", "redis://"):
                assert leak not in r.text, (leak, r.text)
            redis_server.revive()
            assert c.get("/readyz").json() == {"detail": "ray not initialised"}
    finally:
        redis_server.stop()


# ----- nothing echoed -------------------------------------------------------------------------------
@pytest.mark.parametrize("warm_draft", ["secret-draft-name", "store:job1", "store:../../x:1", "http://evil.example/x",
                                        "~/my-draft", "C:\\drafts\\d.safetensors"])
def test_bad_warm_drafts_get_422_naming_the_field_and_the_rule_not_the_value(client, warm_draft):
    before = client.redis.zcard(jobs_index_key())
    r = client.post("/v1/jobs", json={"model": "tiny", "warm_draft": warm_draft}, headers=AUTH)
    assert_refused(r, 422, "warm_draft", warm_draft)
    assert "store:JOBID:VERSION" in r.text and client.redis.zcard(jobs_index_key()) == before


@pytest.mark.parametrize("key", ["has space-secret", "slash/secret", "a" * 129, "semi;colon-secret", "",
                                 "ünïcode-secret".encode().decode("latin-1")])
def test_bad_idempotency_keys_get_422_naming_the_header_and_the_rule_not_the_value(client, key):
    before = client.redis.zcard(jobs_index_key())
    r = client.post("/v1/jobs", json={"model": "tiny"}, headers=AUTH | {"Idempotency-Key": key.encode("latin-1")})
    assert_refused(r, 422, "idempotency-key", *([key] if key else []))
    assert "secret" not in r.text and client.redis.zcard(jobs_index_key()) == before


def test_a_reused_idempotency_key_is_refused_without_echoing_it(client):
    key = {"Idempotency-Key": "my-private-key-4711"}
    assert client.post("/v1/jobs", json={"model": "tiny"}, headers=AUTH | key).status_code == 201
    r = client.post("/v1/jobs", json={"model": "tiny", "seed": 1}, headers=AUTH | key)
    assert_refused(r, 422, "idempotency-key", "my-private-key-4711", "4711")
    assert "already used for a different job spec" in r.text


def test_unknown_job_ids_are_not_echoed(client):
    for job_id in ("no-such-job-4711", "x" * 128):
        for path in (f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/steps", f"/v1/jobs/{job_id}/events"):
            r = client.get(path, headers=AUTH)
            assert r.status_code == 404 and job_id not in r.text and r.json() == {"detail": "job not found"}


# ----- pages ----------------------------------------------------------------------------------------
def test_steps_come_in_bounded_pages_that_continue_from_start(client, monkeypatch):
    key = job_steps_key(client.job_id)
    client.redis.delete(key)
    client.redis.rpush(key, *(step_record(i) for i in range(MAX_STEPS_READ + 250)))
    base = f"/v1/jobs/{client.job_id}/steps"

    def rl_steps(query: str) -> list[int]:
        r = client.get(base + query, headers=AUTH)
        assert r.status_code == 200, r.text
        return [s["rl_step"] for s in r.json()]

    assert rl_steps("") == list(range(MAX_STEPS_READ))  # the default page is the largest
    assert rl_steps(f"?limit={10 ** 30}") == list(range(MAX_STEPS_READ))
    assert rl_steps("?start=5&limit=3") == [5, 6, 7] and rl_steps("?limit=0") == [0]
    assert rl_steps(f"?start={MAX_STEPS_READ}") == list(range(MAX_STEPS_READ, MAX_STEPS_READ + 250))
    assert rl_steps(f"?start={MAX_STEPS_READ + 250}") == []
    # `tlt report` reads them all, page by page
    monkeypatch.setattr(report, "call", lambda method, url, path, token=None: client.get(path, headers=AUTH).json())
    assert [s["rl_step"] for s in report.read_steps("unused", client.job_id)] == list(range(MAX_STEPS_READ + 250))
    client.redis.delete(key)


def test_events_pages_continue_from_the_last_id_without_a_gap(client):
    key = job_events_key(client.job_id)
    client.redis.delete(key)
    ids = [client.redis.xadd(key, event_fields("w0", None, WorkerState.IDLE, 1.0, i)) for i in range(25)]
    base = f"/v1/jobs/{client.job_id}/events"
    assert [e["id"] for e in client.get(f"{base}?limit=10", headers=AUTH).json()] == ids[-10:]  # the newest
    seen, after = [], ids[0]
    while page := client.get(base, params={"after": after, "limit": 10}, headers=AUTH).json():
        seen += [e["id"] for e in page]
        after = page[-1]["id"]
    assert seen == ids[1:]
    client.redis.delete(key)
