"""Tasks and rewards. Rewards are chosen by registered NAME only: a job spec can never import or
run code of its own."""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str


_NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sofia", "Omar", "Lena"]
_ITEMS = ["apples", "marbles", "coins", "stickers", "books", "cards"]


class ArithmeticTask:
    """Word problems with chains of 1..max_steps operations, so reasoning lengths vary."""

    def __init__(self, seed: int = 0, min_steps: int = 1, max_steps: int = 4) -> None:
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
        self.rng = random.Random(seed)
        self.min_steps, self.max_steps = min_steps, max_steps

    def one(self) -> Problem:
        rng = self.rng
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        value = rng.randint(2, 20)
        text = [f"{name} has {value} {item}."]
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            op = rng.choice(["gets", "loses", "doubles"] if value > 1 else ["gets", "doubles"])
            if op == "gets":
                n = rng.randint(1, 9)
                value += n
                text.append(f"Then {name} gets {n} more.")
            elif op == "loses":
                n = rng.randint(1, value - 1)
                value -= n
                text.append(f"Then {name} gives away {n}.")
            else:
                value *= 2
                text.append(f"Then the number of {item} doubles.")
        text.append(f"How many {item} does {name} have now? Think step by step, then write 'Answer: <number>'.")
        return Problem(" ".join(text), str(value))

    def sample(self, num: int) -> list[Problem]:
        return [self.one() for _ in range(num)]


def load_jsonl_dataset(path: str | Path | None) -> list[Problem]:
    """Lines of {"prompt": str, "answer": str | number}."""
    if path is None or not Path(path).is_file():
        raise ValueError(f"dataset_path: no such file {path}")
    problems = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"dataset line {n}: not JSON") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) or not item["prompt"]:
            raise ValueError(f'dataset line {n}: field "prompt" must be a non-empty string')
        if not isinstance(item.get("answer"), (str, int, float)) or isinstance(item.get("answer"), bool):
            raise ValueError(f'dataset line {n}: field "answer" must be a string or a number')
        problems.append(Problem(item["prompt"], str(item["answer"])))
    if not problems:
        raise ValueError(f"dataset {path} holds no problems")
    return problems


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _last_number(text: str) -> str | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def arithmetic_reward(text: str, answer: str) -> float:
    """1.0 if the number after the last 'Answer:' (else the last number) equals the answer."""
    tail = text.rsplit("Answer:", 1)[1] if "Answer:" in text else text
    got = _last_number(tail)
    return 1.0 if got is not None and got == answer.strip() else 0.0


def numeric_reward(text: str, answer: str) -> float:
    got = _last_number(text)
    try:
        return 1.0 if got is not None and abs(float(got) - float(answer)) <= 1e-6 else 0.0
    except ValueError:
        return 0.0


def exact_reward(text: str, answer: str) -> float:
    return 1.0 if text.strip() == answer.strip() else 0.0


REWARDS: dict[str, Callable[[str, str], float]] = {
    "arithmetic": arithmetic_reward, "numeric": numeric_reward, "exact": exact_reward}


def get_reward(name: str) -> Callable[[str, str], float]:
    if name not in REWARDS:
        raise ValueError(f"reward must be one of {sorted(REWARDS)}, got {name!r}")
    return REWARDS[name]
