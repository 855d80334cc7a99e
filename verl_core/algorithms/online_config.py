"""Settings shared by the online trainers (PPO, GRPO, RLOO, REINFORCE++); see :mod:`.online`."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from verl_core.engine import TrainConfig
from verl_core.rewards.model import RewardSourceConfig

KLKind = Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"]


class OnlineConfig(TrainConfig, RewardSourceConfig):
    """Settings shared by PPO, GRPO, RLOO and REINFORCE++. ``max_steps`` counts rollout steps."""

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
    clip_range: float = Field(0.2, gt=0)
    clip_range_high: float | None = Field(None, gt=0, description="upper clip (DAPO clip-higher); default clip_range")
    dual_clip: float | None = Field(None, gt=1)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    entropy_coef: float = Field(0.0, ge=0)
    kl_coef: float = Field(0.05, ge=0, description="beta; 0 disables the reference model")
    kl_estimator: KLKind = "k1"
    kl_in: Literal["reward", "loss"] = "reward"
    adaptive_kl: bool = False
    kl_target: float = Field(6.0, gt=0)
    kl_horizon: int = Field(10000, ge=1)
    missing_eos_penalty: float | None = Field(None, description="subtracted from the score of completions cut by max_new_tokens")
    eval_reward: str = "exact_match"
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
        return self
