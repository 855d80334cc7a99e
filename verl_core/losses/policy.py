"""PPO-family policy and value losses, KL penalties and KL-coefficient controllers.

All token tensors are [B, T] with a 0/1 ``response_mask``; losses are reduced to a scalar
with :func:`aggregate`. Diagnostics (clip fractions, approximate KL) are detached.

:data:`POLICY_LOSSES` maps a name to a policy loss with one calling convention::

    POLICY_LOSSES[name](old_logp, logp, advantages, response_mask, *, clip_low, clip_high, agg,
                        dual_clip=None, norm_constant=None) -> PolicyLossOutput

=========== ============================== ===================================================
name        function                       defaults (clip_low, clip_high, agg)
=========== ============================== ===================================================
``vanilla`` :func:`ppo_policy_loss`        0.2, 0.2, ``"token-mean"``  (token ratio, PPO clip)
``gspo``    :func:`gspo_policy_loss`       3e-4, 4e-4, ``"seq-mean-token-mean"`` (sequence ratio)
``cispo``   :func:`cispo_policy_loss`      None, 0.28, ``"token-mean"`` (clipped, detached IS weight)
=========== ============================== ===================================================
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from verl_core.losses.masked import masked_mean, masked_sum

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Bound on |log pi - log pi_old| before exponentiating: keeps exp() finite so that
# gradients through the unselected branch of max/min are 0, not 0 * inf = NaN.
_MAX_LOG_RATIO = 20.0


def aggregate(loss_mat: Tensor, mask: Tensor, agg: str = "token-mean", norm_constant: float | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar over the valid tokens (names as in verl's ``agg_loss``).

    With ``m`` the mask, ``n_b = sum_t m[b, t]`` and ``S`` the sequences with ``n_b > 0``:

    - ``"token-mean"``:          ``sum_{b,t} m l / sum_{b,t} m``   (every token weighs the same;
      DAPO, arXiv:2503.14476)
    - ``"seq-mean-token-sum"``:  ``mean_{b in S} sum_t m l``       (Dr. GRPO, arXiv:2503.20783,
      up to a constant)
    - ``"seq-mean-token-mean"``: ``mean_{b in S} (sum_t m l / n_b)`` (original GRPO,
      arXiv:2402.03300)
    - ``"seq-mean-token-sum-norm"``: ``mean_{b in S} (sum_t m l) / C`` with the constant
      ``C = norm_constant``, default ``T = mask.shape[-1]`` (the max response length): Dr. GRPO's
      length-unbiased constant normaliser (its "MAX_TOKENS", arXiv:2503.20783). Note that
      verl divides the *sum* over sequences by ``C``; this is that value divided by ``|S|``, so it
      is on the same scale as the other sequence means. ``norm_constant`` is ignored by other modes.

    Sequences with no valid token are left out of the sequence means.
    """
    if agg == "token-mean":
        return masked_mean(loss_mat, mask)
    if agg in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        if agg == "seq-mean-token-mean":
            per_seq = masked_mean(loss_mat, mask, dim=-1)
        else:
            per_seq = masked_sum(loss_mat, mask, dim=-1)
        if agg == "seq-mean-token-sum-norm":
            constant = mask.shape[-1] if norm_constant is None else norm_constant
            if constant <= 0:
                raise ValueError(f"norm_constant must be > 0, got {constant}")
            per_seq = per_seq / constant
        has_tokens = mask.bool().any(dim=-1)
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"unknown loss aggregation {agg!r}; expected one of {list(AGG_MODES)}")


class PolicyLossOutput(NamedTuple):
    loss: Tensor  # scalar, differentiable
    clip_fraction: Tensor  # scalar, detached
    approx_kl: Tensor  # scalar, detached


def _check_dual_clip(dual_clip: float | None) -> None:
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None), got {dual_clip}")


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor]:
    """Per-token ``max(-A rho, -A clip(rho))`` (+ dual clip) and where a clipped term is active."""
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (cap < loss_mat)
        loss_mat = torch.where(dual_active, cap, loss_mat)
        clip_active = clip_active | dual_active
    return loss_mat, clip_active


