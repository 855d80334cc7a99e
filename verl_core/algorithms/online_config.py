"""Settings shared by the online trainers (PPO, GRPO, RLOO, REINFORCE++); see :mod:`.online`."""

from __future__ import annotations

import inspect
import math
from typing import Literal

from pydantic import Field, model_validator

from verl_core.agents.environments import AgentSettings
from verl_core.algorithms.async_config import AsyncRolloutConfig, check_async_config
from verl_core.algorithms.base import LMHeadSettings
from verl_core.losses.correction import ROLLOUT_CORRECTIONS
from verl_core.losses.policy import AGG_MODES, POLICY_LOSSES
from verl_core.rewards.model import RewardSourceConfig
from verl_core.rewards.rules import RuleName
from verl_core.rollout.registry import RolloutConfig
from verl_core.train.config import TrainConfig

KLKind = Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"]
PolicyLossName = Literal[tuple(POLICY_LOSSES)]  # type: ignore[valid-type]
LossAgg = Literal[AGG_MODES]  # type: ignore[valid-type]
RolloutCorrection = Literal[tuple(ROLLOUT_CORRECTIONS)]  # type: ignore[valid-type]


class OnlineConfig(TrainConfig, RewardSourceConfig, LMHeadSettings, AgentSettings):
    """Settings shared by PPO, GRPO, RLOO and REINFORCE++. ``max_steps`` counts rollout steps; with an
    ``environment`` (:mod:`verl_core.agents`) each sample is a multi-turn episode with tools and
    ``max_new_tokens`` bounds each policy turn."""

    learning_rate: float = Field(1e-5, gt=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    max_steps: int = Field(
        10, ge=1, description="rollout steps; each is ppo_epochs × (batch_size / mini_batch_size) optimizer steps"
    )
    total_episodes: int | None = Field(None, ge=1, description="if set: max_steps = ceil(total_episodes / batch_size)")
    batch_size: int = Field(16, ge=1, description="episodes (sampled completions) per rollout step, all processes")
    mini_batch_size: int | None = Field(None, ge=1, description="episodes per optimizer step (default batch_size)")
    ppo_epochs: int = Field(1, ge=1)
    num_generations: int = Field(1, ge=1, description="completions sampled per prompt (the group size)")
    max_prompt_length: int = Field(256, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    generation_batch_size: int = Field(256, ge=1)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the sampling engine: hf | vllm, and its options")
    rollout_correction: RolloutCorrection = Field(
        "none",
        description="tis: weight each token's policy loss by min(pi_train / pi_rollout, tis_cap) (Yao et al. 2025); "
        "the mismatch is logged whenever the sampler is not the training model itself",
    )
    tis_cap: float = Field(2.0, gt=0, description="the TIS weight's cap C")
    async_rollout: AsyncRolloutConfig = Field(
        default_factory=AsyncRolloutConfig, description="rollout workers apart from the trainer, bounded staleness"
    )
    policy_loss: PolicyLossName = Field(
        "vanilla", description=f"the policy loss, by name in losses.policy.POLICY_LOSSES: {' | '.join(POLICY_LOSSES)}"
    )
    clip_range: float | None = Field(
        None, gt=0, description="lower clip epsilon; None: the policy loss's default (vanilla 0.2, gspo 3e-4, cispo none)"
    )
    clip_range_high: float | None = Field(
        None,
        gt=0,
        description="upper clip (DAPO clip-higher); None: clip_range if set, else the loss's default "
        "(vanilla 0.2, gspo 4e-4, cispo 0.28)",
    )
    dual_clip: float | None = Field(None, gt=1, description="dual clip (vanilla and gspo; cispo has none)")
    loss_agg: LossAgg | None = Field(
        None,
        description=f"aggregation of the token losses: {' | '.join(AGG_MODES)}; None: the policy loss's default "
        "(vanilla and cispo token-mean, gspo seq-mean-token-mean)",
    )
    loss_agg_norm: float | None = Field(
        None, gt=0, description="seq-mean-token-sum-norm: the constant divisor (default max_new_tokens)"
    )
    entropy_coef: float = Field(0.0, ge=0)
    kl_coef: float = Field(0.05, ge=0, description="beta; 0 disables the reference model")
    kl_estimator: KLKind = "k1"
    kl_in: Literal["reward", "loss"] = "reward"
    adaptive_kl: bool = False
    kl_target: float = Field(6.0, gt=0)
    kl_horizon: int = Field(10000, ge=1)
    missing_eos_penalty: float | None = Field(None, description="subtracted from the score of completions cut by max_new_tokens")
    eval_reward: RuleName = "exact_match"
    seed_per_prompt: bool = Field(
        False, description="sample each prompt from its own seeded stream: samples independent of the number of processes"
    )

    @model_validator(mode="after")
    def _online_shape(self):
        if self.total_episodes is not None:
            self.__dict__["max_steps"] = max(1, math.ceil(self.total_episodes / self.batch_size))
        if self.batch_size % self.num_generations:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of num_generations {self.num_generations}")
        if self.mini_batch_size is not None and self.batch_size % self.mini_batch_size:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of mini_batch_size {self.mini_batch_size}")
        if self.policy_loss == "cispo" and self.dual_clip is not None:
            raise ValueError("policy_loss 'cispo' has no dual clip (its IS weight is already bounded); set dual_clip to null")
        check_async_config(self)
        return self

    def policy_loss_kwargs(self) -> dict[str, float | str | None]:
        """Keywords of ``POLICY_LOSSES[policy_loss]`` (clip bounds left out fall back to that loss's defaults)."""
        kwargs: dict[str, float | str | None] = {"agg": self.aggregation, "dual_clip": self.dual_clip}
        kwargs["norm_constant"] = self.aggregation_norm
        if self.clip_range is not None:
            kwargs["clip_low"] = self.clip_range
        high = self.clip_range_high if self.clip_range_high is not None else self.clip_range
        if high is not None:
            kwargs["clip_high"] = high
        return kwargs

    @property
    def aggregation(self) -> str:
        """``loss_agg``, or the selected policy loss's default aggregation when it is None."""
        if self.loss_agg is not None:
            return self.loss_agg
        return inspect.signature(POLICY_LOSSES[self.policy_loss]).parameters["agg"].default

    @property
    def aggregation_norm(self) -> float:
        """The constant of ``seq-mean-token-sum-norm`` (ignored by the other aggregations)."""
        return float(self.loss_agg_norm if self.loss_agg_norm is not None else self.max_new_tokens)
