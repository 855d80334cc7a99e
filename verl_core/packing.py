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
time from ``segment_ids``/``branch_ids``: a ``[R, 1, C, C]`` bool mask for ``sdpa`` (and for
any implementation registered under a name starting with ``sdpa``, which must take sdpa's
mask), an additive float mask for ``eager``; ``flash_attention_*`` gets none and finds the
sequence boundaries from the restarting ``position_ids`` (prefix sharing is then not
expressible: use ``share_prompt=False``, see :func:`supports_shared_prompt`).

:func:`model_token_logprobs` is the entry point of the trainers: it runs a padded or a packed
batch. Modules depend one way: this one on :mod:`verl_core.logprobs` (tensor math) and
:mod:`verl_core.forward` (attention implementation, last-layer pruning).

A packed batch has no ``attention_mask`` key on purpose: code that does not know the
layout fails loudly instead of reading packed rows as padded ones.
"""
from __future__ import annotations

from typing import Any, Sequence, Union

import torch

from verl_core.forward import attn_implementation, last_layer_only_at
from verl_core.logprobs import entropy_from_logits, selected_logprobs, token_logprobs

PACKED_KEY = "packed_index"
PRUNE_KEY = "prune_last_layer"  # 0-dim bool in a packed batch: see verl_core.forward.last_layer_only_at


def is_packed(batch: object) -> bool:
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
    recorded in the batch for the forward functions (:func:`verl_core.forward.last_layer_only_at`).
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


LogProbs = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]  # log-probs, or (log-probs, entropies)
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


def _prune(batch: dict[str, torch.Tensor]) -> bool:
    flag = batch.get(PRUNE_KEY)
    return True if flag is None else bool(flag)


def packed_forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """``model(...)`` on a packed batch with the attention its implementation needs."""
    impl = attn_implementation(model)
    kind = _mask_kind(impl)
    if kind is None:
        if bool((batch["branch_ids"] > 1).any()):
            raise ValueError(f"a prompt-sharing packed batch needs sdpa or eager attention, the model uses {impl}; "
                             "collate with share_prompt=False")
        mask = None  # boundaries come from the restarting position_ids
    else:
        mask = packed_attention_mask(batch, torch.float32 if kind == "additive" else None)
    return model(input_ids=batch["input_ids"], attention_mask=mask, position_ids=batch["position_ids"],
                 use_cache=False, **kwargs)


def _logits_at(model: torch.nn.Module, batch: dict[str, torch.Tensor], keep: torch.Tensor, flat: torch.Tensor,
               prune: bool) -> torch.Tensor:
    """Logits ``[N, V]`` at the flat packed positions ``flat``, all of them inside ``keep`` (``[R, C]``
    bool), with the last layer and the LM head run only where ``keep`` is True."""
    with last_layer_only_at(model, keep if prune else None):
        try:
            logits = packed_forward(model, batch, logits_to_keep=keep).logits
        except TypeError:  # a model whose forward has no logits_to_keep
            logits = packed_forward(model, batch).logits
    if logits.dim() == 3:  # every position was computed
        return logits.reshape(keep.numel(), -1)[flat]
    return logits[(keep.reshape(-1).long().cumsum(0) - 1)[flat]]  # [kept, V] in flat order


def _predictions(batch: dict[str, torch.Tensor]):
    """Which logical positions need a log-prob, the flat packed position predicting each, and its target."""
    index, mask = batch[PACKED_KEY], batch["loss_mask"]
    need = mask[:, 1:].bool() & (index[:, 1:] >= 0)
    predictor = index[:, :-1][need]
    target = batch["input_ids"].reshape(-1)[index[:, 1:][need]]
    return need, predictor, target


def packed_token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                          with_entropy: bool = False) -> LogProbs:
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
    picked = _logits_at(model, batch, keep.view(rows, width), predictor, _prune(batch))
    out = torch.zeros(need.shape[0], need.shape[1] + 1, dtype=torch.float32, device=picked.device)
    out[:, 1:][need] = selected_logprobs(picked, target)
    if not with_entropy:
        return out
    ent = torch.zeros_like(out)
    ent[:, 1:][need] = entropy_from_logits(picked)
    return out, ent


def model_token_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                         with_entropy: bool = False) -> LogProbs:
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


def packed_response_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor], pad_id: int = 0,
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
    picked = _logits_at(model, packed, keep.view(-1, width), flat, prune_last_layer)
    out = picked.new_zeros(rows, r_len, picked.shape[-1])
    out[valid] = picked
    return out


# -- sequence scores (reward model) -----------------------------------------------------------
def _score_head(model: torch.nn.Module) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "score":
            return module
    raise ValueError("packing a sequence classifier needs its per-token score head, a submodule named 'score'")


def packed_sequence_scores(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
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


def packed_pair_rewards(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
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
