"""Per-token log-probs and entropy from logits, one chunk of rows at a time.

A full ``log_softmax`` over the vocabulary in fp32 costs ``B·T·V·4`` bytes; here only
one chunk of rows is ever upcast, and only the log-normaliser is kept:
``log p(x_t) = z[x_t] - logsumexp(z)``.

Pure tensor math, no model: running a model on a batch is
:func:`verl_core.modeling.packed_forward.model_token_logprobs`.
"""

from __future__ import annotations

import torch

CHUNK_ROWS = 2048


def _upcast(z: torch.Tensor) -> torch.Tensor:
    """fp32 for bf16 / fp16 / fp32 logits; fp64 ones stay fp64."""
    return z.to(torch.promote_types(z.dtype, torch.float32))


def selected_logprobs(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """``log softmax(logits)[..., labels]`` for logits ``[..., V]`` and labels ``[...]``."""
    flat_logits = logits.reshape(-1, logits.shape[-1])
    flat_labels = labels.reshape(-1)
    out = []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        z = _upcast(flat_logits[start : start + chunk_rows])
        y = flat_labels[start : start + chunk_rows]
        out.append(z.gather(-1, y[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1))
    return torch.cat(out).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, chunk_rows: int = CHUNK_ROWS) -> torch.Tensor:
    """``H = logsumexp(z) - Σ softmax(z)·z`` per position."""
    flat = logits.reshape(-1, logits.shape[-1])
    out = []
    for start in range(0, flat.shape[0], chunk_rows):
        z = _upcast(flat[start : start + chunk_rows])
        out.append(torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1))
    return torch.cat(out).reshape(logits.shape[:-1])


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each input token given the ones before it, aligned with ``input_ids``.

    Position ``t`` holds ``log p(x_t | x_<t)``; position 0 has no context and is 0,
    so masks over ``input_ids`` (e.g. ``loss_mask``) apply unchanged.
    """
    lp = selected_logprobs(logits[:, :-1], input_ids[:, 1:])
    return torch.nn.functional.pad(lp, (1, 0))


def scaled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, scale: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(scale · logits)[targets]`` and, with ``with_entropy``, the entropies of the
    same distributions (differentiable only with ``entropy_grad``), else None."""
    if scale != 1.0:
        logits = logits * scale
    logp = selected_logprobs(logits, targets)
    if not with_entropy:
        return logp, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logp, entropy_from_logits(logits)
