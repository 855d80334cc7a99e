"""Log-probs of chosen tokens straight from hidden states: the LM head, the log-softmax and the
gather fused per chunk of rows, so the ``[K, V]`` logits never exist whole.

For hidden states ``h`` ``[K, D]``, the head's weight ``W`` ``[V, D]``, a scale ``s`` (``1/T`` for a
sampling temperature ``T``) and targets ``y``::

    z_k = s · W h_k            log p_k = z_k[y_k] - logsumexp(z_k)
    H_k = -Σ_v p_kv log p_kv   (entropy, reported without gradient)

and, for an upstream gradient ``g_k`` on ``log p_k`` (the softmax cross-entropy derivative),
``∂/∂z_k = g_k (onehot(y_k) - softmax(z_k))``, from which ``∂/∂h`` and ``∂/∂W`` follow by the
chain rule through ``z = s · h Wᵀ``. The same computation as Liger Kernel's fused linear
cross-entropy (Hsu et al. 2024, arXiv:2410.10989), here in plain torch ops.

Why it pays on CPU as well as on GPU: a ``[1024, 32000]`` fp32 logits tensor is 131 MB, and glibc
hands every allocation above 32 MiB straight to ``mmap``, so each full-size temporary of the unfused
path (the logits, the softmax, its gradient, the gather's zero-filled gradient) pays its page faults
anew, and costs 8-10x an in-place pass over the same memory. Chunks of :data:`CHUNK_ELEMENTS` stay
under that threshold and are reused. Each chunk's softmax is kept for the backward (the same memory
the unfused path keeps for its logits). Measured at ``K = 1024, D = 256, V = 32,000``, fp32, 2
cores: forward + backward 0.48 s against 1.16 s for the model's head followed by
:func:`verl_core.modeling.logprobs.selected_logprobs`.

Pure tensor math; which models may use it is decided in :mod:`verl_core.modeling.forward`.
"""

from __future__ import annotations

import torch

# 256 rows x 32k vocabulary in fp32 = 32.8 MB: under glibc's largest mmap threshold (32 MiB),
# big enough that each matmul keeps the cores busy.
CHUNK_ELEMENTS = 256 * 32_000


def _chunk_rows(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for fp32 and narrower (bf16, fp16), fp64 for fp64."""
    return torch.promote_types(dtype, torch.float32)


def _logits(h: torch.Tensor, weight: torch.Tensor, scale: float) -> torch.Tensor:
    z = torch.mm(h, weight.t()).to(_acc_dtype(h.dtype))
    return z.mul_(scale) if scale != 1.0 else z


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, scale, with_entropy, compute_dtype):
        h, w = hidden.to(compute_dtype), weight.to(compute_dtype)
        rows = _chunk_rows(w.shape[0])
        logp = torch.empty(h.shape[0], dtype=_acc_dtype(h.dtype), device=h.device)
        entropy = torch.empty_like(logp) if with_entropy else None
        probs = []
        for s in range(0, h.shape[0], rows):
            z = _logits(h[s : s + rows], w, scale)
            log_probs = z.sub_(torch.logsumexp(z, -1, keepdim=True))
            logp[s : s + rows] = log_probs.gather(-1, targets[s : s + rows, None]).squeeze(-1)
            p = log_probs.exp()
            if entropy is not None:  # -sum p log p as one batched dot product: no [rows, V] temporary
                entropy[s : s + rows] = -torch.bmm(p[:, None, :], log_probs[:, :, None]).view(-1)
            probs.append(p)
        # the softmax chunks are intermediates (neither inputs nor outputs): kept on ctx
        ctx.probs = probs
        ctx.save_for_backward(hidden, weight, targets)
        ctx.scale, ctx.compute_dtype = scale, compute_dtype
        if entropy is None:
            return logp
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, *_grad_entropy):
        hidden, weight, targets = ctx.saved_tensors
        h, w = hidden.to(ctx.compute_dtype), weight.to(ctx.compute_dtype)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if need_h else None
        acc = _acc_dtype(h.dtype)
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        grad_logp = grad_logp.to(acc)
        s = 0
        for p in ctx.probs:
            rows = p.shape[0]
            g = grad_logp[s : s + rows]
            # d log p_y / dz = onehot(y) - softmax(z), times g, times the scale of z = scale * h W^T
            dz = (p * -g[:, None]).scatter_add_(-1, targets[s : s + rows, None], g[:, None])
            if ctx.scale != 1.0:
                dz.mul_(ctx.scale)
            if need_h:
                grad_h[s : s + rows] = dz.to(h.dtype) @ w
            if need_w:
                grad_w.addmm_(dz.t(), h[s : s + rows].to(acc))
            s += rows
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            None,
            None,
            None,
            None,
        )


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scale: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log softmax(scale · hidden @ weightᵀ)[targets]`` for ``hidden`` ``[K, D]``, ``weight``
    ``[V, D]``, ``targets`` ``[K]``: fp32 (fp64 for fp64 inputs) ``[K]``, differentiable in ``hidden`` and ``weight``; with
    ``with_entropy`` also each row's entropy ``[K]`` (no gradient). Under autocast the matmuls run in
    the autocast dtype, as the model's own head would."""
    device = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    if hidden.shape[0] == 0:
        empty = (hidden.sum(-1) + weight.sum() * 0).float()  # keeps the graph connected for DDP
        return (empty, empty.detach()) if with_entropy else empty
    with torch.autocast(device, enabled=False):
        return _LinearLogprobs.apply(hidden, weight, targets.long(), float(scale), with_entropy, compute_dtype)
