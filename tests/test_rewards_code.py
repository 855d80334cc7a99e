"""The code_output reward: a completion's program is run in the sandbox and its last line compared."""

from __future__ import annotations

import doctest

import pytest

from verl_core.rewards import RULE_REWARDS, score_with_rules
from verl_core.rewards import code as code_module
from verl_core.rewards.code import code_output, code_output_details, extract_program
from verl_core.sandbox.runner import SandboxLimits

pytestmark = pytest.mark.fast


def fenced(program: str, before: str = "Here is my solution:", after: str = "It prints the answer.") -> str:
    return f"{before}\n```python\n{program}\n```\n{after}"


def test_docstring_examples() -> None:
    result = doctest.testmod(code_module)
    assert result.attempted > 0 and result.failed == 0


def test_a_correct_program_scores_one():
    completions = [
        fenced("print(sum(range(10)))"),
        "print(6 * 7)",  # no fence, but the whole completion is Python
        fenced("x = 17.5\nprint(x * 2)"),  # 35.0 equals "35" as a number
        fenced("print('working...')\nprint()\nprint('  blue  ')\n"),  # the last non-empty line, stripped
    ]
    assert code_output(completions, ["45", "42", "35", "blue"]) == [1.0, 1.0, 1.0, 1.0]


def test_a_wrong_output_scores_zero_with_the_output_as_reason():
    [(score, reason)] = code_output_details([fenced("print(41)")], ["42"])
    assert (score, reason) == (0.0, "wrong output: '41'")
    [(score, reason)] = code_output_details([fenced("x = 42")], ["42"])
    assert (score, reason) == (0.0, "no output")
    [(score, reason)] = code_output_details([fenced("print('Blue')")], ["blue"])
    assert score == 0.0  # strings compare exactly


def test_the_last_python_block_is_the_program():
    completion = fenced("print(1)") + "\nWait, that is wrong:\n" + fenced("print(2)", before="Fixed:")
    assert code_output([completion], ["2"]) == [1.0]
    assert extract_program("```py\nprint(3)\n```") == "print(3)\n"


def test_a_syntax_error_or_no_code_scores_zero_with_a_reason():
    details = code_output_details([fenced("def f(:\n    return 1"), "The answer is 42.", ""], ["1", "42", "42"])
    assert [score for score, _ in details] == [0.0, 0.0, 0.0]
    assert details[0][1].startswith("error: SyntaxError"), details[0]
    assert details[1][1] == details[2][1] == "no Python program found"


def test_failing_and_hostile_programs_score_zero():
    programs = ["1 / 0", "import os\nos.fork()\nprint(42)", "print(open('/etc/passwd').read())\nprint(42)"]
    completions = [fenced(program) for program in programs]
    details = code_output_details(completions, ["42", "42", "42"])
    assert [score for score, _ in details] == [0.0, 0.0, 0.0]
    assert details[0][1] == "error: ZeroDivisionError: division by zero"
    assert details[1][1] == "blocked: os.fork" and details[2][1].startswith("blocked: open (reading /etc/passwd")


def test_an_infinite_loop_among_correct_programs_scores_zero_and_the_others_one():
    completions = [fenced(f"print({i} + 1)") for i in range(4)]
    completions.insert(2, fenced("while True:\n    pass\nprint(3)"))
    details = code_output_details(completions, ["1", "2", "3", "3", "4"], limits=SandboxLimits(timeout_s=2, cpu_s=60))
    assert [score for score, _ in details] == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert details[2][1] == "timeout: timed out after 2 s"


def test_the_rule_is_usable_by_name_through_the_registry():
    assert RULE_REWARDS["code_output"] is code_output
    scores = score_with_rules({"code_output": 1.0}, [fenced("print(2 ** 10)"), "no code here"], ["1024", "1024"])
    assert scores == [1.0, 0.0]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="ground truth"):
        code_output(["print(1)"], [None])
    with pytest.raises(ValueError, match="2 completions but 1"):
        code_output(["print(1)", "print(2)"], ["1"])
