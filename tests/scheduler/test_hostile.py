"""Hostile input against the REST API (a real app on a real redis-server): every bad request gets a 4xx that
names the problem, echoes nothing, creates nothing, and never touches a file outside the server's roots."""

from __future__ import annotations

import json
import os

import pytest
from fastapi.testclient import TestClient

from scheduler.app import Settings, create_app
from scheduler.http_errors import MAX_BODY_BYTES, safe_text
from scheduler.paths import DATA_ROOTS_ENV, is_under, roots_from_env, spec_path_errors
from tests.scheduler.apps import token_app
from workers.protocol.keys import jobs_index_key
from workers.redis_server import PrivateRedis
from workers.spec import JobSpec

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with token_app(tmp_path_factory.mktemp("roots"), TOKEN) as c:
        yield c


def assert_clean(r, status: int, field: str | None = None) -> None:
    assert r.status_code == status, r.text
    body = r.json()  # always JSON, whatever the input held
    if field is not None:
        assert field in [p for d in body["detail"] for p in d["loc"]], body
    assert "Traceback" not in r.text and "/site-packages/" not in r.text


BAD_BODIES = [
    ('{"lr": Infinity}', "lr"), ('{"temperature": NaN}', "temperature"), ('{"lr": -Infinity}', "lr"),
    ('{"drafter": {"lr": NaN}}', "lr"), ('{"kl_coef": 1e400}', "kl_coef"), ('{"kl_coef": 1000}', "kl_coef"),
    ('{"num_steps": 1e400}', "num_steps"), ('{"seed": 10000000000000000000000000000000000000000}', "seed"),
    ('{"seed": -1}', "seed"), ('{"max_grad_norm": 1e300}', "max_grad_norm"),
    ('{"model": "\\ud800"}', "model"), ('{"model": "/models/a\\u0000b"}', "model"),
    ('{"model": "../../../../etc/passwd"}', "model"), ('{"model": "/etc/passwd"}', "model"),
    ('{"model": "./smollm2"}', "model"), ('{"warm_draft": "/etc/passwd"}', "warm_draft"),
    ('{"task": "dataset", "dataset_path": "/etc/shadow"}', "dataset_path"),
    ('{"task": "dataset", "dataset_path": "/nonexistent/x.jsonl"}', "dataset_path"),
    ('{"model": "/' + "a" * 5000 + '"}', "model"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES)
def test_bad_bodies_get_422_naming_the_field_echo_nothing_and_create_nothing(client, body, field):
    before = client.redis.zcard(jobs_index_key())
    r = client.post("/v1/jobs", content=body.encode(), headers=AUTH)
    assert_clean(r, 422, field)
    assert "input" not in r.json()["detail"][0]  # FastAPI's default echoes the offending input
    assert len(r.content) < 2000
    assert client.redis.zcard(jobs_index_key()) == before


def test_paths_outside_the_roots_get_one_answer_whether_or_not_they_exist(client):
    """No probing: /etc/passwd (exists), /etc (a directory) and a missing file read alike."""
    answers = {client.post("/v1/jobs", json={"task": "dataset", "dataset_path": p}, headers=AUTH).text
               for p in ("/etc/passwd", "/etc", "/no/such/file.jsonl", "/root/.bashrc")}
    assert len(answers) == 1


def test_malformed_json_and_wrong_types(client):
    before = client.redis.zcard(jobs_index_key())
    for body in (b"{", b"[1, 2]", b"null", b'"text"', b"\xff\xfe", b'{"num_steps": "many"}'):
        assert_clean(client.post("/v1/jobs", content=body, headers=AUTH), 422)
    assert_clean(client.post("/v1/jobs", content="[" * 10_000 + "]" * 10_000, headers=AUTH), 400)  # deep nesting
    assert client.redis.zcard(jobs_index_key()) == before


def test_json_that_is_not_utf8_gets_422_json_invalid_and_creates_nothing(client):
    """RFC 8259 8.1: JSON between systems is UTF-8. Python's json reads UTF-16 and UTF-32 too; the API refuses
    them (and Latin-1), before the app parses anything. A UTF-8 byte order mark is let through, as the RFC allows."""
    before = client.redis.zcard(jobs_index_key())
    spec = '{"model": "tiny", "num_steps": 1}'
    for body in (spec.encode("utf-16"), spec.encode("utf-16-le"), spec.encode("utf-32"), spec.encode("utf-32-be"),
                 '{"model": "tiny", "dataset_path": "caf\u00e9"}'.encode("latin-1")):
        r = client.post("/v1/jobs", content=body, headers=AUTH)
        assert_clean(r, 422)
        [error] = r.json()["detail"]
        assert error["loc"] == ["body"] and error["type"] == "json_invalid", error
        assert "not UTF-8" in error["msg"] and "RFC 8259" in error["msg"], error
    assert client.redis.zcard(jobs_index_key()) == before
    r = client.post("/v1/jobs", content=spec.encode("utf-8-sig"), headers=AUTH)  # a UTF-8 byte order mark
    assert r.status_code == 201, r.text
    assert client.redis.zcard(jobs_index_key()) == before + 1


def test_bodies_over_the_limit_get_413_before_parsing(client):
    before = client.redis.zcard(jobs_index_key())
    big = b'{"model": "' + b"x" * (MAX_BODY_BYTES + 10) + b'"}'
    r = client.post("/v1/jobs", content=big, headers=AUTH)
    assert r.status_code == 413 and "bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"model": "'
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"x" * 65536
        yield b'"}'

    r = client.post("/v1/jobs", content=chunks(), headers=AUTH)
    assert r.status_code == 413
    r = client.post("/v1/jobs", content=b"{}", headers=AUTH | {"Content-Length": "lots"})
    assert r.status_code == 400
    assert client.redis.zcard(jobs_index_key()) == before


def test_out_of_range_query_parameters_get_422_not_500(client):
    base = f"/v1/jobs/{client.job_id}"
    assert_clean(client.get(f"{base}/steps?start={2 ** 63}", headers=AUTH), 422, "start")
    assert_clean(client.get(f"{base}/steps?start=-1", headers=AUTH), 422, "start")
    assert_clean(client.get(f"{base}/steps?start=1e400", headers=AUTH), 422, "start")
    assert_clean(client.get(f"{base}/events?after=99999999999999999999-0", headers=AUTH), 422, "after")
    assert client.get(f"{base}/steps?start=5", headers=AUTH).json() == []
    assert client.get(f"{base}/events?after=1-0", headers=AUTH).json() == []
    assert client.get("/v1/jobs?limit=999999999999999999999999", headers=AUTH).status_code == 200  # clamped


def test_unicode_and_nul_in_ids_are_404(client):
    for job_id in ("%00", "%ED%A0%80", "..%2F..%2Fetc", "a" * 5000):
        assert_clean(client.get(f"/v1/jobs/{job_id}", headers=AUTH), 404)


def test_path_checks_resolve_links_and_never_open_files(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.jsonl").write_text("{}\n")
    (root / "link").symlink_to(outside)
    assert is_under(str(root / "data.jsonl"), [str(root)])  # need not exist
    assert not is_under(str(root / "link" / "secret.jsonl"), [str(root)])  # a link out of the root
    assert not is_under(str(root / ".." / "outside" / "secret.jsonl"), [str(root)])
    assert not is_under(str(tmp_path / "rootx" / "a"), [str(root)])  # a sibling sharing the prefix
    spec = JobSpec(task="dataset", dataset_path=str(root / "d.jsonl"), model=str(outside / "m.gguf"),
                   warm_draft="store:job1:3")
    assert spec_path_errors(spec, [str(root)], [str(root)]) == [
        ("model", "model must be a path under the server's model_roots (set TLT_MODEL_ROOTS on the scheduler "
                  "to allow more)")]
    assert spec_path_errors(JobSpec(model="tiny"), [], []) == []  # presets are names


def test_roots_from_the_environment():
    assert roots_from_env({}, DATA_ROOTS_ENV) is None
    assert roots_from_env({DATA_ROOTS_ENV: f"/a{os.pathsep}/b"}, DATA_ROOTS_ENV) == ("/a", "/b")
    with pytest.raises(ValueError, match=f"{DATA_ROOTS_ENV}: roots must be absolute"):
        roots_from_env({DATA_ROOTS_ENV: "data"}, DATA_ROOTS_ENV)


def test_safe_text_always_encodes():
    out = safe_text("a\ud800b\x00c" + "x" * 1000, 50)
    json.dumps(out).encode("utf-8")  # no surrogate left to fail the response
    assert len(out) == 50 and "\\x00" in out


def test_redis_going_away_answers_503_and_the_api_recovers_when_it_returns(tmp_path):
    redis_server = PrivateRedis().start()
    try:
        app = create_app(Settings(redis_url=redis_server.url, api_token=TOKEN, store_dir=str(tmp_path),
                                  start_ray=False, watch=False))
        with TestClient(app, raise_server_exceptions=False) as c:
            assert c.get("/v1/jobs", headers=AUTH).status_code == 200
            redis_server.kill()
            submit = c.post("/v1/jobs", json={"model": "tiny"}, headers=AUTH)
            for r in (c.get("/v1/jobs", headers=AUTH), c.get("/v1/jobs/abc", headers=AUTH), submit, c.get("/metrics")):
                assert r.status_code == 503, (r.request.url, r.text)
                assert r.headers["retry-after"] and "Redis is unreachable" in r.json()["detail"]
            assert c.get("/readyz").status_code == 503
            redis_server.revive()
            assert c.get("/v1/jobs", headers=AUTH).json() == []  # reconnects by itself
    finally:
        redis_server.stop()
