"""Rollout: batched sampling of completions from a policy, with the masks and log-probs RL needs.

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

The HF backend is a hand-written KV-cache loop rather than ``model.generate`` so that the
random stream (one ``torch.Generator``), the stopping rule and the log-probs are exact and
under our control. A vLLM or SGLang backend implements :class:`RolloutBackend` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol, runtime_checkable

import torch
from pydantic import Field

from verl_core.config import StrictConfig
from verl_core.data import pad_to


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
        """The batch as a training forward pass takes it (:func:`verl_core.forward.response_logprobs`)."""
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


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set logits outside the top-k and outside the top-p nucleus (Holtzman et al. 2020,
    arXiv:1904.09751: the smallest set of tokens whose probability sum reaches ``p``) to -inf.
    The most likely token is always kept."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # probability of strictly more likely tokens
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


class HFRolloutBackend:
    """Sampling with a Hugging Face causal LM and its KV cache, in this process.

    ``autocast_dtype`` (e.g. ``torch.bfloat16``) runs the forward passes under autocast; the
    sampling distribution and log-probs are always computed in fp32 from the logits.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        eos_token_id: int | Sequence[int],
        pad_token_id: int,
        autocast_dtype: torch.dtype | None = None,
    ):
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        self.eos_ids = torch.tensor(eos, dtype=torch.long)
        self.pad_token_id = int(pad_token_id)
        self.autocast_dtype = autocast_dtype
        self.sync_weights(model)

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.model = model
        self._cache_kw = _cache_keyword(model)
        self._keeps_logits = _takes_argument(model, "logits_to_keep")

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, seed: int | Sequence[int] = 0
    ) -> RolloutBatch:
        """``seed``: one stream for the whole batch, or one seed per prompt (each sample then draws
        from its own stream, so a prompt's samples do not depend on the other prompts in the call)."""
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate needs at least one prompt and no empty prompt")
        device = next(self.model.parameters()).device
        rows = [list(p) for p in prompt_ids for _ in range(params.n)]
        groups = [i for i in range(len(prompt_ids)) for _ in range(params.n)]
        if isinstance(seed, int):
            gen: torch.Generator | list[torch.Generator] = torch.Generator(device=device).manual_seed(seed)
        elif len(seed) != len(prompt_ids):
            raise ValueError(f"{len(seed)} seeds for {len(prompt_ids)} prompts: give one seed per prompt or one in all")
        else:
            gen = [row_generator(int(seed[i]), j, device) for i in range(len(prompt_ids)) for j in range(params.n)]
        was_training = self.model.training
        self.model.eval()
        try:
            size = params.batch_size
            chunks = [
                self._generate_chunk(rows[s : s + size], params, gen[s : s + size] if isinstance(gen, list) else gen, device)
                for s in range(0, len(rows), size)
            ]
        finally:
            self.model.train(was_training)
        batch = _concat(chunks, self.pad_token_id)
        batch.group_index = torch.tensor(groups, dtype=torch.long, device=device)
        return batch

    def _forward(self, cache=None, **kwargs):
        """One forward with the KV cache; returns (last-position logits, updated cache). The LM head
        runs on the last position only (``logits_to_keep=1``): a prefill needs no other logits."""
        if cache is not None:
            kwargs[self._cache_kw] = cache
        if self._keeps_logits:
            kwargs["logits_to_keep"] = 1
        if self.autocast_dtype is None:
            out = self.model(**kwargs, use_cache=True)
        else:
            with torch.autocast(device_type=kwargs["input_ids"].device.type, dtype=self.autocast_dtype):
                out = self.model(**kwargs, use_cache=True)
        return out.logits[:, -1], out.get(self._cache_kw)

    def _generate_chunk(
        self, rows: list[list[int]], params: SamplingParams, gen: torch.Generator | list[torch.Generator], device: torch.device
    ) -> RolloutBatch:
        n = len(rows)
        # The n samples of a prompt share ONE prefill: each distinct prompt is run once, then its KV
        # cache and first logits are copied to every row that samples from it.
        distinct: dict[tuple, int] = {}
        source = torch.tensor([distinct.setdefault(tuple(r), len(distinct)) for r in rows], device=device)
        unique_rows = [list(r) for r in distinct]
        prompt = pad_to(unique_rows, self.pad_token_id, side="left").to(device)
        prompt_mask = pad_to([[1] * len(r) for r in unique_rows], 0, side="left").to(device)
        positions = position_ids_from_mask(prompt_mask)
        logits, cache = self._forward(input_ids=prompt, attention_mask=prompt_mask, position_ids=positions)
        prompt, prompt_mask, positions, logits = prompt[source], prompt_mask[source], positions[source], logits[source]
        if len(unique_rows) < n:
            if hasattr(cache, "batch_select_indices"):
                cache.batch_select_indices(source)
            else:  # a cache this code cannot copy rows of: prefill every row
                logits, cache = self._forward(input_ids=prompt, attention_mask=prompt_mask, position_ids=positions)
        eos_ids = self.eos_ids.to(device)
        mask = prompt_mask.clone()
        next_pos = positions[:, -1:] + 1
        done = torch.zeros(n, dtype=torch.bool, device=device)
        tokens, logps, alive = [], [], []
        for step in range(params.max_new_tokens):
            token, logp = _sample(logits.float(), params, gen)
            token = torch.where(done, self.pad_token_id, token)
            tokens.append(token)
            logps.append(torch.where(done, 0.0, logp))
            alive.append(~done)
            done = done | torch.isin(token, eos_ids)
            if bool(done.all()) or step == params.max_new_tokens - 1:
                break
            mask = torch.cat([mask, alive[-1].long()[:, None]], 1)
            logits, cache = self._forward(input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, cache=cache)
            next_pos = next_pos + 1
        batch = RolloutBatch(
            prompt_ids=prompt,
            prompt_mask=prompt_mask,
            response_ids=torch.stack(tokens, 1),
            response_mask=torch.stack(alive, 1).long(),
            logprobs=torch.stack(logps, 1),
            group_index=torch.zeros(n, dtype=torch.long, device=device),
            finished=done,
        )
        return batch


