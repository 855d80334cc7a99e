"""Padding-free packing: sequences concatenated, no pad token computed.

A packed batch holds *units*; a unit is one prompt followed by one or more completions
(branches). Units are laid end to end in ``R`` rows (one row unless ``row_capacity``
bounds the row length); every token gets the position it would have in its own
sequence, and attention is block-diagonal and causal: a token sees the earlier
tokens of its own unit's prompt and of its own branch, nothing else. So

- SFT: one branch per unit, ``prompt + completion`` exactly as in the padded layout;
- pairs (DPO, reward model) and KTO with ``share_prompt=True``: ONE copy of the prompt
  and of the completions' common beginning, then the rest of chosen, then the rest of
  rejected (KTO: completion, then the KL completion). The rejected tokens take the
  positions after the shared part again and do not see the chosen ones, so each
  completion is scored exactly as in its own padded row while the shared prefix is
  computed once (prefix sharing). Completions often share their first tokens (answers
  that differ in the final number, pairs sampled from one policy): those are computed
  once and their log-probs count in both sequences (``loss_mask`` is 1 there for both).

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
batch. The forward functions that read packed batches live in :mod:`verl_core.modeling.packed_forward`.

A packed batch has no ``attention_mask`` key on purpose: code that does not know the
layout fails loudly instead of reading packed rows as padded ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Union

import torch

PACKED_KEY = "packed_index"
PRUNE_KEY = "prune_last_layer"  # 0-dim bool in a packed batch: see verl_core.modeling.forward.last_layer_only_at
FUSED_HEAD_KEY = "fused_lm_head"  # 0-dim bool in a packed batch: see verl_core.modeling.lm_head


def is_packed(batch: object) -> bool:
    return isinstance(batch, dict) and PACKED_KEY in batch


# -- collate ----------------------------------------------------------------------------------
RowCapacity = Union[int, None, str]


def collate_packed(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[Sequence[int]]],
    pad_id: int,
    share_prompt: bool = True,
    row_capacity: RowCapacity = None,
    prune_last_layer: bool = True,
    fused_lm_head: bool = True,
) -> dict[str, torch.Tensor]:
    """Pack ``len(prompts)`` units; ``completions[k][i]`` is the k-th completion of prompt ``i``.

    Logical sequence ``s = k * B + i`` is ``prompts[i] + completions[k][i]`` (the row order of
    :func:`~verl_core.data.collate_pairs`: all first completions, then all second ones).
    With ``share_prompt=True`` the completions' longest common prefix joins the shared prompt
    (its tokens stay in every sequence's ``loss_mask``); with ``False`` every logical sequence
    is its own unit (no prefix sharing).
    ``row_capacity`` (tokens) bounds a packed row: units are placed first-fit, longest first,
    and a unit longer than the capacity gets a row of its own; ``None`` packs one row;
    ``"longest"`` uses the longest unit of the batch, so no row attends over more tokens than
    the padded layout would (the best choice when attention cost grows with the row, e.g. SDPA
    with a dense mask on CPU), while short units still share rows. ``prune_last_layer`` and
    ``fused_lm_head`` are recorded in the batch for the forward functions
    (:func:`verl_core.modeling.forward.last_layer_only_at`, :func:`verl_core.modeling.lm_head.linear_logprobs`).
    """
    n_units, n_branches = len(prompts), len(completions)
    if any(len(c) != n_units for c in completions):
        raise ValueError("every completions[k] needs one entry per prompt")
    # Units as (prompt, [branch, ...], [logical sequence index per branch]).
    if share_prompt:
        units = []
        for i in range(n_units):
            branches = [list(completions[k][i]) for k in range(n_branches)]
            common = _common_prefix_length(branches)
            shared = list(prompts[i]) + branches[0][:common]
            units.append((shared, [b[common:] for b in branches], [k * n_units + i for k in range(n_branches)], len(prompts[i])))
    else:
        units = [
            (list(prompts[i]), [list(completions[k][i])], [k * n_units + i]) for k in range(n_branches) for i in range(n_units)
        ]
    batch = pack_units(units, n_units * n_branches, pad_id, row_capacity)
    batch[PRUNE_KEY] = torch.tensor(bool(prune_last_layer))
    batch[FUSED_HEAD_KEY] = torch.tensor(bool(fused_lm_head))
    return batch


Unit = tuple  # (shared ids, [completion ids per branch], [logical sequence index per branch][, prompt length])


def _common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest prefix every sequence starts with (0 for one sequence: nothing to share)."""
    if len(sequences) < 2:
        return 0
    n = 0
    for tokens in zip(*sequences):
        if any(t != tokens[0] for t in tokens[1:]):
            break
        n += 1
    return n


def pack_units(units: Sequence[Unit], n_seq: int, pad_id: int, row_capacity: RowCapacity = None) -> dict[str, torch.Tensor]:
    """The packed batch of ``units`` (see :func:`collate_packed` for ``row_capacity``); every
    logical sequence ``0..n_seq-1`` must be a branch of exactly one unit. A unit's optional fourth
    entry is its prompt's length when the shared part also holds completion tokens (those are in
    every branch's ``loss_mask``)."""
    sizes = [len(u[0]) + sum(len(b) for b in u[1]) for u in units]
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
            prompt, branches, seq_ids = units[u][:3]
            p = len(prompt)
            prompt_len = units[u][3] if len(units[u]) > 3 else p
            ids[r, at : at + p] = torch.as_tensor(prompt, dtype=torch.long)
            pos[r, at : at + p] = torch.arange(p)
            seg[r, at : at + p] = unit_no
            prompt_flat = list(range(r * width + at, r * width + at + p))
            at += p
            for k, (comp, s) in enumerate(zip(branches, seq_ids), start=1):
                c = len(comp)
                ids[r, at : at + c] = torch.as_tensor(comp, dtype=torch.long)
                pos[r, at : at + c] = torch.arange(p, p + c)
                seg[r, at : at + c] = unit_no
                branch[r, at : at + c] = k
                logical[s] = prompt_flat + list(range(r * width + at, r * width + at + c))
                loss[s] = [0] * prompt_len + [1] * (p - prompt_len + c)
                at += c
    length = max(len(x) for x in logical)
    index = torch.full((n_seq, length), -1, dtype=torch.long)
    loss_mask = torch.zeros((n_seq, length), dtype=torch.long)
    for s in range(n_seq):
        index[s, : len(logical[s])] = torch.as_tensor(logical[s], dtype=torch.long)
        loss_mask[s, : len(loss[s])] = torch.as_tensor(loss[s], dtype=torch.long)
    return {
        "input_ids": ids,
        "position_ids": pos,
        "segment_ids": seg,
        "branch_ids": branch,
        PACKED_KEY: index,
        "loss_mask": loss_mask,
    }


def _collate_fields(
    examples: list[dict], fields: tuple[str, ...], pad_id: int, share_prompt: bool, row_capacity: RowCapacity, **flags: bool
) -> dict[str, torch.Tensor]:
    """``collate_packed`` of each example's prompt with its completions named by ``fields`` (one branch
    each); ``flags``: ``prune_last_layer``, ``fused_lm_head``."""
    completions = [[e[field] for e in examples] for field in fields]
    prompts = [e["prompt_ids"] for e in examples]
    return collate_packed(prompts, completions, pad_id, share_prompt=share_prompt, row_capacity=row_capacity, **flags)


def collate_packed_sft(
    examples: list[dict], pad_id: int, row_capacity: RowCapacity = None, **flags: bool
) -> dict[str, torch.Tensor]:
    """Packed counterpart of :func:`~verl_core.data.collate_sft` (``flags``: as :func:`collate_packed`'s)."""
    return _collate_fields(examples, ("completion_ids",), pad_id, False, row_capacity, **flags)


def collate_packed_pairs(
    examples: list[dict], pad_id: int, share_prompt: bool = True, row_capacity: RowCapacity = None, **flags: bool
) -> dict[str, torch.Tensor]:
    """Packed counterpart of :func:`~verl_core.data.collate_pairs`: logical rows chosen ``0..B-1``, rejected ``B..2B-1``."""
    return _collate_fields(examples, ("chosen_ids", "rejected_ids"), pad_id, share_prompt, row_capacity, **flags)


def collate_packed_kto(
    examples: list[dict], pad_id: int, share_prompt: bool = True, row_capacity: RowCapacity = None, **flags: bool
) -> dict[str, torch.Tensor]:
    """Packed KTO batch: the target rows ``0..B-1`` (prompt + completion) plus ``labels``, and under
    ``"kl"`` a packed batch of its own with the KL rows (prompt + ``kl_completion_ids``).

    The KL rows feed only the detached reference point z0, so the trainer scores them in a separate
    forward without gradients: sharing their prompt with the target rows would keep their
    activations for a backward pass that gives them no gradient."""
    batch = _collate_fields(examples, ("completion_ids",), pad_id, share_prompt, row_capacity, **flags)
    batch["kl"] = _collate_fields(examples, ("kl_completion_ids",), pad_id, share_prompt, row_capacity, **flags)
    batch["labels"] = torch.tensor([e["label"] for e in examples], dtype=torch.bool)
    return batch


# -- bookkeeping ------------------------------------------------------------------------------
def packing_stats(batch: dict[str, torch.Tensor]) -> dict[str, int]:
    """Tokens computed by a packed batch vs. the logical tokens it stands for."""
    index = batch[PACKED_KEY]
    computed = int((batch["segment_ids"] > 0).sum())
    logical = int((index >= 0).sum())
    padded = int(index.shape[0] * index.shape[1])
    return {
        "computed_tokens": computed,
        "logical_tokens": logical,
        "padded_tokens": padded,
        "rows": int(batch["input_ids"].shape[0]),
        "row_width": int(batch["input_ids"].shape[1]),
    }
