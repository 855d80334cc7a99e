"""An LM as judge: the question it reads, yes/no probabilities, parsed numbers, batching, parse errors,
its place among the reward sources, and a short GRPO run scored by it."""

from __future__ import annotations

import doctest
import logging

import pytest
import torch

from verl_core.config import ConfigError
from verl_core.rewards import JudgeConfig, JudgeReward, RewardSource, RewardSourceConfig
from verl_core.rewards.judge import parse_number_score, render

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset

# The tiny tokenizer knows few words: " more" and " left" are single tokens of it (" Yes" is not).
YES_NO = dict(yes_token=" more", no_token=" left")
PROMPTS = [
    "Question: Ann has 3 cups and gets 4 more. How many cups does Ann have?\nAnswer:",
    "Q: 9 - 2?",
    [{"role": "user", "content": "Kim has 5 eggs and gives 2 away. How many are left?"}],
    "Q: 1+1?",
    "x",
]
COMPLETIONS = [" 3 + 4 = 7\n#### 7", " 6", " 5 - 2 = 3\n#### 3", " 2", " a long answer" * 6]
TRUTHS = ["7", "7", "3", "2", None]


def test_the_template_is_filled_and_numbers_are_parsed_to_the_unit_interval():
    text = render("{prompt} | {completion} | {ground_truth} | {json: 1}", [{"role": "user", "content": "hi"}], "ok", "4")
    assert text == "user: hi | ok | 4 | {json: 1}"  # other braces stay as they are
    assert parse_number_score("Score: 7/10", 0, 10) == 0.7
    assert parse_number_score("-3", 1, 5) == 0.0 and parse_number_score("99", 1, 5) == 1.0
    assert parse_number_score("3.5", 1, 5) == 0.625
    assert parse_number_score("I cannot tell", 0, 10) is None


def test_the_judge_modules_examples_hold():
    from verl_core.rewards import judge

    assert doctest.testmod(judge).failed == 0


def test_judge_configs_are_checked():
    with pytest.raises(ConfigError, match=r"\{completion\}"):
        JudgeConfig(model="m", template="Is {prompt} good?")
    with pytest.raises(ConfigError, match="max_score"):
        JudgeConfig(model="m", mode="number", min_score=5, max_score=5)
    with pytest.raises(ConfigError, match="mode"):
        JudgeConfig(model="m", mode="stars")


def test_yes_and_no_words_must_be_single_tokens_of_the_judge(tiny_path):
    with pytest.raises(ConfigError, match="yes_token ' Yes' is 3 tokens"):
        JudgeReward(JudgeConfig(model=str(tiny_path)))  # the defaults are not words of the tiny vocabulary
    with pytest.raises(ConfigError, match="no_token ' nope'"):
        JudgeReward(JudgeConfig(model=str(tiny_path), yes_token=" more", no_token=" nope"))
    with pytest.raises(ConfigError, match="the same token"):
        JudgeReward(JudgeConfig(model=str(tiny_path), yes_token=" more", no_token=" more"))


@pytest.fixture(scope="module")
def yes_no_judge(tiny_path) -> JudgeReward:
    return JudgeReward(JudgeConfig(model=str(tiny_path), batch_size=2, device="cpu", **YES_NO))


def test_yes_no_score_is_p_yes_over_p_yes_plus_p_no_and_batching_does_not_change_it(yes_no_judge):
    judge = yes_no_judge
    batched = judge.score(PROMPTS, COMPLETIONS, TRUTHS)  # batches of 2, 2 and 1 rows of different lengths
    one_by_one = [judge.score([p], [c], [g])[0] for p, c, g in zip(PROMPTS, COMPLETIONS, TRUTHS)]
    assert torch.allclose(torch.tensor(batched), torch.tensor(one_by_one), atol=1e-5)
    assert all(0.0 < s < 1.0 for s in batched)
    # by hand for the first row: the next-token distribution after the judge's (chat-templated) question
    text = judge.judge_prompt(PROMPTS[0], COMPLETIONS[0], TRUTHS[0])
    assert text.startswith("<|user|>\nQuestion:\nQuestion: Ann has") and text.endswith("Answer:<|end|>\n<|assistant|>\n")
    ids = torch.tensor([judge.tokenizer(text, add_special_tokens=False)["input_ids"]])
    probs = torch.softmax(judge.model(input_ids=ids).logits[0, -1].float(), -1)
    p_yes, p_no = probs[judge.yes_id].item(), probs[judge.no_id].item()
    assert batched[0] == pytest.approx(p_yes / (p_yes + p_no), abs=1e-5)
    metrics = judge.metrics()
    assert metrics["judge/parse_errors"] == 0.0 and metrics["judge/yes_no_mass"] > 0
    assert metrics["judge/mean"] == pytest.approx(sum(batched + one_by_one) / 10, abs=1e-6)
    assert judge.metrics()["judge/parse_errors"] == 0.0 and "judge/mean" not in judge.metrics()  # reset after reading


def test_the_first_judge_prompt_is_logged_once(tiny_path, caplog):
    judge = JudgeReward(JudgeConfig(model=str(tiny_path), use_chat_template=False, **YES_NO))
    with caplog.at_level(logging.INFO, logger="verl_core"):
        judge.score(PROMPTS[:2], COMPLETIONS[:2], TRUTHS[:2])
        judge.score(PROMPTS[:2], COMPLETIONS[:2], TRUTHS[:2])
    logged = [r.getMessage() for r in caplog.records if "reads, for the first row" in r.getMessage()]
    assert len(logged) == 1 and "Proposed answer:\n 3 + 4 = 7" in logged[0]
    assert "<|user|>" not in logged[0]  # use_chat_template=False: the plain question


