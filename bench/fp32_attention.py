"""SDPA computed in fp32 under CPU autocast: a bench-only attention kernel.

On CPU, PyTorch's flash-attention kernel is several times slower in bf16 than in fp32 for the
backward pass (the attention is a small part of the FLOPs but was about a third of a
bf16-autocast training step of the bench model); upcasting q/k/v for that one op is faster and
more exact. It lives here, not in ``verl_core``, because only the bench's CPU runs need it.

The kernel is registered with transformers' ``AttentionInterface`` under :data:`FP32_CPU_SDPA`;
the name starts with ``sdpa`` so that :mod:`verl_core.modeling.packed_forward` gives it sdpa's bool mask.
"""
from __future__ import annotations

from typing import Any

import torch

from verl_core.modeling.forward import attn_implementation, base_module, register_sdpa_variant

FP32_CPU_SDPA = "sdpa_fp32_cpu"


def _sdpa_fp32_cpu(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SDPA in fp32 on CPU under autocast (which would run it in bf16/fp16); the output is cast
    to the autocast dtype, as autocast's own SDPA returns it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = torch.get_autocast_dtype("cpu")
    with torch.autocast("cpu", enabled=False):  # autocast would cast SDPA's inputs back down
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


def use_fp32_cpu_attention(model: torch.nn.Module) -> bool:
    """Switch an ``sdpa`` model to SDPA computed in fp32 on CPU; returns whether it switched.

    Weights and every other op keep the autocast dtype; on GPU nothing changes. The
    implementation name is not saved with the model (``save_pretrained`` writes none).
    """
    register_sdpa_variant(FP32_CPU_SDPA, _sdpa_fp32_cpu)
    base = base_module(model)
    if attn_implementation(base) != "sdpa":
        return False
    base.set_attn_implementation(FP32_CPU_SDPA)
    return attn_implementation(base) == FP32_CPU_SDPA
