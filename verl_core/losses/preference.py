"""Preference-optimisation losses: DPO (and variants), KTO, SimPO, ORPO.

Pure functions on tensors. Every loss returns *per-example* values of shape [B]
(never reduced) so the caller decides how to sum / normalise. Reward-style
diagnostics are always detached.

Conventions: ``*_logps`` are summed sequence log-probs of the completion tokens
(see ``sequence_logps``), shape [B]. ``*_lengths`` are completion token counts,
shape [B]. ``z`` denotes the DPO log-ratio margin

    z = (log pi(y_c|x) - log ref(y_c|x)) - (log pi(y_r|x) - log ref(y_r|x)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------- sequence log-probs


def sequence_logps(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Sum of per-token log-probs over the mask: ``sum_t mask_t * logp_t``.

    ``token_logps``: [B, T]; ``mask``: [B, T], 0 at prompt and padding positions.
    Masked positions are excluded with ``torch.where`` (not multiplication), so
    garbage values there (even inf/nan) cannot leak into the result. Returns [B].
    """
    keep = mask.bool()
    return torch.where(keep, token_logps, torch.zeros_like(token_logps)).sum(dim=-1)


def sequence_mean_logps(token_logps: Tensor, mask: Tensor) -> Tensor:
    """Mean per-token log-prob over the mask: ``sum_t mask_t logp_t / max(1, sum_t mask_t)``.

    Shapes as in ``sequence_logps``; the count is clamped to >= 1 so an empty
    completion gives 0 instead of nan. Returns [B].
    """
    count = mask.bool().sum(dim=-1).clamp(min=1).to(token_logps.dtype)
    return sequence_logps(token_logps, mask) / count


def _per_token(logps: Tensor, lengths: Tensor) -> Tensor:
    """Length-normalise summed log-probs: ``logps / max(lengths, 1)``."""
    return logps / lengths.to(logps.dtype).clamp(min=1)


def _smoothed_sigmoid_loss(x: Tensor, label_smoothing: float) -> Tensor:
    """``-(1 - eps) log sigma(x) - eps log sigma(-x)``; plain ``-log sigma(x)`` at eps=0."""
    return -(1.0 - label_smoothing) * F.logsigmoid(x) - label_smoothing * F.logsigmoid(-x)


# ---------------------------------------------------------------- DPO family


class DPOOutput(NamedTuple):
    losses: Tensor  # [B], carries grad
    chosen_rewards: Tensor  # [B], beta * (pi_c - ref_c), detached
    rejected_rewards: Tensor  # [B], beta * (pi_r - ref_r), detached