def _output(
    loss_mat: Tensor, clip_active: Tensor, log_ratio: Tensor, mask: Tensor, agg: str, norm_constant: float | None
) -> PolicyLossOutput:
    loss = aggregate(loss_mat, mask, agg, norm_constant)
    with torch.no_grad():
        clip_fraction = masked_mean(clip_active.to(loss_mat.dtype), mask)
        approx_kl = masked_mean(0.5 * log_ratio.detach() ** 2, mask)
    return PolicyLossOutput(loss, clip_fraction, approx_kl)


def _token_log_ratio(old_logp: Tensor, logp: Tensor, mask: Tensor) -> Tensor:
    """``logp - old_logp`` on valid tokens (0 elsewhere), clamped to [-20, 20]."""
    return torch.where(mask, logp - old_logp, 0.0).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def ppo_policy_loss(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    norm_constant: float | None = None,
) -> PolicyLossOutput:
    """Clipped surrogate policy loss of PPO (Schulman et al. 2017, arXiv:1707.06347). Registry: ``"vanilla"``.

    Per token, with ``rho = exp(logp - old_logp)``::

        L_t = max(-A_t * rho, -A_t * clip(rho, 1 - clip_low, 1 + clip_high))

    - Asymmetric bounds (``clip_high > clip_low``) are DAPO's "clip-higher"
      (Yu et al. 2025, arXiv:2503.14476).
    - ``dual_clip = c > 1`` adds the dual clip of Ye et al. 2020 (arXiv:1912.09729): for
      ``A_t < 0`` the loss is capped at ``-c * A_t``, i.e. ``L_t = min(L_t, -c * A_t)``, so a
      huge ratio on a bad action cannot produce an unbounded update.

    ``clip_fraction`` is the fraction of valid tokens on which a clipped term is the active one
    (so the token gets no gradient): the clipped surrogate strictly beat the unclipped one
    (``rho`` outside ``[1 - clip_low, 1 + clip_high]`` on the side that matters for the sign of
    ``A_t``), or the dual-clip cap was applied.

    ``approx_kl`` estimates KL(pi_old || pi) with the k2 estimator of Schulman (2020,
    "Approximating KL divergence"): ``mean_t 0.5 * (logp - old_logp)^2`` over valid tokens.

    The log-ratio is clamped to [-20, 20] before ``exp`` for numerical safety (inactive in any
    sane regime); masked positions never contribute to the loss or its gradient.
    ``norm_constant`` is passed to :func:`aggregate` (``"seq-mean-token-sum-norm"`` only).
    """
    _check_dual_clip(dual_clip)
    mask = response_mask.bool()
    log_ratio = _token_log_ratio(old_logp, logp, mask)
    loss_mat, clip_active = _clipped_surrogate(torch.exp(log_ratio), advantages, clip_low, clip_high, dual_clip)
    return _output(loss_mat, clip_active, log_ratio, mask, agg, norm_constant)


