"""Greedy answers of a causal LM to many prompts: batches of similar lengths, left-padded, through
transformers' ``generate`` inside the CPU decode kernels with a KV cache that appends in place
(:mod:`verl_core.rollout.reserved_cache`), or through a rollout backend when one is given.
Evaluation and the judge (a model's sampled number) both decode this way."""

from __future__ import annotations

import torch

from verl_core.data import pad_to
from verl_core.rollout.decode_kernels import cpu_decode_kernels
from verl_core.rollout.reserved_cache import reserved_cache


@torch.no_grad()
def greedy_completions(
    model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int = 32, batch_size: int = 64, backend=None
) -> list[str]:
    """Greedy decode (KV cache, left padding, stop at EOS) and return the decoded completions; with a
    rollout ``backend`` (:mod:`verl_core.rollout.registry`), through it."""
    if backend is not None:
        from verl_core.rollout.contract import SamplingParams, decode_responses

        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, batch_size=batch_size)
        return decode_responses(tokenizer, backend.generate(prompt_ids, params))
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    # batches of similar lengths: left padding to a batch's longest prompt is compute spent on nothing
    # (real dialogues range from 20 to 500 tokens)
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))
    texts: list[str] = []
    try:
        with cpu_decode_kernels(model):
            for start in range(0, len(order), batch_size):
                chunk = [prompt_ids[i] for i in order[start : start + batch_size]]
                ids = pad_to(chunk, tokenizer.pad_token_id, side="left").to(device)
                mask = pad_to([[1] * len(p) for p in chunk], 0, side="left").to(device)
                out = model.generate(
                    past_key_values=reserved_cache(model, max_new_tokens),  # None: generate makes the model's own
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
                texts += tokenizer.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    finally:  # a caller that catches the error keeps training a model in the mode it left it
        model.train(was_training)
    by_row = [""] * len(order)
    for text, i in zip(texts, order):
        by_row[i] = text
    return by_row
