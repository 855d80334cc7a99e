"""Collate token-id examples into padded tensors.

``collate_sequences`` on two examples with prompt ids ``[5, 6]`` / ``[5]`` and
completion ids ``[7, 2]`` / ``[8, 9, 2]`` (pad 0) gives::

    input_ids      [[5, 6, 7, 2], [5, 8, 9, 2]]
    attention_mask [[1, 1, 1, 1], [1, 1, 1, 1]]
    loss_mask      [[0, 0, 1, 1], [0, 1, 1, 1]]   # 1 on completion tokens only
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_to(seqs: Sequence[Sequence[int]], pad_value: int, side: str = "right", length: int | None = None) -> torch.Tensor:
    length = length or max(len(s) for s in seqs)
    out = torch.full((len(seqs), length), pad_value, dtype=torch.long)
    for i, s in enumerate(seqs):
        if side == "right":
            out[i, : len(s)] = torch.as_tensor(s, dtype=torch.long)
        else:
            out[i, length - len(s) :] = torch.as_tensor(s, dtype=torch.long)
    return out


def collate_sequences(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion sequences with a mask over completion tokens."""
    ids = [list(p) + list(c) for p, c in zip(prompts, completions)]
    loss = [[0] * len(p) + [1] * len(c) for p, c in zip(prompts, completions)]
    return {
        "input_ids": pad_to(ids, pad_id),
        "attention_mask": pad_to([[1] * len(s) for s in ids], 0),
        "loss_mask": pad_to(loss, 0),
    }


def collate_sft(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    return collate_sequences([e["prompt_ids"] for e in examples], [e["completion_ids"] for e in examples], pad_id)


def collate_pairs(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows ``0..B-1`` then rejected rows ``B..2B-1``, so one forward pass scores both."""
    prompts = [e["prompt_ids"] for e in examples]
    return collate_sequences(
        prompts + prompts, [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples], pad_id
    )
