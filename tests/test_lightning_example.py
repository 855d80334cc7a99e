"""examples/lightning_rlhf.py: SFT and DPO as a LightningModule trained by ``lightning.Trainer``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning", reason="the lightning test extra is not installed (make test installs it)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from lightning_rlhf import PolicyModule  # noqa: E402

from verl_core.bundled import arithmetic  # noqa: E402


class LossHistory(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def fit(module: PolicyModule, rows: list[dict], steps: int, batch_size: int) -> list[float]:
    history = LossHistory()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[history],
    )
    trainer.fit(module, module.dataloader(rows, batch_size=batch_size, shuffle=False))
    assert trainer.global_step == steps
    return history.losses


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_sft_then_dpo_train_under_the_lightning_trainer_and_the_loss_goes_down(tiny_path, tmp_path):
    torch.manual_seed(0)
    sft = PolicyModule(str(tiny_path), "sft", learning_rate=3e-3)
    losses = fit(sft, arithmetic.sft_rows(16 * 30), steps=30, batch_size=16)
    assert mean(losses[-5:]) < 0.7 * mean(losses[:5]), losses
    sft.policy.save_pretrained(tmp_path / "sft")
    sft.tokenizer.save_pretrained(tmp_path / "sft")

    dpo = PolicyModule(str(tmp_path / "sft"), "dpo", learning_rate=1e-3, beta=0.1)
    pairs = arithmetic.preference_rows(arithmetic.train_problems(64))[:8]
    losses = fit(dpo, pairs, steps=10, batch_size=8)  # one batch, seen ten times: the DPO loss must fall
    assert losses[0] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference at the start
    assert losses[-1] < losses[0] - 0.1, losses
