"""The bundled verifiable task: arithmetic word problems generated from a seed.

Every row carries its ground-truth answer, so rewards are exact (rule-based) and
accuracy is measurable. Completions follow the GSM8K convention: a worked line,
then ``#### <answer>``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NAMES = ["Ann", "Ben", "Cal", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Joe", "Kim", "Lou"]
ITEMS = ["apple", "book", "coin", "pen", "egg", "cup", "ball", "card"]


@dataclass(frozen=True)
class Problem:
    question: str
    work: str
    answer: int

    @property
    def prompt(self) -> str:
        return f"Question: {self.question}\nAnswer:"

    @property
    def completion(self) -> str:
        return f" {self.work}\n#### {self.answer}"


def make_problem(rng: random.Random, max_operand: int = 20) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    if rng.random() < 0.5:
        q = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have?"
        return Problem(q, f"{a} + {b} = {a + b}", a + b)
    a, b = max(a, b), min(a, b)
    q = f"{name} has {a} {item}s and gives away {b}. How many {item}s are left?"
    return Problem(q, f"{a} - {b} = {a - b}", a - b)


def make_problems(n: int, seed: int, max_operand: int = 20) -> list[Problem]:
    rng = random.Random(seed)
    return [make_problem(rng, max_operand) for _ in range(n)]


NEAR_MISS = (3, 12)


def wrong_answer(problem: Problem, rng: random.Random, offsets: tuple[int, int] = NEAR_MISS) -> int:
    """A wrong answer off by ``offsets[0]`` to ``offsets[1]`` (default 3 to 12), never the true one.

    The default keeps near misses of 1 out: they are too subtle for a reward model of the
    default size to learn in a CPU minute. Evaluations that need headroom use (1, 2)."""
    low, high = offsets
    if not 1 <= low <= high:
        raise ValueError(f"offsets must satisfy 1 <= low <= high, got {offsets}")
    delta = rng.choice([-1, 1]) * rng.randint(low, high)
    return problem.answer + delta if problem.answer + delta >= 0 else problem.answer - delta


def wrong_completion(problem: Problem, rng: random.Random, offsets: tuple[int, int] = NEAR_MISS) -> str:
    w = wrong_answer(problem, rng, offsets)
    left = problem.work.rsplit("=", 1)[0].strip()
    return f" {left} = {w}\n#### {w}"


# Seeds of the fixed splits: eval never overlaps train by construction of the seed,
# and duplicates across splits are removed below.
TRAIN_SEED, EVAL_SEED, PROMPT_SEED = 1, 2, 3


def seeded_split(n: int, seed: int, exclude: set[str], make=None) -> list:
    """``n`` problems drawn by ``make(rng)`` (default :func:`make_problem`) from a stream seeded ``seed``,
    skipping questions in ``exclude``: every bundled task's train / eval / prompt splits."""
    make = make or make_problem
    out, rng = [], random.Random(seed)
    while len(out) < n:
        p = make(rng)
        if p.question not in exclude:
            out.append(p)
    return out


def eval_problems(n: int = 200) -> list[Problem]:
    return seeded_split(n, EVAL_SEED, set())


def train_problems(n: int = 2000) -> list[Problem]:
    held_out = {p.question for p in eval_problems()}
    return seeded_split(n, TRAIN_SEED, held_out)


def prompt_problems(n: int = 256) -> list[Problem]:
    held_out = {p.question for p in eval_problems()}
    return seeded_split(n, PROMPT_SEED, held_out)


def sft_rows(n: int = 2000) -> list[dict]:
    return [{"prompt": p.prompt, "completion": p.completion} for p in train_problems(n)]


def eval_rows(n: int = 200) -> list[dict]:
    return [{"prompt": p.prompt, "completion": p.completion, "ground_truth": str(p.answer)} for p in eval_problems(n)]


def prompt_rows(n: int = 256) -> list[dict]:
    return [{"prompt": p.prompt, "ground_truth": str(p.answer)} for p in prompt_problems(n)]


def preference_rows(problems: list[Problem], seed: int = 0, offsets: tuple[int, int] = NEAR_MISS) -> list[dict]:
    """Correct answer chosen, a wrong answer off by ``offsets`` (a near miss) rejected."""
    rng = random.Random(seed)
    return [{"prompt": p.prompt, "chosen": p.completion, "rejected": wrong_completion(p, rng, offsets)} for p in problems]


def corpus(n: int = 4000) -> list[str]:
    """Text the default tokenizer is trained on."""
    return [p.prompt + p.completion for p in make_problems(n, seed=12345)]
