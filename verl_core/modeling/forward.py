"""How a model's forward is run: the wrapped base model, its attention implementation, and
last-layer pruning (the last decoder layer computes its output only where it is read).

Pruning uses module hooks only (no replaced ``forward``, no re-implemented layer), so a model
keeps its own attention kernel, rotary embeddings and gradient checkpointing code.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

log = logging.getLogger("verl_core")

# Decoder layers checked to do, after ``self_attn.o_proj``, only per-token work (residual adds,
# norms, a dense MLP) and to use ``o_proj``'s output only in the layer's own residual stream:
# gathering o_proj's input and the MLP's input at kept positions then changes nothing there.
# tests/test_packing.py builds each one and compares pruned and full log-probs.
PRUNABLE_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer", "GemmaDecoderLayer")
# Lowest and highest transformers major version those checks ran on (5.24). A 4.x install (the
# project's floor is 4.56) runs unpruned until tests/test_packing.py has passed on it.
TESTED_TRANSFORMERS_MAJOR = (5, 5)

_logged_reasons: set[str] = set()


def base_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP-style wrappers (``.module``) and peft (``get_base_model``)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def attn_implementation(model: torch.nn.Module) -> str:
    config = getattr(base_module(model), "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def register_sdpa_variant(name: str, attention) -> None:
    """Register ``attention`` with transformers' ``AttentionInterface`` as ``name`` (once), with ``sdpa``'s
    masks: an ``sdpa_*`` name is treated as ``sdpa`` here (packed masks, prefix sharing)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


