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
    """Per pair ``log π(chosen|prompt) − log π(rejected|prompt)`` (summed completion log-probs), [N]."""
    was_training = model.training
    model.eval()
    examples = tokenize_pairs(rows, tokenizer, max_length)
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = collate_pairs(chunk, tokenizer.pad_token_id)
        lp = (model_token_logprobs(model, batch) * batch["loss_mask"]).sum(-1)
        out.append((lp[: len(chunk)] - lp[len(chunk) :]).float())
    model.train(was_training)
    return torch.cat(out)


@torch.no_grad()
def reward_model_accuracy(reward_model, tokenizer, rows: Any, batch_size: int = 64, max_length: int = 512) -> float:
    from verl_core.modeling.packed_forward import pair_rewards

    was_training = reward_model.training
    reward_model.eval()
    examples = tokenize_pairs(rows, tokenizer, max_length)
    wins = 0
    for start in range(0, len(examples), batch_size):
        c, r = pair_rewards(reward_model, collate_pairs(examples[start : start + batch_size], tokenizer.pad_token_id))
        wins += int((c > r).sum())
    reward_model.train(was_training)
    return wins / len(examples)
