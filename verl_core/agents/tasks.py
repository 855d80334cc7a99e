"""Bundled agent tasks: environments registered by name (:data:`~verl_core.agents.environments.ENVIRONMENTS`).

``calculator_arithmetic``: word problems of three operands, ``a * b ± c`` with ``a`` of two digits
(``"Ann has 37 bags of 4 apples each and gets 19 more apples. How many apples does Ann have?"``).
The embedded default cannot multiply a two-digit number in its head (SFT on worked answers scores
a few percent held out, ``bench/agent_rl.py``), but it can copy the numbers into a calculator call
and the result into its answer. One episode, in the ``pythonic`` call format::

    user       Ann has 37 bags of 4 apples each and gets 19 more apples. How many apples does Ann have?
    assistant  [calculator(expression="37 * 4 + 19")]
    tool       167
    assistant  #### 167

Splits are seeded like :mod:`verl_core.bundled.arithmetic`: held-out questions never appear in the
training or prompt splits. :func:`sft_rows` shows the tool use as chat ``messages`` rows, one per
assistant turn (the SFT data format puts the loss on the last assistant message, so each turn is
a row of its own and tool results are context only), on a minority of the problems; the others are
answered in one turn without a tool (:func:`direct_sft_rows`, ``37 * 4 + 19 = 167`` then ``#### 167``).

``python_math``: the ``python`` tool (the sandbox) in the Hermes format for a real instruct model
on the user's prompts (GSM8K: ``configs/gsm8k_tools.yaml``); no bundled rows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from verl_core.agents.environments import Environment, register_environment
from verl_core.bundled.arithmetic import ITEMS, NAMES, seeded_split

TRAIN_SEED, EVAL_SEED, PROMPT_SEED = 21, 22, 23


@dataclass(frozen=True)
class ToolProblem:
    question: str
    expression: str
    answer: int

    @property
    def call(self) -> str:
        return f'[calculator(expression="{self.expression}")]'

    @property
    def final(self) -> str:
        return f"#### {self.answer}"


def make_problem(rng: random.Random) -> ToolProblem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(11, 99), rng.randint(3, 9), rng.randint(1, 30)
    if rng.random() < 0.5:
        q = f"{name} has {a} bags of {b} {item}s each and gets {c} more {item}s. How many {item}s does {name} have?"
        return ToolProblem(q, f"{a} * {b} + {c}", a * b + c)
    q = f"{name} has {a} bags of {b} {item}s each and gives away {c} {item}s. How many {item}s are left?"
    return ToolProblem(q, f"{a} * {b} - {c}", a * b - c)


def _split(n: int, seed: int, exclude: set[str]) -> list[ToolProblem]:
    return seeded_split(n, seed, exclude, make_problem)


def eval_problems(n: int = 200) -> list[ToolProblem]:
    return _split(n, EVAL_SEED, set())


def _held_out() -> set[str]:
    return {p.question for p in eval_problems(1000)}


def train_problems(n: int = 2000) -> list[ToolProblem]:
    return _split(n, TRAIN_SEED, _held_out())


def prompt_problems(n: int = 512) -> list[ToolProblem]:
    return _split(n, PROMPT_SEED, _held_out())


def _user(p: ToolProblem) -> list[dict]:
    return [{"role": "user", "content": p.question}]


def episode_messages(p: ToolProblem) -> list[dict]:
    """The whole correct episode as chat messages."""
    return [
        *_user(p),
        {"role": "assistant", "content": p.call},
        {"role": "tool", "content": str(p.answer)},
        {"role": "assistant", "content": p.final},
    ]


def sft_rows(n: int = 3000, tool_fraction: float = 0.3, seed: int = 0) -> list[dict]:
    """Tool episodes for a ``tool_fraction`` of the problems (two rows each: the call after the question,
    the answer after the call and its result), one-turn direct answers (:func:`direct_sft_rows`) for the
    rest. The SFT policy then answers directly most of the time, mostly wrongly; RL finds that the
    calculator pays (``bench/agent_rl.py``)."""
    rows, rng = [], random.Random(seed)
    for p in train_problems(n):
        if rng.random() < tool_fraction:
            messages = episode_messages(p)
            rows += [{"messages": messages[:2]}, {"messages": messages}]
        else:
            rows.append(_direct(p))
        if len(rows) >= n:
            break
    return rows[:n]


def _direct(p: ToolProblem) -> dict:
    return {"messages": [*_user(p), {"role": "assistant", "content": f"{p.expression} = {p.answer}\n{p.final}"}]}


def direct_sft_rows(n: int = 2000) -> list[dict]:
    """The same problems answered in one turn without a tool: ``37 * 4 + 19 = 167`` then ``#### 167``."""
    return [_direct(p) for p in train_problems(n)]


def prompt_rows(n: int = 512) -> list[dict]:
    return [{"prompt": _user(p), "ground_truth": str(p.answer)} for p in prompt_problems(n)]


def eval_rows(n: int = 200) -> list[dict]:
    return [{"prompt": _user(p), "ground_truth": str(p.answer)} for p in eval_problems(n)]


CALCULATOR_ARITHMETIC = register_environment(
    Environment(
        "calculator_arithmetic",
        tools=("calculator",),
        parser="pythonic",
        max_turns=3,
        summary="a * b ± c word problems with a calculator tool (the embedded default's agent task)",
        prompt_rows=prompt_rows,
        eval_rows=eval_rows,
        sft_rows=sft_rows,
    )
)

PYTHON_MATH = register_environment(
    Environment(
        "python_math",
        tools=("python",),
        parser="hermes",
        max_turns=4,
        system_prompt=(
            "Solve the problem step by step. You can run Python to compute: call the python tool, and its "
            "printed output comes back to you. When you are done, write the final answer as '#### <number>'."
        ),
        summary="math word problems (GSM8K) with a sandboxed Python tool, Hermes tool calls",
    )
)

# The embedded default's recipe for calculator_arithmetic (bench/agent_rl.py and tests/test_agent_training.py
# run it; configs/agent.yaml is the pipeline's): SFT on sft_rows(3000), then 15 rollout steps of 16 prompts x 4 episodes.
SFT_RECIPE = dict(max_steps=900, learning_rate=2e-3, warmup_steps=20, batch_size=32)
RL_RECIPE = dict(batch_size=64, num_generations=4, max_steps=15, learning_rate=1e-4, max_new_tokens=48)
