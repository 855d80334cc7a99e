"""Padding-free packing: sequences concatenated, no pad token computed.

A packed batch holds *units*; a unit is one prompt followed by one or more completions
(branches). Units are laid end to end in ``R`` rows (one row unless ``row_capacity``
bounds the row length); every token gets the position it would have in its own
sequence, and attention is block-diagonal and causal: a token sees the earlier
tokens of its own unit's prompt and of its own branch, nothing else. So

- SFT: one branch per unit, ``prompt + completion`` exactly as in the padded layout;
- pairs (DPO, reward model) and KTO with ``share_prompt=True``: ONE copy of the prompt,
  then chosen, then rejected (KTO: completion, then the KL completion). The rejected
  tokens take positions ``len(prompt)..`` again and do not see the chosen ones, so
  each completion is scored exactly as in its own padded row while the prompt is
  computed once (prefix sharing).

Two prompts ``[5, 6]`` / ``[5]`` with completions ``[7, 2]`` / ``[8, 9, 2]``
(:func:`collate_packed_sft`, pad 0) give::

    input_ids    [[5, 6, 7, 2, 5, 8, 9, 2]]
    position_ids [[0, 1, 2, 3, 0, 1, 2, 3]]
    segment_ids  [[1, 1, 1, 1, 2, 2, 2, 2]]   # unit of each token (0: row padding)
    branch_ids   [[0, 0, 1, 1, 0, 1, 1, 1]]   # 0: prompt, k: k-th completion

and the *logical* (unpacked) view that losses read, the same shape and ``loss_mask``
as :func:`verl_core.data.collate_sequences`::

    packed_index [[0, 1, 2, 3], [4, 5, 6, 7]]  # flat packed position of each token, -1 = none
    loss_mask    [[0, 0, 1, 1], [0, 1, 1, 1]]

:func:`packed_token_logprobs` returns per-token log-probs in that logical layout (so
``sequence_logps(lp, batch["loss_mask"])`` works unchanged) and computes the LM head
only where ``loss_mask`` needs a prediction. The attention mask is built at forward
time from ``segment_ids``/``branch_ids``: a ``[R, 1, C, C]`` bool mask for ``sdpa``, an
additive float mask for ``eager``; ``flash_attention_*`` gets none and finds the
sequence boundaries from the restarting ``position_ids`` (prefix sharing is then not
expressible: use ``share_prompt=False``, see :func:`supports_shared_prompt`).

A packed batch has no ``attention_mask`` key on purpose: code that does not know the
layout fails loudly instead of reading packed rows as padded ones.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Iterator, Sequence, Union

import torch

from verl_core.logprobs import entropy_from_logits, selected_logprobs

PACKED_KEY = "packed_index"
PRUNE_KEY = "prune_last_layer"  # 0-dim bool in a packed batch: see last_layer_only_at
FP32_CPU_SDPA = "sdpa_fp32_cpu"
_MASK_IMPLS = ("sdpa", "eager", FP32_CPU_SDPA)


def is_packed(batch) -> bool:
    return isinstance(batch, dict) and PACKED_KEY in batch


# -- collate ----------------------------------------------------------------------------------
RowCapacity = Union[int, None, str]


def collate_packed(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[Sequence[int]]], pad_id: int,
                   share_prompt: bool = True, row_capacity: RowCapacity = None,
                   prune_last_layer: bool = True) -> dict[str, torch.Tensor]:
    """Pack ``len(prompts)`` units; ``completions[k][i]`` is the k-th completion of prompt ``i``.

    Logical sequence ``s = k * B + i`` is ``prompts[i] + completions[k][i]`` (the row order of
    :func:`~verl_core.data.collate_pairs`: all first completions, then all second ones).
    With ``share_prompt=False`` every logical sequence is its own unit (no prefix sharing).
    ``row_capacity`` (tokens) bounds a packed row: units are placed first-fit, longest first,
    and a unit longer than the capacity gets a row of its own; ``None`` packs one row;
    ``"longest"`` uses the longest unit of the batch, so no row attends over more tokens than
    the padded layout would (the best choice when attention cost grows with the row, e.g. SDPA
    with a dense mask on CPU), while short units still share rows. ``prune_last_layer`` is
    recorded in the batch for the forward functions (:func:`last_layer_only_at`).
    """
    n_units, n_branches = len(prompts), len(completions)
    if any(len(c) != n_units for c in completions):
        raise ValueError("every completions[k] needs one entry per prompt")
    # Units as (prompt, [branch, ...], [logical sequence index per branch]).
    if share_prompt:
        units = [(list(prompts[i]), [list(completions[k][i]) for k in range(n_branches)],
                  [k * n_units + i for k in range(n_branches)]) for i in range(n_units)]
    else:
        units = [(list(prompts[i]), [list(completions[k][i])], [k * n_units + i])
                 for k in range(n_branches) for i in range(n_units)]
    batch = pack_units(units, n_units * n_branches, pad_id, row_capacity)
    batch[PRUNE_KEY] = torch.tensor(bool(prune_last_layer))
    return batch


Unit = tuple  # (prompt ids, [completion ids per branch], [logical sequence index per branch])


def pack_units(units: Sequence[Unit], n_seq: int, pad_id: int, row_capacity: RowCapacity = None) -> dict[str, torch.Tensor]:
    """The packed batch of ``units`` (see :func:`collate_packed` for ``row_capacity``); every
    logical sequence ``0..n_seq-1`` must be a branch of exactly one unit."""
    sizes = [len(p) + sum(len(b) for b in bs) for p, bs, _ in units]
    if row_capacity == "longest":
        row_capacity = max(sizes)
    elif isinstance(row_capacity, str):
        raise ValueError(f"row_capacity must be a number of tokens, None or 'longest', not {row_capacity!r}")
    rows: list[list[int]] = []  # unit indices per row
    fill: list[int] = []
    for u in sorted(range(len(units)), key=lambda u: (-sizes[u], u)):
        for r, used in enumerate(fill):
            if row_capacity is None or used + sizes[u] <= row_capacity:
                rows[r].append(u)
                fill[r] += sizes[u]
                break
        else:
            rows.append([u])
            fill.append(sizes[u])
    width = max(fill)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), width), dtype=torch.long)
    seg = torch.zeros((len(rows), width), dtype=torch.long)
    branch = torch.zeros((len(rows), width), dtype=torch.long)
    logical: list[list[int]] = [[] for _ in range(n_seq)]
    loss: list[list[int]] = [[] for _ in range(n_seq)]
    for r, members in enumerate(rows):
        at = 0
        for unit_no, u in enumerate(sorted(members), start=1):
            prompt, branches, seq_ids = units[u]
            p = len(prompt)
            ids[r, at:at + p] = torch.as_tensor(prompt, dtype=torch.long)
            pos[r, at:at + p] = torch.arange(p)
            seg[r, at:at + p] = unit_no
            prompt_flat = list(range(r * width + at, r * width + at + p))
            at += p
            for k, (comp, s) in enumerate(zip(branches, seq_ids), start=1):
                c = len(comp)
                ids[r, at:at + c] = torch.as_tensor(comp, dtype=torch.long)
                pos[r, at:at + c] = torch.arange(p, p + c)
                seg[r, at:at + c] = unit_no
                branch[r, at:at + c] = k
                logical[s] = prompt_flat + list(range(r * width + at, r * width + at + c))
                loss[s] = [0] * p + [1] * c
                at += c
    length = max(len(x) for x in logical)
    index = torch.full((n_seq, length), -1, dtype=torch.long)
    loss_mask = torch.zeros((n_seq, length), dtype=torch.long)
    for s in range(n_seq):
        index[s, :len(logical[s])] = torch.as_tensor(logical[s], dtype=torch.long)
        loss_mask[s, :len(loss[s])] = torch.as_tensor(loss[s], dtype=torch.long)
    return {"input_ids": ids, "position_ids": pos, "segment_ids": seg, "branch_ids": branch,
            PACKED_KEY: index, "loss_mask": loss_mask}


def collate_packed_sft(examples: list[dict], pad_id: int, row_capacity: RowCapacity = None,
                       prune_last_layer: bool = True) -> dict[str, torch.Tensor]:
    """Packed counterpart of :func:`~verl_core.data.collate_sft`."""
    return collate_packed([e["prompt_ids"] for e in examples], [[e["completion_ids"] for e in examples]], pad_id,
                          share_prompt=False, row_capacity=row_capacity, prune_last_layer=prune_last_layer)


def collate_packed_pairs(examples: list[dict], pad_id: int, share_prompt: bool = True,
                         row_capacity: RowCapacity = None, prune_last_layer: bool = True) -> dict[str, torch.Tensor]:
    """Packed counterpart of :func:`~verl_core.data.collate_pairs`: logical rows chosen ``0..B-1``, rejected ``B..2B-1``."""
    return collate_packed([e["prompt_ids"] for e in examples],
                          [[e["chosen_ids"] for e in examples], [e["rejected_ids"] for e in examples]],
                          pad_id, share_prompt=share_prompt, row_capacity=row_capacity, prune_last_layer=prune_last_layer)


def collate_packed_kto(examples: list[dict], pad_id: int, share_prompt: bool = True,
                       row_capacity: RowCapacity = None, prune_last_layer: bool = True) -> dict[str, torch.Tensor]:
    """Packed KTO batch: logical rows target ``0..B-1`` (prompt + completion), KL ``B..2B-1``
    (prompt + ``kl_completion_ids``), plus ``labels``; the prompt is shared by both."""
    batch = collate_packed([e["prompt_ids"] for e in examples],
                           [[e["completion_ids"] for e in examples], [e["kl_completion_ids"] for e in examples]],
                           pad_id, share_prompt=share_prompt, row_capacity=row_capacity, prune_last_layer=prune_last_layer)
    batch["labels"] = torch.tensor([e["label"] for e in examples], dtype=torch.bool)
    return batch


# -- forward ----------------------------------------------------------------------------------
def _base_module(model):
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP / wrappers
        model = model.module
    if hasattr(model, "get_base_model"):  # peft
        model = model.get_base_model()
    return model


def attn_implementation(model) -> str:
    config = getattr(_base_module(model), "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def supports_shared_prompt(model) -> bool:
    """Prefix sharing needs an explicit mask: ``sdpa`` or ``eager`` attention (not flash-attention)."""
    return attn_implementation(model) in _MASK_IMPLS


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


# Decoder layers whose structure last_layer_only_at knows: pre-norm attention (q/k/v/o
# projections, rotary embeddings, no q/k norms) then a pre-norm MLP, each with a residual.
PRUNABLE_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")


def _last_decoder_layer(model) -> torch.nn.Module | None:
    inner = getattr(_base_module(model), "model", None)
    layers = getattr(inner, "layers", None)
    if not layers:
        return None
    layer = layers[getattr(inner.config, "num_hidden_layers", len(layers)) - 1]
    return layer if type(layer).__name__ in PRUNABLE_LAYERS else None


def can_prune_last_layer(model) -> bool:
    """Whether :func:`last_layer_only_at` can prune this model (a known decoder layer, and an
    attention that takes an explicit mask)."""
    return _last_decoder_layer(model) is not None and attn_implementation(model) in _MASK_IMPLS


@contextlib.contextmanager
def last_layer_only_at(model, keep: torch.Tensor | None) -> Iterator[bool]:
    """Inside the block, the model's LAST decoder layer computes its attention output and MLP only
    at the positions where ``keep`` (``[R, C]`` bool) is True; elsewhere it outputs zeros.

    Only the last layer can be cut: every position's hidden state in the layers below feeds the
    keys and values that kept positions attend to. Its queries, attention output, ``o_proj`` and
    MLP are needed only where a logit or score is read: in SFT / DPO / KTO batches the prompt
    tokens (all but the last) are not, in a reward-model batch only each sequence's last token
    is. Keys and values are still computed at every position. The result at kept positions is
    the full layer's (tests/test_packing.py); yields whether the model was pruned (a model
    :func:`can_prune_last_layer` rejects runs in full).
    """
    layer = _last_decoder_layer(model) if keep is not None and attn_implementation(model) in _MASK_IMPLS else None
    if layer is None:
        yield False
        return
    layer.forward = lambda hidden_states, *args, **kwargs: _pruned_layer_forward(layer, keep, hidden_states, *args, **kwargs)
    try:
        yield True
    finally:
        del layer.forward


def _pruned_layer_forward(layer, keep: torch.Tensor, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                          position_ids=None, position_embeddings=None, **kwargs) -> torch.Tensor:
    if attention_mask is None or attention_mask.dim() != 4 or position_embeddings is None:
        return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                   position_embeddings=position_embeddings, **kwargs)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attn = layer.self_attn
    impl = sys.modules[type(attn).__module__]  # the model file's own rotary and eager attention functions
    rows, width, hidden = hidden_states.shape
    keep = keep.to(hidden_states.device)
    counts = keep.sum(1)
    k_max = max(1, int(counts.max()))
    cols = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :k_max]  # kept columns first, in order
    valid = torch.arange(k_max, device=keep.device)[None, :] < counts[:, None]

    def at_kept(t: torch.Tensor) -> torch.Tensor:  # [R, C, D] -> [R, K, D]
        t = t.expand(rows, *t.shape[1:])
        return t.gather(1, cols[..., None].expand(-1, -1, t.shape[-1]))

    x = layer.input_layernorm(hidden_states)
    head_dim = attn.head_dim
    q = attn.q_proj(at_kept(x)).view(rows, k_max, -1, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(rows, width, -1, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(rows, width, -1, head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q = impl.apply_rotary_pos_emb(q, q, at_kept(cos), at_kept(sin))[0]
    k = impl.apply_rotary_pos_emb(k, k, cos, sin)[1]
    mask = attention_mask.expand(rows, -1, -1, -1)
    mask = mask.gather(2, cols[:, None, :, None].expand(-1, mask.shape[1], -1, mask.shape[-1]))
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, impl.eager_attention_forward)
    out, _ = attention(attn, q, k, v, mask, dropout=0.0 if not attn.training else attn.attention_dropout, scaling=attn.scaling)
    h = at_kept(hidden_states) + attn.o_proj(out.reshape(rows, k_max, -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    row_index = torch.arange(rows, device=keep.device)[:, None].expand(-1, k_max)
    return hidden_states.new_zeros(rows, width, hidden).index_put((row_index[valid], cols[valid]), h[valid])


def _prune(batch: dict[str, torch.Tensor]) -> bool:
    flag = batch.get(PRUNE_KEY)
    return True if flag is None else bool(flag)


def packed_forward(model, batch: dict[str, torch.Tensor], **kwargs):
    """``model(...)`` on a packed batch with the attention its implementation needs."""
    impl = attn_implementation(model)
    if impl.startswith("flash"):
        if bool((batch["branch_ids"] > 1).any()):
            raise ValueError(f"a prompt-sharing packed batch needs sdpa or eager attention, the model uses {impl}; "
                             "collate with share_prompt=False")
        mask = None  # boundaries come from the restarting position_ids
    elif impl == "eager":
        mask = packed_attention_mask(batch, torch.float32)
    elif impl in ("sdpa", FP32_CPU_SDPA):
        mask = packed_attention_mask(batch)
    else:
        raise ValueError(f"packing supports sdpa, eager and flash_attention_* models, not {impl!r}")
    return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                 use_cache=False, **kwargs)


def _predictions(batch: dict[str, torch.Tensor]):
    """Which logical positions need a log-prob, the flat packed position predicting each, and its target."""
    index, mask = batch[PACKED_KEY], batch["loss_mask"]
    need = mask[:, 1:].bool() & (index[:, 1:] >= 0)
    predictor = index[:, :-1][need]
    target = batch["input_ids"].reshape(-1)[index[:, 1:][need]]
    return need, predictor, target


def packed_token_logprobs(model, batch: dict[str, torch.Tensor], with_entropy: bool = False):
    """Per-token log-probs ``[S, T]`` in the logical layout of ``batch["loss_mask"]``.

    Like :func:`verl_core.logprobs.model_token_logprobs`: position ``t`` holds
    ``log p(x_t | x_<t)`` of the logical sequence; only positions where ``loss_mask`` is 1
    are computed (0 elsewhere, and at ``t = 0``), and the LM head runs only at the packed
    positions that predict them.
    """
    need, predictor, target = _predictions(batch)
    rows, width = batch["input_ids"].shape
    keep = torch.zeros(rows * width, dtype=torch.bool, device=predictor.device)
    keep[predictor] = True
    with last_layer_only_at(model, keep.view(rows, width) if _prune(batch) else None):
        try:
            logits = packed_forward(model, batch, logits_to_keep=keep.view(rows, width)).logits
        except TypeError:  # a model whose forward has no logits_to_keep
            logits = packed_forward(model, batch).logits
    if logits.dim() == 3:  # every position was computed
        picked = logits.reshape(rows * width, -1)[predictor]
    else:  # [kept, V] in flat order
        rank = keep.long().cumsum(0) - 1
        picked = logits[rank[predictor]]
    out = torch.zeros(need.shape[0], need.shape[1] + 1, dtype=torch.float32, device=picked.device)
    out[:, 1:][need] = selected_logprobs(picked, target)
    if not with_entropy:
        return out
    ent = torch.zeros_like(out)
    ent[:, 1:][need] = entropy_from_logits(picked)
    return out, ent


def packed_response_logits(model, batch: dict[str, torch.Tensor], pad_id: int = 0,
                           row_capacity: RowCapacity = "longest", prune_last_layer: bool = True) -> torch.Tensor:
    """:func:`verl_core.algorithms.online.lm_response_logits` with each distinct prompt computed once.

    ``batch`` is an online micro-batch (``input_ids`` = left-padded prompt + right-padded response,
    ``attention_mask``, ``response_ids``, ``response_mask``). Rows whose prompts are identical (the
    ``num_generations`` samples of one prompt in GRPO/RLOO) become ONE unit, prompt once, then every
    response as its own branch. Returns logits ``[B, R, V]`` predicting each response token, computed
    only where ``response_mask`` is 1 (zeros elsewhere, which every consumer masks out).
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
    units = [(list(prompt), [ids_l[b][p_len:p_len + resp_len[b]] for b in members], members)
             for prompt, members in groups.items()]
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
    with last_layer_only_at(model, keep.view(-1, width) if prune_last_layer else None):
        try:
            logits = packed_forward(model, packed, logits_to_keep=keep.view(-1, width)).logits
        except TypeError:
            logits = packed_forward(model, packed).logits
    if logits.dim() == 3:
        picked = logits.reshape(keep.shape[0], -1)[flat]
    else:
        picked = logits[(keep.long().cumsum(0) - 1)[flat]]
    out = picked.new_zeros(rows, r_len, picked.shape[-1])
    out[valid] = picked
    return out


