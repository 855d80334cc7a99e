"""The rollout contract: batched sampling of completions from a policy, with the masks and log-probs RL needs.

One :class:`RolloutBatch` holds ``N = len(prompts) * n`` samples laid out so that a training
forward pass can take them as they are::

    prompt_ids    [N, P]  left-padded (pad id), prompt_mask 1 on real prompt tokens
    response_ids  [N, R]  right-padded (pad id)
    response_mask [N, R]  1 on every generated token up to and including EOS, 0 after
    logprobs      [N, R]  log-prob of each sampled token (0 where response_mask is 0)
    group_index   [N]     index of the prompt each sample answers (samples of one prompt are adjacent)
    response_attention_mask [N, R] or None: 1 on every real response token (None: = response_mask)

A multi-turn episode (:mod:`verl_core.agents`) puts its whole continuation after the prompt in
``response_ids``: the policy's turns and the tool results between them. ``response_attention_mask``
covers all of it (the context every token sees), ``response_mask`` only the tokens the policy
sampled, the one mask that carries loss, log-probs, rewards and advantages. A single-turn batch
leaves it None, so its layout is unchanged.

``torch.cat([prompt_ids, response_ids], 1)`` with ``position_ids = cumsum(mask) - 1`` is the
exact sequence the sampler saw, so a fresh forward pass reproduces ``logprobs``.

Which log-probs: ``logprobs[i, t] = log softmax(z_t / T)[y_t]``, the log-probability of the
sampled token under the policy *at the sampling temperature* ``T``, before the top-k / top-p
truncation (the truncation is a sampler heuristic, not part of the policy being optimised).
With ``T = 1`` this is the model's own log-prob; greedy decoding (``temperature=0``) reports
the ``T = 1`` log-probs.

The HF backend (:mod:`verl_core.rollout.hf_backend`) is a hand-written KV-cache loop rather than
``model.generate`` so that the random stream (one ``torch.Generator``), the stopping rule and the
log-probs are exact and under our control. A vLLM or SGLang backend implements :class:`RolloutBackend`
instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol, runtime_checkable

import torch
from pydantic import Field

from verl_core.config import StrictConfig


class SamplingParams(StrictConfig):
    """How to sample completions."""

    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, ge=0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 means no top-k filter")
    n: int = Field(1, ge=1, description="samples per prompt")
    batch_size: int = Field(256, ge=1, description="sequences decoded together (bounds memory)")


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    logprobs: torch.Tensor
    group_index: torch.Tensor
    finished: torch.Tensor  # [N] bool: the response ended with EOS (was not cut by max_new_tokens)
    response_attention_mask: torch.Tensor | None = None  # [N, R]: real tokens (policy + tool); None = response_mask

    @property
    def context_mask(self) -> torch.Tensor:
        """[N, R] 1 on every real response token: policy tokens and, in an episode, tool/environment tokens."""
        return self.response_mask if self.response_attention_mask is None else self.response_attention_mask

    def __len__(self) -> int:
        return self.response_ids.shape[0]

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.response_ids], 1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.context_mask], 1)

    @property
    def position_ids(self) -> torch.Tensor:
        return position_ids_from_mask(self.attention_mask)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1)

    def training_inputs(self) -> dict[str, torch.Tensor]:
        """The batch as a training forward pass takes it (:func:`verl_core.modeling.forward.response_logprobs`)."""
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
            "response_ids": self.response_ids,
            "response_mask": self.response_mask,
        }

    def response_lists(self) -> list[list[int]]:
        """Each response's token ids without padding (EOS kept when generated)."""
        return [r[m.bool()].tolist() for r, m in zip(self.response_ids, self.response_mask)]

    def context_lists(self) -> list[list[int]]:
        """Each whole continuation without padding: policy tokens and the tool results between them."""
        return [r[m.bool()].tolist() for r, m in zip(self.response_ids, self.context_mask)]

    def prompt_lists(self) -> list[list[int]]:
        return [p[m.bool()].tolist() for p, m in zip(self.prompt_ids, self.prompt_mask)]

    def to(self, device) -> RolloutBatch:
        return RolloutBatch(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})

    def select_groups(self, groups: Sequence[int]) -> RolloutBatch:
        """The rows answering ``groups`` (prompt indices), in that order and renumbered ``0..len(groups)-1``,
        without the padding columns no remaining row needs (all groups in order: the same batch)."""
        members: dict[int, list[int]] = {}
        for row, g in enumerate(self.group_index.tolist()):
            members.setdefault(g, []).append(row)
        if not groups or any(g not in members for g in groups):
            raise ValueError(f"select_groups needs groups of this batch (0..{len(members) - 1}), got {list(groups)}")
        rows = [r for g in groups for r in members[g]]
        new_index = [k for k, g in enumerate(groups) for _ in members[g]]
        pick = torch.tensor(rows, dtype=torch.long, device=self.response_ids.device)
        p_len = int(self.prompt_mask[pick].sum(-1).max())
        r_len = max(1, int(self.context_mask[pick].sum(-1).max()))
        p0 = self.prompt_ids.shape[1] - p_len
        attention = self.response_attention_mask
        return RolloutBatch(
            prompt_ids=self.prompt_ids[pick, p0:],
            prompt_mask=self.prompt_mask[pick, p0:],
            response_ids=self.response_ids[pick, :r_len],
            response_mask=self.response_mask[pick, :r_len],
            logprobs=self.logprobs[pick, :r_len],
            group_index=torch.tensor(new_index, dtype=torch.long, device=self.group_index.device),
            finished=self.finished[pick],
            response_attention_mask=None if attention is None else attention[pick, :r_len],
        )


