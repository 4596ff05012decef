"""Tasks (prompts with reference answers) and rewards.

Rewards are chosen by registered NAME only (`REWARDS`, `get_reward`): a job spec carries a string
that is looked up in this module's table, so nothing in a job spec can import or run code. Adding
a reward means adding a function here, reviewed like any other code.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the reference answer as text, e.g. "42"
    stop_strings: tuple[str, ...] = ()  # the response ends at the first of these (sent with its rollouts)


ANSWER_INSTRUCTION = 'Think step by step, then give the final answer as "Answer: <number>".'
_NAMES = ["Tom", "Anna", "Ravi", "Mei", "Lucas", "Sofia", "Omar", "Lena", "Kofi", "Ines"]
_ITEMS = ["apples", "marbles", "coins", "stickers", "books", "cards", "pencils", "shells"]
_MAX_VALUE_TO_MULTIPLY = 60  # keeps every intermediate value small (below ~200)


class ArithmeticTask:
    """Word problems whose chains hold min_steps..max_steps operations, so the reasoning (and the
    response) lengths vary: the long tail the scheduler exists for.

    Deterministic per seed: the same seed yields the same problems in the same order, across calls
    (`sample(3); sample(2)` gives the same five problems as `sample(5)`).
    """

    def __init__(self, seed: int = 0, min_steps: int = 1, max_steps: int = 4) -> None:
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {min_steps}")
        if max_steps < min_steps:
            raise ValueError(f"max_steps must be >= min_steps ({min_steps}), got {max_steps}")
        self.min_steps, self.max_steps = min_steps, max_steps
        self._rng = random.Random(seed)

    def _step(self, value: int, name: str, item: str) -> tuple[int, str]:
        """One operation on `value`; returns the new value and its sentence."""
        rng = self._rng
        ops = ["gets", "buys_packs"]
        if value > 1:
            ops.append("gives")
        if value <= _MAX_VALUE_TO_MULTIPLY:
            ops.append("multiplies")
        divisors = [k for k in (2, 3, 4) if value % k == 0 and value > k]
        if divisors:
            ops.append("shares")
        op = rng.choice(ops)
        if op == "gets":
            n = rng.randint(1, 9)
            return value + n, f"Then {name} finds {n} more {item}."
        if op == "buys_packs":
            packs, per_pack = rng.randint(2, 4), rng.randint(2, 5)
            return value + packs * per_pack, f"Then {name} buys {packs} packs with {per_pack} {item} in each pack."
        if op == "gives":
            n = rng.randint(1, value - 1)
            return value - n, f"Then {name} gives away {n} {item}."
        if op == "multiplies":
            k = rng.choice([2, 3])
            word = {2: "doubles", 3: "triples"}[k]
            return value * k, f"Then the number of {item} {name} has {word}."
        k = rng.choice(divisors)
        return value // k, f"Then {name} splits the {item} into {k} equal piles and keeps one pile."

    def one(self) -> Problem:
        rng = self._rng
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        value = rng.randint(2, 20)
        sentences = [f"{name} has {value} {item}."]
        for _ in range(rng.randint(self.min_steps, self.max_steps)):
            value, sentence = self._step(value, name, item)
            sentences.append(sentence)
        sentences.append(f"How many {item} does {name} have now? {ANSWER_INSTRUCTION}")
        return Problem(" ".join(sentences), str(value))

    def sample(self, n: int) -> list[Problem]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self.one() for _ in range(n)]


SHORT_INSTRUCTION = 'Reply with only the final answer, as "Answer: <number>", on one line.'
LONG_INSTRUCTION = ('Think step by step and explain every step in detail, then give the final answer as '
                    '"Answer: <number>".')
LONG_FRACTION = 0.1  # share of prompts that ask for detailed reasoning: the tail (0.2 measured p90 = 512)
MIX_BLOCK = 10  # the mix is exact per block of this many prompts (long_fraction counts in tenths)
LONGTAIL_MAX_NEW_TOKENS = 512  # the variant's natural cap: the detailed answers run to it


class LongTailTask:
    """The arithmetic problems with a heavy-tailed response length, as reasoning RL has (the last 10% of
    requests take about half the rollout time in published runs; rollout is 63-85% of the step).

    Most prompts (1 - long_fraction) ask for the final answer alone, on one line, and their rollouts stop at
    the first newline; the others ask for detailed step-by-step reasoning and run to max_new_tokens=512
    (LONGTAIL_MAX_NEW_TOKENS) or EOS. The answer line ("Answer: <number>") is asked of both, so the
    arithmetic reward scores both. Why a mix rather than one instruction: at T=1.0 SmolLM2-135M-Instruct
    rambles under either instruction alone (asked for the answer only, 3 of 12 still hit 512 tokens), so the
    short side needs the one-line stop, and the long side keeps the model's own spread (15..512).
    Measured with SmolLM2-135M-Instruct, plain decoding, T=1.0, max_new_tokens=512, 1 thread, one batch of 48
    rollouts (LongTailTask(2), 16 prompts x 3, 2 of them detailed): response tokens median 27, p90 226,
    p99 512, max 512, min 6; 4 of 48 at the cap; the longest 10% of responses hold 57% of the tokens and the
    last 10% to finish took 30% of the batch's wall time (a shared, loaded box). At long_fraction 0.25
    (LongTailTask(0), 3 of 12 prompts detailed, 48 rollouts) the tail was too heavy: median 46 but p90 512,
    8 of 48 at the cap. Answer-line reward 0.06 (the untrained 135M model rarely gets the sum right).

    Deterministic per seed, like ArithmeticTask (the same seed: the same problems, the same mix). The mix is
    drawn in blocks of 10 prompts (MIX_BLOCK), each holding exactly round(long_fraction * 10) detailed ones at
    seeded random places, not a coin per prompt: a step of num_prompts_per_step = 10 has its tail (one
    detailed prompt at 0.1), never none or a double one.
    """

    def __init__(self, seed: int = 0, long_fraction: float = LONG_FRACTION, min_steps: int = 1,
                 max_steps: int = 4) -> None:
        if not 0.0 <= long_fraction <= 1.0:
            raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
        self.long_fraction = long_fraction
        self._problems = ArithmeticTask(seed, min_steps, max_steps)
        self._rng = random.Random(seed + 1)  # the mix, apart from the problems' own draws
        self._block: list[bool] = []  # what is left of the current block of MIX_BLOCK prompts: detailed or not

    def one(self) -> Problem:
        base = self._problems.one()
        stem = base.prompt[: -len(ANSWER_INSTRUCTION)]
        if not self._block:  # exactly round(long_fraction * 10) of every 10 prompts are detailed, at random places
            num_long = round(self.long_fraction * MIX_BLOCK)
            self._block = [True] * num_long + [False] * (MIX_BLOCK - num_long)
            self._rng.shuffle(self._block)
        if self._block.pop():
            return Problem(stem + LONG_INSTRUCTION, base.answer)
        return Problem(stem + SHORT_INSTRUCTION, base.answer, stop_strings=("\n",))

    def sample(self, n: int) -> list[Problem]:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return [self.one() for _ in range(n)]


# the built-in tasks by the name a JobSpec gives (task "dataset" reads a file instead: load_jsonl_dataset)
TASKS: dict[str, type[ArithmeticTask] | type[LongTailTask]] = {"arithmetic": ArithmeticTask, "longtail": LongTailTask}


def make_task(name: str, seed: int, **options) -> ArithmeticTask | LongTailTask:
    """The built-in task `name` drawn with `seed`; ValueError naming task for an unknown one."""
    if name not in TASKS:
        raise ValueError(f"task must be one of {', '.join(sorted(TASKS))}, got {name!r}")
    return TASKS[name](seed, **options)


def _answer_text(value: object) -> str:
    """JSON answer -> text; integral floats read as integers (7.0 -> "7") so exact rewards match."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value).strip()


