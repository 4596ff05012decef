"""Tasks and rewards: deterministic arithmetic problems with correct answers, reward parsing, JSONL loading."""

from __future__ import annotations

import json
import re

import pytest

from workers.tasks import (
    LONG_INSTRUCTION,
    REWARDS,
    SHORT_INSTRUCTION,
    ArithmeticTask,
    LongTailTask,
    Problem,
    arithmetic_reward,
    get_reward,
    load_jsonl_dataset,
)


def _solve(prompt: str) -> tuple[int, int]:
    """Replays a problem's chain from its text alone: (answer, number of operations)."""
    value = int(re.match(r"\w+ has (\d+) \w+\.", prompt).group(1))
    steps = 0
    for sentence in re.findall(r"Then [^.]*\.", prompt):
        steps += 1
        if m := re.search(r"finds (\d+) more", sentence):
            value += int(m.group(1))
        elif m := re.search(r"buys (\d+) packs with (\d+)", sentence):
            value += int(m.group(1)) * int(m.group(2))
        elif m := re.search(r"gives away (\d+)", sentence):
            assert int(m.group(1)) < value
            value -= int(m.group(1))
        elif sentence.endswith("doubles."):
            value *= 2
        elif sentence.endswith("triples."):
            value *= 3
        elif m := re.search(r"into (\d+) equal piles", sentence):
            assert value % int(m.group(1)) == 0
            value //= int(m.group(1))
        else:
            raise AssertionError(f"unknown operation: {sentence}")
        assert value > 0
    return value, steps


def test_arithmetic_task_is_deterministic_per_seed():
    a = ArithmeticTask(seed=3).sample(30)
    assert a == ArithmeticTask(seed=3).sample(30)
    assert a != ArithmeticTask(seed=4).sample(30)
    task = ArithmeticTask(seed=3)
    assert task.sample(10) + task.sample(20) == a  # the stream does not depend on how it is cut


def test_arithmetic_answers_are_correct_and_chains_vary():
    problems = ArithmeticTask(seed=7, min_steps=1, max_steps=5).sample(200)
    lengths = set()
    for p in problems:
        value, steps = _solve(p.prompt)
        assert p.answer == str(value)
        assert 1 <= steps <= 5
        lengths.add(steps)
        assert p.prompt.endswith('give the final answer as "Answer: <number>".')
    assert lengths == {1, 2, 3, 4, 5}
    assert all(_solve(p.prompt)[1] == 6 for p in ArithmeticTask(seed=1, min_steps=6, max_steps=6).sample(20))


def test_longtail_task_mixes_answer_only_and_detailed_prompts_deterministically():
    problems = LongTailTask(seed=3).sample(400)
    assert problems == LongTailTask(seed=3).sample(400) and problems != LongTailTask(seed=4).sample(400)
    task = LongTailTask(seed=3)
    assert task.sample(150) + task.sample(250) == problems
    detailed = [p for p in problems if p.prompt.endswith(LONG_INSTRUCTION)]
    answer_only = [p for p in problems if p.prompt.endswith(SHORT_INSTRUCTION)]
    assert len(detailed) + len(answer_only) == 400 and len(detailed) == 40  # LONG_FRACTION 0.1
    places = set()
    for start in range(0, 400, 10):  # exact per block: every RL step of 10 prompts has one, at a random place
        block = [p.prompt.endswith(LONG_INSTRUCTION) for p in problems[start : start + 10]]
        assert sum(block) == 1
        places.add(block.index(True))
    assert len(places) > 3
    assert sum(p.prompt.endswith(LONG_INSTRUCTION) for p in LongTailTask(seed=3, long_fraction=0.75).sample(10)) == 8
    assert all(p.stop_strings == () for p in detailed)  # they run to max_new_tokens or EOS
    assert all(p.stop_strings == ("\n",) for p in answer_only)  # one line
    # the same problems and answers as the arithmetic task of the same seed, only the instruction differs
    for p, q in zip(problems, ArithmeticTask(seed=3).sample(400)):
        value, _ = _solve(p.prompt)
        assert p.answer == q.answer == str(value) and p.prompt.split("?")[0] == q.prompt.split("?")[0]
    assert all(p.prompt.endswith(LONG_INSTRUCTION) for p in LongTailTask(seed=0, long_fraction=1.0).sample(20))
    with pytest.raises(ValueError, match="long_fraction"):
        LongTailTask(long_fraction=1.5)


@pytest.mark.parametrize(("text", "reward"), [("Answer: 12", 1.0), ("Answer: 12.", 1.0), ("Answer: 13", 0.0),
                                              ("The total is 5 + 7 = 12.\nAnswer: 12", 1.0)])
def test_both_longtail_answer_forms_are_scored(text, reward):
    assert arithmetic_reward(text, "12") == reward


def test_arithmetic_task_errors():
    with pytest.raises(ValueError, match="min_steps"):
        ArithmeticTask(min_steps=0)
    with pytest.raises(ValueError, match="max_steps"):
        ArithmeticTask(min_steps=3, max_steps=2)


