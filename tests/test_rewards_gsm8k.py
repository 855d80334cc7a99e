"""The GSM8K reward and answer extractor against hand-written cases and the published data."""

from __future__ import annotations

import doctest
import json

import pytest

from verl_core.rewards import gsm8k as gsm8k_module
from verl_core.rewards import gsm8k_answer, gsm8k_ground_truth
from verl_core.rewards.rules import get_rule_reward


def test_docstring_examples() -> None:
    result = doctest.testmod(gsm8k_module)
    assert result.attempted > 0 and result.failed == 0


# completion, ground truth, strict score, flexible score
CASES = [
    ("3 * 411 + 1 = 1234\n#### 1,234", "1234", 1.0, 1.0),  # thousands separator in the answer
    ("#### 1234", "...so 1,234 in all.\n#### 1,234", 1.0, 1.0),  # ground truth is a full GSM8K solution
    ("She earns $5 a day.\n#### $5", "5", 1.0, 1.0),  # dollar sign stripped
    ("She earns $5 a day.", "5", 0.0, 1.0),  # no ####: strict fails, flexible takes the last number
    ("the answer is 18", "18", 0.0, 1.0),
    ("2 + 3 = 5, then 5 * 4 = 20", "20", 0.0, 1.0),  # several numbers: the last one
    ("2 + 3 = 5, then 5 * 4 = 20", "5", 0.0, 0.0),  # ...never an earlier one
    ("#### 3\nwait, recount\n#### 4", "4", 1.0, 1.0),  # several ####: the last (verl), not the first (lm-eval)
    ("#### 3\nwait, recount\n#### 4", "3", 0.0, 0.0),
    ("#### 18.00", "18", 1.0, 1.0),  # numeric equality
    ("#### -7", "-7", 1.0, 1.0),
    ("#### 17", "18", 0.0, 0.0),
    ("#### eighteen", "18", 0.0, 0.0),
    ("no digits at all", "18", 0.0, 0.0),
    ("1,000,000 people\n#### 1000000", "1,000,000", 1.0, 1.0),
]


@pytest.mark.parametrize("completion, truth, strict, flexible", CASES)
def test_gsm8k_reward_table(completion: str, truth: str, strict: float, flexible: float) -> None:
    assert get_rule_reward("gsm8k")([completion], [truth]) == [strict]
    assert get_rule_reward("gsm8k_flexible")([completion], [truth]) == [flexible]


def test_extractor_modes() -> None:
    assert gsm8k_answer("x\n#### 1,234") == "1234"
    assert gsm8k_answer("costs $5") is None
    assert gsm8k_answer("costs $5", "flexible") == "5"
    with pytest.raises(ValueError, match="mode"):
        gsm8k_answer("1", "loose")  # type: ignore[arg-type]


def test_missing_ground_truth_is_an_error() -> None:
    with pytest.raises(ValueError, match="ground truth"):
        get_rule_reward("gsm8k")(["#### 1"], [None])


def test_published_answers_score_themselves(shared_data) -> None:
    """Every reference solution of the GSM8K test split earns 1.0 against its own answer field."""
    rows = [json.loads(line) for line in (shared_data / "gsm8k-test.jsonl").open()]
    answers = [r["answer"] for r in rows]
    assert get_rule_reward("gsm8k")(answers, answers) == [1.0] * len(rows)
    assert all(gsm8k_ground_truth(a) == gsm8k_answer(a) for a in answers)
