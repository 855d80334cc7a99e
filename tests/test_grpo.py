"""GRPO / RLOO / REINFORCE++: group sampling, critic-free advantages, KL placement, reproducibility."""

from __future__ import annotations

import pytest
import torch

from verl_core.algorithms.grpo import GROUP_ESTIMATORS
from verl_core.config import ConfigError
from verl_core.losses.policy import AGG_MODES, POLICY_LOSSES
from verl_core.train.callbacks import Callback

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: one torch thread, accelerate state reset


class _Updates(Callback):
    """Records every optimizer step's metrics (the engine's per-update hook)."""

    def __init__(self):
        self.metrics: list[dict[str, float]] = []

    def on_update(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.append(metrics)


def _trainer(path, cls_name="GRPOTrainer", **overrides):
    from verl_core.algorithms import grpo
    from verl_core.policies import LLMPolicy

    settings = dict(
        batch_size=16, num_generations=4, max_steps=2, learning_rate=1e-4, max_new_tokens=16, progress=False, logging_steps=1
    )
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


@pytest.mark.parametrize(
    "cls_name",
    [
        "GRPOTrainer",
        pytest.param("RLOOTrainer", marks=pytest.mark.exhaustive),
        pytest.param("ReinforcePPTrainer", marks=pytest.mark.exhaustive),
    ],
)
def test_kl_to_the_reference_starts_at_zero(sft_path, cls_name):
    updates = _Updates()
    trainer = _trainer(sft_path, cls_name, max_steps=1, kl_coef=0.1, callbacks=[updates])
    result = trainer.train()
    first = updates.metrics[0]
    if trainer.config.kl_in == "loss":
        assert abs(first["policy/kl_loss"]) < 1e-6
    else:
        assert abs(result.history["kl"][0][1]) < 1e-6
    assert first["policy/ratio_dev_max"] < 1e-5 and first["policy/clip_fraction"] == 0.0


def test_seeded_grpo_runs_are_identical(sft_path):
    runs = [_trainer(sft_path, seed=3, ppo_epochs=2).train().history for _ in range(2)]
    for key in ("reward/mean", "loss", "policy/loss", "grad_norm"):
        assert runs[0][key] == runs[1][key], key


# GRPO's held-out improvement is measured by bench/online_rl.py, not asserted here: in fp32 from the
# 0.495 SFT fixture (200 held-out rows) 40 steps x 128 episodes gave 0.525 (lr 1e-4), 0.47 (lr 3e-4) and
# 0.505 (4 updates per rollout), below the +0.05 a test would need (on the earlier bf16 host: 0.46 -> 0.65).


def by_name_variants(names) -> list:
    """The first name (the default) trains in the suite, the others with --exhaustive: each is a pure
    function tested on its own in tests/test_losses_*.py, and this checks the by-name wiring."""
    names = list(names)
    return names[:1] + [pytest.param(n, marks=pytest.mark.exhaustive) for n in names[1:]]


def _changes_weights(trainer) -> dict[str, float]:
    before = {k: v.clone() for k, v in trainer.policy.model.state_dict().items()}
    result = trainer.train()
    after = trainer.policy.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before), "the step did not change the policy"
    assert all(torch.isfinite(torch.tensor(v[-1][1])) for k, v in result.history.items() if k in ("loss", "policy/loss"))
    return result.metrics


@pytest.mark.parametrize("name", by_name_variants(POLICY_LOSSES))
def test_every_policy_loss_trains_a_grpo_step_by_name(sft_path, name):
    from verl_core.algorithms.grpo import GRPOConfig

    config = GRPOConfig.from_dict({"policy_loss": name, "batch_size": 16, "num_generations": 4, "max_steps": 1})
    metrics = _changes_weights(_trainer(sft_path, config=config, ppo_epochs=2, mini_batch_size=8))
    assert metrics["policy/clip_fraction"] >= 0.0


@pytest.mark.parametrize("name", by_name_variants(GROUP_ESTIMATORS))
def test_every_group_estimator_trains_a_grpo_step_by_name(sft_path, name):
    from verl_core.algorithms.grpo import GRPOConfig

    config = GRPOConfig.from_dict({"advantage_estimator": name, "batch_size": 16, "num_generations": 4, "max_steps": 1})
    metrics = _changes_weights(_trainer(sft_path, config=config))
    assert metrics["advantages/abs_mean"] > 0