def _dpo_sigmoid(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """DPO / conservative DPO: ``-(1 - eps) log sigma(beta z) - eps log sigma(-beta z)``.

    eps = 0 is DPO, Rafailov et al. 2023, "Direct Preference Optimization: Your
    Language Model is Secretly a Reward Model", arXiv:2305.18290, eq. 7.
    eps > 0 is conservative DPO (cDPO; Mitchell 2023, "A note on DPO with noisy
    preferences & relationship to IPO"): a cross-entropy against the soft target
    that the label is flipped with probability eps.
    """
    return _smoothed_sigmoid_loss(beta * z, label_smoothing)


def _dpo_robust(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """Robust DPO: ``(-(1 - eps) log sigma(beta z) + eps log sigma(-beta z)) / (1 - 2 eps)``.

    Chowdhury et al. 2024, "Provably Robust DPO: Aligning Language Models with
    Noisy Feedback", arXiv:2403.00409: an unbiased estimate of the clean DPO loss
    under label-flip rate eps. Note the ``+ eps`` sign (unlike cDPO). Needs eps < 0.5.
    """
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    pos = -(1.0 - label_smoothing) * F.logsigmoid(beta * z)
    neg = label_smoothing * F.logsigmoid(-beta * z)
    return (pos + neg) / (1.0 - 2.0 * label_smoothing)


def _dpo_hinge(z: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """SLiC hinge loss: ``relu(1 - beta z)``.

    Zhao et al. 2023, "SLiC-HF: Sequence Likelihood Calibration with Human
    Feedback", arXiv:2305.10425 (calibration loss with margin 1/beta, scaled by beta).
    """
    return torch.relu(1.0 - beta * z)


def _dpo_ipo(z_norm: Tensor, beta: float, label_smoothing: float) -> Tensor:
    """IPO: ``(z_norm - 1 / (2 beta))^2`` with length-normalised log-ratios.

    Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from
    Human Preferences", arXiv:2310.12036, eq. 17 (tau = beta).
    """
    return (z_norm - 1.0 / (2.0 * beta)) ** 2


DPO_LOSS_TYPES: dict[str, Callable[[Tensor, float, float], Tensor]] = {
    "sigmoid": _dpo_sigmoid,
    "robust": _dpo_robust,
    "hinge": _dpo_hinge,
    "ipo": _dpo_ipo,
}


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Optional[Tensor] = None,
    rejected_lengths: Optional[Tensor] = None,
) -> DPOOutput:
    """Per-example DPO-family loss on the margin ``z`` (see module docstring).

    loss_type:
      "sigmoid": ``-(1-eps) log sigma(beta z) - eps log sigma(-beta z)``; DPO
                 (arXiv:2305.18290) at eps=label_smoothing=0, cDPO for eps>0.
      "robust":  ``(-(1-eps) log sigma(beta z) + eps log sigma(-beta z)) / (1-2eps)``,
                 robust DPO (arXiv:2403.00409); eps < 0.5.
      "hinge":   ``relu(1 - beta z)``, SLiC (arXiv:2305.10425); ignores eps.
      "ipo":     ``(z_norm - 1/(2 beta))^2``, IPO (arXiv:2310.12036); ignores eps.
                 z_norm divides each of the four logps by its completion token
                 count, so ``chosen_lengths`` and ``rejected_lengths`` are required.
                 A caller who already has per-token averages may pass them as the
                 logps together with ``lengths = torch.ones(B)``.

    Rewards are ``beta * (policy - ref)`` per side (unnormalised), detached.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; valid: {sorted(DPO_LOSS_TYPES)}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    if loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type 'ipo' needs chosen_lengths and rejected_lengths")
        z = _per_token(chosen_ratio, chosen_lengths) - _per_token(rejected_ratio, rejected_lengths)
    else:
        z = chosen_ratio - rejected_ratio
    losses = DPO_LOSS_TYPES[loss_type](z, beta, label_smoothing)
    return DPOOutput(
        losses=losses,
        chosen_rewards=(beta * chosen_ratio).detach(),
        rejected_rewards=(beta * rejected_ratio).detach(),
    )


# ---------------------------------------------------------------- KTO


class KTOOutput(NamedTuple):
    losses: Tensor  # [B], carries grad
    rewards: Tensor  # [B], beta * (policy - ref), detached
    kl: Tensor  # scalar reference point z0 (after reduce_kl and clamp), detached


def mismatched_indices(batch_size: int) -> Tensor:
    """Permutation pairing prompt i with completion ``(i + 1) % B`` for KTO's KL term.

    KTO (arXiv:2402.01306, sec. 4.1) estimates the reference point
    ``z0 = KL(pi(y'|x) || ref(y'|x))`` from unrelated (x_i, y_j) pairs in the batch.
    Shifting by one guarantees j != i for every row, so needs B >= 2.
    Use as ``kl_completions = completions[mismatched_indices(B)]``.
    """
    if batch_size < 2:
        raise ValueError(f"mismatched_indices needs batch_size >= 2, got {batch_size}")
    return (torch.arange(batch_size) + 1) % batch_size


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    labels: Tensor,
    kl_policy_logps: Tensor,
    kl_ref_logps: Tensor,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    reduce_kl: Optional[Callable[[Tensor], Tensor]] = None,
) -> KTOOutput:
    """Per-example KTO loss (Ethayarajh et al. 2024, "KTO: Model Alignment as
    Prospect Theoretic Optimization", arXiv:2402.01306, eq. 8).

    r = policy_logps - ref_logps
    z0 = max(0, reduce_kl(mean(kl_policy_logps - kl_ref_logps)))   (detached)
    desirable   (labels True):  w_d * (1 - sigma(beta (r - z0)))
    undesirable (labels False): w_u * (1 - sigma(beta (z0 - r)))

    ``kl_*_logps`` are log-probs of mismatched (prompt_i, completion_j) pairs, see
    ``mismatched_indices``. ``reduce_kl`` lets a distributed caller average z0
    across processes (e.g. an all-reduce mean) before the clamp.
    """
    labels = labels.bool()
    z0 = (kl_policy_logps - kl_ref_logps).mean().detach()
    if reduce_kl is not None:
        z0 = reduce_kl(z0).detach()
    z0 = z0.clamp(min=0)
    r = policy_logps - ref_logps
    desirable = desirable_weight * (1.0 - torch.sigmoid(beta * (r - z0)))
    undesirable = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - r)))
    losses = torch.where(labels, desirable, undesirable)
    return KTOOutput(losses=losses, rewards=(beta * r).detach(), kl=z0)


# ---------------------------------------------------------------- SimPO


class SimPOOutput(NamedTuple):
    losses: Tensor  # [B], carries grad
    chosen_rewards: Tensor  # [B], beta * avg_c, detached
    rejected_rewards: Tensor  # [B], beta * avg_r, detached


def simpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> SimPOOutput:
    """Per-example SimPO loss (Meng et al. 2024, "SimPO: Simple Preference
    Optimization with a Reference-Free Reward", arXiv:2405.14734, eq. 6).

    avg = logps / length;  x = beta (avg_c - avg_r) - gamma
    loss = -(1 - eps) log sigma(x) - eps log sigma(-x)   (eps = label_smoothing, cDPO-style)
    """
    avg_c = _per_token(policy_chosen_logps, chosen_lengths)
    avg_r = _per_token(policy_rejected_logps, rejected_lengths)
    losses = _smoothed_sigmoid_loss(beta * (avg_c - avg_r) - gamma, label_smoothing)
    return SimPOOutput(losses, (beta * avg_c).detach(), (beta * avg_r).detach())


# ---------------------------------------------------------------- ORPO


class ORPOOutput(NamedTuple):
    losses: Tensor  # [B], carries grad
    chosen_rewards: Tensor  # [B], lam * avg_c, detached
    rejected_rewards: Tensor  # [B], lam * avg_r, detached
    log_odds_ratio: Tensor  # [B], log odds_c - log odds_r, detached


def _log1mexp(x: Tensor) -> Tensor:
    """Stable ``log(1 - exp(x))`` for x < 0 (Maechler 2012, "Accurately Computing
    log(1 - exp(-|a|))"). x is clamped to <= -1e-6 so that x -> 0 stays finite."""
    x = x.clamp(max=-1e-6)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    chosen_lengths: Tensor,
    rejected_lengths: Tensor,
    chosen_nll: Tensor,
    lam: float = 0.1,
) -> ORPOOutput:
    """Per-example ORPO loss (Hong et al. 2024, "ORPO: Monolithic Preference
    Optimization without Reference Model", arXiv:2403.07691, eqs. 6-7).

    avg = logps / length                          (mean per-token log-prob)
    log odds(y) = avg - log(1 - exp(avg))
    L_OR = -log sigma(log odds_c - log odds_r)
    loss = chosen_nll + lam * L_OR                (chosen_nll: mean NLL of chosen tokens, [B])
    """
    avg_c = _per_token(policy_chosen_logps, chosen_lengths)
    avg_r = _per_token(policy_rejected_logps, rejected_lengths)
    log_odds_ratio = (avg_c - _log1mexp(avg_c)) - (avg_r - _log1mexp(avg_r))
    losses = chosen_nll - lam * F.logsigmoid(log_odds_ratio)
    return ORPOOutput(
        losses=losses,
        chosen_rewards=(lam * avg_c).detach(),
        rejected_rewards=(lam * avg_r).detach(),
        log_odds_ratio=log_odds_ratio.detach(),
    )
