"""Held-out scoring for bench/distill.py: the student-to-teacher gap, measured two ways, and accuracy.

- ``reverse_kl``: exact per-token KL(π_S ‖ π_T) over the whole vocabulary at every position of the
  student's own sampled answers (temperature 1, a fixed seed) to the held-out prompts, token mean.
- ``forward_kl``: exact per-token KL(π_T ‖ π_S) at every position of the teacher's greedy answers to the
  same prompts (the distribution SFT on teacher answers imitates), token mean.
- ``accuracy``: the student's greedy answers, ``numeric_match`` against the arithmetic ground truth.

The teacher scores 0 on both KLs, so "gap closed" is ``(m(student0) - m(after)) / m(student0)``.
"""

from __future__ import annotations

import torch

from verl_core.bundled import arithmetic
from verl_core.rewards.rules import numeric_match
from verl_core.rollout.contract import RolloutBatch, SamplingParams
from verl_core.rollout.hf_backend import HFRolloutBackend

EVAL_SAMPLE_SEED = 2024  # the student's held-out samples: the same stream for every student
HELD_OUT_SEED = 12  # the verdicts' held-out problems; pilots draw theirs with another seed


def chat_prompt(tokenizer, question: str) -> str:
    """The question as one user turn of the chat template (the default system prompt included)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)


def task_splits(
    n_train: int, n_eval: int, eval_seed: int = HELD_OUT_SEED
) -> tuple[list[arithmetic.Problem], list[arithmetic.Problem]]:
    """Disjoint train / held-out arithmetic word problems (operands 0..20), by seed and by question;
    another ``eval_seed`` draws another held-out set (pilots use one, verdicts the default)."""
    train = arithmetic.seeded_split(n_train, 11, set())
    held_out = arithmetic.seeded_split(n_eval, eval_seed, {p.question for p in train})
    return train, held_out


def generate(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float, seed: int = 0):
    backend = HFRolloutBackend(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, batch_size=64)
    return backend.generate(prompt_ids, params, seed=seed)


def response_texts(tokenizer, batch: RolloutBatch) -> list[str]:
    return [
        tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
        for ids, mask in zip(batch.response_ids, batch.response_mask)
    ]


@torch.no_grad()
def response_log_softmax(model, batch: RolloutBatch, lo: int, hi: int) -> torch.Tensor:
    """``log π(· | x_<t)`` over the vocabulary at every response position of rows ``lo:hi``: [b, R, V]."""
    ids = batch.input_ids[lo:hi]
    mask = batch.attention_mask[lo:hi]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    r = batch.response_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False, logits_to_keep=r + 1).logits
    return torch.log_softmax(logits[:, :-1].float(), dim=-1)


@torch.no_grad()
def mean_kl(p_model, q_model, batch: RolloutBatch, chunk: int = 8, p_cache: list | None = None) -> float:
    """Token mean over the response tokens of ``batch`` of the exact KL(p ‖ q) of the two models'
    next-token distributions. ``p_cache``: p's log-softmax chunks, reused when given (filled when empty)."""
    total, count = 0.0, 0
    was = p_model.training, q_model.training
    p_model.eval(), q_model.eval()
    for i, lo in enumerate(range(0, len(batch), chunk)):
        hi = min(lo + chunk, len(batch))
        if p_cache is not None and i < len(p_cache):
            lp = p_cache[i].float()
        else:
            lp = response_log_softmax(p_model, batch, lo, hi)
            if p_cache is not None:
                p_cache.append(lp.to(torch.bfloat16))
        lq = response_log_softmax(q_model, batch, lo, hi)
        kl = (lp.exp() * (lp - lq)).sum(-1)
        m = batch.response_mask[lo:hi].bool()
        total += kl[m].sum().item()
        count += int(m.sum())
    p_model.train(was[0]), q_model.train(was[1])
    return total / max(count, 1)


class HeldOut:
    """The held-out prompts, the teacher's greedy answers to them and the teacher's accuracy (computed once)."""

    def __init__(self, teacher, tokenizer, problems: list[arithmetic.Problem], max_new_tokens: int):
        self.teacher, self.tok, self.max_new_tokens = teacher, tokenizer, max_new_tokens
        self.prompt_ids = [tokenizer(chat_prompt(tokenizer, p.question))["input_ids"] for p in problems]
        self.truths = [str(p.answer) for p in problems]
        self.teacher_greedy = generate(teacher, tokenizer, self.prompt_ids, max_new_tokens, 0.0)
        self.teacher_texts = response_texts(tokenizer, self.teacher_greedy)
        self.teacher_accuracy = sum(numeric_match(self.teacher_texts, self.truths)) / len(self.truths)
        self._teacher_cache: list = []  # the teacher's log-softmax on its greedy answers (bf16), reused

    def greedy_correct(self, student) -> list[int]:
        """1 per held-out problem the student's greedy answer gets right (numeric_match), else 0."""
        greedy = response_texts(self.tok, generate(student, self.tok, self.prompt_ids, self.max_new_tokens, 0.0))
        return [int(c) for c in numeric_match(greedy, self.truths)]

    def score(self, student) -> dict[str, float]:
        samples = generate(student, self.tok, self.prompt_ids, self.max_new_tokens, 1.0, seed=EVAL_SAMPLE_SEED)
        correct = self.greedy_correct(student)
        return {
            "reverse_kl": mean_kl(student, self.teacher, samples),
            "forward_kl": mean_kl(self.teacher, student, self.teacher_greedy, p_cache=self._teacher_cache),
            "accuracy": sum(correct) / len(self.truths),
            "sample_tokens": float(samples.response_mask.sum()),
            "correct": correct,  # per held-out problem, for the paired rule
        }


def gap_closed(before: float, after: float, target: float = 0.0) -> float:
    """The fraction of ``before - target`` that training removed (1: the teacher's value reached)."""
    return (before - after) / (before - target) if before != target else 0.0


def sign_test_p(wins: int, losses: int) -> float:
    """One-sided exact sign test (McNemar's exact test on the discordant pairs): P(X >= wins) for
    X ~ Binomial(wins + losses, 1/2), the chance of at least ``wins`` under "neither method is better"."""
    from math import comb

    n = wins + losses
    return sum(comb(n, k) for k in range(wins, n + 1)) / 2**n if n else 1.0
