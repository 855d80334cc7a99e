"""Critic-free policy optimisation with group sampling: GRPO, RLOO, REINFORCE++ (and DAPO, :mod:`.dapo`).

Each prompt gets ``num_generations`` completions; the baseline comes from the other samples
instead of a learned value function. ``advantage_estimator`` names a group estimator of
:data:`~verl_core.losses.advantages.ADVANTAGE_ESTIMATORS` (every entry but the critic's ``gae``):

- ``"grpo"`` (Shao et al. 2024, arXiv:2402.03300): ``A_i = (s_i - mean_g) / (std_g + eps)``
  for every token of completion i (``scale_rewards=False`` drops the std, as Dr. GRPO,
  arXiv:2503.20783). The KL to the reference goes into the loss (k3 estimator) by default.
- ``"dr_grpo"`` (Liu et al. 2025, arXiv:2503.20783): ``A_i = s_i - mean_g``; pair it with
  ``loss_agg="seq-mean-token-sum-norm"`` for the full Dr. GRPO.
- ``"rloo"`` (Ahmadian et al. 2024, arXiv:2402.14740): ``A_i = s_i - mean of the other k-1``.
- ``"reinforce_pp"`` (Hu 2025, arXiv:2501.03262): per-token return-to-go of
  ``r_t = -beta * kl_t + score on the last token``, whitened over the whole batch.
- ``"reinforce_pp_baseline"`` (Hu 2025): ``s_i - mean_g`` whitened over the batch's tokens.

For the sequence-level estimators with ``kl_in="reward"`` the sequence score is ``s_i - beta * sum_t kl_t``.
The update is the policy loss of :class:`~verl_core.algorithms.online.OnlineTrainer`
(``policy_loss``, ``loss_agg``). DAPO's two sampling-side techniques are options here:
``dynamic_sampling`` (:func:`~verl_core.algorithms.sampling.dynamic_collect`) and overlong reward
shaping ``overlong_buffer`` (:func:`~verl_core.algorithms.sampling.overlong_penalty`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from verl_core.algorithms.base import PackingSettings
from verl_core.algorithms.online import OnlineTrainer
from verl_core.algorithms.online_config import KLKind, OnlineConfig
from verl_core.algorithms.sampling import dynamic_collect, overlong_penalty
from verl_core.losses.advantages import ADVANTAGE_ESTIMATORS
from verl_core.losses.masked import masked_mean
from verl_core.modeling.forward import attn_implementation
from verl_core.modeling.packed_forward import packed_response_logprobs, supports_shared_prompt

# The group estimators: every registered estimator but GAE, which needs a critic (PPO's).
GROUP_ESTIMATORS = tuple(name for name in ADVANTAGE_ESTIMATORS if name != "gae")
GroupEstimator = Literal[GROUP_ESTIMATORS]  # type: ignore[valid-type]
NEEDS_GROUPS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")  # a per-group baseline: num_generations >= 2


class GRPOConfig(OnlineConfig, PackingSettings):
    """``GRPOConfig(num_generations=8, batch_size=128)``: 16 prompts × 8 completions per step.

    ``packing`` (on by default) is the shared-prompt update: each prompt is computed once for its
    group's completions and no pad token is computed (sdpa or eager attention; other attention
    implementations fall back to padded rows with one log line)."""

    batch_size: int = Field(64, ge=1)
    num_generations: int = Field(8, ge=1)
    advantage_estimator: GroupEstimator = Field("grpo", description=" | ".join(GROUP_ESTIMATORS))
    scale_rewards: bool = Field(True, description="grpo: divide by the group std (dr_grpo never does)")
    kl_coef: float = Field(0.0, ge=0, description="beta; 0 (the default) skips the reference model")
    kl_estimator: KLKind = "k3"
    kl_in: Literal["reward", "loss"] = "loss"
    gamma: float = Field(1.0, ge=0, le=1, description="reinforce_pp: discount of the return-to-go")
    dynamic_sampling: bool = Field(
        False, description="DAPO: drop groups whose scores are all equal, sample more prompts until the batch is full"
    )
    max_sampling_rounds: int = Field(
        4, ge=0, description="dynamic sampling: most extra rounds per step; at the cap the step trains on what there is"
    )
    overlong_buffer: int | None = Field(
        None, ge=1, description="DAPO overlong shaping: penalise the last N tokens before max_new_tokens (None: off)"
    )
    overlong_penalty: float = Field(1.0, ge=0, description="overlong shaping: the penalty at max_new_tokens")

    @model_validator(mode="after")
    def _groups(self):
        if self.advantage_estimator in NEEDS_GROUPS and self.num_generations < 2:
            raise ValueError(
                f"{self.advantage_estimator} needs num_generations >= 2 (a group baseline), got {self.num_generations}"
            )
        if self.dynamic_sampling and self.num_generations < 2:
            raise ValueError("dynamic_sampling drops groups whose scores are all equal: it needs num_generations >= 2")
        if self.overlong_buffer is not None and self.overlong_buffer > self.max_new_tokens:
            raise ValueError(f"overlong_buffer {self.overlong_buffer} must be <= max_new_tokens {self.max_new_tokens}")
        return self


class RLOOConfig(GRPOConfig):
    advantage_estimator: GroupEstimator = "rloo"
    kl_estimator: KLKind = "k1"
    kl_in: Literal["reward", "loss"] = "reward"


class ReinforcePPConfig(GRPOConfig):
    advantage_estimator: GroupEstimator = "reinforce_pp"
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

    def response_logprobs(self, model, batch, with_entropy=False):
        c = self.config
        if not c.packing or c.environment is not None:  # episodes: tool tokens inside the response (padded path)
            return super().response_logprobs(model, batch, with_entropy)
        pad = self.policy.tokenizer.pad_token_id
        return packed_response_logprobs(
            model,
            batch,
            pad,
            c.packing_row_tokens,
            c.prune_last_layer,
            1.0 / c.temperature,
            with_entropy,
            c.entropy_coef > 0,
            c.fused_lm_head,
        )

    def collect(self, step):
        if self.config.dynamic_sampling:
            return dynamic_collect(self, step)
        rollout, scores, metrics = super().collect(step)
        return rollout, *self.shape_scores(rollout, scores, metrics)

    def shape_scores(self, rollout, scores, metrics):
        """Scores with the overlong penalty added (when ``overlong_buffer`` is set); ``reward/*`` of the result."""
        c = self.config
        if c.overlong_buffer is not None:
            lengths = rollout.response_lengths.to(scores.device)
            penalty = overlong_penalty(lengths, c.max_new_tokens, c.overlong_buffer, c.overlong_penalty)
            scores = scores + penalty.to(scores.dtype)
            metrics["reward/overlong_penalty"] = penalty.mean().item()
            metrics.update({"reward/mean": scores.mean().item(), "reward/std": scores.std(unbiased=False).item()})
        return scores, metrics

    def compute_advantages(self, exp, scores):
        """``ADVANTAGE_ESTIMATORS[advantage_estimator]`` over the groups (rows ``i*n .. i*n+n-1`` answer
        prompt ``i``, the rollout contract); the KL in the reward enters as dense token rewards
        (``reinforce_pp``) or as ``s_i - beta * sum_t kl_t`` (the sequence-level estimators)."""
        c = self.config
        mask = exp["response_mask"]
        kl = exp["kl"] if "kl" in exp and c.kl_in == "reward" else None
        options: dict = {}
        if c.advantage_estimator == "reinforce_pp":
            options = {"dense_rewards": None if kl is None else -(self.kl_ctl.value * kl), "gamma": c.gamma}
        else:
            if kl is not None:
                scores = scores - self.kl_ctl.value * kl.sum(-1)
            if c.advantage_estimator == "grpo":
                options = {"norm_by_std": c.scale_rewards}
        groups = torch.arange(len(scores), device=scores.device) // c.num_generations
        advantages = ADVANTAGE_ESTIMATORS[c.advantage_estimator](scores, groups, response_mask=mask, **options)
        exp["advantages"] = advantages
        solved = scores.view(-1, c.num_generations)
        mixed = ((solved.max(-1).values - solved.min(-1).values) > 0).float().mean().item()
        return {"advantages/abs_mean": masked_mean(advantages.abs(), mask).item(), "groups/mixed_fraction": mixed}


class RLOOTrainer(GRPOTrainer):
    config_cls = RLOOConfig


class ReinforcePPTrainer(GRPOTrainer):
    config_cls = ReinforcePPConfig