def gspo_policy_loss(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    agg: str = "seq-mean-token-mean",
    dual_clip: float | None = None,
    norm_constant: float | None = None,
) -> PolicyLossOutput:
    """Group Sequence Policy Optimization loss (Zheng et al. 2025, arXiv:2507.18071). Registry: ``"gspo"``.

    The importance ratio is per *sequence*: the length-normalised likelihood ratio over the
    valid tokens of row ``i``::

        s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|) = exp(mean_{t valid} (logp_t - old_logp_t))

    It enters the loss in the paper's token-level form (GSPO-token), with ``sg`` = stop-gradient::

        s_{i,t} = sg(s_i) * exp(logp_t - sg(logp_t))        (value s_i, d s_{i,t} = s_i d logp_t)
        L_t     = max(-A_t * s_{i,t}, -A_t * clip(s_{i,t}, 1 - clip_low, 1 + clip_high))

    With one advantage per sequence and ``agg="seq-mean-token-mean"`` (the default, as in the
    paper's ``1/G sum_i 1/|y_i| sum_t``) this has exactly the value and gradient of the sequence
    objective ``mean_i max(-A_i s_i, -A_i clip(s_i))``; token-level advantages are allowed too.
    Clip ranges are on the sequence ratio, hence tiny (the paper uses 3e-4 / 4e-4, the defaults).
    ``dual_clip`` (not in the paper) caps ``L_t`` at ``-c A_t`` for ``A_t < 0`` as in
    :func:`ppo_policy_loss`.

    ``clip_fraction``: fraction of valid tokens whose clipped term is active (all tokens of a
    sequence share its ratio, so this is a token-weighted fraction of clipped sequences).
    ``approx_kl``: the token-level k2 estimate, as in :func:`ppo_policy_loss`.
    ``log s_i`` is clamped to [-20, 20] before ``exp``; masked positions never contribute.
    """
    _check_dual_clip(dual_clip)
    mask = response_mask.bool()
    log_ratio = _token_log_ratio(old_logp, logp, mask)
    seq_log_ratio = masked_mean(log_ratio, mask, dim=-1).detach()  # log s_i, [B]
    valid_logp = torch.where(mask, logp, 0.0)
    # value log s_i, gradient d logp_t (the sg term is added last to keep its precision)
    token_log_ratio = (valid_logp - valid_logp.detach()) + seq_log_ratio.unsqueeze(-1)
    ratio = torch.exp(token_log_ratio)
    loss_mat, clip_active = _clipped_surrogate(ratio, advantages, clip_low, clip_high, dual_clip)
    return _output(loss_mat, clip_active, log_ratio, mask, agg, norm_constant)


def cispo_policy_loss(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float | None = None,
    clip_high: float | None = 0.28,
    agg: str = "token-mean",
    dual_clip: float | None = None,
    norm_constant: float | None = None,
) -> PolicyLossOutput:
    """Clipped IS-weight Policy Optimization (MiniMax-M1, arXiv:2506.13585, eqs. 4-5). Registry: ``"cispo"``.

    Per token, with ``rho_t = exp(logp_t - old_logp_t)`` and ``sg`` = stop-gradient::

        w_t = clip(rho_t, 1 - clip_low, 1 + clip_high)       (the clipped IS weight r-hat)
        L_t = -sg(w_t) * A_t * logp_t                         (gradient: -w_t * A_t * d logp_t)

    Unlike PPO no token is dropped: a clipped token keeps a gradient, with a bounded weight.
    Bounds: the paper defines both ``epsilon_low^IS`` and ``epsilon_high^IS`` but in its
    experiments sets ``epsilon_low`` large (no lower bound) and tunes only ``epsilon_high``.
    Here ``clip_low=None`` (the default) applies no lower bound (``w_t = min(rho_t, 1 + clip_high)``);
    a float applies ``1 - clip_low``. ``clip_high=None`` drops the upper bound too. The default
    ``clip_high=0.28`` is a common setting (DAPO's clip-higher), not a value from the paper.
    ``agg`` defaults to ``"token-mean"``, the paper's ``1 / sum_i |o_i|`` normalisation.

    The loss *value* is a surrogate (it depends on the magnitude of ``logp``); its gradient is
    the CISPO policy gradient. ``dual_clip`` is not defined for CISPO (the weight is already
    bounded) and must be None. ``clip_fraction``: fraction of valid tokens whose weight was
    clipped (``rho_t`` outside the bounds). ``approx_kl``: token-level k2, as in :func:`ppo_policy_loss`.
    """
    if dual_clip is not None:
        raise ValueError("cispo has no dual clip (its IS weight is already bounded); pass dual_clip=None")
    mask = response_mask.bool()
    log_ratio = _token_log_ratio(old_logp, logp, mask)
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        lower = None if clip_low is None else 1.0 - clip_low
        upper = None if clip_high is None else 1.0 + clip_high
        weight = ratio.clamp(min=lower, max=upper) if lower is not None or upper is not None else ratio
        clip_active = weight != ratio
    loss_mat = -weight * advantages * torch.where(mask, logp, 0.0)
    return _output(loss_mat, clip_active, log_ratio, mask, agg, norm_constant)


class ValueLossOutput(NamedTuple):
    loss: Tensor  # scalar, differentiable
    clip_fraction: Tensor  # scalar, detached


