"""Sampling with a Hugging Face causal LM and its KV cache, in this process (the ``hf`` rollout backend).

The layout of what it returns and which log-probs it reports: :mod:`verl_core.rollout.contract`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verl_core.data import pad_to
from verl_core.rollout.contract import RolloutBatch, SamplingParams, concat_chunks, position_ids_from_mask
from verl_core.rollout.decode_kernels import cpu_decode_kernels
from verl_core.rollout.reserved_cache import reserved_cache


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
            with cpu_decode_kernels(self.model):
                chunks = [
                    self._generate_chunk(rows[s : s + size], params, gen[s : s + size] if isinstance(gen, list) else gen, device)
                    for s in range(0, len(rows), size)
                ]
        finally:
            self.model.train(was_training)
        batch = concat_chunks(chunks, self.pad_token_id)
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
        return out.logits[:, -1].contiguous(), out.get(self._cache_kw)

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
        cache = reserved_cache(self.model, params.max_new_tokens)  # None: the model's own cache
        logits, cache = self._forward(input_ids=prompt, attention_mask=prompt_mask, position_ids=positions, cache=cache)
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
