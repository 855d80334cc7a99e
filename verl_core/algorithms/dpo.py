"""DPO and its relatives (IPO, hinge/SLiC, robust/cDPO, SimPO, ORPO) on the shared engine.

One trainer, the loss picked by ``loss_type``; the formulas and their sources are in
:mod:`verl_core.losses.preference`. Chosen and rejected completions go through the
policy in ONE forward pass (:func:`~verl_core.data.collate_pairs` stacks them), and
the reference likewise (see :mod:`verl_core.algorithms.preference` for where the
reference comes from, precomputation and LoRA).

``simpo`` and ``orpo`` are reference-free: no reference model is loaded.

Example (the seed's)::

    DPOTrainer(model=model, tokenizer=tokenizer,
               train_dataset=[{"prompt": ..., "chosen": ..., "rejected": ...}, ...],
               beta=0.1, learning_rate=5e-6).train()
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from verl_core.algorithms.preference import PreferenceConfig, PreferenceTrainer, attach_reference, pair_metrics
from verl_core.data import collate_pairs, tokenize_pairs
from verl_core.data.packing import collate_packed_pairs
from verl_core.losses.preference import DPO_LOSS_TYPES, dpo_loss, orpo_loss, sequence_logps, sequence_mean_logps, simpo_loss
from verl_core.modeling.packed_forward import model_token_logprobs
from verl_core.train.engine import LossOutput


def _simpo(c: DPOConfig, token_lps, mask, chosen, rejected, lengths, n: int):
    return simpo_loss(chosen, rejected, lengths[:n], lengths[n:], c.beta, c.simpo_gamma, c.label_smoothing), {}


def _orpo(c: DPOConfig, token_lps, mask, chosen, rejected, lengths, n: int):
    nll = -sequence_mean_logps(token_lps[:n], mask[:n])
    out = orpo_loss(chosen, rejected, lengths[:n], lengths[n:], nll, c.orpo_lambda)
    return out, {"nll": nll.detach().mean().item(), "log_odds_ratio": out.log_odds_ratio.mean().item()}


# loss_type -> the loss of a pair batch without a reference model; every other loss_type is one of
# losses.preference.DPO_LOSS_TYPES, against the reference.
REFERENCE_FREE_LOSSES = {"simpo": _simpo, "orpo": _orpo}
DPOLossType = Literal[tuple(DPO_LOSS_TYPES) + tuple(REFERENCE_FREE_LOSSES)]  # type: ignore[valid-type]


class DPOConfig(PreferenceConfig):
    """DPO-family settings. ``beta`` is DPO's β (SimPO's β for ``simpo``; unused by ``orpo``)."""

    loss_type: DPOLossType = "sigmoid"
    label_smoothing: float = Field(0.0, ge=0, lt=0.5, description="ε of cDPO (sigmoid), robust DPO and SimPO")
    simpo_gamma: float = Field(0.5, description="SimPO target reward margin γ")
    orpo_lambda: float = Field(0.1, ge=0, description="ORPO weight λ of the odds-ratio term")


class SimPOConfig(DPOConfig):
    """SimPO defaults (Meng et al. 2024 use β in 2–2.5, γ/β around 0.5)."""

    loss_type: DPOLossType = "simpo"
    beta: float = Field(2.0, gt=0)
    simpo_gamma: float = 1.0


class ORPOConfig(DPOConfig):
    """ORPO defaults (Hong et al. 2024)."""

    loss_type: DPOLossType = "orpo"


class DPOTrainer(PreferenceTrainer):
    """Direct preference optimisation; rows ``{"prompt", "chosen", "rejected"}``.

    Per step the loss is the mean over the global batch of per-pair losses
    (``LossOutput(loss_sum=Σ losses, count=B pairs)``). Metrics: ``loss``,
    ``rewards/{chosen,rejected,margins,accuracies}``, ``logps/{chosen,rejected}``
    (summed completion log-probs under the policy); ORPO adds ``nll`` and
    ``log_odds_ratio``. For DPO losses a reward is ``β·(log π − log π_ref)``; for
    SimPO ``β·mean-token log π``; for ORPO ``λ·mean-token log π``.
    """

    config_cls = DPOConfig
    config: DPOConfig

    @property
    def uses_reference(self) -> bool:
        return self.config.loss_type not in REFERENCE_FREE_LOSSES

    def tokenize(self, rows) -> list[dict]:
        c = self.config
        return tokenize_pairs(rows, self.tokenizer, c.max_length, c.max_prompt_length, c.on_long_prompt)

    def collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        c, pad = self.config, self.tokenizer.pad_token_id
        batch = (
            collate_packed_pairs(
                examples,
                pad,
                c.share_prompt,
                c.packing_row_tokens,
                prune_last_layer=c.prune_last_layer,
                fused_lm_head=c.fused_lm_head,
            )
            if c.packing
            else collate_pairs(examples, pad)
        )
        return attach_reference(batch, examples)

    def loss(self, model, batch: dict[str, torch.Tensor]) -> LossOutput:
        c = self.config
        token_lps = model_token_logprobs(model, batch)
        mask = batch["loss_mask"]
        logps = sequence_logps(token_lps, mask)
        lengths = mask.sum(-1)
        n = logps.shape[0] // 2
        chosen, rejected = logps[:n], logps[n:]
        if c.loss_type in REFERENCE_FREE_LOSSES:
            out, extra = REFERENCE_FREE_LOSSES[c.loss_type](c, token_lps, mask, chosen, rejected, lengths, n)
        else:
            ref = self.reference_logps(model, batch)
            out = dpo_loss(chosen, rejected, ref[:n], ref[n:], c.beta, c.loss_type, c.label_smoothing, lengths[:n], lengths[n:])
            extra = {}
        metrics = {**pair_metrics(out.chosen_rewards, out.rejected_rewards, chosen, rejected), **extra}
        return LossOutput(loss_sum=out.losses.sum(), count=n, metrics=metrics)


class SimPOTrainer(DPOTrainer):
    """:class:`DPOTrainer` with ``loss_type="simpo"`` defaults (reference-free)."""

    config_cls = SimPOConfig
    config: SimPOConfig


class ORPOTrainer(DPOTrainer):
    """:class:`DPOTrainer` with ``loss_type="orpo"`` (reference-free; NLL on chosen + λ·odds-ratio)."""

    config_cls = ORPOConfig
    config: ORPOConfig
