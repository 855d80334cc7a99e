"""Rollout/training mismatch: how far the sampler's log-probs are from the training model's, and the
truncated importance-sampling (TIS) weight that corrects for it.

A fast sampler (vLLM, other kernels, another precision) does not compute exactly the policy the
trainer differentiates: ``pi_rollout != pi_train`` even for the same weights, so "on-policy" samples
are slightly off-policy. Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training" (https://fengyao.notion.site/off-policy-rl), reweight each token's policy
loss by ``w_t = min(pi_train(y_t) / pi_rollout(y_t), C)`` (detached), with ``pi_train`` the
training model's old log-probs (recomputed before the update) and ``C`` a cap (2 in their runs;
verl's ``rollout_is_threshold`` default too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from verl_core.losses.masked import masked_mean

_MAX_LOG_RATIO = 20.0  # exp() of a larger log-ratio is capped anyway; keeps it finite


def tis_weights(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """``w_t = min(exp(train_logp_t - rollout_logp_t), cap)`` on the mask, 0 off it; no gradient."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0, got {cap}")
    log_ratio = (train_logp.detach() - rollout_logp.detach()).clamp(max=_MAX_LOG_RATIO)
    return torch.where(mask.bool(), log_ratio.exp().clamp(max=cap), 0.0)


def rollout_mismatch(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """How the sampler's log-probs differ from the training model's on the sampled tokens:

    - ``mismatch/logp_abs_diff_mean``: mean over tokens of ``|log pi_train - log pi_rollout|``;
    - ``mismatch/logp_abs_diff_max``: its maximum;
    - ``mismatch/kl``: ``KL(pi_rollout || pi_train)`` per token, estimated on the rollout's own samples
      with the unbiased, non-negative k3 estimator ``r - 1 - log r``, ``r = pi_train / pi_rollout``
      (Schulman 2020, http://joschu.net/blog/kl-approx.html);
    - ``mismatch/ratio_mean``: mean ``pi_train / pi_rollout`` (1 when they agree).
    """
    m = mask.bool()
    if not m.any():
        return {}
    log_ratio = (train_logp - rollout_logp).float().clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    diff = log_ratio.abs()
    ratio = log_ratio.exp()
    return {
        "mismatch/logp_abs_diff_mean": masked_mean(diff, mask).item(),
        "mismatch/logp_abs_diff_max": diff[m].max().item(),
        "mismatch/kl": masked_mean(ratio - 1 - log_ratio, mask).item(),
        "mismatch/ratio_mean": masked_mean(ratio, mask).item(),
    }


# name -> (train_logp, rollout_logp, mask, cap) -> per-token weight of the policy loss; "none": no correction
ROLLOUT_CORRECTIONS: dict[str, Callable[..., Tensor] | None] = {"none": None, "tis": tis_weights}


def correct_rollout_mismatch(exp: dict[str, Tensor], correction: str, cap: float) -> dict[str, float]:
    """Pop ``exp["rollout_logp"]`` (the sampler's log-probs, when the trainer kept them), return the mismatch
    metrics against ``exp["old_logp"]`` and, with a correction other than ``"none"``, set
    ``exp["tis_weight"]`` (the per-token weight of the policy loss)."""
    rollout_logp = exp.pop("rollout_logp", None)
    if rollout_logp is None:
        return {}
    mask = exp["response_mask"]
    metrics = rollout_mismatch(exp["old_logp"], rollout_logp, mask)
    weight_fn = ROLLOUT_CORRECTIONS[correction]
    if weight_fn is not None:
        exp["tis_weight"] = weight_fn(exp["old_logp"], rollout_logp, mask, cap)
        metrics["mismatch/tis_weight_mean"] = masked_mean(exp["tis_weight"], mask).item()
    return metrics
