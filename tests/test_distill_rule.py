"""bench/distill.py's verdicts: the paired rule's sign test and what makes it pass or miss."""

from __future__ import annotations

from bench import distill
from bench.distill_eval import sign_test_p

TEACHER = 0.3


def _result(on_correct: list[list[int]], off_correct: list[list[int]], student0: float = 0.05) -> dict:
    runs = []
    for seed, (on, off) in enumerate(zip(on_correct, off_correct)):
        for method, correct in (("on-policy", on), ("offline", off)):
            closed = (sum(correct) / len(correct) - student0) / (TEACHER - student0)
            runs.append({"method": method, "seed": seed, "after": {"correct": correct}, "closed": {"accuracy": closed}})
    return {
        "config": {"rule": "paired", "seeds": list(range(len(on_correct)))},
        "teacher_accuracy": TEACHER,
        "student0": {"accuracy": student0},
        "runs": runs,
    }


def test_sign_test_is_the_exact_binomial_tail():
    assert sign_test_p(10, 2) == sum((1, 12, 66)) / 2**12  # P(X >= 10), X ~ Bin(12, 1/2)
    assert sign_test_p(0, 0) == 1.0 and sign_test_p(5, 5) > 0.5


def test_paired_rule_passes_a_clear_win_and_misses_noise_or_a_lost_seed():
    clear_on, clear_off = [1] * 8 + [0] * 12, [0] * 6 + [1] * 2 + [0] * 12  # 6 discordant wins, 0 losses per seed
    assert distill.verdict(_result([clear_on, clear_on], [clear_off, clear_off]))[0]
    one_up_on, one_up_off = [1, 0] + [0] * 18, [0] * 20  # ahead by one problem per seed: p = 0.25
    ok, lines = distill.verdict(_result([one_up_on, one_up_on], [one_up_off, one_up_off]))
    assert not ok and "MISS" in lines[-1]
    assert not distill.verdict(_result([clear_on, clear_off], [clear_off, clear_on]))[0]  # seed 1 lost
    assert not distill.verdict(_result([clear_on, clear_on], [clear_off, clear_off], student0=0.25))[0]  # no task gap
