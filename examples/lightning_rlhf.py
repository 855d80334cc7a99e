"""verl_core under PyTorch Lightning: SFT and DPO as a ``LightningModule``.

verl_core's pieces are plain functions, so Lightning users keep their ``Trainer`` (devices,
strategies, loggers, checkpoints) and take from verl_core only what a training step needs:

- data: :func:`verl_core.data.tokenize_sft` / :func:`~verl_core.data.tokenize_pairs` (validation,
  chat templates, prompt masking, implicit-prompt pairs) and the collators
  :func:`~verl_core.data.collate_sft` / :func:`~verl_core.data.collate_pairs`;
- losses: :func:`verl_core.modeling.logprobs.token_logprobs`, :func:`verl_core.losses.sequence_logps` and
  :func:`verl_core.losses.dpo_loss` (pure functions on tensors);
- models: :func:`verl_core.modeling.loading.load_causal_lm` / :func:`~verl_core.modeling.loading.load_tokenizer`.

Run it (``pip install lightning``; the tests install it with the ``lightning`` extra)::

    python examples/lightning_rlhf.py            # SFT then DPO on the bundled arithmetic task, tiny model

The example is outside the ``verl_core`` package on purpose: the kernel does not depend on Lightning.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import lightning as L
import torch
from torch.utils.data import DataLoader

from verl_core.data import collate_pairs, collate_sft, tokenize_pairs, tokenize_sft
from verl_core.losses import dpo_loss, sequence_logps
from verl_core.modeling.loading import load_causal_lm, load_tokenizer
from verl_core.modeling.logprobs import token_logprobs

Task = Literal["sft", "dpo"]


def sft_loss(token_lp: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of completion tokens: ``-sum_t m_t log p(x_t|x_<t) / sum_t m_t``."""
    return -sequence_logps(token_lp, loss_mask).sum() / loss_mask.sum().clamp(min=1)


class PolicyModule(L.LightningModule):
    """A causal LM trained with verl_core's SFT objective or DPO loss (against a frozen copy)."""

    def __init__(self, model_path: str, task: Task = "sft", learning_rate: float = 1e-3, beta: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.policy = load_causal_lm(model_path)
        self.tokenizer = load_tokenizer(model_path)
        self.reference = load_causal_lm(model_path, trainable=False) if task == "dpo" else None

    def _token_logprobs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return token_logprobs(logits.float(), batch["input_ids"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        mask = batch["loss_mask"]
        if self.hparams.task == "sft":
            loss = sft_loss(self._token_logprobs(self.policy, batch), mask)
        else:  # collate_pairs: chosen rows first, then rejected
            half = batch["input_ids"].shape[0] // 2
            policy = sequence_logps(self._token_logprobs(self.policy, batch), mask)
            with torch.no_grad():
                reference = sequence_logps(self._token_logprobs(self.reference, batch), mask)
            out = dpo_loss(policy[:half], policy[half:], reference[:half], reference[half:], beta=self.hparams.beta)
            loss = out.losses.mean()
            self.log("reward_margin", (out.chosen_rewards - out.rejected_rewards).mean())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.policy.parameters(), lr=self.hparams.learning_rate)

    def dataloader(self, rows: list[dict], batch_size: int = 16, max_length: int = 128, shuffle: bool = True) -> DataLoader:
        """Rows in verl_core's formats (SFT: prompt/completion, text or messages; DPO: prompt/chosen/rejected)."""
        pad = self.tokenizer.pad_token_id
        if self.hparams.task == "sft":
            examples, collate = tokenize_sft(rows, self.tokenizer, max_length), partial(collate_sft, pad_id=pad)
        else:
            examples, collate = tokenize_pairs(rows, self.tokenizer, max_length), partial(collate_pairs, pad_id=pad)
        return DataLoader(examples, batch_size=batch_size, shuffle=shuffle, collate_fn=collate)


def main() -> None:
    from verl_core import tiny_model_path
    from verl_core.bundled import arithmetic

    trainer_args = dict(accelerator="cpu", max_steps=60, logger=False, enable_checkpointing=False)
    sft = PolicyModule(str(tiny_model_path()), "sft", learning_rate=3e-3)
    L.Trainer(**trainer_args).fit(sft, sft.dataloader(arithmetic.sft_rows(2000), batch_size=32))
    sft.policy.save_pretrained("out/lightning-sft")
    sft.tokenizer.save_pretrained("out/lightning-sft")
    dpo = PolicyModule("out/lightning-sft", "dpo", learning_rate=1e-4, beta=0.1)
    pairs = arithmetic.preference_rows(arithmetic.train_problems(512))
    L.Trainer(**{**trainer_args, "max_steps": 20}).fit(dpo, dpo.dataloader(pairs, batch_size=16))


if __name__ == "__main__":
    main()
