"""Which prompts an online rollout step samples, DAPO's dynamic sampling and overlong reward shaping.

Every index here is a pure function of ``(seed, step, round, process)``, never of the run's
history, so a run resumed from a checkpoint samples exactly what the uninterrupted run sampled.

Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476, Sec. 3.2): a group whose completions all
got the same score has zero group-relative advantage and teaches nothing; it is dropped and more
prompts are sampled until the step has its ``batch_size / num_generations`` informative groups
(:func:`dynamic_collect`). Round 0 is the step's usual prompts; extra round ``r >= 1`` takes a full
prompt batch more from a permutation seeded by ``(seed, step, r)`` (:func:`round_prompt_indices`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from verl_core.rollout.contract import RolloutBatch, concat_rollouts
from verl_core.train.batches import micro_batch_indices

if TYPE_CHECKING:
    from verl_core.algorithms.online_config import OnlineConfig


def step_prompt_indices(n_prompts: int, step: int, c: OnlineConfig, rank: int, world: int) -> list[int]:
    """This process's ``batch_size / num_generations / world`` prompts at ``step``: a seeded
    permutation, a pure function of ``(seed, step)`` (an epoch of the prompts, then the next)."""
    return micro_batch_indices(n_prompts, step, c.batch_size // c.num_generations, c.seed, rank, world, 1)[0]


def step_request(trainer: Any, step: int) -> tuple[list[dict], int | list[int]]:
    """What ``trainer``'s process samples at ``step``: its prompts (:func:`step_prompt_indices`) and the seed
    the backend gets for them (``trainer.rollout_seed(step)``, or with ``seed_per_prompt`` one seed per prompt
    of the global batch, so samples do not depend on how prompts are split over processes). The synchronous
    loop and the asynchronous rollout workers (:mod:`verl_core.algorithms.async_rollout`) both ask this."""
    from verl_core.algorithms.online_batch import prompt_seeds

    c, acc = trainer.config, trainer.engine.accelerator
    idx = step_prompt_indices(len(trainer.prompts), step, c, acc.process_index, acc.num_processes)
    examples = [trainer.prompts[i] for i in idx]
    seed: int | list[int] = trainer.rollout_seed(step)
    if c.seed_per_prompt:
        seed = prompt_seeds(c.seed, step, acc.process_index * len(examples), len(examples))
    return examples, seed


def round_prompt_indices(n_prompts: int, step: int, round: int, c: OnlineConfig, rank: int, world: int) -> list[int]:
    """This process's prompts of dynamic-sampling ``round`` at ``step`` (round 0: :func:`step_prompt_indices`).

    Round ``r >= 1`` is a permutation of all prompts seeded by ``(seed, step, r)`` with the prompts
    of rounds ``0..r-1`` (of every process) moved to its end; each process takes its slice of the
    first ``batch_size / num_generations`` prompts, so the rounds of one step repeat a prompt only
    once every prompt has been used."""
    if round == 0:
        return step_prompt_indices(n_prompts, step, c, rank, world)
    per_step = c.batch_size // c.num_generations
    seen = set(step_prompt_indices(n_prompts, step, c, 0, 1))
    for r in range(1, round + 1):
        gen = torch.Generator().manual_seed((c.seed * 1_000_003 + step) * 10_007 + r)
        order = torch.randperm(n_prompts, generator=gen).tolist()
        order = [i for i in order if i not in seen] + [i for i in order if i in seen]
        picked = order[:per_step]
        seen.update(picked)
    per_rank = per_step // world
    return picked[rank * per_rank : (rank + 1) * per_rank]


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), times ``penalty``.

    With ``L_max = max_length`` and ``L_cache = buffer``, for a response of ``|y|`` tokens::

        R_length(y) = 0                                  if |y| <= L_max - L_cache
                    = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                    = -1                                 if |y| > L_max

    i.e. 0 up to ``L_max - L_cache`` tokens, then linearly down to ``-penalty`` at ``L_max``. It is
    added to the score. [N] lengths -> [N] float32 penalties (<= 0).
    """
    if not 1 <= buffer <= max_length:
        raise ValueError(f"overlong buffer must be in [1, {max_length}], got {buffer}")
    excess = (lengths.float() - (max_length - buffer)) / buffer
    return -penalty * excess.clamp(0.0, 1.0)