@contextlib.contextmanager
def sdpa_switched_to(model: torch.nn.Module, name: str, attention) -> Iterator[bool]:
    """Within the block a model whose attention is transformers' ``sdpa`` attends with ``attention``
    (registered as ``name``), and with ``sdpa`` again after it; yields whether it switched (any other
    model is left as it is)."""
    base = base_module(model)
    config = getattr(base, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(base, "set_attn_implementation"):
        yield False
        return
    register_sdpa_variant(name, attention)
    base.set_attn_implementation(name)
    try:
        yield True
    finally:
        base.set_attn_implementation("sdpa")


def _last_decoder_layer(model: torch.nn.Module) -> tuple[torch.nn.Module | None, str | None]:
    """The last decoder layer, or ``None`` and why it cannot be pruned."""
    import transformers

    major = int(transformers.__version__.split(".")[0])
    low, high = TESTED_TRANSFORMERS_MAJOR
    if not low <= major <= high:
        return None, f"transformers {transformers.__version__} is outside the tested major versions {low}..{high}"
    inner = getattr(base_module(model), "model", None)
    layers = getattr(inner, "layers", None)
    if not layers:
        return None, f"{type(base_module(model)).__name__} has no model.layers"
    # num_hidden_layers, not len(layers): some models append extra (e.g. draft) layers after it
    layer = layers[getattr(inner.config, "num_hidden_layers", len(layers)) - 1]
    name = type(layer).__name__
    if name not in PRUNABLE_LAYERS:
        return None, f"{name} is not a known decoder layer (verl_core.modeling.forward.PRUNABLE_LAYERS)"
    if not isinstance(getattr(getattr(layer, "self_attn", None), "o_proj", None), torch.nn.Module) or not isinstance(
        getattr(layer, "mlp", None), torch.nn.Module
    ):
        return None, f"{name} lacks self_attn.o_proj or mlp"
    return layer, None


def can_prune_last_layer(model: torch.nn.Module) -> bool:
    """Whether :func:`last_layer_only_at` prunes this model (see :data:`PRUNABLE_LAYERS` and
    :data:`TESTED_TRANSFORMERS_MAJOR`)."""
    return _last_decoder_layer(model)[0] is not None


def prune_skip_reason(model: torch.nn.Module) -> str | None:
    """Why :func:`last_layer_only_at` runs this model's last layer in full, or None when it prunes it."""
    return _last_decoder_layer(model)[1]


def _gather_scatter_hooks(module: torch.nn.Module, keep: torch.Tensor) -> list:
    """Hooks making ``module`` ([R, C, D] -> [R, C, H]) run on the kept positions only, as one
    ``[1, K, D]`` batch, and return zeros at the others."""
    gathered: list[bool] = []  # per call: whether the pre-hook gathered, so the forward hook scatters back

    def gather(_module, args):
        x = args[0]
        gathered.append(x.shape[:-1] == keep.shape)
        # a call of another shape (none in the packed forwards) runs in full rather than failing
        return (x[keep.to(x.device)][None], *args[1:]) if gathered[-1] else None

    def scatter(_module, _args, out):
        if not gathered.pop():
            return None
        full = out.new_zeros(*keep.shape, out.shape[-1])
        full[keep.to(out.device)] = out[0]
        return full

    return [module.register_forward_pre_hook(gather), module.register_forward_hook(scatter)]


@contextlib.contextmanager
def last_layer_only_at(model: torch.nn.Module, keep: torch.Tensor | None) -> Iterator[bool]:
    """Inside the block, the model's LAST decoder layer runs ``o_proj`` and its MLP only at the
    positions where ``keep`` (``[R, C]`` bool) is True; its output there is exactly the full
    layer's, elsewhere it is meaningless (the input plus zeros).

    Only the last layer can be cut: every position's hidden state in the layers below feeds the
    keys and values that kept positions attend to. Its attention output projection and MLP are
    needed only where a logit or score is read: in SFT / DPO / KTO batches the prompt tokens (all
    but the last) are not, in a reward-model batch only each sequence's last token is. Queries,
    keys and values are still computed at every position. Yields whether the model was pruned; a
    model :func:`can_prune_last_layer` rejects runs in full, with one log line per reason.
    """
    layer, reason = _last_decoder_layer(model) if keep is not None else (None, None)
    if reason is not None and reason not in _logged_reasons:
        _logged_reasons.add(reason)
        log.info("last-layer pruning skipped (the full layer runs, results are unchanged): %s", reason)
    if layer is None:
        yield False
        return
    hooks = _gather_scatter_hooks(layer.self_attn.o_proj, keep) + _gather_scatter_hooks(layer.mlp, keep)
    # A checkpointed layer is recomputed during backward, after the hooks are gone, and the
    # recompute's shapes would then differ from the pruned forward's: this layer is not checkpointed.
    checkpointing = layer.__dict__.get("gradient_checkpointing")
    if checkpointing:
        layer.gradient_checkpointing = False
    try:
        yield True
    finally:
        for hook in hooks:
            hook.remove()
        if checkpointing:
            layer.gradient_checkpointing = checkpointing


# Causal LMs checked to compute ``logits = lm_head(out.hidden_states[-1])`` with a bias-free
# linear head and nothing after it (no soft-capping, no logit scale): their log-probs may come
# from :func:`verl_core.modeling.lm_head.linear_logprobs` on the hidden states. tests/test_lm_head.py
# builds each one and compares against the model's own logits.
FUSED_HEAD_MODELS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GemmaForCausalLM")


def fused_head_skip_reason(model: torch.nn.Module) -> str | None:
    """Why log-probs of ``model`` must come from its own logits, or None when
    :func:`output_head_weight` and the last hidden states give them exactly."""
    import transformers

    base = base_module(model)
    name = type(base).__name__
    major = int(transformers.__version__.split(".")[0])
    low, high = TESTED_TRANSFORMERS_MAJOR
    if not low <= major <= high:
        return f"transformers {transformers.__version__} is outside the tested major versions {low}..{high}"
    if name not in FUSED_HEAD_MODELS:
        return f"{name} is not a known causal LM (verl_core.modeling.forward.FUSED_HEAD_MODELS)"
    head = base.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        bias = " with a bias" if getattr(head, "bias", None) is not None else ""
        return f"its output head is {type(head).__name__}{bias}, not a plain linear layer"
    config = base.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return "its config scales or soft-caps the logits"
    return None


def output_head_weight(model: torch.nn.Module) -> torch.nn.Parameter:
    """The ``[V, D]`` weight of the LM head (shared with the input embeddings when tied)."""
    return base_module(model).get_output_embeddings().weight


def last_hidden_states(model: torch.nn.Module, **forward_kwargs) -> torch.Tensor:
    """The final (normed) hidden states ``[B, T, D]`` the LM head would read, from a forward
    through ``model`` itself (wrappers such as DDP see the call) with the head run on one
    position per row only."""
    out = model(**forward_kwargs, output_hidden_states=True, logits_to_keep=1)
    return out.hidden_states[-1]


def response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    scale: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, R]`` of ``batch["response_ids"]`` under ``softmax(scale · logits)`` and their
    entropies (or None), for a padded online batch (left-padded prompt + right-padded response);
    0 where ``response_mask`` is 0. Through :func:`verl_core.modeling.lm_head.linear_logprobs` on the hidden
    states when ``fused`` and :func:`fused_head_skip_reason` allows and no entropy gradient is needed, else
    through the model's logits at the response positions only."""
    from verl_core.modeling.lm_head import linear_logprobs
    from verl_core.modeling.logprobs import scaled_logprobs

    ids, mask = batch["response_ids"], batch["response_mask"].bool()
    r = ids.shape[1]
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    if fused and not entropy_grad and fused_head_skip_reason(model) is None:
        hidden = last_hidden_states(model, **inputs, use_cache=False)[:, -r - 1 : -1]
        out = linear_logprobs(hidden[mask], output_head_weight(model), ids[mask], scale, with_entropy)
        logp_k, ent_k = out if with_entropy else (out, None)
        logp = logp_k.new_zeros(mask.shape).masked_scatter(mask, logp_k)
        return logp, None if ent_k is None else ent_k.new_zeros(mask.shape).masked_scatter(mask, ent_k)
    logits = model(**inputs, use_cache=False, logits_to_keep=r + 1).logits[:, :-1]
    logp, entropy = scaled_logprobs(logits, ids, scale, with_entropy, entropy_grad)
    return torch.where(mask, logp, 0.0), None if entropy is None else torch.where(mask, entropy, 0.0)
