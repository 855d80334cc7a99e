"""The pipeline layer: Prefect-free stage logic over the kernel.

The pipeline config (:mod:`.config`), stage records and the step registry (:mod:`.records`,
:mod:`.registry`), cache keys (:mod:`.keys`), one module per step (:mod:`.sft`,
:mod:`.preference_data`, :mod:`.reward_model`, :mod:`.policy_optimisation`,
:mod:`.evaluation`), :func:`~.runner.run_stage`, MLflow tracking of pipeline runs
(:mod:`.tracking`) and the report (:mod:`.report`). ``tasks/`` and ``flows/`` wrap it in Prefect;
the kernel (the rest of ``verl_core``) never imports it.

    from verl_core.pipeline import load_pipeline_config, run_stage
    cfg = load_pipeline_config("configs/default.yaml", ["workdir=/tmp/w"])
    pairs = run_stage(cfg, "preference_data", {}).record
"""

from verl_core.pipeline.config import PipelineConfig, load_pipeline_config
from verl_core.pipeline.records import StageRecord
from verl_core.pipeline.registry import STAGE_ORDER, STAGES, STEPS, given_record, stage_enabled, stage_for
from verl_core.pipeline.runner import run_stage

__all__ = [
    "STAGES",
    "STAGE_ORDER",
    "STEPS",
    "PipelineConfig",
    "StageRecord",
    "given_record",
    "load_pipeline_config",
    "run_stage",
    "stage_enabled",
    "stage_for",
]