def load_jsonl_dataset(path: str | Path | None) -> list[Problem]:
    """Problems from a JSONL file, one {"prompt": str, "answer": str | number} per line (other
    keys are ignored, blank lines skipped). Any bad line raises ValueError naming line and field."""
    if path is None or not Path(path).is_file():
        raise ValueError(f"dataset_path: no such file {path}")
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"dataset_path: {path} is not UTF-8 text ({exc.reason})") from None
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"dataset line {n}: not valid JSON ({exc.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"dataset line {n}: must be a JSON object with fields \"prompt\" and \"answer\"")
        prompt, answer = item.get("prompt"), item.get("answer")
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f'dataset line {n}: field "prompt" must be a non-empty string')
        is_number = isinstance(answer, (int, float)) and not isinstance(answer, bool)
        if not (isinstance(answer, str) or is_number):
            raise ValueError(f'dataset line {n}: field "answer" must be a string or a number')
        if is_number and not math.isfinite(answer):
            raise ValueError(f'dataset line {n}: field "answer" must be a finite number')
        problems.append(Problem(prompt, _answer_text(answer)))
    if not problems:
        raise ValueError(f"dataset_path: {path} holds no problems")
    return problems


# A number: optional sign (not when glued to a preceding digit, as in "10-3"), digits, optional decimals.
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # "1,000" -> "1000"


