"""Trainable CPU parameters in the process's own memory, not in the checkpoint file's mapping.

transformers loads ``model.safetensors`` through ``mmap``, so on CPU every parameter is a view of
the file's page-cache pages, mapped copy-on-write. The first optimizer step then writes each 4 KiB
page of every trained weight once, and each write is a page fault that copies the page out of
the file: at SmolLM2-135M's size (538 MB of fp32 weights, ~131k pages) that made AdamW's first
step take 2.3-2.8 s instead of 0.15 s, measured on a 2-core Xeon host (bench/RESULTS.md).
Copying the weights once at the start costs 0.3-0.5 s there and leaves the step its normal time.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def own_parameter_memory(params: Iterable[torch.nn.Parameter]) -> int:
    """Give each trainable CPU parameter its own contiguous copy of its data (in place: the same
    ``Parameter`` objects, so tied weights stay tied and optimizers built later see them); the
    number of bytes copied. Parameters on an accelerator are left alone (moving them there already
    copied them)."""
    copied = 0
    for p in params:
        if p.requires_grad and p.device.type == "cpu":
            p.data = p.data.clone(memory_format=torch.contiguous_format)
            copied += p.numel() * p.element_size()
    return copied
