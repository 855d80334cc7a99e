"""GSM8K answers and rewards, following the published conventions.

GSM8K (Cobbe et al. 2021, arXiv:2110.14168) writes a solution's final answer after ``####``
on its last line: ``"... = 18\\n#### 18"``. Two extraction modes are in common use:

- **strict**: the number right after ``#### `` (verl ``utils/reward_score/gsm8k.py``
  ``method="strict"``; lm-eval-harness ``gsm8k`` filter ``strict-match``);
- **flexible**: the last number anywhere in the text (verl ``method="flexible"``; lm-eval's
  ``flexible-extract``, whose regex also takes the last match).

When a text holds several candidates, this module follows **verl's "last match"** in both
modes: ``"#### 3 ... #### 4"`` answers ``4``. (lm-eval's strict filter takes the *first*
``####`` match instead.) In both modes thousands separators (``1,234``) and a ``$`` sign
(``$5``) are stripped, and numbers compare by value (``18.00 == 18``).

The ground truth may be the bare number (``"72"``) or a whole GSM8K ``answer`` field
(``"...reasoning...\\n#### 72"``): :func:`gsm8k_ground_truth` reduces either to the number, so
a dataset's ``answer`` column can be used as ``ground_truth`` unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from verl_core.rewards.rules import normalize_number, register_rule_reward

ExtractMode = Literal["strict", "flexible"]

# a number: optional minus, optional "$", digits with optional thousands separators, optional decimals
_NUM = r"-?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_STRICT = re.compile(r"####\s*(" + _NUM + ")")
_ANY = re.compile(r"(?<![\d.,])(" + _NUM + ")")


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").replace(" ", "")


def gsm8k_answer(text: str, mode: ExtractMode = "strict") -> str | None:
    """The final answer of ``text`` as a plain number string, or None when there is none.

    ``strict``: the last ``#### <number>``; ``flexible``: the last number anywhere.

    >>> gsm8k_answer("9 * 2 = 18\\n#### 1,234")
    '1234'
    >>> gsm8k_answer("#### $5")
    '5'
    >>> gsm8k_answer("the answer is 18") is None
    True
    >>> gsm8k_answer("3 apples, then 4, so 7.", mode="flexible")
    '7'
    >>> gsm8k_answer("#### 3 and later #### 4")
    '4'
    """
    if mode not in ("strict", "flexible"):
        raise ValueError(f"mode must be 'strict' or 'flexible', got {mode!r}")
    found = (_STRICT if mode == "strict" else _ANY).findall(text)
    return _clean(found[-1]) if found else None


def gsm8k_ground_truth(truth: str) -> str:
    """The reference number: the strict answer of a full GSM8K solution, else the text itself.

    >>> gsm8k_ground_truth("Janet sells 16 - 3 - 4 = 9 eggs.\\n#### 18")
    '18'
    >>> gsm8k_ground_truth(" 1,000 ")
    '1000'
    """
    answer = gsm8k_answer(truth, "strict")
    return answer if answer is not None else _clean(truth.strip())


def gsm8k_score(completion: str, truth: str | None, mode: ExtractMode = "strict") -> float:
    """1.0 when the extracted answer equals the ground truth numerically, else 0.0.

    No partial credit for a well-formed wrong answer (verl's ``format_score`` default 0.0).
    """
    if truth is None:
        raise ValueError("the gsm8k reward needs a ground truth, got None")
    prediction = gsm8k_answer(completion, mode)
    if prediction is None:
        return 0.0
    pred, ref = normalize_number(prediction), normalize_number(gsm8k_ground_truth(truth))
    return 1.0 if pred is not None and pred == ref else 0.0


@register_rule_reward("gsm8k")
def gsm8k(completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
    """Strict GSM8K accuracy: 1.0 when the last ``#### <number>`` equals the ground truth."""
    return [gsm8k_score(c, t, "strict") for c, t in zip(completions, ground_truths)]


@register_rule_reward("gsm8k_flexible")
def gsm8k_flexible(completions: Sequence[str], ground_truths: Sequence[str | None]) -> list[float]:
    """Flexible GSM8K accuracy: 1.0 when the last number in the completion equals the ground truth."""
    return [gsm8k_score(c, t, "flexible") for c, t in zip(completions, ground_truths)]


ANSWER_EXTRACTORS = {
    "gsm8k": lambda text: gsm8k_answer(text, "strict"),
    "gsm8k_flexible": lambda text: gsm8k_answer(text, "flexible"),
}
