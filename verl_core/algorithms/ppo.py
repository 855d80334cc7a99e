"""PPO for language models (Schulman et al. 2017, arXiv:1707.06347; the RLHF recipe of Ziegler
et al. 2019, arXiv:1909.08593, and Ouyang et al. 2022, arXiv:2203.02155).

The critic is a value head on the policy's backbone: ``V(s_t) = k · (w · h_t + b)`` with ``h_t``
the last hidden state at the position that predicts token ``t`` (one ``nn.Linear(hidden, 1)``,
zero-initialised so every value starts at 0). Actor and critic share one forward pass and one
optimizer step. By default the value loss does not flow into the backbone (``h_t`` is detached:
the critic is a probe on the policy's features), so a noisy early critic cannot move the policy;
``critic_backprop=True`` lets it. Under Adam the constant ``k = value_lr_multiplier`` acts as a
learning-rate multiplier of the head (the step in ``w`` is ~lr whatever the gradient's scale, so
the step in ``V`` is ~k·lr), letting the critic catch up with returns within a few steps. The loss is::

    L = L_clip(pi) + vf_coef * L_value(V) - entropy_coef * H(pi)  [+ beta * KL when kl_in="loss"]

with ``L_value`` the clipped value loss of :func:`~verl_core.losses.policy.ppo_value_loss`.
Rewards per token are ``r_t = -beta * kl_t`` plus the sequence score on the last token;
advantages are GAE (Schulman et al. 2016, arXiv:1506.02438), whitened over the batch. PPO always
uses GAE (it is the only estimator that reads the critic): unlike the group trainers it has no
``advantage_estimator`` option. The policy loss and its aggregation are selectable as in every
online trainer (``policy_loss``: ``vanilla`` (the default), ``gspo``, ``cispo``; ``loss_agg``);
the value loss uses the same aggregation.
Only the policy LM is saved at the end (``output_dir/model``); the value head is a training aid.
"""

from __future__ import annotations

import torch
from pydantic import Field

from verl_core.algorithms.online import OnlineTrainer
from verl_core.algorithms.online_config import OnlineConfig
from verl_core.losses.advantages import gae_advantages
from verl_core.losses.masked import masked_mean, masked_var, masked_whiten
from verl_core.losses.policy import ppo_value_loss
from verl_core.modeling.logprobs import scaled_logprobs


class PPOConfig(OnlineConfig):
    """``PPOConfig(learning_rate=1e-5, batch_size=32, ppo_epochs=4, clip_range=0.2)``"""

    ppo_epochs: int = Field(4, ge=1)
    vf_coef: float = Field(0.1, ge=0)
    value_clip_range: float | None = Field(0.2, gt=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    whiten_advantages: bool = True
    whiten_rewards: bool = False
    critic_backprop: bool = Field(False, description="let the value loss train the shared backbone")
    value_lr_multiplier: float = Field(
        10.0, gt=0, description="k in V = k·(w·h + b): the value head's learning-rate multiplier under Adam"
    )


class ValueHeadModel(torch.nn.Module):
    """A causal LM plus a scalar value head on its last hidden state."""

    def __init__(self, lm: torch.nn.Module, backprop: bool = False, scale: float = 1.0):
        super().__init__()
        self.lm = lm
        self.backprop = backprop
        self.scale = scale
        self.value_head = torch.nn.Linear(lm.config.hidden_size, 1)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(lm.parameters()).dtype)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, logits_to_keep: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and values of the last ``logits_to_keep`` positions."""
        out = self.lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            output_hidden_states=True,
            logits_to_keep=logits_to_keep,
        )
        hidden = out.hidden_states[-1][:, -logits_to_keep:]
        if not self.backprop:
            hidden = hidden.detach()
        return out.logits, self.scale * self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)


class PPOTrainer(OnlineTrainer):
    """``PPOTrainer(policy=LLMPolicy.from_pretrained(p), reward_model=RewardModel.from_pretrained(r),
    config=PPOConfig()).train()``"""

    config_cls = PPOConfig
    config: PPOConfig
    needs_values = True
    fused_head_unsupported = "the value model returns the policy's logits with its values (the reference's are fused)"

    def packing_unsupported(self, lm: torch.nn.Module) -> str | None:
        return "PPO's value head reads the padded layout (no packed path yet)"

    def build_module(self, lm: torch.nn.Module) -> torch.nn.Module:
        if self.config.gradient_checkpointing and hasattr(lm, "gradient_checkpointing_enable"):
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return ValueHeadModel(lm, self.config.critic_backprop, self.config.value_lr_multiplier)

    def policy_lm(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.lm

    def policy_outputs(self, model, batch, with_entropy=False):
        c, r = self.config, batch["response_ids"].shape[1]
        logits, values = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            logits_to_keep=r + 1,
        )
        scale = 1.0 / c.temperature
        logp, entropy = scaled_logprobs(logits[:, :-1], batch["response_ids"], scale, with_entropy, c.entropy_coef > 0)
        return logp, entropy, values[:, :-1].float()

    def compute_advantages(self, exp, scores):
        c = self.config
        mask = exp["response_mask"]
        rewards = self.token_rewards(exp, scores)
        if c.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae_advantages(rewards, exp["values"], mask, c.gamma, c.lam)
        if c.whiten_advantages:
            advantages = masked_whiten(advantages, mask)
        exp["advantages"], exp["returns"] = advantages, returns
        var_returns = masked_var(returns, mask)
        explained = (
            1.0 - masked_var(returns - exp["values"], mask) / var_returns if var_returns > 0 else torch.tensor(float("nan"))
        )
        return {
            "value/explained_variance": float(explained),
            "value/mean": masked_mean(exp["values"], mask).item(),
            "returns/mean": masked_mean(returns, mask).item(),
        }

    def extra_loss(self, values, batch):
        c, mask = self.config, batch["response_mask"]
        out = ppo_value_loss(
            values, batch["values"], batch["returns"], mask, c.value_clip_range, c.aggregation, c.aggregation_norm
        )
        return c.vf_coef * out.loss, {"value/loss": out.loss.item(), "value/clip_fraction": out.clip_fraction.item()}


Trainer = PPOTrainer
