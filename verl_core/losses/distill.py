"""Distillation losses: a student against a frozen teacher on the student's own samples.

Two losses, picked by name in :data:`DISTILL_LOSSES` (``DistillConfig.loss``):

- ``"reverse_kl"``: the per-token reverse KL on sampled tokens, ``k_t = log π_S(x_t) - log π_T(x_t)``
  with ``x_t ~ π_S`` (the k1 estimate of ``KL(π_S ‖ π_T)`` at that position), used as a per-token
  advantage ``A_t = -k_t`` (detached) in the policy-gradient loss. ``E_{x~π_S}[-k ∇ log π_S(x)]`` is
  ``-∇ KL(π_S ‖ π_T)``, so a policy-gradient step on it descends the reverse KL (Lu & Thinking Machines
  Lab 2025, "On-Policy Distillation"; discount 0: each token's advantage is its own reverse KL).
- ``"jsd"``: the generalized Jensen-Shannon divergence of GKD over the whole vocabulary (Agarwal et al.
  2024, "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes",
  arXiv:2306.13649, Eq. 2 / Section 3), in TRL's convention (``trl.GKDTrainer.generalized_jsd_loss``)::

      P_S = softmax(z_S / τ),  P_T = softmax(z_T / τ),  M = β·P_T + (1-β)·P_S
      JSD(β) = β·KL(P_T ‖ M) + (1-β)·KL(P_S ‖ M)          0 < β < 1
      JSD(0) = KL(P_T ‖ P_S)  (forward KL)              JSD(1) = KL(P_S ‖ P_T)  (reverse KL)

  The endpoints are defined as those KLs, as TRL does (the formula above tends to 0 there). The loss
  is the mean of the per-token JSD over the mask's tokens. It is computed only at masked positions,
  ``chunk_tokens`` positions at a time, each chunk under activation checkpointing when a gradient is
  needed: at no time does a ``[tokens, V]`` fp32 tensor exist for more than one chunk.

Pure tensor functions, no model; the trainer is :mod:`verl_core.algorithms.distill`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

# Positions x vocabulary of one fp32 chunk: 256 x 32k = 32.8 MB, as the fused LM head's chunks.
CHUNK_ELEMENTS = 256 * 32_000


def _chunk(tokens: int | None, vocab: int) -> int:
    return max(1, tokens if tokens is not None else CHUNK_ELEMENTS // max(vocab, 1))


def sampled_reverse_kl(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """``k_t = log π_S(x_t) - log π_T(x_t)`` on the sampled tokens ``[B, R]``, exact 0 off the mask.

    With ``x_t ~ π_S`` its expectation is ``KL(π_S ‖ π_T)`` at that position (the k1 estimator).

    >>> sampled_reverse_kl(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.5, -0.5]]), torch.tensor([[1, 0]]))
    tensor([[0.5000, 0.0000]])
    """
    diff = student_logp.float() - teacher_logp.float()
    return torch.where(mask.bool(), diff, torch.zeros((), dtype=diff.dtype, device=diff.device))


def reverse_kl_advantages(student_logp: Tensor, teacher_logp: Tensor, mask: Tensor) -> Tensor:
    """Per-token advantages ``A_t = -(log π_S(x_t) - log π_T(x_t))`` (detached, 0 off the mask): the
    Thinking Machines formulation of on-policy distillation, fed to any policy loss."""
    return -sampled_reverse_kl(student_logp, teacher_logp, mask).detach()


def _kl_terms(p_log: Tensor, q_log: Tensor) -> Tensor:
    """``KL(P ‖ Q) = Σ_v P_v (log P_v - log Q_v)`` per row, with ``0 · log 0 = 0``."""
    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros((), dtype=p.dtype, device=p.device))
    return terms.sum(-1)


def jsd_rows(student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0) -> Tensor:
    """``JSD(β)`` of each row (``[K, V]`` logits -> ``[K]``, fp32 or fp64), in the convention of the module doc."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    log_s = torch.log_softmax(student_logits.to(dtype) / temperature, -1)
    log_t = torch.log_softmax(teacher_logits.to(dtype) / temperature, -1)
    if beta == 0.0:
        return _kl_terms(log_t, log_s)
    if beta == 1.0:
        return _kl_terms(log_s, log_t)
    log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1.0 - beta)]), 0)
    return beta * _kl_terms(log_t, log_m) + (1.0 - beta) * _kl_terms(log_s, log_m)


