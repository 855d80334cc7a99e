"""Settings, result record and constants of preference-data generation."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from verl_core.config import ConfigError, StrictConfig
from verl_core.modeling.loading import DType
from verl_core.rewards.model import RewardSourceConfig
from verl_core.rollout.contract import SamplingParams
from verl_core.rollout.registry import RolloutConfig

FORMAT_VERSION = "preference-data-1"
OUTPUT_KINDS = ("pairs", "unpaired", "best_of_n")
COLUMNS = {
    "pairs": ["prompt", "chosen", "rejected", "chosen_score", "rejected_score", "prompt_index", "ground_truth"],
    "unpaired": ["prompt", "completion", "label", "score", "prompt_index", "ground_truth"],
    "best_of_n": ["prompt", "completion", "score", "prompt_index", "ground_truth"],
}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class PreferenceDataConfig(StrictConfig):
    """How to sample, score, pair and label; see the package docstring for the rules."""

    n_samples: int = Field(8, ge=2, description="completions sampled per prompt")
    sampling: SamplingParams = Field(
        default_factory=lambda: SamplingParams(max_new_tokens=64),
        description="temperature, top_p, top_k, max_new_tokens, batch_size; n must be 1 or n_samples",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the sampling engine: hf | vllm, and its options")
    seed: int = 0
    reward: RewardSourceConfig = Field(
        default_factory=RewardSourceConfig, description="rules and/or a reward model; nothing given means exact_match"
    )
    min_margin: float = Field(0.0, ge=0, description="a pair needs chosen_score - rejected_score >= min_margin (and > 0)")
    pairing: Literal["best_worst", "all_pairs"] = "best_worst"
    tie_break: Literal["sample_order", "logprob"] = Field(
        "sample_order", description="among equal scores, best = first sample / most likely one, worst = first / least likely"
    )
    max_pairs_per_prompt: int | None = Field(None, ge=1, description="cap for all_pairs (largest margins first)")
    kto_labelling: Literal["threshold", "rank"] = Field(
        "threshold", description="threshold: desirable iff score >= kto_threshold; rank: above/below the prompt's mean score"
    )
    kto_threshold: float = 0.5
    best_of_n_min_score: float | None = Field(None, description="best-of-n rows only where the best score reaches this")
    shard_size: int = Field(64, ge=1, description="prompts per shard (the unit of resumption)")
    batch_size: int = Field(16, ge=1, description="prompts per generate call")
    max_prompt_length: int = Field(256, ge=1)
    outputs: list[Literal["pairs", "unpaired", "best_of_n"]] = Field(default_factory=lambda: list(OUTPUT_KINDS))
    formats: list[Literal["arrow", "parquet"]] = Field(default_factory=lambda: ["arrow", "parquet"])
    device: str = Field("auto", description="'auto' = cuda when available, else cpu")
    dtype: DType = "float32"
    progress: bool = True

    @model_validator(mode="after")
    def _check_n(self) -> PreferenceDataConfig:
        if self.sampling.n not in (1, self.n_samples):
            raise ValueError(f"sampling.n ({self.sampling.n}) must be 1 or equal n_samples ({self.n_samples})")
        return self

    def sampling_params(self) -> SamplingParams:
        """The sampling parameters actually used (``n = n_samples``)."""
        return self.sampling.updated(n=self.n_samples)


@dataclass
class PreferenceDataResult:
    """Where the outputs are, how many rows each has, and the reward statistics."""

    output_dir: Path
    paths: dict[str, Path]  # "pairs", "pairs_parquet", ..., "provenance", "shards"
    counts: dict[str, int]
    stats: dict[str, Any]
    provenance: dict[str, Any] = field(repr=False, default_factory=dict)


class ShardMismatchError(ConfigError):
    """``output_dir`` holds shards sampled with different settings, policy or prompts."""
