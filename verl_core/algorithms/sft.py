"""Supervised fine-tuning: next-token NLL on completion tokens only."""

from __future__ import annotations

from pydantic import Field

from verl_core.algorithms.base import LMHeadSettings, OfflineTrainer, PackingSettings
from verl_core.data import collate_sft, tokenize_sft
from verl_core.data.formats import LongPromptPolicy
from verl_core.data.packing import collate_packed_sft
from verl_core.modeling.packed_forward import model_token_logprobs
from verl_core.train.config import TrainConfig
from verl_core.train.engine import LossOutput


class SFTConfig(TrainConfig, PackingSettings, LMHeadSettings):
    learning_rate: float = Field(1e-3, gt=0)
    max_length: int = Field(512, ge=2)
    max_prompt_length: int | None = None
    on_long_prompt: LongPromptPolicy = "error"


class SFTTrainer(OfflineTrainer):
    """``SFTTrainer(model, tokenizer, train_dataset=rows, learning_rate=...).train()``

    Loss: mean over every completion token in the global batch of ``-log p(x_t | x_<t)``.
    """

    config_cls = SFTConfig
    config: SFTConfig

    def tokenize(self, rows):
        c = self.config
        return tokenize_sft(rows, self.tokenizer, c.max_length, c.max_prompt_length, c.on_long_prompt)

    def collate(self, examples):
        c = self.config
        if c.packing:
            return collate_packed_sft(
                examples,
                self.tokenizer.pad_token_id,
                c.packing_row_tokens,
                prune_last_layer=c.prune_last_layer,
                fused_lm_head=c.fused_lm_head,
            )
        return collate_sft(examples, self.tokenizer.pad_token_id)

    def loss(self, model, batch) -> LossOutput:
        logps = model_token_logprobs(model, batch)
        mask = batch["loss_mask"].to(logps.dtype)
        return LossOutput(loss_sum=-(logps * mask).sum(), count=mask.sum().item())
