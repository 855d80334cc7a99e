"""Rule-based (verifiable) rewards for math-style completions.

A rule reward is batched: ``fn(completions, ground_truths) -> list[float]``, one score per
completion. Rewards are looked up by name in :data:`RULE_REWARDS` and combined with
:func:`score_with_rules`, which checks every output and raises :class:`RewardError` naming the
reward and the sample when one misbehaves.

Answers follow the GSM8K convention (Cobbe et al. 2021, arXiv:2110.14168): the final answer
is written after ``####`` at the end of the solution, e.g. ``"... = 18\\n#### 18"``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from typing import Annotated, Optional

from pydantic import AfterValidator

from verl_core.config import ConfigError
from verl_core.errors import UserError

RewardFn = Callable[[Sequence[str], Sequence[Optional[str]]], list[float]]

RULE_REWARDS: dict[str, RewardFn] = {}

# An integer or decimal, optionally negative, with optional thousands separators
# ("1,000,000"). A minus directly after a digit is subtraction ("10-3"), not a sign.
_NUMBER = re.compile(r"(?<![\d.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


class RewardError(UserError, ValueError):
    """A reward function raised, returned the wrong number of scores, or a non-finite one."""

    def __init__(self, reward_name: str, index: int | None, problem: str, completion: str | None):
        self.reward_name = reward_name
        self.index = index
        where = f"sample {index}" if index is not None else "the batch"
        message = f"reward {reward_name!r} failed on {where}: {problem}"
        if completion is not None:
            snippet = completion if len(completion) <= 80 else completion[:77] + "..."
            message += f" (completion: {snippet!r})"
        super().__init__(message)


def register_rule_reward(name: str, overwrite: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Decorator adding a batched reward function to :data:`RULE_REWARDS` under ``name``."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in RULE_REWARDS and not overwrite:
            raise ValueError(f"rule reward {name!r} is already registered")
        RULE_REWARDS[name] = fn
        return fn

    return decorator


def get_rule_reward(name: str) -> RewardFn:
    """The registered reward ``name``; a :class:`ConfigError` listing the known names if there is none."""
    try:
        return RULE_REWARDS[name]
    except KeyError:
        raise ConfigError(f"unknown rule reward {name!r}; registered: {', '.join(sorted(RULE_REWARDS))}") from None


def known_rule(name: str) -> str:
    """A config field's validator: ``name`` is a registered rule reward (checked when the config is read)."""
    get_rule_reward(name)
    return name


def known_rules(weights: dict[str, float] | None) -> dict[str, float] | None:
    for name in weights or {}:
        get_rule_reward(name)
    return weights


RuleName = Annotated[str, AfterValidator(known_rule)]
RuleWeights = Annotated[Optional[dict[str, float]], AfterValidator(known_rules)]


# --- answer extraction ---------------------------------------------------------------------


def extract_gsm8k_answer(text: str) -> str | None:
    """The final answer in GSM8K format: the text after the last ``####``.

    It is stripped, its commas are removed and one trailing period is dropped. Returns None
    when there is no ``####`` or nothing follows it.

    >>> extract_gsm8k_answer("She makes 9 * 2 = $18 every day.\\n#### 18")
    '18'
    >>> extract_gsm8k_answer("#### 1,450,000.")
    '1450000'
    >>> extract_gsm8k_answer("#### 3 #### 4")
    '4'
    >>> extract_gsm8k_answer("The answer is 18") is None
    True
    """
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    if answer.endswith("."):
        answer = answer[:-1].rstrip()
    return answer or None


def extract_last_number(text: str) -> str | None:
    """The last integer or decimal number in ``text``, commas removed; None if there is none.

    >>> extract_last_number("3 + 4 = 7, so 1,000 apples.")
    '1000'
    >>> extract_last_number("it fell to -2.5 degrees")
    '-2.5'
    >>> extract_last_number("no digits") is None
    True
    """
    matches = _NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


def normalize_number(s: str) -> str | None:
    """A canonical string for a number, so equal numbers compare equal as strings.

    Commas and surrounding spaces are removed, the value is parsed exactly (``Decimal``) and
    written without exponent, trailing zeros or a negative zero. None if ``s`` is not a
    finite number.

    >>> [normalize_number(s) for s in ["72.0", "1,000", "-3", "0.50", "-0", "abc"]]
    ['72', '1000', '-3', '0.5', '0', None]
    """
    try:
        value = Decimal(s.replace(",", "").strip())
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == 0:
        return "0"
    return format(value.normalize(), "f")


def _require_truth(truth: str | None) -> str:
    if truth is None:
        raise ValueError("this reward needs a ground truth, got None")
    return truth


def _numbers_equal(prediction: str | None, truth: str) -> bool:
    if prediction is None:
        return False
    pred = normalize_number(prediction)
    return pred is not None and pred == normalize_number(truth)


# --- rewards -------------------------------------------------------------------------------


