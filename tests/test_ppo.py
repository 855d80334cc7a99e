"""PPO: the seed example, step-0 invariants, seeded reproducibility, config checks."""

from __future__ import annotations

import pytest
import torch

from verl_core.config import ConfigError
from verl_core.train.callbacks import Callback

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset


def _imports():
    try:
        from verl_core import PPOConfig, Trainer  # the seed's public spelling
    except ImportError:  # until verl_core/__init__.py exports them
        from verl_core.algorithms.ppo import PPOConfig, Trainer
    return Trainer, PPOConfig


def test_ppo_config_is_strict_and_sized_for_a_short_run():
    _, PPOConfig = _imports()
    c = PPOConfig(learning_rate=1e-5, batch_size=32, ppo_epochs=4, clip_range=0.2)
    assert (c.learning_rate, c.batch_size, c.ppo_epochs, c.clip_range) == (1e-5, 32, 4, 0.2)
    assert c.max_steps <= 20
    PPOConfig(gradient_checkpointing=True, gradient_accumulation_steps=4, mixed_precision="bf16", offload_optimizer=True)
    with pytest.raises(ConfigError, match="unknown key 'ppo_epoch'"):
        PPOConfig.from_dict({"ppo_epoch": 2})
    with pytest.raises(Exception, match="unknown key|extra"):
        PPOConfig(ppo_epoch=2)
    assert PPOConfig(total_episodes=100, batch_size=16).max_steps == 7
    with pytest.raises(Exception, match="mini_batch_size"):
        PPOConfig(batch_size=16, mini_batch_size=6)


def test_seed_example_runs_verbatim(sft_path, tiny_path):
    Trainer, PPOConfig = _imports()
    from verl_core.policies import LLMPolicy
    from verl_core.rewards import RewardModel

    path = str(sft_path)
    torch.manual_seed(0)
    policy = LLMPolicy.from_pretrained(path)
    reward_model = RewardModel.from_pretrained(path)  # an LM folder: fresh (seeded) score head
    config = PPOConfig(learning_rate=1e-5, batch_size=32, ppo_epochs=4, clip_range=0.2)
    result = Trainer(policy=policy, reward_model=reward_model, config=config).train()
    assert result.steps == config.max_steps and torch.isfinite(torch.tensor(result.metrics["loss"]))
    config = PPOConfig(gradient_checkpointing=True, gradient_accumulation_steps=4, mixed_precision="bf16", offload_optimizer=True)
    result = Trainer(policy=policy, reward_model=reward_model, config=config).train()
    for key in (
        "reward/mean",
        "reward/std",
        "kl",
        "policy/clip_fraction",
        "policy/approx_kl",
        "value/loss",
        "value/explained_variance",
        "response_length/mean",
        "perf/gen_tokens_per_s",
        "perf/train_tokens_per_s",
    ):
        assert key in result.metrics, key


class _Updates(Callback):
    """Records every optimizer step's metrics (the engine's per-update hook)."""

    def __init__(self):
        self.steps: list[int] = []
        self.metrics: list[dict[str, float]] = []

    def on_update(self, step: int, metrics: dict[str, float]) -> None:
        self.steps.append(step)
        self.metrics.append(metrics)


def _ppo(path, **overrides):
    from verl_core.algorithms.ppo import PPOTrainer
    from verl_core.policies import LLMPolicy

    settings = dict(
        batch_size=16,
        mini_batch_size=8,
        ppo_epochs=2,
        max_steps=1,
        learning_rate=1e-4,
        kl_coef=0.1,
        max_new_tokens=16,
        progress=False,
        logging_steps=1,
        reward_rules={"exact_match": 1.0, "format": 0.5},
    )
    settings.update(overrides)
    return PPOTrainer(policy=LLMPolicy.from_pretrained(str(path)), **settings)


def test_first_update_sees_zero_kl_unit_ratio_and_no_clipping(sft_path):
    updates = _Updates()
    result = _ppo(sft_path, gradient_accumulation_steps=2, callbacks=[updates]).train()
    first = updates.metrics[0]  # metrics of the first optimizer step, computed before it stepped
    assert abs(result.history["kl"][0][1]) < 1e-6  # policy == reference at step 0
    assert first["policy/ratio_dev_max"] < 1e-5
    assert first["policy/clip_fraction"] == 0.0
    assert first["policy/approx_kl"] < 1e-10
    assert updates.steps == [1, 2, 3, 4]  # 2 epochs × 2 mini-batches
    assert updates.metrics[-1]["policy/ratio_dev_max"] > first["policy/ratio_dev_max"]  # later ones are off-policy


def test_seeded_runs_give_identical_rewards_and_losses(sft_path):
    keys = ("reward/mean", "loss", "policy/loss", "value/loss", "kl")
    runs = [_ppo(sft_path, max_steps=3, seed=5).train().history for _ in range(2)]
    for key in keys:
        assert runs[0][key] == runs[1][key], key
    other = _ppo(sft_path, max_steps=3, seed=6).train().history
    assert other["reward/mean"] != runs[0]["reward/mean"] or other["loss"] != runs[0]["loss"]


def test_adaptive_kl_coefficient_moves_toward_the_target(sft_path):
    trainer = _ppo(sft_path, max_steps=2, adaptive_kl=True, kl_coef=0.2, kl_target=100.0, kl_horizon=10)
    result = trainer.train()
    assert result.history["kl_coef"][-1][1] < 0.2  # KL far below target -> beta shrinks


# PPO's accuracy gain (value head, GAE, KL in the reward, exact-match rule, 40 rollout steps of 128 from
# the SFT fixture) is asserted by tests/test_flows.py, whose policy stage is that same run; measured
# 0.495 -> 0.620 in bench/online_rl.py. With a reward model trained on ``arithmetic.preference_rows``
# instead, the same run gained +0.00 to +0.17 over seeds and then over-optimised the model (held-out
# pairwise accuracy ~0.9, but it ranks the policy's own samples little better than chance).


def test_a_resumed_run_continues_exactly(sft_path, tmp_path):
    class CrashAfterStep2(Callback):
        def on_step_end(self, step: int) -> None:
            if step == 2:
                raise KeyboardInterrupt

    settings = dict(max_steps=3, save_steps=1, adaptive_kl=True, kl_target=1.0, kl_horizon=10)
    straight = _ppo(sft_path, **settings).train().history
    crashed = _ppo(sft_path, output_dir=str(tmp_path), callbacks=[CrashAfterStep2()], **settings)
    with pytest.raises(KeyboardInterrupt):
        crashed.train()
    result = _ppo(sft_path, output_dir=str(tmp_path), **settings).train()  # from the step-2 checkpoint
    assert result.resumed_from_step == 2 and result.steps == 3  # rollout steps, not optimizer steps
    resumed = result.history
    for key in ("reward/mean", "loss", "value/loss", "kl_coef"):
        assert resumed[key] == straight[key][2:], key
