"""Scoring one rollout of an online trainer, and the few samples of it that become MLflow traces."""

from __future__ import annotations

import torch

from verl_core.agents.episodes import episode_samples
from verl_core.rollout.contract import RolloutBatch, decode_responses

ROLLOUT_TRACE_SAMPLES = 4  # samples of a logging interval's rollout written as traces (verl_core.train.traces)


def score_rollout(trainer, rollout: RolloutBatch, examples: list[dict]) -> tuple[torch.Tensor, dict[str, float]]:
    """Each completion's reward (``trainer.rewards``, minus ``missing_eos_penalty`` for a completion cut
    before EOS) and the ``reward/*`` metrics, with the judge's, the service's and the sampler's own.
    A trainer that needs no reward and was given none (distillation) scores 0 and logs the sampler's only."""
    sampler = getattr(trainer.backend, "metrics", dict)()  # episodes: agent/*; async workers: async/*
    if trainer.rewards is None:
        return torch.zeros(len(rollout)), sampler
    texts = decode_responses(trainer.policy.tokenizer, rollout)
    groups = rollout.group_index.tolist()
    ids = trainer.rm_reads_ids
    result = trainer.rewards.score(
        [examples[g]["prompt"] for g in groups],
        texts,
        [examples[g]["ground_truth"] for g in groups],
        prompt_ids=rollout.prompt_lists() if ids else None,
        completion_ids=rollout.response_lists() if ids else None,
    )
    scores = result.total
    if trainer.config.missing_eos_penalty is not None:
        scores = scores - trainer.config.missing_eos_penalty * (~rollout.finished.cpu()).float()
    metrics = {"reward/mean": scores.mean().item(), "reward/std": scores.std(unbiased=False).item()}
    metrics.update({f"reward/{k}": v.float().mean().item() for k, v in result.components.items()})
    metrics.update(trainer.rewards.metrics())  # judge/*, remote/*
    metrics.update(sampler)
    return scores, metrics


def rollout_samples(trainer, rollout: RolloutBatch, scores: torch.Tensor, limit: int = ROLLOUT_TRACE_SAMPLES) -> list[dict]:
    """The first ``limit`` samples of this process's rollout: prompt, completion, reward (None when the
    trainer scores nothing, as distillation without a reward); agent episodes with their turns."""
    tok = trainer.policy.tokenizer
    rewards = [float(s) for s in scores[:limit]] if trainer.rewards is not None else [None] * limit
    episodes = getattr(trainer.backend, "episodes", None)
    if episodes:
        return episode_samples(episodes, rewards, tok, limit)
    prompts = tok.batch_decode(rollout.prompt_lists()[:limit], skip_special_tokens=True)
    completions = tok.batch_decode(rollout.response_lists()[:limit], skip_special_tokens=True)
    return [{"prompt": p, "completion": c, "reward": r} for p, c, r in zip(prompts, completions, rewards)]
