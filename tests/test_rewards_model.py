"""Reward-model scoring, user reward callables and their weighted combination with rules."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from verl_core.config import ConfigError
from verl_core.rewards import RewardError, RewardModel, RewardSource, RewardSourceConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset


@pytest.fixture(scope="module")
def reward_model(tiny_path) -> RewardModel:
    torch.manual_seed(0)  # the score head of a causal-LM folder is freshly initialised
    return RewardModel.from_pretrained(tiny_path, batch_size=2)


PROMPTS = [
    "Question: Ann has 3 cups and gets 4 more. How many cups does Ann have?\nAnswer:",
    "Question: 9 - 2?\nAnswer:",
    "Q: 1+1?\nA:",
]
COMPLETIONS = [" 3 + 4 = 7\n#### 7", " 9 - 2 = 6\n#### 6", " 2\n#### 2"]


def test_texts_and_token_ids_score_the_same_and_batching_does_not_matter(reward_model):
    by_text = reward_model.score(PROMPTS, COMPLETIONS)
    prompt_ids, completion_ids = reward_model.encode(PROMPTS, COMPLETIONS)
    assert completion_ids[0][-1] == reward_model.tokenizer.eos_token_id  # as RewardTrainer saw completions
    by_ids = reward_model.score(prompt_ids, completion_ids)
    one_by_one = torch.cat([reward_model.score([p], [c]) for p, c in zip(PROMPTS, COMPLETIONS)])
    assert by_text.shape == (3,) and by_text.dtype == torch.float32
    assert torch.allclose(by_text, by_ids, atol=1e-5) and torch.allclose(by_text, one_by_one, atol=1e-5)
    assert reward_model.shares_vocab(reward_model.tokenizer)


def test_long_sequences_keep_their_last_tokens(reward_model):
    prompt_ids, completion_ids = reward_model.encode(PROMPTS[:1], COMPLETIONS[:1])
    full = reward_model.score(prompt_ids, completion_ids)
    reward_model.max_length = 8
    try:
        short = reward_model.score(prompt_ids, completion_ids)
        tail = (prompt_ids[0] + completion_ids[0])[-8:]
        assert torch.allclose(short, reward_model.score([tail[:1]], [tail[1:]]), atol=1e-5)
        assert not torch.allclose(short, full)
    finally:
        reward_model.max_length = 1024


def test_rules_model_and_callables_combine_with_their_weights(reward_model):
    def length(completions, truths):
        return [float(len(c)) for c in completions]

    truths = ["7", "7", "2"]
    source = RewardSource(
        rules={"exact_match": 2.0}, reward_model=reward_model, reward_model_weight=0.5, functions={"len": (length, 0.1)}
    )
    out = source.score(PROMPTS, COMPLETIONS, truths)
    rm = reward_model.score(PROMPTS, COMPLETIONS)
    expected = 2.0 * torch.tensor([1.0, 0.0, 1.0]) + 0.5 * rm + 0.1 * torch.tensor([float(len(c)) for c in COMPLETIONS])
    assert torch.allclose(out.total, expected, atol=1e-5)
    assert set(out.components) == {"exact_match", "len", "reward_model"}


def test_a_callable_that_raises_or_returns_nan_names_the_sample():
    def picky(completions, truths):
        if any("6" in c for c in completions):
            raise ZeroDivisionError("no sixes")
        return [1.0] * len(completions)

    with pytest.raises(RewardError, match=r"'picky' failed on sample 1: raised ZeroDivisionError"):
        RewardSource(functions=[picky]).score(PROMPTS, COMPLETIONS, [None] * 3)
    with pytest.raises(RewardError, match=r"'nanny' failed on sample 2: returned a non-finite score nan"):
        RewardSource(functions={"nanny": lambda c, t: [0.0, 1.0, float("nan")]}).score(PROMPTS, COMPLETIONS, [None] * 3)


def test_a_reward_model_returning_nan_names_the_sample(reward_model):
    class NaNAtOne(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, attention_mask, use_cache=False):
            logits = torch.zeros(input_ids.shape[0], 1)
            logits[1 if input_ids.shape[0] > 1 else 0] = float("nan")
            return SimpleNamespace(logits=logits)

    broken = RewardModel(NaNAtOne(), reward_model.tokenizer)
    with pytest.raises(RewardError, match=r"'reward_model' failed on sample 1: returned a non-finite score nan.*9 - 2"):
        RewardSource(reward_model=broken).score(PROMPTS, COMPLETIONS, [None] * 3)


def test_a_source_needs_some_reward_and_known_rule_names():
    with pytest.raises(ConfigError, match="no reward"):
        RewardSource()
    with pytest.raises(ValueError, match="unknown rule reward 'nope'"):
        RewardSource(rules={"nope": 1.0})
    # defaults apply only when nothing is configured
    assert RewardSource.build(RewardSourceConfig(), default_rules={"exact_match": 1.0}).rules == {"exact_match": 1.0}
    built = RewardSource.build(RewardSourceConfig(), functions=[lambda c, t: [0.0] * len(c)], default_rules={"exact_match": 1.0})
    assert built.rules == {} and len(built.functions) == 1


def test_packed_scores_equal_the_padded_ones_in_the_callers_order(reward_model):
    # rows of very different lengths, so that sorting by length reorders them and a padded batch pads a lot
    prompts = [PROMPTS[0] * 4, PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    completions = [COMPLETIONS[0], COMPLETIONS[1] * 3, COMPLETIONS[2], COMPLETIONS[0]]
    assert reward_model._packed  # the tiny model's sdpa attention takes a packed mask
    packed = reward_model.score(prompts, completions)
    reversed_ = reward_model.score(prompts[::-1], completions[::-1])
    reward_model._packed = False
    try:
        padded = reward_model.score(prompts, completions)
        one_by_one = torch.cat([reward_model.score([p], [c]) for p, c in zip(prompts, completions)])
        reward_model.max_length = 8
        padded_short = reward_model.score(prompts, completions)
        reward_model._packed = True
        packed_short = reward_model.score(prompts, completions)
    finally:
        reward_model._packed, reward_model.max_length = True, 1024
    assert torch.allclose(packed, padded, atol=1e-5) and torch.allclose(packed, one_by_one, atol=1e-5)
    assert torch.allclose(reversed_, packed.flip(0), atol=1e-5)
    assert torch.allclose(packed_short, padded_short, atol=1e-5) and not torch.allclose(packed_short, packed)
