"""The evaluation stage's comparisons of a trained policy with the base model: the reward model's win rate
with its interval, and the prompt stripping of held-out pairs for the implicit-reward accuracy."""

import pytest

from verl_core.pipeline.evaluation import _completions_only, win_rate

pytestmark = pytest.mark.fast


def test_win_rate_counts_ties_as_half_and_gives_a_95_interval():
    m = win_rate([1.0, 2.0, 0.0, 5.0], [0.0, 2.0, 1.0, 4.0])  # win, tie, loss, win
    assert m["win_rate/final_vs_base"] == pytest.approx(0.625) and m["win_rate/prompts"] == 4
    # outcomes 1, .5, 0, 1: sample sd 0.4787, half width 1.96 * 0.4787 / 2 = 0.469
    assert m["win_rate/ci95_low"] == pytest.approx(0.625 - 0.4691, abs=1e-3)
    assert m["win_rate/ci95_high"] == 1.0  # clipped
    assert win_rate(None, [1.0]) == {} and win_rate([1.0], None) == {}


def test_held_out_pairs_lose_their_shared_prompt_text_or_messages():
    user = [{"role": "user", "content": "q"}]
    pairs = [
        {
            "prompt": "\n\nHuman: q\n\nAssistant:",
            "chosen": "\n\nHuman: q\n\nAssistant: yes",
            "rejected": "\n\nHuman: q\n\nAssistant: no",
        },
        {
            "prompt": user,
            "chosen": user + [{"role": "assistant", "content": "a"}],
            "rejected": user + [{"role": "assistant", "content": "b"}],
        },
        {"prompt": "p", "chosen": "a", "rejected": "b"},  # explicit prompt: the answers are already bare
    ]
    out = _completions_only(pairs)
    assert out[0]["chosen"] == " yes" and out[0]["rejected"] == " no"
    assert out[1]["chosen"] == [{"role": "assistant", "content": "a"}]
    assert out[2] == {"prompt": "p", "chosen": "a", "rejected": "b"}
