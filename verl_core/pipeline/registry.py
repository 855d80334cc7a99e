"""The pipeline's steps, in order, and the stages that compute them: the one list the Prefect
task, the stage flow, the CLI's choices and the cache keys are derived from.

Adding a step = a module with its ``STEP`` and one entry in :data:`STEPS`; adding a variant of a
step (a new algorithm) = one entry in that step's registry (for algorithms:
:data:`verl_core.algorithms.registry.ALGORITHMS`).
"""

from __future__ import annotations

import hashlib
import json

from verl_core.config import ConfigError
from verl_core.data.fingerprint import fingerprint_path
from verl_core.pipeline import evaluation, policy_optimisation, preference_data, reward_model, sft
from verl_core.pipeline.config import GIVEN_PAIRS_FIELDS, PipelineConfig
from verl_core.pipeline.records import Stage, StageRecord, Step

STEPS: dict[str, Step] = {
    s.name: s
    for s in (
        sft.STEP,  # base model + SFT data -> SFT policy   (given: sft.model_path)
        preference_data.STEP,  # prompts -> (prompt, chosen, rejected) (given: preference_data.path)
        reward_model.STEP,  # pairs -> Bradley-Terry reward model   (given: reward_model.model_path)
        policy_optimisation.STEP,  # SFT policy -> final policy            (policy_optimisation.algorithm)
        evaluation.STEP,  # final vs SFT policy; register the final policy
    )
}
STAGE_ORDER: tuple[str, ...] = tuple(STEPS)
STAGES: dict[str, Stage] = {stage.name: stage for step in STEPS.values() for stage in step.stages}


def variant_of(config: PipelineConfig, name: str) -> str | None:
    selector = STEPS[name].selector if name in STEPS else None
    return getattr(getattr(config, name), selector) if selector else None


def stage_for(config: PipelineConfig, name: str) -> Stage:
    """The stage that computes step ``name`` under ``config`` (its selected variant)."""
    variant = variant_of(config, name)
    key = f"{name}:{variant}" if variant else name
    if key not in STAGES:
        raise ConfigError(f"no stage registered for {key!r}; registered: {sorted(STAGES)}")
    return STAGES[key]


def stage_enabled(config: PipelineConfig, name: str) -> bool:
    """Whether the pipeline has this step at all (computed or given)."""
    return STEPS[name].enabled(config)


def base_model_record(config: PipelineConfig) -> StageRecord:
    """The base model as a record: the configured folder/hub id, or the embedded tiny model."""
    from verl_core.bundled.tiny_model import tiny_model_path

    path = config.base_model or str(tiny_model_path())
    return StageRecord(stage="base", output_path=str(path), fingerprint=fingerprint_path(path), given=True)


def given_record(config: PipelineConfig, name: str) -> StageRecord | None:
    """A record for a step output named in the config (the step is then skipped)."""
    if name == "base":
        return base_model_record(config)
    field = STEPS[name].given_field if name in STEPS else None
    path = getattr(getattr(config, name), field) if field else None
    if path is None:
        return None
    fingerprint = fingerprint_path(path)
    section = getattr(config, name)
    shape = {k: getattr(section, k, None) for k in GIVEN_PAIRS_FIELDS}
    if any(shape.values()):  # the same file read through another mapping, part or length is other data
        shape = {k: v.model_dump() if hasattr(v, "model_dump") else v for k, v in shape.items() if v}
        fingerprint = hashlib.sha256(f"{fingerprint}:{json.dumps(shape, sort_keys=True)}".encode()).hexdigest()
    return StageRecord(stage=name, output_path=str(path), fingerprint=fingerprint, given=True)