def dynamic_collect(trainer: Any, step: int) -> tuple[RolloutBatch, torch.Tensor, dict[str, float]]:
    """:meth:`OnlineTrainer.collect` with dynamic sampling (``trainer``: a GRPO-family trainer; typed
    loosely because the trainer module imports this one): sample, drop the groups whose scores are
    all equal (the task's scores, before :meth:`GRPOTrainer.shape_scores` adds the overlong
    penalty: with the exact-match rule, the groups of accuracy 0 or 1 that the paper filters out),
    sample up to ``max_sampling_rounds`` more rounds until this process has its
    ``batch_size / num_generations / processes`` informative groups (the first ones found, in round
    order; the surplus of the last round is not used).

    When the cap is hit the step trains on what there is: the informative groups found, topped up
    with dropped groups (the earliest first) so that the batch keeps its shape (every process and
    mini-batch the same number of rows). A dropped group has zero group-relative advantage (grpo,
    dr_grpo, rloo), so it adds no policy gradient: the update is that of the informative groups,
    with the filler's tokens in the token-mean denominator, as plain GRPO would have it.

    Metrics (this process's): ``sampling/rounds`` (rounds sampled, 1 = none extra),
    ``sampling/dropped_groups`` (all-equal groups sampled, over all rounds), ``sampling/filler_groups``
    (dropped groups put back because the cap was hit). ``reward/*`` are over every sampled
    completion of the step (an unbiased view of the policy), not only the trained batch.
    """
    c, acc = trainer.config, trainer.engine.accelerator
    n = c.num_generations
    want = c.batch_size // n // acc.num_processes
    rounds: list[tuple[RolloutBatch, torch.Tensor, dict[str, float]]] = []
    kept: list[tuple[int, int]] = []  # (round, group)
    dropped: list[tuple[int, int]] = []
    gen_seconds = 0.0
    for rnd in range(1 + c.max_sampling_rounds):
        idx = round_prompt_indices(len(trainer.prompts), step, rnd, c, acc.process_index, acc.num_processes)
        examples = [trainer.prompts[i] for i in idx]
        t0 = time.perf_counter()
        rollout = trainer.backend.generate([e["prompt_ids"] for e in examples], trainer.sampling, trainer.rollout_seed(step, rnd))
        gen_seconds += time.perf_counter() - t0
        scores, metrics = trainer.score(rollout, examples)
        per_group = scores.view(-1, n)  # the task's scores, before shaping: the paper filters on accuracy
        rounds.append((rollout, *trainer.shape_scores(rollout, scores, metrics)))
        informative = (per_group.max(-1).values > per_group.min(-1).values).tolist()
        for g, ok in enumerate(informative):
            (kept if ok else dropped).append((rnd, g))
        if len(kept) >= want:
            break
    chosen = kept[:want]
    filler = dropped[: want - len(chosen)]
    parts, part_scores = [], []
    for rnd, (rollout, scores, _) in enumerate(rounds):
        groups = sorted(g for r, g in chosen + filler if r == rnd)
        if groups:
            parts.append(rollout.select_groups(groups))
            part_scores.append(scores.view(-1, n)[groups].reshape(-1))
    batch = concat_rollouts(parts, trainer.policy.tokenizer.pad_token_id)
    all_scores = torch.cat([s for _, s, _ in rounds])
    metrics = {k: sum(m[k] for _, _, m in rounds) / len(rounds) for k in rounds[0][2]}  # rounds are equal in size
    metrics.update(
        {
            "reward/mean": all_scores.mean().item(),
            "reward/std": all_scores.std(unbiased=False).item(),
            "sampling/rounds": float(len(rounds)),
            "sampling/dropped_groups": float(len(dropped)),
            "sampling/filler_groups": float(len(filler)),
            "perf/gen_seconds": gen_seconds,
            "perf/gen_tokens_per_s": sum(r.response_lengths.sum().item() for r, _, _ in rounds) / max(gen_seconds, 1e-9),
        }
    )
    return batch, torch.cat(part_scores), metrics
