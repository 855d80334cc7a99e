"""Prefect tasks: one per pipeline stage (see ``tasks.stage_tasks``)."""
from tasks.stage_tasks import (
    TASKS,
    evaluation_task,
    policy_optimisation_task,
    preference_data_task,
    reward_model_task,
    sft_task,
)

__all__ = ["TASKS", "evaluation_task", "policy_optimisation_task", "preference_data_task", "reward_model_task", "sft_task"]
