"""Strict input at the REST edge (issue 34, item 6): numbers and flags only of their own JSON type, every
field of JobSpec and its sections; error bodies bounded in size. A real app on a real redis-server."""

from __future__ import annotations

import json

import pytest

from scheduler.http_errors import MAX_BODY_BYTES, MAX_ERRORS_REPORTED
from tests.scheduler.apps import token_app
from workers.protocol.keys import jobs_index_key
from workers.spec import JobSpec

TOKEN = "strict-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with token_app(tmp_path_factory.mktemp("roots"), TOKEN) as c:
        yield c


@pytest.mark.parametrize(("field", "value"), [
    ("num_steps", True), ("num_steps", "5"), ("num_steps", 5.0), ("group_size", "4"), ("seed", False),
    ("max_new_tokens", "128"), ("num_workers", True), ("checkpoint_every", "10"),
    ("lr", "0.1"), ("temperature", True), ("clip_eps", "0.2"),
    ("tlt", "true"), ("tlt", 1), ("normalize_std", "false"),
    ("drafter.num_rows", True), ("drafter.lr", "0.001"), ("swap_guard.num_verify_steps", "64"),
])
def test_a_value_of_another_json_type_is_refused(client, field, value):
    section, _, name = field.rpartition(".")
    body = {"model": "tiny"} | ({section: {name: value}} if section else {name: value})
    before = client.redis.zcard(jobs_index_key())
    r = client.post("/v1/jobs", json=body, headers=AUTH)
    assert r.status_code == 422, (field, value, r.text)
    assert [d["loc"][1:] for d in r.json()["detail"]] == [field.split(".")], r.text
    assert client.redis.zcard(jobs_index_key()) == before


def test_numbers_of_their_own_type_pass():
    spec = JobSpec.model_validate_json(json.dumps({"model": "tiny", "num_steps": 3, "lr": 1, "temperature": 0.5,
                                                   "drafter": {"lr": 1}, "tlt": False}))
    assert (spec.num_steps, spec.lr, spec.drafter.lr, spec.tlt) == (3, 1.0, 1.0, False)  # an int is a float
    assert JobSpec.model_validate(spec.model_dump()) == spec  # a stored record reads back


def test_a_422_lists_a_bounded_number_of_problems(client):
    body = json.dumps({f"k{i}": 0 for i in range(4000)}).encode()  # ~40 KB, under the body limit
    assert len(body) < MAX_BODY_BYTES
    r = client.post("/v1/jobs", content=body, headers=AUTH | {"Content-Type": "application/json"})
    assert r.status_code == 422
    detail = r.json()["detail"]
    assert len(detail) == MAX_ERRORS_REPORTED + 1 and len(r.content) < 4096, len(r.content)
    assert detail[-1] == {"loc": ["body"], "msg": f"{4000 - MAX_ERRORS_REPORTED} more problems not listed",
                          "type": "too_many_errors"}


def test_the_issues_60k_key_body_is_refused_unparsed(client):
    body = json.dumps({f"key{i}": 1 for i in range(60_000)}).encode()  # 769 KB: a 5.4 MB 422 before
    r = client.post("/v1/jobs", content=body, headers=AUTH)
    assert r.status_code == 413 and len(r.content) < 200, r.text
