"""DAPO (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
arXiv:2503.14476) as a recipe of the GRPO trainer.

The paper's four techniques, each an option of :class:`~verl_core.algorithms.grpo.GRPOConfig`:

- clip-higher: decoupled clip bounds ``clip_range=0.2`` (epsilon_low) and ``clip_range_high=0.28``
  (epsilon_high), so low-probability tokens can grow (against entropy collapse);
- dynamic sampling: groups whose completions all score the same (accuracy 0 or 1) are dropped and
  more prompts are sampled until the batch is full (``dynamic_sampling``, at most
  ``max_sampling_rounds`` extra rounds; see :func:`~verl_core.algorithms.sampling.dynamic_collect`);
- token-level policy-gradient loss: ``loss_agg="token-mean"`` (every token of the batch weighs the
  same, so long responses are not under-weighted);
- overlong reward shaping: the soft length penalty of the paper's eq. 13 over the last
  ``overlong_buffer`` tokens before ``max_new_tokens`` (:func:`~verl_core.algorithms.sampling.overlong_penalty`).

As in the paper there is no KL term (``kl_coef=0``, no reference model) and the advantage is GRPO's
group-normalised one. The default buffer suits the default ``max_new_tokens=32`` on the bundled
task (answers take 13-17 tokens with EOS, so only responses longer than 24 tokens are penalised);
scale it with ``max_new_tokens`` (the paper: 4096 of 20480 tokens).
"""

from __future__ import annotations

from pydantic import Field

from verl_core.algorithms.grpo import GRPOConfig, GRPOTrainer
from verl_core.algorithms.online_config import LossAgg


class DAPOConfig(GRPOConfig):
    """``DAPOConfig(batch_size=128, num_generations=4)``: GRPO with the paper's recipe as defaults."""

    clip_range: float | None = Field(0.2, gt=0, description="epsilon_low of clip-higher")
    clip_range_high: float | None = Field(0.28, gt=0, description="epsilon_high of clip-higher")
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = Field(0.0, ge=0, description="beta; DAPO drops the KL term")
    dynamic_sampling: bool = True
    overlong_buffer: int | None = Field(8, ge=1, description="L_cache of the overlong shaping (None: off)")
    overlong_penalty: float = Field(1.0, ge=0)


class DAPOTrainer(GRPOTrainer):
    """``DAPOTrainer(policy=..., config=DAPOConfig(...), prompts=rows).train()``"""

    config_cls = DAPOConfig
    config: DAPOConfig
