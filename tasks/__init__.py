"""Prefect tasks: one task, parametrised by the pipeline step it runs (see ``tasks.stage_task``)."""

from tasks.stage_task import execute, stage_task, task_for

__all__ = ["execute", "stage_task", "task_for"]
