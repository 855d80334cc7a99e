"""Rule rewards: extraction, scoring, registry, error reporting, and the real GSM8K test set."""

from __future__ import annotations

import doctest
import json
import math
from pathlib import Path

import pytest

from verl_core.rewards import rules
from verl_core.rewards.rules import (
    RULE_REWARDS,
    RewardError,
    extract_gsm8k_answer,
    extract_last_number,
    get_rule_reward,
    length_penalty,
    normalize_number,
    register_rule_reward,
    score_with_rules,
)

DATA_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data"
GSM8K = DATA_DIR / "gsm8k-test.jsonl"


def test_docstring_examples() -> None:
    result = doctest.testmod(rules)
    assert result.attempted > 0 and result.failed == 0


# --- extraction ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("work\n#### 18", "18"),
        ("#### 1,234.", "1234"),
        ("####  -7 ", "-7"),
        ("#### 1 then #### 2", "2"),
        ("####", None),
        ("no marker 42", None),
    ],
)
def test_extract_gsm8k_answer(text: str, expected: str | None) -> None:
    assert extract_gsm8k_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3 + 4 = 7", "7"),
        ("total 1,000,000 dollars.", "1000000"),
        ("pi is 3.14.", "3.14"),
        ("10-3 = 7 and it is -2 degrees", "-2"),
        ("10-3", "3"),
        ("lists 1,2,3", "3"),
        ("nothing", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_last_number(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("72.0", "72"),
        ("1,000", "1000"),
        ("-3", "-3"),
        ("0.50", "0.5"),
        ("-0.0", "0"),
        (" 18 ", "18"),
        ("1e3", "1000"),
        ("18 dollars", None),
        ("nan", None),
        ("", None),
    ],
)
def test_normalize_number(raw: str, expected: str | None) -> None:
    assert normalize_number(raw) == expected


# --- rewards -------------------------------------------------------------------------------


def test_exact_match() -> None:
    completions = ["  work\n#### 18 ", "18", "#### 18.0", "work 18"]
    assert get_rule_reward("exact_match")(completions, ["18"] * 4) == [1.0, 1.0, 0.0, 0.0]


def test_numeric_match() -> None:
    completions = ["#### 18.0", "so the answer is 1,000.", "#### eighteen but 18", "#### 17", "no"]
    truths = ["18", "1000", "18", "18", "18"]
    assert get_rule_reward("numeric_match")(completions, truths) == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_gsm8k_strict_and_format() -> None:
    completions = ["2 + 16 = 18\n#### 18", "#### 18.00", "the answer is 18", "#### 17", "#### x"]
    truths = ["18", "18", "18", "18", "18"]
    assert get_rule_reward("gsm8k")(completions, truths) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert get_rule_reward("format")(completions, [None] * 5) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_length_penalty() -> None:
    fn = length_penalty(max_len=4, coef=0.5)
    texts = ["a b c", "a b c d", "a b c d e f", "a b c d e f g h"]
    # over = 0, 0, 2, 4  -> -0.5 * over / 4
    assert fn(texts, [None] * 4) == [0.0, 0.0, -0.25, -0.5]
    with pytest.raises(ValueError):
        length_penalty(max_len=0, coef=1.0)


def test_score_with_rules_weighted_sum() -> None:
    completions = ["#### 18", "the answer is 18", "#### 3"]
    scores = score_with_rules({"gsm8k": 1.0, "format": 0.1}, completions, ["18", "18", "18"])
    assert scores == pytest.approx([1.1, 0.0, 0.1])


def test_registry() -> None:
    assert {"exact_match", "numeric_match", "gsm8k", "format"} <= set(RULE_REWARDS)
    with pytest.raises(ValueError, match="gsm8k"):
        get_rule_reward("no_such_reward")
    with pytest.raises(ValueError, match="already registered"):
        register_rule_reward("gsm8k")(lambda c, g: [0.0] * len(c))


# --- error reporting -----------------------------------------------------------------------


@pytest.fixture
def bad_rewards():
    def raises_on_boom(completions, truths):
        return [1.0 if "boom" not in c else 1 / 0 for c in completions]

    def nan_on_second(completions, truths):
        return [math.nan if i == 1 else 0.0 for i, _ in enumerate(completions)]

    def too_short(completions, truths):
        return [0.0] * (len(completions) - 1)

    def inf_score(completions, truths):
        return [0.0, 0.0, math.inf]

    fns = {
        "t_raises": raises_on_boom,
        "t_nan": nan_on_second,
        "t_short": too_short,
        "t_inf": inf_score,
    }
    for name, fn in fns.items():
        register_rule_reward(name)(fn)
    yield
    for name in fns:
        del RULE_REWARDS[name]


@pytest.mark.parametrize(
    "name, index, phrase",
    [
        ("t_raises", 2, "ZeroDivisionError"),
        ("t_nan", 1, "non-finite"),
        ("t_short", 2, "2 scores for 3 completions"),
        ("t_inf", 2, "non-finite"),
    ],
)
def test_reward_errors_name_function_and_index(bad_rewards, name, index, phrase) -> None:
    completions = ["#### 1", "#### 2", "kaboom here"]
    with pytest.raises(RewardError) as info:
        score_with_rules({"format": 1.0, name: 1.0}, completions, ["1", "2", "3"])
    message = str(info.value)
    assert info.value.reward_name == name and info.value.index == index
    assert repr(name) in message and f"sample {index}" in message and phrase in message
    assert completions[index] in message  # snippet of the offending completion
    assert isinstance(info.value, ValueError)


def test_missing_ground_truth_is_reported() -> None:
    with pytest.raises(RewardError, match="sample 1"):
        score_with_rules({"gsm8k": 1.0}, ["#### 1", "#### 2"], ["1", None])


def test_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="2 completions but 1 ground truths"):
        score_with_rules({"gsm8k": 1.0}, ["a", "b"], ["1"])


# --- real data: GSM8K test split -----------------------------------------------------------


@pytest.fixture(scope="module")
def gsm8k_rows() -> list[dict]:
    if not GSM8K.is_file():
        pytest.skip(f"GSM8K test file not found at {GSM8K} (shared data not present)")
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines() if line.strip()]
    assert len(rows) > 1000
    return rows


def test_gsm8k_reference_answers_extract_to_numbers(gsm8k_rows) -> None:
    for i, row in enumerate(gsm8k_rows):
        answer = extract_gsm8k_answer(row["answer"])
        assert answer is not None and normalize_number(answer) is not None, (i, row["answer"])


def test_gsm8k_reward_on_reference_answers(gsm8k_rows) -> None:
    texts = [row["answer"] for row in gsm8k_rows]
    truths = [extract_gsm8k_answer(t) for t in texts]
    # Each row's own solution is correct.
    assert score_with_rules({"gsm8k": 1.0}, texts, truths) == [1.0] * len(texts)
    # The next row's solution is wrong whenever its number differs.
    shifted = texts[1:] + texts[:1]
    shifted_truths = truths[1:] + truths[:1]
    differs = [normalize_number(a) != normalize_number(b) for a, b in zip(truths, shifted_truths)]
    assert sum(differs) > 1000
    scores = get_rule_reward("gsm8k")(shifted, truths)
    for i, (score, differ) in enumerate(zip(scores, differs)):
        assert score == (0.0 if differ else 1.0), i
