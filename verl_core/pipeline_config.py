"""The typed pipeline config: one object that is ``configs/*.yaml``, the CLI's ``--set``
overrides and the Prefect flow's parameter form at once.

Each stage has its own section, named like the stage. A section holds the stage's
trainer settings (inherited from the algorithm's config class) plus:

- a *given output* field (``sft.model_path``, ``preference_data.path``,
  ``reward_model.model_path``): when set, the stage does not run and that output is
  used instead;
- where a stage has variants, a selector (``preference_data.method``,
  ``policy_optimisation.algorithm``) and one sub-section per variant, named like the
  variant (``policy_optimisation.dpo``). Only the selected variant's sub-section enters
  the stage's cache key.

No Prefect here, and nothing that runs: :mod:`verl_core.stages` reads this object.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from verl_core.algorithms.reward_model import RewardConfig
from verl_core.algorithms.sft import SFTConfig
from verl_core.config import ConfigError, StrictConfig

PolicyAlgorithm = Literal["dpo", "kto", "simpo", "orpo", "ppo", "grpo", "rloo", "none"]
PreferenceMethod = Literal["bundled", "sample_and_score"]
STAGE_ORDER = ("sft", "preference_data", "reward_model", "policy_optimisation", "evaluation")


class DataSource(StrictConfig):
    """Rows for a stage: a local file (JSONL/JSON/Parquet/CSV), a ``save_to_disk`` folder
    or a hub id; ``path: null`` means the bundled arithmetic task's split for that stage.
    A local file's content fingerprint is part of the stage's cache key."""

    path: str | None = None
    split: str = "train"
    limit: int | None = Field(None, ge=1, description="use only the first N rows")


class SFTStageConfig(SFTConfig):
    """Supervised fine-tuning of the base model; skipped when ``model_path`` is given."""

    model_path: str | None = Field(None, description="an SFT policy folder to use instead of training one")
    data: DataSource = Field(default_factory=DataSource)
    max_steps: int | None = Field(300, ge=1)
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)
    logging_steps: int = Field(25, ge=1)
    save_steps: int | None = Field(50, ge=1)


class PreferenceDataStageConfig(StrictConfig):
    """Preference pairs (prompt, chosen, rejected); skipped when ``path`` is given.

    ``bundled``: the arithmetic task's pairs (correct answer chosen, a near miss
    rejected). ``sample_and_score``: sample completions from the SFT policy and pair them
    by score (not wired yet).
    """

    path: str | None = Field(None, description="pairs to use instead of generating them (file or folder)")
    method: PreferenceMethod = "bundled"
    num_prompts: int = Field(512, ge=1)
    seed: int = 0

    @model_validator(mode="after")
    def _wired(self):
        _check_variant(self, "method", "preference_data")
        return self


class RewardModelStageConfig(RewardConfig):
    """Bradley–Terry reward model on the preference pairs, initialised from the SFT policy."""

    enabled: bool = True
    model_path: str | None = Field(None, description="a reward-model folder to use instead of training one")
    init_from: Literal["sft", "base"] = "sft"
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="last fraction of the pairs held out for accuracy")
    max_steps: int | None = Field(100, ge=1)
    batch_size: int = Field(16, ge=1)
    learning_rate: float = Field(1e-3, gt=0)
    logging_steps: int = Field(10, ge=1)
    save_steps: int | None = Field(20, ge=1)


class PolicyOptimisationStageConfig(StrictConfig):
    """Policy optimisation of the SFT policy; ``algorithm: none`` keeps the SFT policy.

    Each algorithm, once wired, has a sub-section named like it holding its trainer
    config (e.g. ``dpo: DPOConfig``); only the chosen one enters the cache key.
    """

    algorithm: PolicyAlgorithm = "none"
    model_path: str | None = Field(None, description="a policy folder to evaluate instead of training one")
    prompts: DataSource = Field(default_factory=DataSource, description="prompts for online algorithms (PPO, GRPO, ...)")

    @model_validator(mode="after")
    def _wired(self):
        _check_variant(self, "algorithm", "policy_optimisation")
        return self


class EvaluationStageConfig(StrictConfig):
    """Held-out exact-match accuracy (and reward-model score) of base, SFT and final policies."""

    data: DataSource = Field(default_factory=DataSource, description="rows with 'prompt' and 'ground_truth'")
    num_rows: int = Field(200, ge=1)
    reward: str = "exact_match"
    max_new_tokens: int = Field(32, ge=1)
    include_base: bool = True


class TrackingConfig(StrictConfig):
    """MLflow: the URI is this value, else ``$MLFLOW_TRACKING_URI``, else ``<workdir>/mlflow.db``."""

    uri: str | None = None
    experiment: str = "verl-core"
    ui_url: str | None = Field(None, description="MLflow UI base URL for links; default: the URI when http, else http://127.0.0.1:5000")
    log_model: bool = True
    registered_model_name: str | None = "verl-core-policy"


class OrchestrationConfig(StrictConfig):
    """Prefect: where results (cache records) live, retries, cache refresh."""

    result_storage: str | None = Field(None, description="folder for Prefect results; default <workdir>/prefect-results")
    retries: int = Field(1, ge=0)
    retry_delay_seconds: float = Field(2.0, ge=0)
    refresh_cache: bool = False
    keep_checkpoints: bool = False


class PipelineConfig(StrictConfig):
    """Everything one run of the RLHF pipeline needs."""

    name: str = "rlhf"
    base_model: str | None = Field(None, description="folder or hub id; null = the embedded tiny model")
    workdir: str = Field("runs", description="stage outputs, Prefect results and the default MLflow store")
    sft: SFTStageConfig = Field(default_factory=SFTStageConfig)
    preference_data: PreferenceDataStageConfig = Field(default_factory=PreferenceDataStageConfig)
    reward_model: RewardModelStageConfig = Field(default_factory=RewardModelStageConfig)
    policy_optimisation: PolicyOptimisationStageConfig = Field(default_factory=PolicyOptimisationStageConfig)
    evaluation: EvaluationStageConfig = Field(default_factory=EvaluationStageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)

    @property
    def workdir_path(self) -> Path:
        return Path(self.workdir).expanduser().resolve()

    @property
    def result_storage_path(self) -> Path:
        o = self.orchestration.result_storage
        return Path(o).expanduser().resolve() if o else self.workdir_path / "prefect-results"


def load_pipeline_config(path: str | Path | None = None, overrides: dict[str, Any] | list[str] | None = None) -> PipelineConfig:
    """``configs/default.yaml`` (or defaults when ``path`` is None) plus ``a.b=c`` overrides."""
    if isinstance(overrides, list):
        overrides = parse_overrides(overrides)
    if path is None:
        data: dict[str, Any] = {}
        from verl_core.config import set_dotted

        for dotted, value in (overrides or {}).items():
            set_dotted(data, dotted, value)
        return PipelineConfig.from_dict(data, source="overrides")
    return PipelineConfig.from_yaml(path, overrides)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["sft.max_steps=10", "sft.model_path=null"]`` → typed values (YAML scalars)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
    return out


def _check_variant(section: StrictConfig, selector: str, stage: str) -> None:
    """A selected variant other than ``none``/``bundled`` must have its sub-section (= is wired)."""
    value = getattr(section, selector)
    if value in ("none", "bundled") or value in type(section).model_fields:
        return
    raise ConfigError(f"{stage}.{selector}={value!r} is not wired into the pipeline yet "
                      f"(no '{stage}.{value}' section); add it in verl_core/pipeline_config.py and register "
                      f"its stage in verl_core/stages.py")
