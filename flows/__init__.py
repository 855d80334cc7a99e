"""Prefect flows: ``rlhf_pipeline`` and ``stage_flow`` (one step and what it needs); the CLI."""

from flows.pipeline import PipelineResult, rlhf_pipeline, run_pipeline, stage_flow

__all__ = ["PipelineResult", "rlhf_pipeline", "run_pipeline", "stage_flow"]
