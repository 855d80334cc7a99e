"""GRPO / RLOO / REINFORCE++: group sampling, critic-free advantages, KL placement, reproducibility."""
from __future__ import annotations

import pytest
import torch

from verl_core.config import ConfigError


@pytest.fixture(autouse=True)
def one_thread():
    """The tiny model runs far faster on one thread when the two cores are shared; afterwards the
    process-wide accelerate state is cleared so the next test's engine may pick its own precision."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)


def _trainer(path, cls_name="GRPOTrainer", **overrides):
    from verl_core.algorithms import grpo
    from verl_core.policies import LLMPolicy

    settings = dict(batch_size=16, num_generations=4, max_steps=2, learning_rate=1e-4, max_new_tokens=16,
                    progress=False, logging_steps=1)
    settings.update(overrides)
    return getattr(grpo, cls_name)(policy=LLMPolicy.from_pretrained(str(path)), **settings)


def test_group_configs_are_checked():
    from verl_core.algorithms.grpo import GRPOConfig, ReinforcePPConfig, RLOOConfig

    with pytest.raises(ConfigError, match="needs num_generations >= 2"):
        GRPOConfig.from_dict({"num_generations": 1, "batch_size": 8})
    with pytest.raises(ConfigError, match="not a multiple of num_generations"):
        GRPOConfig.from_dict({"num_generations": 3, "batch_size": 8})
    assert RLOOConfig().advantage_estimator == "rloo" and RLOOConfig().kl_in == "reward"
    assert ReinforcePPConfig(num_generations=1, batch_size=8).advantage_estimator == "reinforce_pp"


def test_default_reward_is_exact_match_and_groups_hold_one_prompt_each(sft_path):
    trainer = _trainer(sft_path, max_steps=1)
    assert trainer.rewards.rules == {"exact_match": 1.0}
    result = trainer.train()
    assert 0.0 <= result.metrics["reward/mean"] <= 1.0
    assert 0.0 <= result.metrics["groups/mixed_fraction"] <= 1.0
    assert result.metrics["policy/clip_fraction"] == 0.0  # one update per rollout: on-policy, ratio 1


def test_groups_with_equal_rewards_leave_the_policy_unchanged(sft_path):
    trainer = _trainer(sft_path, max_steps=1, reward_fns=[lambda completions, truths: [1.0] * len(completions)])
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    result = trainer.train()
    assert result.metrics["grad_norm"] == 0.0
    after = trainer.policy.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("cls_name", ["GRPOTrainer", "RLOOTrainer", "ReinforcePPTrainer"])
def test_kl_to_the_reference_starts_at_zero(sft_path, cls_name):
    trainer = _trainer(sft_path, cls_name, max_steps=1, kl_coef=0.1)
    result = trainer.train()
    first = trainer.update_history[0]
    if trainer.config.kl_in == "loss":
        assert abs(first["policy/kl_loss"]) < 1e-6
    else:
        assert abs(result.history["kl"][0][1]) < 1e-6
    assert first["policy/ratio_dev_max"] < 1e-5 and first["policy/clip_fraction"] == 0.0


def test_seeded_grpo_runs_are_identical(sft_path):
    runs = [_trainer(sft_path, seed=3, ppo_epochs=2).train().history for _ in range(2)]
    for key in ("reward/mean", "loss", "policy/loss", "grad_norm"):
        assert runs[0][key] == runs[1][key], key


def competent_or_skip(sft_path, eval_rows) -> float:
    """Greedy exact match of ``sft_path``; skip when it is too weak for RL to sharpen.

    Measured on the bundled task: from SFT policies that solve 13% (300 steps), 31-33% (500 steps)
    or 36% (600 steps, lr 3e-3 cosine) neither GRPO nor PPO improves held-out accuracy within
    minutes of CPU (e.g. 500 steps: GRPO 0.33 -> 0.33, PPO 0.33 -> 0.36 in 20 steps); from the
    900-step recipe of bench/online_rl.py (0.46) GRPO gains +0.15..0.2 and PPO +0.2..0.36 in 20-40
    steps.
    """
    from verl_core.evaluation import answer_accuracy
    from verl_core.models import load_causal_lm, load_tokenizer

    acc = answer_accuracy(load_causal_lm(sft_path), load_tokenizer(sft_path), eval_rows)
    if acc < 0.4:
        pytest.skip(f"the sft_path fixture solves {acc:.2f} of eval_rows(100); RL needs a base that solves >= 0.4 "
                    "(bench/online_rl.py's 900-step SFT recipe) to improve within a CPU minute")
    return acc


@pytest.mark.xfail(strict=False, reason=(
    "measured in fp32 from the 0.495 SFT fixture (200 held-out rows): GRPO 40 steps x 128 -> 0.525 (lr 1e-4), "
    "0.47 (lr 3e-4), 0.505 (4 updates per rollout); RLOO 0.52, REINFORCE++ 0.52; PPO with the same budget "
    "reaches 0.62. On the earlier bf16 host GRPO went 0.46 -> 0.65. Issue 4 stays open on this point."))
def test_grpo_with_exact_match_raises_held_out_accuracy(sft_path):
    from verl_core import arithmetic
    from verl_core.algorithms.grpo import GRPOTrainer
    from verl_core.policies import LLMPolicy

    eval_rows = arithmetic.eval_rows(200)
    before = competent_or_skip(sft_path, eval_rows)
    trainer = GRPOTrainer(policy=LLMPolicy.from_pretrained(str(sft_path)), prompts=arithmetic.prompt_rows(2048),
                          eval_prompts=eval_rows, learning_rate=1e-4, batch_size=128, num_generations=8, max_steps=40,
                          max_new_tokens=24, mixed_precision="no", progress=False, logging_steps=10)
    after = trainer.train().metrics["eval/accuracy"]
    assert after >= before + 0.05, (before, after)
