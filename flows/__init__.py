"""Prefect flows: ``rlhf_pipeline`` and one flow per stage."""
from flows.pipeline import (
    STAGE_FLOWS,
    PipelineResult,
    evaluation_flow,
    policy_optimisation_flow,
    preference_data_flow,
    reward_model_flow,
    rlhf_pipeline,
    run_pipeline,
    sft_flow,
)

__all__ = ["STAGE_FLOWS", "PipelineResult", "evaluation_flow", "policy_optimisation_flow", "preference_data_flow",
           "reward_model_flow", "rlhf_pipeline", "run_pipeline", "sft_flow"]
