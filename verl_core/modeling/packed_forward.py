"""Forward passes over padding-free packed batches (the layout: :mod:`verl_core.data.packing`).

:func:`packed_token_logprobs` returns per-token log-probs in the logical (unpacked) layout, so
``sequence_logps(lp, batch["loss_mask"])`` works unchanged, and runs the LM head only where
``loss_mask`` needs a prediction. The attention mask is built at forward time from
``segment_ids``/``branch_ids``: a ``[R, 1, C, C]`` bool mask for ``sdpa``, an additive float mask
for ``eager``; ``flash_attention_*`` gets none and finds the sequence boundaries from the
restarting ``position_ids`` (prefix sharing is then not expressible, see
:func:`supports_shared_prompt`). Modules depend one way: this one on :mod:`verl_core.modeling.logprobs`
(tensor math), :mod:`verl_core.modeling.forward` (attention implementation, last-layer pruning) and
:mod:`verl_core.data.packing` (the layout and its collate functions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from verl_core.data.packing import FUSED_HEAD_KEY, PACKED_KEY, PRUNE_KEY, RowCapacity, is_packed, pack_units
from verl_core.modeling.forward import (
    attn_implementation,
    base_module,
    fused_head_skip_reason,
    last_layer_only_at,
    output_head_weight,
)
from verl_core.modeling.lm_head import linear_logprobs
from verl_core.modeling.logprobs import entropy_from_logits, scaled_logprobs, token_logprobs

LogProbs = torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # log-probs, or (log-probs, entropies)


# -- forward ----------------------------------------------------------------------------------
def _mask_kind(impl: str) -> str | None:
    """``"bool"``, ``"additive"`` or ``None`` (no mask: flash-attention) for an attention implementation."""
    if impl.startswith("flash"):
        return None
    if impl == "eager":
        return "additive"
    if impl.startswith("sdpa"):  # sdpa and custom kernels registered as sdpa_<variant> (the bench's fp32 one)
        return "bool"
    raise ValueError(f"packing supports sdpa (or sdpa_*), eager and flash_attention_* models, not {impl!r}")


def supports_shared_prompt(model: torch.nn.Module) -> bool:
    """Prefix sharing needs an explicit mask: ``sdpa`` or ``eager`` attention (not flash-attention)."""
    impl = attn_implementation(model)
    return impl == "eager" or impl.startswith("sdpa")


def packing_unsupported(model: torch.nn.Module, needs_score_head: bool = False) -> str | None:
    """Why packed batches cannot run through ``model`` (None when they can): its attention takes no
    packed mask, or (``needs_score_head``: a reward model) it has no per-token ``score`` head to read."""
    impl = attn_implementation(model)
    if not (impl == "eager" or impl.startswith(("sdpa", "flash"))):
        return f"the {impl!r} attention implementation takes no packed mask"
    if needs_score_head and not any(n.rsplit(".", 1)[-1] == "score" for n, _ in model.named_modules()):
        return "the sequence classifier has no per-token 'score' head to read"
    return None


def packed_attention_mask(batch: dict[str, torch.Tensor], additive_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``[R, 1, C, C]`` mask of a packed batch: True (or 0.0 when ``additive_dtype``) where query may see key."""
    seg, branch = batch["segment_ids"], batch["branch_ids"]
    width = seg.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=seg.device).tril()
    same_unit = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    same_branch = (branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])
    mask = (same_unit & same_branch & causal) | torch.eye(width, dtype=torch.bool, device=seg.device)  # row padding sees itself
    mask = mask[:, None]
    if additive_dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=additive_dtype, device=mask.device).masked_fill(~mask, torch.finfo(additive_dtype).min)


def _flag(batch: dict[str, torch.Tensor], key: str) -> bool:
    flag = batch.get(key)
    return True if flag is None else bool(flag)


def packed_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """``model(...)`` on a packed batch with the attention its implementation needs."""
    impl = attn_implementation(model)
    kind = _mask_kind(impl)
    if kind is None:
        if bool((batch["branch_ids"] > 1).any()):
            raise ValueError(
                f"a prompt-sharing packed batch needs sdpa or eager attention, the model uses {impl}; "
                "collate with share_prompt=False"
            )
        mask = None  # boundaries come from the restarting position_ids
    else:
        mask = packed_attention_mask(batch, torch.float32 if kind == "additive" else None)
    return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"], use_cache=False, **kwargs)


