"""The typed pipeline config: one object that is ``configs/*.yaml``, the CLI's ``--set``
overrides and the Prefect flow's parameter form at once.

Each stage has its own section, named like the stage. A training section *is* its trainer's
config class (every trainer setting can be set) plus the stage's own fields:

- a *given output* field (``sft.model_path``, ``preference_data.path``,
  ``reward_model.model_path``, ``policy_optimisation.model_path``): when set, the stage does
  not run and that output is used instead;
- where a stage has variants, a selector (``preference_data.method``,
  ``policy_optimisation.algorithm``) and one sub-section per variant, named like the
  variant (``policy_optimisation.dpo``). The algorithm choices and sub-sections are generated
  from :data:`verl_core.algorithms.registry.ALGORITHMS`; only the selected variant's
  sub-section enters the stage's cache key.

Defaults: a setting's default is its trainer config's. :data:`RECIPE` is the one place where
the pipeline overrides some of them for the embedded default (a tiny model on a laptop CPU);
``configs/default.yaml`` repeats none of it with another value (tests keep both in sync).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, create_model, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from verl_core.algorithms.registry import ALGORITHMS
from verl_core.algorithms.reward_model import RewardConfig
from verl_core.algorithms.sft import SFTConfig
from verl_core.config import ConfigError, StrictConfig
from verl_core.data.dialogues import HoldoutPart
from verl_core.pipeline.launcher_config import LauncherConfig
from verl_core.preference_data import PreferenceDataConfig
from verl_core.rewards.model import RewardSourceConfig
from verl_core.rewards.rules import RuleName
from verl_core.rollout.contract import SamplingParams
from verl_core.rollout.registry import RolloutConfig

EXACT_MATCH = {"exact_match": 1.0}
_STAGE_LAUNCHER = "this stage's launcher; null = the pipeline's `launcher`"

PreferenceMethod = Literal["bundled", "sample_and_score"]
PolicyAlgorithm = Literal[("none", *ALGORITHMS)]  # type: ignore[valid-type]

# The embedded default's recipe, measured on the bundled arithmetic task (bench/online_rl.py):
# 900 SFT steps reach ~0.5 held-out exact match; the online recipe (128 episodes per rollout
# step, two epochs of two mini-batches) then adds +0.1 within 40-80 steps.
_ONLINE = dict(
    reward_rules=EXACT_MATCH,
    batch_size=128,
    mini_batch_size=64,
    ppo_epochs=2,
    learning_rate=1e-4,
    max_new_tokens=24,
    mixed_precision="auto",
    save_steps=5,
)
_GROUPS = dict(_ONLINE, max_steps=80, num_generations=4)
_OFFLINE = dict(max_steps=30, learning_rate=1e-5, save_steps=10)
RECIPE: dict[str, dict[str, Any]] = {
    "sft": dict(
        max_steps=900,
        batch_size=32,
        learning_rate=2e-3,
        lr_scheduler="constant",
        warmup_steps=20,
        logging_steps=50,
        save_steps=100,
        mixed_precision="auto",
    ),
    "reward_model": dict(
        max_steps=100, batch_size=16, learning_rate=1e-3, logging_steps=10, save_steps=20, mixed_precision="auto"
    ),
    "sample_and_score": dict(
        n_samples=4,
        sampling=SamplingParams(max_new_tokens=24),
        reward=RewardSourceConfig(reward_rules=EXACT_MATCH),
        tie_break="logprob",
        outputs=["pairs", "unpaired"],
        formats=["arrow"],
        progress=False,
    ),
    "dpo": dict(_OFFLINE, beta=0.5),
    "kto": dict(_OFFLINE, beta=0.5),
    "simpo": dict(_OFFLINE, simpo_gamma=0.5),
    "orpo": dict(_OFFLINE, learning_rate=3e-4),
    "ppo": dict(_ONLINE, max_steps=40),
    "grpo": _GROUPS,
    "rloo": _GROUPS,
    "reinforce_pp": _GROUPS,
    # 24 new tokens: answers take 13-17 with EOS, so the overlong penalty starts past 18
    "dapo": dict(_GROUPS, overlong_buffer=6),
    # rounds: each round samples 4 answers to 256 prompts from the current policy (exact match), then
    # trains on what it found: 30 DPO steps on best-vs-worst pairs, or 30 SFT steps on the best answers
    "iterative_dpo": dict(_OFFLINE, beta=0.5, rounds=3, prompts_per_round=256),
    "rft": dict(
        max_steps=30, batch_size=32, learning_rate=1e-4, lr_scheduler="constant", save_steps=10, rounds=3, prompts_per_round=256
    ),
}


class _Unresolved(StrictConfig):
    """Keeps host-dependent choices (``mixed_precision: auto``) as written: a pipeline config travels
    (a Prefect deployment stores it, a worker on another host runs it), so each host resolves them when
    its trainer config is built (``training.train_in_stage``); cache keys use the resolved value."""

    @model_validator(mode="after")
    def _resolve_precision(self):  # overrides TrainConfig's validator of the same name
        return self


def with_defaults(base: type[StrictConfig], name: str, defaults: dict[str, Any], doc: str | None = None) -> type:
    """``base`` with other defaults for some of its fields (constraints and descriptions kept), its
    host-dependent settings left unresolved (:class:`_Unresolved`)."""
    fields: dict[str, Any] = {}
    for key, value in defaults.items():
        if key not in base.model_fields:
            raise KeyError(f"{base.__name__} has no field {key!r}")  # a wrong recipe is a bug, not a user error
        info = base.model_fields[key]
        if isinstance(value, (dict, list, StrictConfig)):  # mutable: a fresh copy per instance
            new = FieldInfo.merge_field_infos(info, default_factory=lambda v=value: copy.deepcopy(v))
            new.default = PydanticUndefined  # merging keeps the base's default beside the factory
        else:
            new = FieldInfo.merge_field_infos(info, default=value)
            new.default_factory = None
        fields[key] = (info.annotation, new)
    model = create_model(name, __base__=(_Unresolved, base), __module__=__name__, **fields)
    model.__doc__ = doc or base.__doc__
    return model


CHAT_DESCRIPTION = (
    "render text rows as messages for the model's chat template (HH transcripts become their turns, "
    "a prompt string one user message)"
)
DROP_DESCRIPTION = "skip pairs with an empty or identical answer (a warning lists them) instead of failing on the first"

# The fields stages read; ``columns`` maps each to the user's column name (verl_core.data.columns).
RowField = Literal["prompt", "completion", "text", "messages", "chosen", "rejected", "ground_truth", "label"]


class Holdout(StrictConfig):
    """A deterministic train / held-out split by a hash of each row's prompt: held-out prompts never
    appear in training (:func:`verl_core.data.dialogues.holdout_part`)."""

    fraction: float = Field(gt=0, lt=1, description="share of prompts held out")
    part: HoldoutPart = Field(description="the part this source reads: train | held_out")
    seed: int = 0


class DataSource(StrictConfig):
    """Rows for a stage: a local file (JSONL/JSON/Parquet/CSV), a ``save_to_disk`` folder
    or a hub id; ``path: null`` means the bundled arithmetic task's split for that stage.
    A local file's content fingerprint is part of the stage's cache key.

    ``columns`` names the user's column for each field the stage reads (GSM8K:
    ``{prompt: question, completion: answer}``); ``prompt_template`` then builds the prompt
    from the row's columns (``"Question: {question}\nAnswer:"``)."""

    path: str | None = None
    split: str = "train"
    limit: int | None = Field(None, ge=1, description="use only the first N rows")
    columns: dict[RowField, str] = Field(default_factory=dict, description="field the stage reads -> your column")
    prompt_template: str | None = Field(None, description="str.format template over the row's columns, gives 'prompt'")
    chat: bool = Field(False, description=CHAT_DESCRIPTION)
    holdout: Holdout | None = Field(None, description="read one part of a split by prompt (applied before limit)")
    drop_unusable_pairs: bool = Field(False, description=DROP_DESCRIPTION)

    @model_validator(mode="after")
    def _mapping_needs_a_path(self):
        if (self.columns or self.prompt_template or self.holdout) and self.path is None:
            raise ValueError("columns / prompt_template / holdout apply to your data: set path too")
        return self