@pytest.mark.parametrize("agg", by_name_variants(AGG_MODES))
def test_every_loss_aggregation_trains_a_grpo_step_by_name(sft_path, agg):
    _changes_weights(_trainer(sft_path, max_steps=1, loss_agg=agg))


def test_loss_names_come_from_the_registries():
    from verl_core.algorithms.grpo import GRPOConfig
    from verl_core.algorithms.ppo import PPOConfig
    from verl_core.losses.advantages import ADVANTAGE_ESTIMATORS

    assert set(GROUP_ESTIMATORS) == set(ADVANTAGE_ESTIMATORS) - {"gae"}
    with pytest.raises(ConfigError, match="'vanilla', 'gspo' or 'cispo'|vanilla.*gspo.*cispo"):
        GRPOConfig.from_dict({"policy_loss": "ppo"})
    with pytest.raises(ConfigError, match="advantage_estimator"):
        GRPOConfig.from_dict({"advantage_estimator": "gae"})
    with pytest.raises(ConfigError, match="cispo"):
        PPOConfig.from_dict({"policy_loss": "cispo", "dual_clip": 3.0})
    with pytest.raises(ConfigError, match="needs num_generations >= 2"):
        GRPOConfig.from_dict({"advantage_estimator": "dr_grpo", "num_generations": 1, "batch_size": 8})
    # clip bounds: None falls back to the loss's own defaults; clip_range_high defaults to clip_range
    assert "clip_low" not in GRPOConfig(policy_loss="gspo").policy_loss_kwargs()
    assert GRPOConfig(clip_range=0.1).policy_loss_kwargs()["clip_high"] == 0.1
    assert GRPOConfig(loss_agg="seq-mean-token-sum-norm", max_new_tokens=20).policy_loss_kwargs()["norm_constant"] == 20.0
    # loss_agg None: the loss's own aggregation (GSPO's sequence mean), used for entropy, KL and units too
    assert GRPOConfig().aggregation == "token-mean" and GRPOConfig(policy_loss="gspo").aggregation == "seq-mean-token-mean"
    assert GRPOConfig(policy_loss="gspo", loss_agg="token-mean").policy_loss_kwargs()["agg"] == "token-mean"


@pytest.mark.parametrize("agg", [*AGG_MODES, None])
def test_loss_units_make_micro_batches_add_up_to_the_batch_loss(agg):
    """The engine sums ``loss_sum`` over micro-batches and divides by the summed ``count``: for every
    aggregation that must equal the aggregated loss of the whole batch."""
    import types

    from verl_core.algorithms.grpo import GRPOConfig
    from verl_core.algorithms.online import OnlineTrainer
    from verl_core.losses.policy import FixedKLController
    from verl_core.modeling.logprobs import scaled_logprobs

    torch.manual_seed(0)
    b, t, v = 6, 5, 11
    lengths = torch.tensor([1, 5, 0, 2, 5, 4])  # a row without tokens counts for no aggregation
    mask = (torch.arange(t)[None] < lengths[:, None]).long()
    batch = {
        "logits": torch.randn(b, t, v),
        "response_ids": torch.randint(0, v, (b, t)),
        "response_mask": mask,
        "advantages": torch.randn(b, 1).expand(b, t) * mask,
        "old_logp": -torch.rand(b, t),
    }
    for name in ("vanilla", "gspo", "cispo"):
        fake = types.SimpleNamespace(
            config=GRPOConfig(loss_agg=agg, policy_loss=name, max_new_tokens=8, num_generations=2, batch_size=6),
            policy_outputs=lambda model, mb, with_entropy: (
                *scaled_logprobs(mb["logits"], mb["response_ids"], with_entropy=with_entropy),
                None,
            ),
            extra_loss=lambda values, mb: (0.0, {}),
            kl_ctl=FixedKLController(0.0),
            behaviour_is_old=False,
        )
        whole = OnlineTrainer.loss(fake, None, batch)
        parts = [OnlineTrainer.loss(fake, None, {k: x[s] for k, x in batch.items()}) for s in (slice(0, 2), slice(2, 6))]
        assert whole.count == (mask.sum().item() if fake.config.aggregation == "token-mean" else b - 1)
        combined = sum(p.loss_sum for p in parts) / sum(p.count for p in parts)
        assert torch.allclose(combined, whole.loss_sum / whole.count, atol=1e-6), (name, agg)