def _numbers(text: str) -> list[str]:
    return _NUMBER.findall(_THOUSANDS.sub("", text))


def arithmetic_reward(text: str, answer: str) -> float:
    """1.0 if the number right after the last "Answer:" (else the last number in the text) is
    exactly the answer's text ("7" matches "7", not "7.0"), else 0.0."""
    if "Answer:" in text:
        after = _numbers(text.rsplit("Answer:", 1)[1])
        if after:
            return 1.0 if after[0] == answer.strip() else 0.0
    found = _numbers(text)
    return 1.0 if found and found[-1] == answer.strip() else 0.0


def numeric_reward(text: str, answer: str) -> float:
    """1.0 if the last number in the text equals the answer as floats, within 1e-6."""
    found = _numbers(text)
    if not found:
        return 0.0
    try:
        target = float(answer.replace(",", ""))
    except ValueError:
        return 0.0
    return 1.0 if abs(float(found[-1]) - target) <= 1e-6 else 0.0


def exact_reward(text: str, answer: str) -> float:
    """1.0 if the stripped text equals the stripped answer (case-sensitive)."""
    return 1.0 if text.strip() == answer.strip() else 0.0


REWARDS: dict[str, Callable[[str, str], float]] = {
    "arithmetic": arithmetic_reward,
    "numeric": numeric_reward,
    "exact": exact_reward,
}


def get_reward(name: str) -> Callable[[str, str], float]:
    """The reward function registered under `name`; ValueError listing the valid names otherwise."""
    if name not in REWARDS:
        raise ValueError(f"reward must be one of {sorted(REWARDS)}, got {name!r}")
    return REWARDS[name]


class StepProblems:
    """A job's problems, step by step: step k's are problems k*n .. k*n+n-1 of the task's sequence (n =
    num_prompts_per_step), drawn when the step asks for them, never all the steps' at once (a job of 100,000
    steps would hold billions before its first step). A dataset's lines are read once and wrap around. Steps
    are asked for in order; an earlier one (a test, a re-read) replays the task from its seed."""

    def __init__(self, task: str, seed: int, num_per_step: int, dataset_path: str | None = None) -> None:
        self.task, self.seed, self.num_per_step = task, seed, num_per_step
        self._dataset = load_jsonl_dataset(dataset_path) if task == "dataset" else None
        self._source = None if self._dataset is not None else make_task(task, seed)
        self._num_drawn = 0  # problems of the task's sequence drawn so far

    def step(self, rl_step: int) -> list[Problem]:
        n, start = self.num_per_step, rl_step * self.num_per_step
        if self._dataset is not None:
            return [self._dataset[(start + i) % len(self._dataset)] for i in range(n)]
        if start < self._num_drawn:
            self._source, self._num_drawn = make_task(self.task, self.seed), 0
        for _ in range(start - self._num_drawn):  # a resumed job skips the steps done: drawn, not kept
            self._source.one()
        self._num_drawn = start + n
        return self._source.sample(n)