@pytest.mark.parametrize(("text", "answer", "reward"), [
    ("3 + 4 = 7. Answer: 7", "7", 1.0),
    ("3 + 4 = 8. Answer: 8", "7", 0.0),  # wrong
    ("Answer: 12.", "12", 1.0),  # trailing punctuation
    ("so it is 12. Answer: **12**!", "12", 1.0),
    ("Answer: 7 because 3 + 4 = 7 and 7 > 6", "7", 1.0),  # the number right after "Answer:" counts
    ("Answer: 5 ... wait. Answer: 7", "7", 1.0),  # the LAST "Answer:" counts
    ("Answer: 7 ... wait. Answer: 5", "7", 0.0),
    ("I think it is 7", "7", 1.0),  # no "Answer:": the last number in the text
    ("7 apples, then 9", "7", 0.0),
    ("7 apples. Answer: seven", "7", 1.0),  # "Answer:" with no number after it: fall back to the last number
    ("no idea", "7", 0.0),  # missing answer
    ("", "7", 0.0),
    ("Answer: -7", "-7", 1.0),  # negative
    ("Answer: -7", "7", 0.0),
    ("10-3 = 7", "7", 1.0),  # a minus glued to a digit is subtraction, not a sign
    ("Answer: 7.5", "7", 0.0),  # exact: a decimal is not the integer
    ("Answer: 1,200", "1200", 1.0),
])
def test_arithmetic_reward(text, answer, reward):
    assert get_reward("arithmetic")(text, answer) == reward


@pytest.mark.parametrize(("text", "answer", "reward"), [
    ("it is 3.0", "3", 1.0),
    ("it is 3.0000001", "3", 1.0),
    ("it is 3.001", "3", 0.0),
    ("first 3 then -2.5", "-2.5", 1.0),
    ("nothing", "3", 0.0),
    ("it is 3", "three", 0.0),  # an answer that is no number never matches
])
def test_numeric_reward(text, answer, reward):
    assert get_reward("numeric")(text, answer) == reward


def test_exact_reward_strips_and_is_case_sensitive():
    exact = get_reward("exact")
    assert exact(" Paris\n", "Paris") == 1.0
    assert exact("paris", "Paris") == 0.0
    assert exact("Paris.", "Paris") == 0.0


def test_rewards_by_registered_name_only():
    assert set(REWARDS) == {"arithmetic", "numeric", "exact"}
    with pytest.raises(ValueError, match=r"reward must be one of \['arithmetic', 'exact', 'numeric'\]"):
        get_reward("os.system")
    with pytest.raises(ValueError, match="one of"):
        get_reward("workers.tasks:exact_reward")


def _write(tmp_path, lines: list[str]):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_loader_reads_problems(tmp_path):
    path = _write(tmp_path, [json.dumps({"prompt": "1+1?", "answer": 2}), "",
                             json.dumps({"prompt": "Capital of France?", "answer": "Paris", "id": 9}),
                             json.dumps({"prompt": "half of 7?", "answer": 3.5}),
                             json.dumps({"prompt": "2*3?", "answer": 6.0})])
    assert load_jsonl_dataset(path) == [Problem("1+1?", "2"), Problem("Capital of France?", "Paris"),
                                        Problem("half of 7?", "3.5"), Problem("2*3?", "6")]


@pytest.mark.parametrize(("bad", "match"), [
    ("{not json", "line 2: not valid JSON"),
    ('["a", "b"]', "line 2: must be a JSON object"),
    ('{"answer": "1"}', 'line 2: field "prompt"'),
    ('{"prompt": "", "answer": "1"}', 'line 2: field "prompt"'),
    ('{"prompt": 5, "answer": "1"}', 'line 2: field "prompt"'),
    ('{"prompt": "q"}', 'line 2: field "answer"'),
    ('{"prompt": "q", "answer": true}', 'line 2: field "answer"'),
    ('{"prompt": "q", "answer": [1]}', 'line 2: field "answer"'),
    ('{"prompt": "q", "answer": NaN}', 'line 2: field "answer" must be a finite number'),
])
def test_jsonl_loader_errors_name_line_and_field(tmp_path, bad, match):
    path = _write(tmp_path, [json.dumps({"prompt": "ok", "answer": 1}), bad])
    with pytest.raises(ValueError, match=match):
        load_jsonl_dataset(path)


def test_jsonl_loader_file_errors(tmp_path):
    with pytest.raises(ValueError, match="dataset_path: no such file"):
        load_jsonl_dataset(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no problems"):
        load_jsonl_dataset(_write(tmp_path, ["", "  "]))
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_jsonl_dataset(binary)


def test_the_job_spec_names_exactly_the_registered_tasks():
    import typing

    from workers.spec import JobSpec
    from workers.tasks import TASKS, make_task

    assert set(typing.get_args(JobSpec.model_fields["task"].annotation)) == set(TASKS) | {"dataset"}
    with pytest.raises(ValueError, match="task must be one of arithmetic, longtail"):
        make_task("poetry", 0)
