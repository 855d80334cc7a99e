"""Reward-model losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bradley_terry_loss(
    chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, margin: torch.Tensor | None = None, center_coef: float = 0.0
) -> torch.Tensor:
    """Per-pair Bradley–Terry loss ``-log σ(r_c - r_r - m) + c·(r_c + r_r)²``.

    Bradley & Terry (1952); as a reward-model objective: Ouyang et al. 2022
    (arXiv:2203.02155), eq. 1. The margin ``m`` follows Llama 2 (Touvron et al. 2023,
    arXiv:2307.09288, eq. 2). The centering term ``c·(r_c + r_r)²`` keeps rewards near
    zero mean (Eisenstein et al. 2023, arXiv:2312.09244); averaged over pairs it is
    ``c·mean((r_c + r_r)²)``.
    """
    diff = chosen_rewards - rejected_rewards
    if margin is not None:
        diff = diff - margin
    loss = -F.logsigmoid(diff)
    if center_coef:
        loss = loss + center_coef * (chosen_rewards + rejected_rewards) ** 2
    return loss