# -- attention kernel -------------------------------------------------------------------------
def _sdpa_fp32_cpu(module, query, key, value, attention_mask, **kwargs):
    """SDPA in fp32 on CPU under autocast (which would run it in bf16/fp16); the output is cast
    to the autocast dtype, as autocast's own SDPA returns it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    dtype = torch.get_autocast_dtype("cpu")
    with torch.autocast("cpu", enabled=False):  # autocast would cast SDPA's inputs back down
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


def use_fp32_cpu_attention(model) -> bool:
    """Switch an ``sdpa`` model to SDPA computed in fp32 on CPU; returns whether it switched.

    On CPU, PyTorch's flash-attention kernel is several times slower in bf16 than in fp32 for
    the backward pass (the attention is a small part of the FLOPs but was about a third of a
    bf16-autocast training step of the bench model); upcasting q/k/v for that one op is faster
    and more exact. Weights and every other op keep the autocast dtype; on GPU nothing changes.
    The implementation name is not saved with the model (``save_pretrained`` writes none).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    if FP32_CPU_SDPA not in AttentionInterface._global_mapping:
        AttentionInterface.register(FP32_CPU_SDPA, _sdpa_fp32_cpu)
        ALL_MASK_ATTENTION_FUNCTIONS.register(FP32_CPU_SDPA, sdpa_mask)
    base = _base_module(model)
    if attn_implementation(base) != "sdpa":
        return False
    base.set_attn_implementation(FP32_CPU_SDPA)
    return attn_implementation(base) == FP32_CPU_SDPA


