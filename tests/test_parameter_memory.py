"""Trainable weights leave the checkpoint file's copy-on-write mapping before the first optimizer step
(``verl_core.train.parameter_memory``): otherwise that step faults every page of every weight out of the
file (2.3 s instead of 0.15 s for AdamW's first step at SmolLM2-135M's size, measured on a 2-core Xeon host)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from verl_core.modeling.loading import load_causal_lm
from verl_core.train.config import TrainConfig
from verl_core.train.engine import Engine

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


def _file_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from ``path``."""
    target = str(path.resolve())
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].strip() == target:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((lo, hi))
    return ranges


def _in_file(model: torch.nn.Module, path: Path) -> list[str]:
    ranges = _file_ranges(path)
    return [n for n, p in model.named_parameters() if any(lo <= p.data_ptr() < hi for lo, hi in ranges)]


def test_engine_copies_trainable_weights_out_of_the_file_mapping(tiny_path):
    model = load_causal_lm(tiny_path)
    weights = Path(tiny_path) / "model.safetensors"
    mapped = _in_file(model, weights)
    if not mapped:
        pytest.skip("transformers did not memory-map model.safetensors here: nothing to copy out")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    Engine(model, TrainConfig(max_steps=1, batch_size=1))
    assert _in_file(model, weights) == []
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n]), n
    if tied:  # still one tensor: a step on the embedding is a step on the LM head
        assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_frozen_weights_stay_where_they_are(tiny_path):
    from verl_core.train.parameter_memory import own_parameter_memory

    model = load_causal_lm(tiny_path, trainable=False)
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert own_parameter_memory(model.parameters()) == 0
    assert [p.data_ptr() for p in model.parameters()] == ptrs
