"""Statistics over the valid (mask == 1) positions of a tensor.

Every RL loss in this package works on [B, T] token tensors where only the response
tokens count. These helpers compute sums, means, variances and whitening over those
positions only. Padded positions may hold anything, even NaN or inf: they are selected
away with ``torch.where`` (never multiplied by 0, since ``0 * nan == nan``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _select(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is set, exact 0 elsewhere (NaN/inf-safe)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask == 1``.

    Formula: ``sum_i m_i * x_i`` (over ``dim``, or over everything when ``dim`` is None).
    """
    selected = _select(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | tuple[int, ...] | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask == 1``.

    Formula: ``sum_i m_i x_i / max(sum_i m_i, 1)``. An all-masked slice has mean 0
    (instead of the NaN of 0 / 0).
    """
    mask = torch.broadcast_to(mask, x.shape)
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over all positions where ``mask == 1`` (a scalar).

    Formula: ``sum_i m_i (x_i - mu)^2 / (n - 1)`` with ``mu = masked_mean(x, mask)`` and
    ``n = sum_i m_i`` (Bessel's correction, as ``torch.var``); ``unbiased=False`` divides by
    ``n``. With fewer than two valid positions the unbiased estimate is undefined, so the
    biased one is returned (0 for a single value, 0 for none) rather than NaN.
    """
    mask = torch.broadcast_to(mask, x.shape)
    mean = masked_mean(x, mask)
    sum_sq = masked_sum((x - mean) ** 2, mask)
    count = mask.bool().sum().to(x.dtype)
    denom = count - 1 if unbiased and count > 1 else count
    return sum_sq / denom.clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Standardise ``x`` with statistics from the valid positions only.

    Formula: ``(x - mu) / sqrt(var + eps)`` with ``mu``/``var`` from :func:`masked_mean` and
    :func:`masked_var` (unbiased), so the valid outputs have mean 0 and (unbiased) std ~1.
    With ``shift_mean=False`` the mean is added back: ``(x - mu) / sqrt(var + eps) + mu``
    (rescale only, as is common for advantages that should keep their sign).
    Masked positions of the output are 0.
    """
    mask = torch.broadcast_to(mask, x.shape)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return _select(whitened, mask)