def test_number_mode_parses_the_judges_answer_and_counts_answers_without_a_number(tiny_path, caplog):
    # the untrained tiny model continues "<prompt><completion>" with repeated digits or letters
    config = JudgeConfig(
        model=str(tiny_path), mode="number", template="{prompt}{completion}", use_chat_template=False, max_new_tokens=4
    )
    judge = JudgeReward(config.updated(batch_size=3))
    with caplog.at_level(logging.WARNING, logger="verl_core"):
        batched = judge.score(PROMPTS, COMPLETIONS, TRUTHS)
    answers = judge.last_answers
    expected = [parse_number_score(a, 0, 10) for a in answers]
    assert batched == [0.0 if e is None else e for e in expected]
    unparsed = sum(e is None for e in expected)
    assert 0 < unparsed < len(answers)  # both kinds of answer (the bundled model is built from a fixed seed)
    assert judge.metrics()["judge/parse_errors"] == unparsed
    assert len([r for r in caplog.records if "has no number, scored 0" in r.getMessage()]) == unparsed
    one_by_one = [judge.score([p], [c], [g])[0] for p, c, g in zip(PROMPTS, COMPLETIONS, TRUTHS)]
    assert batched == one_by_one


def test_number_mode_scores_and_errors_with_a_scripted_judge(tiny_path):
    judge = JudgeReward(JudgeConfig(model=str(tiny_path), mode="number", min_score=1, max_score=5, use_chat_template=False))
    tok = judge.tokenizer
    scripted = {"good": " 5", "fair": " 3", "bad": " no idea"}

    def generate(input_ids, attention_mask, max_new_tokens, **kwargs):  # answers by the word in each question
        rows = []
        for row in input_ids:
            text = tok.decode(row, skip_special_tokens=True)
            word = next(w for w in scripted if f"({w})" in text)
            answer = tok(scripted[word], add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows.append(torch.cat([row, torch.tensor(answer + [tok.pad_token_id] * (max_new_tokens - len(answer)))]))
        return torch.stack(rows)

    judge.model.generate = generate
    scores = judge.score(["q"] * 3, ["a (good)", "a (bad)", "a (fair)"], [None] * 3)
    assert scores == [1.0, 0.0, 0.5]
    assert judge.metrics()["judge/parse_errors"] == 1.0 and judge.parse_errors_total == 1


def test_a_judge_is_a_weighted_reward_source_with_its_metrics(tiny_path):
    config = RewardSourceConfig(
        reward_rules={"exact_match": 1.0},
        judge=JudgeConfig(model=str(tiny_path), device="cpu", **YES_NO),
        judge_weight=2.0,
    )
    source = RewardSource.build(config)
    result = source.score(PROMPTS[:4], COMPLETIONS[:4], TRUTHS[:4])
    assert set(result.components) == {"exact_match", "judge"}
    expected = result.components["exact_match"] + 2.0 * result.components["judge"]
    assert torch.allclose(result.total, expected)
    metrics = source.metrics()
    assert metrics["judge/parse_errors"] == 0.0 and "judge/mean" in metrics
    only_judge = RewardSource.build(RewardSourceConfig(judge=config.judge), default_rules={"exact_match": 1.0})
    assert only_judge.rules == {}  # a judge is a reward: the default rules do not apply


@pytest.mark.slow
def test_grpo_trains_on_the_judges_scores_and_logs_its_metrics(tiny_path, tmp_path):
    from verl_core.algorithms.grpo import GRPOTrainer

    judge = {"model": str(tiny_path), "device": "cpu", **YES_NO}
    trainer = GRPOTrainer(
        policy=str(tiny_path),
        judge=judge,
        batch_size=8,
        num_generations=4,
        max_steps=2,
        max_new_tokens=8,
        learning_rate=1e-4,
        progress=False,
        logging_steps=1,
        output_dir=str(tmp_path / "out"),
    )
    assert trainer.rewards.rules == {} and trainer.rewards.judge is not None
    result = trainer.train()
    assert 0.0 < result.metrics["reward/judge"] < 1.0
    assert result.metrics["judge/parse_errors"] == 0.0 and "judge/yes_no_mass" in result.metrics
    assert result.output_dir is not None


def test_a_judge_served_over_http_scores_as_it_does_locally(tiny_path, tmp_path, yes_no_judge):
    from verl_core.rewards import RemoteReward, RemoteRewardConfig
    from verl_core.rewards.serve import RewardHTTPServer, load_reward

    with pytest.raises(ConfigError, match=f"holds a LlamaForCausalLM, not a reward model.*judge:{tiny_path}"):
        load_reward(str(tiny_path))
    spec = tmp_path / "judge.yaml"
    JudgeConfig(model=str(tiny_path), device="cpu", **YES_NO).to_yaml(spec)
    server = RewardHTTPServer(load_reward(str(spec)), "127.0.0.1", 0).start()
    try:
        client = RemoteReward(RemoteRewardConfig(url=f"{server.url}/score", batch_size=2))
        remote = client.score(PROMPTS, COMPLETIONS, TRUTHS)  # message-list prompts and None ground truths travel too
    finally:
        server.close()
    local = yes_no_judge.score(PROMPTS, COMPLETIONS, TRUTHS)
    assert torch.allclose(torch.tensor(remote), torch.tensor(local), atol=1e-5)
