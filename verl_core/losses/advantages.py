"""Advantage estimators: turn rewards (and values) into per-token advantages.

Token tensors are [B, T] with a 0/1 ``response_mask`` of the same shape; per-sequence
tensors are [N]. Outputs are detached (advantages are targets, not part of the graph)
and are exactly 0 at masked positions. Recursions run over the *valid* tokens only, so a
mask with holes behaves as if the masked tokens were not there.

:data:`ADVANTAGE_ESTIMATORS` maps a name to an estimator with one calling convention::

    ADVANTAGE_ESTIMATORS[name](scores, group_index, *, response_mask=mask, **options) -> [B, T]

``scores`` [N] is one outcome score per completion and ``group_index`` [N] its group (prompt)
id; with ``response_mask`` [N, T] every entry returns [N, T] token advantages (0 at masked
positions). Options and input levels per entry:

========================= ========================================= ===========================================
name                      function                                  options / notes
========================= ========================================= ===========================================
``grpo``                  :func:`grpo_advantages`                   ``norm_by_std=True, eps=1e-6``; [N] if no mask
``dr_grpo``               :func:`dr_grpo_advantages`                [N] if no mask
``rloo``                  :func:`rloo_advantages`                   [N] if no mask
``reinforce_pp_baseline`` :func:`reinforce_pp_baseline_advantages`  ``eps=1e-8``; mask required (token whitening)
``reinforce_pp``          :func:`reinforce_pp_outcome_advantages`   ``dense_rewards=None, gamma=1.0``; token-level,
                                                                    ``group_index`` unused (batch baseline)
``gae``                   :func:`gae_outcome_advantages`            ``values`` (required, token-level),
                                                                    ``dense_rewards=None, gamma=1.0, lam=0.95``;
                                                                    ``group_index`` unused; advantages only
========================= ========================================= ===========================================

The token-level estimators (``reinforce_pp``, ``gae``) place each score on the last valid token
of its row (:func:`outcome_token_rewards`), plus optional per-token ``dense_rewards`` [N, T]
(e.g. ``-beta * KL``). Their token-reward functions :func:`reinforce_pp_advantages` and
:func:`gae_advantages` (which also returns the value targets) stay available for callers
that build token rewards themselves. A group of size 1 has no baseline: the group estimators
give it advantage 0 (never NaN).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def _as_float(scores: Tensor) -> Tensor:
    return scores.to(torch.promote_types(scores.dtype, torch.float32))


def _maybe_broadcast(adv: Tensor, response_mask: Tensor | None) -> Tensor:
    return adv if response_mask is None else broadcast_to_tokens(adv, response_mask)


@torch.no_grad()
def grpo_advantages(
    scores: Tensor,
    group_index: Tensor | Sequence[int],
    norm_by_std: bool = True,
    eps: float = 1e-6,
    *,
    response_mask: Tensor | None = None,
) -> Tensor:
    """Group-relative advantages of GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    For sample i in group g (all completions of one prompt)::

        A_i = (s_i - mean_g) / (std_g + eps)     (norm_by_std=True)
        A_i =  s_i - mean_g                      (norm_by_std=False)

    ``std_g`` is the unbiased sample std (as ``torch.std``). A group of size 1 has no
    baseline to compare with, so its advantage is 0.

    (verl's GRPO instead gives a singleton group mean 0 and std 1, i.e. its raw score.)

    Args:
        scores: [N] one scalar score per completion.
        group_index: [N] integer group id per completion (any ids, any order).
        response_mask: optional [N, T]; when given the result is broadcast to tokens.
    Returns:
        [N] advantages, or [N, T] with ``response_mask`` (see :func:`broadcast_to_tokens`).
    """
    scores = _as_float(scores)
    dense, n_groups = _group_ids(group_index, scores.device)
    count = _group_sums(torch.ones_like(scores), dense, n_groups)
    mean = _group_sums(scores, dense, n_groups) / count
    centered = scores - mean[dense]
    if norm_by_std:
        var = _group_sums(centered**2, dense, n_groups) / (count - 1).clamp(min=1)
        centered = centered / (var.sqrt()[dense] + eps)
    return _maybe_broadcast(torch.where(count[dense] > 1, centered, 0.0), response_mask)


@torch.no_grad()
def dr_grpo_advantages(scores: Tensor, group_index: Tensor | Sequence[int], *, response_mask: Tensor | None = None) -> Tensor:
    """Dr. GRPO advantages (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    GRPO without the std normalisation (which biases towards too easy / too hard prompts)::

        A_i = s_i - mean_g

    A group of size 1 gets 0. Same as ``grpo_advantages(..., norm_by_std=False)``; pair it with
    a length-unbiased loss aggregation (``"seq-mean-token-sum-norm"``) for the full Dr. GRPO.
    Returns [N], or [N, T] with ``response_mask``.
    """
    return grpo_advantages(scores, group_index, norm_by_std=False, response_mask=response_mask)


@torch.no_grad()
def rloo_advantages(scores: Tensor, group_index: Tensor | Sequence[int], *, response_mask: Tensor | None = None) -> Tensor:
    """REINFORCE Leave-One-Out advantages (Ahmadian et al. 2024, arXiv:2402.14740).

    For sample i in a group of k samples, the baseline is the mean of the *other* k-1::

        A_i = s_i - (sum_g - s_i) / (k - 1)

    A group of size 1 has no other sample, so its advantage is 0.

    Args:
        scores: [N] one scalar score per completion.
        group_index: [N] integer group id per completion.
        response_mask: optional [N, T]; when given the result is broadcast to tokens.
    Returns:
        [N] advantages, or [N, T] with ``response_mask``.
    """
    scores = _as_float(scores)
    dense, n_groups = _group_ids(group_index, scores.device)
    count = _group_sums(torch.ones_like(scores), dense, n_groups)[dense]
    total = _group_sums(scores, dense, n_groups)[dense]
    baseline = (total - scores) / (count - 1).clamp(min=1)
    return _maybe_broadcast(torch.where(count > 1, scores - baseline, 0.0), response_mask)


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
def reinforce_pp_advantages(token_rewards: Tensor, response_mask: Tensor, gamma: float = 1.0) -> Tensor:
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


@torch.no_grad()
def reinforce_pp_baseline_advantages(
    scores: Tensor, group_index: Tensor | Sequence[int], *, response_mask: Tensor, eps: float = 1e-8
) -> Tensor:
    """REINFORCE++-baseline advantages (Hu 2025, arXiv:2501.03262; verl's ``reinforce_plus_plus_baseline``).

    The group mean is subtracted (a per-prompt baseline, no std division), the result is given
    to every valid token, then whitened with the statistics of the batch's valid *tokens*::

        c_i    = s_i - mean_g                                   (local baseline)
        A_i,t  = (c_i - mean_tok(c)) / sqrt(var_tok(c) + eps)   (global token-level whitening)

    where ``mean_tok``/``var_tok`` (unbiased) run over the valid tokens of the sequences whose
    group has >= 2 members, so longer responses weigh more, as in verl. A group of size 1 has
    no baseline: its tokens get 0 and are left out of the statistics (verl would keep its raw
    score). Returns [N, T], 0 at masked positions.
    """
    centered = grpo_advantages(scores, group_index, norm_by_std=False)
    dense, n_groups = _group_ids(group_index, centered.device)
    in_group = (_group_sums(torch.ones_like(centered), dense, n_groups)[dense] > 1).unsqueeze(-1)
    token_mask = response_mask.bool() & in_group
    return masked_whiten(broadcast_to_tokens(centered, response_mask), token_mask, eps=eps)


def outcome_token_rewards(scores: Tensor, response_mask: Tensor, dense_rewards: Tensor | None = None) -> Tensor:
    """Token rewards of an outcome score: ``r[i, t] = s_i`` on the last valid token of row i, else 0.

    ``dense_rewards`` [N, T] (e.g. ``-beta * KL_t``) is added on the valid tokens. A row with no
    valid token gets no reward. [N] -> [N, T]; masked positions are 0.
    """
    scores = _as_float(scores)
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(mask, positions, -1).amax(dim=-1, keepdim=True)
    rewards = torch.where(mask & (positions == last), scores.unsqueeze(-1), 0.0)
    if dense_rewards is not None:
        rewards = rewards + torch.where(mask, dense_rewards, 0.0)
    return rewards


@torch.no_grad()
def reinforce_pp_outcome_advantages(
    scores: Tensor,
    group_index: Tensor | Sequence[int] | None = None,
    *,
    response_mask: Tensor,
    dense_rewards: Tensor | None = None,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++ from outcome scores (registry ``"reinforce_pp"``; ``group_index`` is unused).

    ``reinforce_pp_advantages(outcome_token_rewards(scores, response_mask, dense_rewards), response_mask, gamma)``:
    the return-to-go of the token rewards, whitened over the batch's valid tokens. Returns [N, T].
    """
    rewards = outcome_token_rewards(scores, response_mask, dense_rewards)
    return reinforce_pp_advantages(rewards, response_mask, gamma)


@torch.no_grad()
def gae_outcome_advantages(
    scores: Tensor,
    group_index: Tensor | Sequence[int] | None = None,
    *,
    response_mask: Tensor,
    values: Tensor,
    dense_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> Tensor:
    """GAE from outcome scores and critic ``values`` [N, T] (registry ``"gae"``; ``group_index`` is unused).

    The advantages of ``gae_advantages(outcome_token_rewards(scores, response_mask, dense_rewards),
    values, response_mask, gamma, lam)``; the value targets are ``where(mask, A + values, 0)``
    (or call :func:`gae_advantages` for both). Returns [N, T].
    """
    rewards = outcome_token_rewards(scores, response_mask, dense_rewards)
    return gae_advantages(rewards, values, response_mask, gamma, lam)[0]


# Name -> estimator, one calling convention (see the module docstring):
# ``fn(scores, group_index, *, response_mask=..., **options)``, [N, T] token advantages with a mask.
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_outcome_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_outcome_advantages,
}