def _logprobs_at(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    keep: torch.Tensor,
    flat: torch.Tensor,
    targets: torch.Tensor,
    prune: bool,
    scale: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[N]`` of ``targets`` predicted at the flat packed positions ``flat`` (all inside
    ``keep``, ``[R, C]`` bool) under ``softmax(scale · logits)``, and their entropies (or None).

    The last layer runs only where ``keep`` is True. With ``fused``, a model :func:`fused_head_skip_reason` accepts
    gets them from its last hidden states through :func:`verl_core.modeling.lm_head.linear_logprobs` (no
    ``[N, V]`` logits tensor); any other model, or an entropy that needs a gradient, through its
    logits."""
    plain_head = fused_head_skip_reason(model) is None
    fused = fused and not entropy_grad and plain_head
    with last_layer_only_at(model, keep if prune else None):
        if plain_head:  # the head applied here, to the kept rows only (transformers < 5.20 takes no boolean logits_to_keep)
            hidden = packed_forward(model, batch, output_hidden_states=True, logits_to_keep=1).hidden_states[-1]
            picked_hidden = hidden.reshape(-1, hidden.shape[-1])[flat]
            if fused:
                out = linear_logprobs(picked_hidden, output_head_weight(model), targets, scale, with_entropy)
                return out if with_entropy else (out, None)
            logits = base_module(model).get_output_embeddings()(picked_hidden)
            return scaled_logprobs(logits, targets, scale, with_entropy, entropy_grad)
        try:
            logits = packed_forward(model, batch, logits_to_keep=keep).logits
        except (TypeError, IndexError):  # a forward without logits_to_keep, or one that takes no boolean mask for it
            logits = packed_forward(model, batch).logits
    if logits.dim() == 3:  # every position was computed
        picked = logits.reshape(keep.numel(), -1)[flat]
    else:
        picked = logits[(keep.reshape(-1).long().cumsum(0) - 1)[flat]]  # [kept, V] in flat order
    return scaled_logprobs(picked, targets, scale, with_entropy, entropy_grad)


def _predictions(batch: dict[str, torch.Tensor]):
    """Which logical positions need a log-prob, the flat packed position predicting each, and its target."""
    index, mask = batch[PACKED_KEY], batch["loss_mask"]
    need = mask[:, 1:].bool() & (index[:, 1:] >= 0)
    predictor = index[:, :-1][need]
    target = batch["input_ids"].reshape(-1)[index[:, 1:][need]]
    return need, predictor, target


def packed_token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_entropy: bool = False) -> LogProbs:
    """Per-token log-probs ``[S, T]`` in the logical layout of ``batch["loss_mask"]``.

    Like :func:`model_token_logprobs` on a padded batch: position ``t`` holds
    ``log p(x_t | x_<t)`` of the logical sequence; only positions where ``loss_mask`` is 1
    are computed (0 elsewhere, and at ``t = 0``), and the LM head runs only at the packed
    positions that predict them.
    """
    need, predictor, target = _predictions(batch)
    rows, width = batch["input_ids"].shape
    keep = torch.zeros(rows * width, dtype=torch.bool, device=predictor.device)
    keep[predictor] = True
    prune, fused = _flag(batch, PRUNE_KEY), _flag(batch, FUSED_HEAD_KEY)
    logp, entropy = _logprobs_at(model, batch, keep.view(rows, width), predictor, target, prune, 1.0, with_entropy, False, fused)
    out = torch.zeros(need.shape[0], need.shape[1] + 1, dtype=logp.dtype, device=logp.device)
    out[:, 1:][need] = logp
    if not with_entropy:
        return out
    ent = torch.zeros_like(out)
    ent[:, 1:][need] = entropy
    return out, ent


def model_token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], with_entropy: bool = False) -> LogProbs:
    """Forward ``model`` on a collated batch, padded or packed; per-token log-probs ``[S, T]``
    aligned with the batch's ``loss_mask`` (position ``t``: ``log p(x_t | x_<t)``, 0 at ``t = 0``),
    and their entropies with ``with_entropy``."""
    if is_packed(batch):
        return packed_token_logprobs(model, batch, with_entropy)
    kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    if "position_ids" in batch:
        kwargs["position_ids"] = batch["position_ids"]
    logits = model(**kwargs, use_cache=False).logits
    lp = token_logprobs(logits, batch["input_ids"])
    if not with_entropy:
        return lp
    return lp, torch.nn.functional.pad(entropy_from_logits(logits[:, :-1]), (1, 0))


def packed_response_logprobs(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    pad_id: int = 0,
    row_capacity: RowCapacity = "longest",
    prune_last_layer: bool = True,
    scale: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    fused_lm_head: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs ``[B, R]`` of the response tokens under ``softmax(scale · logits)`` (and their
    entropies ``[B, R]``, or None), with each distinct prompt computed once.

    ``batch`` is an online micro-batch (``input_ids`` = left-padded prompt + right-padded response,
    ``attention_mask``, ``response_ids``, ``response_mask``). Rows whose prompts are identical (the
    ``num_generations`` samples of one prompt in GRPO/RLOO) become ONE unit, prompt once, then every
    response as its own branch. Computed only where ``response_mask`` is 1 (zeros elsewhere, which
    every consumer masks out).
    """
    ids, attn = batch["input_ids"], batch["attention_mask"]
    resp_mask = batch["response_mask"].bool()
    rows, r_len = resp_mask.shape
    p_len = ids.shape[1] - r_len
    ids_l, prompt_keep, resp_len = ids.tolist(), attn[:, :p_len].bool().tolist(), resp_mask.sum(-1).tolist()
    groups: dict[tuple, list[int]] = {}
    for b in range(rows):
        prompt = tuple(t for t, keep in zip(ids_l[b][:p_len], prompt_keep[b]) if keep)
        groups.setdefault(prompt, []).append(b)
    units = [
        (list(prompt), [ids_l[b][p_len : p_len + resp_len[b]] for b in members], members) for prompt, members in groups.items()
    ]
    packed = pack_units(units, rows, pad_id, row_capacity)
    packed = {k: v.to(ids.device) for k, v in packed.items()}
    index = packed[PACKED_KEY]
    prompt_lens = torch.zeros(rows, dtype=torch.long, device=ids.device)
    for prompt, _branches, members in units:
        prompt_lens[members] = len(prompt)
    # response token j of row b is predicted by logical position prompt_len_b + j - 1
    cols = prompt_lens[:, None] + torch.arange(r_len, device=ids.device)[None, :] - 1
    predictor = index.gather(1, cols.clamp(max=index.shape[1] - 1))
    valid = resp_mask & (cols >= 0)
    flat = predictor[valid]
    width = packed["input_ids"].shape[1]
    keep = torch.zeros(packed["input_ids"].numel(), dtype=torch.bool, device=ids.device)
    keep[flat] = True
    targets = batch["response_ids"][valid]
    logp, entropy = _logprobs_at(
        model, packed, keep.view(-1, width), flat, targets, prune_last_layer, scale, with_entropy, entropy_grad, fused_lm_head
    )
    out = logp.new_zeros(rows, r_len)
    out[valid] = logp
    if entropy is None:
        return out, None
    ent = entropy.new_zeros(rows, r_len)
    ent[valid] = entropy
    return out, ent


# -- sequence scores (reward model) -----------------------------------------------------------
def _score_head(model: torch.nn.Module) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "score":
            return module
    raise ValueError("scoring a sequence classifier needs its per-token score head, a submodule named 'score'")


def _per_token_scores(head: torch.nn.Module, forward: Callable[[], Any]) -> torch.Tensor:
    """What ``head`` (the score head) outputs during ``forward()``: the per-token scores, taken with a
    forward hook so that the call still goes through the (wrapped) model's own forward."""
    captured: dict[str, torch.Tensor] = {}
    hook = head.register_forward_hook(lambda _m, _i, out: captured.__setitem__("scores", out))
    try:
        forward()
    finally:
        hook.remove()
    return captured["scores"]


def packed_sequence_scores(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scalar score ``[S]`` of every logical sequence, read at its last token (as the padded
    ``AutoModelForSequenceClassification`` does), from the score head's per-token output."""
    index = batch[PACKED_KEY]
    last = index.gather(1, ((index >= 0).sum(-1, keepdim=True) - 1)).squeeze(1)
    keep = torch.zeros(batch["input_ids"].numel(), dtype=torch.bool, device=last.device)
    keep[last] = True

    def forward() -> None:
        with last_layer_only_at(model, keep.view(batch["input_ids"].shape) if _flag(batch, PRUNE_KEY) else None):
            packed_forward(model, batch)

    scores = _per_token_scores(_score_head(model), forward)
    return scores.reshape(-1, scores.shape[-1])[last, 0].float()


def packed_pair_rewards(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected rewards of a :func:`~verl_core.data.packing.collate_packed_pairs` batch."""
    scores = packed_sequence_scores(model, batch)
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


def padded_sequence_scores(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Scalar score ``[B]`` of each padded row, read at its last attended token (the packed path's position).

    Not transformers' pooling: ``AutoModelForSequenceClassification`` reads the last token that is not
    ``pad_token_id``, and where pad is EOS (SmolLM2, Qwen, Llama 3 chat models) that is the token *before*
    the completion's EOS, so a model trained packed would be scored somewhere else."""
    try:
        head = _score_head(model)
    except ValueError:  # a classifier of its own making (no `score` submodule): its own pooling
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, 0].float()
    scores = _per_token_scores(head, lambda: model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False))
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    last = (positions * attention_mask.bool()).argmax(-1)  # the last 1 of each row, whichever side is padded
    return scores[torch.arange(scores.shape[0], device=scores.device), last.to(scores.device), 0].float()


def pair_rewards(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Scalar rewards of the chosen and rejected halves of a :func:`~verl_core.data.collate_pairs` batch (or a packed one)."""
    if is_packed(batch):
        return packed_pair_rewards(model, batch)
    scores = padded_sequence_scores(model, batch["input_ids"], batch["attention_mask"])
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]
