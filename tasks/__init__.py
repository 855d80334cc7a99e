"""Prefect tasks: one task, parametrised by the pipeline step it runs (see ``tasks.stage_task``)."""

from tasks.prefect_settings import apply_defaults

apply_defaults()  # before the first import of Prefect (tasks.stage_task imports it)

from tasks.stage_task import execute, stage_task, task_for  # noqa: E402

__all__ = ["execute", "stage_task", "task_for"]