# -- sequence scores (reward model) -----------------------------------------------------------
def _score_head(model) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "score":
            return module
    raise ValueError("packing a sequence classifier needs its per-token score head, a submodule named 'score'")


def packed_sequence_scores(model, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Scalar score ``[S]`` of every logical sequence, read at its last token (as the padded
    ``AutoModelForSequenceClassification`` does). The per-token scores are taken from the score
    head with a forward hook, so the call still goes through the (wrapped) model's forward."""
    captured: dict[str, torch.Tensor] = {}
    index = batch[PACKED_KEY]
    last = index.gather(1, ((index >= 0).sum(-1, keepdim=True) - 1)).squeeze(1)
    keep = torch.zeros(batch["input_ids"].numel(), dtype=torch.bool, device=last.device)
    keep[last] = True
    hook = _score_head(model).register_forward_hook(lambda _m, _i, out: captured.__setitem__("scores", out))
    try:
        with last_layer_only_at(model, keep.view(batch["input_ids"].shape) if _prune(batch) else None):
            packed_forward(model, batch)
    finally:
        hook.remove()
    scores = captured["scores"]
    return scores.reshape(-1, scores.shape[-1])[last, 0].float()


def packed_pair_rewards(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chosen and rejected rewards of a :func:`collate_packed_pairs` batch
    (counterpart of :func:`verl_core.algorithms.reward_model.pair_rewards`)."""
    scores = packed_sequence_scores(model, batch)
    half = scores.shape[0] // 2
    return scores[:half], scores[half:]


# -- bookkeeping ------------------------------------------------------------------------------
def packing_stats(batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """Tokens computed by a packed batch vs. the logical tokens it stands for."""
    index = batch[PACKED_KEY]
    computed = int((batch["segment_ids"] > 0).sum())
    logical = int((index >= 0).sum())
    padded = int(index.shape[0] * index.shape[1])
    return {"computed_tokens": computed, "logical_tokens": logical, "padded_tokens": padded,
            "rows": int(batch["input_ids"].shape[0]), "row_width": int(batch["input_ids"].shape[1])}
