"""Held-out evaluation: greedy answers scored by a rule reward, pairwise preference accuracy."""

from __future__ import annotations

from typing import Any

import torch

from verl_core.data import collate_pairs, tokenize_pairs, tokenize_prompts
from verl_core.modeling.packed_forward import model_token_logprobs
from verl_core.rollout.greedy import greedy_completions


def answer_rewards(
    model,
    tokenizer,
    rows: Any,
    reward: str = "exact_match",
    max_new_tokens: int = 32,
    max_prompt_length: int = 256,
    backend=None,
) -> tuple[list[str], list[float]]:
    """Greedy answers to prompt rows carrying ``ground_truth``, and each answer's rule reward."""
    from verl_core.rewards.rules import get_rule_reward

    examples = tokenize_prompts(rows, tokenizer, max_prompt_length)
    texts = greedy_completions(model, tokenizer, [e["prompt_ids"] for e in examples], max_new_tokens, backend=backend)
    return texts, list(get_rule_reward(reward)(texts, [e["ground_truth"] for e in examples]))


def answer_accuracy(model, tokenizer, rows: Any, reward: str = "exact_match", max_new_tokens: int = 32) -> float:
    """Mean rule reward of greedy answers to prompt rows carrying ``ground_truth``."""
    _, scores = answer_rewards(model, tokenizer, rows, reward, max_new_tokens)
    return sum(scores) / len(scores)


def preference_accuracy(model, tokenizer, rows: Any, batch_size: int = 64, max_length: int = 512) -> float:
    """Fraction of pairs where the policy gives the chosen completion a higher summed log-prob."""
    margins = preference_margins(model, tokenizer, rows, batch_size, max_length)
    return float((margins > 0).float().mean())


@torch.no_grad()
def preference_margins(model, tokenizer, rows: Any, batch_size: int = 64, max_length: int = 512) -> torch.Tensor:
    """Per pair ``log π(chosen|prompt) − log π(rejected|prompt)`` (summed completion log-probs), [N],
    in the rows' order (computed in :func:`_pair_batches`' order and layout)."""
    was_training = model.training
    model.eval()
    examples = tokenize_pairs(rows, tokenizer, max_length)
    margins = torch.zeros(len(examples))
    try:
        for index, batch in _pair_batches(model, tokenizer, examples, batch_size):
            lp = (model_token_logprobs(model, batch) * batch["loss_mask"]).sum(-1)
            margins[index] = (lp[: len(index)] - lp[len(index) :]).float().cpu()
    finally:
        model.train(was_training)
    return margins


@torch.no_grad()
def reward_model_accuracy(reward_model, tokenizer, rows: Any, batch_size: int = 64, max_length: int = 512) -> float:
    from verl_core.modeling.packed_forward import pair_rewards

    was_training = reward_model.training
    reward_model.eval()
    examples = tokenize_pairs(rows, tokenizer, max_length)
    wins = 0
    try:
        for _, batch in _pair_batches(reward_model, tokenizer, examples, batch_size, needs_score_head=True):
            c, r = pair_rewards(reward_model, batch)
            wins += int((c > r).sum())
    finally:
        reward_model.train(was_training)
    return wins / len(examples)


def _pair_batches(model, tokenizer, examples: list[dict], batch_size: int, needs_score_head: bool = False):
    """``(row indices, collated batch)`` over tokenized pairs in order of length and, where the model's
    attention takes a packed mask, packed with each prompt computed once for both answers (the trainers'
    layout, equal to the padded one: tests/test_packing.py). Held-out dialogues of 50 to 1,000 tokens
    padded in the rows' order spent most of an evaluation's time on padding and on every prompt twice."""
    from verl_core.data.packing import collate_packed_pairs
    from verl_core.modeling.packed_forward import packing_unsupported, supports_shared_prompt

    packed = packing_unsupported(model, needs_score_head) is None
    order = sorted(range(len(examples)), key=lambda i: _pair_tokens(examples[i]))
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        chunk = [examples[i] for i in index]
        if packed:
            yield index, collate_packed_pairs(chunk, tokenizer.pad_token_id, supports_shared_prompt(model), "longest")
        else:
            yield index, collate_pairs(chunk, tokenizer.pad_token_id)


def _pair_tokens(example: dict) -> int:
    return len(example["prompt_ids"]) + max(len(example["chosen_ids"]), len(example["rejected_ids"]))
