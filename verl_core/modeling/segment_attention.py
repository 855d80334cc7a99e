"""Attention of a packed batch computed one sequence at a time, on CPU.

A packed row holds several sequences back to back, and ``sdpa`` with the row's block-diagonal causal
mask computes every query against every key of the row, then masks: for a row of two 150-token
sequences that is four times the causal work of the two sequences, and the masked kernel is also the
slower one. Here each sequence (a run of one ``segment_id``) gets its own causal SDPA over its own
span, the plain causal kernel without a mask (what flash-attention's variable-length kernel does on
GPU). Row padding gets zeros (nothing attends to it, and no log-prob is read there). Measured on one
layer of SmolLM2-135M's shape (rows of 303 positions holding 1-3 sequences, 1 thread, forward and
backward): 119-127 ms masked, 75-85 ms per sequence.

It applies to batches without prompt sharing only (a shared prompt's completions see the prompt
and not each other: not a run of causal spans), on CPU, to models whose attention is transformers'
``sdpa``, without gradient checkpointing (a checkpointed layer is recomputed after the block,
under plain ``sdpa``, and must save what the first forward saved). Within :func:`segment_attention` the
model's attention implementation is :data:`SEGMENT_SDPA`, which falls back to ``sdpa`` whenever no spans
are passed (generation, a KV cache).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from verl_core.modeling.forward import base_module, sdpa_switched_to, switches_sdpa

SEGMENT_SDPA = "sdpa_segments"
SPANS_KEY = "packed_spans"  # the forward keyword the spans travel under, down to the attention function

Spans = list[list[tuple[int, int]]]  # per row: the [start, end) of each sequence


def segment_spans(segment_ids: torch.Tensor) -> Spans:
    """Per row of ``segment_ids`` (``[R, C]``, 0 = row padding): the ``[start, end)`` of each run of one
    nonzero id."""
    spans: Spans = []
    for row in segment_ids.cpu():
        ids, counts = torch.unique_consecutive(row, return_counts=True)
        ends = counts.cumsum(0).tolist()
        starts = [0, *ends[:-1]]
        spans.append([(s, e) for i, s, e in zip(ids.tolist(), starts, ends) if i > 0])
    return spans


def segment_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' ``sdpa`` attention, with each span of ``kwargs[SPANS_KEY]`` attended causally on
    its own (query/key/value ``[R, H(kv), C, D]`` -> output ``[R, C, H, D]``, as ``sdpa_attention_forward``
    returns it). Without spans, or with a KV cache (keys longer than queries), it is plain ``sdpa``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spans = kwargs.pop(SPANS_KEY, None)
    if spans is None or key.shape[2] != query.shape[2] or kwargs.get("output_attentions", False):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kwargs.pop("is_causal", None)
    rows, heads, width, dim = query.shape
    out = query.new_zeros(rows, width, heads, dim)
    for r, row_spans in enumerate(spans):
        for s, e in row_spans:
            part, _ = sdpa_attention_forward(
                module,
                query[r : r + 1, :, s:e],
                key[r : r + 1, :, s:e],
                value[r : r + 1, :, s:e],
                None,
                scaling=scaling,
                is_causal=True,
                **kwargs,
            )
            out[r, s:e] = part[0]
    return out, None


def applies(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> bool:
    """Whether :func:`segment_attention` computes this packed batch per sequence: a CPU ``sdpa`` model
    without gradient checkpointing, and no prompt shared by several completions."""
    param = next(model.parameters(), None)
    return (
        param is not None
        and param.device.type == "cpu"
        and switches_sdpa(model)
        and not getattr(base_module(model), "is_gradient_checkpointing", False)
        and not bool((batch["branch_ids"] > 1).any())
    )


@contextlib.contextmanager
def segment_attention(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Iterator[dict[str, Any]]:
    """Within the block the model attends per sequence of the packed ``batch`` when :func:`applies`;
    yields the keywords to pass to its forward (empty when it does not apply)."""
    if not applies(model, batch):
        yield {}
        return
    with sdpa_switched_to(model, SEGMENT_SDPA, segment_sdpa_attention):
        yield {SPANS_KEY: segment_spans(batch["segment_ids"])}