def _chunked_rows(fn: Callable[[Tensor], Tensor], n: int, rows: int, device, grad: bool) -> Tensor:
    """``cat(fn(index chunk))`` over ``range(n)``, checkpointing each chunk when ``grad``."""
    out = []
    for s in range(0, n, rows):
        idx = torch.arange(s, min(n, s + rows), device=device)
        out.append(checkpoint(fn, idx, use_reentrant=False) if grad else fn(idx))
    return torch.cat(out) if out else torch.zeros(0, device=device)


def generalized_jsd_tokens(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """Per-token ``JSD(β)`` ``[K]`` at the ``K`` positions where ``mask`` (``[...]``) is set, for logits
    ``[..., V]``, in row-major order of the mask; ``chunk_tokens`` positions at a time (default:
    :data:`CHUNK_ELEMENTS` / V)."""
    vocab = student_logits.shape[-1]
    if teacher_logits.shape != student_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits {tuple(teacher_logits.shape)} differ")
    flat_s, flat_t = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    where = mask.reshape(-1).bool().nonzero().squeeze(-1)

    def rows(idx: Tensor) -> Tensor:
        pos = where[idx]
        return jsd_rows(flat_s.index_select(0, pos), flat_t.index_select(0, pos), beta, temperature)

    grad = torch.is_grad_enabled() and student_logits.requires_grad
    return _chunked_rows(rows, where.numel(), _chunk(chunk_tokens, vocab), student_logits.device, grad)


def generalized_jsd(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """GKD's ``JSD(β)`` (Agarwal et al. 2024, arXiv:2306.13649; TRL's convention, see the module doc):
    the token mean over ``mask`` of :func:`generalized_jsd_tokens`. 0 when the mask is empty."""
    per_token = generalized_jsd_tokens(student_logits, teacher_logits, mask, beta, temperature, chunk_tokens)
    return per_token.sum() / max(per_token.numel(), 1)


def linear_generalized_jsd_tokens(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> Tensor:
    """:func:`generalized_jsd_tokens` from final hidden states ``[K, D]`` and LM-head weights
    ``[V, D]`` (bias-free heads): the logits of one chunk of positions are computed, used and dropped
    (and recomputed in the backward), so neither model's ``[K, V]`` logits exist whole."""
    vocab = student_weight.shape[0]
    if teacher_weight.shape[0] != vocab or teacher_hidden.shape[0] != student_hidden.shape[0]:
        raise ValueError(
            f"student head {tuple(student_weight.shape)} / {student_hidden.shape[0]} positions and teacher head "
            f"{tuple(teacher_weight.shape)} / {teacher_hidden.shape[0]} positions do not match"
        )

    def rows(idx: Tensor) -> Tensor:
        z_s = student_hidden.index_select(0, idx) @ student_weight.t()
        z_t = teacher_hidden.index_select(0, idx) @ teacher_weight.t()
        return jsd_rows(z_s, z_t, beta, temperature)

    grad = torch.is_grad_enabled() and (student_hidden.requires_grad or student_weight.requires_grad)
    return _chunked_rows(rows, student_hidden.shape[0], _chunk(chunk_tokens, vocab), student_hidden.device, grad)


# Config name -> loss. reverse_kl is an advantage (the policy loss does the update), jsd a direct loss.
DISTILL_LOSSES: dict[str, Callable[..., Tensor]] = {"reverse_kl": sampled_reverse_kl, "jsd": generalized_jsd}
