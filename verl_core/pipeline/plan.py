"""A stage run resolved once: which stage computes it, its inputs, its cache key and its output folder.

The Prefect task (``tasks/stage_task.py``) resolves a :class:`StagePlan` with :func:`plan_stage` and
passes it down: :func:`~verl_core.pipeline.launch.run_stage_launched` and
:func:`~verl_core.pipeline.runner.run_planned` take it as it is, and a launched job reads the same
plan back from its request file (:meth:`StagePlan.to_request` / :meth:`StagePlan.from_request`), so
nothing below the task computes the key or looks the stage up again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verl_core.config import ConfigError
from verl_core.pipeline.config import PipelineConfig
from verl_core.pipeline.keys import stage_dir, stage_key
from verl_core.pipeline.records import PREVIOUS_ROUND, Stage, StageRecord
from verl_core.pipeline.registry import STAGES, stage_for, variant_of

Inputs = dict[str, StageRecord | None]


@dataclass(frozen=True)
class StagePlan:
    config: PipelineConfig
    name: str  # the pipeline step (``policy_optimisation``), whose selected variant is ``stage``
    stage: Stage
    variant: str | None
    inputs: Inputs
    key: str
    out_dir: Path
    round: int | None = None

    def to_request(self) -> dict:
        """The plan as JSON, for a launched job's request file."""
        return {
            "config": self.config.model_dump(mode="json"),
            "step": self.name,
            "stage": self.stage.name,
            "variant": self.variant,
            "inputs": {k: (v.model_dump(mode="json") if v is not None else None) for k, v in self.inputs.items()},
            "key": self.key,
            "out_dir": str(self.out_dir),
            "round": self.round,
        }

    @classmethod
    def from_request(cls, request: dict) -> StagePlan:
        """The plan a launcher wrote, as it was resolved (the key and folder are read, not recomputed)."""
        config = PipelineConfig.from_dict(request["config"], source="the launch request")
        variant = request["variant"]
        stage = STAGES[f"{request['step']}:{variant}" if variant else request["step"]]
        inputs = {k: (StageRecord.model_validate(v) if v is not None else None) for k, v in request["inputs"].items()}
        return cls(config, request["step"], stage, variant, inputs, request["key"], Path(request["out_dir"]), request["round"])


def plan_stage(config: PipelineConfig, name: str, inputs: Inputs, round: int | None = None) -> StagePlan:
    """Resolve step ``name`` (round ``round`` of it) once: its stage, its inputs checked, its key and folder."""
    stage = stage_for(config, name)
    for needed in stage.input_names(config):
        if inputs.get(needed) is None:
            raise ConfigError(f"stage {name!r} needs the output of {needed!r}")
    if (round is not None) != (stage.rounds is not None):
        raise ConfigError(f"stage {stage.name!r} " + ("runs in rounds: give round=" if round is None else "has no rounds"))
    if round is not None and round > 1 and inputs.get(PREVIOUS_ROUND) is None:
        raise ConfigError(f"round {round} of {stage.name!r} needs the record of round {round - 1}")
    variant = variant_of(config, name)
    key = stage_key(config, stage, inputs, round)
    return StagePlan(config, name, stage, variant, inputs, key, stage_dir(config, name, variant, key, round), round)
