"""The policy that online RL trains: a causal LM, its tokenizer and a way to sample from it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from verl_core.data import tokenize_prompts
from verl_core.modeling.loading import DType, LoraSettings, load_causal_lm, load_tokenizer, save_pretrained_atomic
from verl_core.rollout.contract import SamplingParams, decode_responses
from verl_core.rollout.hf_backend import HFRolloutBackend


class LLMPolicy:
    """``LLMPolicy.from_pretrained(path)``: a trainable causal LM plus its tokenizer.

    ``policy.model`` is the live ``nn.Module`` (trainers update it in place), ``policy.tokenizer``
    its tokenizer (pad token set), ``policy.source`` the folder or hub id it came from, if any.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, source: str | None = None):
        if tokenizer.eos_token_id is None:
            raise ValueError("the policy's tokenizer needs an eos_token to stop generation")
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model = model
        self.tokenizer = tokenizer
        self.source = source

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, dtype: DType = "float32", lora: LoraSettings | None = None, trust_remote_code: bool = False
    ) -> LLMPolicy:
        model = load_causal_lm(path, dtype=dtype, lora=lora, trust_remote_code=trust_remote_code)
        return cls(model, load_tokenizer(path, trust_remote_code=trust_remote_code), str(path))

    def rollout_backend(self, autocast_dtype: torch.dtype | None = None) -> HFRolloutBackend:
        return HFRolloutBackend(self.model, self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, autocast_dtype)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[dict],
        sampling: SamplingParams | None = None,
        seed: int = 0,
        **sampling_overrides: Any,
    ) -> list[str]:
        """Sample ``n`` completions per prompt (prompt strings or prompt rows); ``n`` per prompt, in order."""
        params = sampling or SamplingParams()
        if sampling_overrides:
            params = params.updated(**sampling_overrides)
        rows = [{"prompt": p} if isinstance(p, str) else p for p in prompts]
        ids = [e["prompt_ids"] for e in tokenize_prompts(rows, self.tokenizer, max_prompt_length=10**9)]
        return decode_responses(self.tokenizer, self.rollout_backend().generate(ids, params, seed))

    def save_pretrained(self, path: str | os.PathLike) -> Path:
        return save_pretrained_atomic(self.model, self.tokenizer, path)
