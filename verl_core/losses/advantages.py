"""Advantage estimators: turn rewards (and values) into per-token advantages.

Token tensors are [B, T] with a 0/1 ``response_mask`` of the same shape; per-sequence
tensors are [N]. Outputs are detached (advantages are targets, not part of the graph)
and are exactly 0 at masked positions. Recursions run over the *valid* tokens only, so a
mask with holes behaves as if the masked tokens were not there.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor

from verl_core.losses.masked import masked_whiten


def _zeros_like_col(x: Tensor) -> Tensor:
    return torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)


@torch.no_grad()
def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Over the valid tokens of each row, from last to first::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t                      (value-function target, "returns")

    where "next" is the next *valid* token of the same row (``V_next = A_next = 0`` after the
    last valid token). Masked positions are skipped, the carried ``V_next``/``A_next`` pass
    over them, and their outputs are 0: rewards or values at padded positions cannot leak.

    Args:
        token_rewards: [B, T] reward per token (typically the score on the last token,
            minus a KL penalty per token).
        values: [B, T] critic values V(s_t).
        response_mask: [B, T] 1 on response tokens, 0 on padding.
    Returns:
        (advantages, returns), both [B, T].
    """
    mask = response_mask.bool()
    advantages = torch.zeros_like(values)
    next_value = _zeros_like_col(values)
    next_adv = _zeros_like_col(values)
    for t in reversed(range(values.shape[1])):
        valid = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(valid, adv_t, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, adv_t, next_adv)
    returns = torch.where(mask, advantages + values, 0.0)
    return advantages, returns


def _group_ids(group_index: Tensor | Sequence[int], device: torch.device) -> tuple[Tensor, int]:
    """Map arbitrary integer group ids to 0..G-1; returns (dense ids [N], G)."""
    ids = torch.as_tensor(group_index, device=device)
    unique_ids, dense = torch.unique(ids, return_inverse=True)
    return dense, unique_ids.numel()


def _group_sums(x: Tensor, dense: Tensor, n_groups: int) -> Tensor:
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, dense, x)


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    group_index: Tensor | Sequence[int],
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """Group-relative advantages of GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    For sample i in group g (all completions of one prompt)::

        A_i = (s_i - mean_g) / (std_g + eps)     (norm_by_std=True)
        A_i =  s_i - mean_g                      (norm_by_std=False)

    ``std_g`` is the unbiased sample std (as ``torch.std``). A group of size 1 has no
    baseline to compare with, so its advantage is 0.

    Args:
        scores: [N] one scalar score per completion.
        group_index: [N] integer group id per completion (any ids, any order).
    Returns:
        [N] advantages (broadcast to tokens with :func:`broadcast_to_tokens`).
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    dense, n_groups = _group_ids(group_index, scores.device)
    count = _group_sums(torch.ones_like(scores), dense, n_groups)
    mean = _group_sums(scores, dense, n_groups) / count
    centered = scores - mean[dense]
    if not norm_by_std:
        return torch.where(count[dense] > 1, centered, 0.0)
    var = _group_sums(centered**2, dense, n_groups) / (count - 1).clamp(min=1)
    adv = centered / (var.sqrt()[dense] + eps)
    return torch.where(count[dense] > 1, adv, 0.0)


@torch.no_grad()
def rloo_advantages(scores: Tensor, group_index: Tensor | Sequence[int]) -> Tensor:
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, arXiv:2402.14740).

    For sample i in a group of k samples, the baseline is the mean of the *other* k-1::

        A_i = s_i - (sum_g - s_i) / (k - 1)

    A group of size 1 has no other sample, so its advantage is 0.

    Args:
        scores: [N] one scalar score per completion.
        group_index: [N] integer group id per completion.
    Returns:
        [N] advantages.
    """
    scores = scores.to(torch.promote_types(scores.dtype, torch.float32))
    dense, n_groups = _group_ids(group_index, scores.device)
    count = _group_sums(torch.ones_like(scores), dense, n_groups)[dense]
    total = _group_sums(scores, dense, n_groups)[dense]
    baseline = (total - scores) / (count - 1).clamp(min=1)
    return torch.where(count > 1, scores - baseline, 0.0)


def broadcast_to_tokens(adv: Tensor, response_mask: Tensor) -> Tensor:
    """Give every valid token of sequence i the sequence advantage: ``A[i, t] = adv[i] * m[i, t]``.

    [N] -> [N, T]; masked positions are 0.
    """
    expanded = adv.unsqueeze(-1).expand(response_mask.shape).to(adv.dtype)
    return torch.where(response_mask.bool(), expanded, 0.0)


@torch.no_grad()
def discounted_returns(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted return-to-go over the valid tokens of each row.

    ``G_t = r_t + gamma * G_next`` with "next" the next valid token (``G_next = 0`` after the
    last one); masked positions are skipped and set to 0. [B, T] -> [B, T].
    """
    mask = response_mask.bool()
    returns = torch.zeros_like(token_rewards)
    running = _zeros_like_col(token_rewards)
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t]
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, 0.0)
    return returns


@torch.no_grad()
def reinforce_pp_advantages(
    token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0
) -> Tensor:
    """REINFORCE++ advantages (Hu 2025, arXiv:2501.03262).

    Return-to-go per token, then whitened with the statistics of the whole batch's valid
    tokens (a global baseline and scale instead of a critic)::

        G_t = sum_{k >= t, valid} gamma^(k - t) r_k          (see discounted_returns)
        A_t = (G_t - mean(G)) / sqrt(var(G) + 1e-8)          (see masked_whiten)

    ``token_rewards`` usually holds the score on the last token minus a per-token KL penalty.
    Returns [B, T]; masked positions are 0.
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask)


# Name -> estimator. The signatures differ by family (token-level with values, token-level
# without, sequence-level with groups); the caller dispatches on the family.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor | tuple[Tensor, Tensor]]] = {
    "gae": gae_advantages,
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
