"""Prefect flows: ``rlhf_pipeline`` and ``stage_flow`` (one step and what it needs); the CLI."""

import tasks  # noqa: F401, I001  (first: applies the Prefect settings defaults before Prefect is imported)
from flows.pipeline import PipelineResult, rlhf_pipeline, rlhf_pipeline_form, run_pipeline, stage_flow

__all__ = ["PipelineResult", "rlhf_pipeline", "rlhf_pipeline_form", "run_pipeline", "stage_flow"]