def _takes_argument(model: torch.nn.Module, name: str) -> bool:
    import inspect

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return name in inspect.signature(base.forward).parameters


def _cache_keyword(model: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: ``cache`` (transformers >= 5.x) or ``past_key_values``."""
    return "cache" if _takes_argument(model, "cache") else "past_key_values"


def row_generator(prompt_seed: int, sample: int, device) -> torch.Generator:
    """The random stream of sample ``sample`` of the prompt seeded ``prompt_seed``."""
    return torch.Generator(device=device).manual_seed(prompt_seed * 1_000_003 + sample)


def _sample(
    logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under softmax(logits / T) (see the module docstring).

    Inverse-CDF sampling: row i's token is the first k with ``cdf_i[k] > u_i``, ``u_i`` uniform on
    [0, total_i), drawn from the batch's stream or, with one generator per row, from the row's own
    (a pure function of that row's logits and stream). One uniform per row instead of
    ``torch.multinomial``'s vocabulary-wide random vector, and one ``exp`` pass over the logits for
    both the draw and the log-prob: at a 32k vocabulary this step cost as much as the LM head."""
    if params.temperature == 0:
        token = logits.argmax(-1)
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None]).squeeze(-1)
    scaled = logits / params.temperature
    top = scaled.amax(-1, keepdim=True)
    weights = (scaled - top).exp()
    if params.top_k or params.top_p < 1.0:
        total = weights.sum(-1)  # the log-prob is the policy's, before the truncation
        cdf = weights.masked_fill(filter_logits(scaled, params.top_k, params.top_p) == float("-inf"), 0.0).cumsum_(-1)
    else:
        cdf = weights.cumsum_(-1)
        total = cdf[:, -1]
    if isinstance(gen, torch.Generator):
        u = torch.rand(len(cdf), generator=gen, device=cdf.device)
    else:
        u = torch.stack([torch.rand((), generator=g, device=cdf.device) for g in gen])
    # right=True: the first k with cdf[k] > u, so a token of probability 0 is never chosen
    token = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)
    logp = scaled.gather(-1, token[:, None]).squeeze(-1) - top.squeeze(-1) - total.log()
    return token, logp


def _concat(chunks: list[RolloutBatch], pad_id: int) -> RolloutBatch:
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
    return replace(_concat(list(batches), pad_id), group_index=shifted)


def decode_responses(tokenizer, batch: RolloutBatch) -> list[str]:
    """Response texts without special tokens (EOS and padding removed)."""
    return tokenizer.batch_decode(batch.response_lists(), skip_special_tokens=True)
