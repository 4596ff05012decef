"""Job budgets (issue 34, item 1): a job's size checked as a whole at the REST edge, on a real app and a real
redis-server; the driver's problems drawn step by step."""

from __future__ import annotations

import pytest

from scheduler.budget import JobBudget, budget_errors, step_memory_bytes, step_tokens
from tests.scheduler.apps import token_app
from workers.protocol.keys import jobs_index_key
from workers.spec import JobSpec
from workers.tasks import StepProblems, make_task

TOKEN = "budget-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
OVERSIZED = {"model": "tiny", "num_steps": 100000, "num_prompts_per_step": 65536, "group_size": 256,
             "max_new_tokens": 131072, "micro_batch_size": 4096}  # the spec: every field in bounds


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with token_app(tmp_path_factory.mktemp("roots"), TOKEN) as c:
        yield c


def test_the_oversized_spec_is_refused_naming_each_limit(client):
    before = client.redis.zcard(jobs_index_key())
    r = client.post("/v1/jobs", json=OVERSIZED, headers=AUTH)
    assert r.status_code == 422, r.text
    msgs = " ".join(d["msg"] for d in r.json()["detail"])
    for limit in ("max_tokens_per_step", "max_tokens_per_job", "max_step_memory_bytes"):
        assert limit in msgs, r.text
    assert {d["type"] for d in r.json()["detail"]} == {"over_budget"}
    assert "131072" not in r.text and "65536" not in r.text  # the values sent are not echoed
    assert client.redis.zcard(jobs_index_key()) == before  # nothing stored


def test_one_limit_alone_is_named(client):
    spec = {"model": "tiny", "num_steps": 100_000, "num_prompts_per_step": 512, "group_size": 16,
            "max_new_tokens": 8192, "micro_batch_size": 1}  # a large step within max_tokens_per_step, too many steps
    r = client.post("/v1/jobs", json=spec, headers=AUTH)
    assert r.status_code == 422 and [d["loc"] for d in r.json()["detail"]] == [["body", "num_steps"]], r.text
    assert "max_tokens_per_job" in r.text


def test_a_job_at_the_budget_passes_and_one_over_fails():
    spec = JobSpec(model="tiny", num_prompts_per_step=8, group_size=4, max_new_tokens=16, num_steps=10)
    exact = JobBudget(max_tokens_per_step=step_tokens(spec), max_tokens_per_job=10 * step_tokens(spec),
                      max_step_memory_bytes=step_memory_bytes(spec))
    assert budget_errors(spec, exact) == []
    over = spec.model_copy(update={"num_steps": 11})
    assert [f for f, _ in budget_errors(over, exact)] == ["num_steps"]
    assert [f for f, _ in budget_errors(spec.model_copy(update={"micro_batch_size": 5}), exact)] == [
        "micro_batch_size"]
    with pytest.raises(ValueError, match="max_tokens_per_step must be >= 1"):
        JobBudget(max_tokens_per_step=0)


def test_a_path_model_is_counted_at_the_largest_vocabulary():
    preset, path = JobSpec(model="smollm2-135m"), JobSpec(model="/models/any")
    assert step_memory_bytes(path) > step_memory_bytes(preset) > step_memory_bytes(JobSpec(model="tiny"))


def test_default_jobs_fit_the_default_budget():
    assert budget_errors(JobSpec(), JobBudget()) == []
    assert budget_errors(JobSpec(task="longtail", max_new_tokens=512, num_prompts_per_step=16), JobBudget()) == []


# ----- the driver's problems, step by step ------------------------------------------------------------
def test_step_problems_are_the_tasks_sequence_drawn_lazily():
    eager = make_task("longtail", 3).sample(5 * 4)
    lazy = StepProblems("longtail", 3, 4)
    assert lazy._num_drawn == 0  # nothing drawn before the first step asks
    assert lazy.step(0) == eager[0:4] and lazy._num_drawn == 4
    assert lazy.step(3) == eager[12:16] and lazy._num_drawn == 16  # a resumed job skips, keeping none
    assert lazy.step(1) == eager[4:8]  # an earlier step replays from the seed


def test_step_problems_of_a_huge_job_cost_one_step():
    spec = JobSpec.model_validate(OVERSIZED | {"num_prompts_per_step": 8})  # 100,000 steps
    problems = StepProblems(spec.task, spec.seed, spec.num_prompts_per_step)
    assert len(problems.step(0)) == 8 and problems._num_drawn == 8


def test_step_problems_wrap_a_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": 1}\n{"prompt": "b", "answer": 2}\n{"prompt": "c", "answer": 3}\n')
    problems = StepProblems("dataset", 0, 2, str(path))
    assert [p.prompt for p in problems.step(0) + problems.step(1)] == ["a", "b", "c", "a"]
