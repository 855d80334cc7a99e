"""Online preference optimisation as rounds of generate -> score -> train.

- **Iterative DPO** (Xiong et al. 2024, "Iterative Preference Learning from Human Feedback",
  arXiv:2312.11456; Dong et al. 2024, "RLHF Workflow", arXiv:2405.07863): each round samples
  ``n_samples`` completions per prompt from the current policy, scores them (rules and/or a reward
  model), pairs the best against the worst and runs DPO from the current policy. The reference is
  the round's starting policy (``reference="round_start"``) or the policy the rounds started from
  (``reference="initial"``).
- **Rejection-sampling fine-tuning** (RAFT, Dong et al. 2023, arXiv:2304.06767; best-of-n SFT):
  each round keeps each prompt's best-scored completion when it reaches ``min_score`` and
  fine-tunes the current policy on them.

One round is :func:`run_round` (a pure function of its inputs and the round index, so a workflow
engine can cache and retry it); :class:`IterativeDPOTrainer` / :class:`RFTTrainer` run all rounds
in one process for users without the pipeline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field

from verl_core.algorithms.base import FINAL_MODEL_DIR
from verl_core.algorithms.dpo import DPOConfig, DPOTrainer
from verl_core.algorithms.sft import SFTConfig, SFTTrainer
from verl_core.config import ConfigError, StrictConfig
from verl_core.errors import TrainingError
from verl_core.preference_data import PreferenceDataConfig, derive_seed, generate_preference_data
from verl_core.rewards.model import RewardSourceConfig
from verl_core.rollout.contract import SamplingParams
from verl_core.train.callbacks import Callback
from verl_core.train.engine import TrainResult

ROUND_DIR = "round-{:02d}"


def _generation_default() -> PreferenceDataConfig:
    return PreferenceDataConfig(
        n_samples=4,
        sampling=SamplingParams(max_new_tokens=24),
        reward=RewardSourceConfig(reward_rules={"exact_match": 1.0}),
        tie_break="logprob",
        formats=["arrow"],
        progress=False,
    )


class RoundsSettings(StrictConfig):
    """How many rounds, and how each round samples and scores (``generation``: see
    :class:`~verl_core.preference_data.PreferenceDataConfig`; its seed is derived per round)."""

    rounds: int = Field(3, ge=1)
    prompts_per_round: int | None = Field(None, ge=1, description="prompts sampled per round (None: all)")
    generation: PreferenceDataConfig = Field(default_factory=_generation_default)


class IterativeDPOConfig(DPOConfig, RoundsSettings):
    """DPO settings of every round (``max_steps`` is per round) plus the rounds' settings."""

    reference: Literal["round_start", "initial"] = Field(
        "round_start", description="DPO reference: each round's starting policy, or the policy round 1 started from"
    )


class RFTConfig(SFTConfig, RoundsSettings):
    """SFT settings of every round plus the rounds' settings; ``min_score`` selects the samples kept."""

    min_score: float | None = Field(1.0, description="keep a prompt's best sample only when its score reaches this")


def round_prompts(prompts: list[dict], config: RoundsSettings, round_index: int) -> list[dict]:
    """Round ``k``'s prompts: a window that moves through the prompt list (all prompts when unset)."""
    n = config.prompts_per_round
    if n is None or n >= len(prompts):
        return prompts
    start = ((round_index - 1) * n) % len(prompts)
    return (prompts + prompts)[start : start + n]


def _sub_config(config: StrictConfig, cls: type, **changes: Any) -> Any:
    values = {k: v for k, v in config.model_dump().items() if k in cls.model_fields}
    return cls.from_dict({**values, **changes}, source=f"{type(config).__name__} (one round)")


def run_round(
    config: IterativeDPOConfig | RFTConfig,
    policy: str,
    initial: str,
    prompts: list[dict],
    round_index: int,
    output_dir: str | os.PathLike,
    reward_model: str | None = None,
    callbacks: Sequence[Callback] = (),
) -> TrainResult:
    """One round from the policy at ``policy`` into ``output_dir`` (samples, then the trained policy
    in ``output_dir/model``); rerun with the same arguments it resumes its shards and checkpoints."""
    out = Path(output_dir)
    is_dpo = isinstance(config, IterativeDPOConfig)
    kind = "pairs" if is_dpo else "best_of_n"
    gen = config.generation.updated(
        seed=derive_seed(config.seed, round_index),
        outputs=[kind],
        best_of_n_min_score=None if is_dpo else config.min_score,
    )
    data = generate_preference_data(
        policy, round_prompts(prompts, config, round_index), gen, out / "data", reward_model=reward_model
    )
    from verl_core.data import load_rows

    rows = load_rows(str(data.paths[kind])).to_list()
    if not rows:
        raise TrainingError(
            f"round {round_index}: the policy's samples gave no {kind} rows (every prompt's samples tied"
            + ("" if is_dpo else f" or none reached min_score {config.min_score}")
            + "); raise generation.n_samples or the sampling temperature"
        )
    if is_dpo:
        rows = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows]
        dpo = _sub_config(config, DPOConfig, output_dir=str(out), resume=True)
        ref = initial if config.reference == "initial" else None  # None: the round's starting policy
        return DPOTrainer(policy, ref_model=ref, train_dataset=rows, config=dpo, callbacks=callbacks).train()
    rows = [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows]
    sft = _sub_config(config, SFTConfig, output_dir=str(out), resume=True)
    return SFTTrainer(policy, train_dataset=rows, config=sft, callbacks=callbacks).train()


class RoundsTrainer:
    """All rounds in this process: ``IterativeDPOTrainer(path, prompts=rows, rounds=3).train()``."""

    config_cls: ClassVar[type[RoundsSettings]]

    def __init__(
        self,
        model: str | os.PathLike,
        prompts: list[dict],
        config: RoundsSettings | dict | None = None,
        reward_model: str | None = None,
        callbacks: Sequence[Callback] = (),
        **overrides: Any,
    ):
        from verl_core.algorithms.base import resolve_config

        self.config = resolve_config(self.config_cls, config, overrides)
        if not self.config.output_dir:
            raise ConfigError(f"{type(self).__name__} writes each round's samples and policy: set output_dir")
        self.model, self.prompts, self.reward_model, self.callbacks = str(model), list(prompts), reward_model, callbacks

    def train(self) -> TrainResult:
        policy, result = self.model, None
        for k in range(1, self.config.rounds + 1):
            out = Path(self.config.output_dir) / ROUND_DIR.format(k)
            result = run_round(self.config, policy, self.model, self.prompts, k, out, self.reward_model, self.callbacks)
            policy = str(out / FINAL_MODEL_DIR)
        result.output_dir = policy
        return result


class IterativeDPOTrainer(RoundsTrainer):
    config_cls = IterativeDPOConfig


class RFTTrainer(RoundsTrainer):
    config_cls = RFTConfig