def ppo_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    clip_range: float | None = 0.2,
    agg: str = "token-mean",
    norm_constant: float | None = None,
) -> ValueLossOutput:
    """Clipped value loss of PPO (as in the PPO2 baselines code, Schulman et al. 2017).

    Per token, with ``V_clip = V_old + clip(V - V_old, -eps, +eps)``::

        L_t = 0.5 * max((V - R)^2, (V_clip - R)^2)

    ``clip_range=None`` gives the plain ``0.5 * (V - R)^2``. ``clip_fraction`` is the fraction
    of valid tokens on which the clipped term was strictly larger (the active one).
    ``norm_constant`` is passed to :func:`aggregate` (``"seq-mean-token-sum-norm"`` only).
    """
    mask = response_mask.bool()
    loss_unclipped = (values - returns) ** 2
    if clip_range is None:
        loss_mat = 0.5 * loss_unclipped
        clip_active = torch.zeros_like(mask)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
        loss_clipped = (values_clipped - returns) ** 2
        loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
        clip_active = loss_clipped > loss_unclipped
    loss = aggregate(loss_mat, mask, agg, norm_constant)
    with torch.no_grad():
        clip_fraction = masked_mean(clip_active.to(loss_mat.dtype), mask)
    return ValueLossOutput(loss, clip_fraction)


KL_KINDS = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "k1") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of tokens sampled from pi.

    Estimators from Schulman (2020), "Approximating KL divergence"
    (http://joschu.net/blog/kl-approx.html), with ``d = logp - ref_logp``:

    - ``"k1"``: ``d`` (unbiased, high variance, can be negative)
    - ``"abs"``: ``|d|``
    - ``"k2"`` / ``"mse"``: ``0.5 * d^2`` (biased, low variance, >= 0)
    - ``"k3"`` / ``"low_var_kl"``: ``exp(-d) - (-d) - 1`` (unbiased, >= 0, low variance).
      As is common practice, ``-d`` is clamped to [-20, 20] before ``exp`` and the result is
      clamped to [-10, 10], so one extreme token cannot dominate (or overflow) the penalty.

    Returns a [B, T] tensor (no masking; aggregate it with the response mask).
    """
    diff = logp - ref_logp
    if kind == "k1":
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff**2
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-diff).clamp(-20.0, 20.0)  # log(pi_ref / pi)
        return (torch.exp(log_ratio) - log_ratio - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl penalty kind {kind!r}; expected one of {list(KL_KINDS)}")


def kl_summary(kl: Tensor, response_mask: Tensor) -> dict[str, float]:
    """``kl``: the per-sequence sum of the token KL estimates, averaged over sequences;
    ``kl/token_mean``: their mean over valid tokens."""
    return {"kl": kl.sum(-1).mean().item(), "kl/token_mean": masked_mean(kl, response_mask).item()}


class _Checkpointable:
    """The coefficient as a checkpointable state (``Engine.register_state``: saved as JSON with each checkpoint)."""

    value: float

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(_Checkpointable):
    """Adaptive KL coefficient (Ziegler et al. 2019, arXiv:1909.08593, eq. 2).

    After a step that observed mean KL ``current_kl`` over ``n_steps`` samples::

        e     = clip((current_kl - target) / target, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    so beta grows when KL exceeds the target and shrinks when below it.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target and horizon must be > 0, got {target=}, {horizon=}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max((float(current_kl) - self.target) / self.target, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


class FixedKLController(_Checkpointable):
    """Constant KL coefficient with the same interface as :class:`AdaptiveKLController`."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


# Policy losses by name, one calling convention (see the module docstring):
# ``fn(old_logp, logp, advantages, response_mask, *, clip_low, clip_high, agg, dual_clip=None, norm_constant=None)``
# ``-> PolicyLossOutput``. Each keyword has a per-loss default; pass them by keyword.
POLICY_LOSSES: dict[str, Callable[..., PolicyLossOutput]] = {
    "vanilla": ppo_policy_loss,
    "gspo": gspo_policy_loss,
    "cispo": cispo_policy_loss,
}
