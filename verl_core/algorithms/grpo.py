"""Critic-free policy optimisation with group sampling: GRPO, RLOO and REINFORCE++.

Each prompt gets ``num_generations`` completions; the baseline comes from the other samples
instead of a learned value function:

- ``"grpo"`` (Shao et al. 2024, arXiv:2402.03300): ``A_i = (s_i - mean_g) / (std_g + eps)``
  for every token of completion i (``scale_rewards=False`` drops the std, as Dr. GRPO,
  arXiv:2503.20783). The KL to the reference goes into the loss (k3 estimator) by default.
- ``"rloo"`` (Ahmadian et al. 2024, arXiv:2402.14740): ``A_i = s_i - mean of the other k-1``.
- ``"reinforce_pp"`` (Hu 2025, arXiv:2501.03262): per-token return-to-go of
  ``r_t = -beta * kl_t + score on the last token``, whitened over the whole batch.

For ``"grpo"``/``"rloo"`` with ``kl_in="reward"`` the sequence score is ``s_i - beta * sum_t kl_t``.
The update is the clipped surrogate of :class:`~verl_core.algorithms.online.OnlineTrainer`.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from verl_core.algorithms.base import PackingSettings
from verl_core.algorithms.online import KLKind, OnlineConfig, OnlineTrainer
from verl_core.forward import attn_implementation
from verl_core.losses.advantages import broadcast_to_tokens, grpo_advantages, reinforce_pp_advantages, rloo_advantages
from verl_core.losses.masked import masked_mean
from verl_core.packing import packed_response_logits, supports_shared_prompt


class GRPOConfig(OnlineConfig, PackingSettings):
    """``GRPOConfig(num_generations=8, batch_size=128)``: 16 prompts × 8 completions per step.

    ``packing`` (on by default) is the shared-prompt update: each prompt is computed once for its
    group's completions and no pad token is computed (sdpa or eager attention; other attention
    implementations fall back to padded rows with one log line)."""

    batch_size: int = Field(64, ge=1)
    num_generations: int = Field(8, ge=1)
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp"] = "grpo"
    scale_rewards: bool = Field(True, description="grpo: divide by the group std")
    kl_coef: float = Field(0.0, ge=0, description="beta; 0 (the default) skips the reference model")
    kl_estimator: KLKind = "k3"
    kl_in: Literal["reward", "loss"] = "loss"
    gamma: float = Field(1.0, ge=0, le=1, description="reinforce_pp: discount of the return-to-go")

    @model_validator(mode="after")
    def _groups(self):
        if self.advantage_estimator in ("grpo", "rloo") and self.num_generations < 2:
            raise ValueError(
                f"{self.advantage_estimator} needs num_generations >= 2 (a group baseline), got {self.num_generations}"
            )
        return self


class RLOOConfig(GRPOConfig):
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp"] = "rloo"
    kl_estimator: KLKind = "k1"
    kl_in: Literal["reward", "loss"] = "reward"


class ReinforcePPConfig(GRPOConfig):
    advantage_estimator: Literal["grpo", "rloo", "reinforce_pp"] = "reinforce_pp"
    kl_estimator: KLKind = "k1"
    kl_in: Literal["reward", "loss"] = "reward"


class GRPOTrainer(OnlineTrainer):
    """``GRPOTrainer(policy=..., config=GRPOConfig(...), prompts=rows).train()``; the default reward
    (when no reward model, rule or function is given) is the ``exact_match`` rule."""

    config_cls = GRPOConfig
    config: GRPOConfig

    def packing_unsupported(self, lm):
        if not supports_shared_prompt(lm):
            return f"the shared-prompt update needs sdpa or eager attention, the policy uses {attn_implementation(lm)}"
        return None

    def response_logits(self, model, batch):
        if self.config.packing:
            c = self.config
            return packed_response_logits(
                model, batch, self.policy.tokenizer.pad_token_id, c.packing_row_tokens, c.prune_last_layer
            )
        return super().response_logits(model, batch)

    def compute_advantages(self, exp, scores):
        c = self.config
        mask = exp["response_mask"]
        kl_in_reward = "kl" in exp and c.kl_in == "reward"
        if c.advantage_estimator == "reinforce_pp":
            advantages = reinforce_pp_advantages(self.token_rewards(exp, scores), mask, c.gamma)
        else:
            if kl_in_reward:
                scores = scores - self.kl_ctl.value * exp["kl"].sum(-1)
            # rows i*n .. i*n+n-1 answer prompt i (the rollout contract)
            groups = torch.arange(len(scores), device=scores.device) // c.num_generations
            if c.advantage_estimator == "grpo":
                seq = grpo_advantages(scores, groups, norm_by_std=c.scale_rewards)
            else:
                seq = rloo_advantages(scores, groups)
            advantages = broadcast_to_tokens(seq, mask)
        exp["advantages"] = advantages
        solved = scores.view(-1, c.num_generations)
        mixed = ((solved.max(-1).values - solved.min(-1).values) > 0).float().mean().item()
        return {"advantages/abs_mean": masked_mean(advantages.abs(), mask).item(), "groups/mixed_fraction": mixed}


class RLOOTrainer(GRPOTrainer):
    config_cls = RLOOConfig


class ReinforcePPTrainer(GRPOTrainer):
    config_cls = ReinforcePPConfig
