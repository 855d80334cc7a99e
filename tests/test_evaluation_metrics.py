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


def test_preference_margins_are_the_same_packed_with_shared_prompts_as_padded(tiny_path):
    """The held-out margins go through packed pairs (each prompt once) in order of length: the same numbers,
    in the rows' order, as padded pairs one at a time."""
    import torch

    from verl_core.evaluation import preference_margins
    from verl_core.modeling.loading import load_causal_lm, load_tokenizer
    from verl_core.modeling.packed_forward import packing_unsupported

    model, tok = load_causal_lm(tiny_path, trainable=False), load_tokenizer(tiny_path)
    assert packing_unsupported(model) is None
    model.train()
    rows = [
        {"prompt": "Question: 2 + 2?\nAnswer:" * 5, "chosen": " 4", "rejected": " 5 or so"},
        {"prompt": "Q: 3 + 4?\nA:", "chosen": " 7, since 3 + 4 = 7", "rejected": " 8"},
        {"prompt": "Q: 1?\nA:", "chosen": " 1", "rejected": " 1 1"},  # answers with a common first token
    ]
    margins = preference_margins(model, tok, rows, batch_size=2)
    assert model.training  # the caller's mode is back
    model.eval()
    one_by_one = []
    with torch.no_grad():
        for r in rows:  # the padded path by hand: no packing, no sorting
            from verl_core.data import collate_pairs, tokenize_pairs
            from verl_core.modeling.packed_forward import model_token_logprobs

            batch = collate_pairs(tokenize_pairs([r], tok, 512), tok.pad_token_id)
            lp = (model_token_logprobs(model, batch) * batch["loss_mask"]).sum(-1)
            one_by_one.append(float(lp[0] - lp[1]))
    assert torch.allclose(margins, torch.tensor(one_by_one), atol=1e-4)