class _SFTStage(SFTConfig):
    """Supervised fine-tuning of the base model; skipped when ``model_path`` is given."""

    model_path: str | None = Field(None, description="an SFT policy folder to use instead of training one")
    data: DataSource = Field(default_factory=DataSource)
    launcher: LauncherConfig | None = Field(None, description=_STAGE_LAUNCHER)


SFTStageConfig = with_defaults(_SFTStage, "SFTStageConfig", RECIPE["sft"])
SampleAndScoreConfig = with_defaults(
    PreferenceDataConfig,
    "SampleAndScoreConfig",
    RECIPE["sample_and_score"],
    "Sampling and pairing for ``preference_data.method: sample_and_score``.",
)


# the preference_data keys that shape pairs the user gave (read as one DataSource; part of their fingerprint)
GIVEN_PAIRS_FIELDS = ("columns", "chat", "holdout", "limit", "drop_unusable_pairs")


class PreferenceDataStageConfig(StrictConfig):
    """Preference pairs (prompt, chosen, rejected); skipped when ``path`` is given.

    ``bundled``: the arithmetic task's pairs (correct answer chosen, a near miss
    rejected). ``sample_and_score``: sample ``n_samples`` completions per prompt from the
    SFT policy, score them (``sample_and_score.reward``: rules and/or a reward-model folder),
    pair best against worst (see :mod:`verl_core.preference_data`).
    """

    path: str | None = Field(None, description="pairs to use instead of generating them (file or folder)")
    columns: dict[RowField, str] = Field(default_factory=dict, description="the given pairs: field -> your column")
    chat: bool = Field(False, description="the given pairs: " + CHAT_DESCRIPTION)
    holdout: Holdout | None = Field(None, description="the given pairs: read one part of a split by prompt")
    limit: int | None = Field(None, ge=1, description="the given pairs: use only the first N (after holdout)")
    drop_unusable_pairs: bool = Field(False, description="the given pairs: " + DROP_DESCRIPTION)
    method: PreferenceMethod = "bundled"
    num_prompts: int = Field(512, ge=1)
    seed: int = 0
    prompts: DataSource = Field(default_factory=DataSource, description="sample_and_score: prompts (null path = bundled)")
    sample_and_score: SampleAndScoreConfig = Field(default_factory=lambda: SampleAndScoreConfig())


