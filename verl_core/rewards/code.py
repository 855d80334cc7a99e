"""A verifiable reward for programs: run the completion's Python and compare what it prints.

``code_output`` takes the program of each completion (the last fenced ```` ```python ```` block, or
the whole completion when it has no fence and parses as Python), runs the batch in the sandbox
(:func:`verl_core.sandbox.runner.run_many`: a child process each, no network, rlimits, a
timeout) and scores 1.0 when the last non-empty line of stdout equals the ground truth, else 0.0.
Numbers compare by value (:func:`~verl_core.rewards.rules.normalize_number`, as the GSM8K rules
do: ``"18.0"`` equals ``"18"``), anything else as stripped strings.

A program that fails, times out, blows its memory or tries something forbidden scores 0.0 and
never raises: its sandbox result is data. :func:`code_output_details` returns the reason with
each score, so that a trainer can log why samples failed.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from verl_core.rewards.rules import normalize_number, register_rule_reward
from verl_core.sandbox.runner import SandboxLimits, SandboxResult, run_many

# A fenced block tagged python/py/python3 (or untagged); the closing fence must be on its own line.
_FENCE = re.compile(r"^[ \t]*```[ \t]*(python3?|py)?[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.DOTALL | re.MULTILINE | re.IGNORECASE)

DEFAULT_LIMITS = SandboxLimits(timeout_s=5.0, cpu_s=5, memory_mb=512)
WORKERS = 2  # programs run at once; each is one child process


def extract_program(completion: str) -> str | None:
    """The program of a completion: the last fenced Python block, else the whole text if it parses.

    >>> extract_program("First\\n```python\\nprint(1)\\n```\\nthen\\n```python\\nprint(2)\\n```")
    'print(2)\\n'
    >>> extract_program("print(6 * 7)")
    'print(6 * 7)'
    >>> extract_program("The answer is 42.") is None
    True
    """
    blocks = _FENCE.findall(completion)
    if blocks:
        return blocks[-1][1]
    try:
        ast.parse(completion)
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the text
        return None
    return completion if completion.strip() else None


def last_line(stdout: str) -> str | None:
    """The last non-empty line of a program's output, stripped; None when it printed nothing."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    return lines[-1] if lines else None


def outputs_match(output: str, truth: str) -> bool:
    """Equal as numbers when both are numbers, else equal as stripped strings.

    >>> outputs_match("18.0", "18"), outputs_match("1,000", "1000"), outputs_match("abc", " abc ")
    (True, True, True)
    >>> outputs_match("18", "19"), outputs_match("yes", "Yes")
    (False, False)
    """
    output, truth = output.strip(), truth.strip()
    number, expected = normalize_number(output), normalize_number(truth)
    if number is not None and expected is not None:
        return number == expected
    return output == truth


def _score(result: SandboxResult, truth: str) -> tuple[float, str]:
    if not result.ok:  # "blocked: os.fork" already names its status; "timed out after 5 s" gets it prefixed
        return 0.0, result.reason if result.reason.startswith(result.status) else f"{result.status}: {result.reason}"
    printed = last_line(result.stdout)
    if printed is None:
        return 0.0, "no output"
    if outputs_match(printed, truth):
        return 1.0, "correct"
    shown = printed if len(printed) <= 60 else printed[:57] + "..."
    return 0.0, f"wrong output: {shown!r}"


def code_output_details(
    completions: Sequence[str],
    ground_truths: Sequence[str | None],
    limits: SandboxLimits | None = None,
    workers: int = WORKERS,
) -> list[tuple[float, str]]:
    """(score, reason) per completion: ``"correct"``, ``"wrong output: '17'"``, ``"no output"``,
    ``"no Python program found"`` or the sandbox's reason, prefixed by its status
    (``"timeout: timed out after 5 s"``, ``"error: ZeroDivisionError: division by zero"``, ``"blocked: os.fork"``)."""
    if len(completions) != len(ground_truths):
        raise ValueError(f"{len(completions)} completions but {len(ground_truths)} ground truths")
    if any(truth is None for truth in ground_truths):
        raise ValueError("the code_output reward needs a ground truth for every sample, got None")
    programs = [extract_program(c) for c in completions]
    runnable = [i for i, program in enumerate(programs) if program is not None]
    results = run_many([programs[i] for i in runnable], limits or DEFAULT_LIMITS, workers=workers)
    out: list[tuple[float, str]] = [(0.0, "no Python program found")] * len(completions)
    for i, result in zip(runnable, results):
        out[i] = _score(result, ground_truths[i])
    return out


@register_rule_reward("code_output")
def code_output(completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
    """1.0 when the completion's program prints the ground truth as its last line, else 0.0."""
    return [score for score, _ in code_output_details(completions, ground_truths)]
