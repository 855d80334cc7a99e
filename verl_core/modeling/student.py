"""A smaller student for distillation: the teacher's first decoder layers (layer dropping).

``student_from_teacher("bundled:smollm2", num_layers=10, output_dir=...)`` writes a folder holding the
teacher's config with ``num_hidden_layers = num_layers``, its tokenizer, and its weights minus the
decoder layers ``num_layers ..``: token embeddings, layers ``0 .. num_layers-1``, the final norm and
the LM head are copied unchanged. Initialising a shallower student from the bottom layers of its
teacher is the layer-dropping initialisation of DistilBERT (Sanh et al. 2019, arXiv:1910.01108, which
takes every other layer) and of Sajjad et al. 2023 ("On the effect of dropping layers of pre-trained
transformer models", arXiv:2004.03844, top-layer dropping works best); the student starts close to the
teacher and on-policy distillation (:mod:`verl_core.algorithms.distill`) closes the rest.

The student's hidden states after each kept layer equal the teacher's; its output is the teacher's
final norm and head applied to layer ``num_layers - 1``'s output.
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import torch

from verl_core.config import ConfigError
from verl_core.modeling.loading import load_causal_lm, load_tokenizer, save_pretrained_atomic

_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_index(key: str) -> int | None:
    match = _LAYER_KEY.search(key)
    return int(match.group(1)) if match else None


def student_config(teacher_config, num_layers: int):
    """The teacher's config with ``num_hidden_layers = num_layers`` (and per-layer lists such as
    ``layer_types`` cut to the kept layers)."""
    total = int(teacher_config.num_hidden_layers)
    if not 1 <= num_layers <= total:
        raise ConfigError(f"student num_layers must be in 1..{total} (the teacher's layers), got {num_layers}")
    config = copy.deepcopy(teacher_config)
    config.num_hidden_layers = num_layers
    for name, value in vars(teacher_config).items():
        if isinstance(value, list) and len(value) == total and name.startswith("layer"):
            setattr(config, name, value[:num_layers])
    return config


def student_from_teacher(
    teacher: str | os.PathLike | torch.nn.Module,
    num_layers: int,
    output_dir: str | os.PathLike,
    tokenizer=None,
) -> Path:
    """Write a ``num_layers``-layer student initialised from ``teacher``'s first layers to
    ``output_dir`` (atomically, :func:`~verl_core.modeling.loading.save_pretrained_atomic`); return the
    folder, loadable with ``LLMPolicy.from_pretrained``.

    ``teacher`` is a model path (folder, ``.gguf``, ``bundled:<name>``; its tokenizer is copied) or a
    loaded causal LM (then pass ``tokenizer``). Raises :class:`ConfigError` for a ``num_layers``
    outside ``1..teacher layers``.
    """
    from transformers import AutoModelForCausalLM

    if isinstance(teacher, torch.nn.Module):
        model = teacher
    else:
        model = load_causal_lm(teacher, trainable=False)
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(teacher)
    config = student_config(model.config, num_layers)
    dtype = next(model.parameters()).dtype
    student = AutoModelForCausalLM.from_config(config, dtype=dtype)
    kept = {}
    for key, value in model.state_dict().items():
        index = _layer_index(key)
        if index is None or index < num_layers:
            kept[key] = value.detach().clone()
    missing, unexpected = student.load_state_dict(kept, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(config, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise ConfigError(
            f"cannot build a student from {type(model).__name__}: missing {sorted(set(missing) - tied)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]} (decoder layers must be named '...layers.<i>.')"
        )
    student.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        student.generation_config = copy.deepcopy(model.generation_config)
    return save_pretrained_atomic(student.eval(), tokenizer, output_dir)