class _RewardModelStage(RewardConfig):
    """Bradley–Terry reward model on the preference pairs, initialised from the SFT policy."""

    enabled: bool = True
    model_path: str | None = Field(None, description="a reward-model folder to use instead of training one")
    init_from: Literal["sft", "base"] = "sft"
    eval_fraction: float = Field(0.1, ge=0, lt=1, description="last fraction of the pairs held out for accuracy")
    launcher: LauncherConfig | None = Field(None, description=_STAGE_LAUNCHER)


RewardModelStageConfig = with_defaults(_RewardModelStage, "RewardModelStageConfig", RECIPE["reward_model"])

# One sub-section class per registered algorithm: its trainer config with the recipe's defaults.
ALGORITHM_SECTIONS: dict[str, type] = {
    name: with_defaults(a.config_cls, f"{a.config_cls.__name__.removesuffix('Config')}StageConfig", RECIPE.get(name, {}))
    for name, a in ALGORITHMS.items()
}


def _policy_section() -> type:
    doc = """Policy optimisation of the SFT policy; ``algorithm: none`` keeps the SFT policy.

    Each algorithm has a sub-section named like it holding its trainer config
    (``policy_optimisation.dpo.beta``); only the chosen one enters the cache key.
    Offline algorithms train on the preference-data stage's pairs; online ones sample from
    ``prompts`` and score with their ``reward_rules`` (default exact match against the ground
    truth) plus, when ``use_reward_model``, the pipeline's reward model.
    """
    fields: dict[str, Any] = {
        "algorithm": (PolicyAlgorithm, Field("ppo", description=" | ".join(("none", *ALGORITHMS)))),
        "model_path": (str | None, Field(None, description="a policy folder to evaluate instead of training one")),
        "prompts": (DataSource, Field(default_factory=DataSource, description="prompts for online algorithms")),
        "use_reward_model": (bool, Field(False, description="online algorithms: add the reward-model stage's score")),
        "launcher": (LauncherConfig | None, Field(None, description=_STAGE_LAUNCHER)),
    }
    fields.update(
        {
            name: (cls, Field(default_factory=cls, description=ALGORITHMS[name].summary))
            for name, cls in ALGORITHM_SECTIONS.items()
        }
    )
    model = create_model("PolicyOptimisationStageConfig", __base__=StrictConfig, __module__=__name__, **fields)
    model.__doc__ = doc
    return model


