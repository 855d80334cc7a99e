"""The fast path every trainer takes by default, and where it cannot apply, the fallback.

Defaults (each a config switch that turns it off): padding-free packing (``packing``), one copy of
each prompt for the completions that share it (``share_prompt``), the last decoder layer computed
only where the loss reads (``prune_last_layer``), log-probs without a full-vocabulary fp32 log-
softmax (always), log-probs straight from the hidden states with the LM head fused into the log-
softmax per chunk of rows (``fused_lm_head``, :mod:`verl_core.modeling.lm_head`), and the reference scored
once before training where that pays (``precompute_ref_logps="auto"``, see
:mod:`verl_core.algorithms.preference`). A model the fast path does not fit trains on the plain
path, with one log line saying what was turned off and why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from verl_core.modeling import packed_forward
from verl_core.modeling.forward import attn_implementation, fused_head_skip_reason, prune_skip_reason

log = logging.getLogger("verl_core")


def resolve_speed(
    model: torch.nn.Module,
    config: Any,
    owner: str,
    needs_score_head: bool = False,
    unsupported: str | None = None,
    fused_head_unsupported: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """``config`` with the features this model cannot use switched off, and the features in use.

    Returns ``(config, speed_features)``: ``speed_features`` maps each feature to whether it is on,
    plus ``"fallbacks"``: feature -> why it is off although asked for. ``unsupported`` is a reason
    why the trainer itself has no packed path (packing is then reported off with that reason);
    ``fused_head_unsupported`` why it cannot take log-probs from hidden states (``fused_lm_head``).
    Offline trainers fuse the head on packed batches only; online trainers on every batch.
    """
    fields = type(config).model_fields
    changes: dict[str, Any] = {}
    why: dict[str, str] = {}
    if "packing" in fields and config.packing:
        reason = unsupported or packed_forward.packing_unsupported(model, needs_score_head)
        if reason:
            changes["packing"], why["packing"] = False, reason
        elif getattr(config, "share_prompt", False) and not packed_forward.supports_shared_prompt(model):
            changes["share_prompt"] = False
            why["share_prompt"] = (
                f"{attn_implementation(model)} attention takes no mask to share a prompt between completions (packing stays on)"
            )
    if changes:
        config = config.model_copy(update=changes)
    on = bool(getattr(config, "packing", False))
    features: dict[str, Any] = {"packing": on, "chunked_logprobs": True}
    if "share_prompt" in fields:
        features["share_prompt"] = on and config.share_prompt
    if "prune_last_layer" in fields:
        skip = prune_skip_reason(model) if on and config.prune_last_layer else None
        features["prune_last_layer"] = on and config.prune_last_layer and skip is None
        if skip:
            why["prune_last_layer"] = skip
    if "fused_lm_head" in fields and config.fused_lm_head:
        online = "num_generations" in fields
        skip = fused_head_unsupported or fused_head_skip_reason(model)
        if not on and not online:
            skip = "it runs on packed batches (packing is off)"
        elif online and getattr(config, "entropy_coef", 0) > 0:
            skip = "the entropy bonus (entropy_coef > 0) needs the entropy's gradient, taken from the logits"
        features["fused_lm_head"] = skip is None
        if skip and (on or online):
            why["fused_lm_head"] = skip
    elif "fused_lm_head" in fields:
        features["fused_lm_head"] = False
    if "fused_optimizer" in fields:  # the engine turns it off under FSDP / DeepSpeed
        features["fused_optimizer"] = config.fused_optimizer
    if unsupported and "packing" not in fields:
        features["packing"], why["packing"] = False, unsupported
    for name, reason in why.items():
        log.info("%s: %s is off: %s", owner, name, reason)
    features["fallbacks"] = why
    return config, features


def describe(features: dict[str, Any]) -> str:
    """``packing=on share_prompt=on ...`` for the log line a run starts with."""
    return " ".join(f"{k}={'on' if v else 'off'}" for k, v in features.items() if k != "fallbacks")