def _to(t: torch.Tensor | None, device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: ``cumsum(mask) - 1``, clamped at 0 on pads."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@runtime_checkable
class RolloutBackend(Protocol):
    """Anything that samples completions for token-id prompts.

    ``generate`` must return samples of prompt ``i`` at rows ``i*n .. i*n+n-1`` and be a pure
    function of ``(weights, prompt_ids, params, seed)``; with one seed per prompt, prompt ``i``'s
    samples must be a function of ``(weights, prompt i, params, seed[i])`` alone. ``sync_weights`` is called after every
    policy update; an in-process backend that holds the live model has nothing to do.
    """

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seed: int | Sequence[int]
    ) -> RolloutBatch: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


def concat_chunks(chunks: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    if len(chunks) == 1:
        return chunks[0]
    p_len = max(c.prompt_ids.shape[1] for c in chunks)
    r_len = max(c.response_ids.shape[1] for c in chunks)

    def pad(t: torch.Tensor, length: int, value, left: bool) -> torch.Tensor:
        extra = length - t.shape[1]
        return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

    multi_turn = any(c.response_attention_mask is not None for c in chunks)
    out = RolloutBatch(
        prompt_ids=torch.cat([pad(c.prompt_ids, p_len, pad_id, True) for c in chunks]),
        prompt_mask=torch.cat([pad(c.prompt_mask, p_len, 0, True) for c in chunks]),
        response_ids=torch.cat([pad(c.response_ids, r_len, pad_id, False) for c in chunks]),
        response_mask=torch.cat([pad(c.response_mask, r_len, 0, False) for c in chunks]),
        logprobs=torch.cat([pad(c.logprobs, r_len, 0.0, False) for c in chunks]),
        group_index=torch.cat([c.group_index for c in chunks]),
        finished=torch.cat([c.finished for c in chunks]),
        response_attention_mask=torch.cat([pad(c.context_mask, r_len, 0, False) for c in chunks]) if multi_turn else None,
    )
    return out


def concat_rollouts(batches: Sequence[RolloutBatch], pad_id: int) -> RolloutBatch:
    """One batch of several (prompts left-padded, responses right-padded to the widest); the group
    indices of each batch are shifted past those of the batches before it."""
    if not batches:
        raise ValueError("concat_rollouts needs at least one batch")
    offsets, total = [], 0
    for b in batches:
        offsets.append(total)
        total += int(b.group_index.max()) + 1 if len(b) else 0
    shifted = torch.cat([b.group_index + off for b, off in zip(batches, offsets)])
    return replace(concat_chunks(list(batches), pad_id), group_index=shifted)


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """Response texts without special tokens (EOS and padding removed)."""
    return tokenizer.batch_decode(batch.response_lists(), skip_special_tokens=True)
