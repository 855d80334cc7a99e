"""Reward model: a sequence classifier trained with the Bradley–Terry loss on pairs."""

from __future__ import annotations

import torch
from pydantic import Field

from verl_core.algorithms.base import OfflineTrainer, PairPackingSettings
from verl_core.data import collate_pairs, packing, tokenize_pairs
from verl_core.data.formats import LongPromptPolicy
from verl_core.losses.reward import bradley_terry_loss
from verl_core.modeling.loading import load_reward_model
from verl_core.modeling.packed_forward import pair_rewards
from verl_core.train.config import TrainConfig
from verl_core.train.engine import LossOutput


class RewardConfig(TrainConfig, PairPackingSettings):
    learning_rate: float = Field(1e-4, gt=0)
    max_length: int = Field(512, ge=2)
    max_prompt_length: int | None = None
    on_long_prompt: LongPromptPolicy = "error"
    center_rewards_coefficient: float = Field(0.0, ge=0)
    margin: float | None = Field(None, description="constant margin m in -logσ(r_c - r_r - m)")


class RewardTrainer(OfflineTrainer):
    """Bradley–Terry reward model; metric ``accuracy`` = fraction of pairs with r_c > r_r."""

    config_cls = RewardConfig
    config: RewardConfig
    needs_score_head = True

    def load_model(self, path: str):
        return load_reward_model(path, gradient_checkpointing=self.config.gradient_checkpointing)

    def tokenize(self, rows):
        c = self.config
        examples = tokenize_pairs(rows, self.tokenizer, c.max_length, c.max_prompt_length, c.on_long_prompt)
        return examples

    def collate(self, examples):
        c = self.config
        if c.packing:
            batch = packing.collate_packed_pairs(
                examples, self.tokenizer.pad_token_id, c.share_prompt, c.packing_row_tokens, prune_last_layer=c.prune_last_layer
            )
        else:
            batch = collate_pairs(examples, self.tokenizer.pad_token_id)
        if self.config.margin is not None:
            batch["margin"] = torch.full((len(examples),), float(self.config.margin))
        return batch

    def loss(self, model, batch) -> LossOutput:
        chosen, rejected = pair_rewards(model, batch)
        losses = bradley_terry_loss(chosen, rejected, batch.get("margin"), self.config.center_rewards_coefficient)
        metrics = {
            "accuracy": (chosen > rejected).float().mean().item(),
            "rewards/chosen": chosen.mean().item(),
            "rewards/rejected": rejected.mean().item(),
            "rewards/margin": (chosen - rejected).mean().item(),
        }
        return LossOutput(loss_sum=losses.sum(), count=len(chosen), metrics=metrics)