PolicyOptimisationStageConfig = _policy_section()


class EvaluationStageConfig(StrictConfig):
    """Held-out accuracy under a rule reward (and reward-model score) of base, SFT and final policies.

    Rows without ``prompt`` but with ``chosen``/``rejected`` (Anthropic HH) are prompted with
    their shared dialogue prefix; with ``reward: null`` only the reward model scores them."""

    data: DataSource = Field(
        default_factory=DataSource, description="rows with 'prompt' and 'ground_truth' (or implicit-prompt pairs)"
    )
    num_rows: int = Field(200, ge=1)
    reward: RuleName | None = Field("exact_match", description="rule reward for accuracy; null: reward-model score only")
    max_new_tokens: int = Field(32, ge=1)
    max_prompt_length: int = Field(256, ge=1, description="a longer prompt is an error naming its row")
    include_base: bool = True
    implicit_reward_rows: int = Field(
        100,
        ge=0,
        description="held-out chosen/rejected rows for the implicit-reward accuracy of a policy trained on pairs"
        " and the reward model's own accuracy",
    )
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the engine of the greedy answers: hf | vllm")


class TrackingConfig(StrictConfig):
    """MLflow: the URI is this value, else ``$MLFLOW_TRACKING_URI``, else ``<workdir>/mlflow.db``."""

    uri: str | None = None
    experiment: str = "verl-core"
    ui_url: str | None = Field(
        None, description="MLflow UI base URL for links; default: the URI when http, else http://127.0.0.1:5000"
    )
    log_stage_models: bool = Field(
        True, description="log each stage's model folder as artifacts of its run (off for large models: tags keep the path)"
    )
    registered_model_name: str | None = Field(
        "verl-core-policy", description="register each evaluated policy here (alias 'champion' = best); null: off"
    )


class OrchestrationConfig(StrictConfig):
    """Prefect: where results (cache records) live, retries, cache refresh."""

    result_storage: str | None = Field(None, description="folder for Prefect results; default <workdir>/prefect-results")
    retries: int = Field(1, ge=0)
    retry_delay_seconds: float = Field(2.0, ge=0)
    refresh_cache: bool = False
    keep_checkpoints: bool = False
    busy_workdir: Literal["wait", "fail"] = Field(
        "wait", description="when another run holds the workdir (or a stage folder): wait for it, or fail at once"
    )
    busy_wait_seconds: float = Field(3600.0, gt=0, description="how long to wait before failing")


class PipelineConfig(StrictConfig):
    """Everything one run of the RLHF pipeline needs."""

    name: str = "rlhf"
    base_model: str | None = Field(None, description="folder, or hub id as hf://org/name; null = the embedded tiny model")
    workdir: str = Field("runs", description="stage outputs, Prefect results and the default MLflow store")
    sft: SFTStageConfig = Field(default_factory=SFTStageConfig)
    preference_data: PreferenceDataStageConfig = Field(default_factory=PreferenceDataStageConfig)
    reward_model: RewardModelStageConfig = Field(default_factory=RewardModelStageConfig)
    policy_optimisation: PolicyOptimisationStageConfig = Field(default_factory=PolicyOptimisationStageConfig)
    evaluation: EvaluationStageConfig = Field(default_factory=EvaluationStageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    launcher: LauncherConfig = Field(default_factory=LauncherConfig, description="where training stages run (default)")

    @model_validator(mode="after")
    def _async_rollout_launcher(self):
        """Rollout workers (``async_rollout``) serve one training process: local processes, or Ray actors under Ray."""
        po = self.policy_optimisation
        settings = self.async_rollout_settings()
        launcher = po.launcher or self.launcher
        if settings is not None and launcher.world_size > 1:
            raise ValueError(
                f"policy_optimisation.{po.algorithm}.async_rollout.max_staleness > 0 with launcher.kind "
                f"{launcher.kind!r} and {launcher.world_size} process(es): rollout workers serve one training "
                "process; use launcher.num_processes: 1 or async_rollout.max_staleness: 0"
            )
        return self

    def async_rollout_settings(self):
        """The policy-optimisation algorithm's ``async_rollout`` when it is on (max_staleness > 0), else None."""
        po = self.policy_optimisation
        settings = getattr(getattr(po, po.algorithm, None), "async_rollout", None)
        return settings if settings is not None and settings.enabled else None

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
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return out