@register_rule_reward("exact_match")
def exact_match(completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
    """1.0 when the answer string equals the stripped ground truth, else 0.0.

    The answer is the GSM8K answer (:func:`extract_gsm8k_answer`) of the stripped completion
    if it has one, else the whole stripped completion. String comparison, no number parsing.
    """
    scores = []
    for completion, truth in zip(completions, ground_truths):
        text = completion.strip()
        answer = extract_gsm8k_answer(text)
        prediction = answer if answer is not None else text
        scores.append(1.0 if prediction == _require_truth(truth).strip() else 0.0)
    return scores


@register_rule_reward("numeric_match")
def numeric_match(completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
    """1.0 when the predicted number equals the ground truth numerically, else 0.0 (lenient).

    The prediction is the GSM8K answer if it is a number, else the last number anywhere in
    the completion (:func:`extract_last_number`). Equality via :func:`normalize_number`.
    """
    scores = []
    for completion, truth in zip(completions, ground_truths):
        prediction = extract_gsm8k_answer(completion)
        if prediction is None or normalize_number(prediction) is None:
            prediction = extract_last_number(completion)
        scores.append(1.0 if _numbers_equal(prediction, _require_truth(truth)) else 0.0)
    return scores


@register_rule_reward("format")
def format_reward(completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
    """1.0 when the completion ends with ``#### <number>`` (any number), else 0.0.

    The strict ``gsm8k`` reward (:mod:`verl_core.rewards.gsm8k`) is ``format`` and correct.
    The ground truths are ignored (may be None).
    """
    scores = []
    for completion in completions:
        answer = extract_gsm8k_answer(completion)
        scores.append(1.0 if answer is not None and normalize_number(answer) is not None else 0.0)
    return scores


def length_penalty(max_len: int, coef: float) -> RewardFn:
    """A reward penalising completions longer than ``max_len`` whitespace-separated words.

    ``score = -coef * max(0, n_words - max_len) / max_len``: 0 up to ``max_len`` words, then
    linearly more negative (``-coef`` at twice the length). Ground truths are ignored.
    Register it to use it by name, e.g.
    ``register_rule_reward("length_200")(length_penalty(200, 0.5))``.
    """
    if max_len <= 0:
        raise ValueError(f"max_len must be > 0, got {max_len}")
    if coef < 0:
        raise ValueError(f"coef must be >= 0, got {coef}")

    def penalty(completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
        return [-coef * max(0, len(c.split()) - max_len) / max_len for c in completions]

    return penalty


# --- combination with checks ---------------------------------------------------------------


def _locate_failure(fn: RewardFn, completions: Sequence[str], truths: Sequence[str | None]) -> tuple[int, Exception] | None:
    """Re-run ``fn`` one sample at a time; the first index and error that reproduce, or None."""
    for i, (completion, truth) in enumerate(zip(completions, truths)):
        try:
            fn([completion], [truth])
        except Exception as err:  # noqa: BLE001 - we report whatever the reward raised
            return i, err
    return None


def _checked_scores(name: str, fn: RewardFn, completions: Sequence[str], truths: Sequence[str | None]) -> list[float]:
    n = len(completions)
    try:
        raw = fn(completions, truths)
    except Exception as err:  # noqa: BLE001
        located = _locate_failure(fn, completions, truths)
        if located is None:
            raise RewardError(name, None, f"raised {type(err).__name__}: {err}", None) from err
        index, single_err = located
        problem = f"raised {type(single_err).__name__}: {single_err}"
        raise RewardError(name, index, problem, completions[index]) from single_err
    try:
        raw = list(raw)
    except TypeError:
        raise RewardError(name, None, f"returned {type(raw).__name__}, not a list", None) from None
    if len(raw) != n:
        index = min(len(raw), n)  # first sample without a score (or first extra score)
        problem = f"returned {len(raw)} scores for {n} completions"
        raise RewardError(name, index, problem, completions[index] if index < n else None)
    scores = []
    for i, value in enumerate(raw):
        try:
            score = float(value)
        except (TypeError, ValueError):
            problem = f"returned a non-number {value!r}"
            raise RewardError(name, i, problem, completions[i]) from None
        if not math.isfinite(score):
            raise RewardError(name, i, f"returned a non-finite score {score}", completions[i])
        scores.append(score)
    return scores


def score_with_rules(
    names_and_weights: dict[str, float],
    completions: Sequence[str],
    ground_truths: Sequence[str | None],
) -> list[float]:
    """Weighted sum of registered rule rewards: ``score_i = sum_name w_name * r_name(i)``.

    Each reward's output is validated; a reward that raises, returns a list of the wrong
    length, or a NaN/inf (or non-numeric) score raises :class:`RewardError` naming the reward
    and the sample index (when a reward raises on the batch, samples are re-run one at a time
    to find the index).
    """
    if len(completions) != len(ground_truths):
        raise ValueError(f"{len(completions)} completions but {len(ground_truths)} ground truths")
    total = [0.0] * len(completions)
    for name, weight in names_and_weights.items():
        if not math.isfinite(weight):
            raise ValueError(f"weight of reward {name!r} is not finite: {weight}")
        scores = _checked_scores(name, get_rule_reward(name), completions, ground_truths)
        total = [t + weight * s for t, s in zip(total, scores)]
    return total
